"""A recorded file's arrays as columns read in chunks (the readers' common type)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_export.exporter.recorded.budget import chunk_rows

EPISODE_IDS = ("episode_ids", "eps_id")  # per row: the episode it belongs to (rows of one id, in file order)
EPISODE_ENDS = ("dones", "terminateds", "truncateds")  # per row: true ends the episode at that row
REWARDS = "rewards"  # per row: the reward the step earned (the next step's prev_reward)
EPISODE_COLUMNS = (*EPISODE_IDS, *EPISODE_ENDS, REWARDS)  # columns that are not inputs, read where wanted


@dataclass
class Column:
    """One array of a file, read in chunks: ``rows`` rows of ``shape`` and ``dtype``."""

    key: str
    rows: int
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: Any  # () -> iterator of arrays [k, *shape], in row order
    optional: bool = False  # a column the policy may not take (RLlib's prev_actions): left out then


def chunked(array: np.ndarray) -> Iterator[np.ndarray]:
    """``array``'s rows, ``CHUNK_BYTES`` at a time (views, nothing copied)."""
    step = chunk_rows(array[:1].nbytes)
    for start in range(0, len(array), step):
        yield array[start:start + step]


def in_memory(key: str, array: np.ndarray, optional: bool = False) -> Column:
    """A column of an array already read (a decoded RLlib batch)."""
    return Column(key, len(array), tuple(array.shape[1:]), array.dtype, lambda: chunked(array), optional)


def columns_of(mapping: Mapping[str, np.ndarray]) -> dict[str, Column]:
    return {k: in_memory(k, v) for k, v in mapping.items()}


def lazy(key: str, rows: int, shape: tuple[int, ...], dtype: np.dtype, chunks: Any, optional: bool = False) -> Column:
    """A column read again, in chunks, each time it is read (a file's second pass)."""
    return Column(key, rows, shape, np.dtype(dtype), chunks, optional)
