"""``tflite``: ``model.tflite``, float32, the serving step graph with a ``serving_default``
signature under the signature keys; builtin ops only. Run by the standalone LiteRT interpreter
(``ai_edge_litert``) where installed, else by ``tf.lite.Interpreter``. Opt-in (``--formats``)."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format


class TFLiteFormat(Format):
    name = "tflite"
    path = "model.tflite"
    order = 60
    capabilities = Capabilities(needs_frozen_graph=True, default=False)
    quantize = False

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.tflite import convert as edge

        return edge.write_tflite(ctx, target, self.name, quantize=self.quantize)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.tflite.runner import TFLiteRunner
        from policy_export.signatures.contract import Contract

        info = (manifest.get("formats") or {}).get(self.name) or {}
        fixed = info.get("fixed_inputs") if isinstance(info.get("fixed_inputs"), list) else ()
        return TFLiteRunner(path, Contract.from_json(manifest["contract"]), fixed_inputs=fixed)


FORMAT = TFLiteFormat()
# the family's variants, each a module of this package with a FORMAT of its own
VARIANTS = ("int8",)
