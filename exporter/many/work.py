"""One job, run in a worker process of its own (never in the driver): export or verify one policy
with the single commands' Python API, and report what happened as plain values."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.exporter.many.jobs import Job, record_done
from policy_export.exporter.progress import peak_rss_mb

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"


def _max_error(report) -> float | None:
    values = [r.max_abs_err for r in report.records if r.max_abs_err is not None]
    return max(values) if values else None


def _run_export(job: Job):
    """Export one job's policy through the one pipeline (its source found again, as the driver named it)."""
    from policy_export.exporter import pipeline

    own, rest = pipeline.split_options(job.options)
    rest.setdefault("overwrite", True)
    if job.policy_id is not None:
        own["policy_id"] = job.policy_id
    opened = pipeline.open_source(job.source, own, allowed=(job.kind,))
    (result,) = pipeline.export_source(opened, job.out, **rest).values()
    return result


def _outcome(job: Job) -> dict[str, Any]:
    """Run the job; its status, the parity report's figures and what failed."""
    from policy_export.exporter.reports import junit_xml

    signed: dict[str, Any] = {}
    if job.kind == "verify":
        from policy_export.exporter.verify import verify_export

        options = dict(job.options)
        request = options.pop("signature", None)
        if request is not None:  # a signature at the export's top (OUT/model.sig) is not an extra file
            from policy_export.exporter.signing import find_signature, inside_export

            options["signature_inside"] = inside_export(job.out, find_signature(job.out, request.get("signature")))
        result = verify_export(job.out, **options)
        report, problems = result.parity, list(result.file_problems)
        passed = result.passed
        if request is not None:
            signed = {"signature": _check_signature(job, request)}
            problems += signed["signature"]["problems"]
            passed = passed and signed["signature"]["passed"]
    else:
        result = _run_export(job)
        report, problems = result.parity, [f"{k}: not written: {v}" for k, v in result.missing.items()]
        passed = report.passed and not problems
    failures = problems + [r.describe() for r in report.failures()] + [f"{k}: {v}" for k, v in report.errors.items()]
    return {"status": PASSED if passed and not failures else FAILED, "failures": failures,
            "max_error": _max_error(report), "formats": sorted({r.format.split(" ")[0] for r in report.records}),
            "junit": junit_xml(report, job.name, problems if job.kind == "verify" else ()), **signed}


def _check_signature(job: Job, request: Mapping[str, Any]) -> dict[str, Any]:
    """The export's signature (``OUT.sig``) checked as ``verify --public-key`` checks it: the
    report's ``signature`` entry, its problems named (a missing signature is one), and the seconds."""
    from policy_export.errors import InputError
    from policy_export.exporter.signing import verify_signature

    start = time.perf_counter()
    try:
        entry = verify_signature(job.out, **request).to_json()
    except InputError as e:  # no signature beside the export, or one that is not a bundle
        entry = {"passed": False, "signer": "", "files": 0, "problems": [f"signature: {e}"]}
    return {**entry, "seconds": round(time.perf_counter() - start, 3)}


def run_job(job_json: Mapping[str, Any]) -> dict[str, Any]:
    """Run one job (its :meth:`Job.to_json`) and return its result: ``name``, ``status``
    (passed, failed, error), ``seconds``, ``peak_rss_mb`` (this process's), ``max_error``, ``failures``,
    ``junit`` (the policy's test suite) and ``pid``. Never raises for a policy's own problem."""
    from policy_export.errors import PolicyExportError

    job = Job.from_json(job_json)
    start = time.perf_counter()
    try:
        outcome = _outcome(job)
    except PolicyExportError as e:
        outcome = {"status": FAILED, "failures": [f"{type(e).__name__}: {e}"]}
    except Exception as e:  # noqa: BLE001 - one policy's bug must not stop the others
        outcome = {"status": ERROR, "failures": [f"internal error: {type(e).__name__}: {e}"],
                   "traceback": traceback.format_exc(limit=20)}
    result = {"name": job.name, "kind": job.kind, "seconds": round(time.perf_counter() - start, 3),
              "peak_rss_mb": round(peak_rss_mb(), 1),
              "pid": os.getpid(), "max_error": None, "failures": [], **outcome}
    if job.kind != "verify" and result["status"] == PASSED:
        record_done(job, result)
    return result


def skipped(job: Job) -> dict[str, Any]:
    """The result of a job whose export is current."""
    return {"name": job.name, "kind": job.kind, "status": SKIPPED, "seconds": 0.0, "peak_rss_mb": None,
            "max_error": None, "failures": [], "note": f"current: made from the same source and options ({Path(job.out)})"}


def refused(job: Job) -> dict[str, Any]:
    """The result of a job whose source the driver refused (:attr:`Job.refused`): failed, never run."""
    return {"name": job.name, "kind": job.kind, "status": FAILED, "seconds": 0.0, "peak_rss_mb": None,
            "max_error": None, "failures": [f"refused before running: {job.refused}"[:600]]}
