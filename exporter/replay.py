"""Run formats, or candidate model files, against a parity plan and record every comparison.

``export`` and ``verify`` share this: each format (or candidate) is loaded once, runs the golden
inputs, the exploration probes and the stepped sequences of the :class:`~exporter.plan.ParityPlan`,
and is compared with the session's stored outputs. A candidate is a model file transformed
downstream of an export (an optimised ``model.onnx``, say); it is checked like the format it
stands for, loaded with the same checks (``onnx.checker`` before ONNX Runtime, the SavedModel op
checks of :mod:`exporter.trust`), without touching the export.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter import manifest
from policy_export.exporter.parity import ParityReport, Tolerances, compare, run_batched, sample_inputs
from policy_export.exporter.plan import ParityPlan
from policy_export.policy.errors import ExportError, InputError
from policy_export.signatures.contract import Contract

MODEL_IO_PREFIX = "base_model/"
# formats with a runner over the policy's signature (the Keras files hold the base model alone)
RUNNABLE = ("saved_model", "frozen_graph", "onnx", "onnx_deterministic")


def open_runner(fmt: str, path: Path, tensor_names: Mapping[str, Any], device):
    """A runner (``runner(feeds) -> outputs``, keyed by signature keys) over the model at ``path``.

    The file is checked before any runtime loads it: ``onnx.checker`` for ONNX, the op checks of
    :mod:`exporter.trust` for a SavedModel or a frozen graph.

    Raises:
        ExportError: the format has no runner, or the model does not load or fails its checks.
    """
    if fmt == "saved_model":
        from policy_export.exporter.saved_model import SavedModelRunner

        return SavedModelRunner(path, device)
    if fmt == "frozen_graph":
        from policy_export.exporter.frozen_graph import FrozenGraphRunner

        return FrozenGraphRunner(path, tensor_names, device)
    if fmt in ("onnx", "onnx_deterministic"):
        from policy_export.exporter.onnx_model import OnnxRunner

        return OnnxRunner(path, device)
    raise ExportError(f"no runner for format {fmt!r}")


def close(runner) -> None:
    getattr(runner, "close", lambda: None)()


@dataclass
class Replay:
    """What each format is checked against: the plan, the contract, the tolerances.

    ``explore`` runs the exploration part: the plan's :class:`~exporter.plan.ExplorationPlan`, or
    at export an object that also scores each format's samples in the session.
    """

    plan: ParityPlan
    contract: Contract
    tolerances: Tolerances
    batch_size: int
    explore: Any = None
    formats_info: Mapping[str, Any] = field(default_factory=dict)

    def output_keys(self, fmt: str) -> list[str]:
        """The outputs a format has: all of the contract's, but for the deterministic model, its own."""
        keys = self.contract.output_keys
        own = (self.formats_info.get(fmt) or {}).get("outputs")
        return [k for k in keys if k in own] if fmt == "onnx_deterministic" and own else list(keys)

    def check_runner(self, label: str, fmt: str, runner, report: ParityReport) -> None:
        """Golden outputs, exploration (formats that sample) and stepped parity for one runner."""
        keys = self.output_keys(fmt)
        got = run_batched(runner, self.plan.golden_inputs, self.batch_size)
        report.records.extend(compare(label, self.plan.golden_outputs, got, self.tolerances, keys, self.contract))
        if self.explore is not None and fmt != "onnx_deterministic":
            self.explore.check(label, runner, self.tolerances, report)
        if self.plan.stepped is not None:
            self.plan.stepped.check(label, runner, self.tolerances, report, keys)

    def check_keras(self, root: Path, report: ParityReport) -> None:
        """The Keras files on the base model's golden inputs and outputs."""
        from policy_export.exporter import keras_model

        golden = self.plan.golden_outputs
        out_prefix = f"{MODEL_IO_PREFIX}{keras_model.MODEL_OUTPUT}"
        ins = {k[len(MODEL_IO_PREFIX):]: v for k, v in golden.items()
               if k.startswith(MODEL_IO_PREFIX) and not k.startswith(out_prefix)}
        reference = {k[len(MODEL_IO_PREFIX):]: v for k, v in golden.items() if k.startswith(out_prefix)}
        if not reference:
            return
        for fmt, runner in keras_model.load(root, (self.formats_info.get("keras") or {}).get("outputs")).items():
            got = run_batched(runner, ins, self.batch_size)
            report.records.extend(compare(fmt, reference, got, self.tolerances))


def check_formats(root: Path, formats: Sequence[str], tensor_names: Mapping[str, Any], device, replay: Replay,
                  report: ParityReport, collect_errors: bool = False,
                  loader: Callable[..., Any] | None = None) -> None:
    """Check each format of the export at ``root`` against ``replay``; with ``collect_errors``
    whatever breaks a format is recorded in ``report.errors`` instead of raised."""
    load = loader or (lambda fmt: open_runner(fmt, root / manifest.FORMAT_PATHS[fmt], tensor_names, device))
    for fmt in formats:
        _guarded(fmt, report, collect_errors, lambda fmt=fmt: _check_one(fmt, fmt, load, root, replay, report))


def check_candidates(candidates: Mapping[str, Path], tensor_names: Mapping[str, Any], device, replay: Replay,
                     report: ParityReport) -> None:
    """Check each candidate model file (format -> path) against ``replay``, as ``<format> candidate``."""
    for fmt, path in candidates.items():
        label = candidate_label(fmt)
        load = (lambda _fmt, path=path, fmt=fmt: open_runner(fmt, path, tensor_names, device))
        _guarded(label, report, True, lambda fmt=fmt, label=label, load=load: _check_one(
            label, fmt, load, None, replay, report))


def candidate_label(fmt: str) -> str:
    return f"{fmt} candidate"


def _check_one(label: str, fmt: str, load, root: Path | None, replay: Replay, report: ParityReport) -> None:
    if fmt == "keras":
        replay.check_keras(root, report)
        return
    runner = load(fmt)
    try:
        if fmt == "onnx" or (fmt == "onnx_deterministic" and "onnxruntime_providers_used" not in report.devices):
            report.devices["onnxruntime_providers_used"] = list(runner.providers)
        replay.check_runner(label, fmt, runner, report)
    finally:
        close(runner)


def _guarded(label: str, report: ParityReport, collect_errors: bool, run: Callable[[], None]) -> None:
    try:
        run()
    except Exception as e:  # in verify, whatever breaks a format is that format's failure
        if not collect_errors:
            raise
        report.errors[label] = str(e) if isinstance(e, ExportError) else f"{type(e).__name__}: {e}"


def check_fresh_samples(feeds: Mapping[str, np.ndarray], reference: tuple[str, Callable[[], Any]],
                        others: Mapping[str, tuple[str, Callable[[], Any]]], replay: Replay,
                        report: ParityReport) -> None:
    """Run ``feeds`` through the reference runner and each other runner (label -> (format, opener))
    and compare; a runner that cannot be loaded or run is recorded in ``report.errors``."""
    ref_label, open_reference = reference
    runner = open_reference()
    try:
        expected = run_batched(runner, feeds, replay.batch_size)
    finally:
        close(runner)
    for label, (fmt, opener) in others.items():
        def run(label=label, fmt=fmt, opener=opener):
            other = opener()
            try:
                got = run_batched(other, feeds, replay.batch_size)
            finally:
                close(other)
            report.records.extend(compare(f"{label} vs {ref_label}", expected, got, replay.tolerances,
                                          replay.output_keys(fmt), replay.contract))
        _guarded(f"{label} vs {ref_label}", report, True, run)


def fresh_feeds(doc: Mapping[str, Any], contract: Contract, samples: int, seed: int, where: str) -> dict[str, np.ndarray]:
    """``samples`` new inputs drawn from the export's recorded spaces."""
    from policy_export.policy.spaces import check_sample_budget, space_from_json

    obs_space = space_from_json(doc["spaces"]["observation"], "$.spaces.observation", where)
    act_space = space_from_json(doc["spaces"]["action"], "$.spaces.action", where)
    check_sample_budget(samples, obs_space, "samples")
    return sample_inputs(obs_space, act_space, contract, samples, seed)


def parse_candidates(items: Sequence[str]) -> dict[str, Path]:
    """``FORMAT=PATH`` items as a format -> path mapping, each path checked to exist.

    Raises:
        InputError: a malformed item, a format without a runner, a format given twice, or a
            path that does not exist (or is not a SavedModel directory, for ``saved_model``).
    """
    out: dict[str, Path] = {}
    for item in items:
        fmt, sep, path = item.partition("=")
        if not sep or not fmt or not path:
            raise InputError(f"--candidate {item!r}: expected FORMAT=PATH, e.g. onnx=model.opt.onnx")
        if fmt not in RUNNABLE:
            raise InputError(f"--candidate {item!r}: format {fmt!r} cannot be a candidate; "
                             f"choose one of {', '.join(RUNNABLE)}")
        if fmt in out:
            raise InputError(f"--candidate {item!r}: format {fmt!r} is given twice")
        out[fmt] = Path(path)
    return check_candidate_paths(out)


def check_candidate_paths(candidates: Mapping[str, str | Path]) -> dict[str, Path]:
    """The candidates with their paths checked to exist (a SavedModel directory, or a file).

    Raises:
        InputError: a path does not exist or is the wrong kind, or a format has no runner.
    """
    out = {}
    for fmt, path in candidates.items():
        path = Path(path)
        if fmt not in RUNNABLE:
            raise InputError(f"candidate format {fmt!r} has no runner; choose one of {', '.join(RUNNABLE)}")
        if fmt == "saved_model":
            if not (path / "saved_model.pb").is_file():
                raise InputError(f"candidate {fmt}={path}: not a SavedModel directory (no saved_model.pb)")
        elif not path.is_file():
            raise InputError(f"candidate {fmt}={path}: no such file")
        out[fmt] = path
    return out
