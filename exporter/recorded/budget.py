"""What reading a recorded file may cost: one budget that every reader shares.

A file small on disk must not cost gigabytes or minutes: compression (deflate, LZ4, zstd),
Parquet's dictionary encoding (N identical cells stored once), JSON's and msgpack's nesting, a
pickle's opcodes all make a few bytes on disk cost many in memory or in time. Three bounds, each
checked before the work it bounds, so that memory is bounded by the rows kept and these
constants, and time by the bytes on disk:

- a chunk: rows are streamed :data:`CHUNK_BYTES` at a time (a byte count, not a row count: a row of
  an image is large), never a whole file;
- a cell: one unit decoded whole (a JSON line, a compressed column inflated, a Parquet page or
  cell: one episode or one row) holds at most :data:`CELL_BYTES`, checked from what the file says
  of it before it is decoded (a line's length, an LZ4 frame's declared size or an inflate that
  stops there, a Parquet page's header, a cell's offsets); what a JSON line parses into is
  estimated from its tokens before it is parsed (:func:`parse_cost`, at most :data:`OBJECT_BYTES`),
  and the values a msgpack cell builds are counted as they are built (:data:`CELL_VALUES`);
- a pass: each pass over a file (a first pass counts its rows; each column kept is read again)
  decodes at most :attr:`Budget.allowance` bytes: :data:`INFLATE_RATIO` times its bytes on disk,
  or a floor (:data:`INFLATE_FLOOR`) shared by the files of one command, whichever is more. Sizes
  a file declares (an ``.npz`` member's header, a Parquet page's header) are checked against it
  before anything is inflated; bytes decoded are charged as they are, a cell decoded in Python at
  least :data:`UNIT_BYTES` (a dictionary-encoded cell costs a bit on disk, its decoding much more).
  Work done per Python object has its own allowance, per byte on disk with a shared floor as well:
  msgpack values (:data:`VALUES_PER_DISK_BYTE`), pickle opcodes (:data:`PICKLE_DISK_BYTES`),
  Parquet pages walked (:data:`PAGE_DISK_BYTES`).

A file that exceeds a bound is refused (:class:`~policy_export.errors.InputError`, exit 2), naming
the file and the bound. Episodes are counted in arrays, at most :data:`MAX_EPISODES` (:mod:`.episodes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policy_export.errors import InputError

CHUNK_BYTES = 1 << 20  # rows streamed at a time, in bytes (at least one row; 65,536 rows of CartPole)
CELL_BYTES = 64 << 20  # one unit decoded whole: a JSON line, an inflated column, a Parquet page or cell
OBJECT_BYTES = 256 << 20  # the Python objects one JSON line may parse into (estimated before parsing)
INFLATE_RATIO = 64  # bytes a pass may decode per byte on disk (deflate reaches 1032, LZ4 255, zstd more)...
INFLATE_FLOOR = 256 << 20  # ...or this floor, shared by a command's files (a small file's rows, a few seconds)
UNIT_BYTES = 16 << 10  # the least a cell decoded in Python is charged (its Python work, whatever its size)
ROW_GROUP_BYTES = 256 << 20  # a Parquet row group's pages, decoded (a batch may hold them all; RLlib: 128 MiB)
VALUES_PER_DISK_BYTE = 4  # msgpack values a pass may build per byte on disk (RLlib's episodes: one per 6)...
VALUES_FLOOR = 1 << 20  # ...or this floor (about 1 us each, in Python hooks)
CELL_VALUES = 1 << 22  # msgpack values of one cell (containers and their items: a few hundred MiB at most)
PICKLE_DISK_BYTES = 8  # a pass may run one pickle opcode per this many bytes on disk (RLlib's columns: 11)...
PICKLE_OPS_FLOOR = 1 << 20  # ...or this floor (the safe unpickler runs about 1 us an opcode)
PAGE_DISK_BYTES = 256  # a pass may walk one Parquet page header per this many bytes on disk...
PAGES_FLOOR = 1 << 16  # ...or this floor (pyarrow writes pages of about 1 MiB)
MAX_EPISODES = 1 << 20  # episodes one input (a file, a Parquet directory) may give; counted in arrays
MAX_DIM = 1 << 48  # a declared dimension (larger is no array a file holds; kept short in messages)


def mib(nbytes: int) -> str:
    """``nbytes`` in MiB for a message (a bound, a size on disk: never a number a file holds)."""
    return f"{nbytes / (1 << 20):.0f} MiB"


@dataclass
class Budget:
    """One pass over one input (a file, or a Parquet directory): what it has decoded against its
    allowances. ``where`` names the input in messages (``--observations PATH``), ``disk`` is its
    bytes on disk, ``share`` the number of inputs of the command (they share the floors). A new
    pass starts a new budget (:meth:`fresh`)::

        budget = Budget("--observations x.npz", disk=1 << 20)   # allowance: 256 MiB (the floor)
        budget.declare(8 << 30, "its arrays")   # InputError, before anything is inflated
        budget.cell(len(line), "a line", "its lines")   # at most CELL_BYTES, then charged
    """

    where: str
    disk: int
    share: int = 1
    spent: int = 0
    values: int = 0
    pages: int = 0
    _pickles: Any = field(default=None, repr=False, compare=False)

    def _floor(self, floor: int) -> int:
        return max(1, floor // max(self.share, 1))

    @property
    def allowance(self) -> int:
        return max(self._floor(INFLATE_FLOOR), INFLATE_RATIO * self.disk)

    def fresh(self) -> Budget:
        return Budget(self.where, self.disk, self.share)

    def _on_disk(self) -> str:
        return mib(self.disk) if self.disk >= 1 << 20 else f"{self.disk} bytes"

    def _over(self, what: str) -> InputError:
        return InputError(f"{self.where}: {what} inflate to more than {mib(self.allowance)} ({INFLATE_RATIO}x its "
                          f"{self._on_disk()} on disk, or {mib(self._floor(INFLATE_FLOOR))}); a file compressed this "
                          "far is not read: save the rows uncompressed (.npy, np.savez)")

    def declare(self, nbytes: int, what: str) -> None:
        """A size the file declares (``what``, plural: ``its arrays``), checked before anything is decoded.

        Raises:
            InputError: more than is left of the allowance.
        """
        if nbytes > self.allowance - self.spent:
            raise self._over(what)

    def charge(self, nbytes: int, what: str) -> None:
        """Bytes decoded (or about to be: a cell is charged before it is copied).

        Raises:
            InputError: the pass has decoded more than its allowance.
        """
        self.spent += nbytes
        if self.spent > self.allowance:
            raise self._over(what)

    def cell(self, nbytes: int, what: str, many: str, where: str | None = None) -> None:
        """One unit about to be decoded whole: ``nbytes`` as the file says; ``what`` names it in a
        message (``an episode``), ``many`` all of them (``its episodes``), ``where`` the file when
        it is not the input (a file of a Parquet directory). At most :data:`CELL_BYTES`, and
        charged (at least :data:`UNIT_BYTES`).

        Raises:
            InputError: a cell too large, or the pass over its allowance.
        """
        if nbytes > CELL_BYTES:
            raise InputError(f"{where or self.where}: {what} of more than {mib(CELL_BYTES)}, more than is decoded "
                             "at once")
        self.charge(max(nbytes, UNIT_BYTES), many)

    def charge_values(self, count: int, what: str) -> None:
        """Values (containers and their items) built in Python while decoding.

        Raises:
            InputError: more than the pass's share (:data:`VALUES_PER_DISK_BYTE` per byte on disk,
                or the floor).
        """
        self.values += count
        limit = max(self._floor(VALUES_FLOOR), VALUES_PER_DISK_BYTE * self.disk)
        if self.values > limit:
            raise InputError(f"{self.where}: {what} build more than {limit} values ({VALUES_PER_DISK_BYTE} per byte on "
                             f"disk, or {self._floor(VALUES_FLOOR)}); a file compressed this far is not read")

    def charge_pages(self, count: int) -> None:
        """Parquet page headers walked (:mod:`.parquet_pages`).

        Raises:
            InputError: more than one per :data:`PAGE_DISK_BYTES` on disk (or the floor).
        """
        self.pages += count
        limit = max(self._floor(PAGES_FLOOR), self.disk // PAGE_DISK_BYTES)
        if self.pages > limit:
            raise InputError(f"{self.where}: more than {limit} Parquet pages (one per {PAGE_DISK_BYTES} bytes on disk, "
                             f"or {self._floor(PAGES_FLOOR)})")

    def pickles(self):
        """The safe unpickler's budget for this pass (:class:`~exporter.sources.safe_pickle.ReadBudget`):
        opcodes relative to the bytes on disk, and no time limit of its own (a pass over a large file
        takes what it takes); made once per pass."""
        if self._pickles is None:
            from policy_export.exporter.sources.safe_pickle import ReadBudget

            self._pickles = ReadBudget(objects=self.pickle_limit, decoded=self.allowance, seconds=float("inf"))
        return self._pickles

    @property
    def pickle_limit(self) -> int:
        return max(self._floor(PICKLE_OPS_FLOOR), self.disk // PICKLE_DISK_BYTES)


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk for rows of ``row_bytes`` bytes: :data:`CHUNK_BYTES` of them, at least one."""
    return max(1, CHUNK_BYTES // max(row_bytes, 1))


def parse_cost(line: bytes) -> int:
    """An upper estimate of the bytes ``json.loads(line)`` allocates, from counts of its tokens
    (C-speed scans, before parsing): each list 88 bytes, each dict 232, each comma an item (its
    slot and a float object, 40), each quote half a string (24), and the text three times (the
    bytes, the decoded text, the strings in it; nine times when it is not ASCII: one wide
    character makes a string four bytes a character). Measured (``tracemalloc``, and the line
    itself) it is 1 to 4 times the real peak for lists, dicts, numbers and long strings, more for
    short strings; a base64 string costs three times its length, ``[[],[],...]`` 46 times it."""
    text = (3 if line.isascii() else 9) * len(line)
    return (text + 88 * line.count(b"[") + 232 * line.count(b"{") + 40 * line.count(b",")
            + 24 * line.count(b'"'))
