"""Reading a file the package was given, safely: never through a symbolic link, only a regular
file, and only up to a size checked before anything is read. Every reader of untrusted files
(SavedModels, checkpoints, TensorFlow checkpoint bundles) goes through :func:`read_regular`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from policy_export.errors import ExportError


def read_regular(file: Path, limit: int, error: type[Exception] = ExportError) -> bytes:
    """The bytes of ``file``, opened without following a symbolic link, if it is a regular file of
    at most ``limit`` bytes (checked before reading); ``error`` otherwise.

    Raises:
        ``error``: not a regular file, or over the limit. OSError: it cannot be opened (a
            symbolic link is ``ELOOP``).
    """
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise error(f"refusing to read {file}: not a regular file")
        if info.st_size > limit:
            raise error(f"refusing to read {file}: {info.st_size} bytes, over {limit} bytes (the "
                        f"{limit / 2**20:.3g} MiB limit)")
        chunks, total = [], 0
        while total <= limit:  # in chunks: memory follows the file's bytes, never the limit
            chunk = f.read(min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise error(f"refusing to read {file}: it grew past {limit} bytes while it was read")
        return b"".join(chunks)
