"""``onnx_explore``: ``model_explore.onnx``, ``model.onnx`` with every input a plain graph input.

``model.onnx`` backs its optional inputs (``explore``, ``is_training``, ``timestep``) with
initializers holding their defaults, ONNX's way to say "may be fed". Runtimes that feed only what
a session lists as its inputs cannot feed those: onnxruntime-web refuses the feed ("invalid input
'explore'") and onnxruntime-node drops it without a word, so a JavaScript client of ``model.onnx``
always gets deterministic actions. In this file they are inputs like the others, which every
client must feed (``explore`` true to sample). Opt-in; run here by ONNX Runtime, with the
contract's defaults fed where a caller leaves an input out."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.exporter.formats.onnx import OnnxFile

EXPLORE_FILENAME = "model_explore.onnx"


class OnnxExploreFormat(OnnxFile, Format):
    name = "onnx_explore"
    path = EXPLORE_FILENAME
    order = 45
    capabilities = Capabilities(onnx=True, default=False)
    candidate_without_export = True  # its runner needs the export's contract alone

    def skip_reason(self, policy) -> str | None:
        if not policy.defaults:
            return "the policy has no optional inputs: every input of model.onnx is a graph input already"
        return None

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.onnx import model as onnx_model
        from policy_export.exporter.formats.onnx.compress import full_onnx
        from policy_export.exporter.formats.coverage import check_onnx_runtime
        from policy_export.exporter.formats.base import FormatRecord

        contract = ctx.signature.contract
        model = full_onnx(ctx, target.parent)
        fed = onnx_model.make_inputs_plain(model, contract)
        check_onnx_runtime(model, EXPLORE_FILENAME)
        files = onnx_model.save(model, target, ctx.external_data_threshold)
        del model
        onnx_model.check_saved(target)
        return FormatRecord(self.name, files, {"opset": ctx.opset, "inputs": contract.input_keys, "plain_inputs": fed,
                                               "defaults": {s.key: s.default for s in contract.inputs if not s.required}})

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.onnx.model import OnnxDefaultsRunner
        from policy_export.signatures.contract import Contract

        return OnnxDefaultsRunner(path, device, contract=Contract.from_json(manifest["contract"]))


FORMAT = OnnxExploreFormat()
