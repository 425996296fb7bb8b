"""``triton``: a Triton Inference Server model repository under ``triton/`` for its ONNX Runtime
backend (see :mod:`.repository` for the files, :mod:`.graph` for how the models differ from
``model.onnx``). Run here by ONNX Runtime through the same feeds Triton gives the model.
Opt-in (``--formats``)."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format


class TritonFormat(Format):
    name = "triton"
    path = "triton"
    order = 70
    is_directory = True
    capabilities = Capabilities(onnx=False, default=False)

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.triton.repository import write_repository

        return write_repository(ctx, target, self.name)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.triton.runner import TritonRunner
        from policy_export.signatures.contract import Contract

        info = (manifest.get("formats") or {}).get(self.name) or {}
        return TritonRunner(path, Contract.from_json(manifest["contract"]), info, device)

    def explores(self, info) -> bool:
        return bool((info or {}).get("explores"))


FORMAT = TritonFormat()
