"""``onnx``: ``model.onnx``, every signature output, with the explore branch; run by ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format


class OnnxFile:
    """What every format of the ONNX family shares: its model file passes the ONNX door
    (:func:`.trust.check_file`: no link, external data beside it, declared sizes, node budget,
    onnx's checker) before anything parses it."""

    def check_model(self, path: Path) -> None:
        from policy_export.exporter.formats.onnx.trust import check_file

        check_file(Path(path))


class OnnxFormat(OnnxFile, Format):
    name = "onnx"
    path = "model.onnx"
    order = 30
    capabilities = Capabilities(onnx=True, from_onnx=True)

    def write(self, ctx, target: Path):
        from policy_export.exporter.formats.onnx import model as onnx_model

        return onnx_model.write(ctx, target)

    inspect_order = 30
    inspect_description = "a .onnx file"

    def find_model(self, path: Path) -> Path | None:
        return path if path.is_file() and path.suffix == ".onnx" else None

    def read_contract(self, found: Path, signature_key: str = "serving_default", tag: str = "serve"):
        from policy_export.exporter.formats.onnx.model import onnx_contract

        return onnx_contract(found)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.onnx.model import OnnxRunner
        from policy_export.signatures.contract import Contract

        return OnnxRunner(path, device, contract=Contract.from_json(manifest["contract"]))


FORMAT = OnnxFormat()
# the family's variants, each a module of this package with a FORMAT of its own
VARIANTS = ("deterministic", "int8", "fp16", "explore")
