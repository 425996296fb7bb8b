"""Runtime calls that a model cannot hold: a deadline on every run, and signals that still stop it.

A model file decides how long one call into its runtime takes: an ONNX ``Loop`` or a TF ``While``
with a huge trip count keeps ONNX Runtime or TensorFlow busy in native code, where Python's signal
handlers never run. :func:`run_stoppable` runs each such call in a worker thread while the calling
thread waits in Python, a short wait at a time, so that SIGINT, SIGTERM and SIGHUP handlers run
and a deadline is kept. On an interrupt or at the deadline the runtime is told to stop (ONNX
Runtime's ``RunOptions.terminate``, cancelling the TF session or function call) and the interrupt,
or :class:`RunTimeoutError`, is raised. A runtime that does not stop within :data:`GRACE` seconds
is left running in its (daemon) thread: the caller's cleanup still runs and the process can exit.

The limit is :data:`DEFAULT_RUN_TIMEOUT` seconds per call, far beyond any honest policy's run;
:func:`run_limit` sets another for a block of code (the ``run_timeout`` keyword of the API and the
``--run-timeout`` option of the command line use it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from policy_export.errors import InputError, RunTimeoutError  # noqa: F401 (RunTimeoutError: raised here)

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_RUN_TIMEOUT = 600.0  # seconds per runtime call: a large policy's whole golden batch takes seconds
MAX_RUN_TIMEOUT = 7 * 24 * 3600.0
GRACE = 2.0  # seconds the runtime gets to stop once told to
POLL = 0.05  # seconds between checks of the waiting thread (signal handlers run in between)

_limit: contextvars.ContextVar[float] = contextvars.ContextVar("policy_export_run_timeout", default=DEFAULT_RUN_TIMEOUT)


def check_run_timeout(seconds: float | None, option: str = "run_timeout (--run-timeout)") -> float:
    """``seconds`` as a run limit (``None``: the current one, by default :data:`DEFAULT_RUN_TIMEOUT`).

    Raises:
        InputError: not a finite number above 0 and at most :data:`MAX_RUN_TIMEOUT`.
    """
    if seconds is None:
        return current_limit()
    try:
        value = float(seconds)
    except (TypeError, ValueError) as e:
        raise InputError(f"{option} must be a number of seconds, got {seconds!r}") from e
    if not (math.isfinite(value) and 0 < value <= MAX_RUN_TIMEOUT):
        raise InputError(f"{option} must be above 0 and at most {MAX_RUN_TIMEOUT:g} seconds, got {seconds!r}")
    return value


def current_limit() -> float:
    """The run limit in force here (seconds per runtime call)."""
    return _limit.get()


@contextlib.contextmanager
def run_limit(seconds: float | None) -> Iterator[float]:
    """Within the block, every runtime call a runner makes is limited to ``seconds`` (``None``
    keeps the limit in force); yields the limit.

    Raises:
        InputError: ``seconds`` is not a valid limit (see :func:`check_run_timeout`).
    """
    value = check_run_timeout(seconds)
    token = _limit.set(value)
    try:
        yield value
    finally:
        _limit.reset(token)


class Stoppable:
    """Runs one runtime call at a time in a worker thread (see :func:`run_stoppable`).

    ``stuck`` becomes true when a call was told to stop and did not within the grace period: its
    thread may still be using the runtime, which must then not be closed or run again.
    """

    def __init__(self, label: str, grace: float = GRACE):
        self.label, self.grace = label, grace
        self.stuck = False

    def run(self, call: Callable[[], T], stop: Callable[[], None] | None = None, timeout: float | None = None) -> T:
        """The result of ``call()``, computed in a daemon thread while this thread waits.

        ``stop`` tells the runtime to abandon the call (it runs in this thread, after an interrupt
        or at the deadline). ``timeout`` defaults to :func:`current_limit`.

        Raises:
            RunTimeoutError: ``call`` did not return within ``timeout`` seconds.
            KeyboardInterrupt: a signal arrived meanwhile (the call was told to stop first).
            Exception: whatever ``call`` raised.
        """
        if self.stuck:
            raise RunTimeoutError(self.label, timeout or current_limit())
        limit = current_limit() if timeout is None else timeout
        done = threading.Event()
        box: dict[str, object] = {}

        def work() -> None:
            try:
                box["value"] = call()
            except BaseException as e:  # handed to the waiting thread as is
                box["error"] = e
            finally:
                done.set()

        worker = threading.Thread(target=work, name="policy-export-run", daemon=True)
        deadline = time.monotonic() + limit
        expired = False
        worker.start()
        try:
            while not done.wait(POLL):
                if time.monotonic() >= deadline:
                    expired = True
                    break
        except BaseException:  # an interrupt raised by a signal handler while waiting
            self._stop(stop, done, "an interrupt")
            raise
        if expired:
            self._stop(stop, done, f"the run limit of {limit:g} s")
            raise RunTimeoutError(self.label, limit)
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]

    def _stop(self, stop: Callable[[], None] | None, done: threading.Event, why: str) -> None:
        if done.is_set():
            return
        started = time.monotonic()
        if stop is not None:
            try:
                stop()
            except Exception as e:  # stopping is best effort; the thread is left behind otherwise
                log.debug("stopping %s failed: %s", self.label, e)
        if done.wait(self.grace):
            log.debug("%s stopped %.3f s after %s", self.label, time.monotonic() - started, why)
            return
        self.stuck = True
        log.warning("%s did not stop within %g s after %s; its run is left in a background thread",
                    self.label, self.grace, why)


def run_stoppable(call: Callable[[], T], label: str, stop: Callable[[], None] | None = None,
                  timeout: float | None = None, grace: float = GRACE) -> T:
    """``call()`` run so that a deadline holds and signals stop it: see :meth:`Stoppable.run`.

    Raises:
        RunTimeoutError: the deadline passed (``stop`` was called first).
        KeyboardInterrupt: a signal arrived (``stop`` was called first).
    """
    return Stoppable(label, grace).run(call, stop, timeout)



def stoppable_session(graph, config, label: str):
    """A TF1 session over ``graph`` whose every ``run`` keeps the run limit and stops on signals.

    For sessions over graphs a file brought (the legacy SavedModel ``convert`` imports): each
    ``run`` gets the limit as ``timeout_in_ms`` and runs through :meth:`Stoppable.run`, which closes
    the session on an interrupt (cancelling the step). It is a real ``tf.compat.v1.Session``
    (TensorFlow's savers insist on one).
    """
    return _session_class()(graph, config, label)


@functools.cache
def _session_class():
    import tensorflow as tf

    class StoppableSession(tf.compat.v1.Session):
        def __init__(self, graph, config, label: str):
            super().__init__(graph=graph, config=config)
            self._watch = Stoppable(label)

        def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
            limit = current_limit()
            if options is None:
                options = tf.compat.v1.RunOptions()
            if options.timeout_in_ms > 0:  # the caller's own, shorter deadline stays
                limit = min(limit, options.timeout_in_ms / 1000)
            options.timeout_in_ms = max(1, int(limit * 1000))
            parent = super().run
            try:
                return self._watch.run(lambda: parent(fetches, feed_dict, options, run_metadata), self.close, limit)
            except tf.errors.DeadlineExceededError as e:
                raise RunTimeoutError(self._watch.label, limit) from e

        def unwatched_run(self, fetches, feed_dict=None, options=None, run_metadata=None):
            """``run`` for a caller that keeps the limit and signals itself (a format runner)."""
            return super().run(fetches, feed_dict, options, run_metadata)

    return StoppableSession
