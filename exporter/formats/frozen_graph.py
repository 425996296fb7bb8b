"""``frozen_graph``: the frozen inference GraphDef, variables folded into constants; run by the
manifest's tensor names."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, Format


class FrozenGraphFormat(Format):
    name = "frozen_graph"
    path = "frozen_graph.pb"
    order = 20
    capabilities = Capabilities(reference=True)

    def write(self, ctx, target: Path):
        from policy_export.exporter import frozen_graph

        return frozen_graph.write(ctx, target)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.tf_runner import TFGraphRunner
        from policy_export.signatures.contract import Contract

        return TFGraphRunner.from_graph_def(path, manifest["tensor_names"], device,
                                            contract=Contract.from_json(manifest["contract"]))


FORMAT = FrozenGraphFormat()
