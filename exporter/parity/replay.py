"""Run formats, or candidate model files, against a parity plan and record every comparison.

``export`` and ``verify`` share this: each format (or candidate) is opened once through its plugin
(:mod:`exporter.formats`), replays each group of the :class:`~exporter.parity.plan.ParityPlan`
(:mod:`exporter.parity.groups`: golden, recorded, exploration, stepped, reference) as its
capabilities allow, is compared with the reference's stored outputs, and is closed. A candidate is a model file transformed downstream of
an export (an optimised ``model.onnx``, say); it is checked like the format it stands for, opened
with the same checks (``onnx.checker`` before ONNX Runtime, the SavedModel op checks of
:mod:`exporter.trust`), without touching the export.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter import formats as registry
from policy_export.exporter.formats import Format
from policy_export.exporter.parity.compare import ParityReport, Tolerances, compare, run_batched, sample_inputs
from policy_export.exporter.parity.plan import ParityPlan
from policy_export.exporter.progress import SILENT, Counted, Progress, Task
from policy_export.errors import InputError, PolicyExportError
from policy_export.signatures.contract import Contract



@dataclass
class Replay:
    """What each format is checked against: the plan (its groups), the contract, the tolerances.

    ``progress`` is told each format's check as a stage (``parity <format>``), with a bar over the
    rows it runs. ``action_space`` and ``behaviour`` (lossy format -> behaviour.Thresholds) are what
    a lossy format's actions are judged by.
    """

    plan: ParityPlan
    contract: Contract
    tolerances: Tolerances
    batch_size: int
    formats_info: Mapping[str, Any] = field(default_factory=dict)
    progress: Progress = SILENT
    action_space: Any = None  # lossy formats: what their actions are judged by
    behaviour: Mapping[str, Any] = field(default_factory=dict)  # lossy format -> behaviour.Thresholds
    _task: Task | None = field(default=None, init=False, repr=False)

    @contextlib.contextmanager
    def stage(self, label: str, fmt: Format) -> Iterator[Task]:
        """The check of ``fmt`` (as ``label``) as a progress stage; runners :meth:`counted` meanwhile
        advance its bar."""
        with self.progress.stage(f"parity {label}", self.rows(fmt)) as task:
            self._task = task
            try:
                yield task
            finally:
                self._task = None

    def rows(self, fmt: Format) -> int | None:
        """The rows :meth:`check_runner` runs through ``fmt`` (None for formats checked otherwise)."""
        if not fmt.capabilities.signature:
            return None
        return sum(group.rows(fmt) for group in self.plan.replayed(fmt.capabilities.lossy))

    def counted(self, runner):
        """``runner``, advancing the current stage's bar by the rows of each call."""
        return runner if self._task is None else Counted(runner, self._task)

    def output_keys(self, fmt: Format) -> list[str]:
        """The contract outputs ``fmt`` computes."""
        return fmt.output_keys(self.contract, self.formats_info.get(fmt.name))

    def check_outputs(self, label: str, runner, inputs: Mapping[str, np.ndarray],
                      reference: Mapping[str, np.ndarray], report: ParityReport) -> None:
        """Run ``runner`` on ``inputs`` (in batches) and compare its outputs with ``reference``
        under the plan's tolerances (a format checked on other inputs than the signature's, such
        as the Keras base model)."""
        got = run_batched(runner, inputs, self.batch_size)
        report.records.extend(compare(label, reference, got, self.tolerances))

    def check_runner(self, label: str, fmt: Format, runner, report: ParityReport) -> None:
        """Every group of the plan on one runner, in the order the format replays them
        (:func:`exporter.parity.groups.replay_order`)."""
        runner = self.counted(runner)
        for group in self.plan.replayed(fmt.capabilities.lossy):
            group.check(label, fmt, runner, self, report)

    def thresholds(self, fmt: Format):
        from policy_export.exporter.parity.behaviour import Thresholds

        return self.behaviour.get(fmt.name) or Thresholds()


def check_formats(root: Path, names: Sequence[str], manifest: Mapping[str, Any], device, replay: Replay,
                  report: ParityReport, collect_errors: bool = False) -> None:
    """Check each format of the export at ``root`` against ``replay``; with ``collect_errors``
    whatever breaks a format is recorded in ``report.errors`` instead of raised."""
    for name in names:
        fmt = registry.get(name)
        with replay.stage(name, fmt):
            _guarded(name, report, collect_errors,
                     lambda fmt=fmt: fmt.check(fmt.name, root / fmt.path, manifest, device, replay, report))


def check_candidates(candidates: Mapping[str, Path], manifest: Mapping[str, Any], device, replay: Replay,
                     report: ParityReport) -> None:
    """Check each candidate model file (format -> path) against ``replay``, as ``<format> candidate``."""
    for name, path in candidates.items():
        fmt, label = registry.get(name), candidate_label(name)
        with replay.stage(label, fmt):
            _guarded(label, report, True,
                     lambda fmt=fmt, label=label, path=path: fmt.check(label, path, manifest, device, replay, report))


def candidate_label(fmt: str) -> str:
    return f"{fmt} candidate"


MAX_ERROR_TEXT = 2000


def _guarded(label: str, report: ParityReport, collect_errors: bool, run: Callable[[], None]) -> None:
    start = time.perf_counter()
    try:
        run()
    except model_errors() as e:  # in verify, what a model file makes its runtime raise is that format's failure
        if not collect_errors:
            raise
        text = str(e) if isinstance(e, PolicyExportError) else f"{type(e).__name__}: {e}"
        # a runtime may repeat a model's own (hostile, huge) names in its message
        report.errors[label] = text if len(text) <= MAX_ERROR_TEXT else f"{text[:MAX_ERROR_TEXT]}... ({len(text) - MAX_ERROR_TEXT} more characters)"
    finally:  # the format's load and checks, for the reports (JUnit's time)
        report.seconds[label] = report.seconds.get(label, 0.0) + time.perf_counter() - start


def model_errors() -> tuple[type[BaseException], ...]:
    """The errors a model file can make its runtime raise (loading or running it): the package's
    own refusals, the runtimes' errors (TensorFlow's ``OpError``, ONNX Runtime's, the ONNX checker's,
    protobuf's ``DecodeError``) and the builtin errors runtimes raise for bad models
    (``RuntimeError``, ``ValueError``, ``OSError``, ``MemoryError``). Anything else escaping a
    format's check (a ``TypeError``, a ``KeyError``...) is a bug in the package: it is not
    recorded as the format's failure but raised (exit code 3)."""
    import sys

    from google.protobuf.message import DecodeError

    errors: list[type[BaseException]] = [PolicyExportError, RuntimeError, ValueError, OSError, MemoryError, DecodeError]
    if "tensorflow" in sys.modules:
        errors.append(sys.modules["tensorflow"].errors.OpError)
    if "onnxruntime" in sys.modules:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

        errors += [e for e in vars(ort_state).values() if isinstance(e, type) and issubclass(e, Exception)]
    if "onnx" in sys.modules:
        errors.append(sys.modules["onnx"].checker.ValidationError)
    return tuple(errors)


@dataclass(frozen=True)
class Opened:
    """A model to open later: its label in reports, its format and its path."""

    label: str
    fmt: Format
    path: Path


def check_fresh_samples(feeds: Mapping[str, np.ndarray], reference: Opened, others: Sequence[Opened],
                        manifest: Mapping[str, Any], device, replay: Replay, report: ParityReport,
                        task: Task | None = None) -> None:
    """Run ``feeds`` through the reference and each other model and compare; a model that cannot
    be opened or run is recorded in ``report.errors``. ``task`` (a progress stage) is advanced by
    the rows run. Each comparison is labelled ``<model> vs <reference>``."""
    def counted(runner):
        return runner if task is None else Counted(runner, task)

    with reference.fmt.open(reference.path, manifest, device) as runner:
        expected = run_batched(counted(runner), feeds, replay.batch_size)
    for other in others:
        def run(other=other):
            with other.fmt.open(other.path, manifest, device) as runner:
                got = run_batched(counted(runner), feeds, replay.batch_size)
            if other.fmt.capabilities.lossy:
                from policy_export.exporter.parity.behaviour import compare_behaviour

                report.behaviour.extend(compare_behaviour(
                    f"{other.label} vs {reference.label}", expected, got, replay.output_keys(other.fmt),
                    replay.action_space, replay.thresholds(other.fmt)))
                return
            report.records.extend(compare(f"{other.label} vs {reference.label}", expected, got,
                                          replay.tolerances, replay.output_keys(other.fmt), replay.contract))
        _guarded(f"{other.label} vs {reference.label}", report, True, run)


def fresh_feeds(doc: Mapping[str, Any], contract: Contract, samples: int, seed: int, where: str) -> dict[str, np.ndarray]:
    """``samples`` new inputs drawn from the export's recorded spaces."""
    from policy_export.policy.spaces import check_sample_budget, space_from_json

    obs_space = space_from_json(doc["spaces"]["observation"], "$.spaces.observation", where)
    act_space = space_from_json(doc["spaces"]["action"], "$.spaces.action", where)
    check_sample_budget(samples, obs_space, "samples")
    return sample_inputs(obs_space, act_space, contract, samples, seed)


def runnable_names() -> list[str]:
    """Formats that run the policy's signature: what candidates and rollouts may name."""
    return [f.name for f in registry.with_capability("signature")]


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
        if fmt not in runnable_names():
            raise InputError(f"--candidate {item!r}: format {fmt!r} cannot be a candidate; "
                             f"choose one of {', '.join(runnable_names())}")
        if fmt in out:
            raise InputError(f"--candidate {item!r}: format {fmt!r} is given twice")
        out[fmt] = Path(path)
    return check_candidate_paths(out)


def check_candidate_paths(candidates: Mapping[str, str | Path]) -> dict[str, Path]:
    """The candidates with their paths checked to exist (a directory or a file, as the format keeps it).

    Raises:
        InputError: a path does not exist or is the wrong kind, or a format has no runner.
    """
    out = {}
    for name, path in candidates.items():
        path = Path(path)
        if name not in runnable_names():
            raise InputError(f"candidate format {name!r} has no runner; choose one of {', '.join(runnable_names())}")
        registry.get(name).check_candidate(path)
        out[name] = path
    return out
