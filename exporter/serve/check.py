"""``verify OUT --server triton``: the export served by a real Triton server, checked through
Triton's own clients over HTTP and gRPC like any format (golden outputs, exploration where the
server has a sampling model, the stepped sequences of a recurrent policy), a report row per
protocol and output (``triton-server/http``, ``triton-server/grpc``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.exporter.serve.client import PROTOCOLS, TritonClientRunner
from policy_export.exporter.serve.server import TritonServer, free_port
from policy_export.exporter.serve.targets import run_target
from policy_export.signatures.contract import Contract

SERVERS = ("triton",)


@dataclass
class ServerTarget(Format):
    """A live server's models over one protocol, as a format the parity plan can be replayed on."""

    server: TritonServer
    protocol: str
    contract: Contract

    def __post_init__(self):
        self.name = f"triton-server/{self.protocol}"
        self.path = ""
        self.capabilities = Capabilities(explores=any(not m.batched for m in self.server.models), default=False)

    def open(self, path: Path, manifest: Mapping[str, Any], device: Any) -> TritonClientRunner:
        return TritonClientRunner(self.server.endpoints()[self.protocol], self.protocol, self.server.models,
                                  self.contract)

    def explores(self, info) -> bool:
        return self.capabilities.explores

    def output_keys(self, contract: Contract, info) -> list[str]:
        served = {w.key for m in self.server.models for w in m.outputs}
        return [k for k in contract.output_keys if k in served]


def check_server(out: Path, doc: Mapping[str, Any], kind: str, replay, report, device: Any) -> list[str]:
    """Start a ``kind`` server on the export (free ports on 127.0.0.1), replay the plan through each
    protocol's client into ``report``, stop it; returns notes for the verify report."""
    contract = Contract.from_json(doc["contract"])
    with TritonServer.start(out, http_port=free_port(), grpc_port=free_port()) as server:
        for protocol in PROTOCOLS:
            run_target(ServerTarget(server, protocol, contract), out, doc, replay, report, device)
        models = ", ".join(f"{m.name} ({'batched' if m.batched else 'not batched'})" for m in server.models)
    notes = [f"server: Triton ({kind}) on 127.0.0.1 serving {models} through {server.engine.format}, checked "
             f"over {' and '.join(PROTOCOLS)}"]
    # the written repository too, where this verify checked its files and models (not a candidate's)
    if "triton" in doc["formats"] and "triton" not in report.errors and \
            any(r.format.split(" ")[0] == "triton" for r in report.records):
        from policy_export.exporter.serve.repository import check_repository

        notes += check_repository(out, doc, replay, report, device)
    return notes
