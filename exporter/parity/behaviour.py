"""Behavioural parity for lossy formats (quantised, float16): does the format still act like the policy?

Bitwise or tolerance parity is the wrong test for a quantised model. A lossy format (capability
``lossy``) is run on the same golden inputs (and, for recurrent policies, the same stepped
sequences, feeding back its own state) and compared with the session's outputs:

- every output gets its error statistics (max, mean and 99th-percentile absolute error; for
  integer and bool outputs the share of identical rows), recorded, not judged;
- each action output gets a judged metric: for discrete leaves (Discrete, MultiDiscrete,
  MultiBinary) the **agreement**, the share of rows whose action is identical to the session's;
  for Box leaves the **Box error**, the mean absolute error of the action as a fraction of the
  action range ``high - low`` (per component; where a bound is infinite, the range the session's
  own actions span on the golden inputs, or the component's magnitude, at least 1, where they hold
  it constant), with the max and 99th percentile recorded beside it.

The thresholds (:class:`Thresholds`: ``min_agreement``, default 0.99; ``max_box_error``, default
0.02) sit in the manifest (``behaviour``, one entry per lossy format) and are overridable per
format; an export that misses them is not written, and ``verify`` checks them again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import InputError
from policy_export.policy.spaces import leaves
from policy_export.signatures.keys import action_key, is_action

DEFAULT_MIN_AGREEMENT = 0.99
DEFAULT_MAX_BOX_ERROR = 0.02
ALL = "*"  # an override for every lossy format


@dataclass(frozen=True)
class Thresholds:
    """What a lossy format must achieve: the share of identical discrete actions, and the mean
    Box action error as a fraction of the action range."""

    min_agreement: float = DEFAULT_MIN_AGREEMENT
    max_box_error: float = DEFAULT_MAX_BOX_ERROR

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InputError(f"behaviour {f.name} must be a finite number >= 0, got {value!r}")
        if self.min_agreement > 1:
            raise InputError(f"behaviour min_agreement must be at most 1, got {self.min_agreement!r}")

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, where: str = "behaviour") -> "Thresholds":
        names = {f.name for f in fields(cls)}
        if not isinstance(obj, Mapping) or set(obj) - names:
            raise InputError(f"{where}: expected an object with {sorted(names)}, got {obj!r}")
        return cls(**dict(obj))


def parse_override(text: str) -> tuple[str, str, float]:
    """``FORMAT:NAME=VALUE`` (or ``NAME=VALUE`` for every lossy format) as (format, name, value).

    Raises:
        InputError: malformed, or an unknown threshold name or a value that is not a number.
    """
    fmt, sep, rest = text.rpartition(":")
    if not sep:
        fmt, rest = ALL, text
    name, eq, value = rest.partition("=")
    names = [f.name for f in fields(Thresholds)]
    if not eq or not fmt or name not in names:
        raise InputError(f"--behaviour {text!r}: expected [FORMAT:]NAME=VALUE with NAME one of {', '.join(names)}")
    try:
        number = float(value)
    except ValueError:
        raise InputError(f"--behaviour {text!r}: {value!r} is not a number") from None
    return fmt, name, number


def resolve(lossy_formats: Sequence[str], overrides: Mapping[str, Mapping[str, float]] | None,
            base: Mapping[str, Thresholds] | None = None) -> dict[str, Thresholds]:
    """Each lossy format's thresholds: ``base`` (e.g. the manifest's) or the defaults, then the
    overrides (format -> {name: value}; ``"*"`` applies to every lossy format).

    Raises:
        InputError: an override names a format that is not one of ``lossy_formats``, or a bad value.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(lossy_formats) - {ALL})
    if unknown:
        raise InputError(f"behaviour thresholds given for {unknown}, which are not lossy formats of this export "
                         f"(lossy formats: {', '.join(lossy_formats) or 'none'})")
    out = {}
    for fmt in lossy_formats:
        values = (base or {}).get(fmt, Thresholds()).to_json()
        for scope in (ALL, fmt):
            for name, value in (overrides.get(scope) or {}).items():
                if name not in values:
                    raise InputError(f"unknown behaviour threshold {name!r}; choose {', '.join(values)}")
                values[name] = value
        out[fmt] = Thresholds(**values)
    return out


def to_json(thresholds: Mapping[str, Thresholds]) -> dict[str, dict[str, float]]:
    return {fmt: t.to_json() for fmt, t in thresholds.items()}


def from_manifest(doc: Mapping[str, Any]) -> dict[str, Thresholds]:
    """The thresholds the manifest records (``behaviour``), by format.

    Raises:
        InputError: the section is malformed.
    """
    section = doc.get("behaviour") or {}
    if not isinstance(section, Mapping):
        raise InputError("manifest behaviour: expected an object of format -> thresholds")
    return {fmt: Thresholds.from_json(v, f"manifest behaviour.{fmt}") for fmt, v in section.items()}


@dataclass(frozen=True)
class BehaviourCheck:
    """One output of one lossy format against the session. ``metric`` is ``agreement`` or
    ``box_error`` (judged against ``threshold``) for actions, ``error`` (recorded only) otherwise."""

    format: str
    key: str
    metric: str
    value: float
    threshold: float | None
    passed: bool
    samples: int
    max_abs_err: float = 0.0
    mean_abs_err: float = 0.0
    p99_abs_err: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        if self.metric == "agreement":
            what = (f"{self.value:.2%} of {self.samples} actions identical to {self.extra.get('against', 'the session')}'s "
                    f"(at least {self.threshold:.2%} required)")
        elif self.metric == "box_error":
            what = (f"mean action error {self.value:.3%} of the action range over {self.samples} rows, "
                    f"p99 {self.extra.get('p99_fraction', 0):.3%}, max {self.extra.get('max_fraction', 0):.3%} "
                    f"(at most {self.threshold:.3%} required)")
        elif self.metric == "problem":
            what = str(self.extra.get("problem", "cannot be compared"))
        else:
            what = (f"max abs err {self.max_abs_err:.3g}, mean {self.mean_abs_err:.3g}, p99 {self.p99_abs_err:.3g} "
                    "(recorded)")
        return f"{self.format}/{self.key}: {what}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _errors(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float]:
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64)).ravel()
    diff = np.where(np.isnan(diff), math.inf, diff)
    if not diff.size:
        return 0.0, 0.0, 0.0
    return float(diff.max()), float(diff.mean()), float(np.percentile(diff, 99, method="higher"))


def _action_ranges(space: gym.spaces.Box, ref: np.ndarray) -> np.ndarray:
    """The range of each component: ``high - low``, or where a bound is infinite the span of the
    reference's own actions (where they are constant, their magnitude, at least 1)."""
    low, high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
    bounded = np.broadcast_to(high - low, ref.shape[1:])
    flat = ref.astype(np.float64)
    observed = (flat.max(axis=0) - flat.min(axis=0)) if len(ref) else np.ones(ref.shape[1:])
    # a component the reference holds constant spans nothing: its own magnitude (at least 1) instead
    magnitude = np.maximum(np.abs(flat).max(axis=0), 1.0) if len(ref) else np.ones(ref.shape[1:])
    ranges = np.where(np.isfinite(bounded), bounded, np.where(observed > 0, observed, magnitude))
    return np.maximum(ranges, np.finfo(np.float64).tiny)


def compare_behaviour(label: str, reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray],
                      keys: Sequence[str], action_space: gym.Space | None, thresholds: Thresholds,
                      stepped: bool = False, judged: Mapping[str, Any] | None = None) -> list[BehaviourCheck]:
    """The behavioural records of one format: every output's error statistics, and the judged
    agreement or Box error of each action output. Arrays are ``[rows, ...]``, or with ``stepped``
    ``[steps, sequences, ...]`` (every step of every sequence is then a row).

    ``judged`` (output -> its gymnasium space, or ``"identical"`` for an action judged by
    agreement) names the action outputs where they are not the action space's ``actions_<i>``
    (a policy exported elsewhere); a Box without finite bounds is judged on the range the
    reference's own actions span."""
    if judged is not None:
        spaces = dict(judged)
    else:
        spaces = {action_key(i): leaf.space for i, leaf in enumerate(leaves(action_space))} if action_space else {}
    out = []
    for key in keys:
        if key not in reference:
            continue
        ref = np.asarray(reference[key])
        got = actual.get(key)
        problem = ("the output is missing" if got is None
                   else f"shape {list(np.shape(got))}, the reference is {list(ref.shape)}" if np.shape(got) != ref.shape
                   else f"dtype {np.asarray(got).dtype.name}, the reference is {ref.dtype.name}"
                   if np.asarray(got).dtype != ref.dtype else "")
        if problem:
            out.append(BehaviourCheck(label, key, "problem", math.inf, None, False, int(ref.size),
                                      math.inf, math.inf, math.inf, {"problem": problem}))
            continue
        got = np.asarray(got)
        space = spaces.get(key) if is_action(key) or judged is not None else None
        lead = 2 if stepped else 1  # [steps, sequences, ...] -> every step of every sequence is a row
        ref_rows = ref.reshape(-1, *ref.shape[lead:]) if ref.ndim >= lead else ref.reshape(1)
        got_rows = got.reshape(-1, *got.shape[lead:]) if got.ndim >= lead else got.reshape(1)
        max_abs, mean_abs, p99 = _errors(ref, got)
        rows = len(ref_rows)
        if space is None:
            out.append(BehaviourCheck(label, key, "error", mean_abs, None, True, rows, max_abs, mean_abs, p99))
        elif isinstance(space, gym.spaces.Box):
            ranges = _action_ranges(space, ref_rows)
            frac = np.abs(got_rows.astype(np.float64) - ref_rows.astype(np.float64)) / ranges
            frac = np.where(np.isnan(frac), math.inf, frac).ravel()
            value = float(frac.mean()) if frac.size else 0.0
            extra = {"max_fraction": float(frac.max()) if frac.size else 0.0,
                     "p99_fraction": float(np.percentile(frac, 99, method="higher")) if frac.size else 0.0,
                     "range": float(np.min(ranges)) if np.size(ranges) else 0.0}
            out.append(BehaviourCheck(label, key, "box_error", value, thresholds.max_box_error,
                                      value <= thresholds.max_box_error, rows, max_abs, mean_abs, p99, extra))
        else:
            same = np.all(got_rows.reshape(rows, -1) == ref_rows.reshape(rows, -1), axis=1)
            value = float(same.mean()) if rows else 1.0
            out.append(BehaviourCheck(label, key, "agreement", value, thresholds.min_agreement,
                                      value >= thresholds.min_agreement, rows, max_abs, mean_abs, p99,
                                      {"differing": int(rows - same.sum())}))
    return out


def summarize(checks: Sequence[BehaviourCheck]) -> dict[str, Any]:
    """The manifest's summary: per format label and action, the judged value and threshold."""
    return {f"{c.format}/{c.key}": {"metric": c.metric, "value": c.value, "threshold": c.threshold,
                                    "passed": c.passed}
            for c in checks if c.metric != "error"}
