"""The compressed ONNX models, both made from the deterministic ONNX model
(``model_deterministic.onnx``'s conversion, made here whether or not that format is written):
``onnx_int8`` by ``onnxruntime.quantization.quantize_dynamic`` (int8 weights, per channel;
activations quantised per call), ``onnx_fp16`` by
``onnxruntime.transformers.float16.convert_float_to_float16`` with float32 inputs and outputs kept.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.errors import ConversionError, ExportError
from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.onnx.convert import onnx_models
from policy_export.policy import jsonio

log = logging.getLogger(__name__)



def deterministic_onnx(ctx: ExportContext, stage: Path):
    """The deterministic ONNX model (as ``model_deterministic.onnx`` holds it) and its signature:
    read back from ``stage`` where that format was written already, else a finished copy of the
    export's one conversion (:func:`exporter.formats.onnx.convert.onnx_models`; the ``onnx_deterministic`` format
    need not be chosen).

    Raises:
        ExportError: the policy exposes no deterministic outputs.
    """
    if ctx.model_file is not None:  # a model exported elsewhere: itself, with its own contract
        return full_onnx(ctx, stage), _ModelSignature(ctx.contract)
    from policy_export.signatures.builder import build_deterministic_signature

    sig = build_deterministic_signature(ctx.policy)
    if sig is None:
        raise ExportError("the policy exposes no deterministic outputs")
    return _finished(ctx, stage, "deterministic", sig), sig


def full_onnx(ctx: ExportContext, stage: Path):
    """``model.onnx``'s model (every output, the explore branch, optional inputs backed by their
    defaults), read back from ``stage`` or finished from a copy of the conversion, as
    :func:`deterministic_onnx` does.

    Raises:
        ConversionError: the full signature did not convert.
    """
    if ctx.model_file is not None:
        from policy_export.exporter.formats.onnx.trust import load_checked

        return load_checked(ctx.model_file)
    return _finished(ctx, stage, "full", ctx.signature)


@dataclass(frozen=True)
class _ModelSignature:
    """What the compressed formats take of a signature, for a model exported elsewhere: its contract."""

    contract: Any


def _finished(ctx: ExportContext, stage: Path, which: str, sig):
    from policy_export.exporter.compat import import_onnx
    from policy_export.exporter.formats.onnx import model as onnx_model

    onnx = import_onnx()
    filename = onnx_model.DETERMINISTIC_FILENAME if which == "deterministic" else "model.onnx"
    written = Path(stage) / filename
    if written.is_file():
        return onnx.load_model(str(written))
    converted = onnx_models(ctx)
    source = getattr(converted, which)
    if source is None:
        if which == "full" and converted.full_error:
            raise ConversionError(converted.full_error)
        raise ExportError(f"the {which} ONNX model was released before the formats made from it were written")
    model = onnx.ModelProto()
    model.CopyFrom(source)  # weightless: the copy is small; the weights go into the copy
    parts = {"full": None, "deterministic": None, which: model}
    converted_copy = type(converted)(parts["full"], parts["deterministic"], converted.route, converted.nchw,
                                     converted.weights, converted.session, converted.weight_tensors)
    model = converted_copy.take(which)
    onnx_model.finish_model(model, sig.contract, ctx.opset, [k for k in converted.nchw if k in sig.contract.input_keys])
    return model


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
            # 7-bit weights (reduce_range): without VNNI, the u8s8 kernels saturate on 8-bit weights
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
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
    from policy_export.exporter.formats.onnx import model as onnx_model

    model, sig = deterministic_onnx(ctx, target.parent)
    out = quantize_onnx_int8(model) if kind == "int8" else convert_onnx_fp16(model)
    del model
    files = onnx_model.save(out, target, ctx.external_data_threshold)  # external data over the threshold
    onnx_model.check_saved(target)
    source = f"{ctx.model_file.name}, exported elsewhere" if ctx.model_file is not None else \
        "model_deterministic.onnx's conversion"
    details = {"opset": ctx.opset, "nodes": len(out.graph.node), "source": source,
               "inputs": sig.contract.input_keys, "outputs": sig.contract.output_keys,
               "ops": sorted({n.op_type for n in out.graph.node}),
               "quantization": ("onnxruntime quantize_dynamic: int8 weights per channel (reduce_range), activations quantised "
                                "per call (results depend on the batch)") if kind == "int8"
               else "float16 weights and compute, float32 inputs and outputs",
               "nchw_inputs": jsonio.loads(next((p.value for p in out.metadata_props
                                               if p.key == "policy_export.nchw_inputs"), "[]"), "ONNX metadata")}
    return FormatRecord(name, files, details)
