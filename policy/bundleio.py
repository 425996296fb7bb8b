"""TensorFlow's checkpoint files (the tensor bundle: ``PREFIX.index`` + ``PREFIX.data-*``), read
in Python without TensorFlow.

``tf.compat.v1.train.Saver`` checkpoints (RLlib <= 2.0's ``TFPolicy.export_checkpoint``) and a
SavedModel's ``variables/variables`` share this layout: the index is a LevelDB-style table
(blocks of prefix-compressed keys, a block index, a footer with a magic number) mapping each
tensor's name to a ``BundleEntryProto`` (dtype, shape, shard, offset, size); the data files hold
the raw little-endian bytes. :func:`read_bundle` parses the index with bounds checked at every
step, accepts only numeric dtypes whose byte size matches their shape, reads each array from
inside its data file (opened without following links, with a size limit) and never hands any of
it to TensorFlow's own C++ reader. Entries of other dtypes (strings of an object graph,
resources) are listed and never read; compressed blocks and sliced (partitioned) variables are
refused. Every checksum TensorFlow's own reader checks is checked too: the masked CRC32C of each
index block (its 5-byte trailer) and of each tensor's bytes (the entry's ``crc32c``), so a file
altered after it was written is refused rather than served. The tensors read from one checkpoint
total at most :data:`TOTAL_LIMIT` bytes, however many shards and entries the index declares,
checked before any data file is opened; each is read from its offset alone, never the whole file.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from policy_export.errors import UnsafeCheckpointError
from policy_export.policy.files import read_regular

INDEX_LIMIT = 64 << 20
DATA_LIMIT = 1 << 30  # bytes of one data file
TOTAL_LIMIT = 1 << 30  # bytes of all tensors read from one checkpoint, over every shard and entry
MAX_SHARDS = 10_000
MAX_ENTRIES = 200_000
MAX_KEY = 4096  # bytes of one tensor name
MAX_KEY_BYTES = 64 << 20  # of all names: prefix compression lets a small index declare much more
MAX_RANK = 32
MAGIC = 0xDB4775248B80FB57
FOOTER = 48
# TensorFlow's DataType enum -> numpy, for the dtypes weights are stored in
DTYPES = {1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 9: "<i8", 10: "?", 19: "<f2", 22: "<u4",
          23: "<u8"}


# ------------------------------------------------------------------------------------- CRC32C
# CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) as TensorFlow's ``crc32c::Value``, in numpy:
# the bytes are cut into up to 65536 equal lanes, each lane's register advanced four bytes a step
# through two 16-bit tables, and the lanes joined by the linear "append n zero bytes" map.
_POLY = 0x82F63B78
_MASK_DELTA = 0xA282EAD8
_LANES = 1 << 16
_SMALL = 1 << 14  # bytes below which a plain loop is faster


def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


def _word_tables() -> tuple[list[int], np.ndarray, np.ndarray]:
    """The byte table (as ints) and two 16-bit tables that advance the register over four bytes."""
    tables = [_byte_table()]
    for _ in range(3):
        tables.append((tables[-1] >> 8) ^ tables[0][tables[-1] & 0xFF])
    x = np.arange(1 << 16, dtype=np.uint32)
    low = (tables[3][x & 0xFF] ^ tables[2][x >> 8]).astype(np.uint32)
    high = (tables[1][x & 0xFF] ^ tables[0][x >> 8]).astype(np.uint32)
    return [int(v) for v in tables[0]], low, high


_BYTE, _LOW, _HIGH = _word_tables()


def _bytewise(data, state: int) -> int:
    for byte in bytes(data):
        state = _BYTE[(state ^ byte) & 0xFF] ^ (state >> 8)
    return state


def _apply(columns: tuple[int, ...], value: int) -> int:
    out, bit = 0, 0
    while value:
        if value & 1:
            out ^= columns[bit]
        value >>= 1
        bit += 1
    return out


@functools.cache
def _power(k: int) -> tuple[int, ...]:
    """The columns of the linear map "advance the register over 2**k zero bytes"."""
    if k == 0:
        return tuple(_bytewise(b"\0", 1 << j) for j in range(32))
    half = _power(k - 1)
    return tuple(_apply(half, c) for c in half)


def _shift(value: int, count: int) -> int:
    """The register ``value`` advanced over ``count`` zero bytes."""
    k = 0
    while count:
        if count & 1:
            value = _apply(_power(k), value)
        count >>= 1
        k += 1
    return value


@functools.lru_cache(maxsize=64)
def _shift_tables(count: int) -> np.ndarray:
    """Four byte tables of the map "advance the register over ``count`` zero bytes"."""
    columns, byte = [_shift(1 << j, count) for j in range(32)], np.arange(256, dtype=np.uint32)
    tables = np.zeros((4, 256), np.uint32)
    for k in range(4):
        for bit in range(8):
            tables[k] ^= np.where((byte >> bit) & 1, np.uint32(columns[8 * k + bit]), np.uint32(0))
    return tables


def _shift_lanes(states: np.ndarray, count: int) -> np.ndarray:
    """Each register of ``states`` advanced over ``count`` zero bytes."""
    tables = _shift_tables(count)
    out = np.zeros_like(states)
    for k in range(4):
        out ^= tables[k][(states >> np.uint32(8 * k)) & np.uint32(0xFF)]
    return out


def _crc_register(data, state: int) -> int:
    """The CRC register after ``data``, from ``state`` (no final inversion)."""
    size = len(data)
    if size < _SMALL:
        return _bytewise(data, state)
    lanes = _LANES
    while lanes * 256 > size:
        lanes //= 2
    steps = size // (4 * lanes)
    words = np.frombuffer(data, "<u4", lanes * steps).reshape(lanes, steps)
    lane, low, high = np.zeros(lanes, np.uint32), np.empty(lanes, np.uint32), np.empty(lanes, np.uint32)
    lane[0] = state  # the register entering the first lane; the others start from zero
    for start in range(0, steps, 64):
        for row in np.ascontiguousarray(words[:, start:start + 64].T):
            lane ^= row
            np.bitwise_and(lane, 0xFFFF, out=low)
            np.right_shift(lane, 16, out=high)
            _LOW.take(low, out=lane)
            lane ^= _HIGH.take(high)
    length = 4 * steps
    while len(lane) > 1:  # the register is linear: join neighbouring lanes, doubling their length
        lane = _shift_lanes(lane[0::2], length) ^ lane[1::2]
        length *= 2
    return _crc_register(memoryview(data)[lanes * steps * 4:], int(lane[0]))


def crc32c(data) -> int:
    """CRC-32C of ``data`` (any bytes-like object), as TensorFlow's ``crc32c::Value``.

    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    """
    return _crc_register(memoryview(data).cast("B"), 0xFFFFFFFF) ^ 0xFFFFFFFF


def masked_crc32c(data) -> int:
    """The CRC-32C of ``data`` masked as TensorFlow stores it (``crc32c::Mask``)."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def _read(path: Path, limit: int) -> bytes:
    """``path``'s bytes through :func:`policy.files.read_regular` (no link followed, size checked first)."""
    try:
        return read_regular(path, limit, UnsafeCheckpointError)
    except OSError as e:
        raise UnsafeCheckpointError(f"cannot read {path}: {e.strerror} (a symbolic link is never followed)") from e


@dataclass(frozen=True)
class BundleEntry:
    """One tensor of the index; ``dtype`` is None for a dtype this reader does not read."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int
    dtype_enum: int
    crc32c: int | None = None  # masked, as stored; None when the index holds none


class _Cursor:
    """Protobuf and table varints over ``data[pos:end]``, every read bounds-checked."""

    def __init__(self, data: bytes, where: str, pos: int = 0, end: int | None = None):
        self.data, self.where, self.pos = data, where, pos
        self.end = len(data) if end is None else end

    def fail(self, what: str):
        raise UnsafeCheckpointError(f"{self.where}: {what} (at byte {self.pos}); not a TensorFlow checkpoint index")

    def varint(self) -> int:
        value = shift = 0
        while True:
            if self.pos >= self.end or shift > 63:
                self.fail("a truncated or overlong varint")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            self.fail(f"a field of {n} bytes past the end")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def fields(self):
        """``(field number, wire type, value)`` of a protobuf message: ints, or bytes for
        length-delimited fields."""
        while self.pos < self.end:
            key = self.varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                yield number, wire, self.varint()
            elif wire == 2:
                yield number, wire, self.take(self.varint())
            elif wire == 5:
                yield number, wire, int.from_bytes(self.take(4), "little")
            elif wire == 1:
                yield number, wire, int.from_bytes(self.take(8), "little")
            else:
                self.fail(f"protobuf wire type {wire}")


def _block(index: bytes, offset: int, size: int, where: str) -> list[tuple[bytes, bytes]]:
    """The (key, value) entries of the table block at ``offset`` (``size`` bytes + 5-byte trailer)."""
    if offset < 0 or size < 4 or offset + size + 5 > len(index) - FOOTER:
        raise UnsafeCheckpointError(f"{where}: a block [{offset}, +{size}] outside the index")
    stored = int.from_bytes(index[offset + size + 1:offset + size + 5], "little")
    if masked_crc32c(memoryview(index)[offset:offset + size + 1]) != stored:
        raise UnsafeCheckpointError(f"{where}: the index block at byte {offset} does not match its checksum; "
                                    "the file was altered or damaged after it was written")
    if index[offset + size] != 0:
        raise UnsafeCheckpointError(f"{where}: a compressed index block (type {index[offset + size]}); only "
                               "uncompressed checkpoint indexes are read")
    restarts = int.from_bytes(index[offset + size - 4:offset + size], "little")
    end = offset + size - 4 * (restarts + 1)
    if restarts < 1 or end < offset:
        raise UnsafeCheckpointError(f"{where}: a block with {restarts} restart points does not fit its size")
    cur, entries, key, key_bytes = _Cursor(index, where, offset, end), [], b"", 0
    while cur.pos < end:
        shared, unshared, length = cur.varint(), cur.varint(), cur.varint()
        if shared > len(key) or shared + unshared > MAX_KEY:
            cur.fail(f"a key of {shared} shared + {unshared} bytes (the previous key has {len(key)}; at most {MAX_KEY})")
        key = key[:shared] + cur.take(unshared)
        entries.append((key, cur.take(length)))
        key_bytes += len(key)
        if len(entries) > MAX_ENTRIES or key_bytes > MAX_KEY_BYTES:
            cur.fail(f"more than {MAX_ENTRIES} entries or {MAX_KEY_BYTES} bytes of names in a block")
    return entries


def _handle(cur: _Cursor) -> tuple[int, int]:
    return cur.varint(), cur.varint()


def _table(index: bytes, where: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of the table, in order."""
    if len(index) < FOOTER or int.from_bytes(index[-8:], "little") != MAGIC:
        raise UnsafeCheckpointError(f"{where}: no table footer (magic number); not a TensorFlow checkpoint index")
    footer = _Cursor(index, where, len(index) - FOOTER, len(index) - 8)
    _handle(footer)  # the meta index, unused
    entries, key_bytes = [], 0
    for _, value in _block(index, *_handle(footer), where):
        block = _block(index, *_handle(_Cursor(value, where)), where)
        entries.extend(block)
        key_bytes += sum(len(k) for k, _ in block)
        if len(entries) > MAX_ENTRIES or key_bytes > MAX_KEY_BYTES:
            raise UnsafeCheckpointError(f"{where}: more than {MAX_ENTRIES} entries or {MAX_KEY_BYTES} bytes of names")
    return entries


def _typed(fields, where: str, varints: Iterable[int] = (), messages: Iterable[int] = (),
           fixed32: Iterable[int] = ()):
    """The fields, each known one checked to have its wire type (0: a varint, 2: bytes, 5: 32 bits)."""
    expected = {**{n: 0 for n in varints}, **{n: 2 for n in messages}, **{n: 5 for n in fixed32}}
    for number, wire, value in fields:
        if expected.get(number, wire) != wire:
            raise UnsafeCheckpointError(f"{where}: field {number} has wire type {wire}")
        yield number, value


def _shape(data: bytes, where: str) -> tuple[int, ...]:
    dims = []
    for number, value in _typed(_Cursor(data, where).fields(), where, varints=(3,), messages=(2,)):
        if number == 2:  # Dim
            size = next((v for n, v in _typed(_Cursor(value, where).fields(), where, varints=(1,)) if n == 1), 0)
            if size >= 1 << 31:
                raise UnsafeCheckpointError(f"{where}: a dimension of {size} (unknown, negative or too large)")
            dims.append(size)
            if len(dims) > MAX_RANK:
                raise UnsafeCheckpointError(f"{where}: a tensor of rank over {MAX_RANK}")
        elif number == 3 and value:
            raise UnsafeCheckpointError(f"{where}: a tensor of unknown rank")
    return tuple(dims)


def _entry(name: str, data: bytes, where: str) -> BundleEntry:
    found = {"dtype": 0, "shape": (), "shard": 0, "offset": 0, "size": 0, "crc32c": None}
    here = f"{where} entry {name!r}"
    fields = _typed(_Cursor(data, here).fields(), here, varints=(1, 3, 4, 5), messages=(2, 7), fixed32=(6,))
    for number, value in fields:
        if number == 1:
            found["dtype"] = value
        elif number == 2:
            found["shape"] = _shape(value, here)
        elif number in (3, 4, 5, 6):
            found[{3: "shard", 4: "offset", 5: "size", 6: "crc32c"}[number]] = value
        elif number == 7:
            raise UnsafeCheckpointError(f"{where}: {name!r} is a sliced (partitioned) variable, which is not read")
    dtype = np.dtype(DTYPES[found["dtype"]]) if found["dtype"] in DTYPES else None
    entry = BundleEntry(name, dtype, found["shape"], found["shard"], found["offset"], found["size"], found["dtype"],
                        found["crc32c"])
    if dtype is not None and int(np.prod(entry.shape, dtype=object)) * dtype.itemsize != entry.size:
        raise UnsafeCheckpointError(f"{where}: {name!r} declares shape {list(entry.shape)} of {dtype} but {entry.size} "
                               f"bytes")
    return entry


def bundle_entries(prefix: str | Path) -> tuple[int, dict[str, BundleEntry]]:
    """``(number of data shards, name -> entry)`` from ``PREFIX.index`` (nothing else is read).

    Raises:
        UnsafeCheckpointError: the index is missing, a link, too large or malformed, big-endian,
            compressed, or declares sizes that do not match its shapes.
    """
    prefix = Path(prefix)
    where = str(prefix) + ".index"
    index = _read(Path(where), INDEX_LIMIT)
    shards, entries = 1, {}
    for key, value in _table(index, where):
        if key == b"":  # the header: shard count and byte order
            for number, v in _typed(_Cursor(value, where).fields(), where, varints=(1, 2), messages=(3,)):
                if number == 1:
                    shards = v
                elif number == 2 and v != 0:
                    raise UnsafeCheckpointError(f"{where}: a big-endian checkpoint, which is not read")
            continue
        try:
            name = key.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafeCheckpointError(f"{where}: a tensor name that is not UTF-8") from None
        entries[name] = _entry(name, value, where)
    if not 1 <= shards <= MAX_SHARDS or any(e.shard >= shards for e in entries.values()):
        raise UnsafeCheckpointError(f"{where}: {shards} data shards, and entries in shards beyond them")
    return shards, entries


def read_bundle(prefix: str | Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays of the checkpoint ``prefix``: those named (each must be present and readable),
    or every numeric one.

    Raises:
        UnsafeCheckpointError: as :func:`bundle_entries`; a named tensor missing or of a dtype that is
            not read; the tensors to read over :data:`TOTAL_LIMIT` bytes in all; a data file missing,
            a link, too large, or shorter than an entry needs; a tensor whose bytes do not match
            its checksum.
    """
    prefix = Path(prefix)
    shards, entries = bundle_entries(prefix)
    wanted = [e for e in entries.values() if e.dtype is not None] if names is None else []
    for name in names or []:
        entry = entries.get(name)
        if entry is None or entry.dtype is None:
            why = "holds no tensor" if entry is None else f"stores it as dtype {entry.dtype_enum}, not a number"
            raise UnsafeCheckpointError(f"{prefix}: the checkpoint {why} {name!r}")
        wanted.append(entry)
    total = sum(e.size for e in wanted)
    if total > TOTAL_LIMIT:
        raise UnsafeCheckpointError(
            f"{prefix}: {len(wanted)} tensors of {total} bytes in all (across {len({e.shard for e in wanted})} "
            f"data files), over the {TOTAL_LIMIT >> 20} MiB a checkpoint may hold; nothing was read")
    by_shard: dict[int, list[BundleEntry]] = {}
    for entry in wanted:
        by_shard.setdefault(entry.shard, []).append(entry)
    out = {}
    for shard in sorted(by_shard):  # one data file open at a time
        fd = _open_data(prefix.parent / f"{prefix.name}.data-{shard:05d}-of-{shards:05d}")
        try:
            size = os.fstat(fd).st_size
            for entry in by_shard[shard]:
                out[entry.name] = _read_tensor(fd, size, entry, prefix)
        finally:
            os.close(fd)
    return out


def _open_data(path: Path) -> int:
    """A descriptor of the data file ``path``: opened without following a link, a regular file of at
    most :data:`DATA_LIMIT` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UnsafeCheckpointError(f"cannot read {path}: {e.strerror} (a symbolic link is never followed)") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > DATA_LIMIT:
        os.close(fd)
        why = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} bytes, over {DATA_LIMIT}"
        raise UnsafeCheckpointError(f"refusing to read {path}: {why}")
    return fd


def _short(name: str) -> str:
    return repr(name) if len(name) <= 120 else repr(name[:117] + "...")


def _read_tensor(fd: int, file_size: int, entry: BundleEntry, prefix: Path) -> np.ndarray:
    """``entry``'s array, its bytes read from their offset alone and checked against their checksum."""
    if entry.offset + entry.size > file_size:
        raise UnsafeCheckpointError(f"{prefix}: {entry.name!r} lies past the end of its data file")
    raw = np.empty(entry.size, np.uint8)
    done = 0
    while done < entry.size:
        got = os.preadv(fd, [raw[done:]], entry.offset + done)
        if got <= 0:
            raise UnsafeCheckpointError(f"{prefix}: {entry.name!r} lies past the end of its data file")
        done += got
    if entry.crc32c is None or masked_crc32c(raw) != entry.crc32c:
        why = "has no checksum" if entry.crc32c is None else "does not match its checksum"
        raise UnsafeCheckpointError(f"{prefix}: the bytes of {_short(entry.name)} {why}; the checkpoint was altered or "
                                    "damaged after it was written, and nothing from it is used")
    try:
        return raw.view(entry.dtype).reshape(entry.shape).astype(entry.dtype.newbyteorder("="), copy=False)
    except (ValueError, MemoryError) as e:
        raise UnsafeCheckpointError(f"{prefix}: {entry.name!r} of shape {list(entry.shape)}: {e}") from None


def checkpoint_prefix(path: str | Path) -> Path:
    """The prefix of a TF1 checkpoint given as its prefix, its ``.index`` file, or the directory
    holding it (the one ``*.index`` there, else the one TF's ``checkpoint`` file names, by base
    name and inside that directory only).

    Raises:
        UnsafeCheckpointError: no checkpoint there, or several and none named.
    """
    path = Path(path)
    if path.name.endswith(".index"):
        return path.with_name(path.name[:-len(".index")])
    if not path.is_dir():
        return path
    indexes = sorted(p.name[:-len(".index")] for p in path.iterdir() if p.name.endswith(".index"))
    if len(indexes) == 1:
        return path / indexes[0]
    named = None
    if (path / "checkpoint").is_file() and not (path / "checkpoint").is_symlink():
        text = _read(path / "checkpoint", 1 << 20).decode("utf-8", "replace")
        for line in text.splitlines():
            if line.startswith("model_checkpoint_path:"):
                named = line.split(":", 1)[1].strip().strip('"').replace("\\", "/").rsplit("/", 1)[-1]
    if named in indexes:
        return path / named
    raise UnsafeCheckpointError(f"{path}: {'no' if not indexes else len(indexes)} TF checkpoint(s) (*.index) "
                           f"{'' if not indexes else '(' + ', '.join(indexes) + ') and none named by its checkpoint file'}")
