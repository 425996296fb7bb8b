"""``onnx_fp16``: ``model_fp16.onnx``, the deterministic model with float16 weights and compute
and float32 inputs and outputs. Lossy: held to behavioural thresholds. Opt-in (``--formats``)."""

from __future__ import annotations

from policy_export.exporter.formats.onnx.int8 import OnnxInt8Format


class OnnxFp16Format(OnnxInt8Format):
    name = "onnx_fp16"
    path = "model_fp16.onnx"
    order = 63
    kind = "fp16"


FORMAT = OnnxFp16Format()
