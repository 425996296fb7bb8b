"""Read the I/O contract of an export directory, a bare ONNX file, or a SavedModel directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from policy_export.exporter import manifest
from policy_export.errors import ExportError
from policy_export.signatures.contract import Contract, TensorSpec, json_default


def contract_of(path: str | Path, signature_key: str = "serving_default", tag: str = "serve") -> tuple[str, Contract]:
    """``(kind, contract)`` of ``path``: kind is ``export``, ``onnx``, ``saved_model``, ``triton``
    (a Triton model directory, or a repository holding one model: the interface its
    ``config.pbtxt`` serves) or ``tf_serving`` (a TF Serving model base path: its newest version's
    SavedModel; or a ``tf_serving/`` directory holding one base path).

    Raises:
        ExportError: ``path`` is none of those, or fails its format's checks.
    """
    path = Path(path)
    layout = serving_layout(path)
    if layout is not None:
        kind, where = layout
        if kind == "triton":
            return kind, triton_contract(where)
        return kind, saved_model_contract(where, signature_key, tag)
    if path.is_dir() and (path / manifest.MANIFEST).is_file():
        return "export", Contract.from_json(manifest.read_manifest(path)["contract"])
    if path.is_file() and path.suffix == ".onnx":
        return "onnx", onnx_contract(path)
    if path.is_dir() and (path / "saved_model.pb").is_file():
        return "saved_model", saved_model_contract(path, signature_key, tag)
    raise ExportError(f"{path} is not an export directory, a .onnx file or a SavedModel directory")


CONFIG_LIMIT = 1 << 20  # bytes of a config.pbtxt read
_TRITON_NUMPY = {"TYPE_FP32": "float32", "TYPE_FP64": "float64", "TYPE_FP16": "float16", "TYPE_INT64": "int64",
                 "TYPE_INT32": "int32", "TYPE_INT16": "int16", "TYPE_INT8": "int8", "TYPE_UINT8": "uint8",
                 "TYPE_UINT16": "uint16", "TYPE_UINT32": "uint32", "TYPE_UINT64": "uint64", "TYPE_BOOL": "bool"}


_VERSION = re.compile(r"[0-9]{1,19}")  # TF Serving's versions: ASCII 64-bit integers
MAX_VERSION = 2**63 - 1


def _is_version(p: Path) -> bool:
    return (_VERSION.fullmatch(p.name) is not None and int(p.name) <= MAX_VERSION
            and p.is_dir() and not p.is_symlink())


def serving_layout(path: Path) -> tuple[str, Path] | None:
    """``("triton", model_dir)`` or ``("tf_serving", version_dir)`` when ``path`` is one of those
    layouts (a directory holding exactly one model of it counts), else ``None``.

    Raises:
        ExportError: a layout holding several models (name one) or no version.
    """
    if not path.is_dir() or (path / manifest.MANIFEST).is_file():
        return None
    if (path / "config.pbtxt").is_file():
        return "triton", path
    versions = sorted((p for p in path.iterdir() if _is_version(p) and (p / "saved_model.pb").is_file()),
                      key=lambda p: int(p.name))
    if versions:
        return "tf_serving", versions[-1]
    inner = [p for p in sorted(path.iterdir()) if p.is_dir() and not p.is_symlink()]
    found = [(p, layout) for p in inner if (layout := _one_level(p)) is not None]
    if len(found) > 1:
        raise ExportError(f"{path} holds {len(found)} served models ({', '.join(p.name for p, _ in found)}); "
                          f"name one, e.g. {found[0][0]}")
    return found[0][1] if found else None


def _one_level(path: Path) -> tuple[str, Path] | None:
    if (path / "config.pbtxt").is_file():
        return "triton", path
    versions = sorted((p for p in path.iterdir() if _is_version(p) and (p / "saved_model.pb").is_file()),
                      key=lambda p: int(p.name))
    return ("tf_serving", versions[-1]) if versions else None


def triton_contract(model_dir: Path) -> Contract:
    """The interface a Triton model serves, read from its ``config.pbtxt`` with Triton's own schema:
    each input and output with the batch dimension (``None``) first when the model batches, the
    ``reshape`` a client's tensor takes; optional inputs are not required (their default is the
    model's own). Implicit state and sequence controls are not a client's tensors and are left out.

    Raises:
        ExportError: tritonclient is not installed, or the file is not a valid ModelConfig.
    """
    from policy_export.policy.files import read_regular

    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise ExportError(f"reading {model_dir / 'config.pbtxt'} needs Triton's schema: pip install "
                          f"'policy-export[serving]' ({e})") from e
    try:
        raw = read_regular(model_dir / "config.pbtxt", CONFIG_LIMIT)
    except OSError as e:  # a symbolic link (ELOOP), a file that cannot be opened
        raise ExportError(f"{model_dir / 'config.pbtxt'} cannot be read as a regular file "
                          f"(links are not followed): {e.strerror}") from e
    try:
        config = text_format.Parse(raw.decode("utf-8"), model_config_pb2.ModelConfig())
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise ExportError(f"{model_dir / 'config.pbtxt'} is not a valid Triton ModelConfig: {e}") from e
    pb = model_config_pb2

    def spec(io, optional: bool = False) -> TensorSpec:
        value = pb.DataType.DESCRIPTOR.values_by_number.get(io.data_type)
        name = value.name if value is not None else str(io.data_type)
        if name not in _TRITON_NUMPY:
            raise ExportError(f"{model_dir / 'config.pbtxt'}: {io.name!r} has data type {name}, which has no numpy dtype")
        dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
        shape = ((None,) if config.max_batch_size > 0 else ()) + tuple(None if d < 0 else int(d) for d in dims)
        return TensorSpec(io.name, _TRITON_NUMPY[name], shape, required=not optional)

    return Contract(inputs=tuple(spec(i, i.optional) for i in config.input),
                    outputs=tuple(spec(o) for o in config.output), method="triton", signature_key=config.name)


def onnx_contract(path: Path) -> Contract:
    """The contract in an ONNX model's metadata, else one read from its graph.

    The model is checked with ``onnx.checker`` first; a file that is not ONNX is an error.
    """
    from policy_export.exporter.compat import import_onnx

    onnx = import_onnx()
    from onnx import numpy_helper

    from policy_export.exporter.formats.onnx.model import contract_from_model

    try:
        onnx.checker.check_model(str(path))
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError, ValidationError, OSError...
        raise ExportError(f"{path} is not a valid ONNX model: {e}") from e
    try:
        stored = contract_from_model(model)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ExportError(f"{path}: the contract in its metadata is not valid: {type(e).__name__}: {e}") from e
    if stored is not None:
        return stored
    initializers = {i.name: i for i in model.graph.initializer}

    def spec(value_info, is_input: bool) -> TensorSpec:
        if value_info.type.WhichOneof("value") != "tensor_type":
            raise ExportError(f"{path}: {value_info.name!r} is a {value_info.type.WhichOneof('value')} value, "
                              "not a tensor; only tensor inputs and outputs are supported")
        t = value_info.type.tensor_type
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name
        except (KeyError, TypeError, ValueError) as e:
            raise ExportError(f"{path}: {value_info.name!r} has element type {t.elem_type}, "
                              "which has no numpy dtype") from e
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        if is_input and value_info.name in initializers:
            default = json_default(numpy_helper.to_array(initializers[value_info.name]))
            return TensorSpec(value_info.name, dtype, shape, required=False, default=default)
        return TensorSpec(value_info.name, dtype, shape)

    return Contract(inputs=tuple(spec(i, True) for i in model.graph.input),
                    outputs=tuple(spec(o, False) for o in model.graph.output))


def saved_model_meta_graph(path: Path, tag: str, signature_key: str = "serving_default"):
    """The meta graph of the SavedModel at ``path`` tagged ``tag``, pruned to what
    ``signature_key``, the restore op and the init op need, and checked
    (:func:`exporter.trust.check_meta_graph`); ``saved_model.pb`` is read once, with
    :func:`exporter.trust.read_saved_model`.

    Raises:
        ExportError: unreadable, no meta graph tagged ``tag``, or no such signature.
        UnsafeModelError: the pruned graph holds an op that may not be loaded.
    """
    from policy_export.exporter.trust import (
        check_meta_graph, prune_to_serving, read_saved_model, saved_model_budget, select_meta_graph,
    )

    proto = read_saved_model(path)
    meta = prune_to_serving(select_meta_graph(proto, tag, str(path)), signature_key, str(path))
    check_meta_graph(meta, str(path), budget=saved_model_budget(path))
    return meta


def saved_model_contract(path: Path, signature_key: str = "serving_default", tag: str = "serve") -> Contract:
    """A SavedModel signature's contract, read from the proto (no variables are loaded).

    Inputs fed through ``PlaceholderWithDefault`` are optional, with their constant default.
    """
    import tensorflow as tf

    meta = saved_model_meta_graph(path, tag, signature_key)
    from policy_export.signatures.builder import find_signature

    sig = find_signature(meta, signature_key, str(path))
    nodes = {n.name: n for n in meta.graph_def.node}

    def spec(key: str, info, is_input: bool) -> TensorSpec:
        try:
            tf_dtype = tf.dtypes.as_dtype(info.dtype)
            if tf_dtype in (tf.resource, tf.variant):
                raise TypeError(f"{tf_dtype.name} is a handle, not a tensor of values")
            dtype = np.dtype(tf_dtype.as_numpy_dtype).name
        except (TypeError, ValueError) as e:
            raise ExportError(f"{path}: signature {signature_key!r} {key!r} has dtype {info.dtype}: {e}") from e
        shape = () if info.tensor_shape.unknown_rank else tuple(
            None if d.size < 0 else int(d.size) for d in info.tensor_shape.dim)
        node = nodes.get(info.name.split(":")[0])
        if is_input and node is not None and node.op == "PlaceholderWithDefault":
            const = nodes.get(node.input[0].split(":")[0])
            if const is not None and const.op == "Const":
                value = tf.make_ndarray(const.attr["value"].tensor)
                return TensorSpec(key, dtype, shape, required=False, default=json_default(value))
        return TensorSpec(key, dtype, shape)

    return Contract(inputs=tuple(spec(k, v, True) for k, v in sorted(sig.inputs.items())),
                    outputs=tuple(spec(k, v, False) for k, v in sorted(sig.outputs.items())),
                    method=sig.method_name, signature_key=signature_key)


def contract_json(kind: str, path: Path, contract: Contract) -> str:
    return json.dumps({"path": str(path), "kind": kind, **contract.to_json()}, indent=2)
