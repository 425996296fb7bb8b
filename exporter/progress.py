"""Progress of long exports, conversions and verifies: each stage with its elapsed time, and a
bar for the loops that run samples through the session or a format.

The API reports to a :class:`Progress`; three implementations:

- :class:`SilentProgress` (:data:`SILENT`): nothing; the Python API's default.
- :class:`PlainProgress`: one line per stage on stderr when the stage finishes,
  ``[policy-export] write onnx: 7.0 s``. A stage still running after :data:`HEARTBEAT` seconds
  adds a line every :data:`HEARTBEAT` seconds (``[policy-export] parity onnx: still running after
  30 s (4,096 of 10,240 rows)``), so nothing sits silent for a minute. A stage that fails prints
  nothing (the error says what happened). For logs, CI and anything that is not a terminal.
- :class:`RichProgress`: a live display on a terminal (``rich.progress``): a spinner per stage
  with its elapsed time, a bar where the stage knows how many rows it runs.

:func:`for_terminal` picks one for the command line.

    with progress.stage("parity onnx", total=10_240) as task:
        ...
        task.advance(256)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

PREFIX = "[policy-export]"
HEARTBEAT = 30.0  # seconds between "still running" lines of a long stage (plain output)


class Task:
    """One running stage: ``advance(n)`` when ``n`` more of its ``total`` rows are done."""

    def __init__(self, name: str, total: int | None = None, on_advance: Callable[["Task"], None] | None = None):
        self.name = name
        self.total = total
        self.completed = 0
        self.start = time.perf_counter()
        self._on_advance = on_advance

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def advance(self, n: int = 1) -> None:
        self.completed += n
        if self.total is not None:  # the total is an estimate (e.g. exploration may run fewer rows)
            self.completed = min(self.completed, self.total)
        if self._on_advance is not None:
            self._on_advance(self)


class Progress:
    """Where stages report. The base class reports nothing (see :class:`SilentProgress`)."""

    @contextlib.contextmanager
    def stage(self, name: str, total: int | None = None) -> Iterator[Task]:
        """A stage named ``name``; ``total`` rows to run, when known (a bar is shown for them)."""
        yield Task(name, total)

    def close(self, failed: bool = False) -> None:
        """End the display (idempotent); ``failed`` clears a live display so an error can follow alone."""


class SilentProgress(Progress):
    """Reports nothing."""


def peak_rss_mb() -> float:
    """The process's peak resident memory so far, in MiB (``getrusage``; Linux reports KiB)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def release_memory(collect: bool = True) -> None:
    """Collect garbage (``collect``) and hand the C heap's free memory back to the system (glibc's
    ``malloc_trim``, where there is one), so a stage's freed buffers do not raise the next one's peak."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class MemoryTrace(Progress):
    """Passes every stage on to ``inner`` and records the process's peak resident memory when each
    stage ends (``peaks``: stage -> MiB); where the peak jumps is the stage that needed the memory."""

    def __init__(self, inner: Progress):
        self.inner = inner
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, total: int | None = None) -> Iterator[Task]:
        try:
            with self.inner.stage(name, total) as task:
                yield task
        finally:
            self.peaks[name] = peak_rss_mb()
            release_memory(collect=False)

    def close(self, failed: bool = False) -> None:
        self.inner.close(failed)


SILENT = SilentProgress()


def format_line(name: str, seconds: float) -> str:
    """The plain line of a finished stage: ``[policy-export] NAME: 7.0 s``."""
    return f"{PREFIX} {name}: {seconds:.1f} s"


class PlainProgress(Progress):
    """One line per finished stage on ``stream`` (default: ``sys.stderr`` at the time of writing),
    and a "still running" line every ``heartbeat`` seconds of a long stage."""

    def __init__(self, stream: TextIO | None = None, heartbeat: float = HEARTBEAT):
        self._stream = stream
        self._heartbeat = heartbeat
        self._lock = threading.Lock()
        self._closed = False

    def _write(self, line: str) -> None:
        with self._lock:
            if self._closed:
                return
            stream = self._stream or sys.stderr
            stream.write(line + "\n")
            stream.flush()

    @contextlib.contextmanager
    def stage(self, name: str, total: int | None = None) -> Iterator[Task]:
        task = Task(name, total)
        done = threading.Event()
        beat = threading.Thread(target=self._beat, args=(task, done), daemon=True, name=f"progress {name}")
        beat.start()
        try:
            yield task
        finally:
            done.set()
            beat.join()
        # reached only when the stage succeeded
        self._write(format_line(name, task.elapsed))

    def _beat(self, task: Task, done: threading.Event) -> None:
        while not done.wait(self._heartbeat):
            rows = f" ({task.completed:,} of {task.total:,} rows)" if task.total else ""
            self._write(f"{PREFIX} {task.name}: still running after {task.elapsed:.0f} s{rows}")

    def close(self, failed: bool = False) -> None:
        with self._lock:
            self._closed = True


class RichProgress(Progress):
    """A live display on ``console`` (a rich Console, normally on stderr): one row per stage with
    a spinner (a check mark once done), a bar and row count where the total is known, and the
    elapsed time."""

    def __init__(self, console, transient: bool = False):
        from rich.progress import BarColumn, Progress as _Progress, ProgressColumn, SpinnerColumn, TextColumn
        from rich.text import Text

        class _Bar(BarColumn):
            def render(self, task):
                return super().render(task) if task.fields.get("rows") else Text("")

        class _Rows(ProgressColumn):
            def render(self, task):
                if not task.fields.get("rows"):
                    return Text("")
                return Text(f"{int(task.completed):,}/{int(task.total):,}", style="progress.download")

        class _Elapsed(ProgressColumn):
            def render(self, task):
                elapsed = task.finished_time if task.finished else task.elapsed
                return Text(f"{elapsed or 0.0:.1f} s", style="progress.elapsed")

        self._progress = _Progress(SpinnerColumn(finished_text="[green]\u2713[/green]"),
                                   TextColumn("{task.description}", markup=False), _Bar(), _Rows(), _Elapsed(),
                                   console=console, transient=transient, redirect_stdout=False,
                                   redirect_stderr=True)
        self._started = False
        self._closed = False

    @contextlib.contextmanager
    def stage(self, name: str, total: int | None = None) -> Iterator[Task]:
        if self._closed:
            yield Task(name, total)
            return
        if not self._started:
            self._progress.start()
            self._started = True
        tid = self._progress.add_task(name, total=total if total else None, rows=bool(total))
        task = Task(name, total, on_advance=lambda t: self._progress.update(tid, completed=t.completed))
        ok = False
        try:
            yield task
            ok = True
        finally:
            if ok:
                final = total or 1
                self._progress.update(tid, total=final, completed=final)
            else:
                self._progress.update(tid, description=f"{name} (failed)")
                self._progress.stop_task(tid)

    def close(self, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            if failed:  # leave the terminal clean for the one error line
                self._progress.live.transient = True
            self._progress.stop()
        closing = getattr(self._progress.console.file, "close_with_display", None)
        if closing is not None:
            closing()


class _OwnDescriptor:
    """A text stream on a duplicate of a terminal's descriptor, for the live display alone: a
    library that points descriptor 2 elsewhere while it loads (TensorFlow, quietly) does not
    swallow the frames the display draws meanwhile, which would leave the display's bookkeeping
    of the lines on the screen wrong and its lines drawn twice."""

    def __init__(self, stream: TextIO):
        self._stream = os.fdopen(os.dup(stream.fileno()), "w", encoding=getattr(stream, "encoding", None) or "utf-8",
                                 errors="replace", closefd=True)

    def close_with_display(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._stream.close()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def terminal_console(stream: TextIO | None = None):
    """A rich Console for a live display on the terminal ``stream`` (default ``sys.stderr``),
    writing to a duplicate of its descriptor (see :class:`_OwnDescriptor`). Its width is the
    terminal's own, asked again at each frame (a resized window redraws at its new width), never
    ``COLUMNS``: a display that redraws its lines must know how wide the screen really is, or a
    line the terminal wraps is drawn again below itself."""
    from rich.console import Console

    stream = sys.stderr if stream is None else stream
    try:
        own: Any = _OwnDescriptor(stream)
    except (AttributeError, OSError, ValueError):  # no descriptor to duplicate: the stream itself
        own = stream
    environ = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return Console(file=own, force_terminal=True, _environ=environ)


def live_terminal(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) takes a live display: a terminal, ``TERM`` not
    ``dumb``, ``CI`` not set."""
    environ = os.environ if environ is None else environ
    stream = sys.stderr if stream is None else stream
    try:
        terminal = bool(stream.isatty())
    except (AttributeError, ValueError):
        terminal = False
    return terminal and environ.get("TERM", "").lower() not in ("dumb", "unknown") and not environ.get("CI")


def for_terminal(quiet: bool = False, environ: Mapping[str, str] | None = None, console: Any = None,
                 stream: TextIO | None = None, plain: bool = True, transient: bool = False) -> Progress:
    """The command line's reporter: silent with ``quiet``; a live rich display on ``console``
    (default :func:`terminal_console`) when ``stream`` (default ``sys.stderr``) is a terminal,
    ``TERM`` is not ``dumb`` and ``CI`` is not set, erased when it closes with ``transient``;
    otherwise plain lines on stderr, or nothing when ``plain`` is false. ``FORCE_COLOR`` does not
    make a log file a terminal."""
    if quiet:
        return SILENT
    stream = sys.stderr if stream is None else stream
    if live_terminal(stream, environ):
        return RichProgress(console if console is not None else terminal_console(stream), transient=transient)
    return PlainProgress() if plain else SILENT


class Counted:
    """A runner (``runner(feeds) -> outputs``) that advances ``task`` by each call's rows; other
    attributes are the runner's."""

    def __init__(self, runner, task: Task):
        self._runner = runner
        self.task = task

    def __call__(self, feeds: Mapping[str, Any]):
        out = self._runner(feeds)
        self.task.advance(rows(feeds))
        return out

    def head(self):
        """The runner's action head (see :meth:`exporter.formats.runner.Runner.head`), counted too."""
        head = getattr(self._runner, "head", None)
        run = head() if head is not None else None
        return None if run is None else Counted(run, self.task)

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


def rows(feeds: Mapping[str, Any]) -> int:
    """The batch size of ``feeds`` (the length of its first array that is not a scalar)."""
    for value in feeds.values():
        shape = getattr(value, "shape", None)
        if shape:
            return int(shape[0])
    return 0
