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
  observation (read as in :mod:`.rllib_json`) or a list of numbers.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded.columns import Column, lazy

MAX_FILES = 100_000
CELL_LIMIT = 256 << 20  # bytes of one msgpack cell (one episode)


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


def _table(path: Path, columns: list[str] | None = None):
    from policy_export.exporter.compat import require

    require(("pyarrow",), "offline", "--observations of a Parquet file")
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path) if columns is None else pq.read_table(path, columns=columns)
    except (OSError, ValueError) as e:
        raise InputError(f"--observations {path}: not a readable Parquet file ({str(e)[:120]})") from None


def _hook(obj: dict) -> Any:
    """``msgpack_numpy``'s encoding of an array (``nd`` true) or a numpy scalar, rebuilt from its
    bytes; any other map as it is."""
    if b"nd" not in obj:
        return obj
    kind, type_, data = obj.get(b"kind", b""), obj.get(b"type"), obj.get(b"data")
    if kind not in (b"", "") or not isinstance(type_, str) or not isinstance(data, bytes):
        raise InputError("an episode holds an array of objects or records, which is not read (msgpack_numpy "
                         "would unpickle it)")
    dtype = np.dtype(type_)
    if dtype.kind not in "biuf" or dtype.fields is not None:
        raise InputError(f"an episode holds an array of {type_[:20]}, which is not read")
    if obj[b"nd"]:
        shape = obj.get(b"shape")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InputError("an episode's array has no shape")
        if int(np.prod(shape)) * dtype.itemsize != len(data):
            raise InputError("an episode's array declares more values than its bytes hold")
        return np.frombuffer(data, dtype).reshape(shape)
    if len(data) != dtype.itemsize:
        raise InputError("an episode's number does not fit its type")
    return np.frombuffer(data, dtype)[0]


def _episode_rows(cell: bytes, where: str) -> tuple[str, np.ndarray]:
    import msgpack

    if len(cell) > CELL_LIMIT:
        raise InputError(f"{where}: an episode of more than {CELL_LIMIT >> 20} MiB")
    try:
        state = msgpack.unpackb(cell, object_hook=_hook, raw=False, strict_map_key=False, ext_hook=_no_ext)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise InputError(f"{where}: an episode that is not msgpack ({str(e)[:80]})") from None
    observations = state.get("observations") if isinstance(state, dict) else None
    data = observations.get("data") if isinstance(observations, dict) else None
    lookback, t = (observations or {}).get("lookback", 0), state.get("t") if isinstance(state, dict) else None
    if not isinstance(data, list) or not isinstance(lookback, int) or not isinstance(t, int) \
            or not all(isinstance(o, np.ndarray) for o in data):
        raise InputError(f"{where}: not an RLlib episode (no observations buffer of arrays)")
    acted = data[lookback:][:max(len(data) - lookback - 1, 0)]  # the last observation is acted on by no one
    if not acted:
        return str(state.get("id_")), np.zeros((0, *(data[0].shape if data else ())), np.float32)
    return str(state.get("id_")), np.stack(acted)


def _no_ext(code: int, data: bytes):
    raise InputError(f"a msgpack extension type {code}, which an episode never holds")


def _episodes(files: list[Path]) -> Iterator[np.ndarray]:
    seen: set[str] = set()
    for f in files:
        table = _table(f, ["item"])
        for i, cell in enumerate(table.column("item").to_pylist()):
            eid, rows = _episode_rows(cell, f"--observations {f}: row {i}")
            if eid in seen:
                continue
            seen.add(eid)
            if len(rows):
                yield rows


def _packed_rows(files: list[Path]) -> Iterator[np.ndarray]:
    from policy_export.exporter.recorded.rllib_json import unpack

    for f in files:
        cells = _table(f, ["obs"]).column("obs").to_pylist()
        out = [unpack(c, f"--observations {f}: obs") if isinstance(c, str) else np.asarray(c) for c in cells]
        if out:
            yield np.stack(out)


def columns(path: Path) -> dict[str, Column]:
    files = _files(path)
    names = set(_table(files[0]).schema_arrow.names)
    if names == {"item"}:
        make = lambda: _episodes(files)  # noqa: E731
    elif "obs" in names:
        make = lambda: _packed_rows(files)  # noqa: E731
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
    if not rows:
        raise InputError(f"--observations {path}: holds no rows")
    out = {"obs": lazy("obs", rows, shape, dtype, make)}
    if names == {"item"}:  # each cell is one episode: its rows numbered as one
        def episode_numbers():
            for number, chunk in enumerate(make()):
                yield np.full(len(chunk), number, np.int64)
        out["eps_id"] = lazy("eps_id", rows, (), np.int64, episode_numbers, optional=True)
    return out
