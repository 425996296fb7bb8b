"""``onnx_deterministic``: ``model_deterministic.onnx``, the deterministic action path alone (no
random ops, no explore switch, only the required inputs); run by ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.exporter.formats.onnx import OnnxFile


class OnnxDeterministicFormat(OnnxFile, Format):
    name = "onnx_deterministic"
    path = "model_deterministic.onnx"
    order = 40
    capabilities = Capabilities(explores=False, onnx=True)

    def skip_reason(self, policy) -> str | None:
        if not policy.deterministic_outputs:
            return "the policy exposes no deterministic outputs"
        return None

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.onnx import model as onnx_model

        return onnx_model.write_deterministic(ctx, target)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.onnx.model import OnnxRunner
        from policy_export.signatures.contract import Contract

        return OnnxRunner(path, device, contract=Contract.from_json(manifest["contract"]))

    def output_keys(self, contract, info) -> list[str]:
        own = (info or {}).get("outputs")
        return [k for k in contract.output_keys if k in own] if own else list(contract.output_keys)


FORMAT = OnnxDeterministicFormat()
