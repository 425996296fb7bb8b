"""The temporary folders and server processes of ``serve`` and ``verify --server``, removed and
stopped however the command ends.

Each folder is made by :func:`make` and registered until :func:`remove` takes it away with the
process groups started for it (:func:`add_process`) and whatever else they leave outside it
(:func:`add_cleanup`: a server's shared memory). Leaving a server's block removes its folder;
an interrupt (the command line turns SIGINT, SIGTERM and SIGHUP into one) unwinds that block, and
what an interrupt caught half-way (inside a server's own stop) is removed when the interpreter
exits. A server process this package starts is also told to die with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()
_live: dict[Path, list[int]] = {}  # folder -> process group ids started for it
_cleanups: dict[Path, list] = {}  # folder -> what to call once its processes are killed
_hooked = False


def make(prefix: str) -> Path:
    """A new private temporary folder (under ``TMPDIR``), registered until :func:`remove`."""
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(remove_all)
            _hooked = True
        folder = Path(tempfile.mkdtemp(prefix=prefix))
        _live[folder] = []
    return folder


def add_process(folder: Path, pgid: int) -> None:
    """Register process group ``pgid`` as started for ``folder``: killed when the folder is removed."""
    with _lock:
        _live.setdefault(folder, []).append(pgid)


def add_cleanup(folder: Path, cleanup) -> None:
    """Register ``cleanup()`` to be called when ``folder`` is removed, after its processes are killed
    (what they leave outside the folder; its errors are ignored)."""
    with _lock:
        _cleanups.setdefault(folder, []).append(cleanup)


def remove(folder: Path) -> None:
    """Kill the process groups registered for ``folder`` (those still running), run its cleanups
    and remove it."""
    with _lock:
        groups = _live.pop(folder, [])
        cleanups = _cleanups.pop(folder, [])
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for cleanup in cleanups:
        with contextlib.suppress(Exception):
            cleanup()
    shutil.rmtree(folder, ignore_errors=True)


def remove_all() -> None:
    """Remove every folder still registered (at interpreter exit)."""
    with _lock:
        folders = list(_live)
    for folder in folders:
        remove(folder)


def die_with_parent() -> None:
    """In a child process before it executes (``preexec_fn``): be killed when the parent dies."""
    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def quiet_interrupts() -> None:
    """Let an interrupt pass through gevent's hub (the loop tritonclient's HTTP client runs on, in
    this thread) without its traceback: the hub hands it on to the waiting code as before, and the
    command says it was interrupted."""
    try:
        from gevent import get_hub
    except ImportError:
        return
    hub = get_hub()
    if not issubclass(KeyboardInterrupt, hub.NOT_ERROR):
        hub.NOT_ERROR = (*hub.NOT_ERROR, KeyboardInterrupt)  # the instance's, as gevent's Hub documents
