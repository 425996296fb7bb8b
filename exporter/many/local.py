"""The local executor: each policy in a fresh process of its own, at most ``jobs`` at a time.

Processes are forked from a fork server that imported TensorFlow, ONNX Runtime and tf2onnx once
(:mod:`.preload`), so a policy's process starts with the imports paid but with nothing else of
another policy's: it is a new process per policy (no TensorFlow graph, session, memory or thread
pool is shared), and it exits when its policy is done. With ``preload=False`` each process is
spawned from scratch and imports everything itself. A process over the memory cap, or still
running past the time limit per policy, is killed and its policy fails; a process that dies
otherwise is retried once in a new process.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from policy_export.exporter.many.jobs import Job
from policy_export.exporter.many.work import ERROR, FAILED

POLL = 0.2  # seconds between checks of the running processes


def _child(job_json: dict, conn, log_path: str, threads: int) -> None:  # pragma: no cover - the worker process
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)  # TensorFlow's C++ logging: into the policy's log, not the terminal
    os.close(fd)
    # the cores are shared among the policies running at once: TensorFlow's thread pools (made at
    # the first session, after the fork) and OpenMP take their share, not all of them each
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(name, str(threads))
    from policy_export.exporter.many.work import run_job

    conn.send(run_job(job_json))
    conn.close()


def rss_mb(pid: int) -> float | None:
    """The resident memory of process ``pid`` in MiB (``/proc``), or ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


@dataclass
class _Running:
    job: Job
    process: Any
    conn: Any
    started: float
    attempt: int
    peak: float = 0.0
    killed: str | None = None
    result: dict | None = field(default=None)


class LocalPool:
    """Runs jobs in fresh processes; ``on_start(job, attempt)`` and ``on_result(result)`` are called
    in the driver as they happen."""

    def __init__(self, jobs: int, memory_mb: float | None = None, preload: bool = True, log_dir: str | None = None,
                 timeout: float | None = None):
        self.jobs = max(1, int(jobs))
        self.memory_mb, self.timeout = memory_mb, timeout
        self.log_dir = log_dir
        if preload:
            self.ctx = multiprocessing.get_context("forkserver")
            self.ctx.set_forkserver_preload(["policy_export.exporter.many.preload"])
        else:
            self.ctx = multiprocessing.get_context("spawn")

    def run(self, jobs: Sequence[Job], on_start: Callable, on_result: Callable) -> None:
        queue = [(job, 1) for job in jobs]
        running: list[_Running] = []
        while queue or running:
            while queue and len(running) < self.jobs:
                job, attempt = queue.pop(0)
                running.append(self._start(job, attempt))
                on_start(job, attempt)
            time.sleep(POLL) if running else None
            for item in list(running):
                done = self._poll(item)
                if done is None:
                    continue
                running.remove(item)
                if done == "retry":
                    queue.insert(0, (item.job, item.attempt + 1))
                else:
                    on_result(done)

    def _start(self, job: Job, attempt: int) -> _Running:
        receive, send = self.ctx.Pipe(duplex=False)
        log = os.path.join(self.log_dir or job.root, f"{job.name}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        threads = max(1, (os.cpu_count() or 1) // self.jobs)
        process = self.ctx.Process(target=_child, args=(job.to_json(), send, log, threads), name=f"policy-export:{job.name}")
        process.start()
        send.close()
        return _Running(job, process, receive, time.perf_counter(), attempt)

    def _check_caps(self, item: _Running) -> None:
        """Kill the running process of ``item`` if it is over the memory cap or past the time limit."""
        used = rss_mb(item.process.pid)
        item.peak = max(item.peak, used or 0.0)
        if item.killed:
            return
        elapsed = time.perf_counter() - item.started
        if self.memory_mb and used and used > self.memory_mb:
            item.killed = f"killed at {used:.0f} MiB: over the memory cap of {self.memory_mb:g} MiB"
        elif self.timeout and elapsed > self.timeout:
            item.killed = f"killed after {elapsed:.0f} s: over the time limit of {self.timeout:g} s per policy"
        if item.killed:
            item.process.kill()

    def _poll(self, item: _Running):
        """``None`` while it runs; its result; or ``"retry"``."""
        if item.result is None and item.conn.poll():
            try:
                item.result = item.conn.recv()
            except (EOFError, OSError):
                pass
        if item.process.is_alive():
            self._check_caps(item)
            return None
        item.process.join()
        item.conn.close()
        if item.result is not None:
            return {**item.result, "attempts": item.attempt}
        if item.killed is None and item.attempt < 2:
            return "retry"
        why = item.killed or f"the policy's process died (exit code {item.process.exitcode}), twice"
        return {"name": item.job.name, "kind": item.job.kind, "status": FAILED if item.killed else ERROR,
                "seconds": round(time.perf_counter() - item.started, 3), "peak_rss_mb": round(item.peak, 1),
                "max_error": None, "failures": [why], "attempts": item.attempt}
