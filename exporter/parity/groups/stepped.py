"""The stepped group (recurrent policies): a few sequences stepped one call at a time with the
state carried (``parity/stepped.npz``), every format stepped through the same inputs feeding back
its own state and compared at every step with the reference's serving graph and, where the session
has one, its training-time graph (:mod:`exporter.parity.stepped`). A lossy format is judged by its
behavioural thresholds over the steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from policy_export.errors import ExportError
from policy_export.exporter.parity.compare import ParityReport, Runner, Tolerances
from policy_export.exporter.parity.groups.base import ParityGroup, Stored, prefixed
from policy_export.exporter.parity.stepped import compare_stepped, run_stepped, run_training_graph, stepped_inputs
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import state_in_key

STEPPED = "parity/stepped.npz"


@dataclass
class SteppedGroup(ParityGroup):
    """Step sequences for a recurrent policy and the reference's per-step outputs."""

    inputs: dict[str, np.ndarray]
    initial_state: list[np.ndarray]
    serving: dict[str, np.ndarray]
    training: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: np.ndarray | None = None  # recorded episodes: each sequence's own steps (the rest is padding)
    group: str = "stepped"  # the records' label: "<format> (<group> <steps>)"

    name = "stepped"
    files = (STEPPED,)
    order, lossy_order = 3, 1

    @classmethod
    def make(cls, reference, steps: int, sequences: int, seed: int) -> "SteppedGroup":
        """``sequences`` sequences of ``steps`` steps sampled as parity samples, stepped by the
        reference from its initial state, and run through its training-time graph."""
        policy = reference.policy
        inputs = stepped_inputs(policy, reference.contract, steps, sequences, seed)
        initial = policy.get_initial_state()
        return cls(inputs, initial, run_stepped(reference.run, inputs, initial),
                   run_training_graph(policy, inputs, policy.sequence_graph_chunk))

    @property
    def steps(self) -> int:
        return len(next(iter(self.inputs.values())))

    @property
    def label(self) -> str:
        return f"{self.group} {self.steps}"

    def rows(self, fmt) -> int:
        first = next(iter(self.inputs.values()))
        return first.shape[0] * first.shape[1] if fmt.capabilities.steps_state else 0

    def check(self, label: str, fmt, runner, replay, report) -> None:
        if not fmt.capabilities.steps_state:
            return
        keys = replay.output_keys(fmt)
        if fmt.capabilities.lossy:
            from policy_export.exporter.parity.behaviour import compare_behaviour

            steps = run_stepped(runner, self.inputs, self.initial_state)
            report.behaviour.extend(compare_behaviour(f"{label} (stepped {self.steps})", self.serving, steps, keys,
                                                      replay.action_space, replay.thresholds(fmt), stepped=True))
            return
        self.check_steps(label, runner, replay.tolerances, report, keys)

    def check_steps(self, fmt: str, runner: Runner, tolerances: Tolerances, report: ParityReport,
                    keys: Sequence[str]) -> None:
        """Step ``runner`` through the sequences (feeding back its own state) and compare every
        step with the reference's serving graph and, where stored, its training-time graph."""
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
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], stored: Stored | Contract, where: str) -> "SteppedGroup":
        """Raises:
            ExportError: the arrays are not a stepped plan for this contract."""
        contract = stored.contract if isinstance(stored, Stored) else stored
        inputs, serving = prefixed(arrays, "inputs/"), prefixed(arrays, "serving/")
        states = prefixed(arrays, "initial_state/")
        if not inputs or not serving or not states:
            raise ExportError(f"{where}: expected inputs/, initial_state/ and serving/ arrays")
        try:
            initial = [states[str(i)] for i in range(len(states))]
        except KeyError:
            raise ExportError(f"{where}: initial_state/ must be numbered 0..{len(states) - 1}") from None
        group = cls(inputs, initial, serving, prefixed(arrays, "training/"))
        first = next(iter(inputs.values()))
        if first.ndim < 2:
            raise ExportError(f"{where}: inputs must be [steps, sequences, ...]")
        for name, part in (("inputs", inputs), ("serving", serving)):
            bad = sorted(k for k, v in part.items() if v.shape[:2] != first.shape[:2])
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
            group.lengths = lengths
        return group

    def describe(self) -> list[str]:
        seqs = next(iter(self.inputs.values())).shape[1]
        return [f"stepped: {seqs} sequences x {self.steps} steps vs the session's per-step outputs"
                + (" and its training-time graph" if self.training else "")]
