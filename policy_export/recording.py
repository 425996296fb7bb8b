"""Record what a training framework computes, for ``policy-export verify MODEL.onnx --reference FILE``.

Run this where the policy was trained (it needs numpy only; importing it loads neither
TensorFlow nor anything else of this package). Each array is named as the exported graph's
input or output it holds and has one row per step; a recurrent policy's recording holds no
state arrays but the episode of each row (``episode_ids``), and the state is replayed from zeros
at each episode's first step::

    from policy_export.recording import Recording

    rec = Recording()
    obs, _ = env.reset(seed=0)
    for step in range(1000):
        actions = policy(obs)                       # what the framework computes
        rec.add({"obs": obs, "actions": actions}, episode_id=episode)
        ...
    rec.save("reference.npz")

or, with every row at hand, :func:`save_reference`.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

EPISODE_IDS = "episode_ids"
__all__ = ["EPISODE_IDS", "Recording", "save_reference"]


class Recording:
    """Rows of named arrays, added a step (:meth:`add`) or a batch (:meth:`add_batch`) at a time."""

    def __init__(self) -> None:
        self._rows: dict[str, list[np.ndarray]] = {}
        self._episodes: list[Any] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, step: Mapping[str, Any], episode_id: Hashable | None = None) -> None:
        """Add one step: each value is one row (no batch axis)."""
        self.add_batch({name: np.asarray(value)[None] for name, value in step.items()},
                       None if episode_id is None else [episode_id])

    def add_batch(self, rows: Mapping[str, Any], episode_ids: Sequence[Hashable] | None = None) -> None:
        """Add several rows at once: each value has the rows on its first axis (one row per
        environment of a vectorised step, say); ``episode_ids`` gives each row's episode."""
        arrays = {str(name): np.asarray(value) for name, value in rows.items()}
        if not arrays:
            raise ValueError("a step holds no arrays")
        if EPISODE_IDS in arrays:
            raise ValueError(f"{EPISODE_IDS!r} is given as episode_id(s), not as an array")
        if self._rows and set(arrays) != set(self._rows):
            raise ValueError(f"every step holds the same arrays: {sorted(self._rows)}, "
                             f"not {sorted(arrays)}")
        counts = {name: (value.shape[0] if value.ndim else None) for name, value in arrays.items()}
        if None in counts.values() or len(set(counts.values())) != 1:
            raise ValueError(f"every array needs the same number of rows on its first axis: {counts}")
        count = next(iter(counts.values()))
        if episode_ids is not None:
            if len(episode_ids) != count:
                raise ValueError(f"{len(episode_ids)} episode ids for {count} rows")
            if self._count and not self._episodes:
                raise ValueError("episode ids are given for every row or for none")
            self._episodes.extend(episode_ids)
        elif self._episodes:
            raise ValueError("episode ids are given for every row or for none")
        for name, value in arrays.items():
            self._rows.setdefault(name, []).append(value)
        self._count += count

    def arrays(self) -> dict[str, np.ndarray]:
        """The recording as one array per name (and ``episode_ids`` when given)."""
        out = {name: np.concatenate(chunks) for name, chunks in self._rows.items()}
        if self._episodes:
            out[EPISODE_IDS] = _episode_array(self._episodes)
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the recording as an ``.npz`` (uncompressed, no pickles); returns its path."""
        if not self._count:
            raise ValueError("nothing was recorded")
        return save_reference(path, self.arrays())


def _episode_array(ids: Sequence[Any]) -> np.ndarray:
    values = np.asarray(list(ids))
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    # any other id (a string, a uuid) becomes the number of its first appearance
    numbers: dict[Any, int] = {}
    return np.asarray([numbers.setdefault(i, len(numbers)) for i in ids], dtype=np.int64)


def save_reference(path: str | os.PathLike, arrays: Mapping[str, Any],
                   episode_ids: Sequence[Hashable] | None = None) -> Path:
    """Write ``arrays`` (named as the graph's inputs and outputs, rows on the first axis) and, for
    a recurrent policy, each row's episode, as an ``.npz`` without pickles. Returns the path."""
    out = {str(name): np.asarray(value) for name, value in arrays.items()}
    if episode_ids is not None:
        out[EPISODE_IDS] = _episode_array(episode_ids)
    rows = {name: (value.shape[0] if value.ndim else None) for name, value in out.items()}
    if not out or None in rows.values() or len(set(rows.values())) != 1:
        raise ValueError(f"every array needs the same number of rows on its first axis: {rows}")
    for name, value in out.items():
        if value.dtype.kind not in "biuf":
            raise ValueError(f"{name}: dtype {value.dtype} is not a number or bool array")
    target = Path(path)
    if target.suffix != ".npz":
        target = target.with_name(target.name + ".npz")
    with open(target, "wb") as handle:  # np.savez would add the suffix to a str path itself
        np.savez(handle, **out)
    return target
