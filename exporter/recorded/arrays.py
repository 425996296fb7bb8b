"""``.npy`` and ``.npz`` files read as columns without loading them whole: each array's header is
read first (numpy's format, ``allow_pickle`` never: an object array is refused), then its rows are
streamed in chunks of :data:`~exporter.recorded.CHUNK_ROWS` from the file (or the zip member,
stored or deflated)."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import IO, Callable

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded.columns import CHUNK_ROWS, EPISODE_COLUMNS, Column

MAX_MEMBERS = 1024


def _header(f: IO[bytes], where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        major, _ = np.lib.format.read_magic(f)
        read = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0}.get(major)
        if read is None:
            raise ValueError(f"npy format version {major}")
        shape, fortran, dtype = read(f)
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"{where}: not a numpy array file ({str(e)[:120]})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biuf":
        raise InputError(f"{where}: arrays of {dtype} are not read (numbers and booleans are)")
    if not shape:
        raise InputError(f"{where}: a single value, not rows of observations")
    if fortran and len(shape) > 1:
        raise InputError(f"{where}: a Fortran-ordered array; save it in C order (numpy's default)")
    return tuple(int(d) for d in shape), fortran, dtype


def _streamer(opener: Callable[[], IO[bytes]], shape: tuple[int, ...], dtype: np.dtype, where: str):
    """Chunks of rows of the array whose data starts where ``opener``'s stream is after its header."""
    row_items = math.prod(shape[1:])

    def chunks():
        with opener() as f:
            _header(f, where)
            left = shape[0]
            while left:
                n = min(CHUNK_ROWS, left)
                data = f.read(n * row_items * dtype.itemsize)
                if len(data) != n * row_items * dtype.itemsize:
                    raise InputError(f"{where}: the file ends before its {shape[0]} rows (truncated)")
                yield np.frombuffer(data, dtype).reshape((n, *shape[1:]))
                left -= n
    return chunks


def columns(path: Path, kind: str) -> dict[str, Column]:
    if kind == "npy":
        with open(path, "rb") as f:
            shape, _, dtype = _header(f, f"--observations {path}")
        where = f"--observations {path}"
        return {"observations": Column("observations", shape[0], shape[1:], dtype,
                                       _streamer(lambda: open(path, "rb"), shape, dtype, where))}
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise InputError(f"--observations {path}: not an .npz archive ({str(e)[:120]})") from None
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        if len(members) > MAX_MEMBERS:
            raise InputError(f"--observations {path}: {len(members)} arrays, more than {MAX_MEMBERS}")
        out = {}
        for member in members:
            if not member.filename.endswith(".npy"):
                raise InputError(f"--observations {path}: {member.filename[:80]!r} is not a numpy array")
            key = member.filename[:-4]
            where = f"--observations {path}: {key}"
            try:
                with archive.open(member) as f:
                    shape, _, dtype = _header(f, where)
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise InputError(f"{where}: cannot be read ({str(e)[:120]})") from None
            name = member.filename

            def opener(name=name):
                zf = zipfile.ZipFile(path)
                stream = zf.open(name)
                stream_close = stream.close

                def close():
                    stream_close()
                    zf.close()
                stream.close = close
                return stream
            out[key] = Column(key, shape[0], shape[1:], dtype, _streamer(opener, shape, dtype, where),
                              optional=key in EPISODE_COLUMNS)
    return out
