"""``tflite_int8``: ``model_int8.tflite``, dynamic-range quantised TFLite (int8 weights of the
tensors with 1024 elements or more, float32 activations) of the deterministic path: the optional
inputs are fixed to their defaults, so it does not explore. Lossy: held to behavioural thresholds.
Opt-in (``--formats``)."""

from __future__ import annotations

from policy_export.exporter.formats.base import Capabilities
from policy_export.exporter.formats.tflite import TFLiteFormat


class TFLiteInt8Format(TFLiteFormat):
    name = "tflite_int8"
    path = "model_int8.tflite"
    order = 61
    capabilities = Capabilities(explores=False, needs_frozen_graph=True, default=False, lossy=True)
    quantize = True


FORMAT = TFLiteInt8Format()
