"""Parity: run formats on the same inputs as the TF session and compare every output.

Comparison returns data (:class:`ParityReport`, one :class:`OutputParity` per format and
output); :attr:`ParityReport.passed` decides. An output must have the reference's (and
the contract's) dtype and shape; float outputs pass when ``|a - b| <= atol + rtol * |b|``
element-wise (b the reference) and hold no NaN or infinity unless the output allows them
(:attr:`Tolerances.allow_non_finite`); integer and bool outputs must be identical. Float records
carry the max, mean and 99th-percentile absolute error.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np

from policy_export.errors import InputError
from policy_export.policy.spaces import leaf_dtype, leaves

if TYPE_CHECKING:
    from policy_export.signatures.contract import Contract

from policy_export.exporter.defaults import (  # noqa: E402,F401 (re-exported)
    DEFAULT_ATOL, DEFAULT_BATCH, DEFAULT_RTOL, DEFAULT_SAMPLES,
)
from policy_export.signatures.keys import OBSERVATIONS, PREV_ACTION, SEQ_LENS
LARGE_BOUND = 1e6  # float Box bounds beyond this are sampled as unbounded (see sampling_space)

Runner = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Tolerance:
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL

    def __post_init__(self) -> None:
        for name, value in (("atol", self.atol), ("rtol", self.rtol)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InputError(f"{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> "Tolerance":
        """``"ATOL"`` or ``"ATOL:RTOL"``."""
        parts = text.split(":")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise InputError(f"tolerance {text!r}: expected ATOL or ATOL:RTOL as numbers") from None
        if len(values) not in (1, 2) or any(not math.isfinite(v) or v < 0 for v in values):
            raise InputError(f"tolerance {text!r}: expected ATOL or ATOL:RTOL, non-negative and finite")
        return cls(values[0], values[1] if len(values) == 2 else DEFAULT_RTOL)


@dataclass
class Tolerances:
    """The default tolerance and per-output overrides."""

    default: Tolerance = field(default_factory=Tolerance)
    per_output: dict[str, Tolerance] = field(default_factory=dict)
    allow_non_finite: frozenset[str] = frozenset()  # outputs that may hold NaN or infinity

    def for_output(self, key: str) -> Tolerance:
        return self.per_output.get(key, self.default)

    def allows_non_finite(self, key: str) -> bool:
        """Whether output ``key`` may hold NaN or infinite values (they must then match the reference's)."""
        return key in self.allow_non_finite

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"default": asdict(self.default),
                               "per_output": {k: asdict(v) for k, v in self.per_output.items()}}
        if self.allow_non_finite:
            out["allow_non_finite"] = sorted(self.allow_non_finite)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "Tolerances":
        allowed = obj.get("allow_non_finite", [])
        if not (isinstance(allowed, list) and all(isinstance(k, str) for k in allowed)):
            raise InputError(f"tolerances.allow_non_finite: expected a list of output keys, got {allowed!r}")
        return cls(Tolerance(**obj["default"]), {k: Tolerance(**v) for k, v in obj.get("per_output", {}).items()},
                   frozenset(allowed))


@dataclass(frozen=True)
class OutputParity:
    """How one format's output compares with the reference."""

    format: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    exact: bool
    max_abs_err: float
    max_rel_err: float
    atol: float
    rtol: float
    mismatches: int
    min_atol_to_pass: float
    passed: bool
    worst_step: int | None = None  # stepped parity: the step with the largest error
    mean_abs_err: float = 0.0
    p99_abs_err: float = 0.0  # the 99th percentile of the element-wise absolute error
    non_finite: int = 0  # NaN and infinite values, counted over the output and its reference
    problem: str = ""  # why the output could not be compared value by value (dtype, shape, NaN...)
    first_divergence: str = ""  # a recording's replay: the first row out of tolerance (its episode and step)

    def describe(self) -> str:
        step = f" (largest at step {self.worst_step})" if self.worst_step is not None else ""
        if self.first_divergence:
            step += f"; first diverging at {self.first_divergence}"
        if self.problem:
            return f"{self.format}/{self.key}: {self.problem}"
        if self.exact:
            return (f"{self.format}/{self.key}: {self.mismatches} of {int(np.prod(self.shape))} values differ{step} "
                    "(exact match required)")
        return (f"{self.format}/{self.key}: max abs err {self.max_abs_err:.3g}{step}, mean {self.mean_abs_err:.3g}, "
                f"p99 {self.p99_abs_err:.3g}, max rel err {self.max_rel_err:.3g}; "
                f"tolerance atol={self.atol:g} rtol={self.rtol:g}; would pass with atol >= {self.min_atol_to_pass:.3g}")


@dataclass
class ParityReport:
    """Per-format, per-output comparison records and the conditions of the run."""

    reference: str
    samples: int
    seed: int
    devices: dict[str, Any]
    records: list[OutputParity] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # format -> why it could not be run
    exploration: list[Any] = field(default_factory=list)  # exploration.ExplorationCheck
    localization: list[dict[str, Any]] = field(default_factory=list)  # localize.Localization.to_json()
    behaviour: list[Any] = field(default_factory=list)  # behaviour.BehaviourCheck (lossy formats)
    recorded: dict[str, Any] | None = None  # the user's recorded observations: files, rows, bounds
    seconds: dict[str, float] = field(default_factory=dict)  # label -> seconds its load and checks took

    @property
    def passed(self) -> bool:
        return (not self.errors and all(r.passed for r in self.records) and all(c.passed for c in self.exploration)
                and all(c.passed for c in self.behaviour))

    def failures(self) -> list[Any]:
        """Every failed record: :class:`OutputParity`, exploration and behaviour checks alike (``describe()``)."""
        return ([r for r in self.records if not r.passed] + [c for c in self.exploration if not c.passed]
                + [c for c in self.behaviour if not c.passed])

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "samples": self.samples, "seed": self.seed,
                "devices": self.devices, "passed": self.passed, "errors": dict(self.errors),
                "records": [_record_json(r) for r in self.records],
                "exploration": [c.to_json() for c in self.exploration],
                "behaviour": [c.to_json() for c in self.behaviour],
                "localization": list(self.localization), "recorded": self.recorded,
                "on_recorded": recorded_summary(self), "seconds": {k: round(v, 6) for k, v in self.seconds.items()}}


def _record_json(record: OutputParity) -> dict[str, Any]:
    out = {**asdict(record), "shape": list(record.shape)}
    if not out["first_divergence"]:
        del out["first_divergence"]  # only a recording's replay names one
    return out


RECORDED = " (recorded)"
_RECORDED_GROUP = re.compile(r" \(recorded(?: (stepped \d+))?\)$")


def _recorded_entry(out: dict[str, Any], label: str, key: str) -> tuple[dict[str, Any], str] | None:
    """The summary's entry of a record labelled ``label`` and the name its output is shown by
    (``<output> (stepped <n>)`` for the recorded episodes stepped); None outside the recorded group."""
    match = _RECORDED_GROUP.search(label)
    if match is None:
        return None
    entry = out.setdefault(label[:match.start()], {"passed": True, "outputs": {}})
    return entry, (f"{key} ({match.group(1)})" if match.group(1) else key)


def recorded_summary(report: "ParityReport") -> dict[str, Any] | None:
    """The recorded group alone ("on your data", apart from "on the space"): per format, the worst
    error per output and whether it passed (the recorded episodes stepped as outputs
    ``<output> (stepped <n>)``); None without recorded rows."""
    out: dict[str, Any] = {}
    for r in report.records:
        found = _recorded_entry(out, r.format, r.key)
        if found:
            found[0]["outputs"][found[1]] = {"max_abs_err": r.max_abs_err, "atol": r.atol, "rtol": r.rtol,
                                             "passed": r.passed}
            found[0]["passed"] = found[0]["passed"] and r.passed
    for c in report.behaviour:
        found = _recorded_entry(out, getattr(c, "format", ""), c.key)
        if found:
            found[0]["outputs"][found[1]] = {"metric": c.metric, "value": c.value, "threshold": c.threshold,
                                             "passed": c.passed}
            found[0]["passed"] = found[0]["passed"] and c.passed
    return out or None


def sampling_space(space: gym.Space) -> gym.Space:
    """The space a leaf is sampled from: itself, except that a float Box bound beyond
    ``+-LARGE_BOUND`` counts as unbounded on that side. Gymnasium then samples that component from
    a standard normal (both sides unbounded) or as the finite bound plus or minus a standard
    exponential (one side), instead of uniformly over a range like RLlib's +-3.4e38."""
    if not isinstance(space, gym.spaces.Box) or not np.issubdtype(space.dtype, np.floating):
        return space
    low, high = space.low.astype(np.float64), space.high.astype(np.float64)
    if not np.any(np.isfinite(low) & (low < -LARGE_BOUND)) and not np.any(np.isfinite(high) & (high > LARGE_BOUND)):
        return space
    low = np.where(low < -LARGE_BOUND, -np.inf, low).astype(space.dtype)
    high = np.where(high > LARGE_BOUND, np.inf, high).astype(space.dtype)
    return gym.spaces.Box(low, high, space.shape, space.dtype)


def sample_observations(space: gym.Space, n: int, seed: int, prefix: str = OBSERVATIONS) -> dict[str, np.ndarray]:
    """``n`` observations drawn with gymnasium's sampler (seeded) from each leaf's
    :func:`sampling_space`, split into leaf arrays by key."""
    out: dict[str, np.ndarray] = {}
    for i, leaf in enumerate(leaves(space)):
        sub = sampling_space(leaf.space)
        sub.seed(seed + i)
        values = np.stack([np.asarray(sub.sample()) for _ in range(n)]).astype(leaf_dtype(leaf.space))
        if sub is not leaf.space:
            values = np.clip(values, leaf.space.low, leaf.space.high)
        out[leaf.key(prefix)] = values
    return out


def sample_inputs(observation_space, action_space, contract: "Contract", n: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` rows of every required input: observations from the space; ``prev_action`` from the
    action space; ``seq_lens`` of 1 (one-step calls); states and rewards standard normal; other
    required inputs zero (integers), standard normal (floats) or random flags, three in four true
    (booleans: an action mask allows most actions, and now and then none)."""
    feeds = sample_observations(observation_space, n, seed)
    feeds = {k: v for k, v in feeds.items() if k in contract.input_keys}
    rng = np.random.default_rng(seed)
    if PREV_ACTION in contract.input_keys:
        feeds[PREV_ACTION] = next(iter(sample_observations(action_space, n, seed + 1).values()))
    if SEQ_LENS in contract.input_keys:
        feeds[SEQ_LENS] = np.ones(n, np.dtype(contract.input(SEQ_LENS).dtype))
    for spec in contract.required_inputs:
        if spec.key in feeds:
            continue
        shape = (n, *(1 if d is None else d for d in spec.shape[1:]))
        dtype = np.dtype(spec.dtype)
        if np.issubdtype(dtype, np.floating):
            feeds[spec.key] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[spec.key] = rng.random(shape) < 0.75
        else:
            feeds[spec.key] = np.zeros(shape, dtype)
    return feeds


def run_batched(runner: Runner, feeds: Mapping[str, np.ndarray], batch_size: int = DEFAULT_BATCH,
                scalars: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Run ``runner`` over ``feeds`` (batch-major arrays) in chunks and concatenate the outputs."""
    n = len(next(iter(feeds.values())))
    chunks: list[dict[str, np.ndarray]] = []
    for start in range(0, n, batch_size):
        batch = {k: v[start:start + batch_size] for k, v in feeds.items()}
        batch.update(scalars or {})
        chunks.append(runner(batch))
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def compare(format_name: str, reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray],
            tolerances: Tolerances, keys: Sequence[str] | None = None,
            contract: "Contract | None" = None) -> list[OutputParity]:
    """One :class:`OutputParity` per key (default: every reference key). A missing output fails;
    with ``contract``, so does an output whose dtype or shape the contract does not allow."""
    records = []
    for key in keys if keys is not None else list(reference):
        ref = np.asarray(reference[key])
        tol = tolerances.for_output(key)
        if key not in actual:
            records.append(_failed(format_name, key, ref, tol, "the output is missing"))
            continue
        spec = _output_spec(contract, key)
        records.append(compare_arrays(format_name, key, ref, np.asarray(actual[key]), tol,
                                      allow_non_finite=tolerances.allows_non_finite(key), spec=spec))
    return records


def _output_spec(contract: "Contract | None", key: str):
    if contract is None or key not in contract.output_keys:
        return None
    return contract.output(key)


def _failed(format_name: str, key: str, ref: np.ndarray, tol: Tolerance, problem: str) -> OutputParity:
    exact = not np.issubdtype(ref.dtype, np.floating)
    return OutputParity(format_name, key, ref.dtype.name, ref.shape, exact, math.inf, math.inf,
                        tol.atol, tol.rtol, int(ref.size), math.inf, False, problem=problem)


def contract_problem(spec, got: np.ndarray) -> str:
    """Why ``got`` does not fit the output ``spec`` (a contract ``TensorSpec``), or ``""``."""
    if spec is None:
        return ""
    if got.dtype != np.dtype(spec.dtype):
        return f"dtype {got.dtype.name}, the contract says {spec.dtype}"
    if len(got.shape) != len(spec.shape) or any(d is not None and d != s for d, s in zip(spec.shape, got.shape)):
        return f"shape {list(got.shape)}, the contract says {spec.shape_text()}"
    return ""


def layout_record(format_name: str, key: str, ref: np.ndarray, got: np.ndarray | None, tolerances: Tolerances,
                  contract: "Contract | None" = None) -> OutputParity | None:
    """A failed record when ``got`` is missing or its dtype or shape is not the reference's or
    the contract's (for outputs compared as samples, not value by value); else None."""
    ref = np.asarray(ref)
    problem = "the output is missing" if got is None else _layout_problem(ref, np.asarray(got),
                                                                         _output_spec(contract, key))
    return _failed(format_name, key, ref, tolerances.for_output(key), problem) if problem else None


def _layout_problem(ref: np.ndarray, got: np.ndarray, spec) -> str:
    if got.dtype != ref.dtype:
        return f"dtype {got.dtype.name}, the reference is {ref.dtype.name}"
    if got.shape != ref.shape:
        return f"shape {list(got.shape)}, the reference is {list(ref.shape)}"
    return contract_problem(spec, got)


def compare_arrays(format_name: str, key: str, ref: np.ndarray, got: np.ndarray, tol: Tolerance,
                   allow_non_finite: bool = False, spec=None) -> OutputParity:
    """Compare one output: exactly for integer/bool dtypes, by ``atol``/``rtol`` for floats.

    Fails, with the reason in ``problem``, when the dtype or shape differs from the reference's
    (or from the contract's ``spec``), and, unless ``allow_non_finite``, when either side holds a
    NaN or an infinity.
    """
    ref, got = np.asarray(ref), np.asarray(got)
    problem = _layout_problem(ref, got, spec)
    if problem:
        return _failed(format_name, key, ref, tol, problem)
    if not np.issubdtype(ref.dtype, np.floating):
        return _compare_exact(format_name, key, ref, got)
    return _compare_float(format_name, key, ref, got, tol, allow_non_finite)


def _compare_exact(format_name: str, key: str, ref: np.ndarray, got: np.ndarray) -> OutputParity:
    """Integer and bool outputs: every value must be identical, whatever the values."""
    differ = got != ref
    mismatches = int(np.count_nonzero(differ))
    # the size of each difference (at least 1 where values differ, even where float64 rounds them together)
    diff = np.where(differ, np.maximum(np.abs(got.astype(np.float64) - ref.astype(np.float64)), 1.0), 0.0)
    max_abs = float(diff.max()) if diff.size else 0.0
    return OutputParity(format_name, key, ref.dtype.name, ref.shape, True, max_abs, max_abs,
                        0.0, 0.0, mismatches, max_abs, mismatches == 0,
                        mean_abs_err=float(diff.mean()) if diff.size else 0.0,
                        p99_abs_err=float(np.percentile(diff, 99, method="higher")) if diff.size else 0.0)


def _compare_float(format_name: str, key: str, ref: np.ndarray, got: np.ndarray, tol: Tolerance,
                   allow_non_finite: bool) -> OutputParity:
    a, b = got.astype(np.float64), ref.astype(np.float64)
    non_finite = int(np.count_nonzero(~np.isfinite(a)) + np.count_nonzero(~np.isfinite(b)))
    both_nan = np.isnan(a) & np.isnan(b)
    same_inf = np.isinf(a) & (a == b)
    diff = np.where(both_nan | same_inf, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), math.inf, diff)
    rel = diff / np.maximum(np.abs(b), np.finfo(np.float64).tiny)
    rel = np.where(diff == 0, 0.0, rel)
    allowed = tol.atol + tol.rtol * np.abs(np.where(np.isfinite(b), b, 0.0))
    bad = diff > allowed
    problem = ""
    if non_finite and not allow_non_finite:
        problem = (f"{non_finite} NaN or infinite value(s) across the output and its reference; "
                   "the output does not allow them")
        bad = bad | ~np.isfinite(a) | ~np.isfinite(b)
    # smallest atol (with this rtol) under which every element passes
    need = np.maximum(diff - tol.rtol * np.abs(np.where(np.isfinite(b), b, 0.0)), 0.0)
    return OutputParity(
        format_name, key, ref.dtype.name, ref.shape, False,
        float(diff.max()) if diff.size else 0.0, float(rel.max()) if rel.size else 0.0,
        tol.atol, tol.rtol, int(np.count_nonzero(bad)),
        float(need.max()) if need.size else 0.0, not bool(bad.any()),
        mean_abs_err=float(diff.mean()) if diff.size else 0.0,
        p99_abs_err=float(np.percentile(diff, 99, method="higher")) if diff.size else 0.0,
        non_finite=non_finite, problem=problem,
    )


def tf32_tolerances(tolerances: Tolerances, plan) -> Tolerances:
    """``tolerances`` with the default raised to at least :data:`exporter.devices.TF32_TOLERANCE`
    where TF32 is allowed and a GPU computes (per-output tolerances stay as given); unchanged
    otherwise. ``plan`` is the :class:`exporter.devices.DevicePlan`."""
    from policy_export.exporter.devices import TF32_TOLERANCE

    if not plan.tf32_active:
        return tolerances
    default = Tolerance(max(tolerances.default.atol, TF32_TOLERANCE), max(tolerances.default.rtol, TF32_TOLERANCE))
    return dataclasses.replace(tolerances, default=default)
