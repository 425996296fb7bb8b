"""RLlib's offline Parquet (the new API stack's ``OfflineSingleAgentEnvRunner``), read with pyarrow
(the ``offline`` extra), a file or a directory of them (every ``*.parquet`` below it, sorted; no
link followed):

- episodes (``output_write_episodes``, RLlib's default): one column ``item``, each cell a
  ``SingleAgentEpisode`` state as msgpack (``msgpack_numpy``'s maps for arrays). It is decoded
  with a hook that rebuilds only plain numeric arrays from their bytes (an object array, which
  ``msgpack_numpy`` would unpickle, is refused); the rows are the observations the policy acted
  on (``observations`` without the lookback and the final one). An episode written again by a
  later run (RLlib rewrites what it buffered) is read once, by its ``id_``;
- rows (``output_write_episodes=False``): an ``obs`` column, each cell RLlib's ``pack`` of one
  observation (read as in :mod:`.rllib_json`), or a list of numbers (lists of lists for more
  dimensions), or a number.

Bounded (:mod:`.budget`), each before the work: a file's column chunks declare (in its metadata)
what they decode to, checked against the pass's allowance and, per row group, against
``ROW_GROUP_BYTES`` before a page is read; the column is read in record batches of at most
``BATCH_ROWS`` rows (fewer where the declared bytes say rows are large), binary cells as
pyarrow's dictionary arrays (a value stored once and repeated N times is never expanded N
times); each cell's size is read from its offsets and checked (``CELL_BYTES``) and charged before
it is copied out; a msgpack cell's values are counted as they are built (``CELL_VALUES``); at most
``MAX_EPISODES`` episodes are remembered. Whatever a cell holds is type-checked before it is
used (a dtype numpy does not know, a ragged row, a shape its bytes do not hold: refused, naming
the file and the row).
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded.budget import (CELL_BYTES, CELL_VALUES, CHUNK_BYTES, MAX_EPISODES,
                                                    ROW_GROUP_BYTES, Budget, mib)
from policy_export.exporter.recorded.columns import Column, lazy

MAX_FILES = 100_000
BATCH_ROWS = 1024  # rows of a record batch, at most (fewer where a row group's rows are large)
MAX_ID_CHARS = 256  # an episode's id_ (RLlib's: 32 hex digits)
RANK_LIMIT = 32  # dimensions of an array in an episode
WIDTHS = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}  # decoded bytes a value


def _files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    found = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            if name.endswith(".parquet") and stat.S_ISREG(os.lstat(full).st_mode):
                found.append(full)
                if len(found) > MAX_FILES:
                    raise InputError(f"--observations {path}: more than {MAX_FILES} Parquet files")
    if not found:
        raise InputError(f"--observations {path}: a directory without .parquet files")
    return found


def _errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    return (pa.ArrowException, OSError, ValueError, KeyError, TypeError, IndexError)


def _open(path: Path, dictionary: list[str] | None = None):
    from policy_export.exporter.compat import require

    require(("pyarrow",), "offline", "--observations of a Parquet file")
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, read_dictionary=dictionary)
    except _errors() as e:
        raise InputError(f"--observations {path}: not a readable Parquet file ({str(e)[:120]})") from None


def _plan(pf, path: Path, column: str, budget: Budget) -> list[tuple[int, int]]:
    """``(row group, rows per batch)`` for reading ``column``. What its chunks decode to is read
    from their page headers (:mod:`.parquet_pages`: no page larger than ``CELL_BYTES``, whatever
    the footer says) before pyarrow reads a page: each row group at most ``ROW_GROUP_BYTES``, all
    of them within the pass's allowance; a batch holds about ``CHUNK_BYTES`` of rows."""
    from policy_export.exporter.recorded import parquet_pages

    md = pf.metadata
    leaves = [i for i in range(md.num_columns) if md.schema.column(i).path.split(".")[0] == column]
    plan, total = [], 0
    with open(path, "rb", buffering=1 << 16) as f:
        for r in range(md.num_row_groups):
            group = md.row_group(r)
            declared = 0
            for i in leaves:
                chunk = group.column(i)
                width = WIDTHS.get(chunk.physical_type) or max(md.schema.column(i).length or 0, 0)
                declared += parquet_pages.check(f, chunk, width, CELL_BYTES, f"--observations {path}: {column}", budget)
            if declared > ROW_GROUP_BYTES:
                raise InputError(f"--observations {path}: a row group of {column} that decodes to more than "
                                 f"{mib(ROW_GROUP_BYTES)}; write smaller row groups")
            total += declared
            budget.declare(total, f"its {column} column's pages")
            plan.append((r, max(1, min(BATCH_ROWS, group.num_rows * CHUNK_BYTES // max(declared, 1)))))
    return plan


def _batches(path: Path, column: str, budget: Budget) -> Iterator[Any]:
    """``column``'s record batches (pyarrow arrays), binary ones as dictionary arrays, after
    :func:`_plan`'s checks."""
    where = f"--observations {path}"
    pf = _open(path)
    field = pf.schema_arrow.field(column) if column in pf.schema_arrow.names else None
    if field is None:
        raise InputError(f"{where}: holds no {column} column (another file of the directory does)")
    if _binary(field.type):
        pf = _open(path, [column])
    plan = _plan(pf, path, column, budget)
    try:
        for group, rows in plan:
            for batch in pf.iter_batches(batch_size=rows, row_groups=[group], columns=[column], use_threads=False):
                yield batch.column(0)
    except _errors() as e:
        raise InputError(f"{where}: not a readable Parquet file ({type(e).__name__}: {str(e)[:120]})") from None


def _binary(kind: Any) -> bool:
    """Whether a column of this arrow type holds bytes or strings (a dictionary of them too)."""
    import pyarrow as pa

    kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_string(kind) \
        or pa.types.is_large_string(kind)


def _cells(path: Path, column: str, budget: Budget, what: str, many: str) -> Iterator[tuple[int, Any]]:
    """``(row, value)`` of each binary or string cell, its size read from the offsets and charged
    (``budget.cell``) before it is copied out of the batch."""
    import pyarrow as pa
    import pyarrow.compute as pc

    row = 0
    for array in _batches(path, column, budget):
        if isinstance(array, pa.DictionaryArray):
            values, index = array.dictionary, array.indices.to_numpy(zero_copy_only=False)
        else:
            values, index = array, None
        if array.null_count or values.null_count:
            raise InputError(f"--observations {path}: {column}: an empty (null) cell")
        if not _binary(values.type):
            raise InputError(f"--observations {path}: {column}: cells of {str(values.type)[:40]}, not bytes")
        sizes = pc.binary_length(values).to_numpy(zero_copy_only=False)
        for i in range(len(array)):
            j = i if index is None else int(index[i])
            budget.cell(int(sizes[j]), what, many, f"--observations {path}: {column}")
            yield row, values[j].as_py()
            row += 1


# ----------------------------------------------------------------------------- episodes (msgpack)


def _array(obj: dict, where: str) -> Any:
    """``msgpack_numpy``'s encoding of an array (``nd`` true) or a numpy scalar, rebuilt from its
    bytes after every part is type-checked; any other map as it is."""
    if b"nd" not in obj:
        return obj
    kind, type_, data = obj.get(b"kind", b""), obj.get(b"type"), obj.get(b"data")
    if kind not in (b"", "") or not isinstance(type_, str) or not isinstance(data, bytes):
        raise InputError(f"{where}: an episode holds an array of objects or records, which is not read "
                         "(msgpack_numpy would unpickle it)")
    try:
        dtype = np.dtype(type_[:32])
    except (TypeError, ValueError, KeyError, SyntaxError, OverflowError):  # a type string numpy does not know
        dtype = None
    if dtype is None or len(type_) > 32 or dtype.kind not in "biuf" or dtype.fields is not None:
        raise InputError(f"{where}: an episode holds an array of {type_[:20]!r}, which is not read (numbers and "
                         "booleans are)")
    if obj[b"nd"]:
        shape = obj.get(b"shape")
        if not isinstance(shape, (list, tuple)) or len(shape) > RANK_LIMIT \
                or not all(type(d) is int and 0 <= d <= max(len(data), 1) for d in shape):
            raise InputError(f"{where}: an episode's array has no shape (at most {RANK_LIMIT} dimensions, each "
                             "no larger than its bytes)")
        if math.prod(shape) * dtype.itemsize != len(data):
            raise InputError(f"{where}: an episode's array declares another number of values than its bytes hold")
        return np.frombuffer(data, dtype).reshape(shape)
    if len(data) != dtype.itemsize:
        raise InputError(f"{where}: an episode's number does not fit its type")
    return np.frombuffer(data, dtype)[0]


def _decode(cell: bytes, where: str, budget: Budget) -> Any:
    """The msgpack ``cell``, every map and list counted as it is built (:data:`CELL_VALUES` a cell,
    the pass's share of values) and every array rebuilt by :func:`_array`."""
    import msgpack

    built = [0]

    def count(n: int) -> None:
        built[0] += n
        if built[0] > CELL_VALUES:
            raise InputError(f"{where}: an episode of more than {CELL_VALUES} values")
        budget.charge_values(n, "its episodes")

    def on_map(obj: dict) -> Any:
        count(len(obj) + 1)
        return _array(obj, where)

    def on_list(items: list) -> list:
        count(len(items) + 1)
        return items

    def on_ext(code: int, data: bytes):
        raise InputError(f"{where}: a msgpack extension type, which an episode never holds")

    try:
        return msgpack.unpackb(cell, object_hook=on_map, list_hook=on_list, raw=False, strict_map_key=False,
                               ext_hook=on_ext, max_array_len=CELL_VALUES, max_map_len=CELL_VALUES)
    except InputError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        raise InputError(f"{where}: an episode that is not msgpack ({type(e).__name__}: {str(e)[:80]})") from None


def _episode_rows(cell: Any, where: str, budget: Budget) -> tuple[Any, np.ndarray]:
    """``(id, rows)``: the episode's id and the observations it acted on, ``[steps, *shape]``."""
    if not isinstance(cell, bytes):
        raise InputError(f"{where}: an episode cell that is not bytes")
    state = _decode(cell, where, budget)
    del cell
    observations = state.get("observations") if isinstance(state, dict) else None
    data = observations.get("data") if isinstance(observations, dict) else None
    lookback = observations.get("lookback", 0) if isinstance(observations, dict) else None
    t = state.get("t") if isinstance(state, dict) else None
    if not isinstance(data, list) or type(lookback) is not int or lookback < 0 or type(t) is not int \
            or not all(isinstance(o, np.ndarray) for o in data):
        raise InputError(f"{where}: not an RLlib episode (no observations buffer of arrays)")
    eid = state.get("id_")
    if not (isinstance(eid, str) and len(eid) <= MAX_ID_CHARS or type(eid) is int):
        raise InputError(f"{where}: an episode whose id_ is not a string of at most {MAX_ID_CHARS} characters")
    acted = data[lookback:][:max(len(data) - lookback - 1, 0)]  # the last observation is acted on by no one
    if not acted:
        return eid, np.zeros((0, *(data[0].shape if data else ())), np.float32)
    shape = acted[0].shape
    if any(o.shape != shape for o in acted):
        raise InputError(f"{where}: an episode's observations of different shapes")
    return eid, np.stack(acted)


def _episodes(files: list[Path], budget: Budget) -> Iterator[np.ndarray]:
    """The rows of each episode of ``files``, each episode once (a pass, charged to ``budget``);
    the ids seen are remembered as 16-byte digests, at most ``MAX_EPISODES``."""
    seen: set[Any] = set()
    for f in files:
        for i, cell in _cells(f, "item", budget, "an episode", "its episodes"):
            eid, rows = _episode_rows(cell, f"--observations {f}: row {i}", budget)
            eid = hashlib.blake2b(eid.encode("utf-8", "surrogatepass"), digest_size=16).digest() \
                if isinstance(eid, str) else eid
            if eid in seen:
                continue
            if len(seen) >= MAX_EPISODES:
                raise InputError(f"--observations {f}: more than {MAX_EPISODES} episodes in the files")
            seen.add(eid)
            if len(rows):
                yield rows


# ----------------------------------------------------------------------------- rows (obs)


def _number_rows(array: Any, where: str, budget: Budget) -> np.ndarray:
    """A batch of numbers, or of lists of numbers (lists of lists for more dimensions), as
    ``[rows, *shape]``, without a Python object per value; the rows' bytes checked and charged
    before they are copied."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows, shape = len(array), []
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) \
            or pa.types.is_fixed_size_list(array.type):
        if array.null_count:
            raise InputError(f"{where}: an empty (null) value")
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise InputError(f"{where}: ragged rows (lists of different lengths)")
        shape.append(int(lengths[0]) if len(lengths) else 0)
        if len(shape) > RANK_LIMIT:
            raise InputError(f"{where}: rows of more than {RANK_LIMIT} dimensions")
        array = array.flatten()
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type)):
        raise InputError(f"{where}: values of {str(array.type)[:40]}, not numbers")
    if array.null_count:
        raise InputError(f"{where}: an empty (null) value")
    width = 1 if pa.types.is_boolean(array.type) else array.type.bit_width // 8  # a bool as numpy's byte
    row_bytes = math.prod(shape) * width
    budget.cell(row_bytes, "a row", "its rows")
    budget.charge(row_bytes * rows, "its rows")
    return array.to_numpy(zero_copy_only=False).reshape((rows, *shape))


def _packed_rows(files: list[Path], budget: Budget) -> Iterator[np.ndarray]:
    """The ``obs`` rows of ``files``, about ``CHUNK_BYTES`` at a time (a pass, charged to ``budget``)."""
    from policy_export.exporter.recorded.rllib_json import unpack

    for f in files:
        where = f"--observations {f}: obs"
        schema = _open(f).schema_arrow
        if "obs" in schema.names and not _binary(schema.field("obs").type):
            for array in _batches(f, "obs", budget):
                if len(array):
                    yield _number_rows(array, where, budget)
            continue
        held, size = [], 0
        for i, cell in _cells(f, "obs", budget, "an obs cell", "its obs cells"):
            row = unpack(cell if isinstance(cell, str) else cell.decode("ascii", "replace"), f"{where}: row {i}",
                         budget, rows=False)
            if held and (row.shape != held[0].shape or row.dtype.kind != held[0].dtype.kind):
                raise InputError(f"{where}: row {i} of shape {list(row.shape)} ({row.dtype}), earlier rows "
                                 f"{list(held[0].shape)} ({held[0].dtype})")
            held.append(row)
            size += row.nbytes
            if size >= CHUNK_BYTES:
                yield np.stack(held)
                held, size = [], 0
        if held:
            yield np.stack(held)


def columns(path: Path, share: int = 1) -> dict[str, Column]:
    """The columns of RLlib's Parquet output at ``path``, their rows counted in a first pass; one
    budget a pass for all its files (``share``: the inputs of the command, which share its floors).

    Raises:
        InputError: neither RLlib's episodes nor an obs column, a cell that is not what it must be,
            or a bound of :mod:`.budget` exceeded.
    """
    files = _files(path)
    budget = Budget(f"--observations {path}", sum(os.stat(f).st_size for f in files), share)
    names = set(_open(files[0]).schema_arrow.names)
    if names == {"item"}:
        make = lambda: _episodes(files, budget.fresh())
    elif "obs" in names:
        make = lambda: _packed_rows(files, budget.fresh())
    else:
        raise InputError(f"--observations {path}: a Parquet file with neither RLlib's episodes (item) nor an obs "
                         f"column (it has {', '.join(sorted(names))[:200]})")
    rows, shape, dtype = 0, None, None
    for chunk in make():
        rows += len(chunk)
        if shape is None:
            shape, dtype = tuple(chunk.shape[1:]), chunk.dtype
        elif tuple(chunk.shape[1:]) != shape:
            raise InputError(f"--observations {path}: observations of shape {list(chunk.shape[1:])} and {list(shape)}")
        else:
            dtype = np.result_type(dtype, chunk.dtype)
    if not rows:
        raise InputError(f"--observations {path}: holds no rows")
    out = {"obs": lazy("obs", rows, shape, dtype, make)}
    if names == {"item"}:  # each cell is one episode: its rows numbered as one
        def episode_numbers():
            for number, chunk in enumerate(make()):
                yield np.full(len(chunk), number, np.int64)
        out["eps_id"] = lazy("eps_id", rows, (), np.int64, episode_numbers, optional=True)
    return out
