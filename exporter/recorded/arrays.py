"""``.npy`` and ``.npz`` files read as columns without loading them whole: each array's header is
read first (numpy's format, ``allow_pickle`` never: an object array is refused), then its rows are
streamed :data:`~exporter.recorded.budget.CHUNK_BYTES` at a time from the file (or the zip member,
stored or deflated; no other compression is read).

Bounded before a row is read: a ``.npy`` must hold the bytes its header declares (a huge declared
shape is a truncated file, refused at once); an ``.npz``'s arrays may declare at most the file's
:class:`~exporter.recorded.budget.Budget` allowance in all (a small archive of deflated zeros
that would inflate to gigabytes is refused from its headers, nothing inflated), and each member is
read only up to the bytes its header declares.
"""

from __future__ import annotations

import math
import os
import tokenize
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded.budget import MAX_DIM, Budget, chunk_rows
from policy_export.exporter.recorded.columns import EPISODE_COLUMNS, Column

MAX_MEMBERS = 1024
MAX_NAME = 256  # characters of an array's name (it names an input, and appears in messages)
COMPRESSIONS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}  # what numpy's savez writes
# what reading a zip member may raise: a bad CRC or header, a corrupt deflate stream, the file cut short
READ_ERRORS = (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError)
# what numpy's header parser (a literal read with ast and tokenize) raises on a malformed header
HEADER_ERRORS = READ_ERRORS + (SyntaxError, TypeError, KeyError, OverflowError, RecursionError,
                               tokenize.TokenError)


def _header(f: IO[bytes], where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        major, _ = np.lib.format.read_magic(f)
        read = {1: np.lib.format.read_array_header_1_0, 2: np.lib.format.read_array_header_2_0}.get(major)
        if read is None:
            raise ValueError(f"npy format version {major}")
        shape, fortran, dtype = read(f)
    except HEADER_ERRORS as e:
        raise InputError(f"{where}: not a numpy array file ({type(e).__name__}: {str(e)[:120]})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biuf":
        raise InputError(f"{where}: arrays of {dtype} are not read (numbers and booleans are)")
    if not shape:
        raise InputError(f"{where}: a single value, not rows of observations")
    if not all(0 <= d <= MAX_DIM for d in shape):  # checked before any of them is formatted or multiplied
        raise InputError(f"{where}: a declared shape with a dimension beyond {MAX_DIM} (or negative)")
    if shape[0] and not math.prod(shape[1:]):
        raise InputError(f"{where}: rows of shape {list(shape[1:])}, which hold no values")
    if fortran and len(shape) > 1:
        raise InputError(f"{where}: a Fortran-ordered array; save it in C order (numpy's default)")
    return tuple(int(d) for d in shape), fortran, dtype


def declared_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _streamer(opener: Callable[[], IO[bytes]], shape: tuple[int, ...], dtype: np.dtype, where: str):
    """Chunks of rows of the array whose data starts where ``opener``'s stream is after its header;
    exactly the bytes the header declares are read, a chunk of at most ``CHUNK_BYTES`` at a time."""
    row_items = math.prod(shape[1:])
    row_bytes = row_items * dtype.itemsize

    def chunks():
        step = chunk_rows(row_bytes)
        try:
            with opener() as f:
                _header(f, where)
                left = shape[0]
                while left:
                    n = min(step, left)
                    data = f.read(n * row_bytes)
                    if len(data) != n * row_bytes:
                        raise InputError(f"{where}: the file ends before its {shape[0]} rows (truncated)")
                    yield np.frombuffer(data, dtype).reshape((n, *shape[1:]))
                    left -= n
        except READ_ERRORS as e:
            raise InputError(f"{where}: cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    return chunks


def _npy(path: Path, flag: str) -> dict[str, Column]:
    where = f"{flag} {path}"
    with open(path, "rb") as f:
        shape, _, dtype = _header(f, where)
        data_bytes = os.fstat(f.fileno()).st_size - f.tell()
    if declared_bytes(shape, dtype) > data_bytes:  # a huge declared shape: refused before a row is read
        raise InputError(f"{where}: the file ends before its {shape[0]} rows (truncated)")
    return {"observations": Column("observations", shape[0], shape[1:], dtype,
                                   _streamer(lambda: open(path, "rb"), shape, dtype, where))}


def _member_opener(path: Path, name: str) -> Callable[[], IO[bytes]]:
    def opener():
        zf = zipfile.ZipFile(path)
        try:
            stream = zf.open(name)
        except BaseException:
            zf.close()
            raise
        stream_close = stream.close

        def close():
            stream_close()
            zf.close()
        stream.close = close
        return stream
    return opener


def columns(path: Path, kind: str, share: int = 1, flag: str = "--observations") -> dict[str, Column]:
    """The file's arrays as columns, from their headers (nothing inflated); ``share``: the inputs
    of the command, which share the budget's floor; ``flag`` names the file's option in messages.

    Raises:
        InputError: not a numpy file or archive, an array of objects, a shape or size it cannot
            hold, members compressed otherwise than numpy writes them or inflating past the budget.
    """
    if kind == "npy":
        return _npy(path, flag)
    budget = Budget(f"{flag} {path}", os.stat(path).st_size, share)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise InputError(f"{flag} {path}: not an .npz archive ({str(e)[:120]})") from None
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        if len(members) > MAX_MEMBERS:
            raise InputError(f"{flag} {path}: {len(members)} arrays, more than {MAX_MEMBERS}")
        out, declared = {}, 0
        for member in members:
            if not member.filename.endswith(".npy"):
                raise InputError(f"{flag} {path}: {member.filename[:80]!r} is not a numpy array")
            if len(member.filename) > MAX_NAME + 4:
                raise InputError(f"{flag} {path}: an array named with more than {MAX_NAME} characters")
            key = member.filename[:-4]
            where = f"{flag} {path}: {key}"
            if member.compress_type not in COMPRESSIONS or member.flag_bits & 0x1:
                raise InputError(f"{where}: a member {'encrypted' if member.flag_bits & 0x1 else 'compressed'} "
                                 f"otherwise than numpy writes them ({' or '.join(COMPRESSIONS.values())})")
            try:
                with archive.open(member) as f:
                    shape, _, dtype = _header(f, where)
            except READ_ERRORS + (NotImplementedError, RuntimeError) as e:
                raise InputError(f"{where}: cannot be read ({str(e)[:120]})") from None
            declared += declared_bytes(shape, dtype)
            budget.declare(declared, "its arrays")  # before anything is inflated
            out[key] = Column(key, shape[0], shape[1:], dtype,
                              _streamer(_member_opener(path, member.filename), shape, dtype, where),
                              optional=key in EPISODE_COLUMNS)
    return out
