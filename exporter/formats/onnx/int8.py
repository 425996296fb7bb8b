"""``onnx_int8``: ``model_int8.onnx``, ONNX Runtime dynamic quantisation (int8 weights per
channel) of the deterministic model; required inputs, ``actions_i`` and ``state_out_i`` as
``model_deterministic.onnx``. Lossy: held to behavioural thresholds. Opt-in (``--formats``)."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.exporter.formats.onnx import OnnxFile


class OnnxInt8Format(OnnxFile, Format):
    name = "onnx_int8"
    path = "model_int8.onnx"
    order = 62
    capabilities = Capabilities(explores=False, default=False, lossy=True, from_onnx=True)
    kind = "int8"

    def skip_reason(self, policy) -> str | None:
        if not policy.deterministic_outputs:
            return "the policy exposes no deterministic outputs"
        return None

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.onnx import compress

        return compress.write_compressed_onnx(ctx, target, self.name, self.kind)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.onnx.model import OnnxRunner
        from policy_export.signatures.contract import Contract

        return OnnxRunner(path, device, contract=Contract.from_json(manifest["contract"]))

    def output_keys(self, contract, info) -> list[str]:
        own = (info or {}).get("outputs")
        return [k for k in contract.output_keys if k in own] if own else list(contract.output_keys)


FORMAT = OnnxInt8Format()
