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
refused. The entries' CRC32C checksums are not verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from policy_export.errors import UnsafeCheckpointError
from policy_export.policy.files import read_regular

INDEX_LIMIT = 64 << 20
DATA_LIMIT = 1 << 30
MAX_ENTRIES = 200_000
MAX_KEY = 4096  # bytes of one tensor name
MAX_KEY_BYTES = 64 << 20  # of all names: prefix compression lets a small index declare much more
MAX_RANK = 32
MAGIC = 0xDB4775248B80FB57
FOOTER = 48
# TensorFlow's DataType enum -> numpy, for the dtypes weights are stored in
DTYPES = {1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 9: "<i8", 10: "?", 19: "<f2", 22: "<u4",
          23: "<u8"}


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


def _typed(fields, where: str, varints: Iterable[int] = (), messages: Iterable[int] = ()):
    """The fields, each known one checked to have its wire type (0: a varint, 2: bytes)."""
    varints, messages = set(varints), set(messages)
    for number, wire, value in fields:
        if (number in varints and wire != 0) or (number in messages and wire != 2):
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
    found = {"dtype": 0, "shape": (), "shard": 0, "offset": 0, "size": 0}
    here = f"{where} entry {name!r}"
    for number, value in _typed(_Cursor(data, here).fields(), here, varints=(1, 3, 4, 5), messages=(2, 7)):
        if number == 1:
            found["dtype"] = value
        elif number == 2:
            found["shape"] = _shape(value, here)
        elif number in (3, 4, 5):
            found[{3: "shard", 4: "offset", 5: "size"}[number]] = value
        elif number == 7:
            raise UnsafeCheckpointError(f"{where}: {name!r} is a sliced (partitioned) variable, which is not read")
    dtype = np.dtype(DTYPES[found["dtype"]]) if found["dtype"] in DTYPES else None
    entry = BundleEntry(name, dtype, found["shape"], found["shard"], found["offset"], found["size"], found["dtype"])
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
    if not 1 <= shards <= 10_000 or any(e.shard >= shards for e in entries.values()):
        raise UnsafeCheckpointError(f"{where}: {shards} data shards, and entries in shards beyond them")
    return shards, entries


def read_bundle(prefix: str | Path, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays of the checkpoint ``prefix``: those named (each must be present and readable),
    or every numeric one.

    Raises:
        UnsafeCheckpointError: as :func:`bundle_entries`; a named tensor missing or of a dtype that is
            not read; a data file missing, a link, too large, or shorter than an entry needs.
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
    data: dict[int, bytes] = {}
    out = {}
    for entry in wanted:
        if entry.shard not in data:
            path = prefix.parent / f"{prefix.name}.data-{entry.shard:05d}-of-{shards:05d}"
            data[entry.shard] = _read(path, DATA_LIMIT)
        blob = data[entry.shard]
        if entry.offset + entry.size > len(blob):
            raise UnsafeCheckpointError(f"{prefix}: {entry.name!r} lies past the end of its data file")
        raw = blob[entry.offset:entry.offset + entry.size]
        try:
            out[entry.name] = np.frombuffer(raw, entry.dtype).reshape(entry.shape).astype(entry.dtype.newbyteorder("="))
        except (ValueError, MemoryError) as e:
            raise UnsafeCheckpointError(f"{prefix}: {entry.name!r} of shape {list(entry.shape)}: {e}") from None
    return out


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
