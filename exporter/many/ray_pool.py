"""The Ray executor: each policy is one Ray task on an existing Ray cluster (``--ray auto`` or
``--ray ADDRESS``), in a fresh worker process of its own.

Each task runs in a Ray worker process that exits when its policy is done (``max_calls=1``), so
no TensorFlow graph, session, memory or thread pool is shared between two policies, as with the
local pool. A task whose worker process or node dies (killed, out of memory, node lost) is
submitted again, up to ``retries`` more times, each time in a new process; its result records
``attempts``. A policy's own problem is never retried: it comes back as a failed result. A task
that still dies after its retries becomes an ``error`` result naming why; one policy never stops
the others. Ctrl-C in the driver cancels every task still pending or running.

The time limit per policy is kept by the worker process itself: a real-time timer whose signal
(``SIGALRM``, its default action) ends the process at the limit, whatever it is doing, in Python
or in C. Its death past the limit is the policy's failure ("over the time limit"), never retried.

Where the exports go: each worker writes ``ROOT/<name>/`` (and the record that makes a rerun skip
it, ``ROOT/.policy-export-many/``) itself, on the node that runs it. Supported are a single
machine (a local Ray cluster), or a cluster whose nodes all see ROOT and the sources at the same
path on a shared file system (NFS, Lustre, a mounted volume...). Not supported: nodes without a
shared file system; their exports would be scattered over the nodes' own disks.

Resources: ``cpus`` is each task's ``num_cpus`` (how many policies run at once on a node) and
``memory_mb`` its ``memory`` reservation; Ray schedules by the reservation (it never starts more
tasks on a node than the node's memory holds), and its memory monitor kills a worker when the node
runs out of memory. Workers' output (TensorFlow's logging) goes to Ray's log files on each node
(``/tmp/ray/session_latest/logs``), not to the driver's terminal.

A cluster with token authentication (Ray 2.52 and later; on by default for local clusters from
2.59) gets the user's token as Ray's own commands find it: ``RAY_AUTH_TOKEN``, the file
``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token``; the driver asks the cluster first whether
it wants one (:func:`_authenticate`). No token, or one the cluster refuses, is an input error that
says so; the token itself is never printed, logged or reported.

The driver imports Ray and the package's light modules only, never TensorFlow. Works with Ray
2.9 and later.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from policy_export.errors import InputError
from policy_export.exporter.many.jobs import Job
from policy_export.exporter.many.work import ERROR, FAILED

TASK_NAME = "policy_export_job"  # the task's process title while it runs is ray::policy_export_job
WAIT = 1.0  # seconds per wait for a finished task (Ctrl-C is seen between waits)
CONNECT_TIMEOUT = 5.0  # seconds to reach a HOST:PORT address before ray.init
START_HINT = ("start one with `ray start --head` (on this machine: `ray start --head --node-ip-address=127.0.0.1`), "
              "or give its address with --ray HOST:PORT (or RAY_ADDRESS)")
AUTH_HINT = ("give the cluster's token as Ray's own commands take it: RAY_AUTH_TOKEN, or a file named by "
             "RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token (`ray get-auth-token` on the head node prints it)")


def _end_at(seconds: float | None) -> None:
    """End this process ``seconds`` from now, by the kernel (``SIGALRM``'s default action); ``None``: never."""
    if seconds and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, seconds or 0)


def policy_export_job(job_json: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:  # pragma: no cover
    """One policy, in the Ray worker process: its libraries imported quietly, then the job run; the
    process ends at ``timeout`` seconds (:func:`_end_at`), as the local pool kills its process."""
    from policy_export.exporter.many.work import run_job
    from policy_export.exporter.quiet import quiet_libraries

    _end_at(timeout)
    try:
        quiet_libraries()
        result = run_job(job_json)
    finally:
        _end_at(None)
    result["host"] = socket.gethostname()
    result["node_id"] = ray.get_runtime_context().get_node_id()
    return result


# a worker's death, not the policy's own problem: the task is submitted again
SYSTEM_ERRORS = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError,
                 ray.exceptions.ObjectLostError, ray.exceptions.LocalRayletDiedError)


def _check_reachable(address: str) -> None:
    """Fail fast on a ``HOST:PORT`` nothing listens at (``ray.init`` would wait a long time)."""
    if address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT):
            return
    except ValueError:
        raise InputError(f"--ray {address!r}: expected auto or HOST:PORT (the head node's GCS port, 6379 by default)")
    except OSError as e:
        raise InputError(f"no Ray cluster at {address} ({e.strerror or e}); {START_HINT}") from None


def _auth_available() -> bool:
    """Whether this Ray has token authentication (2.52 and later)."""
    try:
        from ray._private.authentication import authentication_token_setup  # noqa: F401
    except ImportError:
        return False
    return True


def _refused(address: str, why: str) -> InputError:
    return InputError(f"the Ray cluster at {address!r} refused the connection: authentication {why}; {AUTH_HINT}")


def _gcs_refuses(gcs: str, metadata: tuple = ()) -> bool | None:
    """Whether the cluster's GCS at ``gcs`` (``HOST:PORT``) answers a request sent with ``metadata``
    "unauthenticated"; ``None``: it could not tell (no answer, or no gRPC)."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return None
    with grpc.insecure_channel(gcs) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_TIMEOUT, metadata=metadata)
        except grpc.RpcError as e:
            code = e.code() if callable(getattr(e, "code", None)) else None
            return True if code == grpc.StatusCode.UNAUTHENTICATED else None
    return False


def _authenticate(address: str) -> bool:
    """Get this process ready for the cluster at ``address`` if it wants a token (Ray 2.52 and
    later); whether it does.

    Ray's own rules pick the token, as for its command line: ``RAY_AUTH_TOKEN``, else the file
    ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token`` (``ray get-auth-token``). A cluster
    that refuses requests without a token switches this process to token mode (``RAY_AUTH_MODE=token``),
    unless ``RAY_AUTH_MODE`` says otherwise, as ``ray.init`` itself does for the local cluster;
    a cluster that needs none is left to Ray's defaults. The token is never shown.

    Raises:
        InputError: the cluster wants a token and none is found, token mode is turned off, or it
            refuses the token found.
    """
    if not _auth_available() or address in ("local",) or "://" in address:
        return False
    from ray._private import services

    try:
        gcs = services.canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - ray.init says what is wrong with the address
        return False
    if not gcs or not _gcs_refuses(gcs):
        return False
    from ray._private.authentication import authentication_token_setup as setup
    from ray._raylet import AuthenticationTokenLoader, Config

    mode = os.environ.get(setup.AUTH_MODE_ENV_VAR)
    if mode is not None and mode.lower() != "token":
        raise _refused(address, f"is required, and {setup.AUTH_MODE_ENV_VAR}={mode} turns it off here")
    loader = AuthenticationTokenLoader.instance()
    try:
        loader.reset_cache()
        if not loader.has_token(ignore_auth_mode=True):
            raise _refused(address, "is required, and no token was found")
        if mode is None:
            os.environ[setup.AUTH_MODE_ENV_VAR] = "token"  # as ray.init does for a local cluster when a token exists
            Config.initialize("")  # Ray's cached settings see it
            loader.reset_cache()
        header = tuple(loader.get_token_for_http_header().items())
    except ray.exceptions.AuthenticationError as e:  # e.g. RAY_AUTH_TOKEN_PATH names no readable file
        raise _refused(address, f"failed: {e.message}") from None
    if _gcs_refuses(gcs, header):
        raise _refused(address, "failed: the cluster does not accept the token found")
    return True


def connect(address: str) -> bool:
    """Connect this process to the Ray cluster at ``address``; whether this call connected it
    (``False``: it already was). A cluster with token authentication gets the user's token
    (:func:`_authenticate`).

    Raises:
        InputError: no cluster runs there (the message says how to start one), or it refuses
            this process (no token, or a wrong one: the message says how to give it).
    """
    if ray.is_initialized():
        return False
    _check_reachable(address)
    _authenticate(address)
    kwargs: dict[str, Any] = dict(log_to_driver=False, logging_level=logging.WARNING, configure_logging=True)
    if "://" not in address:
        kwargs["include_dashboard"] = False
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as e:
        raise InputError(f"no Ray cluster to connect to at {address!r} ({e}); {START_HINT}") from None
    except getattr(ray.exceptions, "AuthenticationError", ()) as e:
        raise _refused(address, f"failed ({e.message})") from None
    return True


def _error_result(job: Job, why: str, started: float, attempts: int) -> dict[str, Any]:
    return {"name": job.name, "kind": job.kind, "status": ERROR, "seconds": round(time.perf_counter() - started, 3),
            "peak_rss_mb": None, "pid": None, "max_error": None, "failures": [why], "attempts": attempts}


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:600]


class RayPool:
    """Runs jobs as Ray tasks on the cluster at ``address`` (``"auto"``: the one this machine
    belongs to, or ``RAY_ADDRESS``); ``on_start(job, attempt)`` and ``on_result(result)`` are
    called in the driver as tasks are submitted and finish.

    A process already connected to Ray (``ray.init`` called before) is used as it is, and left
    connected; otherwise the pool connects, and disconnects when :meth:`run` ends.

    ``memory_mb`` is taken as :func:`~exporter.many.export_many` checked it.

    Raises:
        InputError: no Ray cluster runs at ``address``, or a bad ``cpus``/``retries``.
    """

    def __init__(self, address: str, memory_mb: float | None = None, cpus: float = 1, retries: int = 3,
                 timeout: float | None = None):
        if cpus <= 0 or retries < 0:
            raise InputError(f"Ray tasks need cpus > 0 and retries >= 0 (got {cpus}, {retries})")
        self.address, self.cpus, self.memory_mb, self.retries = address or "auto", cpus, memory_mb, retries
        self.timeout = timeout
        self.owned = connect(self.address)
        try:
            self.gcs_address = ray.get_runtime_context().gcs_address
            self.resources = {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
            self.nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        except BaseException:
            self.close()
            raise
        self.jobs = max(1, int(self.resources.get("CPU", 0) / cpus))
        # retries are the pool's own (each attempt a new task, seen by the driver: progress shows
        # "attempt 2" and the result its attempts), so Ray's are off; a policy's own exception is
        # a result value of run_job, never a reason to retry
        options: dict[str, Any] = dict(num_cpus=cpus, max_retries=0, retry_exceptions=False, max_calls=1)
        if memory_mb:
            options["memory"] = int(memory_mb * 2**20)
        self.options = options
        self.task = ray.remote(**options)(policy_export_job)

    def describe(self) -> dict[str, Any]:
        """What ran the jobs, as plain values for the run's report."""
        memory = self.resources.get("memory")
        return {"executor": "ray", "ray_version": ray.__version__, "address": self.address,
                "gcs_address": self.gcs_address, "nodes": self.nodes,
                "cluster": {"cpus": self.resources.get("CPU", 0.0), "gpus": self.resources.get("GPU", 0.0),
                            "memory_mb": round(memory / 2**20) if memory else None},
                "task": {"num_cpus": self.cpus, "memory_mb": self.memory_mb, "max_calls": 1,
                         "timeout_s": self.timeout},
                "retries": self.retries, "parallel": self.jobs}

    def run(self, jobs: Sequence[Job], on_start: Callable, on_result: Callable) -> None:
        """Run every job; returns when each has a result (passed, failed or error)."""
        pending: dict[Any, tuple[Job, int, float]] = {}
        try:
            for job in jobs:
                self._submit(pending, job, 1, on_start)
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=WAIT)
                for ref in ready:
                    job, attempt, started = pending.pop(ref)
                    result = self._collect(ref, job, attempt, started)
                    if result is None:
                        self._submit(pending, job, attempt + 1, on_start)
                    else:
                        on_result(result)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            self.close()

    def _submit(self, pending: dict, job: Job, attempt: int, on_start: Callable) -> None:
        pending[self.task.remote(job.to_json(), self.timeout)] = (job, attempt, time.perf_counter())
        on_start(job, attempt)

    def _collect(self, ref, job: Job, attempt: int, started: float) -> dict[str, Any] | None:
        """The task's result, an error result, or ``None`` to submit it again."""
        try:
            result = ray.get(ref)
        except ray.exceptions.TaskCancelledError as e:
            return _error_result(job, f"the policy's Ray task was cancelled: {_first_line(e)}", started, attempt)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            return _error_result(job, f"the policy's Ray task raised {_first_line(cause)}", started, attempt)
        except ray.exceptions.RayError as e:
            return self._died(e, job, attempt, started)
        return {**result, "attempts": attempt}

    def _died(self, error: BaseException, job: Job, attempt: int, started: float) -> dict[str, Any] | None:
        """A task whose worker died: failed past the time limit (its own timer ended it), else ``None``
        to submit it again, or an error result after the retries."""
        elapsed = time.perf_counter() - started
        if self.timeout and elapsed >= self.timeout:  # the task cannot have started before its submission
            return {**_error_result(job, f"killed after {elapsed:.0f} s: over the time limit of {self.timeout:g} s "
                                         "per policy", started, attempt), "status": FAILED}
        if attempt <= self.retries:
            return None
        if isinstance(error, SYSTEM_ERRORS):
            why = f"the policy's Ray worker died {attempt} time(s), the last: {_first_line(error)}"
        else:
            why = f"Ray could not run the policy's task: {_first_line(error)}"
        return _error_result(job, why, started, attempt)

    def close(self) -> None:
        """Disconnect from the cluster if this pool connected (the cluster keeps running)."""
        if self.owned:
            self.owned = False
            ray.shutdown()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit Ray may be gone already
            pass
