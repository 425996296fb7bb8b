"""The recorded group (``--observations``): the user's recorded observations, the rows kept
(``parity/recorded.npz``) and the reference's outputs on them, every format run on them as a
group of its own (``<format> (recorded)``); for a recurrent policy whose files give episodes, the
episodes kept stepped with the state carried (a stepped part, ``<format> (recorded stepped N)``).
A lossy format is judged by its behavioural thresholds on both."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policy_export.errors import ExportError
from policy_export.exporter.parity.compare import compare, run_batched
from policy_export.exporter.parity.groups.base import ParityGroup, Stored, check_against_contract, check_rows, prefixed
from policy_export.exporter.parity.groups.stepped import SteppedGroup

RECORDED = "parity/recorded.npz"


@dataclass
class RecordedGroup(ParityGroup):
    """The user's recorded observations (the rows kept) and the reference's outputs on them."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    indices: list[np.ndarray] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    stepped: SteppedGroup | None = None  # a recurrent policy's recorded episodes, stepped with state carried
    episodes: np.ndarray | None = None  # [sequences, 4]: file number, episode number, its steps, its first row

    name = "recorded"
    files = (RECORDED,)
    order, lossy_order = 1, 2

    @classmethod
    def make(cls, reference, recorded: Any) -> "RecordedGroup":
        """The rows of ``recorded`` (read: ``inputs``, ``indices``, ``record``, and ``episodes`` to step
        for a recurrent policy) with the reference's outputs on them."""
        group = cls(recorded.inputs, run_batched(reference.run, recorded.inputs, reference.batch_size),
                    recorded.indices, recorded.record)
        episodes = getattr(recorded, "episodes", None)
        if episodes is not None and episodes.steps * len(episodes.lengths) and reference.policy.is_recurrent:
            group._step_episodes(reference, episodes)
        return group

    def _step_episodes(self, reference, episodes: Any) -> None:
        """The recorded episodes stepped by the reference from its initial state, state carried;
        the group's ``stepped`` part and the record's ``stepped`` entry."""
        from policy_export.exporter.parity.stepped import step_recorded

        initial = reference.policy.get_initial_state()
        inputs, serving, fed = step_recorded(reference.run, episodes.inputs, initial, episodes.rewards,
                                             reference.contract)
        self.stepped = SteppedGroup(inputs, initial, serving, lengths=episodes.lengths, group="recorded stepped")
        self.episodes = episodes.episodes
        self.record = {**self.record, "stepped": {**episodes.record, "fed": fed}}

    @property
    def rows_kept(self) -> int:
        return len(next(iter(self.inputs.values())))

    def rows(self, fmt) -> int:
        n = self.rows_kept
        if self.stepped is not None and fmt.capabilities.steps_state:
            n += self.stepped.steps * len(self.stepped.lengths)
        return n

    def check(self, label: str, fmt, runner, replay, report) -> None:
        keys = replay.output_keys(fmt)
        got = run_batched(runner, self.inputs, replay.batch_size)
        if fmt.capabilities.lossy:
            from policy_export.exporter.parity.behaviour import compare_behaviour

            thresholds = replay.thresholds(fmt)
            report.behaviour.extend(compare_behaviour(f"{label} (recorded)", self.outputs, got, keys,
                                                      replay.action_space, thresholds))
            if self.stepped is not None and fmt.capabilities.steps_state:
                self._check_stepped_behaviour(label, runner, report, keys, replay.action_space, thresholds)
            return
        report.records.extend(compare(f"{label} (recorded)", self.outputs, got, replay.tolerances, keys,
                                      replay.contract))
        if self.stepped is not None and fmt.capabilities.steps_state:
            self.stepped.check_steps(label, runner, replay.tolerances, report, keys)

    def _check_stepped_behaviour(self, label: str, runner, report, keys, action_space, thresholds) -> None:
        """A lossy format over the recorded episodes, stepped with its own state: the steps that
        are the episodes' own, as rows."""
        from policy_export.exporter.parity.behaviour import compare_behaviour
        from policy_export.exporter.parity.stepped import run_stepped, valid_steps

        stepped = self.stepped
        got = run_stepped(runner, stepped.inputs, stepped.initial_state)
        mask = valid_steps(stepped.lengths, stepped.steps)
        rows = {k: np.asarray(v)[mask] for k, v in stepped.serving.items()}
        report.behaviour.extend(compare_behaviour(f"{label} ({stepped.label})", rows,
                                                  {k: np.asarray(v)[mask] for k, v in got.items()}, keys,
                                                  action_space, thresholds))

    def to_arrays(self) -> dict[str, np.ndarray]:
        stepped = {} if self.stepped is None else {
            **{f"stepped/{k}": v for k, v in self.stepped.to_arrays().items()},
            "stepped/episodes": np.asarray(self.episodes, np.int64)}
        return {**{f"inputs/{k}": v for k, v in self.inputs.items()},
                **{f"outputs/{k}": v for k, v in self.outputs.items()},
                **{f"indices/{i}": np.asarray(rows, np.int64) for i, rows in enumerate(self.indices)},
                **stepped}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], stored: Stored, where: str) -> "RecordedGroup":
        """Raises:
            ExportError: the arrays are not recorded rows for this contract."""
        inputs, outputs = prefixed(arrays, "inputs/"), prefixed(arrays, "outputs/")
        if not inputs or not outputs:
            raise ExportError(f"{where}: expected inputs/ and outputs/ arrays")
        indices = prefixed(arrays, "indices/")
        record = stored.record
        group = cls(inputs, outputs, [indices[k] for k in sorted(indices, key=lambda k: int(k) if k.isdigit() else -1)],
                    record if isinstance(record, dict) else {})
        check_rows(where, "inputs", inputs, group.rows_kept)
        check_rows(where, "outputs", outputs, group.rows_kept)
        check_against_contract(where, "inputs", inputs, stored.contract, inputs=True)
        check_against_contract(where, "outputs", outputs, stored.contract, inputs=False)
        stepped = prefixed(arrays, "stepped/")
        if stepped:
            group.stepped = SteppedGroup.from_arrays(stepped, stored, f"{where} stepped/")
            group.stepped.group = "recorded stepped"
            episodes = stepped.get("episodes")
            n = 0 if group.stepped.lengths is None else len(group.stepped.lengths)
            if not n or episodes is None or episodes.shape != (n, 4) or episodes.dtype.kind not in "iu":
                raise ExportError(f"{where}: stepped/ needs lengths and episodes [{n}, 4]")
            group.episodes = episodes
        return group

    def describe(self) -> list[str]:
        r = self.record
        files = ", ".join(f"{f.get('path')} ({f.get('kept')} of {f.get('rows')} rows)" for f in r.get("files", []))
        lines = [f"recorded: {self.rows_kept} rows of your observations ({files}; "
                 f"{r.get('out_of_bounds', 0)} outside the space's bounds)"]
        if self.stepped is not None:
            s = self.stepped
            lines.append(f"recorded stepped: {len(s.lengths)} episodes x at most {s.steps} steps "
                         f"({int(s.lengths.sum())} steps) vs the session's per-step outputs, state carried")
        return lines
