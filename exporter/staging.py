"""Write an export into a temporary sibling directory and rename it into place.

A failed export leaves no partial directory and the previous export at that path intact;
a lock file makes a second export to the same path fail instead of racing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from policy.errors import ExportBusyError, ExportError, ExportExistsError

MANIFEST = "manifest.json"


def check_target(out: Path, overwrite: bool) -> None:
    """Fail early when ``out`` cannot receive an export.

    Raises:
        ExportExistsError: ``out`` exists and ``overwrite`` is false.
        ExportError: ``out`` is a file, an existing non-export directory, or its parent is not writable.
    """
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ExportError(f"output path {out} exists and is not a directory")
        if not overwrite:
            raise ExportExistsError(f"{out} already exists; pass overwrite (--overwrite) to replace it")
        if any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise ExportError(f"{out} is a non-empty directory that holds no export; refusing to replace it")
    parent = out.parent
    while not parent.exists():  # missing parents are created; the nearest existing one must be writable
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"{parent} is not a directory, so {out} cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"directory {parent} is not writable")


@contextlib.contextmanager
def staged_directory(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on success rename it to ``out``.

    On an exception (or interrupt) the temporary directory is removed and ``out`` is untouched.

    Raises:
        ExportBusyError: another export to ``out`` holds the lock.
        ExportExistsError / ExportError: as :func:`check_target`.
    """
    out = Path(out).absolute()
    check_target(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create directory {out.parent}: {e.strerror}") from e
    with _lock(out):
        _remove_stale(out)
        try:
            stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        except OSError as e:
            raise ExportError(f"cannot create a directory beside {out}: {e.strerror}") from e
        try:
            yield stage
            check_target(out, overwrite)
            _replace(stage, out)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise


def _remove_stale(out: Path) -> None:
    """Remove what a killed export left beside ``out`` (its lock is ours now, so nobody else is writing)."""
    for pattern in (f".{out.name}.partial-*", f".{out.name}.old-*"):
        for stale in out.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _replace(stage: Path, out: Path) -> None:
    if not out.exists():
        os.rename(stage, out)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(backup)
    os.rename(out, backup)
    try:
        os.rename(stage, out)
    except BaseException:
        os.rename(backup, out)
        raise
    shutil.rmtree(backup, ignore_errors=True)


@contextlib.contextmanager
def _lock(out: Path) -> Iterator[None]:
    lock = out.parent / f".{out.name}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            if _holder_alive(lock):
                raise ExportBusyError(f"another export to {out} is in progress (lock {lock})") from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
        except OSError as e:
            raise ExportError(f"cannot create lock file {lock}: {e.strerror}") from e
    else:
        raise ExportBusyError(f"another export to {out} is in progress (lock {lock})")
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)


def _holder_alive(lock: Path) -> bool:
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return True  # being written right now: treat as held
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True
