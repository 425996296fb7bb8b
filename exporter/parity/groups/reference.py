"""The reference group: a model checked against what its training framework computed.

A recording (``policy_export.recording``, on the training machine) holds arrays named as the
graph's inputs and outputs, one row per step; a recurrent policy's holds no state but the episode
of each row (``episode_ids``). :meth:`ReferenceGroup.make` pairs the recording with a model's
declared inputs and outputs:

- each recorded array is an input or an output of the graph (``names`` maps other names to
  them), of the graph's dtype kind and its row shape (a static batch of 1 is a row);
- the graph's inputs the recording does not hold are its state, each paired with the k-th graph
  output the recording does not hold (or as ``state_pairs`` pair them); they need
  ``episode_ids``;
- the outputs recorded are compared; others are not.

:meth:`ReferenceGroup.check` replays the rows on a runner, the way the model's batch allows: a
static batch of 1 (what rsl_rl, Isaac Lab and SB3's recipe write) row by row; a dynamic batch at
several batch sizes (1, 3 and 64 rows a call), so that a graph answering every row with row 0's
result fails; a recurrent model episode by episode, from zeros at each episode's first step, its
own state fed back (several episodes a call where the batch is dynamic). Every recorded output is
compared under its tolerance (discrete outputs identical), and the first row where a compared
output leaves its tolerance is named with its episode and step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from policy_export.errors import ExportError, InputError
from policy_export.exporter.parity.compare import OutputParity, ParityReport, Tolerances, compare_arrays
from policy_export.exporter.parity.groups.base import ParityGroup, Stored, check_rows, prefixed

EPISODE_IDS = "episode_ids"
BATCHES = (1, 3, 64)  # rows per call where the model's batch is dynamic
ROW_BY_ROW = 256  # rows run one at a time where the batch is dynamic (all of them at the other sizes)
NAME = "reference"


@dataclass(frozen=True)
class Port:
    """A graph input or output as the model declares it: dtype and shape (None: dynamic)."""

    name: str
    dtype: str | None
    shape: tuple[int | None, ...] | None


@dataclass
class ReferenceGroup(ParityGroup):
    """The recorded rows of the graph's inputs and outputs, each row's episode, the state pairs."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    episode_ids: np.ndarray | None = None
    state_pairs: list[tuple[str, str]] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)
    replays: dict[str, str] = field(default_factory=dict)  # label -> how its check ran the rows
    judged: dict[str, Any] | None = None  # lossy formats: action output -> its space, or "identical"

    name = NAME
    files = ("parity/reference.npz",)
    order, lossy_order = 4, 3
    listed_when_absent = False  # only an export of a policy made elsewhere holds one

    @property
    def recorded_rows(self) -> int:
        return len(next(iter(self.inputs.values())))

    def rows(self, fmt) -> int:
        if self.state_pairs or not fmt.capabilities.signature:
            return self.recorded_rows
        return self.recorded_rows * 2 + min(self.recorded_rows, ROW_BY_ROW)

    # ------------------------------------------------------------------ making it

    @classmethod
    def make(cls, arrays: Mapping[str, np.ndarray], graph_inputs: Sequence[Port], graph_outputs: Sequence[Port],
             where: str, names: Mapping[str, str] | None = None,
             state_pairs: Sequence[tuple[str, str]] | None = None, optional: Sequence[str] = ()) -> "ReferenceGroup":
        """The group of ``arrays`` (a recording: name -> rows) for a graph of ``graph_inputs`` and
        ``graph_outputs``; ``optional`` names inputs the graph gives a default (never state).

        Raises:
            InputError: the recording does not fit the graph (a name, dtype or row shape), or its
                state cannot be paired; naming what and how to fix it.
        """
        names = dict(names or {})
        unknown_map = sorted(set(names) - set(arrays))
        if unknown_map:
            raise InputError(f"{where}: --reference-name maps {', '.join(unknown_map)}, which the recording does "
                             f"not hold (it holds {', '.join(sorted(arrays))})")
        recorded = {names.get(k, k): v for k, v in arrays.items() if k != EPISODE_IDS}
        ins, outs = {p.name: p for p in graph_inputs}, {p.name: p for p in graph_outputs}
        stray = sorted(k for k in recorded if k not in ins and k not in outs)
        if stray:
            raise InputError(f"{where}: {', '.join(stray)} is not an input or output of the graph (its inputs: "
                             f"{', '.join(ins)}; outputs: {', '.join(outs)}); name it with --reference-name "
                             "RECORDED=GRAPH")
        inputs = {k: v for k, v in recorded.items() if k in ins}
        outputs = {k: v for k, v in recorded.items() if k in outs}
        if not inputs or not outputs:
            raise InputError(f"{where}: the recording holds {'no input' if not inputs else 'no output'} of the graph "
                             f"(inputs: {', '.join(ins)}; outputs: {', '.join(outs)})")
        rows = {k: len(v) for k, v in recorded.items()}
        if len(set(rows.values())) != 1:
            raise InputError(f"{where}: its arrays hold different numbers of rows ({_shown(rows)})")
        n = next(iter(rows.values()))
        for key, value in recorded.items():
            _check_fits(key, value, ins.get(key) or outs[key], where)
        missing = [k for k in ins if k not in inputs and k not in optional]
        pairs = _pairs(missing, [k for k in outs if k not in outputs], state_pairs, ins, outs, where)
        inputs = {k: _cast(v, ins[k], where) for k, v in inputs.items()}
        outputs = {k: _cast(v, outs[k], where) for k, v in outputs.items()}  # float64 recorded: the graph's float32
        episodes = arrays.get(EPISODE_IDS)
        if pairs and episodes is None:
            raise InputError(f"{where}: graph input(s) {', '.join(missing)} are not recorded, so they are its state, "
                             f"and the recording holds no {EPISODE_IDS} to say where each episode starts")
        if episodes is not None:
            episodes = np.asarray(episodes)
            if episodes.shape != (n,) or episodes.dtype.kind not in "iu":
                raise InputError(f"{where}: {EPISODE_IDS} must be one whole number per row ({n})")
        return cls(inputs, outputs, episodes if pairs else None, pairs)

    # ------------------------------------------------------------------ storing it

    def to_arrays(self) -> dict[str, np.ndarray]:
        out = {**{f"inputs/{k}": v for k, v in self.inputs.items()},
               **{f"outputs/{k}": v for k, v in self.outputs.items()}}
        if self.episode_ids is not None:
            out[EPISODE_IDS] = np.asarray(self.episode_ids, np.int64)
        for i, (a, b) in enumerate(self.state_pairs):
            out[f"state_pairs/{i}"] = np.asarray([a, b])
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], stored: Stored, where: str) -> "ReferenceGroup":
        """Raises:
            ExportError: the arrays are not a recording of this contract's inputs and outputs."""
        inputs, outputs = prefixed(arrays, "inputs/"), prefixed(arrays, "outputs/")
        if not inputs or not outputs:
            raise ExportError(f"{where}: expected inputs/ and outputs/ arrays")
        rows = len(next(iter(inputs.values())))
        check_rows(where, "inputs", inputs, rows)
        check_rows(where, "outputs", outputs, rows)
        keys_in, keys_out = set(stored.contract.input_keys), set(stored.contract.output_keys)
        stray = sorted({*(k for k in inputs if k not in keys_in), *(k for k in outputs if k not in keys_out)})
        if stray:
            raise ExportError(f"{where}: {stray} are not the contract's inputs and outputs")
        pairs = []
        for i in range(len(prefixed(arrays, "state_pairs/"))):
            pair = arrays.get(f"state_pairs/{i}")
            if pair is None or pair.shape != (2,) or pair.dtype.kind != "U":
                raise ExportError(f"{where}: state_pairs/{i} is not two names")
            a, b = (str(x) for x in pair)
            if a not in keys_in or b not in keys_out:
                raise ExportError(f"{where}: state_pairs/{i} ({a}, {b}) is not an input and an output of the contract")
            pairs.append((a, b))
        episodes = arrays.get(EPISODE_IDS)
        if pairs and (episodes is None or episodes.shape != (rows,) or episodes.dtype.kind not in "iu"):
            raise ExportError(f"{where}: a recurrent recording needs {EPISODE_IDS} [{rows}]")
        group = cls(inputs, outputs, episodes if pairs else None, pairs,
                    stored.record if isinstance(stored.record, dict) else {})
        group.judged = judged_outputs(stored.doc.get("contract") or {}, stored.contract, list(outputs), where)
        return group

    def check(self, label: str, fmt, runner, replay, report) -> None:
        if fmt.capabilities.lossy:
            self.replay_behaviour(label, fmt, runner, replay, report)
            return
        self.replay_rows(label, runner, replay.tolerances, report)

    def replay_behaviour(self, label: str, fmt, runner, replay, report) -> None:
        """A lossy format: its actions on the recorded rows against the recording, by the behavioural thresholds."""
        from policy_export.exporter.parity.behaviour import compare_behaviour

        batch = _batch(runner, self.inputs)  # one pass, at the model's static batch or the largest of BATCHES
        if self.state_pairs and batch not in (None, 1):
            raise ExportError(f"{label}: a recurrent model of a static batch of {batch} is not stepped here")
        got = self._stepped(runner, batch or max(BATCHES)) if self.state_pairs else \
            self._rows(runner, batch or max(BATCHES), self.recorded_rows)
        keys = [k for k in replay.output_keys(fmt) if k in self.outputs]
        judged = self.judged if self.judged is not None else judged_outputs({}, replay.contract, list(self.outputs))
        checks = compare_behaviour(f"{label} ({NAME})", self.outputs, got, keys, replay.action_space,
                                   replay.thresholds(fmt), judged=judged)
        report.behaviour.extend(replace(c, extra={**c.extra, "against": "the recording"}) if c.metric == "agreement"
                                else c for c in checks)

    # ------------------------------------------------------------------ replaying it

    def describe(self) -> list[str]:
        ways = list(dict.fromkeys(self.replays.values()))
        if len(ways) <= 1:
            replayed = f"; replayed {ways[0]}" if ways else ""
        else:  # formats differ (a Triton model that takes one sequence a request, say)
            by_way = {w: [k for k, v in self.replays.items() if v == w] for w in ways}
            replayed = "; replayed " + "; ".join(f"{w} ({', '.join(labels)})" for w, labels in by_way.items())
        if self.episode_ids is None:
            return [f"reference: {self.recorded_rows} recorded rows of {', '.join(self.outputs)}{replayed}"]
        episodes = len(np.unique(self.episode_ids))
        return [f"reference: {episodes} recorded episodes ({self.recorded_rows} steps) of {', '.join(self.outputs)}, state "
                f"{', '.join(f'{a} <- {b}' for a, b in self.state_pairs)} fed back from zeros{replayed}"]

    def replay_rows(self, label: str, runner, tolerances: Tolerances, report: ParityReport) -> None:
        """Replay the rows on ``runner`` (see the module's description) and add the records."""
        batch = _batch(runner, self.inputs)
        if self.state_pairs and batch not in (None, 1):
            raise ExportError(f"{label}: a recurrent model of a static batch of {batch} is not stepped here (a static "
                              "batch of 1 is, row by row, and a dynamic batch)")
        if self.state_pairs:
            size = 1 if batch is not None else max(BATCHES)
            got = self._stepped(runner, size if batch is None else batch)
            self.replays[label] = f"episodes stepped {'one at a time' if (batch or size) == 1 else f'up to {size} a call'}"
            self._compare(f"{label} (episodes)", got, tolerances, report)
            return
        if batch is not None:
            self.replays[label] = "row by row" if batch == 1 else f"{batch} rows a call (the model's static batch)"
            self._compare(f"{label} ({NAME})", self._rows(runner, batch, self.recorded_rows), tolerances, report)
            return
        self.replays[label] = ", ".join(f"{min(self.recorded_rows, ROW_BY_ROW) if s == 1 else self.recorded_rows} rows at "
                                        f"batch {s}" for s in BATCHES)
        for size in BATCHES:
            count = min(self.recorded_rows, ROW_BY_ROW) if size == 1 else self.recorded_rows
            self._compare(f"{label} (batch {size})", self._rows(runner, size, count), tolerances, report, count)

    def _rows(self, runner, size: int, count: int) -> dict[str, np.ndarray]:
        chunks: dict[str, list[np.ndarray]] = {}
        for start in range(0, count, size):
            stop = min(start + size, count)
            feeds = {k: v[start:stop] for k, v in self.inputs.items()}
            pad = size - (stop - start) if size > 1 and _static(runner) else 0
            if pad:  # a static batch larger than 1: the last call padded with its own last row
                feeds = {k: np.concatenate([v, np.repeat(v[-1:], pad, axis=0)]) for k, v in feeds.items()}
            out = runner(_shaped(feeds, runner))
            for key in self.outputs:
                value = np.asarray(out[key])
                chunks.setdefault(key, []).append(_rows_of(value, stop - start, self.outputs[key].shape[1:]))
        return {k: np.concatenate(v) for k, v in chunks.items()}

    def _stepped(self, runner, size: int) -> dict[str, np.ndarray]:
        """Every episode from zeros, its own state fed back; ``size`` episodes a call at most."""
        order = _episodes(self.episode_ids)
        got: dict[str, np.ndarray] = {k: np.zeros_like(v) for k, v in self.outputs.items()}
        for first in range(0, len(order), size):
            group = order[first:first + size]
            state = {a: _zeros(runner.inputs[a], len(group)) for a, _ in self.state_pairs}
            alive = list(range(len(group)))
            for t in range(max(len(rows) for rows in group)):
                alive = [i for i in alive if t < len(group[i])]
                rows = np.asarray([group[i][t] for i in alive])
                feeds = _shaped({k: v[rows] for k, v in self.inputs.items()}, runner)
                feeds.update({a: _take(state[a], runner.inputs[a], alive, len(group)) for a in state})
                out = runner(feeds)
                for key in self.outputs:
                    got[key][rows] = _rows_of(np.asarray(out[key]), len(rows), self.outputs[key].shape[1:])
                for a, b in self.state_pairs:
                    state[a] = _put(state[a], np.asarray(out[b]), runner.inputs[a], alive)
        return got

    def _compare(self, label: str, got: Mapping[str, np.ndarray], tolerances: Tolerances, report: ParityReport,
                 count: int | None = None) -> None:
        for key, want in self.outputs.items():
            want = want[:count] if count is not None else want
            record = compare_arrays(label, key, want, got[key], tolerances.for_output(key),
                                    allow_non_finite=tolerances.allows_non_finite(key))
            if not record.passed and not record.problem:
                record = replace(record, first_divergence=self._where(first_row(want, got[key], record)))
            report.records.append(record)

    def _where(self, row: int) -> str:
        if self.episode_ids is None:
            return f"row {row}"
        ids = self.episode_ids
        step = int(np.count_nonzero(ids[:row] == ids[row]))
        return f"row {row} (episode {int(ids[row])}, step {step})"


# ----------------------------------------------------------------------------- helpers

def judged_outputs(record: Mapping[str, Any], contract, recorded: Sequence[str], where: str = "manifest") -> dict[str, Any]:
    """The action outputs a lossy format is judged on, each with its space (a Box is judged on its
    range, any other space by agreement; ``"identical"``: agreement without a space), from the
    contract's ``spaces`` and ``actions`` (a policy exported elsewhere: its contract file). The
    actions are those listed, else those given a space, else every recorded output; an action
    without a space is a Box of the range the reference's own values span when it is a float,
    else judged by agreement.

    Raises:
        ExportError: ``spaces`` or ``actions`` is malformed, or names an output not recorded.
    """
    import gymnasium as gym

    from policy_export.policy.spaces import space_from_json

    spaces_doc, actions = record.get("spaces") or {}, record.get("actions")
    if not isinstance(spaces_doc, Mapping) or (actions is not None and (
            not isinstance(actions, list) or not all(isinstance(a, str) for a in actions))):
        raise ExportError(f"{where}: contract spaces must map names to spaces and actions list output names")
    outputs = set(contract.output_keys)
    spaces = {k: space_from_json(v, f"$.contract.spaces.{k}", where) for k, v in spaces_doc.items() if k in outputs}
    chosen = list(actions) if actions is not None else (list(spaces) or list(recorded))
    stray = [k for k in chosen if k not in recorded]
    if stray:
        raise ExportError(f"{where}: contract actions {stray} are not recorded outputs ({', '.join(recorded)})")
    judged: dict[str, Any] = {}
    for key in chosen:
        if key in spaces:
            judged[key] = spaces[key]
        elif np.dtype(contract.output(key).dtype).kind == "f":
            judged[key] = gym.spaces.Box(-np.inf, np.inf, shape=(), dtype=np.float64)
        else:
            judged[key] = "identical"
    return judged


def first_row(want: np.ndarray, got: np.ndarray, record: OutputParity) -> int:
    """The first row where ``got`` leaves the record's tolerance (or differs, for exact outputs)."""
    a, b = np.asarray(got, np.float64).reshape(len(want), -1), np.asarray(want, np.float64).reshape(len(want), -1)
    if record.exact:
        bad = a != b
    else:
        bad = ~(np.abs(a - b) <= record.atol + record.rtol * np.abs(b))
    rows = np.flatnonzero(bad.any(axis=1))
    return int(rows[0]) if len(rows) else 0


def _shown(rows: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in list(rows.items())[:8])


def _check_fits(key: str, value: np.ndarray, port: Port, where: str) -> None:
    """A recorded array fits its graph port: its kind of dtype, and its row's shape (the port's
    without its batch axis; a static batch of 1 is dropped, or kept as a leading 1)."""
    if value.ndim < 1:
        raise InputError(f"{where}: {key} is a single value, not rows")
    if port.dtype is not None:
        want = np.dtype(port.dtype)
        same = value.dtype.kind == want.kind or (want.kind == "f" and value.dtype.kind in "iu") \
            or (want.kind in "iu" and value.dtype.kind in "iu")
        if not same:
            raise InputError(f"{where}: {key} is {value.dtype.name}; the graph's {key} is {want.name}")
    if port.shape is not None and not _row_fits(value.shape[1:], port.shape):
        shown = "[" + ", ".join("?" if d is None else str(d) for d in port.shape) + "]"
        raise InputError(f"{where}: {key}'s rows are {list(value.shape[1:])}; the graph's {key} is {shown}")


def _row_fits(row: tuple[int, ...], shape: tuple[int | None, ...]) -> bool:
    def same(a, b):
        return len(a) == len(b) and all(d is None or d == r for d, r in zip(b, a))

    rest = shape[1:] if shape else ()
    if same(row, rest):
        return True
    # a batch of 1 folded into the row, or an output of shape [1] recorded as one value per row
    return (shape[:1] in ((1,), (None,)) and same(row, shape)) or (not row and int(np.prod(
        [d or 1 for d in shape])) == 1)


def _pairs(missing: list[str], free: list[str], given: Sequence[tuple[str, str]] | None,
           ins: Mapping[str, Port], outs: Mapping[str, Port], where: str) -> list[tuple[str, str]]:
    if given:
        pairs = list(given)
        bad = [f"{a}={b}" for a, b in pairs if a not in ins or b not in outs]
        if bad:
            raise InputError(f"{where}: --state-pair {', '.join(bad)} does not name a graph input and output")
        unpaired = sorted(set(missing) - {a for a, _ in pairs})
        if unpaired:
            raise InputError(f"{where}: graph input(s) {', '.join(unpaired)} are neither recorded nor paired "
                             "by --state-pair")
        return pairs
    if len(free) < len(missing):
        raise InputError(f"{where}: graph input(s) {', '.join(missing)} are not recorded, and only "
                         f"{len(free)} output(s) are not ({', '.join(free) or 'none'}) to carry them as state; record "
                         "the inputs, or pair them with --state-pair IN=OUT")
    return list(zip(missing, free[:len(missing)]))


def _cast(value: np.ndarray, port: Port, where: str) -> np.ndarray:
    """A recorded input in the graph's dtype (what its runtime takes)."""
    if port.dtype is None or value.dtype == np.dtype(port.dtype):
        return value
    return value.astype(port.dtype)


def _shaped(feeds: Mapping[str, np.ndarray], runner) -> dict[str, np.ndarray]:
    """Rows fed as the model declares its inputs: a batch of 1 recorded inside the row unfolded."""
    out = {}
    for key, value in feeds.items():
        shape = runner.inputs[key].shape if key in runner.inputs else None
        if shape and None not in shape and value.shape != shape and value.size == int(np.prod(shape)):
            value = value.reshape(shape)
        out[key] = value
    return out


def _static(runner) -> bool:
    return all(m.shape and m.shape[0] is not None for m in runner.inputs.values() if m.shape)


def _batch(runner, inputs: Mapping[str, np.ndarray]) -> int | None:
    """The static batch the model declares on its recorded inputs, or None where it is dynamic."""
    dims = {runner.inputs[k].shape[0] for k in inputs if k in runner.inputs and runner.inputs[k].shape}
    if None in dims or not dims:
        return None
    if len(dims) != 1:
        raise ExportError(f"the model declares different batch sizes on its inputs ({sorted(dims)})")
    return dims.pop()


def _rows_of(value: np.ndarray, count: int, row: tuple[int, ...]) -> np.ndarray:
    """``count`` rows of the recorded row shape from a model's output (a static batch of 1's
    leading axis, or an output of shape [1] per row, folded)."""
    if value.shape[:1] == (count,) and value.shape[1:] == row:
        return value
    if value.size >= count * int(np.prod(row, dtype=np.int64)):
        return value.reshape(-1, *row)[:count] if value.ndim else value.reshape(count, *row)
    raise ExportError(f"an output of shape {list(value.shape)} holds no {count} rows of {list(row)}")


def _episodes(ids: np.ndarray) -> list[list[int]]:
    """Each episode's rows in order, episodes in the order they first appear."""
    order: dict[int, list[int]] = {}
    for row, episode in enumerate(ids.tolist()):
        order.setdefault(episode, []).append(row)
    return list(order.values())


def _batch_axis(meta) -> int:
    """Where a state input keeps its batch: its one dynamic axis, else its first axis of 1."""
    shape = meta.shape or (None,)
    dynamic = [i for i, d in enumerate(shape) if d is None]
    if len(dynamic) == 1:
        return dynamic[0]
    ones = [i for i, d in enumerate(shape) if d == 1]
    return ones[0] if ones else 0


def _zeros(meta, episodes: int) -> np.ndarray:
    axis = _batch_axis(meta)
    shape = [1 if d is None else d for d in (meta.shape or (episodes,))]
    shape[axis] = episodes
    return np.zeros(shape, np.dtype(meta.dtype or "float32"))


def _take(state: np.ndarray, meta, alive: list[int], total: int) -> np.ndarray:
    return state if len(alive) == total else np.take(state, alive, axis=_batch_axis(meta))


def _put(state: np.ndarray, value: np.ndarray, meta, alive: list[int]) -> np.ndarray:
    axis = _batch_axis(meta)
    if value.shape[axis] == state.shape[axis]:
        return value.reshape(state.shape)
    out = state.copy()
    index = [slice(None)] * state.ndim
    index[axis] = alive
    out[tuple(index)] = value.reshape(np.take(state, alive, axis=axis).shape)
    return out
