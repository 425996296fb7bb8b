"""The verify pipeline: check an export's files, then replay its stored parity plan on every
format (or on candidate files standing for them) fresh from disk.

    from policy_export import verify_export
    verify_export("out/cartpole").passed
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_export.errors import ExportError, InputError, ParityFailedError
from policy_export.exporter import formats as registry
from policy_export.exporter import manifest
from policy_export.exporter.defaults import DEFAULT_SAMPLES
from policy_export.exporter.devices import DevicePlan, plan_devices
from policy_export.exporter.options import VerifyOptions, check_tolerance_keys
from policy_export.exporter.parity import behaviour as behaviour_thresholds
from policy_export.exporter.parity import replay
from policy_export.exporter.parity.compare import ParityReport, Tolerances, tf32_tolerances
from policy_export.exporter.parity.plan import GOLDEN_INPUTS, GOLDEN_OUTPUTS, golden_planned, load_plan
from policy_export.exporter.progress import SILENT
from policy_export.exporter.watchdog import run_limit
from policy_export.signatures.contract import Contract



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


def verify_export(out: str | Path, options: VerifyOptions | None = None, *, manifest_doc: Mapping[str, Any] | None = None,
                  signature_inside: str | None = None, **keywords: Any) -> VerifyResult:
    """Check an export: file hashes, then replay its stored parity plan on every format fresh from disk.

    The options are a :class:`~exporter.options.VerifyOptions` or its fields as keywords;
    ``manifest_doc`` is the export's manifest already read with :func:`exporter.manifest.read_manifest`
    (it is not read again). ``signature_inside``: the name of the signature being checked with
    the export when it lies at its top (``model.sig``, :func:`exporter.signing.inside_export`),
    the one file the manifest does not list that is not an extra file.

    The plan (see :mod:`exporter.parity.plan`) is the golden inputs and outputs, the session's
    exploration draws and, for recurrent policies, the stepped sequences with the session's
    per-step outputs. A format or plan file whose files failed the hash check (changed, missing,
    extra, or not a regular file) is never loaded; with ``expect_manifest_sha256`` (the manifest's
    digest kept elsewhere) a manifest with another digest fails and nothing is loaded. With
    ``samples > 0``, also draws that many new observations (``seed``) and compares each format with
    the SavedModel (or the frozen graph, in an export without one) on them.

    ``candidates`` (format -> model path, e.g. ``{"onnx": "model.opt.onnx"}``) checks those files
    against the export's plan instead of the export's own formats; the export is only read.
    ``tolerances`` and ``behaviour`` override the manifest's (lossy formats are re-checked against
    the thresholds). ``localize``: for each ONNX model checked, compare every intermediate tensor
    it shares with the export's frozen graph on the golden inputs and name the first that diverges
    (``report.localization``; see :mod:`exporter.parity.localize`). ``progress`` is told each stage
    as it runs; ``run_timeout``: seconds one call into a runtime may take (default 600): a format
    or candidate that takes longer is stopped and fails with :class:`~errors.RunTimeoutError`.
    ``server="triton"`` also serves the export with a real Triton server (the ``serve`` extra) on
    free ports of 127.0.0.1 and replays the plan through its HTTP and gRPC clients
    (:mod:`exporter.serve.check`), a report row per protocol and output.

    Raises:
        ExportError: ``out`` is not an export.
        InputError: a bad option, a tolerance naming an unknown output, or a candidate whose format
            is not one of the export's (unless its runner needs the contract alone, as
            ``openvino``'s does) or whose path does not exist.
    """
    opts = VerifyOptions.make(options, keywords)
    with run_limit(opts.run_timeout):
        return _Verify(Path(out), opts, manifest_doc, signature_inside).run()


class _Verify:
    """One run of :func:`verify_export`: the export's manifest (read once), its file check, and the report."""

    def __init__(self, out: Path, opts: VerifyOptions, doc: Mapping[str, Any] | None = None,
                 signature_inside: str | None = None):
        self.out, self.opts, self.signature_inside = out, opts, signature_inside
        self.progress = opts.progress or SILENT
        self.doc = manifest.read_manifest(out) if doc is None else doc
        self.candidates = _check_candidates(opts.candidates, self.doc)
        if not self.candidates:  # every format of the export is run: each needs its library
            for name in self.doc["formats"]:
                if name in registry.names():
                    registry.get(name).check_installed()
        self.device = plan_devices(opts.device)
        self.tolerances = tf32_tolerances(opts.tolerances or Tolerances.from_json(self.doc["tolerances"]), self.device)
        self.contract = Contract.from_json(self.doc["contract"])
        check_tolerance_keys(self.tolerances, self.contract.output_keys, self.doc["tolerances"].get("per_output", {}))
        lossy = [f for f in self.doc["formats"] if f in registry.names() and registry.get(f).capabilities.lossy]
        self.thresholds = behaviour_thresholds.resolve(lossy, opts.behaviour,
                                                       behaviour_thresholds.from_manifest(self.doc))
        self.report = ParityReport("golden_outputs", 0, opts.seed, self.device.to_json())

    def run(self) -> VerifyResult:
        start = time.perf_counter()
        with self.progress.stage("check files"):
            check = manifest.check_files(self.out, self.doc, registry.paths(), self.signature_inside)
        self.report.seconds["files"] = time.perf_counter() - start  # the sha256 check, for the reports
        problems = list(check.problems)
        pin = self.opts.expect_manifest_sha256
        if pin is not None:
            digest = manifest.manifest_sha256(self.out)
            if digest != pin:  # the manifest itself is not the one pinned: trust none of it
                problems.insert(0, f"changed file {manifest.MANIFEST} (sha256 {digest} is not the expected {pin}); "
                                   "nothing was loaded")
                return VerifyResult(self.out, problems, self.report)
        _untrusted_formats(self.out, self.doc, check, self.report)
        if golden_planned(self.doc) and not all(check.trusted(g) for g in (GOLDEN_INPUTS, GOLDEN_OUTPUTS)):
            self.report.errors["parity"] = "golden files not loaded: they failed the hash check"
            return VerifyResult(self.out, problems, self.report)
        try:
            with self.progress.stage("load plan"):
                checks = self._stored_replay(check)
        except ExportError as e:
            self.report.errors["parity"] = f"the parity plan cannot be used: {e}"
            return VerifyResult(self.out, problems, self.report)
        return VerifyResult(self.out, problems, self.report, self._replay(check, checks))

    def _stored_replay(self, check: manifest.FileCheck) -> replay.Replay:
        from policy_export.policy.spaces import space_from_json

        spaces = self.doc.get("spaces")  # none in the export of a policy exported elsewhere (its recording instead)
        action_space = space_from_json(spaces["action"], "$.spaces.action", str(self.out / manifest.MANIFEST)) \
            if spaces else None
        stored = load_plan(self.out, self.doc, check, action_space, self.contract, self.opts.batch_size)
        checks = replay.Replay(stored, self.contract, self.tolerances, self.opts.batch_size, self.doc["formats"],
                               action_space=action_space)
        checks.behaviour, checks.progress = self.thresholds, self.progress
        return checks

    def _replay(self, check: manifest.FileCheck, checks: replay.Replay) -> list[str]:
        report = self.report
        report.samples = checks.plan.rows
        if not golden_planned(self.doc):
            report.reference = "the stored recording"
        notes: list[str] = []
        if self.candidates:
            notes.append("candidates: " + ", ".join(f"{f}={p}" for f, p in self.candidates.items())
                         + " (the export's own formats are not run)")
            replay.check_candidates(self.candidates, self.doc, self.device, checks, report)
        else:
            formats = [f for f in self.doc["formats"] if f not in report.errors]
            replay.check_formats(self.out, formats, self.doc, self.device, checks, report, collect_errors=True)
        if self.opts.server is not None:
            from policy_export.exporter.serve.check import check_server

            notes += check_server(self.out, self.doc, self.opts.server, checks, report, self.device)
        if self.opts.samples > 0 and not report.errors:
            notes.append(self._fresh_samples(checks))
        if self.opts.observations and not report.errors:
            notes.append(self._fresh_samples(checks, recorded=True))
        if self.opts.localize:
            with self.progress.stage("localize"):
                notes.append(self._localize(check, checks.plan.golden_inputs))
        return checks.plan.describe() + notes  # described once replayed: a group says how it ran

    def _localize(self, check: manifest.FileCheck, golden_inputs) -> str:
        """``verify --localize``: localise every ONNX model checked against the trusted frozen graph."""
        from policy_export.exporter.parity.localize import localize_formats

        frozen = registry.localisation_graph().path
        if not check.trusted(frozen) or frozen not in {f["path"] for f in self.doc["files"]}:
            return "localize: not run, the export has no trusted frozen graph to compare with"
        onnx_formats = registry.with_capability("onnx")
        if self.candidates:
            models = {f.name: Path(self.candidates[f.name]) for f in onnx_formats if f.name in self.candidates}
        else:
            models = {f.name: self.out / f.path for f in onnx_formats
                      if f.name in self.doc["formats"] and check.trusted(f.path)}
        if not models:
            return "localize: no ONNX model to localise"
        self.report.localization.extend(localize_formats(self.out / frozen, models,
                                                         self.doc["tensor_names"]["inputs"], golden_inputs,
                                                         self.tolerances))
        return "localize: " + "; ".join(e.get("describe") or f"{e['format']}: {e.get('error')}"
                                        for e in self.report.localization)

    def _fresh_samples(self, checks: replay.Replay, recorded: bool = False) -> str:
        """Compare the formats (or candidates) with the SavedModel (else the frozen graph) on new
        samples, or on the rows of ``--observations`` (``recorded``); returns a note saying what
        was compared."""
        doc, samples, seed = self.doc, self.opts.samples, self.opts.seed
        references = registry.with_capability("reference", doc["formats"])
        if not references:
            names = ", ".join(f.name for f in registry.with_capability("reference"))
            return f"fresh samples: not compared, the export has no reference format ({names})"
        ref = references[0]
        if self.candidates:
            others = [replay.Opened(replay.candidate_label(f), registry.get(f), p) for f, p in self.candidates.items()]
        else:
            others = [replay.Opened(f.name, f, self.out / f.path)
                      for f in registry.with_capability("signature", doc["formats"]) if f is not ref]
        if recorded:
            from policy_export.exporter.recorded import read_recorded
            from policy_export.policy.spaces import space_from_json

            space = space_from_json(doc["spaces"]["observation"], "$.spaces.observation", str(self.out))
            rows = read_recorded(self.opts.observations, space, checks.contract, DEFAULT_SAMPLES, seed)
            feeds, samples = rows.inputs, rows.rows
        with checks.progress.stage("recorded" if recorded else "fresh samples", samples * (1 + len(others))) as task:
            if not recorded:
                feeds = replay.fresh_feeds(doc, checks.contract, samples, seed, str(self.out / manifest.MANIFEST))
            label = f"{ref.name} (recorded)" if recorded else ref.name  # "onnx vs saved_model (recorded)"
            replay.check_fresh_samples(feeds, replay.Opened(label, ref, self.out / ref.path), others, doc,
                                       self.device, checks, self.report, task)
        if recorded:
            self.report.recorded = rows.record
            return (f"recorded: {samples} rows of {', '.join(str(p) for p in self.opts.observations)} "
                    f"({rows.record['out_of_bounds']} outside the space's bounds), each format vs {ref.name}")
        return f"fresh samples: {samples} new observations (seed {seed}), each format vs {ref.name}"


def _check_candidates(candidates: Mapping[str, str | Path] | None, doc: Mapping[str, Any]) -> dict[str, Path]:
    if not candidates:
        return {}
    out = replay.check_candidate_paths(candidates)
    for name in out:
        registry.get(name).check_installed()
    missing = [f for f in out if f not in doc["formats"]
               and not registry.get(f).candidate_without_export]
    if missing:
        raise InputError(f"candidate format(s) {missing} are not formats of the export (it has "
                         f"{', '.join(doc['formats'])}); a candidate stands for one of them")
    return out


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
