"""``triton``: a Triton Inference Server model repository under ``triton/`` for its ONNX Runtime
backend (see :mod:`.repository` for the files, :mod:`.graph` for how the models differ from
``model.onnx``). Run here by ONNX Runtime through the same feeds Triton gives the model.
Opt-in (``--formats``)."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import SERVED_MODEL_OPTIONS, Capabilities, Format


class TritonFormat(Format):
    name = "triton"
    options = SERVED_MODEL_OPTIONS
    path = "triton"
    order = 70
    is_directory = True
    capabilities = Capabilities(onnx=False, default=False, from_onnx=True)

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.triton.repository import write_repository

        return write_repository(ctx, target, self.name)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.triton.runner import TritonRunner
        from policy_export.signatures.contract import Contract

        info = (manifest.get("formats") or {}).get(self.name) or {}
        return TritonRunner(path, Contract.from_json(manifest["contract"]), info, device)

    inspect_order = 10
    inspect_description = "a Triton model (or a repository holding one)"
    serving_layout = True

    def find_model(self, path: Path) -> Path | None:
        return path if path.is_dir() and (path / "config.pbtxt").is_file() else None

    def read_contract(self, found: Path, signature_key: str = "serving_default", tag: str = "serve"):
        from policy_export.exporter.formats.triton.config import triton_contract

        return triton_contract(found)

    def check_candidate(self, path: Path) -> None:
        from policy_export.exporter.formats.base import refuse_links

        super().check_candidate(path)
        refuse_links(self.name, path)

    def explores(self, info) -> bool:
        return bool((info or {}).get("explores"))

    def output_keys(self, contract, info) -> list[str]:
        """The batched model's outputs and the state it returns (all of the contract's, unless only
        the deterministic model could be made)."""
        from policy_export.exporter.formats.triton.runner import model_records

        models = model_records("triton", info or {})
        batched = next((m for m in models.values() if m.get("max_batch_size")), None)
        if batched is None or not isinstance(batched.get("outputs"), list):
            return list(contract.output_keys)
        served = set(batched["outputs"]) | {o for pair in batched.get("states") or [] for o in pair[1:]}
        return [k for k in contract.output_keys if k in served]


FORMAT = TritonFormat()
