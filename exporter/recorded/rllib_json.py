"""RLlib's offline JSON (the old API stack's ``JsonWriter``): one sample batch per line,
``{"type": "SampleBatch", <column>: ...}`` or ``{"type": "MultiAgentBatch", "count": n,
"policy_batches": {<policy id>: {<column>: ...}}}``. A column is a JSON list, or, compressed
(``output_compress_columns``, by default ``obs`` and ``new_obs``), RLlib's ``pack``: base64 of an
LZ4 frame of a pickle of the whole column's array. The pickle is read with the package's safe
unpickler (numpy's array rebuilders only; nothing it names is imported or called), the LZ4 frame
with a bound on what it may inflate to.

The observations are the ``obs`` column; ``state_in_<i>``, ``prev_actions`` and ``prev_rewards``
are offered too (as the inputs ``state_in_<i>``, ``prev_action``, ``prev_reward``), taken where
the policy has them. A multi-agent file gives the rows of one policy: the only one it holds, or
the one named like the exported policy.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from policy_export.errors import InputError, UnsafeCheckpointError
from policy_export.exporter.recorded.columns import Column, lazy

class PolicyNotNamed(InputError):
    """A multi-agent file whose policies are several and none is the one named (or none was named yet)."""


LINE_LIMIT = 256 << 20  # bytes of one JSON line (one sample batch)
INFLATE_LIMIT = 1 << 30  # bytes a compressed column may inflate to
COLUMNS = {"obs": "obs", "prev_actions": "prev_action", "prev_rewards": "prev_reward",
           "eps_id": "eps_id", "rewards": "rewards"}  # the last two: episodes and rewards, not inputs


def _lines(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(LINE_LIMIT + 1), b""), 1):
            if len(line) > LINE_LIMIT:
                raise InputError(f"--observations {path}: line {number} is longer than {LINE_LIMIT >> 20} MiB")
            if not line.strip():
                continue
            try:
                batch = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                raise InputError(f"--observations {path}: line {number} is not JSON ({str(e)[:80]})") from None
            if not isinstance(batch, dict) or batch.get("type") not in ("SampleBatch", "MultiAgentBatch"):
                raise InputError(f"--observations {path}: line {number} is not an RLlib sample batch (no \"type\" "
                                 "SampleBatch or MultiAgentBatch)")
            yield number, batch


def _policy_batch(batch: dict, policy: str | None, where: str) -> dict:
    if batch["type"] == "SampleBatch":
        return batch
    batches = batch.get("policy_batches")
    if not isinstance(batches, dict) or not batches:
        raise InputError(f"{where}: a MultiAgentBatch without policy_batches")
    if len(batches) == 1:
        return next(iter(batches.values()))
    if policy in batches:
        return batches[policy]
    raise PolicyNotNamed(f"{where}: batches of the policies {', '.join(map(str, batches))[:200]}; none is named like "
                     f"this policy ({policy})")


def unpack(text: str, where: str) -> np.ndarray:
    """RLlib's ``unpack``: base64, an LZ4 frame, a pickle, read without running it."""
    from policy_export.exporter.compat import require
    from policy_export.exporter.sources.safe_pickle import loads

    require(("lz4",), "offline", "--observations of RLlib's compressed JSON columns")
    import lz4.frame

    try:
        packed = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{where}: a compressed column that is not base64") from None
    inflate = lz4.frame.LZ4FrameDecompressor()
    try:
        raw = inflate.decompress(packed, max_length=INFLATE_LIMIT + 1)
    except RuntimeError as e:
        raise InputError(f"{where}: a compressed column that is not an LZ4 frame ({str(e)[:80]})") from None
    if len(raw) > INFLATE_LIMIT:
        raise InputError(f"{where}: a compressed column inflates to more than {INFLATE_LIMIT >> 20} MiB")
    if not inflate.eof:
        raise InputError(f"{where}: a compressed column that is not a whole LZ4 frame (truncated)")
    try:
        value = loads(raw, where)
    except UnsafeCheckpointError as e:
        raise InputError(f"{e}") from None
    if not isinstance(value, np.ndarray):
        raise InputError(f"{where}: a compressed column holds {type(value).__name__}, not an array")
    return value


def _column(value: Any, where: str) -> np.ndarray:
    if isinstance(value, str):
        return unpack(value, where)
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        array = None
    if array is None or array.dtype.kind not in "biuf" or array.ndim == 0:
        raise InputError(f"{where}: not a column of numbers")
    return array


def columns(path: Path, policy: str | None = None) -> dict[str, Column]:
    """The columns of the file, their rows counted in a first pass (each line's ``obs`` decoded)."""
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    rows = 0
    for number, batch in _lines(path):
        where = f"--observations {path}: line {number}"
        part = _policy_batch(batch, policy, where)
        if "obs" not in part:
            raise InputError(f"{where}: the batch holds no obs column")
        count = None
        for name in COLUMNS:
            if name not in part:
                continue
            array = _column(part[name], f"{where}: {name}")
            count = len(array) if count is None else count
            if len(array) != count:
                raise InputError(f"{where}: {name} holds {len(array)} rows, obs {count}")
            shape = (tuple(array.shape[1:]), array.dtype)
            if shapes.setdefault(name, shape)[0] != shape[0]:
                raise InputError(f"{where}: {name} rows of shape {list(shape[0])}, earlier lines {list(shapes[name][0])}")
        rows += count or 0
    if rows == 0:
        raise InputError(f"--observations {path}: holds no rows")

    def chunks_of(name: str):
        def chunks():
            for number, batch in _lines(path):
                where = f"--observations {path}: line {number}"
                part = _policy_batch(batch, policy, where)
                yield _column(part[name], f"{where}: {name}")
        return chunks

    return {COLUMNS[name]: lazy(COLUMNS[name], rows, shape, dtype, chunks_of(name), name != "obs")
            for name, (shape, dtype) in shapes.items()}
