"""The parity groups: each check of the parity plan as one module with one protocol
(:class:`~exporter.parity.groups.base.ParityGroup`: made from a reference, stored in the export,
replayed on each format, reported).

    golden.py       observations sampled from the spaces, the reference's outputs on them
    recorded.py     the user's recorded observations (--observations), and their episodes stepped
    exploration.py  sampled actions compared as distributions
    stepped.py      a recurrent policy stepped with its state carried
    reference.py    a recording of what the training framework computed (a policy exported elsewhere)

:data:`GROUPS` is the registry, in the order a format replays them; a lossy format replays them in
``lossy_order`` (its records have always been made golden, stepped, recorded). Adding a group is a
module here with its class, and one entry below.
"""

from __future__ import annotations

from policy_export.exporter.parity.groups.base import ParityGroup, Stored
from policy_export.exporter.parity.groups.exploration import ExplorationGroup
from policy_export.exporter.parity.groups.golden import GoldenGroup
from policy_export.exporter.parity.groups.recorded import RecordedGroup
from policy_export.exporter.parity.groups.reference import ReferenceGroup
from policy_export.exporter.parity.groups.stepped import SteppedGroup

GROUPS: tuple[type[ParityGroup], ...] = (GoldenGroup, RecordedGroup, ExplorationGroup, SteppedGroup, ReferenceGroup)

__all__ = ["GROUPS", "ExplorationGroup", "GoldenGroup", "ParityGroup", "RecordedGroup", "ReferenceGroup",
           "SteppedGroup", "Stored", "by_name", "replay_order"]


def by_name() -> dict[str, type[ParityGroup]]:
    return {g.name: g for g in GROUPS}


def replay_order(lossy: bool) -> list[str]:
    """The groups' names in the order a format replays them (a lossy format's own order)."""
    if lossy:
        return [g.name for g in sorted((g for g in GROUPS if g.lossy_order is not None), key=lambda g: g.lossy_order)]
    return [g.name for g in sorted(GROUPS, key=lambda g: g.order)]
