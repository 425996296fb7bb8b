"""Rows of a recorded file checked against the policy's observation space and kept."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded.columns import Column
from policy_export.policy.spaces import leaf_dtype, leaf_shape, leaves
from policy_export.signatures.keys import OBSERVATIONS, PREV_ACTION, PREV_REWARD, SEQ_LENS


def observation_leaves(space: gym.Space) -> dict[str, gym.Space]:
    """The contract's observation input names -> their leaf spaces."""
    return {leaf.key(OBSERVATIONS): leaf.space for leaf in leaves(space)}


def _castable(src: np.dtype, dst: np.dtype) -> bool:
    """Numbers of ``src`` fed as ``dst`` without changing their kind (a float into an integer
    input, say, would be rounded): float to float, integer or bool to float, integer to integer,
    bool to integer."""
    if dst.kind == "f":
        return src.kind in "fiub"
    if dst.kind in "iu":
        return src.kind in "iub"
    if dst.kind == "b":
        return src.kind == "b"
    return False


def _outside(chunk: np.ndarray, space: gym.Space | None) -> np.ndarray:
    """Per row: whether any value lies outside the space's bounds (or categories)."""
    if space is None:
        return np.zeros(len(chunk), bool)
    axes = tuple(range(1, chunk.ndim))
    if isinstance(space, gym.spaces.Box):
        low, high = np.broadcast_to(space.low, space.shape), np.broadcast_to(space.high, space.shape)
        bad = (chunk < low) | (chunk > high)
    elif isinstance(space, gym.spaces.Discrete):
        bad = (chunk < space.start) | (chunk >= space.start + space.n)
    elif isinstance(space, gym.spaces.MultiDiscrete):
        bad = (chunk < 0) | (chunk >= space.nvec)
    elif isinstance(space, gym.spaces.MultiBinary):
        bad = (chunk != 0) & (chunk != 1)
    else:
        return np.zeros(len(chunk), bool)
    return bad.any(axis=axes) if axes else bad


def take(column: Column, rows: np.ndarray, space: gym.Space | None, spec: Any, where: str) -> tuple[np.ndarray, int]:
    """The ``rows`` of ``column`` as the input ``spec`` takes them, every row of the file checked
    (NaN refused; outside the space's bounds counted); returns ``(kept rows, rows outside)``.

    Raises:
        InputError: another shape, a dtype of another kind, NaN (the first such row named).
    """
    want = tuple(leaf_shape(space)) if space is not None else tuple(d for d in spec.shape[1:])
    if space is not None and column.shape != want:
        from policy_export.policy.spaces import space_text

        raise InputError(f"{where}: rows of shape {list(column.shape)}; the space {space_text(space)} takes {list(want)}")
    if space is None and (len(column.shape) != len(want)
                          or any(d is not None and d != c for d, c in zip(want, column.shape))):
        raise InputError(f"{where}: rows of shape {list(column.shape)}; the input takes {spec.shape_text()}")
    dtype = leaf_dtype(space) if space is not None else np.dtype(spec.dtype)
    if not _castable(column.dtype, dtype):
        raise InputError(f"{where}: {column.dtype} values; the input takes {dtype} (a {column.dtype.kind}-kind value "
                         f"would change meaning as {dtype.kind}-kind)")
    kept, outside, start = [], 0, 0
    wanted = np.asarray(rows, np.int64)
    for chunk in column.chunks():
        n = len(chunk)
        if chunk.dtype.kind == "f":
            finite = np.isfinite(chunk).reshape(n, -1).all(axis=1) if chunk.ndim > 1 else np.isfinite(chunk)
            if not finite.all():
                first = start + int(np.argmin(finite))
                raise InputError(f"{where}: row {first} holds NaN or infinity; recorded observations must be finite")
        outside += int(_outside(chunk, space).sum())
        mine = wanted[(wanted >= start) & (wanted < start + n)] - start
        if len(mine):
            kept.append(np.array(chunk[mine], dtype=dtype))
        start += n
    if start != column.rows:
        raise InputError(f"{where}: {start} rows read, the header says {column.rows} (truncated)")
    taken = np.concatenate(kept) if kept else np.zeros((0, *column.shape), dtype)
    return taken, outside


def fill_required(inputs: dict[str, np.ndarray], contract) -> dict[str, str]:
    """The required inputs the file did not hold, filled as an episode's first step: a recurrent
    policy's initial (zero) state, ``seq_lens`` 1, a zero previous action and reward; returns
    what was filled, and how."""
    n = len(next(iter(inputs.values())))
    filled = {}
    for spec in contract.required_inputs:
        if spec.key in inputs:
            continue
        shape = (n, *(1 if d is None else d for d in spec.shape[1:]))
        if spec.key == SEQ_LENS:
            inputs[spec.key], filled[spec.key] = np.ones(shape, np.dtype(spec.dtype)), "1 (one step per row)"
        else:
            inputs[spec.key] = np.zeros(shape, np.dtype(spec.dtype))
            filled[spec.key] = "zeros (the start of an episode)" if spec.key not in (PREV_ACTION, PREV_REWARD) \
                else "zeros (no previous step)"
    return filled


def check_against_inputs(inputs: Mapping[str, np.ndarray], contract) -> None:
    unknown = sorted(set(inputs) - set(contract.input_keys))
    if unknown:
        raise InputError(f"--observations: {', '.join(unknown)} is not an input of the policy")
