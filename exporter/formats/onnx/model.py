"""The ONNX models' writer, file checks and runner (the conversion itself is :mod:`.convert`).

Its input and output names are the signature keys. Optional inputs (``explore``,
``is_training``, ``timestep``...) are graph inputs backed by an initializer holding the default:
ONNX's way to say "may be fed". ONNX Runtime lists them with
``session.get_overridable_initializers()`` rather than ``get_inputs()``; the full contract is also
in the model's metadata (``policy_export.contract``). A client that feeds only the required inputs
gets the defaults, so deterministic actions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter.compat import import_onnx

onnx = import_onnx()
from onnx import helper, numpy_helper  # noqa: E402

from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.coverage import check_onnx_runtime
from policy_export.exporter.defaults import DEFAULT_EXTERNAL_DATA_THRESHOLD
from policy_export.exporter.devices import DevicePlan
from policy_export.exporter.formats.onnx.convert import names_read, onnx_models
from policy_export.exporter.formats.onnx.trust import check_file, read_model
from policy_export.exporter.protowire import header
from policy_export.exporter.sessions import inference_session  # noqa: F401 (imported from here by users)
from policy_export.exporter.formats.runner import Runner, TensorMeta
from policy_export.policy import jsonio
from policy_export.errors import ConversionError, ExportError
from policy_export.signatures.contract import Contract

log = logging.getLogger(__name__)
DETERMINISTIC_FILENAME = "model_deterministic.onnx"
RANDOM_OPS = {"Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli"}
BATCH_DIM = "batch"
CONTRACT_METADATA = "policy_export.contract"
LAYOUT_METADATA = "policy_export.nchw_inputs"


def finish_model(model: onnx.ModelProto, contract: Contract, opset: int, nchw: list[str] | None = None) -> None:
    """Make ``model`` carry the contract exactly (:func:`save` runs the full checker on the file).

    ``nchw`` names the inputs whose layout was transposed to NCHW (recorded in the metadata).
    """
    _check_opset(model, opset)
    graph = model.graph
    _scalar_one_hot_depths(graph)
    _add_missing_inputs(graph, contract)
    _drop_unused_initializers(graph)
    _name_batch_dims(graph, contract)
    del model.metadata_props[:]
    helper.set_model_props(model, {CONTRACT_METADATA: json.dumps(contract.to_json(), sort_keys=True),
                                   LAYOUT_METADATA: json.dumps(sorted(nchw or []))})
    model.producer_name = "policy-export"


def _check_opset(model: onnx.ModelProto, opset: int) -> None:
    versions = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    if versions.get("ai.onnx") != opset:
        raise ExportError(f"requested ONNX opset {opset} but the converter wrote opset {versions.get('ai.onnx')}")


def _scalar_one_hot_depths(graph: onnx.GraphProto) -> None:
    """Make every constant ``OneHot`` depth a scalar (tf2onnx writes a one-element tensor, which
    the spec allows but some runtimes, onnx's reference evaluator among them, reject)."""
    initializers = {i.name: i for i in graph.initializer}
    for node in graph.node:
        if node.op_type != "OneHot" or node.input[1] not in initializers:
            continue
        depth = numpy_helper.to_array(initializers[node.input[1]])
        if depth.shape == (1,):
            name = f"{node.input[1]}__scalar"
            if name not in initializers:
                initializers[name] = numpy_helper.from_array(depth.reshape(()), name)
                graph.initializer.append(initializers[name])
            node.input[1] = name


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    """Remove initializers that no node reads and that back no graph input (an optional input's
    default) or output: the converter's and the post-processing's leftovers."""
    keep = names_read(graph) | {i.name for i in graph.input} | {o.name for o in graph.output}
    unused = [i for i in graph.initializer if i.name not in keep]
    for init in unused:
        graph.initializer.remove(init)
    if unused:
        log.debug("dropped %d unused initializers: %s", len(unused), [i.name for i in unused])


def _add_missing_inputs(graph: onnx.GraphProto, contract: Contract) -> None:
    """Every contract input becomes a graph input; optional ones get an initializer default."""
    existing = {i.name for i in graph.input}
    initializers = {i.name for i in graph.initializer}
    for spec in contract.inputs:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
        if spec.key not in existing:
            dims = [BATCH_DIM if (i == 0 and d is None) else d for i, d in enumerate(spec.shape)]
            graph.input.append(helper.make_tensor_value_info(spec.key, elem, dims))
        if not spec.required and spec.key not in initializers:
            value = np.asarray(spec.default, dtype=np.dtype(spec.dtype))
            graph.initializer.append(numpy_helper.from_array(value, spec.key))
        if spec.required and spec.key in initializers:
            raise ExportError(f"required input {spec.key!r} became a constant in the ONNX model")


def _name_batch_dims(graph: onnx.GraphProto, contract: Contract) -> None:
    specs = {s.key: s for s in (*contract.inputs, *contract.outputs)}
    for value_info in (*graph.input, *graph.output):
        spec = specs.get(value_info.name)
        if spec is None or not spec.shape or spec.shape[0] is not None:
            continue
        dims = value_info.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_param = BATCH_DIM


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers (their serialised size: nothing is copied to count it)."""
    return sum(i.ByteSize() for i in model.graph.initializer)


def save(model: onnx.ModelProto, target: Path, external_threshold: int = DEFAULT_EXTERNAL_DATA_THRESHOLD,
         lazy: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Save ``model`` to ``target`` (the checker is :func:`check_saved`, run once the caller has let
    go of the model); returns the file names written (the model, and its external data file when
    there is one).

    ``lazy`` (name -> :class:`~exporter.formats.onnx.convert.LazyWeight`) are initializers the model does
    not hold yet: each is read and written in turn, so that one of them is in memory at a time.
    Models whose weights exceed ``external_threshold`` bytes keep them in ``<target>.data`` beside
    the model (ONNX external data): a single protobuf cannot exceed 2 GiB.
    """
    lazy = dict(lazy or {})
    files = [target.name]
    if weight_bytes(model) + sum(w.nbytes for w in lazy.values()) > external_threshold:
        location = f"{target.name}.data"
        _write_external(model, target.parent / location, location, lazy)
        onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=location, size_threshold=1024, convert_attribute=False)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(target.parent / location, 0o666 & ~umask)  # written private; it is part of the export
        files.append(location)
    else:
        with open(target, "wb") as f:
            f.write(model.SerializeToString())
            _append_initializers(f, lazy)
    return tuple(files)


def _write_external(model: onnx.ModelProto, data_path: Path, location: str, lazy: Mapping[str, Any]) -> None:
    """Write each lazy weight to ``data_path`` and add it to ``model`` as an external initializer
    (``onnx.save_model`` then appends the model's own large initializers to the same file)."""
    from policy_export.exporter.formats.onnx.convert import little_endian

    with open(data_path, "wb") as f:
        for name, weight in lazy.items():
            value = little_endian(weight.value())
            offset = f.tell()
            f.write(memoryview(value).cast("B"))
            tensor = model.graph.initializer.add()
            tensor.name = name
            tensor.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
            tensor.dims.extend(value.shape)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, val in (("location", location), ("offset", str(offset)), ("length", str(value.nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, val
            del value


_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9  # field numbers in onnx.proto


def _append_initializers(f, lazy: Mapping[str, Any]) -> None:
    """Append the lazy weights to a serialised ModelProto as a second ``graph`` field holding only
    initializers: protobuf merges a message field that appears twice, so the model's graph gains
    them. Each tensor's raw data is written from the array's own buffer."""
    from policy_export.exporter.formats.onnx.convert import little_endian

    if not lazy:
        return
    heads = {}
    for name, weight in lazy.items():
        tensor = onnx.TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(weight.dtype)
        tensor.dims.extend(weight.shape)
        head = tensor.SerializeToString() + header(_TENSOR_RAW_DATA, weight.nbytes)
        heads[name] = head
    entries = {name: len(head) + lazy[name].nbytes for name, head in heads.items()}
    graph_len = sum(len(header(_GRAPH_INITIALIZER, n)) + n for n in entries.values())
    f.write(header(_MODEL_GRAPH, graph_len))
    for name, weight in lazy.items():
        value = little_endian(weight.value())
        if value.nbytes != weight.nbytes:
            raise ExportError(f"weight {name} has {value.nbytes} bytes, expected {weight.nbytes}")
        f.write(header(_GRAPH_INITIALIZER, entries[name]) + heads[name])
        f.write(memoryview(value).cast("B"))
        del value


def check_saved(target: Path) -> None:
    """The full ONNX checker on a saved model file.

    Raises:
        ExportError: the checker fails.
    """
    try:
        onnx.checker.check_model(str(target), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ConversionError(f"the ONNX model fails onnx.checker: {e}") from e


def write(ctx: ExportContext, target: Path) -> FormatRecord:
    """Save ``model.onnx`` (converted together with the deterministic model, see
    :mod:`exporter.formats.onnx.convert`), or the model exported elsewhere (:func:`write_model_file`)."""
    if ctx.model_file is not None:
        return write_model_file(ctx, target)
    converted = onnx_models(ctx)
    model, lazy = converted.take_lazy("full")
    finish_model(model, ctx.signature.contract, ctx.opset, converted.nchw)
    check_onnx_runtime(model, "model.onnx")
    details = {
        "opset": ctx.opset, "nodes": len(model.graph.node),
        "optional_inputs": [s.key for s in ctx.signature.contract.inputs if not s.required],
        "nchw_inputs": nchw_inputs(model), "conversion": converted.route,
    }
    files = save(model, target, ctx.external_data_threshold, lazy)
    del model, lazy  # the checker reads the file
    check_saved(target)
    return FormatRecord("onnx", files, details)



def write_model_file(ctx: ExportContext, target: Path) -> FormatRecord:
    """``model.onnx``: the model exported elsewhere, its graph as it is, saved as one file (its
    weights inline, or in ``model.onnx.data`` above the external data threshold)."""
    from policy_export.exporter.formats.onnx.trust import load_checked

    model = load_checked(ctx.model_file)
    check_onnx_runtime(model, "model.onnx")
    details = {
        "opset": model_opset(model), "nodes": len(model.graph.node),
        "optional_inputs": [s.key for s in ctx.contract.inputs if not s.required],
        "source": f"{ctx.model_file.name}, exported by {producer(model)}",
    }
    files = save(model, target, ctx.external_data_threshold)
    del model
    check_saved(target)
    return FormatRecord("onnx", files, details)


def model_opset(model: onnx.ModelProto) -> int | None:
    """The model's opset of the default ONNX domain."""
    return next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def producer(model: onnx.ModelProto) -> str:
    """What wrote the model, as it says (``pytorch 2.13.0``), or ``an unnamed producer``."""
    text = " ".join(" ".join(p.split()) for p in (model.producer_name, model.producer_version) if p).strip()
    return "".join(c for c in text if c.isprintable())[:80] or "an unnamed producer"

def write_deterministic(ctx: ExportContext, target: Path) -> FormatRecord:
    """Save the deterministic path alone: no random ops, no explore branch.

    Raises:
        ExportError: the policy exposes no deterministic outputs, or the model still holds
            random ops or control flow.
    """
    from policy_export.signatures.builder import build_deterministic_signature

    sig = build_deterministic_signature(ctx.policy)
    converted = onnx_models(ctx)
    if sig is None or converted.deterministic is None:
        raise ExportError("the policy exposes no deterministic outputs; leave 'onnx_deterministic' out of the formats")
    model, lazy = converted.take_lazy("deterministic")
    unwanted = sorted({n.op_type for n in model.graph.node} & (RANDOM_OPS | {"If", "Loop"}))
    if unwanted:
        raise ExportError(f"the deterministic model still holds {unwanted}")
    finish_model(model, sig.contract, ctx.opset, [k for k in converted.nchw if k in sig.contract.input_keys])
    check_onnx_runtime(model, DETERMINISTIC_FILENAME)
    details = {
        "opset": ctx.opset, "nodes": len(model.graph.node), "inputs": sig.contract.input_keys,
        "outputs": sig.contract.output_keys, "nchw_inputs": nchw_inputs(model), "conversion": converted.route,
    }
    files = save(model, target, ctx.external_data_threshold, lazy)
    del model, lazy
    check_saved(target)
    return FormatRecord("onnx_deterministic", files, details)


def make_inputs_plain(model: onnx.ModelProto, contract: Contract) -> list[str]:
    """Turn the optional inputs of a finished ``model.onnx`` model into plain graph inputs (their
    default initializers removed, so every runtime lists them and every client must feed them);
    the contract in the metadata says so. Returns their keys.

    Raises:
        ExportError: an optional input is not a graph input of the model.
    """
    graph = model.graph
    optional = [s.key for s in contract.inputs if not s.required]
    missing = sorted(set(optional) - {i.name for i in graph.input})
    if missing:
        raise ExportError(f"optional inputs {missing} are not inputs of the ONNX model")
    for init in [i for i in graph.initializer if i.name in optional]:
        graph.initializer.remove(init)
    plain = dataclasses.replace(contract, inputs=tuple(dataclasses.replace(s, required=True, default=None)
                                                       for s in contract.inputs))
    props = {p.key: p.value for p in model.metadata_props}
    props[CONTRACT_METADATA] = json.dumps(plain.to_json(), sort_keys=True)
    del model.metadata_props[:]
    helper.set_model_props(model, props)
    return optional


def nchw_inputs(model: onnx.ModelProto) -> list[str]:
    """Inputs this model takes in NCHW layout (from its metadata)."""
    for prop in model.metadata_props:
        if prop.key == LAYOUT_METADATA:
            return list(jsonio.loads(prop.value, f"ONNX metadata {LAYOUT_METADATA!r}"))
    return []


def contract_from_model(model: onnx.ModelProto) -> Contract | None:
    """The contract stored in a model's metadata, if any."""
    for prop in model.metadata_props:
        if prop.key == CONTRACT_METADATA:
            return Contract.from_json(jsonio.loads(prop.value, f"ONNX metadata {CONTRACT_METADATA!r}"))
    return None


def ort_run(runner: Runner, session, names: list[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``session.run(names, feeds)`` as a stoppable call of ``runner`` (:meth:`Runner.stoppable`):
    at the run limit or on a signal the run's own ``RunOptions.terminate`` is set, which ONNX
    Runtime checks between kernels and in every ``Loop``/``Scan`` iteration.

    Raises:
        RunTimeoutError: the run took longer than the run limit.
        KeyboardInterrupt: a signal arrived meanwhile.
    """
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = 4  # a terminated run is reported by the exception alone

    def stop() -> None:
        options.terminate = True

    return runner.stoppable(lambda: session.run(names, feeds, options), stop)


_ORT_TYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8",
              "tensor(uint8)": "uint8", "tensor(uint16)": "uint16", "tensor(bool)": "bool"}


def _ort_meta(arg, nchw: bool = False) -> TensorMeta:
    shape = tuple(d if isinstance(d, int) else None for d in arg.shape) if arg.shape is not None else None
    if nchw and shape is not None and len(shape) == 4:  # the runner takes the signature's NHWC layout
        shape = (shape[0], shape[2], shape[3], shape[1])
    return TensorMeta(arg.name, _ORT_TYPES.get(arg.type), shape)


class OnnxRunner(Runner):
    """ONNX Runtime session over a model file; runs by key, feeding only what is given.

    ``inputs`` lists the graph inputs and the optional inputs ONNX Runtime holds as overridable
    initializers. Feeds are taken in the signature's layout (NHWC); inputs the model takes as NCHW
    are transposed on the way in.
    """

    def __init__(self, path: Path, device: DevicePlan, threads: int | None = None, contract: Contract | None = None):
        from policy_export.exporter.formats.onnx.convert import head_model
        from policy_export.signatures.keys import ACTION_DIST_INPUTS

        # the action head is cut while the file is parsed for its checks (not beside the session)
        self._head = check_file(path, lambda model: head_model(model, ACTION_DIST_INPUTS))
        self.path = Path(path)
        self.label = f"ONNX model {path}"
        self.contract = contract
        self.session = inference_session(path, list(device.ort_providers), threads,
                                         provider_options=device.ort_provider_options(), prepack=False)
        self.provider_options = self.session.get_provider_options()
        self.providers = self.session.get_providers()
        meta = self.session.get_modelmeta().custom_metadata_map
        self.nchw = set(jsonio.loads(meta.get(LAYOUT_METADATA, "[]"), f"{path} metadata {LAYOUT_METADATA!r}"))
        declared = [*self.session.get_inputs(), *self.session.get_overridable_initializers()]
        self.inputs = {a.name: _ort_meta(a, a.name in self.nchw) for a in declared}
        self.outputs = {a.name: _ort_meta(a) for a in self.session.get_outputs()}
        self.output_names = list(self.outputs)

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = dict(feeds)
        for key in self.nchw & arrays.keys():
            arrays[key] = np.ascontiguousarray(arrays[key].transpose(0, 3, 1, 2))
        return dict(zip(self.output_names, ort_run(self, self.session, self.output_names, arrays)))

    def device_info(self) -> dict[str, Any]:
        return {"onnxruntime_providers_used": list(self.providers)}

    def head(self):
        """The model cut at ``action_dist_inputs`` (:func:`exporter.formats.onnx.convert.head_model`), in its
        own small ONNX Runtime session; ``None`` when it cannot be cut there."""
        cut = self._head
        if cut is None:
            return None
        session = inference_session(cut.SerializeToString(), providers=self.providers,
                                    provider_options=[self.provider_options.get(p, {}) for p in self.providers])
        names = [o.name for o in session.get_outputs()]
        return lambda feeds: dict(zip(names, ort_run(self, session, names, {k: np.asarray(v) for k, v in feeds.items()})))

    def _close(self) -> None:
        del self.session


class OnnxDefaultsRunner(OnnxRunner):
    """An ONNX Runtime session over a model whose every input must be fed (``model_explore.onnx``):
    an input the caller leaves out gets the contract's default, as ``model.onnx`` would give it."""

    def __init__(self, path: Path, device: DevicePlan, threads: int | None = None, contract: Contract | None = None):
        super().__init__(path, device, threads, contract)
        self.defaults = {s.key: s.default for s in (contract.inputs if contract else ()) if not s.required}
        hidden = sorted(a.name for a in self.session.get_overridable_initializers() if a.name in self.defaults)
        if hidden:
            self.close()
            raise ExportError(f"{path}: inputs {hidden} are initializers holding defaults, not graph inputs: runtimes "
                              "that feed only the inputs a session lists (onnxruntime-web, onnxruntime-node) cannot "
                              "feed them; every input must be a plain graph input")

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from policy_export.exporter.formats.runner import with_defaults

        return super()._run(with_defaults(self.label, self.inputs, feeds, self.defaults))


def onnx_contract(path: Path, metadata: bool = True) -> Contract:
    """The contract in an ONNX model's metadata, else (or without ``metadata``) one read from its graph.

    The model passes :func:`.trust.check_file` first; a file that is not ONNX is an error.
    """
    from policy_export.signatures.contract import TensorSpec, json_default

    check_file(Path(path))
    model = read_model(Path(path))
    try:
        stored = contract_from_model(model) if metadata else None
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
