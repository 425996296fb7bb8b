"""Edge and compressed formats: TFLite (float32 and dynamic-range int8) and the compressed ONNX
models (ONNX Runtime dynamic int8 quantisation, float16).

TFLite: the export's frozen serving graph is wrapped as a ``tf.function`` whose dict inputs and
outputs are the signature keys (``wrap_function`` + ``prune``), and converted with
``TFLiteConverter.from_concrete_functions`` with a ``tf.Module`` as the trackable object, so the
file holds a ``serving_default`` SignatureDef under the same keys. Only builtin ops are allowed
(``TFLITE_BUILTINS``; no Flex, no custom ops). Seeds of the random ops are zeroed first: TFLite
prepares an ``IF`` branch again on every invoke, so a seeded ``MULTINOMIAL`` inside the explore
branch would return the same draw every call. Where the explore branch does not convert with
builtins, the model is converted with every optional input fixed to its default (the
deterministic path alone) and explore is refused (the format record says so).

ONNX: both compressed models come from the deterministic ONNX model (``model_deterministic.onnx``'s
conversion, made here whether or not that format is written): ``onnx_int8`` by
``onnxruntime.quantization.quantize_dynamic`` (int8 weights, per channel; activations quantised
per call), ``onnx_fp16`` by ``onnxruntime.transformers.float16.convert_float_to_float16`` with
float32 inputs and outputs kept.
"""

from __future__ import annotations

import copy
import itertools
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter.context import ExportContext, FormatRecord
from policy_export.policy import jsonio
from policy_export.policy.errors import ExportError

log = logging.getLogger(__name__)

SIGNATURE_KEY = "serving_default"
TFLITE_IDENTIFIER = b"TFL3"
_COUNTER = itertools.count()


# ------------------------------------------------------------------------------------------ TFLite


def strip_seeds(graph_def):
    """A copy of ``graph_def`` with ``seed``/``seed2`` zeroed on every node (graph and function
    library): unseeded random ops draw afresh on every TFLite invoke."""
    import tensorflow as tf

    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    for node in [*out.node, *(n for f in out.library.function for n in f.node_def)]:
        if "seed" in node.attr and "seed2" in node.attr:
            node.attr["seed"].i = 0
            node.attr["seed2"].i = 0
    return out


def _unique_functions(graph_def) -> None:
    """Rename every library function of ``graph_def`` (in place) with a suffix unique in this
    process: importing a GraphDef into the eager context registers its functions, and a second,
    different function of the same name (another export, a seed-stripped copy) is refused."""
    library = {f.signature.name for f in graph_def.library.function}
    if not library:
        return
    suffix = f"_pe{next(_COUNTER)}"

    def fix(attrs) -> None:
        for value in attrs.values():
            if value.HasField("func") and value.func.name in library:
                value.func.name += suffix
            if value.HasField("list"):
                for func in value.list.func:
                    if func.name in library:
                        func.name += suffix

    for node in [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]:
        fix(node.attr)
    for function in graph_def.library.function:
        function.signature.name += suffix
    for grad in graph_def.library.gradient:
        if grad.function_name in library:
            grad.function_name += suffix
        if grad.gradient_func in library:
            grad.gradient_func += suffix


def _concrete_function(graph_def, signature, fix_optional: bool):
    """A concrete function over ``graph_def`` taking and returning dicts keyed by signature keys,
    and the ``tf.Module`` that carries it (so the converter writes a SignatureDef).

    ``fix_optional``: optional inputs become constants holding their defaults (the converter then
    folds the explore branch away); otherwise they are inputs like the required ones.
    """
    import tensorflow as tf

    tf1 = tf.compat.v1
    graph_def = copy.deepcopy(graph_def)
    _unique_functions(graph_def)
    contract = signature.contract
    present = {n.name for n in graph_def.node}
    names = {k: t.name for k, t in signature.inputs.items() if t.op.name in present}
    fixed = {s.key: s for s in contract.inputs if not s.required and s.key in names} if fix_optional else {}

    def imported():
        input_map = {names[k]: tf.constant(np.asarray(s.default, np.dtype(s.dtype))) for k, s in fixed.items()}
        tf1.import_graph_def(graph_def, input_map=input_map, name="")

    wrapped = tf1.wrap_function(imported, [])
    graph = wrapped.graph
    keys = [s.key for s in contract.inputs if s.key in names and s.key not in fixed]
    pruned = wrapped.prune(feeds=[graph.get_tensor_by_name(names[k]) for k in keys],
                           fetches={k: graph.get_tensor_by_name(t.name) for k, t in signature.outputs.items()})
    specs = {s.key: tf.TensorSpec(s.shape, tf.as_dtype(np.dtype(s.dtype)), name=s.key)
             for s in contract.inputs if s.key in keys}

    @tf.function(input_signature=[specs])
    def serving_default(feeds):
        return dict(pruned(*[feeds[k] for k in keys]))

    module = tf.Module()
    module.serving_default = serving_default
    return serving_default.get_concrete_function(), module, sorted(fixed)


def convert_tflite(graph_def, signature, *, quantize: bool = False, fix_optional: bool = False) -> tuple[bytes, list[str]]:
    """The ``.tflite`` bytes of ``graph_def`` (builtin ops only) and the optional inputs fixed to
    their defaults. ``quantize``: dynamic-range int8 (``Optimize.DEFAULT``, no representative data).

    Raises:
        ExportError: the converter fails (an op without a builtin kernel, say).
    """
    import tensorflow as tf

    try:
        function, module, fixed = _concrete_function(strip_seeds(graph_def), signature, fix_optional)
        converter = tf.lite.TFLiteConverter.from_concrete_functions([function], module)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        if quantize:
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        data = converter.convert()
    except ExportError:
        raise
    except Exception as e:  # the converter raises ConverterError, ValueError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ExportError(f"TFLite conversion (builtin ops only) failed: {type(e).__name__}: {first}") from e
    return bytes(data), fixed


def tflite_ops(data: bytes) -> list[str]:
    """The builtin op names a ``.tflite`` model uses (all subgraphs), sorted."""
    try:
        from tensorflow.lite.python import schema_py_generated as schema
    except ImportError:  # pragma: no cover - layout of older TF builds
        return []
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(data, 0))
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    ops = set()
    for code in model.operatorCodes or []:
        value = max(code.builtinCode, code.deprecatedBuiltinCode)
        ops.add(names.get(value, f"CUSTOM:{code.customCode!r}" if code.customCode else str(value)))
    return sorted(ops)


def write_tflite(ctx: ExportContext, target: Path, name: str, quantize: bool) -> FormatRecord:
    """Write ``model.tflite`` (float32, explore kept where builtins express it) or its
    dynamic-range int8 twin (the deterministic path: optional inputs fixed to their defaults)."""
    graph_def = ctx.frozen_graph_def()
    explore_refused = None
    if quantize:
        data, fixed = convert_tflite(graph_def, ctx.signature, quantize=True, fix_optional=True)
    else:
        try:
            data, fixed = convert_tflite(graph_def, ctx.signature)
        except ExportError as e:
            explore_refused = f"sampling is not expressible with TFLite builtin ops ({e})"
            log.warning("%s: %s; writing the deterministic path alone", name, explore_refused)
            data, fixed = convert_tflite(graph_def, ctx.signature, fix_optional=True)
    target.write_bytes(data)
    from policy_export.signatures.keys import EXPLORE

    details: dict[str, Any] = {
        "signature": SIGNATURE_KEY, "ops": tflite_ops(data), "fixed_inputs": fixed,
        "quantization": "dynamic-range int8 weights (tensors of 1024 elements or more)" if quantize else "none (float32)",
        "explores": EXPLORE in ctx.signature.inputs and EXPLORE not in fixed,
    }
    if EXPLORE in ctx.signature.inputs and EXPLORE in fixed:
        details["explore_refused"] = explore_refused or "a lossy format serves the deterministic path alone"
    return FormatRecord(name, (target.name,), details)


def check_tflite_file(path: Path) -> None:
    """Raises ExportError when ``path`` is not a TFLite flatbuffer (checked before any interpreter loads it)."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist")
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[4:8] != TFLITE_IDENTIFIER:
        raise ExportError(f"{path} is not a TFLite model (no {TFLITE_IDENTIFIER.decode()} identifier)")


# ------------------------------------------------------------------------------ compressed ONNX


def deterministic_onnx(ctx: ExportContext, stage: Path):
    """The deterministic ONNX model (as ``model_deterministic.onnx`` holds it) and its signature:
    read back from ``stage`` where that format was written already, else a finished copy of the
    export's one conversion (:meth:`ExportContext.onnx_models`; the ``onnx_deterministic`` format
    need not be chosen).

    Raises:
        ExportError: the policy exposes no deterministic outputs.
    """
    from policy_export.exporter import onnx_model
    from policy_export.exporter.compat import import_onnx
    from policy_export.signatures.builder import build_deterministic_signature

    onnx = import_onnx()
    sig = build_deterministic_signature(ctx.policy)
    if sig is None:
        raise ExportError("the policy exposes no deterministic outputs")
    written = Path(stage) / onnx_model.DETERMINISTIC_FILENAME
    if written.is_file():
        return onnx.load_model(str(written)), sig
    converted = ctx.onnx_models()
    if converted.deterministic is None:
        raise ExportError("the deterministic ONNX model was released before the compressed models were made")
    model = onnx.ModelProto()
    model.CopyFrom(converted.deterministic)  # weightless: the copy is small; the weights go into the copy
    converted_copy = type(converted)(None, model, converted.route, converted.nchw, converted.weights,
                                     converted.session, converted.weight_tensors)
    model = converted_copy.take("deterministic")
    onnx_model.finish_model(model, sig.contract, ctx.opset, [k for k in converted.nchw if k in sig.contract.input_keys])
    return model, sig


def _keep_metadata(source, model) -> None:
    from policy_export.exporter.compat import import_onnx

    helper = import_onnx().helper
    props = {p.key: p.value for p in source.metadata_props}
    del model.metadata_props[:]
    helper.set_model_props(model, props)
    model.producer_name = "policy-export"


def quantize_onnx_int8(model):
    """ONNX Runtime dynamic quantisation of ``model``: int8 weights per channel, activations
    quantised per call (``DynamicQuantizeLinear``)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx = __import__("onnx")
    with tempfile.TemporaryDirectory(prefix="policy-export-int8-") as tmp:
        src, dst = Path(tmp) / "float.onnx", Path(tmp) / "int8.onnx"
        onnx.save_model(model, str(src))
        root = logging.getLogger()  # quantize_dynamic advises pre-processing on the root logger
        level = root.level
        root.setLevel(max(level, logging.ERROR))
        try:
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True)
        except Exception as e:  # onnxruntime raises many kinds
            raise ExportError(f"ONNX Runtime dynamic quantisation failed: {type(e).__name__}: {e}") from e
        finally:
            root.setLevel(level)
        quantized = onnx.load_model(str(dst))
    _keep_metadata(model, quantized)
    return quantized


def convert_onnx_fp16(model):
    """``model`` with float16 weights and compute, float32 inputs and outputs (Casts at the edges)."""
    try:
        from onnxruntime.transformers.float16 import convert_float_to_float16
        from onnxruntime.transformers.onnx_model import OnnxModel

        half = convert_float_to_float16(copy.deepcopy(model), keep_io_types=True)
        wrapped = OnnxModel(half)
        wrapped.topological_sort()  # the input Casts are appended at the end of the graph
        half = wrapped.model
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise ExportError(f"float16 conversion failed: {type(e).__name__}: {e}") from e
    _keep_metadata(model, half)
    return half


def write_compressed_onnx(ctx: ExportContext, target: Path, name: str, kind: str) -> FormatRecord:
    """Write ``model_int8.onnx`` (``kind="int8"``) or ``model_fp16.onnx`` (``kind="fp16"``)."""
    from policy_export.exporter import onnx_model

    model, sig = deterministic_onnx(ctx, target.parent)
    out = quantize_onnx_int8(model) if kind == "int8" else convert_onnx_fp16(model)
    del model
    files = onnx_model.save(out, target, ctx.external_data_threshold)  # external data over the threshold
    onnx_model.check_saved(target)
    details = {"opset": ctx.opset, "nodes": len(out.graph.node), "source": "model_deterministic.onnx's conversion",
               "inputs": sig.contract.input_keys, "outputs": sig.contract.output_keys,
               "ops": sorted({n.op_type for n in out.graph.node}),
               "quantization": ("onnxruntime quantize_dynamic: int8 weights per channel, activations quantised "
                                "per call (results depend on the batch)") if kind == "int8"
               else "float16 weights and compute, float32 inputs and outputs",
               "nchw_inputs": jsonio.loads(next((p.value for p in out.metadata_props
                                               if p.key == "policy_export.nchw_inputs"), "[]"), "ONNX metadata")}
    return FormatRecord(name, files, details)
