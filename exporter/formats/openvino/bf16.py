"""``openvino_bf16``: ``openvino_bf16/``, the same OpenVINO IR as ``openvino`` (float32 weights),
run with ``INFERENCE_PRECISION_HINT`` ``bf16``: OpenVINO's CPU plugin computes in bfloat16 where
the CPU supports it (its ``OPTIMIZATION_CAPABILITIES`` list ``BF16``) and in float32 otherwise (the
runner reports the fallback). Lossy: held to behavioural thresholds. Opt-in (``--formats``)."""

from __future__ import annotations

from policy_export.exporter.formats.base import Capabilities
from policy_export.exporter.formats.openvino import OpenVinoFormat


class OpenVinoBf16Format(OpenVinoFormat):
    name = "openvino_bf16"
    path = "openvino_bf16"
    order = 65
    capabilities = Capabilities(default=False, lossy=True, from_onnx=True)
    precision = "bf16"


FORMAT = OpenVinoBf16Format()
