"""The parity plan an export stores in ``parity/``, so that ``verify`` replays what ``export`` proved.

``export`` builds the plan from the TF session, checks every format by running it, and writes it:

- ``parity/inputs.npz``, ``parity/outputs.npz``: the golden inputs and the session's outputs
  (deterministic actions; for policies with a Keras base model also its inputs and outputs);
- ``parity/exploration.npz`` (policies with an ``explore`` input): the probe observations
  (``probe/<key>``), how many draws each gets (``draws_per_observation``) and the session's own
  sampled actions and distribution inputs for them (``session/<key>``);
- ``parity/recorded.npz`` (``--observations``): the rows kept of the user's recorded observations
  (``inputs/<key>``), which rows of each file they are (``indices/<file number>``) and the
  session's outputs on them (``outputs/<key>``); the manifest's ``parity.recorded`` names each
  file with its sha256;
  for a recurrent policy whose files give episodes and no state, also ``stepped/``: the
  episodes kept as a stepped plan (``stepped/inputs/<key>``, ``stepped/initial_state/<i>``,
  ``stepped/serving/<key>``, each sequence's own steps ``stepped/lengths`` and which episode
  it is, ``stepped/episodes``: file number, episode number in the file, its steps, its first row);
- ``parity/stepped.npz`` (recurrent policies): the step sequences ``inputs/<key>`` as
  ``[steps, sequences, ...]`` (observations, ``prev_action``, ``prev_reward``, ``seq_lens``), the
  initial state (``initial_state/<i>``), the session's per-step outputs on its serving graph
  (``serving/<key>``) and, where it has one, on its training-time graph (``training/<key>``, the
  states at the chunk ends listed in ``training/chunk_ends``).

``verify`` loads the parts the manifest lists (``parity.plan``) and replays each against every
format, or against a candidate model file: exploration with the same two-sample tests and
thresholds, stepped parity against the stored per-step outputs. Every file is read with
``allow_pickle=False`` and checked for shape before use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.exporter import manifest
from policy_export.exporter.parity.exploration import compare_samples, draw, repeated_observations
from policy_export.exporter.parity.compare import ParityReport, Runner, Tolerances, compare, layout_record
from policy_export.exporter.parity.stepped import compare_stepped, run_stepped
from policy_export.errors import ExportError
from policy_export.policy.spaces import leaves
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import action_key, is_action, state_in_key

GOLDEN_INPUTS = "parity/inputs.npz"
GOLDEN_OUTPUTS = "parity/outputs.npz"
EXPLORATION = "parity/exploration.npz"
STEPPED = "parity/stepped.npz"
RECORDED = "parity/recorded.npz"
from policy_export.signatures.keys import ACTION_DIST_INPUTS  # noqa: E402


@dataclass
class ExplorationPlan:
    """Probe observations, each repeated ``draws_per_observation`` times, and the session's
    sampled actions (and distribution inputs) for them."""

    probe: dict[str, np.ndarray]
    draws_per_observation: int
    reference: dict[str, np.ndarray]
    action_space: gym.Space
    batch_size: int
    contract: Contract | None = None
    drawn_by: str = ""  # how the session's draws were made (exploration.draw): "head" or "network"

    @property
    def observations(self) -> int:
        return len(next(iter(self.probe.values())))

    def feeds(self) -> dict[str, np.ndarray]:
        """The probe observations, each repeated ``draws_per_observation`` times (row-major)."""
        return repeated_observations(self.probe, self.observations, self.observations * self.draws_per_observation)

    @classmethod
    def make(cls, run: Runner, probe: Mapping[str, np.ndarray], samples: int, action_space: gym.Space,
             batch_size: int, contract: Contract) -> "ExplorationPlan":
        """Sample the reference draws with ``run`` (the session) for ``probe``: ``samples`` draws in all."""
        per = math.ceil(samples / len(next(iter(probe.values()))))
        plan = cls(dict(probe), per, {}, action_space, batch_size, contract)
        drawn, plan.drawn_by = draw(run, plan.probe, per, batch_size)
        plan.reference = {k: v for k, v in drawn.items() if k in plan.compared_keys(drawn)}
        return plan

    def compared_keys(self, outputs: Mapping[str, Any]) -> list[str]:
        n = len(list(leaves(self.action_space)))
        return [k for k in [*(action_key(i) for i in range(n)), ACTION_DIST_INPUTS] if k in outputs]

    def check(self, fmt: str, runner: Runner, tolerances: Tolerances, report: ParityReport) -> dict[str, np.ndarray]:
        """Sample with ``runner`` and add the two-sample tests (and the numeric comparison of
        ``action_dist_inputs``) to ``report``; returns the runner's draws."""
        got, how = draw(runner, self.probe, self.draws_per_observation, self.batch_size)
        label = f"{fmt} (explore)"
        actions = [k for k in self.reference if is_action(k)]
        bad = [r for r in (layout_record(label, k, self.reference[k], got.get(k), tolerances, self.contract)
                           for k in actions) if r is not None]
        if bad:  # a missing output or another dtype or shape: no distribution test can be made
            report.records.extend(bad)
            return got
        report.exploration.extend(compare_samples(fmt, self.action_space, self.observations, self.reference, got,
                                                  drawn_by=how))
        if ACTION_DIST_INPUTS in self.reference:
            report.records.extend(compare(label, self.reference, got, tolerances, [ACTION_DIST_INPUTS], self.contract))
        return got

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {**{f"probe/{k}": v for k, v in self.probe.items()},
                "draws_per_observation": np.array(self.draws_per_observation, np.int64),
                **{f"session/{k}": v for k, v in self.reference.items()}}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], action_space: gym.Space, batch_size: int,
                    contract: Contract, where: str) -> "ExplorationPlan":
        """Raises:
            ExportError: the arrays are not an exploration plan for this action space and contract."""
        probe, reference = _prefixed(arrays, "probe/"), _prefixed(arrays, "session/")
        per = arrays.get("draws_per_observation")
        if not probe or per is None or per.shape != () or not np.issubdtype(per.dtype, np.integer) or int(per) < 1:
            raise ExportError(f"{where}: expected probe/<input> arrays and a positive draws_per_observation")
        plan = cls(probe, int(per), reference, action_space, batch_size, contract)
        _check_rows(where, "probe", probe, plan.observations)
        wanted = [action_key(i) for i in range(len(list(leaves(action_space))))]
        missing = [k for k in wanted if k not in reference]
        if missing:
            raise ExportError(f"{where}: the session's draws {missing} are missing")
        _check_rows(where, "session", reference, plan.observations * plan.draws_per_observation)
        _check_against_contract(where, "probe", probe, contract, inputs=True)
        _check_against_contract(where, "session", reference, contract, inputs=False)
        return plan


@dataclass
class SteppedPlan:
    """Step sequences for a recurrent policy and the session's per-step outputs."""

    inputs: dict[str, np.ndarray]
    initial_state: list[np.ndarray]
    serving: dict[str, np.ndarray]
    training: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: np.ndarray | None = None  # recorded episodes: each sequence's own steps (the rest is padding)
    group: str = "stepped"  # the records' label: "<format> (<group> <steps>)"

    @property
    def steps(self) -> int:
        return len(next(iter(self.inputs.values())))

    @property
    def label(self) -> str:
        return f"{self.group} {self.steps}"

    def check(self, fmt: str, runner: Runner, tolerances: Tolerances, report: ParityReport,
              keys: Sequence[str]) -> None:
        """Step ``runner`` through the sequences (feeding back its own state) and compare every
        step with the session's serving graph and, where stored, its training-time graph."""
        got = run_stepped(runner, self.inputs, self.initial_state)
        report.records.extend(compare_stepped(f"{fmt} ({self.label})", self.serving, got, tolerances,
                                              list(keys), self.lengths))
        if self.training:
            report.records.extend(compare_stepped(f"{fmt} (stepped {self.steps} vs sequences)", self.training, got,
                                                  tolerances, list(keys)))

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {**{f"inputs/{k}": v for k, v in self.inputs.items()},
                **{f"initial_state/{i}": s for i, s in enumerate(self.initial_state)},
                **{f"serving/{k}": v for k, v in self.serving.items()},
                **{f"training/{k}": v for k, v in self.training.items()},
                **({"lengths": np.asarray(self.lengths, np.int64)} if self.lengths is not None else {})}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], contract: Contract, where: str) -> "SteppedPlan":
        """Raises:
            ExportError: the arrays are not a stepped plan for this contract."""
        inputs, serving = _prefixed(arrays, "inputs/"), _prefixed(arrays, "serving/")
        states = _prefixed(arrays, "initial_state/")
        if not inputs or not serving or not states:
            raise ExportError(f"{where}: expected inputs/, initial_state/ and serving/ arrays")
        try:
            initial = [states[str(i)] for i in range(len(states))]
        except KeyError:
            raise ExportError(f"{where}: initial_state/ must be numbered 0..{len(states) - 1}") from None
        plan = cls(inputs, initial, serving, _prefixed(arrays, "training/"))
        first = next(iter(inputs.values()))
        if first.ndim < 2:
            raise ExportError(f"{where}: inputs must be [steps, sequences, ...]")
        for name, group in (("inputs", inputs), ("serving", serving)):
            bad = sorted(k for k, v in group.items() if v.shape[:2] != first.shape[:2])
            if bad:
                raise ExportError(f"{where}: {name} {bad} are not [{first.shape[0]}, {first.shape[1]}, ...]")
        unknown = sorted(set(inputs) - set(contract.input_keys))
        if unknown or any(state_in_key(i) not in contract.input_keys for i in range(len(initial))):
            raise ExportError(f"{where}: inputs {unknown or 'state'} do not fit the contract's inputs")
        lengths = arrays.get("lengths")
        if lengths is not None:
            if lengths.shape != first.shape[1:2] or lengths.dtype.kind not in "iu" or len(lengths) == 0 \
                    or lengths.min() < 1 or lengths.max() > first.shape[0]:
                raise ExportError(f"{where}: lengths must be [{first.shape[1]}] steps between 1 and {first.shape[0]}")
            plan.lengths = lengths
        return plan


@dataclass
class RecordedPlan:
    """The user's recorded observations (the rows kept) and the session's outputs on them."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    indices: list[np.ndarray] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    stepped: SteppedPlan | None = None  # a recurrent policy's recorded episodes, stepped with state carried
    episodes: np.ndarray | None = None  # [sequences, 4]: file number, episode number, its steps, its first row

    @property
    def rows(self) -> int:
        return len(next(iter(self.inputs.values())))

    def to_arrays(self) -> dict[str, np.ndarray]:
        stepped = {} if self.stepped is None else {
            **{f"stepped/{k}": v for k, v in self.stepped.to_arrays().items()},
            "stepped/episodes": np.asarray(self.episodes, np.int64)}
        return {**{f"inputs/{k}": v for k, v in self.inputs.items()},
                **{f"outputs/{k}": v for k, v in self.outputs.items()},
                **{f"indices/{i}": np.asarray(rows, np.int64) for i, rows in enumerate(self.indices)},
                **stepped}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], contract: Contract, record: Any,
                    where: str) -> "RecordedPlan":
        """Raises:
            ExportError: the arrays are not recorded rows for this contract."""
        inputs, outputs = _prefixed(arrays, "inputs/"), _prefixed(arrays, "outputs/")
        if not inputs or not outputs:
            raise ExportError(f"{where}: expected inputs/ and outputs/ arrays")
        indices = _prefixed(arrays, "indices/")
        plan = cls(inputs, outputs, [indices[k] for k in sorted(indices, key=lambda k: int(k) if k.isdigit() else -1)],
                   record if isinstance(record, dict) else {})
        _check_rows(where, "inputs", inputs, plan.rows)
        _check_rows(where, "outputs", outputs, plan.rows)
        _check_against_contract(where, "inputs", inputs, contract, inputs=True)
        _check_against_contract(where, "outputs", outputs, contract, inputs=False)
        stepped = _prefixed(arrays, "stepped/")
        if stepped:
            plan.stepped = SteppedPlan.from_arrays(stepped, contract, f"{where} stepped/")
            plan.stepped.group = "recorded stepped"
            episodes = stepped.get("episodes")
            n = 0 if plan.stepped.lengths is None else len(plan.stepped.lengths)
            if not n or episodes is None or episodes.shape != (n, 4) or episodes.dtype.kind not in "iu":
                raise ExportError(f"{where}: stepped/ needs lengths and episodes [{n}, 4]")
            plan.episodes = episodes
        return plan


@dataclass
class ParityPlan:
    """Everything ``export`` checked and ``verify`` replays; the parts a policy has no use for are None."""

    golden_inputs: dict[str, np.ndarray]
    golden_outputs: dict[str, np.ndarray]
    exploration: ExplorationPlan | None = None
    stepped: SteppedPlan | None = None
    recorded: RecordedPlan | None = None

    def describe(self) -> list[str]:
        """One line per part: what is replayed, or why a part is absent."""
        samples = len(next(iter(self.golden_inputs.values()))) if self.golden_inputs else 0
        lines = [f"golden: {samples} samples, deterministic outputs"]
        if self.exploration is not None:
            e = self.exploration
            lines.append(f"exploration: {e.observations} observations x {e.draws_per_observation} draws "
                         "vs the session's stored draws")
        else:
            lines.append("exploration: none in the plan")
        if self.stepped is not None:
            s = self.stepped
            seqs = next(iter(s.inputs.values())).shape[1]
            lines.append(f"stepped: {seqs} sequences x {s.steps} steps vs the session's per-step outputs"
                         + (" and its training-time graph" if s.training else ""))
        else:
            lines.append("stepped: none in the plan")
        if self.recorded is not None:
            r = self.recorded.record
            files = ", ".join(f"{f.get('path')} ({f.get('kept')} of {f.get('rows')} rows)" for f in r.get("files", []))
            lines.append(f"recorded: {self.recorded.rows} rows of your observations ({files}; "
                         f"{r.get('out_of_bounds', 0)} outside the space's bounds)")
            if self.recorded.stepped is not None:
                s = self.recorded.stepped
                lines.append(f"recorded stepped: {len(s.lengths)} episodes x at most {s.steps} steps "
                             f"({int(s.lengths.sum())} steps) vs the session's per-step outputs, state carried")
        return lines


def write_plan(root: Path, plan: ParityPlan) -> None:
    """Write the plan's files under ``root`` (``parity/`` must exist)."""
    manifest.save_npz(root / GOLDEN_INPUTS, plan.golden_inputs)
    manifest.save_npz(root / GOLDEN_OUTPUTS, plan.golden_outputs)
    if plan.exploration is not None:
        manifest.save_npz(root / EXPLORATION, plan.exploration.to_arrays(), compressed=True)
    if plan.stepped is not None:
        manifest.save_npz(root / STEPPED, plan.stepped.to_arrays(), compressed=True)
    if plan.recorded is not None:
        manifest.save_npz(root / RECORDED, plan.recorded.to_arrays(), compressed=True)


def manifest_record(plan: ParityPlan) -> dict[str, Any]:
    """What the manifest says about the plan (``parity.plan``): the file of each part, or None."""
    return {"golden": [GOLDEN_INPUTS, GOLDEN_OUTPUTS],
            "exploration": EXPLORATION if plan.exploration is not None else None,
            "stepped": STEPPED if plan.stepped is not None else None,
            "recorded": RECORDED if plan.recorded is not None else None}


def planned_files(doc: Mapping[str, Any]) -> dict[str, str | None]:
    """The plan's parts and files as the manifest records them. An export made before the plan
    was stored (no ``parity.plan``) has the golden part only.

    Raises:
        ExportError: ``parity.plan`` names a file the manifest does not list, or is malformed.
    """
    record = (doc.get("parity") or {}).get("plan") if isinstance(doc.get("parity"), dict) else None
    parts: dict[str, str | None] = {"exploration": None, "stepped": None, "recorded": None}
    if record is None:
        return parts
    if not isinstance(record, dict):
        raise ExportError("manifest parity.plan: expected an object")
    listed = {f["path"] for f in doc["files"]}
    expected = {"exploration": EXPLORATION, "stepped": STEPPED, "recorded": RECORDED}
    for part, path in expected.items():
        value = record.get(part)
        if value is None:
            continue
        if value != path:
            raise ExportError(f"manifest parity.plan.{part}: expected {path!r} or null, got {value!r}")
        if value not in listed:
            raise ExportError(f"manifest parity.plan.{part} names {value}, which the manifest's files do not list")
        parts[part] = value
    return parts


def load_plan(root: Path, doc: Mapping[str, Any], check: manifest.FileCheck, action_space: gym.Space,
              contract: Contract, batch_size: int) -> ParityPlan:
    """The stored plan of the export at ``root``, every file checked against its hash first.

    Raises:
        ExportError: a plan file failed its hash check, or cannot be used (named).
    """
    parts = planned_files(doc)
    for path in [GOLDEN_INPUTS, GOLDEN_OUTPUTS, *(p for p in parts.values() if p)]:
        if not check.trusted(path):
            raise ExportError(f"{path} not loaded: it failed the hash check")
    golden_in = manifest.load_npz(root / GOLDEN_INPUTS)
    golden_out = manifest.load_npz(root / GOLDEN_OUTPUTS)
    if not golden_in or not golden_out:
        raise ExportError(f"{GOLDEN_INPUTS} and {GOLDEN_OUTPUTS} must hold arrays")
    plan = ParityPlan(golden_in, golden_out)
    if parts["exploration"]:
        plan.exploration = ExplorationPlan.from_arrays(manifest.load_npz(root / EXPLORATION), action_space,
                                                       batch_size, contract, EXPLORATION)
    if parts["stepped"]:
        plan.stepped = SteppedPlan.from_arrays(manifest.load_npz(root / STEPPED), contract, STEPPED)
    if parts["recorded"]:
        record = (doc.get("parity") or {}).get("recorded")
        plan.recorded = RecordedPlan.from_arrays(manifest.load_npz(root / RECORDED), contract, record, RECORDED)
    return plan


def _prefixed(arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _check_rows(where: str, name: str, group: Mapping[str, np.ndarray], rows: int) -> None:
    bad = sorted(k for k, v in group.items() if v.ndim == 0 or len(v) != rows)
    if bad:
        raise ExportError(f"{where}: {name} arrays {bad} do not have {rows} rows")


def _check_against_contract(where: str, name: str, group: Mapping[str, np.ndarray], contract: Contract,
                            inputs: bool) -> None:
    specs = {s.key: s for s in (contract.inputs if inputs else contract.outputs)}
    for key, value in group.items():
        spec = specs.get(key)
        if spec is None:
            raise ExportError(f"{where}: {name}/{key} is not an {'input' if inputs else 'output'} of the contract")
        if value.dtype != np.dtype(spec.dtype) or value.ndim != len(spec.shape):
            raise ExportError(f"{where}: {name}/{key} is {value.dtype.name} of rank {value.ndim}; the contract says "
                              f"{spec.dtype} {spec.shape_text()}")


