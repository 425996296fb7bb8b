"""Many policies at once: ``export-many`` and ``verify-many`` (see :func:`export_many`,
:func:`verify_many`). Each policy runs in a process of its own, on the local pool
(:mod:`.local`) or as a Ray task (:mod:`.ray_pool`); the driver never imports TensorFlow. One
policy's failure never stops the others, and a rerun skips what is current (:mod:`.jobs`)."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter.many import report
from policy_export.exporter.many.jobs import Job, expand, is_current, verify_jobs
from policy_export.exporter.many.work import refused, skipped
from policy_export.exporter.options import check_count

__all__ = ["ManyResult", "export_many", "verify_many", "DEFAULT_POLICY_TIMEOUT"]

DEFAULT_POLICY_TIMEOUT = 1800.0  # seconds of wall-clock time one policy's process may take


@dataclass
class ManyResult:
    """Every policy's result (``name``, ``status``, ``seconds``, ``peak_rss_mb``, ``max_error``,
    ``failures``...), in the order the sources named them."""

    root: Path
    results: list[dict[str, Any]]
    seconds: float
    executor: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r["status"] in ("passed", "skipped") for r in self.results)

    @property
    def failed(self) -> list[str]:
        return [r["name"] for r in self.results if r["status"] not in ("passed", "skipped")]

    def to_json(self) -> dict[str, Any]:
        return report.to_json(self.results, self.seconds, {"root": str(self.root), "executor": self.executor})

    def junit(self) -> str:
        return report.junit(self.results)

    def markdown(self, title: str) -> str:
        return report.markdown(self.results, title, self.seconds)


class Progress:
    """Progress over the whole run: done, running, failed and an ETA, one plain line per event."""

    def __init__(self, total: int, workers: int, write: Callable[[str], None] | None = None,
                 status: Callable[[str], None] | None = None):
        self.total, self.workers = total, max(1, workers)
        self.status = status  # shown live on a terminal: the counts after each event
        self.done = self.failed = self.running = 0
        self.times: list[float] = []
        self.start = time.perf_counter()
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))

    def eta(self) -> str:
        left = self.total - self.done
        if not self.times or not left:
            return "-"
        return f"{sum(self.times) / len(self.times) * left / self.workers:.0f} s"

    def started(self, job: Job, attempt: int) -> None:
        self.running += 1
        again = f" (attempt {attempt})" if attempt > 1 else ""
        self.write(f"[{self._counts()}] {job.name}: started{again}")
        self._show()

    def finished(self, result: Mapping[str, Any]) -> None:
        self.running = max(0, self.running - 1) if result["status"] != "skipped" else self.running
        self.done += 1
        if result["status"] not in ("passed", "skipped"):
            self.failed += 1
        if result["status"] != "skipped":
            self.times.append(float(result.get("seconds") or 0))
        detail = f" in {result.get('seconds', 0):.1f} s" if result["status"] != "skipped" else " (current)"
        why = f": {result['failures'][0]}" if result.get("failures") else ""
        self.write(_shortened(f"[{self._counts()}] {result['name']}: {result['status']}{detail}{why}", 400))
        self._show()

    def _show(self) -> None:
        if self.status is not None:
            self.status(self._counts())

    def _counts(self) -> str:
        return (f"{self.done}/{self.total} done, {self.running} running, {self.failed} failed, "
                f"{time.perf_counter() - self.start:.0f} s, ETA {self.eta()}")


def _shortened(text: str, limit: int) -> str:
    """``text`` whole when it has at most ``limit`` characters, else cut at the last space before
    it, ``...`` added (a word or a path is never cut inside)."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 3)
    return text[:cut if cut > 0 else limit - 3] + " ..."


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_run(jobs: int | None, memory_mb: float | None, policy_timeout: float | None = None) -> None:
    """How many policies run at once, the memory and the time each may take, checked before anything runs.

    Raises:
        InputError: ``jobs`` is not a whole number of at least 1, ``memory_mb`` not a size above 0,
            or ``policy_timeout`` not a number of seconds above 0.
    """
    if jobs is not None:
        check_count("jobs", jobs, 1)
    if memory_mb is not None and not _positive(memory_mb):
        raise InputError(f"memory_mb (--memory-mb) must be a number of MiB above 0, got {memory_mb!r:.40}")
    if policy_timeout is not None and not _positive(policy_timeout):
        raise InputError(f"policy_timeout must be a number of seconds above 0, got {policy_timeout!r:.40}")


def _check_root(root: Path, what: str) -> None:
    """``root`` is a directory, or a path where one can be made: never an existing file.

    Raises:
        InputError: ``root`` (or a directory above it) exists and is not a directory.
    """
    for path in (root, *root.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                where = "" if path == root else f" ({path} is not a directory)"
                raise InputError(f"{what} {root}: exists and is not a directory{where}")
            return


def _executor(opts: Mapping[str, Any], log_dir: Path):
    """The pool that runs the jobs: Ray's where ``opts["ray"]`` names a cluster, else the local one."""
    timeout = opts.get("policy_timeout") or DEFAULT_POLICY_TIMEOUT
    if opts.get("ray"):
        from policy_export.exporter.compat import require

        require(("ray",), "ray", "export-many/verify-many --ray")
        from policy_export.exporter.many.ray_pool import RayPool

        return RayPool(opts["ray"], memory_mb=opts.get("memory_mb"), timeout=timeout)
    from policy_export.exporter.many.local import LocalPool

    return LocalPool(opts.get("jobs") or os.cpu_count() or 1, memory_mb=opts.get("memory_mb"),
                     preload=opts.get("preload", True), log_dir=str(log_dir), timeout=timeout)


def _signed(result: dict, outs: Mapping[str, str], sign) -> dict:
    """``result`` with its export signed (``sign``: a :class:`~exporter.signing.SignRequest`), in
    the driver, as each policy passes (or is current): the ``signature`` entry (who signed, the
    files, the seconds it took), or the policy failed with the reason it could not be signed."""
    if sign is None or result.get("kind") == "verify" or result["status"] not in ("passed", "skipped"):
        return result
    from policy_export.errors import PolicyExportError

    start = time.perf_counter()
    try:
        signed = sign.sign(outs[result["name"]])
    except Exception as e:  # noqa: BLE001 - one export that cannot be signed must not stop the others
        why = f"not signed: {e}" if isinstance(e, PolicyExportError) else f"not signed: {type(e).__name__}: {e}"
        return {**result, "status": "failed", "failures": [*result.get("failures", []), why],
                "signature": {"passed": False, "problems": [why], "seconds": round(time.perf_counter() - start, 3)}}
    entry = {"path": str(signed.signature), "passed": True, "signer": signed.signer, **signed.info,
             "files": signed.files, "problems": [], "seconds": round(time.perf_counter() - start, 3)}
    return {**result, "signature": entry}


def _run(all_jobs: Sequence[Job], root: Path, todo: Sequence[Job], done: Mapping[str, dict], opts: Mapping[str, Any],
         write: Callable[[str], None] | None) -> ManyResult:
    """Run ``todo`` (``done``: the results of the current ones) and gather every result in order."""
    start = time.perf_counter()
    from policy_export.exporter.many.jobs import STATE_DIR

    runnable = [j for j in todo if not j.refused]
    pool = _executor(opts, root / STATE_DIR / "logs") if runnable else None
    progress = Progress(len(all_jobs), getattr(pool, "jobs", 1), write, opts.get("status"))
    results = dict(done)
    outs = {j.name: j.out for j in all_jobs}

    def finished(result: dict) -> None:
        result = _signed(result, outs, opts.get("sign"))
        results[result["name"]] = result
        progress.finished(result)

    for result in [*done.values(), *(refused(j) for j in todo if j.refused)]:
        finished(result)
    if pool is not None:
        pool.run(runnable, progress.started, finished)
    ordered = [results[j.name] for j in all_jobs if j.name in results]
    return ManyResult(root, ordered, time.perf_counter() - start, getattr(pool, "describe", lambda: {})())


def _current(all_jobs: Sequence[Job]) -> dict[str, dict]:
    """The results of the jobs whose export is current (skipped), each with the seconds its check took."""
    done = {}
    for job in all_jobs:
        start = time.perf_counter()
        if is_current(job):
            done[job.name] = {**skipped(job), "seconds": round(time.perf_counter() - start, 6)}
    return done


def export_many(sources: Sequence[str | Path], root: str | Path, *, jobs: int | None = None, ray: str | None = None,
                force: bool = False, memory_mb: float | None = None,
                progress: Callable[[str], None] | None = None, **options: Any) -> ManyResult:
    """Export every policy of ``sources`` (spec directories, SavedModels, RLlib checkpoints, league
    files; see :mod:`.jobs`) into ``root/<name>/``, each in a process of its own, ``jobs`` at a
    time (default: the number of cores) or as Ray tasks (``ray``: ``"auto"`` or a cluster address).
    ``options`` are the single commands' (``formats``, ``samples``...); a league entry's own win.
    A policy whose export is current is skipped unless ``force``. ``memory_mb`` caps each policy's
    process; ``policy_timeout=`` (a keyword) is the wall-clock time each may take (default
    :data:`DEFAULT_POLICY_TIMEOUT` seconds), after which it is killed and its policy fails. The
    driver reads the sources' names only (never a checkpoint's state: see :mod:`.jobs`); every
    policy's files are read in its own process, under those caps. ``progress`` receives one line
    per event (default: stderr); ``status``, where given, the counts after each (done, running,
    failed, the ETA), e.g. for a live display. ``preload=False`` starts each local process from
    scratch instead of forking it from a process that imported the runtimes. ``sign=`` (a keyword): a
    :class:`~exporter.signing.SignRequest`: every export that passes (or is current) is signed
    beside it, ``root/<name>.sig``, by the driver (the key and its password never reach a job);
    one that cannot be signed fails.

    Raises:
        InputError: a bad source, league file, option or signing request, or ``root`` an existing
            file (before anything runs).
    """
    preload, status = options.pop("preload", True), options.pop("status", None)
    policy_timeout, sign = options.pop("policy_timeout", None), options.pop("sign", None)
    _check_run(jobs, memory_mb, policy_timeout)
    root = Path(root).absolute()
    _check_root(root, "export-many's ROOT (--out)")
    if sign is not None:
        sign.check(root / "policy")  # the extra, the key and certificates: before anything runs
    all_jobs = expand(sources, root, options)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"export-many's ROOT (--out) {root}: cannot be made: {e.strerror or e}") from None
    done = {} if force else _current(all_jobs)
    todo = [j for j in all_jobs if j.name not in done]
    return _run(all_jobs, root, todo, done, dict(jobs=jobs, ray=ray, memory_mb=memory_mb, preload=preload,
                                                 status=status, policy_timeout=policy_timeout, sign=sign), progress)


def verify_many(root: str | Path, *, jobs: int | None = None, ray: str | None = None, memory_mb: float | None = None,
                preload: bool = True, progress: Callable[[str], None] | None = None,
                status: Callable[[str], None] | None = None, **options: Any) -> ManyResult:
    """Verify every export under ``root`` (``root/<name>/manifest.json``), each in a process of its
    own; ``options`` are :func:`exporter.verify_export`'s (``samples``, ``seed``...); the rest as
    for :func:`export_many` (``policy_timeout=`` too). The driver only lists ``root``; each export
    is read by its own process. ``signature=`` (a keyword): how to check each export's signature,
    ``root/<name>.sig`` (:func:`exporter.signing.verify_signature`'s ``public_key``,
    ``certificate_chain``, ``identity`` and ``issuer``): a policy whose signature is missing or
    does not match fails, with the reasons ``verify`` gives.

    Raises:
        InputError: ``root`` is not a directory or holds no export, or a bad option (before anything runs).
    """
    policy_timeout, signature = options.pop("policy_timeout", None), options.pop("signature", None)
    _check_run(jobs, memory_mb, policy_timeout)
    root = Path(root).absolute()
    if signature is not None:
        from policy_export.exporter.signing import check_verify_request

        signature = {k: ([str(c) for c in v] if k == "certificate_chain" else None if v is None else str(v))
                     for k, v in signature.items()}  # plain values: they travel to each policy's process
        check_verify_request(**signature)
        options = {**options, "signature": signature}
    all_jobs = verify_jobs(root, options)
    return _run(all_jobs, root, all_jobs, {}, dict(jobs=jobs, ray=ray, memory_mb=memory_mb, preload=preload,
                                                   status=status, policy_timeout=policy_timeout), progress)
