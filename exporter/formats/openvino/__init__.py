"""``openvino``: ``openvino/`` holding an OpenVINO IR (``model.xml`` + ``model.bin``), float32
weights, converted by OpenVINO's own converter (``openvino.convert_model``) from the export's ONNX
model. Its input and output tensor names are the signature keys; the optional inputs
(``explore``...) stay inputs, and the runner feeds the contract's defaults for those left out;
where the explore branch holds random ops, which OpenVINO does not reproduce faithfully, they are
fixed to their defaults and the IR serves the deterministic path alone (its record says
``explores: false`` and why).
Run by the OpenVINO runtime on the CPU with ``INFERENCE_PRECISION_HINT`` pinned to ``f32``
(OpenVINO otherwise computes in bfloat16 on CPUs that support it). Opt-in (``--formats``).

A candidate IR (``verify --candidate openvino=DIR``) is checked from the export's contract alone:
the export need not hold the format.
"""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format

from policy_export.exporter.formats.openvino.names import BIN_NAME, XML_NAME  # noqa: F401 (the format's files)


class OpenVinoFormat(Format):
    name = "openvino"
    path = "openvino"
    order = 64
    capabilities = Capabilities(default=False, from_onnx=True)
    is_directory = True
    precision = "f32"  # the runner's INFERENCE_PRECISION_HINT
    candidate_without_export = True  # its runner needs the export's contract alone
    requires, extra = ("openvino",), "openvino"

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.openvino import convert

        return convert.write_openvino(ctx, target, self.name, self.precision)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.openvino.runner import OpenVinoRunner
        from policy_export.signatures.contract import Contract

        return OpenVinoRunner(path, Contract.from_json(manifest["contract"]), precision=self.precision)

    def check(self, label, path, manifest, device, replay, report) -> None:
        """Replay the parity plan on the IR at ``path``; an IR that takes no ``explore`` input (its
        optional inputs were made constants) is checked on the deterministic path alone."""
        import dataclasses

        from policy_export.signatures.keys import EXPLORE

        with self.open(path, manifest, device) as runner:
            for key, value in runner.device_info().items():
                report.devices.setdefault(key, value)
            info = replay.formats_info.get(self.name)
            if EXPLORE not in runner.inputs and self.explores(info):
                replay = dataclasses.replace(replay, formats_info={**replay.formats_info,
                                                                   self.name: {**(info or {}), "explores": False}})
            replay.check_runner(label, self, runner, report)


FORMAT = OpenVinoFormat()
# the family's variants, each a module of this package with a FORMAT of its own
VARIANTS = ("bf16",)
