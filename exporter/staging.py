"""Write an export into a temporary sibling directory and rename it into place.

A failed or interrupted export (an exception, SIGINT, SIGTERM or SIGHUP) leaves no partial
directory and the previous export at that path intact; a lock file makes a second export to
the same path fail instead of racing.

Nothing is ever written inside the user's directory at ``OUT``. Beside it the tool keeps, under
names of a fixed length that do not grow with ``OUT``'s name (``K`` is derived from the name):

* ``.pe-K.lock``: the ``flock`` of the export in progress;
* ``.pe-K.journal``: which staging directory (``.pe-<random>.partial``) and which set-aside
  previous export (``.pe-<random>.old``) belong to the export in progress, written before each
  of them exists.

The next export to ``OUT`` (and :func:`check_target`, before any work) reads the journal of a
killed export: it puts a previous export that is missing at ``OUT`` back, and removes only the
directories the journal names. An existing directory is replaced only when every entry in it
is a file of its export (listed in its ``manifest.json`` with the same sha256).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from policy_export.exporter.manifest import MANIFEST
from policy_export.policy import jsonio
from policy_export.errors import ExportBusyError, ExportError, ExportExistsError

log = logging.getLogger(__name__)

_HANDLED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
NAME_MAX = 255  # bytes of one path component (Linux, macOS)
PATH_MAX = 4096  # bytes of a whole path, the terminating NUL included
_OWN = re.compile(r"\.pe-[0-9a-f]{16}\.(partial|old)")
_OWN_NAME_BYTES = len(".pe-0123456789abcdef.journal-new")
_MAX_JOURNAL_BYTES = 64 << 10


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; raised like ``KeyboardInterrupt`` so that staging cleans up."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


# ------------------------------------------------------------------------------------------ signals


class SignalSession:
    """What the handlers of :func:`signals_as_interrupts` saw.

    ``pending`` is the first signal received (it is recorded even when the exception it raised
    was swallowed, e.g. inside a ``__del__``); ``complete`` is true once an export was renamed
    into place, after which signals are only recorded, never raised.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self.raised = False
        self.complete = False
        self.quiet = False
        self.deferring = 0

    def record_only(self) -> None:
        """From now on signals are recorded and not raised (the caller is finishing up)."""
        self.quiet = True

    def take(self) -> int | None:
        """The pending signal (or ``None``), which is then no longer re-delivered on exit."""
        signum, self.pending = self.pending, None
        return signum


_session: SignalSession | None = None


def check_interrupted() -> None:
    """Raise :class:`Interrupted` if a signal arrived (and was perhaps swallowed) and no export is complete yet.

    Raises:
        Interrupted: a handled signal is pending.
    """
    s = _session
    if s is not None and s.pending is not None and not s.complete:
        s.raised = True
        raise Interrupted(s.pending)


def _handler(signum, frame) -> None:
    s = _session
    if s is None:  # handlers outlived their session (should not happen): act as the default would
        raise Interrupted(signum)
    if s.pending is None:
        s.pending = signum
    if s.complete or s.quiet or s.raised or s.deferring:
        return  # an exception is on its way, the export is done, or a rename is under way: only record
    s.raised = True
    raise Interrupted(signum)


def _unraisable(previous):
    def hook(unraisable) -> None:
        s = _session
        if isinstance(unraisable.exc_value, Interrupted) and s is not None:
            s.raised = False  # swallowed (e.g. inside __del__): the next signal raises again
            return
        previous(unraisable)
    return hook


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[SignalSession]:
    """While active, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` (a ``KeyboardInterrupt``).

    The first signal is also recorded in the yielded :class:`SignalSession`, so that one raised
    where Python swallows exceptions still stops the export (:func:`check_interrupted` before
    the commit); a second one while the first is propagating is only recorded. Only signals
    still at their default action (SIGINT: ``default_int_handler``) are taken over, and only in
    the main thread; nested use shares the outer session. On exit the previous handlers are
    restored and a signal that was recorded but never raised (it came after the export was
    complete) is delivered again unless the caller took it (:meth:`SignalSession.take`).
    """
    global _session
    if threading.current_thread() is not threading.main_thread():
        yield SignalSession()
        return
    if _session is not None:
        yield _session
        return
    session = SignalSession()
    previous = {}
    hook = sys.unraisablehook
    _session = session
    try:
        for name in _HANDLED_SIGNALS:
            signum = getattr(signal, name, None)
            default = signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL
            if signum is not None and signal.getsignal(signum) is default:
                previous[signum] = signal.signal(signum, _handler)
        sys.unraisablehook = _unraisable(hook)
        yield session
    finally:
        with _signals_deferred():
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            sys.unraisablehook = hook
            _session = None
        if session.pending is not None and not session.raised and session.pending in previous:
            signal.raise_signal(session.pending)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block is done (they take effect afterwards).

    The handlers only record a signal while a block is active (another thread may receive a
    process signal even when this one masks it); at the end of the outermost block a recorded
    signal is raised, unless one was raised already or the export is complete.
    """
    session = _session
    if session is not None:
        session.deferring += 1
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, OSError, ValueError):  # no signal masks on this platform
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if session is not None:
            session.deferring -= 1
            if (not session.deferring and session.pending is not None and session is _session
                    and not (session.raised or session.complete or session.quiet)):
                session.raised = True
                raise Interrupted(session.pending)


# ------------------------------------------------------------------------------------------ target


def normalise(out: str | Path) -> Path:
    """``out`` as an absolute path with ``.`` and ``..`` resolved lexically (``X/..`` is ``X``'s parent)."""
    return Path(os.path.abspath(os.fspath(out)))


def _short(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 80 else text[:40] + "..." + text[-30:]


def check_path_length(out: Path) -> None:
    """Fail when a component of ``out`` is longer than NAME_MAX bytes or the path (or a file the
    tool keeps beside it) is longer than PATH_MAX.

    Raises:
        ExportError: a name or the path is too long.
    """
    for part in out.parts[1:]:
        size = len(os.fsencode(part))
        if size > NAME_MAX:
            shown = part if len(part) <= 40 else part[:20] + "..." + part[-12:]
            raise ExportError(f"output path {_short(out)}: the name {shown!r} is {size} bytes, longer than the "
                              f"{NAME_MAX}-byte limit of a file name; choose a shorter --out")
    size = max(len(os.fsencode(out)), len(os.fsencode(out.parent)) + 1 + _OWN_NAME_BYTES)
    if size >= PATH_MAX:
        raise ExportError(f"output path {_short(out)} is {len(os.fsencode(out))} bytes, too long for a path "
                          f"(at most {PATH_MAX - 2 - _OWN_NAME_BYTES} bytes); choose a shorter --out")


def check_target(out: Path, overwrite: bool) -> None:
    """Fail early when ``out`` cannot receive an export.

    An export killed before (see the module) is first recovered: a previous export missing at
    ``out`` is put back, its leftovers removed. Only an empty directory, or one in which every
    entry is a file of its export (listed in its valid ``manifest.json`` with the same size and
    sha256; directories only as parents of those), is ever replaced, and never through a
    symbolic link.

    Raises:
        ExportExistsError: ``out`` exists and ``overwrite`` is false.
        ExportBusyError: another export to ``out`` is in progress (only when one must be recovered).
        ExportError: ``out`` is too long, a file, a symbolic link, a directory that holds anything
            but its export's files, or its parent is not writable.
    """
    out = normalise(out)
    if out == out.parent:
        raise ExportError(f"output path {out} is a file-system root; name a directory to create")
    check_path_length(out)
    for what, path in (("lock file", lock_path(out)), ("journal", journal_path(out))):
        _check_own_file(what, path)
    if journal_path(out).exists():
        with signals_as_interrupts(), _lock(out):
            _recover(out)
    _check_target(out, overwrite)


def _check_target(out: Path, overwrite: bool) -> None:
    if out.is_symlink():
        raise ExportError(f"output path {out} is a symbolic link; refusing to write through it")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"output path {out} exists and is not a directory")
        if not overwrite:
            raise ExportExistsError(f"{out} already exists; pass overwrite (--overwrite) to replace it")
        check_replaceable(out)
    parent = out.parent
    while not parent.exists():  # missing parents are created; the nearest existing one must be writable
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"{parent} is not a directory, so {out} cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"directory {parent} is not writable")


def _check_own_file(what: str, path: Path) -> None:
    """The lock or journal path, if present, must be a regular file (never a link, FIFO, directory...)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise ExportError(f"{what} {path} is not a regular file; remove it if it is not an export's {what}")


_digests: dict[tuple, str] = {}  # (dev, ino, size, mtime_ns, ctime_ns) -> sha256: each file hashed once


def _digest(path: Path, st: os.stat_result) -> str:
    from policy_export.exporter.manifest import sha256

    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _digests:
        _digests[key] = sha256(path)
    return _digests[key]


def check_replaceable(out: Path, label: Path | None = None) -> None:
    """An existing directory may be replaced only if it is empty or holds nothing but its export.

    Every entry (in sorted order) must be a regular file listed in the manifest with the listed
    size and sha256, or a directory above such a file (or empty, inside one); the first one that
    is not is named.

    Raises:
        ExportError: no valid manifest, or a foreign, changed or special entry.
    """
    from policy_export.exporter.manifest import read_manifest

    label = label or out
    try:
        empty = not any(out.iterdir())
    except OSError as e:
        raise ExportError(f"cannot read directory {label}: {e.strerror}") from e
    if empty:
        return
    try:
        doc = read_manifest(out)
    except ExportError as e:
        raise ExportError(f"{label} is a non-empty directory that holds no valid policy-export manifest "
                          f"({e}); refusing to replace it") from e
    listed = {f["path"]: f for f in doc["files"]}
    parents = {"/".join(p.split("/")[:i]) for p in listed for i in range(1, p.count("/") + 1)}
    entries = []
    for dirpath, dirnames, filenames in os.walk(out, followlinks=False):
        for name in dirnames + filenames:
            entries.append((Path(dirpath) / name).relative_to(out).as_posix())
    how = "remove it or choose another --out"
    for rel in sorted(entries):
        if rel == MANIFEST:
            continue
        try:
            st = os.lstat(out / rel)
        except OSError as e:
            raise ExportError(f"refusing to replace {label}: {rel!r} cannot be read ({e.strerror})") from e
        if stat.S_ISDIR(st.st_mode):  # above a file of the export, or empty inside one (SavedModel assets/)
            if rel in parents or ("/" in rel and rel.rsplit("/", 1)[0] in parents and not os.listdir(out / rel)):
                continue
        elif stat.S_ISREG(st.st_mode) and rel in listed:
            try:
                same = st.st_size == listed[rel]["size"] and _digest(out / rel, st) == listed[rel]["sha256"]
            except OSError as e:
                raise ExportError(f"refusing to replace {label}: {rel!r} cannot be read ({e.strerror})") from e
            if same:
                continue
            raise ExportError(f"refusing to replace {label}: {rel!r} was changed since it was exported "
                              f"(its sha256 differs from the manifest; {how})")
        raise ExportError(f"refusing to replace {label}: {rel!r} is not a file of its export ({how})")


# ------------------------------------------------------------------------------------------ journal


def _key(out: Path) -> str:
    return hashlib.sha256(os.fsencode(out.name)).hexdigest()[:16]


def lock_path(out: Path) -> Path:
    """The lock file of exports to ``out`` (``.pe-K.lock`` beside it, of a fixed length)."""
    return out.parent / f".pe-{_key(out)}.lock"


def journal_path(out: Path) -> Path:
    """The journal of exports to ``out`` (``.pe-K.journal`` beside it)."""
    return out.parent / f".pe-{_key(out)}.journal"


def _own_name(role: str) -> str:
    return f".pe-{secrets.token_hex(8)}.{role}"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_journal(out: Path, entry: dict) -> None:
    """Atomically (write, fsync, rename) record ``entry`` in ``.pe-K.journal`` beside ``out``."""
    journal = journal_path(out)
    new = journal.with_name(journal.name + "-new")
    doc = {"tool": "policy-export", "target": os.fsdecode(out.name), **entry}
    with contextlib.suppress(FileNotFoundError):
        os.unlink(new)
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, json.dumps(doc).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(new, journal)
    _fsync_dir(out.parent)


def _read_journal(out: Path) -> dict | None:
    """The journal of an export to ``out``, or ``None`` when there is none.

    Raises:
        ExportError: the journal path holds something that is not a journal of an export to ``out``.
    """
    journal = journal_path(out)
    try:
        fd = os.open(journal, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ExportError(f"journal {journal} cannot be read ({e.strerror}); remove it if it is not an "
                          "export's journal") from e
    try:
        st = os.fstat(fd)
        raw = os.read(fd, _MAX_JOURNAL_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    try:
        doc = jsonio.loads(raw, "journal")
    except ValueError:
        doc = None
    ok = (isinstance(doc, dict) and doc.get("tool") == "policy-export"
          and doc.get("target") == os.fsdecode(out.name)
          and all(doc.get(k) is None or (isinstance(doc[k], str) and _OWN.fullmatch(doc[k]))
                  for k in ("partial", "old"))
          and (doc.get("partial_ino") is None or isinstance(doc["partial_ino"], int)))
    if not ok:
        raise ExportError(f"{journal} is not the journal of an export to {out}; remove it if no export "
                          "to that path is running")
    return doc


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _recover(out: Path) -> None:
    """Finish what an export killed before left beside ``out`` (the lock is held).

    A previous export set aside and missing at ``out`` is renamed back; once the new export is
    at ``out`` the set-aside one is removed; a staging directory is removed. Only directories
    the journal names are touched, and the journal is removed last.

    Raises:
        ExportError: the previous export is set aside but ``out`` now holds another directory.
    """
    journal = journal_path(out)
    doc = _read_journal(out)
    if doc is not None:
        with _signals_deferred():
            partial = out.parent / doc["partial"] if doc.get("partial") else None
            old = out.parent / doc["old"] if doc.get("old") else None
            if old is not None and _is_dir(old):
                if not os.path.lexists(out):
                    os.rename(old, out)
                    _fsync_dir(out.parent)
                    log.info("an interrupted export to %s was rolled back: the previous export is in place", out)
                elif doc.get("partial_ino") is not None and os.lstat(out).st_ino == doc["partial_ino"]:
                    shutil.rmtree(old, ignore_errors=True)  # the new export was already in place
                else:
                    raise ExportError(f"an interrupted export to {out} set the previous export aside as {old}, "
                                      f"and {out} now holds another directory; move {old} where it belongs")
            if partial is not None and _is_dir(partial):
                shutil.rmtree(partial, ignore_errors=True)
            journal.unlink(missing_ok=True)
    new = journal.with_name(journal.name + "-new")  # a journal killed while written: nothing was made yet
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(new).st_mode):
            new.unlink()


# ------------------------------------------------------------------------------------------ staging


@contextlib.contextmanager
def staged_directory(out: str | Path, overwrite: bool = False, *, checked: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on success rename it to ``out``.

    ``out`` is first checked with :func:`check_target`, unless ``checked`` says the caller did
    so before its work began; under the lock, and again at the rename, it is checked either way.
    On an exception, an interrupt, SIGINT, SIGTERM or SIGHUP the temporary directory is removed,
    the lock released and ``out`` untouched (the signals are raised as :class:`Interrupted`,
    and a signal whose exception was swallowed still stops the export before the rename).

    Raises:
        ExportBusyError: another export to ``out`` holds the lock.
        ExportExistsError / ExportError: as :func:`check_target`.
        Interrupted: a signal arrived before the export was in place.
    """
    out = normalise(out)
    if not checked:
        check_target(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create directory {out.parent}: {e.strerror}") from e
    with signals_as_interrupts() as session, _lock(out):
        _recover(out)
        _check_target(out, overwrite)  # a restored previous export needs overwrite too
        check_interrupted()
        stage = out.parent / _own_name("partial")
        try:
            with _signals_deferred():
                _write_journal(out, {"partial": stage.name})
                os.mkdir(stage, 0o700)
        except OSError as e:
            raise ExportError(f"cannot create a directory beside {out}: {e.strerror}") from e
        try:
            yield stage
            check_interrupted()
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(stage, 0o777 & ~umask)
            with _signals_deferred():  # a signal during the renames takes effect after them
                check_interrupted()
                _replace(stage, out, overwrite)
                session.complete = True
        except BaseException:
            with _signals_deferred(), contextlib.suppress(ExportError):
                _recover(out)  # the stage removed, a previous export set aside put back
            raise


def _replace(stage: Path, out: Path, overwrite: bool) -> None:
    """Rename ``stage`` to ``out``, setting a previous export aside (journalled) and removing it after."""
    _check_target(out, overwrite)
    if not os.path.lexists(out):
        os.rename(stage, out)
    else:
        old = out.parent / _own_name("old")
        _write_journal(out, {"partial": stage.name, "partial_ino": os.lstat(stage).st_ino, "old": old.name})
        os.rename(out, old)
        try:
            check_replaceable(old, label=out)  # set aside, nobody can add to it by its path any more
            os.rename(stage, out)
        except BaseException:
            if not os.path.lexists(out):
                os.rename(old, out)
            raise
        _fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out.parent)
    journal_path(out).unlink(missing_ok=True)


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
        if e.errno == errno.ENAMETOOLONG:
            raise ExportError(f"cannot create lock file {lock}: the path is too long") from e
        raise ExportError(f"cannot create lock file {lock}: {e.strerror}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ExportError(f"lock file {lock} is not a regular file; remove it if it is not an export's lock")
    return fd, created


@contextlib.contextmanager
def _lock(out: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``.pe-K.lock`` beside ``out``.

    The kernel releases it when its holder dies, so a killed export never leaves a stale lock;
    the file is unlinked while still locked, and a locker that finds the path re-pointed at
    another file retries. The lock is opened without following symbolic links, must be a regular
    file, and is written to (its holder's PID) only if this process created it.
    """
    lock = lock_path(out)
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
        with _signals_deferred():
            lock.unlink(missing_ok=True)
            os.close(fd)
