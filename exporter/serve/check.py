"""``verify OUT --server triton``: the export served as ``serve`` serves it (its ``triton/``
repository on a real ``tritonserver``, behind the package's HTTP and gRPC fronts), checked through
Triton's own clients like any format: golden outputs and exploration (through the sampling model)
for feed-forward policies, the stepped sequences of a recurrent policy with the server keeping the
state; a report row per protocol and output (``triton-server/http``, ``triton-server/grpc``). A
repository the server is not given (a model, version or file its manifest record does not account
for) or refuses fails the ``triton-repository`` check with the reason."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.exporter.serve.client import PROTOCOLS, RepositoryClient
from policy_export.exporter.serve.server import TritonServer, free_port
from policy_export.exporter.serve.targets import run_target
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import is_state_out

SERVERS = ("triton",)
REPOSITORY_CHECK = "triton-repository"


@dataclass
class ServerTarget(Format):
    """``serve``'s models over one protocol, as a format the parity plan can be replayed on."""

    server: TritonServer
    protocol: str
    contract: Contract

    def __post_init__(self):
        self.name = f"triton-server/{self.protocol}"
        self.path = ""
        self.recurrent = any(m.sequence for m in self.server.models)
        self.capabilities = Capabilities(explores=any(m.samples for m in self.server.models), default=False)

    def open(self, path: Path, manifest: Mapping[str, Any], device: Any) -> RepositoryClient:
        return RepositoryClient(self.server.endpoints()[self.protocol], self.protocol, self.server.models,
                                self.contract)

    def explores(self, info) -> bool:
        return self.capabilities.explores

    def output_keys(self, contract: Contract, info) -> list[str]:
        served = {w.key for m in self.server.models if not m.samples for w in m.outputs}
        return [k for k in contract.output_keys if k in served]

    def check(self, label, path, manifest, device, replay, report) -> None:
        if not self.recurrent:
            return super().check(label, path, manifest, device, replay, report)
        reference = replay.plan.reference
        if reference is not None:  # a policy exported elsewhere: its recorded episodes, stepped
            with self.open(path, manifest, device) as runner:
                reference.check(label, self, runner, replay, report)
            return None
        if replay.plan.stepped is None:  # the server keeps the state: only whole sequences can be replayed
            return None
        with self.open(path, manifest, device) as runner:
            replay.plan.stepped.check_steps(label, runner, replay.tolerances, report,
                                      [k for k in self.output_keys(self.contract, None) if not is_state_out(k)])
        return None


def check_server(out: Path, doc: Mapping[str, Any], kind: str, replay, report, device: Any) -> list[str]:
    """Start ``serve``'s server on the export (free ports of 127.0.0.1), replay the plan through each
    protocol's client into ``report``, stop it; returns notes for the verify report."""
    from policy_export.errors import PolicyExportError

    contract = Contract.from_json(doc["contract"])
    try:
        server = TritonServer.start(out, http_port=free_port(), grpc_port=free_port())
    except PolicyExportError as e:
        report.errors[REPOSITORY_CHECK] = f"{type(e).__name__}: {str(e)[:500]}"
        return [f"triton repository: not served ({str(e)[:200]})"]
    with server:
        for protocol in PROTOCOLS:
            run_target(ServerTarget(server, protocol, contract), out, doc, replay, report, device)
        models = ", ".join(f"{m.name} ({'sequence batching' if m.sequence else 'batched' if m.batched else 'not batched'})"
                           for m in server.models)
        recurrent = any(m.sequence for m in server.models)
        if replay.plan.reference is not None:
            what = "the stored recording" + (" (episodes stepped, the server keeping the state)" if recurrent else "")
        elif recurrent:
            what = "the stepped sequences (the server keeping the state)"
        else:
            what = "the golden outputs" + (" and exploration" if any(m.samples for m in server.models) else "")
        source = "written by serve" if server.repository.written else "the export's triton/"
    return [f"server: Triton ({kind}) on 127.0.0.1 serving {models} from {source} (the package's stand-in for "
            f"the ONNX Runtime backend), {what} checked over {' and '.join(PROTOCOLS)} through serve's fronts"]
