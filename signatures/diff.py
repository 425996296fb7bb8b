"""Compare two contracts: what a deployed client would notice.

Breaking (a client written against OLD may fail or behave differently with NEW):
a removed input or output; a changed dtype, rank or fixed dimension; a new required input; an
optional input that became required; a changed default of an optional input.
Compatible: an added output; an added optional input; a required input that became optional.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from policy_export.signatures.contract import Contract, TensorSpec

BREAKING, COMPATIBLE = "breaking", "compatible"


@dataclass(frozen=True)
class Change:
    kind: str  # "breaking" or "compatible"
    side: str  # "input" or "output"
    key: str
    what: str

    def describe(self) -> str:
        return f"{self.kind}: {self.side} {self.key!r} {self.what}"


@dataclass(frozen=True)
class ContractDiff:
    changes: list[Change]

    @property
    def breaking(self) -> list[Change]:
        return [c for c in self.changes if c.kind == BREAKING]

    @property
    def compatible(self) -> bool:
        return not self.breaking

    def summary(self) -> str:
        if not self.changes:
            return "contracts are identical"
        n = len(self.breaking)
        head = f"{n} breaking change(s)" if n else "compatible"
        return head + ": " + "; ".join(c.describe() for c in self.changes)

    def to_json(self) -> dict[str, Any]:
        return {"compatible": self.compatible, "breaking": len(self.breaking),
                "changes": [asdict(c) for c in self.changes]}


def diff_contracts(old: Contract, new: Contract) -> ContractDiff:
    """Every change from ``old`` to ``new``, each classed breaking or compatible."""
    changes: list[Change] = []
    old_in, new_in = {s.key: s for s in old.inputs}, {s.key: s for s in new.inputs}
    old_out, new_out = {s.key: s for s in old.outputs}, {s.key: s for s in new.outputs}
    for key in old_in.keys() - new_in.keys():
        changes.append(Change(BREAKING, "input", key, "was removed"))
    for key in new_in.keys() - old_in.keys():
        spec = new_in[key]
        if spec.required:
            changes.append(Change(BREAKING, "input", key, "was added as a required input"))
        else:
            changes.append(Change(COMPATIBLE, "input", key, f"was added as an optional input (default {spec.default!r})"))
    for key in old_out.keys() - new_out.keys():
        changes.append(Change(BREAKING, "output", key, "was removed"))
    for key in new_out.keys() - old_out.keys():
        changes.append(Change(COMPATIBLE, "output", key, "was added"))
    for key in old_in.keys() & new_in.keys():
        changes.extend(_tensor_changes("input", old_in[key], new_in[key]))
        a, b = old_in[key], new_in[key]
        if not a.required and b.required:
            changes.append(Change(BREAKING, "input", key, "became required"))
        elif a.required and not b.required:
            changes.append(Change(COMPATIBLE, "input", key, f"became optional (default {b.default!r})"))
        elif not a.required and a.default != b.default:
            changes.append(Change(BREAKING, "input", key, f"default changed from {a.default!r} to {b.default!r}"))
    for key in old_out.keys() & new_out.keys():
        changes.extend(_tensor_changes("output", old_out[key], new_out[key]))
    order = {BREAKING: 0, COMPATIBLE: 1}
    return ContractDiff(sorted(changes, key=lambda c: (order[c.kind], c.side, c.key)))


def _tensor_changes(side: str, a: TensorSpec, b: TensorSpec) -> list[Change]:
    out = []
    if a.dtype != b.dtype:
        out.append(Change(BREAKING, side, a.key, f"dtype changed from {a.dtype} to {b.dtype}"))
    if len(a.shape) != len(b.shape):
        out.append(Change(BREAKING, side, a.key, f"rank changed from {len(a.shape)} to {len(b.shape)} "
                                                 f"({a.shape_text()} -> {b.shape_text()})"))
        return out
    for i, (x, y) in enumerate(zip(a.shape, b.shape)):
        if x != y:
            out.append(Change(BREAKING, side, a.key, f"dimension {i} changed from {x if x is not None else '?'} "
                                                     f"to {y if y is not None else '?'}"))
    return out
