"""Write an export into a temporary sibling directory and rename it into place.

A failed or interrupted export (an exception, SIGINT, SIGTERM or SIGHUP) leaves no partial
directory and the previous export at that path intact; a lock file makes a second export to
the same path fail instead of racing. The tool marks every directory it stages (``.NAME.partial-*``)
or sets aside (``.NAME.old-*``) with a marker file, and cleans up or restores only marked ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from policy_export.exporter.manifest import MANIFEST, STAGING_MARKER as MARKER
from policy_export.policy.errors import ExportBusyError, ExportError, ExportExistsError

_HANDLED_SIGNALS = ("SIGTERM", "SIGHUP")


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived; raised like ``KeyboardInterrupt`` so that staging cleans up."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def normalise(out: str | Path) -> Path:
    """``out`` as an absolute path with ``.`` and ``..`` resolved lexically (``X/..`` is ``X``'s parent)."""
    return Path(os.path.abspath(os.fspath(out)))


def check_target(out: Path, overwrite: bool) -> None:
    """Fail early when ``out`` cannot receive an export.

    Only an empty directory or one whose ``manifest.json`` validates as a policy-export manifest
    is ever replaced, and never through a symbolic link.

    Raises:
        ExportExistsError: ``out`` exists and ``overwrite`` is false.
        ExportError: ``out`` is a file, a symbolic link, a directory that is not an export, or its
            parent is not writable.
    """
    out = normalise(out)
    if out == out.parent:
        raise ExportError(f"output path {out} is a file-system root; name a directory to create")
    if out.is_symlink():
        raise ExportError(f"output path {out} is a symbolic link; refusing to write through it")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"output path {out} exists and is not a directory")
        if not overwrite:
            raise ExportExistsError(f"{out} already exists; pass overwrite (--overwrite) to replace it")
        _check_replaceable(out)
    _check_lock_path(out)
    parent = out.parent
    while not parent.exists():  # missing parents are created; the nearest existing one must be writable
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"{parent} is not a directory, so {out} cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"directory {parent} is not writable")


def _check_lock_path(out: Path) -> None:
    """A lock path that can never be a lock (a symbolic link, FIFO, directory...) is refused up
    front, before any work; :func:`_lock` checks it again when it opens the file."""
    lock = out.parent / f".{out.name}.lock"
    try:
        mode = os.lstat(lock).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise ExportError(f"lock file {lock} is not a regular file; remove it if it is not an export's lock")


def _check_replaceable(out: Path) -> None:
    """An existing directory may be replaced only if it is empty or holds a valid export manifest."""
    from policy_export.exporter.manifest import read_manifest

    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise ExportError(f"cannot read directory {out}: {e.strerror}") from e
    if empty:
        return
    try:
        read_manifest(out)
    except ExportError as e:
        raise ExportError(f"{out} is a non-empty directory that holds no valid policy-export manifest "
                          f"({e}); refusing to replace it") from e


@contextlib.contextmanager
def staged_directory(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on success rename it to ``out``.

    On an exception, an interrupt, SIGTERM or SIGHUP the temporary directory is removed, the
    lock released and ``out`` untouched (the signals are raised as :class:`Interrupted`).

    Raises:
        ExportBusyError: another export to ``out`` holds the lock.
        ExportExistsError / ExportError: as :func:`check_target`.
    """
    out = normalise(out)
    check_target(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create directory {out.parent}: {e.strerror}") from e
    with signals_as_interrupts(), _lock(out):
        _remove_stale(out)
        try:
            stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        except OSError as e:
            raise ExportError(f"cannot create a directory beside {out}: {e.strerror}") from e
        try:
            _write_marker(stage, out, "partial")
            yield stage
            check_target(out, overwrite)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(stage, 0o777 & ~umask)  # mkdtemp made it private
            with _signals_deferred():  # a signal during the two renames takes effect after them
                _replace(stage, out)
        except BaseException:
            with _signals_deferred():
                shutil.rmtree(stage, ignore_errors=True)
            raise


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP raise :class:`Interrupted` (a ``KeyboardInterrupt``).

    Only signals still at their default action are taken over (an application's own handlers are
    left alone), and only in the main thread; the previous handlers are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for name in _HANDLED_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, _raise_interrupted)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block is done (they are delivered afterwards)."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, OSError, ValueError):  # no signal masks on this platform
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


def _write_marker(directory: Path, out: Path, role: str) -> None:
    (directory / MARKER).write_text(json.dumps({"tool": "policy-export", "role": role, "target": out.name}),
                                    encoding="utf-8")


def _marker_role(directory: Path, out: Path) -> str | None:
    """The role in a directory's marker if the tool wrote it for ``out``, else ``None``."""
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return None
        marker = directory / MARKER
        if not stat.S_ISREG(os.lstat(marker).st_mode) or os.lstat(marker).st_size > 4096:
            return None
        doc = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and doc.get("tool") == "policy-export" and doc.get("target") == out.name:
        role = doc.get("role")
        return role if role in ("partial", "old") else None
    return None


def _remove_stale(out: Path) -> None:
    """Clean up what a killed export left beside ``out`` (the lock is ours, so nobody else is writing).

    Only directories carrying the tool's marker are touched. An export killed between its two
    renames leaves the previous export as a marked ``.<name>.old-*`` and nothing at ``out``: that
    export is put back first.
    """
    name = glob.escape(out.name)
    stray = out / MARKER  # a kill between marking the old export and moving it aside
    if out.is_dir() and not out.is_symlink() and _marker_role(out, out) == "old":
        stray.unlink(missing_ok=True)
    if not out.exists() and not out.is_symlink():
        for old in sorted(out.parent.glob(f".{name}.old-*")):
            if _marker_role(old, out) == "old" and (old / MANIFEST).is_file():
                (old / MARKER).unlink()
                os.rename(old, out)
                break
    for pattern, role in ((f".{name}.partial-*", "partial"), (f".{name}.old-*", "old")):
        for stale in out.parent.glob(pattern):
            if _marker_role(stale, out) == role:
                shutil.rmtree(stale, ignore_errors=True)


def _replace(stage: Path, out: Path) -> None:
    (stage / MARKER).unlink(missing_ok=True)
    if not out.exists():
        os.rename(stage, out)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rmdir(backup)
    _write_marker(out, out, "old")
    try:
        os.rename(out, backup)
    except BaseException:
        (out / MARKER).unlink(missing_ok=True)
        raise
    try:
        os.rename(stage, out)
    except BaseException:
        os.rename(backup, out)
        (out / MARKER).unlink(missing_ok=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _open_lock(lock: Path) -> tuple[int, bool]:
    """Open the lock file without following links; ``(fd, created)``. Only a regular file will do."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    created = True
    try:
        fd = os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        created = False
        try:
            fd = os.open(lock, flags)
        except OSError as e:
            raise ExportError(f"lock file {lock} cannot be opened as a regular file ({e.strerror}); "
                              "remove it if it is not an export's lock") from e
    except OSError as e:
        raise ExportError(f"cannot create lock file {lock}: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ExportError(f"lock file {lock} is not a regular file; remove it if it is not an export's lock")
    return fd, created


@contextlib.contextmanager
def _lock(out: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``.<name>.lock`` beside ``out``.

    The kernel releases it when its holder dies, so a killed export never leaves a stale lock;
    the file is unlinked while still locked, and a locker that finds the path re-pointed at
    another file retries. The lock is opened without following symbolic links, must be a regular
    file, and is written to (its holder's PID) only if this process created it.
    """
    lock = out.parent / f".{out.name}.lock"
    for _ in range(100):
        fd, created = _open_lock(lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ExportBusyError(f"another export to {out} is in progress (lock {lock})") from None
        try:
            same = os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file we locked was unlinked by its previous holder: try again
    else:
        raise ExportBusyError(f"could not lock {lock}")
    try:
        if created:
            os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
