"""The ONNX model, converted from the frozen graph with tf2onnx.

Its input and output names are the signature keys. Optional inputs (``explore``,
``is_training``, ``timestep``...) are graph inputs backed by an initializer holding the default:
ONNX's way to say "may be fed". ONNX Runtime lists them with
``session.get_overridable_initializers()`` rather than ``get_inputs()``; the full contract is also
in the model's metadata (``policy_export.contract``). A client that feeds only the required inputs
gets the defaults, so deterministic actions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from exporter.context import ExportContext, FormatRecord
from exporter.devices import DevicePlan
from policy.errors import ExportError, InputError
from signatures.contract import Contract

log = logging.getLogger(__name__)
FILENAME = "model.onnx"
BATCH_DIM = "batch"
CONTRACT_METADATA = "policy_export.contract"
LAYOUT_METADATA = "policy_export.nchw_inputs"


def convert(ctx: ExportContext) -> onnx.ModelProto:
    """tf2onnx conversion of the frozen graph, then keys, optional inputs, batch dims and checks.

    Raises:
        ExportError: the conversion fails, the opset is not the requested one, or the checker fails.
    """
    import tf2onnx

    graph_def = ctx.frozen_graph_def()
    present = {n.name for n in graph_def.node}
    sig = ctx.signature
    inputs = {k: t.name for k, t in sig.inputs.items() if t.op.name in present}
    outputs = {k: t.name for k, t in sig.outputs.items()}
    if len(set(outputs.values())) != len(outputs):
        raise ExportError("two signature outputs are the same tensor; give each its own tensor (tf.identity)")
    rename = {name: key for key, name in {**inputs, **outputs}.items()}
    # only the policy's image inputs (rank-4, HxWxC) change layout
    nchw = [k for k in ctx.policy.image_inputs if k in inputs] if ctx.inputs_as_nchw else []
    try:
        model, _ = tf2onnx.convert.from_graph_def(
            graph_def, name=ctx.policy.name, input_names=list(inputs.values()),
            output_names=list(outputs.values()), opset=ctx.opset, tensors_to_rename=rename,
            inputs_as_nchw=[inputs[k] for k in nchw] or None,
        )
    except Exception as e:  # tf2onnx raises many kinds; say which stage failed
        raise ExportError(f"ONNX conversion (tf2onnx, opset {ctx.opset}) failed: {type(e).__name__}: {e}") from e
    finish_model(model, sig.contract, ctx.opset, nchw)
    return model


def finish_model(model: onnx.ModelProto, contract: Contract, opset: int, nchw: list[str] | None = None) -> None:
    """Make ``model`` carry the contract exactly, then run the full ONNX checker.

    ``nchw`` names the inputs whose layout was transposed to NCHW (recorded in the metadata).
    """
    _check_opset(model, opset)
    graph = model.graph
    _add_missing_inputs(graph, contract)
    _name_batch_dims(graph, contract)
    del model.metadata_props[:]
    helper.set_model_props(model, {CONTRACT_METADATA: json.dumps(contract.to_json(), sort_keys=True),
                                   LAYOUT_METADATA: json.dumps(sorted(nchw or []))})
    model.producer_name = "policy-export"
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ExportError(f"the ONNX model fails onnx.checker: {e}") from e


def _check_opset(model: onnx.ModelProto, opset: int) -> None:
    versions = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    if versions.get("ai.onnx") != opset:
        raise ExportError(f"requested ONNX opset {opset} but the converter wrote opset {versions.get('ai.onnx')}")


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


def write(ctx: ExportContext, target: Path) -> FormatRecord:
    """Convert and save ``model.onnx``."""
    model = convert(ctx)
    onnx.save_model(model, str(target))
    return FormatRecord("onnx", (target.name,), {
        "opset": ctx.opset, "nodes": len(model.graph.node),
        "optional_inputs": [s.key for s in ctx.signature.contract.inputs if not s.required],
        "nchw_inputs": nchw_inputs(model),
    })


def nchw_inputs(model: onnx.ModelProto) -> list[str]:
    """Inputs this model takes in NCHW layout (from its metadata)."""
    for prop in model.metadata_props:
        if prop.key == LAYOUT_METADATA:
            return list(json.loads(prop.value))
    return []


def contract_from_model(model: onnx.ModelProto) -> Contract | None:
    """The contract stored in a model's metadata, if any."""
    for prop in model.metadata_props:
        if prop.key == CONTRACT_METADATA:
            return Contract.from_json(json.loads(prop.value))
    return None


class OnnxRunner:
    """ONNX Runtime session over a model file; runs by key, feeding only what is given.

    Feeds are taken in the signature's layout (NHWC); inputs the model takes as NCHW are
    transposed on the way in.
    """

    def __init__(self, path: Path, device: DevicePlan, threads: int | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), options, providers=list(device.ort_providers))
        except Exception as e:  # onnxruntime raises its own exception types
            raise ExportError(f"ONNX Runtime cannot load {path}: {e}") from e
        self.providers = self.session.get_providers()
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.input_types.update({i.name: i.type for i in self.session.get_overridable_initializers()})
        self.output_names = [o.name for o in self.session.get_outputs()]
        meta = self.session.get_modelmeta().custom_metadata_map
        self.nchw = set(json.loads(meta.get(LAYOUT_METADATA, "[]")))

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        unknown = sorted(set(feeds) - set(self.input_types))
        if unknown:
            raise InputError(f"ONNX model has no input(s) {unknown}")
        arrays = {k: np.asarray(v) for k, v in feeds.items()}
        for key in self.nchw & arrays.keys():
            arrays[key] = np.ascontiguousarray(arrays[key].transpose(0, 3, 1, 2))
        values = self.session.run(self.output_names, arrays)
        return dict(zip(self.output_names, values))


def load(export_dir: Path, device: DevicePlan) -> OnnxRunner:
    """A runner over ``export_dir/model.onnx``."""
    return OnnxRunner(export_dir / FILENAME, device)


