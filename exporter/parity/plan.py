"""The parity plan an export stores in ``parity/``, so that ``verify`` replays what ``export`` proved.

The plan is its groups (:mod:`exporter.parity.groups`), each made from the reference at export,
written to its own files and listed in the manifest's ``parity.plan``:

- ``parity/inputs.npz``, ``parity/outputs.npz`` (golden): the golden inputs and the reference's
  outputs (deterministic actions; for policies with a Keras base model also its inputs and outputs);
- ``parity/exploration.npz`` (policies with an ``explore`` input): the probe observations
  (``probe/<key>``), how many draws each gets (``draws_per_observation``) and the session's own
  sampled actions and distribution inputs for them (``session/<key>``);
- ``parity/recorded.npz`` (``--observations``): the rows kept of the user's recorded observations
  (``inputs/<key>``), which rows of each file they are (``indices/<file number>``) and the
  session's outputs on them (``outputs/<key>``); the manifest's ``parity.recorded`` names each
  file with its sha256; for a recurrent policy whose files give episodes and no state, also
  ``stepped/``: the episodes kept as a stepped plan (``stepped/inputs/<key>``,
  ``stepped/initial_state/<i>``, ``stepped/serving/<key>``, each sequence's own steps
  ``stepped/lengths`` and which episode it is, ``stepped/episodes``: file number, episode number in
  the file, its steps, its first row);
- ``parity/stepped.npz`` (recurrent policies): the step sequences ``inputs/<key>`` as
  ``[steps, sequences, ...]`` (observations, ``prev_action``, ``prev_reward``, ``seq_lens``), the
  initial state (``initial_state/<i>``), the session's per-step outputs on its serving graph
  (``serving/<key>``) and, where it has one, on its training-time graph (``training/<key>``, the
  states at the chunk ends listed in ``training/chunk_ends``);
- ``parity/reference.npz`` (a policy exported elsewhere): the recording of its framework's
  outputs (``inputs/<key>``, ``outputs/<key>``, ``episode_ids``, ``state_pairs/<i>``).

``verify`` loads the groups the manifest lists (``parity.plan``) and replays each against every
format, or against a candidate model file. Every file is read with ``allow_pickle=False`` and
checked for shape before use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.exporter import manifest
from policy_export.exporter.parity.groups import GROUPS, ParityGroup, Stored, by_name, replay_order
from policy_export.exporter.parity.groups.exploration import EXPLORATION, ExplorationGroup
from policy_export.exporter.parity.groups.golden import GOLDEN_INPUTS, GOLDEN_OUTPUTS, GoldenGroup
from policy_export.exporter.parity.groups.recorded import RECORDED, RecordedGroup
from policy_export.exporter.parity.groups.stepped import STEPPED, SteppedGroup
from policy_export.errors import ExportError
from policy_export.signatures.contract import Contract

__all__ = ["EXPLORATION", "GOLDEN_INPUTS", "GOLDEN_OUTPUTS", "RECORDED", "STEPPED", "ParityPlan", "golden_planned",
           "load_plan", "manifest_record", "planned_files", "write_plan"]
# the names the plan's parts had before they were groups
ExplorationPlan, SteppedPlan, RecordedPlan = ExplorationGroup, SteppedGroup, RecordedGroup


class ParityPlan:
    """Everything ``export`` checked and ``verify`` replays: its groups by name (a part a policy
    has no use for is absent)."""

    def __init__(self, golden_inputs: dict[str, np.ndarray] | None = None,
                 golden_outputs: dict[str, np.ndarray] | None = None, **groups: ParityGroup | None):
        self.groups: dict[str, ParityGroup] = {}
        if golden_inputs is not None:
            self.add(GoldenGroup(golden_inputs, golden_outputs or {}))
        for group in groups.values():
            if group is not None:
                self.add(group)

    def add(self, group: ParityGroup) -> None:
        self.groups[group.name] = group

    def replayed(self, lossy: bool) -> list[ParityGroup]:
        """The groups a format replays, in its order."""
        return [self.groups[name] for name in replay_order(lossy) if name in self.groups]

    # the groups the pipelines name
    def _get(self, name: str) -> Any:
        return self.groups.get(name)

    def _set(self, name: str, group: ParityGroup | None) -> None:
        if group is None:
            self.groups.pop(name, None)
        else:
            self.groups[name] = group

    golden = property(lambda self: self._get("golden"))
    exploration = property(lambda self: self._get("exploration"), lambda self, g: self._set("exploration", g))
    stepped = property(lambda self: self._get("stepped"), lambda self, g: self._set("stepped", g))
    recorded = property(lambda self: self._get("recorded"), lambda self, g: self._set("recorded", g))
    reference = property(lambda self: self._get("reference"), lambda self, g: self._set("reference", g))

    @property
    def golden_inputs(self) -> dict[str, np.ndarray]:
        return self.golden.inputs if self.golden is not None else {}

    @property
    def golden_outputs(self) -> dict[str, np.ndarray]:
        return self.golden.outputs if self.golden is not None else {}

    @property
    def rows(self) -> int:
        """The rows the plan's first group holds: the golden inputs, else the recording's."""
        if self.golden is not None:
            return len(next(iter(self.golden.inputs.values()), ()))
        reference = self.reference
        return reference.recorded_rows if reference is not None else 0

    def describe(self) -> list[str]:
        """One line per group: what is replayed, or why a part is absent."""
        lines = []
        for cls in sorted(GROUPS, key=lambda g: _DESCRIBED.index(g.name) if g.name in _DESCRIBED else 99):
            group = self.groups.get(cls.name)
            if group is not None:
                lines += group.describe()
            elif cls.name in ("exploration", "stepped") and self.golden is not None:
                lines.append(f"{cls.name}: none in the plan")
        return lines


_DESCRIBED = ("golden", "exploration", "stepped", "recorded", "reference")  # the order verify prints them in


def write_plan(root: Path, plan: ParityPlan) -> None:
    """Write each group's files under ``root`` (``parity/`` must exist)."""
    for group in plan.groups.values():
        group.write(root)


def manifest_record(plan: ParityPlan) -> dict[str, Any]:
    """What the manifest says about the plan (``parity.plan``): each group's file, or None (a group
    not ``listed_when_absent`` only when present)."""
    record: dict[str, Any] = {}
    for cls in GROUPS:
        group = plan.groups.get(cls.name)
        if group is not None:
            record[cls.name] = group.manifest_entry()
        elif cls.listed_when_absent:
            record[cls.name] = None
    return record


def golden_planned(doc: Mapping[str, Any]) -> bool:
    """Whether the export keeps golden files: every export this package builds (and one made
    before the plan was recorded); not one of a policy exported elsewhere (its recording instead)."""
    record = (doc.get("parity") or {}).get("plan") if isinstance(doc.get("parity"), dict) else None
    return not isinstance(record, dict) or record.get("golden") is not None


def planned_files(doc: Mapping[str, Any]) -> dict[str, str | None]:
    """The plan's groups (besides golden) and their files as the manifest records them. An export
    made before the plan was stored (no ``parity.plan``) has the golden group only.

    Raises:
        ExportError: ``parity.plan`` names a file the manifest does not list, or is malformed.
    """
    record = (doc.get("parity") or {}).get("plan") if isinstance(doc.get("parity"), dict) else None
    parts: dict[str, str | None] = {cls.name: None for cls in GROUPS if cls is not GoldenGroup}
    if record is None:
        return parts
    if not isinstance(record, dict):
        raise ExportError("manifest parity.plan: expected an object")
    listed = {f["path"] for f in doc["files"]}
    for cls in GROUPS:
        if cls is GoldenGroup:
            continue
        value, path = record.get(cls.name), cls.files[0]
        if value is None:
            continue
        if value != path:
            raise ExportError(f"manifest parity.plan.{cls.name}: expected {path!r} or null, got {value!r}")
        if value not in listed:
            raise ExportError(f"manifest parity.plan.{cls.name} names {value}, which the manifest's files do not list")
        parts[cls.name] = value
    return parts


def load_plan(root: Path, doc: Mapping[str, Any], check: manifest.FileCheck, action_space: gym.Space,
              contract: Contract, batch_size: int) -> ParityPlan:
    """The stored plan of the export at ``root``, every file checked against its hash first.

    Raises:
        ExportError: a plan file failed its hash check, or cannot be used (named).
    """
    parts = planned_files(doc)
    golden = list(GoldenGroup.files) if golden_planned(doc) else []
    for path in [*golden, *(p for p in parts.values() if p)]:
        if not check.trusted(path):
            raise ExportError(f"{path} not loaded: it failed the hash check")
    parity = doc.get("parity") if isinstance(doc.get("parity"), dict) else {}
    plan = ParityPlan()
    groups = by_name()
    if golden:
        plan.add(GoldenGroup.load(root, Stored(action_space, contract, batch_size, None, doc)))
    for name, path in parts.items():
        if path:
            stored = Stored(action_space, contract, batch_size, parity.get(name), doc)
            plan.add(groups[name].load(root, stored))
    return plan
