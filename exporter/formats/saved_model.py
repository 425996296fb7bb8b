"""``saved_model``: a TF SavedModel (tag ``serve``, signature ``serving_default``) of the policy session."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.policy.errors import InputError


class SavedModelFormat(Format):
    name = "saved_model"
    path = "saved_model"
    order = 10
    is_directory = True
    capabilities = Capabilities(reference=True)

    def write(self, ctx, target: Path):
        from policy_export.exporter import saved_model

        return saved_model.write(ctx, target)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.tf_runner import TFGraphRunner
        from policy_export.signatures.contract import Contract

        return TFGraphRunner.from_saved_model(path, device, contract=Contract.from_json(manifest["contract"]))

    def check_candidate(self, path: Path) -> None:
        if not (path / "saved_model.pb").is_file():
            raise InputError(f"candidate {self.name}={path}: not a SavedModel directory (no saved_model.pb)")


FORMAT = SavedModelFormat()
