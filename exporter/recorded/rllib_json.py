"""RLlib's offline JSON (the old API stack's ``JsonWriter``): one sample batch per line,
``{"type": "SampleBatch", <column>: ...}`` or ``{"type": "MultiAgentBatch", "count": n,
"policy_batches": {<policy id>: {<column>: ...}}}``. A column is a JSON list, or, compressed
(``output_compress_columns``, by default ``obs`` and ``new_obs``), RLlib's ``pack``: base64 of an
LZ4 frame of a pickle of the whole column's array. The pickle is read with the package's safe
unpickler (numpy's array rebuilders only; nothing it names is imported or called).

The observations are the ``obs`` column; ``state_in_<i>``, ``prev_actions`` and ``prev_rewards``
are offered too (as the inputs ``state_in_<i>``, ``prev_action``, ``prev_reward``), taken where
the policy has them. A multi-agent file gives the rows of one policy: the only one it holds, or
the one named like the exported policy.

Bounded (:mod:`.budget`), each before the work: a line is at most ``CELL_BYTES`` long (read so,
never further), what it parses into is estimated from its tokens (at most ``OBJECT_BYTES``) and
charged to the pass's budget, as is every column inflated (an LZ4 frame's declared size checked
before it is inflated, the inflate stopped at ``CELL_BYTES``) and every pickle opcode run.
Nesting too deep for the parser, a column that is not one array of numbers, a batch that is not
an object: each is a refusal naming the file and the line.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import InputError, UnsafeCheckpointError
from policy_export.exporter.recorded.budget import CELL_BYTES, OBJECT_BYTES, PICKLE_DISK_BYTES, Budget, mib, parse_cost
from policy_export.exporter.recorded.columns import Column, chunked, lazy


class PolicyNotNamed(InputError):
    """A multi-agent file whose policies are several and none is the one named (or none was named yet)."""


COLUMNS = {"obs": "obs", "prev_actions": "prev_action", "prev_rewards": "prev_reward",
           "eps_id": "eps_id", "rewards": "rewards"}  # the last two: episodes and rewards, not inputs


def _lines(path: Path, budget: Budget) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(CELL_BYTES + 1), b""), 1):
            where = f"--observations {path}: line {number}"
            if len(line) > CELL_BYTES:
                raise InputError(f"{where} is longer than {mib(CELL_BYTES)}")
            if line.isspace():
                continue
            cost = parse_cost(line)  # before parsing: what its lists, numbers and strings would take
            if cost > OBJECT_BYTES:
                raise InputError(f"{where} would parse into more than {mib(OBJECT_BYTES)} of objects (its lists, "
                                 "numbers and strings); compress its columns (RLlib's output_compress_columns)")
            budget.charge(cost, "its lines")
            try:
                batch = json.loads(line)
            except RecursionError:
                raise InputError(f"{where} nests deeper than a sample batch does") from None
            except (ValueError, UnicodeDecodeError) as e:
                raise InputError(f"{where} is not JSON ({str(e)[:80]})") from None
            del line
            if not isinstance(batch, dict) or batch.get("type") not in ("SampleBatch", "MultiAgentBatch"):
                raise InputError(f"{where} is not an RLlib sample batch (no \"type\" SampleBatch or "
                                 "MultiAgentBatch)")
            yield number, batch


def _policy_batch(batch: dict, policy: str | None, where: str) -> dict:
    if batch["type"] == "SampleBatch":
        return batch
    batches = batch.get("policy_batches")
    if not isinstance(batches, dict) or not batches:
        raise InputError(f"{where}: a MultiAgentBatch without policy_batches")
    if len(batches) == 1:
        part = next(iter(batches.values()))
    elif policy in batches:
        part = batches[policy]
    else:
        names = ", ".join(name[:40] for name in itertools.islice(batches, 8))
        raise PolicyNotNamed(f"{where}: batches of the policies {names}{', ...' if len(batches) > 8 else ''}; none is "
                             f"named like this policy ({policy})")
    if not isinstance(part, dict):
        raise InputError(f"{where}: a policy batch that is not an object of columns")
    return part


def unpack(text: str, where: str, budget: Budget, rows: bool = True) -> np.ndarray:
    """RLlib's ``unpack``: base64, an LZ4 frame, a pickle, read without running it; the frame's
    declared size checked against ``CELL_BYTES`` before it is inflated, what it inflates to
    charged to ``budget``. ``rows``: a column's rows (at least one dimension), else one value.

    Raises:
        InputError: not base64 or LZ4, larger than a cell, over budget, a pickle refused, or not
            an array of numbers.
    """
    from policy_export.exporter.compat import require
    from policy_export.exporter.sources.safe_pickle import loads

    require(("lz4",), "offline", "--observations of RLlib's compressed JSON columns")
    import lz4.frame

    try:
        packed = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{where}: a compressed column that is not base64") from None
    try:
        declared = int(lz4.frame.get_frame_info(packed).get("content_size") or 0)
    except (RuntimeError, ValueError, TypeError):  # no whole frame header: the inflate below says what is wrong
        declared = 0
    if declared > CELL_BYTES:  # the frame says so: refused before anything is inflated
        budget.cell(declared, "a compressed column", "its compressed columns")
    inflate = lz4.frame.LZ4FrameDecompressor()
    try:
        raw = inflate.decompress(packed, max_length=CELL_BYTES + 1)
    except RuntimeError as e:
        raise InputError(f"{where}: a compressed column that is not an LZ4 frame ({str(e)[:80]})") from None
    del packed
    budget.cell(len(raw), "a compressed column", "its compressed columns")
    if not inflate.eof:
        raise InputError(f"{where}: a compressed column that is not a whole LZ4 frame (truncated)")
    pickles = budget.pickles()
    try:
        value = loads(raw, where, pickles)  # the unpickler lets go of what it read as it returns
    except UnsafeCheckpointError as e:
        if pickles.used_objects > pickles.objects:  # the pass's share of opcodes, not the pickle's fault alone
            raise InputError(f"{budget.where}: its compressed columns' pickles run more than {pickles.objects} "
                             f"opcodes (one per {PICKLE_DISK_BYTES} bytes on disk, or a floor); a file compressed "
                             "this far is not read") from None
        raise InputError(f"{e}") from None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf" or (rows and value.ndim == 0):
        what = f"an array of {value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
        raise InputError(f"{where}: a compressed column holds {what[:40]}, not an array of rows of numbers")
    return value


def _column(value: Any, where: str, budget: Budget) -> np.ndarray:
    if isinstance(value, str):
        return unpack(value, where, budget)
    try:
        array = np.asarray(value) if isinstance(value, list) else None
    except (ValueError, TypeError, OverflowError, RecursionError):  # ragged, or nested past numpy's dimensions
        array = None
    if array is None or array.dtype.kind not in "biuf" or array.ndim == 0:
        raise InputError(f"{where}: not a column of numbers (a list of rows of one shape)")
    return array


def _parts(path: Path, policy: str | None, budget: Budget) -> Iterator[tuple[str, dict]]:
    for number, batch in _lines(path, budget):
        where = f"--observations {path}: line {number}"
        yield where, _policy_batch(batch, policy, where)


def columns(path: Path, policy: str | None = None, share: int = 1) -> dict[str, Column]:
    """The columns of the file, their rows counted in a first pass (each line's columns decoded);
    ``share``: the inputs of the command, which share the budget's floors.

    Raises:
        InputError: a line that is not a sample batch of columns of numbers, or over a bound.
    """
    budget = Budget(f"--observations {path}", os.stat(path).st_size, share)
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    rows = 0
    for where, part in _parts(path, policy, budget):
        if "obs" not in part:
            raise InputError(f"{where}: the batch holds no obs column")
        count = None
        for name in COLUMNS:
            if name not in part:
                continue
            array = _column(part[name], f"{where}: {name}", budget)
            count = len(array) if count is None else count
            if len(array) != count:
                raise InputError(f"{where}: {name} holds {len(array)} rows, obs {count}")
            shape = tuple(array.shape[1:])
            if name in shapes and shapes[name][0] != shape:
                raise InputError(f"{where}: {name} rows of shape {list(shape)}, earlier lines {list(shapes[name][0])}")
            # the column's dtype holds every line's (an int line and a float line: float)
            shapes[name] = (shape, np.result_type(shapes[name][1], array.dtype) if name in shapes else array.dtype)
            del array
        rows += count or 0
    if rows == 0:
        raise InputError(f"--observations {path}: holds no rows")

    def chunks_of(name: str):
        def chunks():
            fresh = budget.fresh()  # each pass has the whole allowance
            for where, part in _parts(path, policy, fresh):
                if name not in part:
                    raise InputError(f"{where}: the batch holds no {name} column (other lines do)")
                yield from chunked(_column(part[name], f"{where}: {name}", fresh))  # CHUNK_BYTES of rows at a time
        return chunks

    return {COLUMNS[name]: lazy(COLUMNS[name], rows, shape, dtype, chunks_of(name), name != "obs")
            for name, (shape, dtype) in shapes.items()}
