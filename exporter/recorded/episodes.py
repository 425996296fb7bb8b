"""Episodes of recorded files, for a recurrent policy's stepped replay with its state carried.

Where a file says which rows form an episode, a recurrent policy whose file holds no state is
also replayed episode by episode, from its initial state, the state carried from step to step:

- ``.npz``: an ``episode_ids`` (or ``eps_id``) array, the episode of each row (the rows of one id,
  in file order, are its steps); else ``dones``, ``terminateds`` or ``truncateds`` (true ends the
  episode at that row; the next row starts one);
- RLlib's offline JSON: its ``eps_id`` column;
- RLlib's Parquet episodes: each cell is one episode.

A deterministic sub-sample (``seed``) of at most :data:`MAX_SEQUENCES` whole episodes is kept,
each truncated at :data:`MAX_STEPS` steps, so memory is bounded by ``MAX_SEQUENCES x MAX_STEPS``
rows, not by the files. The episodes are counted in arrays (an id's number found in a sorted
array of the ids seen, the rows of each in one array of counts), never a Python object each, and
at most :data:`~exporter.recorded.budget.MAX_EPISODES` of them a file: more is a refusal naming
the file, decided as the count passes it. A ``rewards`` column (the reward each
step earned) gives the next step's ``prev_reward``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded.budget import MAX_EPISODES
from policy_export.exporter.recorded.columns import EPISODE_ENDS, EPISODE_IDS, REWARDS, Column

MAX_SEQUENCES = 16  # episodes replayed step by step, at most
MAX_STEPS = 200  # steps of each, at most (a longer episode is truncated)


@dataclass
class Episodes:
    """The kept episodes as step-major arrays ``[steps, sequences, ...]`` (a shorter episode's
    last step repeated after its end), and where they came from."""

    inputs: dict[str, np.ndarray]  # the files' own inputs: observations (prev_action, prev_reward where held)
    lengths: np.ndarray  # [sequences]: the steps of each that are its own
    episodes: np.ndarray  # [sequences, 4]: file number, episode number in the file, its steps, its first row
    rewards: np.ndarray | None = None  # [steps, sequences]: the reward each step earned, where the files hold it
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(next(iter(self.inputs.values())))


def boundary_column(columns: Mapping[str, Column]) -> str | None:
    """The column that gives a file's episodes: an id per row, else an end flag per row."""
    for name in (*EPISODE_IDS, *EPISODE_ENDS):
        if name in columns and columns[name].shape == ():
            return name
    return None


class _Numbering:
    """Episode ids to episode numbers in order of first appearance, in sorted arrays (no Python
    object per episode), at most :data:`MAX_EPISODES` ids."""

    def __init__(self, where: str):
        self.where = where
        self.ids: np.ndarray | None = None  # sorted
        self.numbers = np.zeros(0, np.int64)  # the number of each of ``ids``

    def __call__(self, chunk: np.ndarray) -> np.ndarray:
        if chunk.dtype.kind == "f" and not np.isfinite(chunk).all():
            raise InputError(f"{self.where}: an episode id that is NaN or infinite")
        values, first, inverse = np.unique(chunk, return_index=True, return_inverse=True)
        if self.ids is None:
            self.ids = values[:0]
        elif self.ids.dtype != np.result_type(self.ids.dtype, values.dtype):  # an int line, then a float one
            self.ids = self.ids.astype(np.result_type(self.ids.dtype, values.dtype))
        at = np.searchsorted(self.ids, values)
        known = at < len(self.ids)
        known[known] = self.ids[at[known]] == values[known]
        new = np.flatnonzero(~known)
        new = new[np.argsort(first[new], kind="stable")]  # in order of their first row
        if len(self.ids) + len(new) > MAX_EPISODES:
            raise InputError(f"{self.where}: more than {MAX_EPISODES} episodes; a recurrent policy's episodes are "
                             "read up to that many (give fewer, or each row's state_in_<i>)")
        numbers = np.empty(len(values), np.int64)
        numbers[known] = self.numbers[at[known]]
        numbers[new] = len(self.ids) + np.arange(len(new))
        if len(new):
            order = np.argsort(values[new], kind="stable")  # values[new] is unique: merged in sorted order
            where = np.searchsorted(self.ids, values[new][order])
            self.ids = np.insert(self.ids, where, values[new][order])
            self.numbers = np.insert(self.numbers, where, numbers[new][order])
        return numbers[inverse.reshape(-1)]


def episode_numbers(column: Column, where: str = "--observations") -> Iterator[np.ndarray]:
    """Per chunk of rows: the episode number of each row (episodes numbered in file order).

    Raises:
        InputError: more than :data:`MAX_EPISODES` episodes, or an id that is not a finite number.
    """
    where = f"{where}: {column.key}"
    numbering = _Numbering(where)
    ended = 0
    for chunk in column.chunks():
        chunk = np.asarray(chunk).reshape(-1)
        if column.key in EPISODE_ENDS:
            done = chunk.astype(bool)
            numbers = ended + np.cumsum(done) - done
            ended += int(done.sum())
            if ended > MAX_EPISODES:
                raise InputError(f"{where}: more than {MAX_EPISODES} episodes; a recurrent policy's episodes are "
                                 "read up to that many (give fewer, or each row's state_in_<i>)")
            yield numbers
            continue
        yield numbering(chunk)


def _counts(column: Column, where: str = "--observations") -> np.ndarray:
    """Rows of each episode (by number), counted chunk by chunk in one array (its length grown by
    doubling: at most ``MAX_EPISODES``)."""
    counts, size = np.zeros(0, np.int64), 0
    for numbers in episode_numbers(column, where):
        if not len(numbers):
            continue
        top = int(numbers.max()) + 1
        if top > len(counts):
            grown = np.zeros(max(top, 2 * len(counts)), np.int64)
            grown[:len(counts)] = counts
            counts = grown
        size = max(size, top)
        counts[:top] += np.bincount(numbers, minlength=top)
    return counts[:size]


def _rows_of(column: Column, chosen: np.ndarray, steps: int, where: str = "--observations") -> dict[int, np.ndarray]:
    """The first ``steps`` rows of each chosen episode (its numbers in ``chosen``)."""
    rows: dict[int, list[np.ndarray]] = {int(e): [] for e in chosen}
    taken = dict.fromkeys(rows, 0)
    start = 0
    for numbers in episode_numbers(column, where):
        for e in np.intersect1d(numbers, chosen):
            e = int(e)
            if taken[e] < steps:
                mine = start + np.nonzero(numbers == e)[0][:steps - taken[e]]
                rows[e].append(mine)
                taken[e] += len(mine)
        start += len(numbers)
    return {e: np.concatenate(r) if r else np.zeros(0, np.int64) for e, r in rows.items()}


def choose(files: list[Any], seed: int, sequences: int = MAX_SEQUENCES) -> tuple[list[tuple[int, int, int]], int]:
    """``(file number, episode number, steps in the file)`` of the episodes kept: all of them when
    there are at most ``sequences``, else a sub-sample drawn with ``seed``; in file order. Also
    how many episodes the files hold. The episodes are counted in arrays, never one object each.

    Raises:
        InputError: more than :data:`MAX_EPISODES` episodes in a file.
    """
    numbers, episodes, counts = [], [], []
    for number, f in enumerate(files):
        name = boundary_column(f.columns)
        if name is not None:
            here = _counts(f.columns[name], f"--observations {f.path}")
            held = np.flatnonzero(here > 0)
            numbers.append(np.full(len(held), number, np.int64))
            episodes.append(held)
            counts.append(here[held])
    if not numbers:
        return [], 0
    numbers, episodes, counts = np.concatenate(numbers), np.concatenate(episodes), np.concatenate(counts)
    total = len(episodes)
    if total <= sequences:
        picked = np.arange(total)
    else:
        picked = np.sort(np.random.default_rng(seed).choice(total, size=sequences, replace=False))
    return [(int(numbers[i]), int(episodes[i]), int(counts[i])) for i in picked], total


def _select(column: Column, rows: np.ndarray) -> np.ndarray:
    """The ``rows`` (sorted) of a column read without checks (rewards: only ever fed as numbers)."""
    kept, start = [], 0
    for chunk in column.chunks():
        mine = rows[(rows >= start) & (rows < start + len(chunk))] - start
        if len(mine):
            kept.append(np.asarray(chunk)[mine])
        start += len(chunk)
    return np.concatenate(kept) if kept else np.zeros((0, *column.shape), column.dtype)


def _padded(parts: list[np.ndarray], steps: int) -> np.ndarray:
    """Episodes ``[length, ...]`` as ``[steps, sequences, ...]``, each one's last step repeated."""
    out = [np.concatenate([p, np.repeat(p[-1:], steps - len(p), axis=0)]) for p in parts]
    return np.stack(out, axis=1)


def read_episodes(files: list[Any], maps: list[dict[str, str]], leaves: Mapping[str, Any], contract, seed: int,
                  steps: int = MAX_STEPS) -> Episodes | None:
    """The kept episodes of ``files`` (their columns mapped to inputs by ``maps``), or None when no
    file gives episodes.

    Raises:
        InputError: a kept row that does not fit the policy (as the rows kept one by one).
    """
    from policy_export.exporter.recorded import checks

    chosen, total = choose(files, seed)
    if not chosen:
        return None
    parts: dict[str, list[np.ndarray]] = {}
    rewards: list[np.ndarray] = []
    held = 0
    episodes = []
    for number, f in enumerate(files):
        mine = [(e, c) for n, e, c in chosen if n == number]
        if not mine:
            continue
        rows = _rows_of(f.columns[boundary_column(f.columns)], np.array([e for e, _ in mine]), steps,
                        f"--observations {f.path}")
        union = np.unique(np.concatenate(list(rows.values())))
        where = {e: np.searchsorted(union, r) for e, r in rows.items()}
        for column_name, key in maps[number].items():
            taken, _ = checks.take(f.columns[column_name], union, leaves.get(key), contract.input(key),
                                   f"--observations {f.path}: {column_name}")
            parts.setdefault(key, []).extend(taken[where[e]] for e, _ in mine)
        reward = f.columns.get(REWARDS)
        if reward is not None and reward.shape == () and reward.dtype.kind in "biuf":
            values = _select(reward, union).astype(np.float32)
            held += len(mine)
        else:
            values = np.zeros(len(union), np.float32)
        rewards.extend(values[where[e]] for e, _ in mine)
        episodes.extend((number, e, c, int(rows[e][0])) for e, c in mine)
    lengths = np.array([len(r) for r in rewards], np.int64)
    if len({len(v) for v in parts.values()}) != 1:
        raise InputError("--observations: the files that give episodes hold different inputs; give them apart")
    longest = int(lengths.max())
    return Episodes({k: _padded(v, longest) for k, v in parts.items()}, lengths, np.array(episodes, np.int64),
                    _padded(rewards, longest) if held else None,
                    {"sequences": len(lengths), "steps": longest, "max_sequences": MAX_SEQUENCES,
                     "max_steps": steps, "episodes": total, "rewards_held": held,
                     "from": {str(f.path): boundary_column(f.columns) for f in files if boundary_column(f.columns)}})
