"""Read the I/O contract of an export directory, or of a model one format reads on its own (a
``.onnx`` file, a SavedModel, a Triton model, a TF Serving base path): each format finds and reads
its own files (:meth:`exporter.formats.base.Format.find_model` and ``read_contract``); this module
only asks them, in their ``inspect_order``."""

from __future__ import annotations

import json
from pathlib import Path

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
