"""The export pipeline: one call writes every format and proves parity.

    from policy_export import export_spec, verify_export
    result = export_spec("fixtures/cartpole_mlp", "out/cartpole")
    result.parity.passed, [r.max_abs_err for r in result.parity.records]

Stages: check the options against the policy and the target (:mod:`exporter.options`), build the
signature, write each format into a staging directory (:mod:`exporter.staging`), run the TF session
on the parity plan's inputs (:mod:`exporter.parity.plan`), replay the plan on every format fresh
from disk (:mod:`exporter.parity.replay`), write the golden files and the manifest, and rename the
staging directory into place only if every check passed.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from pathlib import Path
from typing import Any

from policy_export.errors import ConversionError, ExportError, InputError, ParityFailedError
from policy_export.exporter import formats as registry
from policy_export.exporter import manifest
from policy_export.exporter.devices import plan_devices
from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.options import ExportOptions, check_tolerance_keys, serving_name
from policy_export.exporter.parity import behaviour as behaviour_thresholds
from policy_export.exporter.parity import replay
from policy_export.exporter.parity.references.session import session_plan
from policy_export.exporter.parity.compare import ParityReport, Tolerances, tf32_tolerances
from policy_export.exporter.parity.exploration import summarize as summarize_exploration
from policy_export.exporter.parity.plan import ParityPlan, write_plan
from policy_export.exporter.parity.plan import manifest_record as parity_manifest_record
from policy_export.exporter.progress import SILENT, MemoryTrace, release_memory
from policy_export.exporter.results import PARITY_DIR, ExportResult, disk_errors, remove_written, timed_stage  # noqa: F401
from policy_export.exporter.staging import staged_directory
from policy_export.exporter.watchdog import run_limit
from policy_export.policy.spaces import leaves, space_to_json
from policy_export.signatures.builder import build_signature
from policy_export.signatures.keys import OBSERVATIONS, action_key

log = logging.getLogger(__name__)



def export_policy(policy, out: str | Path, options: ExportOptions | None = None, **keywords: Any) -> ExportResult:
    """Export ``policy`` (a :class:`policy.TFPolicy`) to the directory ``out`` and prove parity.

    The options are an :class:`~exporter.options.ExportOptions` or its fields as keywords:

    - ``formats`` (default: every default format), ``opset``, ``inputs_as_nchw`` (the ONNX model
      takes rank-4 image inputs as NCHW; parity feeds each runtime its own layout),
      ``external_data_threshold`` (ONNX weights above it go to a ``.data`` file beside the model);
    - ``samples`` observations sampled from the observation space with ``seed``, compared with
      the TF session for every format (``tolerances``, run ``batch_size`` rows at a time); with an
      ``explore`` input, sampled actions are compared as distributions over ``explore_samples``
      draws (0 skips that); recurrent policies get stepped parity over ``stepped_steps`` steps;
      lossy formats are held to ``behaviour`` thresholds (format, or ``"*"`` for all -> {name:
      value}; see :mod:`exporter.parity.behaviour`);
    - ``device``, ``overwrite``, ``progress`` (told each stage as it runs; default silent),
      ``run_timeout`` (seconds one call into a runtime may take; default 600), ``source``
      (recorded in the manifest, e.g. what a converted model came from).

    The parity plan that was run is stored in ``parity/`` so that :func:`verify_export` replays
    it. The export is renamed into place only if parity passes.

    Returns:
        ExportResult with the format records, file list, parity report and manifest.
    Raises:
        ParityFailedError: an output differs beyond its tolerance (nothing is written).
        ExportExistsError, ExportBusyError, ExportError, InputError, DeviceError: see their docs.
    """
    opts = ExportOptions.make(options, keywords)
    opts.check_export(policy.observation_space, out)
    with run_limit(opts.run_timeout):
        return run_export(policy, out, opts)


def run_export(policy, out: str | Path, opts: ExportOptions) -> ExportResult:
    """:func:`export_policy` once ``opts`` passed :meth:`ExportOptions.check_export` for ``policy``
    and ``out`` (a pipeline that knows them earlier checks there), under the run limit in force."""
    return _Export(policy, Path(out), opts).run()


class _Export:
    """One run of :func:`export_policy`: the policy, its signature and options, and what each stage made."""

    def __init__(self, policy, out: Path, opts: ExportOptions):
        self.policy, self.out, self.opts = policy, out, opts
        self.progress = MemoryTrace(opts.progress or SILENT)
        self.device = plan_devices(opts.device)
        self.tolerances = tf32_tolerances(opts.tolerances or Tolerances(), self.device)
        self.signature = build_signature(policy)
        if opts.tolerances is not None:
            check_tolerance_keys(opts.tolerances, self.signature.contract.output_keys)
        self.chosen = _writable(policy, opts.formats, opts.explicit_formats)
        self.thresholds = behaviour_thresholds.resolve([f.name for f in self.chosen if f.capabilities.lossy],
                                                       opts.behaviour)
        self.ctx = ExportContext(policy=policy, signature=self.signature, device=self.device, opset=opts.opset,
                                 inputs_as_nchw=opts.inputs_as_nchw,
                                 external_data_threshold=opts.external_data_threshold,
                                 model_name=opts.model_name or serving_name(policy.name),
                                 model_version=opts.model_version)
        self.timings: dict[str, float] = {}
        self.missing: dict[str, str] = {}
        self.recorded = None
        if opts.observations:  # read before anything is written: a file that does not fit is bad input
            from policy_export.exporter.recorded import read_recorded

            with timed_stage(self.timings, "read observations", self.progress):
                self.recorded = read_recorded(opts.observations, policy.observation_space, self.signature.contract,
                                              opts.samples, opts.seed, getattr(policy, "name", None))

    def run(self) -> ExportResult:
        with disk_errors(self.out), staged_directory(self.out, self.opts.overwrite, checked=True) as stage:
            records = self._write_formats(stage)
            start = time.perf_counter()
            plan = session_plan(self.policy, self.signature.contract, self.opts, self.progress, self.recorded)
            report = ParityReport("tf_session", self.opts.samples, self.opts.seed, self.device.to_json())
            info = {k: r.details for k, r in records.items()}
            checks = replay.Replay(plan, self.signature.contract, self.tolerances, self.opts.batch_size,
                                   info, self.progress, action_space=self.policy.action_space,
                                   behaviour=self.thresholds)
            view = {"tensor_names": self.signature.tensor_names(), "contract": self.signature.contract.to_json(),
                    "formats": info}
            replay.check_formats(stage, [f.name for f in self.chosen if f.name in records], view, self.device,
                                 checks, report)
            self.timings["parity"] = time.perf_counter() - start
            with timed_stage(self.timings, "write manifest", self.progress):
                doc = self._write_manifest(stage, records, plan, report)
            if not report.passed:
                self._fail(stage, plan, report)
        return ExportResult(self.out, records, doc["files"], report, doc, self.timings, self.progress.peaks,
                            dict(self.missing))

    def _write_formats(self, stage: Path) -> dict[str, FormatRecord]:
        records: dict[str, FormatRecord] = {}
        if any(f.capabilities.needs_frozen_graph for f in self.chosen):
            with timed_stage(self.timings, "freeze", self.progress):
                self.ctx.frozen_graph_def()
        for fmt in self.chosen:
            log.info("writing %s", fmt.name)
            with timed_stage(self.timings, f"write {fmt.name}", self.progress):
                try:
                    records[fmt.name] = fmt.write(self.ctx, stage / fmt.path)
                except ConversionError as e:
                    # this format cannot be made; the others are still written and proven
                    log.warning("%s: not written: %s", fmt.name, e)
                    self.missing[fmt.name] = str(e)
                    remove_written(stage / fmt.path)
        if not records:
            raise ExportError("no format could be written: " + "; ".join(f"{k}: {v}" for k, v in self.missing.items()))
        self.ctx.release()  # the frozen graph and the converted models hold weights no later stage needs
        release_memory()
        return records

    def _write_manifest(self, stage: Path, records, plan: ParityPlan, report: ParityReport) -> dict[str, Any]:
        (stage / PARITY_DIR).mkdir()
        write_plan(stage, plan)
        (stage / PARITY_DIR / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n",
                                                       encoding="utf-8")
        doc = _manifest(self.policy, self.signature, records, self.opts.opset, self.tolerances, report)
        doc["parity"]["plan"] = parity_manifest_record(plan)
        if plan.recorded is not None:
            doc["parity"]["recorded"] = plan.recorded.record
        if self.thresholds:
            doc["behaviour"] = behaviour_thresholds.to_json(self.thresholds)
            doc["parity"]["behaviour"] = behaviour_thresholds.summarize(report.behaviour)
        if self.opts.source:
            doc["source"] = {k: v for k, v in self.opts.source.items() if k != "contract"}
            # what the source adds to the I/O contract (an RLlib checkpoint's filter and action meaning)
            doc["contract"].update(self.opts.source.get("contract") or {})
        if self.missing:
            doc["missing"] = dict(self.missing)
        if getattr(self.policy, "explore_refused", None):
            doc["explore_refused"] = self.policy.explore_refused
        if getattr(self.policy, "unused_inputs", None):
            doc["unused_inputs"] = list(self.policy.unused_inputs)  # left out: no output reads them
        doc["files"] = manifest.file_records(stage)  # hashed once, with everything in place
        manifest.write_manifest(stage, doc)
        return doc

    def _fail(self, stage: Path, plan: ParityPlan, report: ParityReport) -> None:
        with self.progress.stage("localize"):
            self._localize(stage, plan, report)
        where = [e["describe"] for e in report.localization if e.get("describe")]
        raise ParityFailedError("parity failed, nothing was written: " + "; ".join(r.describe() for r in report.failures())
                                + ("; " + "; ".join(where) if where else ""), report)

    def _localize(self, stage: Path, plan: ParityPlan, report: ParityReport) -> None:
        """For each ONNX format that failed, the first intermediate tensor where it leaves the frozen
        graph (:mod:`exporter.parity.localize`), added to ``report.localization``."""
        from policy_export.exporter.parity.localize import localize_formats

        failed = {r.format.split(" ")[0] for r in report.failures() if hasattr(r, "format")} | set(report.errors)
        models = {f.name: stage / f.path for f in registry.with_capability("onnx", [f.name for f in self.chosen])
                  if f.name in failed}
        if not models:
            return
        frozen = stage / registry.localisation_graph().path
        if not frozen.is_file():
            frozen = stage / ".localize_frozen_graph.pb"  # the staging directory is removed on failure
            frozen.write_bytes(self.ctx.frozen_graph_def().SerializeToString())
        report.localization.extend(localize_formats(frozen, models, self.signature.tensor_names()["inputs"],
                                                    plan.golden_inputs, self.tolerances))


def _writable(policy, names, explicit: bool) -> list:
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


def _manifest(policy, signature, records, opset: int, tolerances: Tolerances, report: ParityReport) -> dict[str, Any]:
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
        "files": [],
    }
