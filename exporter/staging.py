"""Write an export into a temporary sibling directory and rename it into place.

A failed export leaves no partial directory and the previous export at that path intact;
a lock file makes a second export to the same path fail instead of racing.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from policy_export.policy.errors import ExportBusyError, ExportError, ExportExistsError

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
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(stage, 0o777 & ~umask)  # mkdtemp made it private
            _replace(stage, out)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise


def _remove_stale(out: Path) -> None:
    """Clean up what a killed export left beside ``out`` (the lock is ours, so nobody else is writing).

    An export killed between its two renames leaves the previous export as ``.<name>.old-*`` and
    nothing at ``out``: that export is put back first.
    """
    name = glob.escape(out.name)
    if not out.exists():
        for old in sorted(out.parent.glob(f".{name}.old-*")):
            if (old / MANIFEST).is_file():
                os.rename(old, out)
                break
    for pattern in (f".{name}.partial-*", f".{name}.old-*"):
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
    """An exclusive ``flock`` on ``.<name>.lock`` beside ``out``.

    The kernel releases it when its holder dies, so a killed export never leaves a stale lock;
    the file is unlinked while still locked, and a locker that finds the path re-pointed at
    another file retries.
    """
    lock = out.parent / f".{out.name}.lock"
    for _ in range(100):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise ExportError(f"cannot create lock file {lock}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ExportBusyError(f"another export to {out} is in progress (lock {lock})") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file we locked was unlinked by its previous holder: try again
    else:
        raise ExportBusyError(f"could not lock {lock}")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
