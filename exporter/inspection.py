"""Read the I/O contract of an export directory, or of a model one format reads on its own (a
``.onnx`` file, a SavedModel, a Triton model, a TF Serving base path): each format finds and reads
its own files (:meth:`exporter.formats.base.Format.find_model` and ``read_contract``); this module
only asks them, in their ``inspect_order``."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.exporter import formats, manifest
from policy_export.exporter.formats.base import Format
from policy_export.errors import ExportError
from policy_export.signatures.contract import Contract


def _readers(layouts_only: bool = False) -> list[Format]:
    found = [f for f in formats.all_formats() if f.inspect_order is not None
             and (f.serving_layout or not layouts_only)]
    return sorted(found, key=lambda f: f.inspect_order)


def find_model(path: str | Path) -> tuple[Format, Path] | None:
    """The format whose model ``path`` holds and where (see :meth:`Format.find_model`); a serving
    layout is also found one directory down when it is the only model there. ``None`` for an
    export directory or a path no format reads.

    Raises:
        ExportError: a directory holding several served models (name one).
    """
    path = Path(path)
    if path.is_dir() and (path / manifest.MANIFEST).is_file():
        return None
    for fmt in _readers():
        where = fmt.find_model(path)
        if where is not None:
            return fmt, where
    if not path.is_dir():
        return None
    found = []
    for inner in sorted(path.iterdir()):
        if inner.is_dir() and not inner.is_symlink():
            hit = next(((f, w) for f in _readers(layouts_only=True) if (w := f.find_model(inner)) is not None), None)
            if hit is not None:
                found.append((inner, hit))
    if len(found) > 1:
        raise ExportError(f"{path} holds {len(found)} served models ({', '.join(p.name for p, _ in found)}); "
                          f"name one, e.g. {found[0][0]}")
    return found[0][1] if found else None


def serving_layout(path: Path) -> tuple[str, Path] | None:
    """``(format name, model path)`` when ``path`` is a serving layout (a Triton model, a TF Serving
    base path, or a directory holding exactly one of those), else ``None``."""
    hit = find_model(path)
    return (hit[0].name, hit[1]) if hit is not None and hit[0].serving_layout else None


def contract_of(path: str | Path, signature_key: str = "serving_default", tag: str = "serve") -> tuple[str, Contract]:
    """``(kind, contract)`` of ``path``: kind is ``export`` or the name of the format whose model it
    holds (``onnx``, ``saved_model``, ``triton``: the interface its ``config.pbtxt`` serves,
    ``tf_serving``: its newest version's SavedModel).

    Raises:
        ExportError: ``path`` is none of those, or fails its format's checks.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise ExportError(f"{path}: no such file or directory")
    hit = find_model(path)
    if hit is not None:
        fmt, where = hit
        return fmt.name, fmt.read_contract(where, signature_key, tag)
    if path.is_dir() and (path / manifest.MANIFEST).is_file():
        return "export", Contract.from_json(manifest.read_manifest(path)["contract"])
    raise ExportError(f"{path} is not an export directory, a .onnx file, a SavedModel directory, a Triton model "
                      "or a TF Serving base path")


def contract_json(kind: str, path: Path, contract: Contract) -> str:
    return json.dumps({"path": str(path), "kind": kind, **contract.to_json()}, indent=2)


_BOX_REPR = re.compile(r"Box\([^()]*?, (\((?:\d+, )*\d*,?\)), (\w+)\)")


def brief_spaces(text: str) -> str:
    """``text`` with every gymnasium ``Box`` repr (its bounds in numpy's padded print) shortened as
    :func:`policy.spaces.space_text` writes a Box: ``Box(4,)``, ``Box(84, 84, 3) uint8``; for a
    table, whose ``--json`` keeps the bounds."""
    return _BOX_REPR.sub(lambda m: f"Box{m.group(1)}{'' if m.group(2) == 'float32' else ' ' + m.group(2)}", text)


# ----------------------------------------------------------------------------- the weights a path holds

WEIGHT_FORMS = {"tf_variables": "the SavedModels' variables", "onnx": "the ONNX models' initializers"}


@dataclass(frozen=True)
class Weights:
    """The weights of a model in one form (``tf_variables``: a SavedModel's variable files;
    ``onnx``: an ONNX model's initializers): ``digest`` over every one (names and values), and how
    many there are."""

    form: str
    digest: str
    count: int


def _variables(saved_model: Path) -> Weights | None:
    """A SavedModel's ``variables/`` files, each by name and sha256 (``None`` without any)."""
    folder = saved_model / "variables"
    if not folder.is_dir() or folder.is_symlink():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{manifest.sha256(f)}\n".encode())
    return Weights("tf_variables", digest.hexdigest(), len(files))


def _initializers(model_file: Path) -> Weights:
    """An ONNX model's initializers, each by name, type, shape and bytes; read through the ONNX
    door (:func:`exporter.formats.onnx.trust.load_checked`)."""
    from policy_export.exporter.formats.onnx.trust import load_checked

    model = load_checked(model_file)
    digest, count = hashlib.sha256(), 0
    for tensor in sorted(model.graph.initializer, key=lambda t: t.name):
        copy = type(tensor)()
        copy.CopyFrom(tensor)
        copy.ClearField("doc_string")
        digest.update(copy.SerializeToString(deterministic=True))
        count += 1
    return Weights("onnx", digest.hexdigest(), count)


def weight_forms(path: str | Path) -> dict[str, Any]:
    """The forms in which the weights of ``path`` can be compared (see :class:`Weights`), each a
    function of no argument returning them: an export (its SavedModel's variables; its
    ``model.onnx``'s initializers), a SavedModel, a ``.onnx`` file, a TF Serving base path (its
    newest version), a Triton model (its newest version's ``model.onnx``)."""
    path = Path(path)
    forms: dict[str, Any] = {}
    if path.is_file() and path.suffix == ".onnx":
        forms["onnx"] = lambda: _initializers(path)
        return forms
    if not path.is_dir():
        return forms
    if (path / manifest.MANIFEST).is_file():
        roots = [path / "saved_model"]
        if (path / "model.onnx").is_file():
            forms["onnx"] = lambda: _initializers(path / "model.onnx")
    else:
        hit = find_model(path)
        where = hit[1] if hit is not None else path
        roots = [where]
        versions = sorted((d for d in where.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)) \
            if where.is_dir() else []
        if versions and (versions[-1] / "model.onnx").is_file():
            forms["onnx"] = lambda: _initializers(versions[-1] / "model.onnx")
    for root in roots:
        if (root / "saved_model.pb").is_file() and (root / "variables").is_dir():
            forms = {"tf_variables": lambda root=root: _variables(root), **forms}
    return forms


def compare_weights(old: str | Path, new: str | Path) -> dict[str, Any]:
    """Whether ``old`` and ``new`` hold the same weights, compared in the first form both have
    (the variables of their SavedModels, else their ONNX initializers): ``{"compared": form,
    "same": bool}``, or ``{"compared": None}`` when they share no form (an export and a Triton
    model holding only a SavedModel, say)."""
    from policy_export.errors import PolicyExportError

    a, b = weight_forms(old), weight_forms(new)
    for form in ("tf_variables", "onnx"):
        if form in a and form in b:
            try:
                left, right = a[form](), b[form]()
            except (PolicyExportError, OSError) as e:  # a model whose contract reads but whose weights do not
                return {"compared": None, "problem": " ".join(str(e).split())[:300]}
            if left is not None and right is not None:
                return {"compared": form, "same": left.digest == right.digest, "count": [left.count, right.count]}
    return {"compared": None}


def weights_line(compared: dict[str, Any]) -> str:
    """What :func:`compare_weights` found, for a person."""
    form = compared.get("compared")
    if form is None:
        why = compared.get("problem") or "the two hold no weights in the same form"
        return f"weights: not compared ({why})"
    what = WEIGHT_FORMS.get(form, form)
    return f"weights: the same ({what})" if compared["same"] else f"weights: differ ({what} differ)"


# ----------------------------------------------------------------------------- the API of inspect and diff

def inspect_path(path: str | Path, signature_key: str = "serving_default", tag: str = "serve") -> dict[str, Any]:
    """What ``policy-export inspect PATH --json`` prints, as data: a source that shows itself (an
    RLlib checkpoint, a Stable-Baselines3 zip) as its reader describes it, anything else (an
    export, an ONNX file, a SavedModel, a Triton model, a TF Serving base path) as its kind and
    contract (``{"path", "kind", "signature_key", "inputs", "outputs", ...}``).

    Raises:
        ExportError, InputError: ``path`` is none of those, or fails its checks.
    """
    from policy_export.exporter import sources

    path = Path(path)
    source = next((s for s in sources.all_sources() if s.shows_itself and s.detect(path)), None)
    if source is not None:
        return source.inspect(source.open(path, {})).json
    kind, contract = contract_of(path, signature_key, tag)
    return json.loads(contract_json(kind, path, contract))


def diff_exports(old: str | Path, new: str | Path, signature_key: str = "serving_default",
                 tag: str = "serve") -> dict[str, Any]:
    """What ``policy-export diff OLD NEW --json`` prints, as data: ``compatible`` (no breaking
    change to the interface), the ``changes`` of every input and output, and ``weights`` (whether
    the two hold the same weights, from :func:`compare_weights`). Each side is anything
    :func:`contract_of` reads."""
    from policy_export.signatures.diff import diff_contracts

    (_, before), (_, after) = contract_of(old, signature_key, tag), contract_of(new, signature_key, tag)
    return {**diff_contracts(before, after).to_json(), "weights": compare_weights(old, new)}
