"""Parquet page headers, read before pyarrow decodes a page: what each page inflates to.

A Parquet column chunk is a run of pages, each a Thrift ``PageHeader`` (compact protocol)
followed by its compressed bytes. The footer says what a chunk holds in all, and a writer may say
anything there; pyarrow allocates what each page's own header declares (up to 2 GiB a page). This
module walks a chunk's page headers, seeking past each page's bytes as pyarrow does, so that a
page that would inflate past a cell (``CELL_BYTES``) is refused before pyarrow allocates it, and
what the chunk decodes to is known from the pages themselves.

Bounded: a header is parsed from at most :data:`MAX_HEADER_BYTES` (pyarrow's own limit is 16 MiB;
a page header holds a few statistics), nested at most :data:`MAX_DEPTH` structs deep; the pages
walked in a pass are charged to its budget (:meth:`~exporter.recorded.budget.Budget.charge_pages`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from policy_export.errors import InputError

MAX_HEADER_BYTES = 1 << 20  # bytes of one page header, at most
MAX_DEPTH = 16  # structs nested in a header (a PageHeader nests two deep)
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
# PageHeader's fields: 1 type, 2 uncompressed_page_size, 3 compressed_page_size; 5 data_page_header,
# 7 dictionary_page_header and 8 data_page_header_v2 each hold num_values as their field 1
_NESTED_VALUES = (5, 7, 8)


class _Short(Exception):
    """The buffer ended inside the header: read more."""


@dataclass(frozen=True)
class Page:
    kind: int
    uncompressed: int
    compressed: int
    values: int  # the values it holds (data and dictionary pages; 0 for an index page)


class _Compact:
    """Thrift's compact protocol over ``data``: enough to read a ``PageHeader`` (every type of a
    struct read or skipped, so that the header's length is known)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def take(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("a negative length")
        if self.pos + n > len(self.data):
            raise _Short
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("a varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, kind: int, depth: int) -> Any:
        if kind in (1, 2):  # a boolean in a list (in a struct its value is the field's type)
            return self.byte() == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            return struct.unpack("<d", self.take(8))[0]
        if kind == 8:
            return self.take(self.varint())
        if kind in (9, 10):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                self.value(element, depth + 1)
            return None
        if kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.value(types >> 4, depth + 1)
                    self.value(types & 0x0F, depth + 1)
            return None
        if kind == 12:
            return self.struct(depth + 1)
        if kind == 13:  # a UUID
            return self.take(16)
        raise ValueError(f"a Thrift type {kind}")

    def struct(self, depth: int = 0) -> dict[int, Any]:
        if depth > MAX_DEPTH:
            raise ValueError("structs nested too deep")
        fields, last = {}, 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            kind, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self.zigzag()
            fields[last] = (kind == 1) if kind in (1, 2) else self.value(kind, depth)


def _header(f: IO[bytes], pos: int) -> tuple[dict[int, Any], int]:
    size = 256
    while True:
        f.seek(pos)
        data = f.read(size)
        parser = _Compact(data)
        try:
            return parser.struct(), parser.pos
        except _Short:
            if len(data) < size or size >= MAX_HEADER_BYTES:
                raise ValueError("a page header cut short, or longer than "
                                 f"{MAX_HEADER_BYTES >> 10} KiB") from None
            size = min(4 * size, MAX_HEADER_BYTES)


def pages(f: IO[bytes], start: int, length: int, values: int) -> Iterator[Page]:
    """The pages of the column chunk at ``start`` (``length`` bytes on disk, ``values`` values,
    as its metadata says), in order, until its values are read or its bytes end (as pyarrow reads
    them).

    Raises:
        ValueError: a header that is not a page header, or a page past the chunk's bytes.
    """
    pos, end, seen = start, start + length, 0
    while pos < end and seen < values:
        header, size = _header(f, pos)
        kind, uncompressed, compressed = header.get(1), header.get(2), header.get(3)
        if not all(type(v) is int and v >= 0 for v in (kind, uncompressed, compressed)):
            raise ValueError("a page header without its type and sizes")
        nested = next((header[k] for k in _NESTED_VALUES if isinstance(header.get(k), dict)), {})
        count = nested.get(1, 0) if type(nested.get(1, 0)) is int else 0
        pos += size + compressed
        if pos > end:
            raise ValueError("a page past the end of its column chunk")
        if kind in (DATA_PAGE, DATA_PAGE_V2):
            seen += max(count, 0)
        yield Page(kind, uncompressed, compressed, max(count, 0))


def chunk_start(chunk) -> int:
    """Where pyarrow starts reading a column chunk (``ColumnChunkMetaData``): its dictionary page
    when it has one before its data pages, else its first data page."""
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and chunk.dictionary_page_offset and 0 < chunk.dictionary_page_offset < start:
        start = chunk.dictionary_page_offset
    return start


def check(f: IO[bytes], chunk, width: int, cell: int, where: str, budget) -> int:
    """What a column chunk (``ColumnChunkMetaData``) decodes to, from its pages: each page's
    uncompressed bytes at most ``cell``; returns the larger of their sum and their values times
    ``width`` (a dictionary-encoded page of N equal numbers holds a few bytes). Each page walked
    is charged to ``budget`` (a :class:`~exporter.recorded.budget.Budget`).

    Raises:
        InputError: a page larger than ``cell``, a malformed page header, too many pages.
    """
    total = values = 0
    try:
        for page in pages(f, chunk_start(chunk), chunk.total_compressed_size, chunk.num_values):
            budget.charge_pages(1)
            if page.uncompressed > cell:
                raise InputError(f"{where}: a Parquet page that inflates to more than {cell >> 20} MiB, more than "
                                 "is decoded at once")
            total += page.uncompressed
            values += page.values if page.kind != DICTIONARY_PAGE else 0
    except (ValueError, OSError) as e:
        raise InputError(f"{where}: not a readable Parquet file ({str(e)[:120]})") from None
    return max(total, values * width)
