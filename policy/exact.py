"""Weights used exactly as stored: a value is converted to the dtype the policy computes in only
when every element keeps its exact value (float64 values that float32 holds, integers in range)."""

from __future__ import annotations

import warnings

import numpy as np


def exact_cast(arr: np.ndarray, want: np.dtype) -> tuple[np.ndarray | None, str | None]:
    """``arr`` as ``want`` if every value converts exactly, else ``(None, the problem)``: a
    weight's values are never changed by a cast."""
    want = np.dtype(want)
    if arr.dtype == want:
        return arr, None
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = arr.astype(want)
        exact = np.array_equal(value.astype(arr.dtype), arr, equal_nan=np.issubdtype(want, np.floating)
                               and np.issubdtype(arr.dtype, np.floating))
    if not exact:
        return None, (f"has dtype {arr.dtype} values that {want} cannot hold exactly (the export computes in "
                      f"{want}); convert the weights to {want} first")
    return value, None
