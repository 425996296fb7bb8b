"""The Python export API: one call writes every format and proves parity.

    from policy_export.exporter import export_spec, verify_export
    result = export_spec("fixtures/cartpole_mlp", "out/cartpole")
    result.parity.passed, [r.max_abs_err for r in result.parity.records]
    verify_export("out/cartpole").raise_if_failed()
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import time
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter import formats as registry
from policy_export.exporter import frozen_graph, keras_model, manifest
from policy_export.exporter.context import (
    ALL_FORMATS, DEFAULT_OPSET, ExportContext, FormatRecord, check_opset, resolve_formats,  # noqa: F401 (re-exported)
)
from policy_export.exporter.defaults import DEFAULT_EXTERNAL_DATA_THRESHOLD
from policy_export.exporter.devices import TF32_TOLERANCE, DevicePlan, plan_devices
from policy_export.exporter.exploration import (
    DEFAULT_EXPLORE_SAMPLES, DEFAULT_OBSERVATIONS, logp_of_given_actions, rounding_allowance, within_allowance,
)
from policy_export.exporter.exploration import summarize as summarize_exploration
from policy_export.exporter import behaviour as behaviour_thresholds
from policy_export.exporter import replay
from policy_export.exporter.parity import (
    DEFAULT_BATCH, DEFAULT_SAMPLES, ParityReport, Tolerance, Tolerances, compare_arrays, run_batched, sample_inputs,
)
from policy_export.exporter.plan import (
    GOLDEN_INPUTS, GOLDEN_OUTPUTS, ExplorationPlan, ParityPlan, SteppedPlan, load_plan, write_plan,
)
from policy_export.exporter.plan import manifest_record as parity_manifest_record
from policy_export.exporter.progress import SILENT, Counted, MemoryTrace, Progress, peak_rss_mb, release_memory
from policy_export.exporter.staging import check_target, staged_directory
from policy_export.exporter.watchdog import limited
from policy_export.exporter.stepped import (
    DEFAULT_SEQUENCES, DEFAULT_STEPS, run_stepped, run_training_graph, stepped_inputs,
)
from policy_export.policy.errors import CheckFailedError, ExportError, InputError
from policy_export.policy.spaces import check_sample_budget, leaves, space_to_json
from policy_export.policy.tf_policy import ACTION_DIST_INPUTS, ACTION_LOGP
from policy_export.signatures.builder import build_signature
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import EXPLORE, OBSERVATIONS, action_key

log = logging.getLogger(__name__)

PARITY_DIR = "parity"
MODEL_IO_PREFIX = replay.MODEL_IO_PREFIX


@contextlib.contextmanager
def _disk_errors(out: Path):
    """An OS error while the export is written (a full disk, an I/O error, a permission change)
    becomes an :class:`ExportError` naming it; the staging directory is gone by then."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or str(e)
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise ExportError(f"writing the export {out} failed: {reason}{where}; nothing was left behind") from e


def tf32_tolerances(tolerances: Tolerances, plan: DevicePlan) -> Tolerances:
    """``tolerances`` with the default raised to at least :data:`TF32_TOLERANCE` where TF32 is
    allowed and a GPU computes (per-output tolerances stay as given); unchanged otherwise."""
    if not plan.tf32_active:
        return tolerances
    default = Tolerance(max(tolerances.default.atol, TF32_TOLERANCE), max(tolerances.default.rtol, TF32_TOLERANCE))
    return dataclasses.replace(tolerances, default=default)


def check_export_files(out: Path, doc: Mapping[str, Any]) -> manifest.FileCheck:
    """The file check of an export (changed, missing, extra and special files, each named)."""
    return manifest.check_files(out, doc, registry.paths())


class ParityFailedError(CheckFailedError):
    """Parity or file checks failed; ``report`` holds every record, ``problems`` the file issues."""

    def __init__(self, message: str, report: ParityReport | None, problems: Sequence[str] = ()):
        super().__init__(message)
        self.report = report
        self.problems = list(problems)


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_policy` wrote; ``timings`` holds each stage's wall time in seconds."""

    path: Path
    formats: dict[str, FormatRecord]
    files: list[dict[str, Any]]
    parity: ParityReport
    manifest: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # process peak memory at each stage's end


@contextlib.contextmanager
def _stage(timings: dict[str, float], name: str, progress: Progress = SILENT, total: int | None = None):
    """Time the stage ``name`` into ``timings`` and report it to ``progress`` (yields its task)."""
    start = time.perf_counter()
    try:
        with progress.stage(name, total) as task:
            yield task
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify_export` found: file problems and the parity of each format."""

    path: Path
    file_problems: list[str]
    parity: ParityReport
    notes: list[str] = field(default_factory=list)  # what the replayed plan held, and what was run

    @property
    def passed(self) -> bool:
        return not self.file_problems and self.parity.passed

    def raise_if_failed(self) -> None:
        """Raise :class:`ParityFailedError` naming every problem."""
        if not self.passed:
            parts = (list(self.file_problems) + [f"{k}: {v}" for k, v in self.parity.errors.items()]
                     + [r.describe() for r in self.parity.failures()])
            raise ParityFailedError(f"verify {self.path} failed: " + "; ".join(parts), self.parity, self.file_problems)


@limited
def export_policy(
    policy,
    out: str | Path,
    *,
    formats: Sequence[str] | None = None,
    opset: int = DEFAULT_OPSET,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    tolerances: Tolerances | None = None,
    device: str | DevicePlan = "auto",
    overwrite: bool = False,
    batch_size: int = DEFAULT_BATCH,
    explore_samples: int = DEFAULT_EXPLORE_SAMPLES,
    inputs_as_nchw: bool = False,
    stepped_steps: int = DEFAULT_STEPS,
    source: Mapping[str, Any] | None = None,
    external_data_threshold: int = DEFAULT_EXTERNAL_DATA_THRESHOLD,
    progress: Progress | None = None,
    behaviour: Mapping[str, Mapping[str, float]] | None = None,
    run_timeout: float | None = None,
) -> ExportResult:
    """Export ``policy`` (a :class:`policy.TFPolicy`) to the directory ``out`` and prove parity.

    Every format is compared with the TF session on ``samples`` observations sampled from the
    observation space with ``seed``; with an ``explore`` input, sampled actions are compared as
    distributions over ``explore_samples`` draws (0 skips that). The export is renamed into place
    only if parity passes. ``inputs_as_nchw`` makes the ONNX model take rank-4 image inputs as
    NCHW (and only those); parity then feeds each runtime its own layout. Recurrent policies also
    get stepped parity over ``stepped_steps`` consecutive steps (see :mod:`exporter.stepped`).
    ONNX models whose weights exceed ``external_data_threshold`` bytes keep them in a ``.data``
    file beside the model (ONNX external data). ``behaviour`` overrides the thresholds of lossy
    formats (format, or ``"*"`` for all -> {name: value}; see :mod:`exporter.behaviour`); they are
    recorded in the manifest. ``source`` is recorded in the manifest (e.g. what a converted model
    came from). The parity
    plan that was run (golden, exploration and stepped parts; :mod:`exporter.plan`) is stored in
    ``parity/`` so that :func:`verify_export` replays it. ``progress`` (a
    :class:`exporter.progress.Progress`; default silent) is told each stage as it runs.
    ``run_timeout``: seconds one call into a runtime may take (default 600; see :mod:`exporter.watchdog`).

    Returns:
        ExportResult with the format records, file list, parity report and manifest.
    Raises:
        ParityFailedError: an output differs beyond its tolerance (nothing is written).
        ExportExistsError, ExportBusyError, ExportError, InputError, DeviceError: see their docs.
    """
    explicit = formats is not None
    progress = MemoryTrace(progress or SILENT)
    formats = resolve_formats(formats)
    check_opset(opset)
    if samples < 1:
        raise InputError(f"samples must be at least 1, got {samples}")
    check_sample_budget(samples, policy.observation_space, "samples")
    check_sample_budget(explore_samples * DEFAULT_OBSERVATIONS, policy.observation_space,
                        f"explore_samples {explore_samples} x {DEFAULT_OBSERVATIONS} observations:")
    plan = plan_devices(device)
    tolerances = tf32_tolerances(tolerances or Tolerances(), plan)
    out = Path(out)  # the target is checked by staged_directory, before anything is built

    signature = build_signature(policy)
    named = set(tolerances.per_output) | tolerances.allow_non_finite
    unknown_tol = sorted(named - set(signature.contract.output_keys))
    if unknown_tol:
        raise InputError(f"tolerance given for unknown output(s) {unknown_tol}; outputs are {signature.contract.output_keys}")
    chosen = _writable(policy, formats, explicit)
    formats = tuple(f.name for f in chosen)
    if external_data_threshold < 0:
        raise InputError(f"external_data_threshold must be 0 or more, got {external_data_threshold}")
    thresholds = behaviour_thresholds.resolve([f.name for f in chosen if f.capabilities.lossy], behaviour)
    ctx = ExportContext(policy=policy, signature=signature, device=plan, opset=opset, inputs_as_nchw=inputs_as_nchw,
                        external_data_threshold=external_data_threshold)

    timings: dict[str, float] = {}
    with _disk_errors(out), staged_directory(out, overwrite) as stage:
        records: dict[str, FormatRecord] = {}
        if any(f.capabilities.needs_frozen_graph for f in chosen):
            with _stage(timings, "freeze", progress):
                ctx.frozen_graph_def()
        for fmt in chosen:
            log.info("writing %s", fmt.name)
            with _stage(timings, f"write {fmt.name}", progress):
                records[fmt.name] = fmt.write(ctx, stage / fmt.path)
        ctx.release()  # the frozen graph and the converted models hold weights no later stage needs
        release_memory()
        parity_start = time.perf_counter()
        explores = explore_samples > 0 and EXPLORE in signature.inputs
        steps = policy.is_recurrent and policy.sequence_graph is not None and stepped_steps > 0
        session_rows = (samples * (2 if policy.model_io is not None else 1)
                        + (_explore_rows(samples, explore_samples) if explores else 0)
                        + (stepped_steps * DEFAULT_SEQUENCES if steps else 0))
        with progress.stage("parity session", session_rows) as task:  # the reference: the TF session's outputs
            run = Counted(policy.run, task)
            golden_in = sample_inputs(policy.observation_space, policy.action_space, signature.contract, samples, seed)
            parity_plan = ParityPlan(golden_in, _reference_outputs(policy, golden_in, batch_size, run))
            explore = None
            if explores:
                explore = _ExploreSetup.make(policy, golden_in, signature.contract, explore_samples, batch_size, run)
                parity_plan.exploration = explore.plan
            if steps:
                parity_plan.stepped = _stepped_plan(policy, signature.contract, stepped_steps, DEFAULT_SEQUENCES,
                                                    seed, run)
        report = ParityReport("tf_session", samples, seed, _device_info(plan))
        info = {k: r.details for k, r in records.items()}
        checks = replay.Replay(parity_plan, signature.contract, tolerances, batch_size, explore, info, progress,
                               action_space=policy.action_space, behaviour=thresholds)
        view = {"tensor_names": signature.tensor_names(), "contract": signature.contract.to_json(), "formats": info}
        replay.check_formats(stage, formats, view, plan, checks, report)
        timings["parity"] = time.perf_counter() - parity_start
        with _stage(timings, "write manifest", progress):
            _write_golden(stage, parity_plan, report)
            doc = _manifest(policy, signature, records, opset, tolerances, report, stage)
            doc["parity"]["plan"] = parity_manifest_record(parity_plan)
            if thresholds:
                doc["behaviour"] = behaviour_thresholds.to_json(thresholds)
                doc["parity"]["behaviour"] = behaviour_thresholds.summarize(report.behaviour)
            if source:
                doc = {**doc, "source": dict(source)}
                doc["files"] = manifest.file_records(stage)
            manifest.write_manifest(stage, doc)
        if not report.passed:
            with progress.stage("localize"):
                _localize_failed(stage, ctx, formats, signature, parity_plan, tolerances, report)
            where = [e["describe"] for e in report.localization if e.get("describe")]
            raise ParityFailedError(
                "parity failed, nothing was written: " + "; ".join(r.describe() for r in report.failures())
                + ("; " + "; ".join(where) if where else ""), report
            )
    return ExportResult(out, records, doc["files"], report, doc, timings, progress.peaks)


def _localize_failed(stage: Path, ctx: ExportContext, formats, signature, parity_plan, tolerances: Tolerances,
                     report: ParityReport) -> None:
    """For each ONNX format that failed, the first intermediate tensor where it leaves the frozen
    graph (:mod:`exporter.localize`), added to ``report.localization``."""
    from policy_export.exporter.localize import localize_formats

    failed = {r.format.split(" ")[0] for r in report.failures() if hasattr(r, "format")} | set(report.errors)
    models = {f.name: stage / f.path for f in registry.with_capability("onnx", formats) if f.name in failed}
    if not models:
        return
    frozen = stage / frozen_graph.FILENAME
    if not frozen.is_file():
        frozen = stage / ".localize_frozen_graph.pb"  # the staging directory is removed on failure
        frozen.write_bytes(ctx.frozen_graph_def().SerializeToString())
    report.localization.extend(localize_formats(frozen, models, signature.tensor_names()["inputs"],
                                                parity_plan.golden_inputs, tolerances))


def export_spec(spec_path: str | Path, out: str | Path, *, device: str = "auto", **options: Any) -> ExportResult:
    """Load a spec (directory or ``policy.json``), build its policy and :func:`export_policy` it
    (``options``, ``progress`` included, go to :func:`export_policy`)."""
    from policy_export.policy.spec import load_spec
    from policy_export.policy.tf_policy import TFPolicy

    plan = plan_devices(device)
    check_target(Path(out).absolute(), options.get("overwrite", False))
    start = time.perf_counter()
    with (options.get("progress") or SILENT).stage("graph build"):
        policy = TFPolicy.from_spec(load_spec(spec_path), device=plan.tf_device)
    build, build_peak = time.perf_counter() - start, peak_rss_mb()
    try:
        result = export_policy(policy, out, device=plan, **options)
    finally:
        policy.close()
    result.timings["graph build"] = build
    result.peak_rss_mb["graph build"] = build_peak
    return result


@limited
def verify_export(
    out: str | Path, *, samples: int = 0, seed: int = 1, device: str = "auto",
    tolerances: Tolerances | None = None, batch_size: int = DEFAULT_BATCH,
    expect_manifest_sha256: str | None = None, candidates: Mapping[str, str | Path] | None = None,
    localize: bool = False, progress: Progress | None = None,
    behaviour: Mapping[str, Mapping[str, float]] | None = None, run_timeout: float | None = None,
) -> VerifyResult:
    """Check an export: file hashes, then replay its stored parity plan on every format fresh from disk.

    The plan (see :mod:`exporter.plan`) is the golden inputs and outputs, the session's exploration
    draws and, for recurrent policies, the stepped sequences with the session's per-step outputs;
    an export made before the plan was stored replays the golden part alone (``notes`` says so).
    A format or plan file whose files failed the hash check (changed, missing, extra, or not a
    regular file) is never loaded; with ``expect_manifest_sha256`` (the manifest's digest kept
    elsewhere) a manifest with another digest fails and nothing is loaded. With ``samples > 0``,
    also draws that many new observations and compares each format with the SavedModel (or the
    frozen graph, in an export without one) on them.

    ``candidates`` (format -> model path, e.g. ``{"onnx": "model.opt.onnx"}``) checks those files
    against the export's plan instead of the export's own formats; the export is only read.

    ``behaviour``: overrides of the lossy formats' thresholds recorded in the manifest (as for
    :func:`export_policy`); lossy formats are re-checked against them.

    ``localize``: for each ONNX model checked (the export's, or an ONNX candidate), compare every
    intermediate tensor it shares with the export's frozen graph on the golden inputs and name the
    first that diverges (``report.localization``; see :mod:`exporter.localize`).

    ``progress`` (a :class:`exporter.progress.Progress`; default silent) is told each stage as it
    runs: the file check, the plan's loading, each format's parity, fresh samples, localisation.

    ``run_timeout``: seconds one call into a runtime may take (default 600): a format or candidate
    that takes longer is stopped and fails with :class:`~exporter.watchdog.RunTimeoutError`.

    Raises:
        ExportError: ``out`` is not an export.
        InputError: ``expect_manifest_sha256`` is not 64 hex digits, a tolerance names an unknown
            output, or a candidate's format is not one of the export's or its path does not exist.
    """
    out = Path(out)
    progress = progress or SILENT
    pin = _check_pin(expect_manifest_sha256)
    doc = manifest.read_manifest(out)
    candidates = _check_candidates(candidates, doc)
    with progress.stage("check files"):
        check = check_export_files(out, doc)
    problems = list(check.problems)
    digest = manifest.manifest_sha256(out) if pin is not None else None
    if digest != pin:
        problems.insert(0, f"changed file {manifest.MANIFEST} (sha256 {digest} is not the expected {pin}); "
                           "nothing was loaded")
    plan = plan_devices(device)
    tolerances = tf32_tolerances(tolerances or Tolerances.from_json(doc["tolerances"]), plan)
    contract = Contract.from_json(doc["contract"])
    _check_tolerance_keys(tolerances, contract, doc)
    lossy = [f for f in doc["formats"] if f in registry.names() and registry.get(f).capabilities.lossy]
    thresholds = behaviour_thresholds.resolve(lossy, behaviour, behaviour_thresholds.from_manifest(doc))
    report = ParityReport("golden_outputs", 0, seed, _device_info(plan))
    if digest != pin:  # the manifest itself is not the one pinned: trust none of it
        return VerifyResult(out, problems, report)
    _untrusted_formats(out, doc, check, report)
    if not all(check.trusted(g) for g in (GOLDEN_INPUTS, GOLDEN_OUTPUTS)):
        report.errors["parity"] = "golden files not loaded: they failed the hash check"
        return VerifyResult(out, problems, report)
    try:
        with progress.stage("load plan"):
            checks = _stored_replay(out, doc, check, contract, tolerances, batch_size)
        checks.behaviour = thresholds
    except (ExportError, StopIteration, TypeError) as e:
        report.errors["parity"] = f"the parity plan cannot be used: {e}"
        return VerifyResult(out, problems, report)
    checks.progress = progress
    report.samples = len(next(iter(checks.plan.golden_inputs.values())))
    notes = checks.plan.describe()
    if candidates:
        notes.append("candidates: " + ", ".join(f"{f}={p}" for f, p in candidates.items())
                     + " (the export's own formats are not run)")
        replay.check_candidates(candidates, doc, plan, checks, report)
    else:
        formats = [f for f in doc["formats"] if f not in report.errors]
        replay.check_formats(out, formats, doc, plan, checks, report, collect_errors=True)
    if samples > 0 and not report.errors:
        notes.append(_fresh_samples(out, doc, plan, samples, seed, checks, report, candidates))
    if localize:
        with progress.stage("localize"):
            notes.append(_localize_verified(out, doc, check, candidates, checks.plan.golden_inputs, tolerances,
                                            report))
    return VerifyResult(out, problems, report, notes)


def _localize_verified(out: Path, doc, check, candidates, golden_inputs, tolerances: Tolerances,
                       report: ParityReport) -> str:
    """``verify --localize``: localise every ONNX model checked against the trusted frozen graph."""
    from policy_export.exporter.localize import localize_formats

    if not check.trusted(frozen_graph.FILENAME) or frozen_graph.FILENAME not in {f["path"] for f in doc["files"]}:
        return "localize: not run, the export has no trusted frozen graph to compare with"
    onnx_formats = registry.with_capability("onnx")
    if candidates:
        models = {f.name: Path(candidates[f.name]) for f in onnx_formats if f.name in candidates}
    else:
        models = {f.name: out / f.path for f in onnx_formats if f.name in doc["formats"] and check.trusted(f.path)}
    if not models:
        return "localize: no ONNX model to localise"
    report.localization.extend(localize_formats(out / frozen_graph.FILENAME, models, doc["tensor_names"]["inputs"],
                                                golden_inputs, tolerances))
    return "localize: " + "; ".join(e.get("describe") or f"{e['format']}: {e.get('error')}"
                                    for e in report.localization)


def _check_candidates(candidates: Mapping[str, str | Path] | None, doc: Mapping[str, Any]) -> dict[str, Path]:
    if not candidates:
        return {}
    out = replay.check_candidate_paths(candidates)
    missing = [f for f in out if f not in doc["formats"]]
    if missing:
        raise InputError(f"candidate format(s) {missing} are not formats of the export (it has "
                         f"{', '.join(doc['formats'])}); a candidate stands for one of them")
    return out


def _stored_replay(out: Path, doc: Mapping[str, Any], check: manifest.FileCheck, contract: Contract,
                   tolerances: Tolerances, batch_size: int) -> replay.Replay:
    from policy_export.policy.spaces import space_from_json

    action_space = space_from_json(doc["spaces"]["action"], "$.spaces.action", str(out / manifest.MANIFEST))
    stored = load_plan(out, doc, check, action_space, contract, batch_size)
    return replay.Replay(stored, contract, tolerances, batch_size, stored.exploration, doc["formats"],
                         action_space=action_space)


def _fresh_samples(out: Path, doc: Mapping[str, Any], plan: DevicePlan, samples: int, seed: int,
                   checks: replay.Replay, report: ParityReport, candidates: Mapping[str, Path]) -> str:
    """Compare the formats (or candidates) with the SavedModel (else the frozen graph) on new samples;
    returns a note saying what was compared."""
    references = registry.with_capability("reference", doc["formats"])
    if not references:
        names = ", ".join(f.name for f in registry.with_capability("reference"))
        return f"fresh samples: not compared, the export has no reference format ({names})"
    ref = references[0]
    if candidates:
        others = [replay.Opened(replay.candidate_label(f), registry.get(f), p) for f, p in candidates.items()]
    else:
        others = [replay.Opened(f.name, f, out / f.path) for f in registry.with_capability("signature", doc["formats"])
                  if f is not ref]
    with checks.progress.stage("fresh samples", samples * (1 + len(others))) as task:
        feeds = replay.fresh_feeds(doc, checks.contract, samples, seed, str(out / manifest.MANIFEST))
        replay.check_fresh_samples(feeds, replay.Opened(ref.name, ref, out / ref.path), others, doc, plan, checks,
                                   report, task)
    return f"fresh samples: {samples} new observations (seed {seed}), each format against {ref.name}"


def _check_pin(digest: str | None) -> str | None:
    if digest is None:
        return None
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdefABCDEF" for c in digest)):
        raise InputError(f"expected manifest sha256 must be 64 hexadecimal digits, got {digest!r}")
    return digest.lower()


def _check_tolerance_keys(tolerances: Tolerances, contract: Contract, doc: Mapping[str, Any]) -> None:
    known = set(contract.output_keys) | set(doc["tolerances"].get("per_output", {}))
    unknown = sorted((set(tolerances.per_output) | tolerances.allow_non_finite) - known)
    if unknown:
        raise InputError(f"tolerance given for unknown output(s) {unknown}; outputs are {contract.output_keys}")


def _untrusted_formats(out: Path, doc: Mapping[str, Any], check: manifest.FileCheck, report: ParityReport) -> None:
    """Record in ``report.errors`` every format that is unknown, missing, or has a file that failed its hash."""
    known = registry.paths()
    for name, info in doc["formats"].items():
        if name not in known:
            report.errors[name] = f"unknown format {name!r} in the manifest"
            continue
        fmt = registry.get(name)
        if not all(check.trusted(p) for p in fmt.files(info)):
            report.errors[name] = "not loaded: its files failed the hash check"
        elif not (out / fmt.path).exists():
            report.errors[name] = f"{fmt.path} is missing"


# ---------------------------------------------------------------------------- internals


def _explore_rows(samples: int, explore_samples: int) -> int:
    """How many rows exploration parity runs per runtime (the probe observations times their draws)."""
    m = min(DEFAULT_OBSERVATIONS, samples)
    return m * -(-explore_samples // m)


def _reference_outputs(policy, feeds: Mapping[str, np.ndarray], batch_size: int, run=None) -> dict[str, np.ndarray]:
    """The session's outputs for ``feeds`` (``run``: the session's runner, e.g. one that counts rows)."""
    out = run_batched(run or policy.run, feeds, batch_size)
    if policy.model_io is not None:
        model_in, model_out = policy.model_io
        names = [t.name.split(":")[0] for t in policy.model.inputs]

        out_keys = keras_model.output_keys(len(model_out))

        def run_io(batch):
            values = policy.session.run(list(model_in) + list(model_out),
                                        {policy.inputs[k]: v for k, v in batch.items()})
            ins = {f"{MODEL_IO_PREFIX}{n}": v for n, v in zip(names, values[: len(model_in)])}
            outs = {f"{MODEL_IO_PREFIX}{k}": v for k, v in zip(out_keys, values[len(model_in):])}
            return {**ins, **outs}

        out.update(run_batched(Counted(run_io, run.task) if isinstance(run, Counted) else run_io, feeds, batch_size))
    return out


class _SessionSampler:
    """The policy's session as exploration draws from it: the whole graph, or its action head."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.policy.run(feeds)

    def head(self):
        from policy_export.exporter.tf_runner import tf_head

        return tf_head(self.policy.session, self.policy.inputs, self.policy.outputs)


@dataclass
class _ExploreSetup:
    """The exploration plan, and the session that also scores each format's own samples (export only)."""

    policy: Any
    plan: ExplorationPlan

    @classmethod
    def make(cls, policy, golden_in, contract: Contract, samples: int, batch_size: int, run=None) -> "_ExploreSetup":
        required = {k: v for k, v in golden_in.items() if k in {s.key for s in contract.required_inputs}}
        m = min(DEFAULT_OBSERVATIONS, len(next(iter(required.values()))))
        probe = {k: v[:m] for k, v in required.items()}
        sampler = _SessionSampler(policy)
        if isinstance(run, Counted):  # count its rows on the session's progress bar
            sampler = Counted(sampler, run.task)
        return cls(policy, ExplorationPlan.make(sampler, probe, samples, policy.action_space, batch_size, contract))

    def check(self, fmt: str, runner, tolerances: Tolerances, report: ParityReport) -> None:
        got = self.plan.check(fmt, runner, tolerances, report)
        if self.policy.raw_actions is not None and ACTION_LOGP in got:
            logp, keep = logp_of_given_actions(self.policy, self.plan.feeds, got, self.plan.batch_size,
                                               self.plan.reference.get(ACTION_DIST_INPUTS))
            # float16 Box actions: the session scores the rounded action, the format's logp is of
            # its unrounded sample; the difference that rounding explains is not an error
            allowance = rounding_allowance(self.policy.action_space, got[ACTION_DIST_INPUTS], got)
            actual = within_allowance(logp, got[ACTION_LOGP], allowance).astype(np.asarray(got[ACTION_LOGP]).dtype)
            report.records.append(compare_arrays(f"{fmt} (explore)", "action_logp of its samples", logp[keep],
                                                 actual[keep], tolerances.for_output(ACTION_LOGP),
                                                 allow_non_finite=tolerances.allows_non_finite(ACTION_LOGP)))


def _stepped_plan(policy, contract: Contract, steps: int, sequences: int, seed: int, run=None) -> SteppedPlan:
    """Fixed step sequences and the session's stepped outputs (serving and training-time graphs)."""
    inputs = stepped_inputs(policy, contract, steps, sequences, seed)
    initial = policy.get_initial_state()
    serving = run_stepped(run or policy.run, inputs, initial)
    training = run_training_graph(policy, inputs, policy.sequence_graph_chunk)
    return SteppedPlan(inputs, initial, serving, training)


def load_runner(fmt: str, root: Path, doc: Mapping[str, Any], plan: DevicePlan):
    """A runner (a context manager; ``runner(feeds) -> outputs`` keyed by signature keys) for one
    format of the export at ``root`` whose manifest is ``doc``.

    Raises:
        InputError: no format has that name.
        ExportError: the format has no runner, or its file does not load.
    """
    format_ = registry.get(fmt)
    if not format_.capabilities.signature:
        raise ExportError(f"the {fmt} format does not run the policy's signature")
    return format_.open(root / format_.path, doc, plan)


def _writable(policy, names: Sequence[str], explicit: bool) -> list:
    """The formats of ``names`` that can be written for ``policy``. One that cannot is skipped
    (logged) when the formats were left to the default, and refused when they were named.

    Raises:
        InputError: a named format cannot be written for this policy.
    """
    chosen = []
    for name in names:
        fmt = registry.get(name)
        reason = fmt.skip_reason(policy)
        if reason is None:
            chosen.append(fmt)
        elif explicit:
            raise InputError(f"format {name!r} cannot be written: {reason}; leave it out of the formats")
        else:
            log.info("%s: skipping the %s format", reason, name)
    return chosen


def _write_golden(root: Path, parity_plan: ParityPlan, report: ParityReport) -> None:
    d = root / PARITY_DIR
    d.mkdir()
    write_plan(root, parity_plan)
    (d / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")


def _device_info(plan: DevicePlan) -> dict[str, Any]:
    return plan.to_json()


def _manifest(policy, signature, records: Mapping[str, FormatRecord], opset: int, tolerances: Tolerances,
              report: ParityReport, root: Path) -> dict[str, Any]:
    obs_keys = {leaf.key(OBSERVATIONS): list(leaf.path) for leaf in leaves(policy.observation_space)}
    act_keys = {action_key(i): list(leaf.path) for i, leaf in enumerate(leaves(policy.action_space))}
    return {
        "manifest_version": manifest.MANIFEST_VERSION,
        "name": policy.name,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": manifest.versions(),
        "opset": opset,
        "spaces": {"observation": space_to_json(policy.observation_space),
                   "action": space_to_json(policy.action_space)},
        "keys": {OBSERVATIONS: obs_keys, "actions": act_keys},
        "contract": signature.contract.to_json(),
        "tensor_names": signature.tensor_names(),
        "formats": {name: {"files": list(r.files), **r.details} for name, r in records.items()},
        "tolerances": tolerances.to_json(),
        "parity": {"passed": report.passed, "reference": report.reference, "samples": report.samples,
                   "seed": report.seed, "devices": report.devices,
                   "max_abs_err": {f"{r.format}/{r.key}": r.max_abs_err for r in report.records},
                   "exploration": summarize_exploration(report.exploration)},
        "files": manifest.file_records(root),
    }
