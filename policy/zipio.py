"""Reading a zip archive the package was given, safely: what it may hold is decided before any
member is read, and no member inflates past what it declares.

An :class:`Archive` is opened from a path (never through a symbolic link, a regular file only)
or from bytes (a zip inside a zip: the ``policy.pth`` a Stable-Baselines3 zip holds, which is
itself a ``torch.save`` archive). Before :mod:`zipfile` parses the central directory, its entry
count and size are read from the end record and held to ``max_members``. Then every entry must:

- have a plain relative name (no leading ``/``, no ``\\``, no NUL, no empty, ``.`` or ``..``
  component) that ``allowed`` accepts, and appear once;
- not be a symbolic link, a directory or encrypted, and be stored or deflated;
- declare a size within ``limit(name)``, and all of them together within ``total``.

:meth:`Archive.read` inflates a member itself, in chunks, from its local header (whose name must
be the directory's): it stops past the declared size, and the stream must end exactly there with
its CRC, so a header that lies never costs more than the declared bytes. What is read is charged
to the archive's ``total``, so reading a member twice, or members that share their bytes, cannot
multiply the cost either.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

from policy_export.errors import ExportError

CHUNK = 1 << 20
LINK_MODE = 0o120000


class Archive:
    """A zip archive whose entries passed the checks of the module's description; ``names`` in
    the directory's order, read with :meth:`read`.

    ``error`` is the exception class raised (the caller's: an input error, an unsafe checkpoint).
    """

    def __init__(self, source: Path | bytes, where: str, *, allowed: Callable[[str], bool], max_members: int,
                 limit: Callable[[str], int], total: int, error: type[Exception] = ExportError):
        self.where, self.error, self.total, self.used = where, error, total, 0
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._handle = io.BytesIO(bytes(source))
        else:
            self._handle = _open_regular(Path(source), error)
        try:
            self._check_end(max_members)
            try:
                with zipfile.ZipFile(self._handle) as archive:
                    infos = archive.infolist()
            except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError) as e:
                raise error(f"{where} is not a readable zip archive: {str(e)[:120]}") from None
            self.members = self._checked(infos, allowed, limit)
        except BaseException:
            self._handle.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self.members)

    def __contains__(self, name: str) -> bool:
        return name in self.members

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handle.close()

    def _check_end(self, max_members: int) -> None:
        """The end-of-directory record's entry count and directory size, before zipfile reads the directory."""
        handle = self._handle
        size = handle.seek(0, io.SEEK_END)
        handle.seek(max(0, size - (1 << 16) - 22))
        tail = handle.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) - at < 22:
            raise self.error(f"{self.where} is not a zip archive (no end of central directory)")
        count = int.from_bytes(tail[at + 10:at + 12], "little")
        directory = int.from_bytes(tail[at + 12:at + 16], "little")
        # a zip64 archive puts 0xFFFF / 0xFFFFFFFF here: its own record is then read by zipfile, and
        # the members counted below
        if count != 0xFFFF and count > max_members:
            raise self.error(f"{self.where} lists {count} members, more than the {max_members} it may hold")
        if directory != 0xFFFFFFFF and directory > (max_members + 1) * (46 + 0xFFFF * 3):
            raise self.error(f"{self.where} has a central directory of {directory} bytes")
        handle.seek(0)

    def _checked(self, infos: list[zipfile.ZipInfo], allowed, limit) -> dict[str, zipfile.ZipInfo]:
        members: dict[str, zipfile.ZipInfo] = {}
        declared = 0
        for info in infos:
            name = info.filename
            shown = name[:120]
            if len(members) >= 1 << 16:
                raise self.error(f"{self.where} holds too many members")
            if not _plain_name(name):
                raise self.error(f"{self.where}: member {shown!r} is not a plain relative name; refusing the archive")
            if name in members:
                raise self.error(f"{self.where}: member {shown!r} appears twice; refusing the archive")
            if info.is_dir() or stat.S_IFMT(info.external_attr >> 16) == LINK_MODE:
                raise self.error(f"{self.where}: member {shown!r} is a "
                                 f"{'directory' if info.is_dir() else 'symbolic link'}; refusing the archive")
            if info.flag_bits & 1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise self.error(f"{self.where}: member {shown!r} is encrypted or compressed with method "
                                 f"{info.compress_type} (stored and deflated are read)")
            if not allowed(name):
                raise self.error(f"{self.where}: member {shown!r} is not one this archive holds; refusing it")
            most = limit(name)
            if info.file_size > most:
                raise self.error(f"{self.where}: member {shown!r} declares {info.file_size} bytes, more than "
                                 f"its limit of {most} bytes; nothing was inflated")
            declared += info.file_size
            if declared > self.total:
                raise self.error(f"{self.where}: its members declare more than {self.total} bytes together; "
                                 "nothing was inflated")
            members[name] = info
        return members

    def size(self, name: str) -> int:
        """The size ``name`` declares (its bytes once read)."""
        return self.members[name].file_size

    def read(self, name: str) -> bytes:
        """The bytes of member ``name``, inflated here within its declared size, its CRC checked.

        Raises:
            ``error``: no such member, a damaged member, or the archive's total spent.
        """
        return self._inflate(name, keep=True)

    def check(self, name: str) -> None:
        """Inflate member ``name`` as :meth:`read` does, keeping nothing (one chunk at a time in
        memory): a member that another library reads afterwards is known to end at its size."""
        self._inflate(name, keep=False)

    def _inflate(self, name: str, keep: bool) -> bytes:
        info = self.members.get(name)
        if info is None:
            raise self.error(f"{self.where} holds no member {name[:120]!r}")
        where = f"{self.where}:{name[:120]}"
        self.used += info.file_size
        if self.used > self.total:
            raise self.error(f"{self.where}: reading its members takes more than {self.total} bytes")
        handle = self._handle
        handle.seek(info.header_offset)
        header = handle.read(30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise self.error(f"{where}: no local header at byte {info.header_offset}")
        name_length = int.from_bytes(header[26:28], "little")
        if handle.read(name_length) != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
            raise self.error(f"{where}: the local header names another member than the directory")
        handle.seek(info.header_offset + 30 + name_length + int.from_bytes(header[28:30], "little"))
        inflater = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
        out, total, crc, left = bytearray(), 0, 0, info.compress_size
        try:
            while left > 0:
                raw = handle.read(min(left, CHUNK))
                if not raw:
                    break
                left -= len(raw)
                while raw:
                    data = inflater.decompress(raw, CHUNK) if inflater else raw
                    raw = inflater.unconsumed_tail if inflater else b""
                    total += len(data)
                    if total > info.file_size:
                        raise self.error(f"{where} inflates past its declared {info.file_size} bytes; refusing it")
                    crc = zlib.crc32(data, crc)
                    if keep:
                        out += data
        except zlib.error as e:
            raise self.error(f"{where}: a damaged deflate stream ({e})") from None
        ended = inflater is None or (inflater.eof and not inflater.unused_data)
        if left or not ended or total != info.file_size or crc != info.CRC:
            raise self.error(f"{where}: {total} bytes where {info.file_size} are declared, or a stream that does "
                             "not end there or fails its CRC")
        return bytes(out)


def _plain_name(name: str) -> bool:
    if not name or len(name) > 1024 or name.startswith("/") or "\\" in name or "\0" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _open_regular(path: Path, error: type[Exception]):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{path} does not exist") from None
    except OSError as e:
        reason = "a symbolic link is never followed" if os.path.islink(path) else e.strerror
        raise error(f"cannot read {path}: {reason}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"refusing to read {path}: not a regular file")
    return os.fdopen(fd, "rb")


def is_zip(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) that starts as a zip archive does."""
    try:
        if path.is_symlink() or not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(4) in (b"PK\x03\x04", b"PK\x05\x06")
    except OSError:
        return False
