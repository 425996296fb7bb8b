"""Where the ``tf_serving`` format puts things, its ``models.config``, and the servability checks.

::

    tf_serving/
      models.config                       ModelServerConfig (text proto): the model, its base path, its version
      <model_name>/                       the model's base path (mounted at /models/<model_name>)
        <model_version>/                  the SavedModel TF Serving loads: saved_model.pb, variables/
        requests/                         golden requests and responses (a non-numeric directory: TF Serving ignores it)

TF Serving treats every child of a base path whose name parses as an integer as a version of the
model and skips every other child, so the ``requests/`` directory beside the version never becomes
a version, and the version directory holds the SavedModel alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from policy_export.errors import ExportError

CONFIG_FILE = "models.config"
REQUESTS_DIR = "requests"
CONTAINER_MODELS = "/models"  # the tensorflow/serving image serves $MODEL_BASE_PATH/$MODEL_NAME, /models/<name>
MODEL_PLATFORM = "tensorflow"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_VERSION = 2**63 - 1
SAVED_MODEL_ENTRIES = frozenset({"saved_model.pb", "variables"})


@dataclass(frozen=True)
class Layout:
    """The paths of one model in a ``tf_serving/`` directory ``root``."""

    root: Path
    name: str
    version: int

    @classmethod
    def of(cls, root: Path, name, version) -> "Layout":
        """The layout of model ``name`` at ``version`` under ``root``.

        Raises:
            ExportError: the name or version cannot name a model on TF Serving (or a directory).
        """
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ExportError(f"tf_serving: model name {name!r} is not a legal model name (1-128 letters, digits, "
                              "'_', '.' or '-', starting with a letter or digit)")
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
            raise ExportError(f"tf_serving: model version {version!r} is not an integer from 1 to {MAX_VERSION}")
        return cls(Path(root), name, version)

    @property
    def base(self) -> Path:
        return self.root / self.name

    @property
    def version_dir(self) -> Path:
        return self.base / str(self.version)

    @property
    def requests(self) -> Path:
        return self.base / REQUESTS_DIR

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def container_base_path(self) -> str:
        """The base path ``models.config`` names: where a container mounts ``<root>/<name>``."""
        return f"{CONTAINER_MODELS}/{self.name}"


def model_config_text(name: str, base_path: str, version: int) -> str:
    """A ``tensorflow.serving.ModelServerConfig`` in protobuf text format serving ``version`` of
    model ``name`` from ``base_path``: exactly what ``text_format.MessageToString`` prints for it
    (the name and path hold no character that text format escapes)."""
    return (
        "model_config_list {\n"
        "  config {\n"
        f"    name: \"{name}\"\n"
        f"    base_path: \"{base_path}\"\n"
        f"    model_platform: \"{MODEL_PLATFORM}\"\n"
        "    model_version_policy {\n"
        "      specific {\n"
        f"        versions: {version}\n"
        "      }\n"
        "    }\n"
        "  }\n"
        "}\n"
    )


def write_model_config(layout: Layout) -> Path:
    """Write ``models.config`` for ``layout`` (base path: the container convention)."""
    layout.config.write_text(model_config_text(layout.name, layout.container_base_path, layout.version),
                             encoding="utf-8")
    return layout.config


def check_version_dir(layout: Layout) -> None:
    """Raises ExportError unless the version directory holds a SavedModel and nothing else."""
    entries = {p.name for p in layout.version_dir.iterdir()} if layout.version_dir.is_dir() else set()
    if "saved_model.pb" not in entries or entries - SAVED_MODEL_ENTRIES:
        raise ExportError(f"tf_serving: {layout.version_dir} must hold a SavedModel alone "
                          f"(saved_model.pb, variables/); it holds {sorted(entries)}")


def is_valid_signature():
    """TensorFlow's own check that TF Serving can serve a SignatureDef (classify, regress or predict)."""
    import tensorflow as tf

    check = getattr(tf.compat.v1.saved_model, "is_valid_signature", None)
    if check is None:  # pragma: no cover - the public v1 name is there in every supported TensorFlow
        from tensorflow.python.saved_model.signature_def_utils_impl import is_valid_signature as check
    return check


def check_servable(saved_model_dir: Path) -> list[str]:
    """The servable signature keys of the SavedModel at ``saved_model_dir`` (every one must be).

    Keys starting with ``__`` (TensorFlow's own, such as ``__saved_model_init_op``) are not served
    and are left out.

    Raises:
        ExportError: a signature fails TensorFlow's servability check (it is named), or there is
            no signature at all.
    """
    from policy_export.exporter.trust import read_saved_model

    check = is_valid_signature()
    keys: list[str] = []
    for meta in read_saved_model(saved_model_dir).meta_graphs:
        for key, sig in sorted(meta.signature_def.items()):
            if key.startswith("__"):
                continue
            if not check(sig):
                raise ExportError(f"tf_serving: signature {key!r} of {saved_model_dir} cannot be served by TF "
                                  f"Serving (method {sig.method_name!r}, {len(sig.inputs)} inputs, "
                                  f"{len(sig.outputs)} outputs; a predict signature needs inputs and outputs)")
            keys.append(key)
    if not keys:
        raise ExportError(f"tf_serving: {saved_model_dir} has no signature TF Serving could serve")
    return sorted(set(keys))


def add_signature_defaults(saved_model_dir: Path, contract) -> dict[str, dict]:
    """Give every signature of the SavedModel at ``saved_model_dir`` ``defaults`` for its optional
    inputs (the contract's), so that TF Serving accepts a request feeding the required inputs
    alone: its predict path refuses a request with fewer inputs than the signature unless the
    SignatureDef lists defaults, and then feeds them (``saved_model::GetInputValues``). They are
    the values the graph's ``PlaceholderWithDefault`` ops hold, so the outputs are the same.
    Returns signature key -> input -> default, as written.
    """
    import numpy as np
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    path = saved_model_dir / "saved_model.pb"
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString(path.read_bytes())  # written by this export a moment ago
    optional = {s.key: s for s in contract.inputs if not s.required}
    written: dict[str, dict] = {}
    for meta in proto.meta_graphs:
        for key, sig in meta.signature_def.items():
            for name in sig.inputs:
                spec = optional.get(name)
                if spec is not None:
                    value = np.asarray(spec.default, np.dtype(spec.dtype))
                    sig.defaults[name].CopyFrom(tf.make_tensor_proto(value))
                    written.setdefault(key, {})[name] = value.tolist()
    path.write_bytes(proto.SerializeToString())
    return written


def files_under(root: Path, top: Path) -> list[str]:
    """Every regular file below ``top``, relative to ``root``, as POSIX paths (sorted)."""
    return sorted(p.relative_to(root).as_posix() for p in top.rglob("*") if p.is_file() and not p.is_symlink())


_VERSION = re.compile(r"[0-9]{1,19}")  # TF Serving's versions: ASCII 64-bit integers


def _is_version(p: Path) -> bool:
    return (_VERSION.fullmatch(p.name) is not None and int(p.name) <= MAX_VERSION
            and p.is_dir() and not p.is_symlink())


def newest_version(base: Path) -> Path | None:
    """The version directory TF Serving serves from the model base path ``base`` (the highest
    version holding a SavedModel), or ``None`` when ``base`` has none."""
    versions = sorted((p for p in base.iterdir() if _is_version(p) and (p / "saved_model.pb").is_file()),
                      key=lambda p: int(p.name))
    return versions[-1] if versions else None
