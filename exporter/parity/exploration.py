"""Exploration parity: sampled actions compared as distributions, not sample by sample.

Runtimes seed their random ops differently, so with ``explore`` on no two runtimes return the
same samples. Instead a few observations are each repeated many times, every runtime samples
actions for them, and per observation and action component a two-sample test asks whether the
two sets of samples come from one distribution:

- discrete components (Discrete, MultiDiscrete, MultiBinary): chi-square test of homogeneity on
  the category counts, as ``scipy.stats.chi2_contingency`` computes it: Pearson's statistic,
  with Yates' continuity correction for a 2x2 table (one degree of freedom) and none for larger
  tables;
- continuous components (Box): two-sample Kolmogorov-Smirnov test, the p-value from the limiting
  Kolmogorov distribution (``scipy.special.kolmogorov``), with the difference of means and of
  standard deviations reported beside it.

p-values come from ``scipy.special`` (importing ``scipy.stats`` alone would cost 1.8 s per export).

A test passes when its p-value is at least ``alpha / number_of_tests`` (Bonferroni), so the whole
family has a false-failure rate of at most ``alpha`` (default 1e-6: a pipeline that verifies
every build must not flake). ONNX Runtime's random ops are seeded; TensorFlow's follow the seeds
the graph was built with, so the session's and the SavedModel's p-values vary between runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.exporter.parity.compare import Runner, run_batched
from policy_export.policy.spaces import leaves

from policy_export.exporter.defaults import (  # noqa: E402,F401 (re-exported)
    DEFAULT_ALPHA, DEFAULT_EXPLORE_SAMPLES, DEFAULT_OBSERVATIONS,
)
from policy_export.signatures.keys import ACTION_DIST_INPUTS, ACTION_LOGP, EXPLORE, action_key


@dataclass(frozen=True)
class ExplorationCheck:
    """One two-sample test between the reference's and a format's sampled actions."""

    format: str
    key: str  # e.g. "actions_0[obs 2, component 1]"
    test: str
    statistic: float
    p_value: float
    threshold: float
    samples: int
    mean_diff: float
    std_diff: float
    passed: bool
    drawn_by: str = ""  # how the format drew its samples (see draw): "head" or "network"

    def describe(self) -> str:
        return (f"{self.format}/{self.key}: {self.test} p={self.p_value:.3g} < threshold {self.threshold:.3g} "
                f"over {self.samples} samples per runtime (mean diff {self.mean_diff:.3g}, std diff {self.std_diff:.3g})")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def repeated_observations(feeds: Mapping[str, np.ndarray], observations: int, samples: int) -> dict[str, np.ndarray]:
    """The first ``observations`` rows of ``feeds``, each repeated so the total is ``samples``."""
    per = math.ceil(samples / observations)
    return {k: np.repeat(v[:observations], per, axis=0) for k, v in feeds.items()}


def sample_actions(runner: Runner, feeds: Mapping[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
    """Run ``runner`` with ``explore`` on."""
    return run_batched(runner, feeds, batch_size, scalars={EXPLORE: np.array(True)})


HEAD_BATCH = 8192  # rows per call of an action head (no network: cheap at any model size)


def draw(runner, probe: Mapping[str, np.ndarray], per: int, batch_size: int) -> tuple[dict[str, np.ndarray], str]:
    """``per`` sampled actions for each probe row (row-major, as :func:`repeated_observations`
    lays them out), and how they were drawn: ``"head"`` or ``"network"``.

    The network is deterministic given its inputs, so running it on a probe observation repeated
    ``per`` times computes one distribution ``per`` times. The runtime's network therefore runs
    once per probe (twice, to see that it is deterministic), and its own action head (its
    sampling ops, cut at ``action_dist_inputs``: :meth:`Runner.head`) draws all samples from that:
    the same samples a full run would give, at a cost that does not grow with the network. A
    runtime without a head, a network that is not deterministic, or a head that needs other inputs
    draws through the whole model instead."""
    from policy_export.exporter.formats.runner import HeadUnavailable

    head = runner.head() if hasattr(runner, "head") else None
    if head is not None:
        feeds = {**probe, EXPLORE: np.array(True)}
        first, second = runner(feeds), runner(feeds)
        dist = first.get(ACTION_DIST_INPUTS)
        if dist is not None and np.array_equal(dist, second.get(ACTION_DIST_INPUTS), equal_nan=True):
            repeated = np.repeat(dist, per, axis=0)
            try:
                out = run_batched(head, {ACTION_DIST_INPUTS: repeated}, HEAD_BATCH, scalars={EXPLORE: np.array(True)})
            except HeadUnavailable:
                pass
            else:
                out[ACTION_DIST_INPUTS] = repeated
                return out, "head"
    rows = len(next(iter(probe.values())))
    return sample_actions(runner, repeated_observations(probe, rows, rows * per), batch_size), "network"


def compare_samples(format_name: str, action_space: gym.Space, observations: int,
                    reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray],
                    alpha: float = DEFAULT_ALPHA, drawn_by: str = "") -> list[ExplorationCheck]:
    """Two-sample tests per observation and action component (see the module docstring)."""
    pending = []
    for i, leaf in enumerate(leaves(action_space)):
        key = action_key(i)
        ref = np.asarray(reference[key]).reshape(observations, -1, *np.shape(reference[key])[1:])
        got = np.asarray(actual[key]).reshape(observations, -1, *np.shape(actual[key])[1:])
        discrete = not isinstance(leaf.space, gym.spaces.Box)
        for obs in range(observations):
            a = ref[obs].reshape(ref.shape[1], -1)
            b = got[obs].reshape(got.shape[1], -1)
            for c in range(a.shape[1]):
                name = f"{key}[obs {obs}" + (f", component {c}]" if a.shape[1] > 1 else "]")
                pending.append((name, discrete, a[:, c], b[:, c]))

    threshold = alpha / max(len(pending), 1)
    checks = []
    for name, discrete, a, b in pending:
        if discrete:
            test = "chi-square homogeneity"
            statistic, p_value = chi_square_homogeneity(a, b)
        else:
            test = "two-sample Kolmogorov-Smirnov"
            statistic, p_value = ks_two_sample(a, b)
        checks.append(ExplorationCheck(
            format_name, name, test, statistic, p_value, threshold, len(a),
            float(abs(np.mean(a) - np.mean(b))), float(abs(np.std(a) - np.std(b))), p_value >= threshold, drawn_by,
        ))
    return checks


def chi_square_homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Pearson's chi-square test that two samples of categories share one distribution."""
    from scipy.special import chdtrc

    categories = np.union1d(a, b)
    if len(categories) < 2:
        return 0.0, 1.0  # both runtimes always chose the same single category
    table = np.array([[np.count_nonzero(a == c) for c in categories],
                      [np.count_nonzero(b == c) for c in categories]], dtype=np.float64)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    if table.shape == (2, 2):  # Yates' correction, as chi2_contingency applies for one degree of freedom
        diff = np.maximum(np.abs(table - expected) - 0.5, 0.0)
    else:
        diff = np.abs(table - expected)
    statistic = float(np.sum(diff**2 / expected))
    return statistic, float(chdtrc(len(categories) - 1, statistic))


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic and its asymptotic p-value."""
    from scipy.special import kolmogorov

    a, b = np.sort(a.astype(np.float64)), np.sort(b.astype(np.float64))
    points = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, points, side="right") / len(a)
    cdf_b = np.searchsorted(b, points, side="right") / len(b)
    statistic = float(np.max(np.abs(cdf_a - cdf_b)))
    en = len(a) * len(b) / (len(a) + len(b))
    return statistic, float(min(1.0, kolmogorov(np.sqrt(en) * statistic)))


def given_action_feeds(policy, actions: Mapping[str, np.ndarray]) -> tuple[dict, np.ndarray]:
    """Feeds that make the session score ``actions`` (a format's samples) and the rows usable.

    The session is fed each action at the sampled-action tensor before post-processing. Rows where
    a Box action sits on a bound are left out: clipping lost the unclipped value there.
    """
    feeds = {}
    keep = None
    for i, (tensor, leaf) in enumerate(zip(policy.raw_actions, leaves(policy.action_space))):
        value = np.asarray(actions[action_key(i)])
        rows = np.ones(len(value), bool)
        if isinstance(leaf.space, gym.spaces.Box):
            flat = value.reshape(len(value), -1)
            low = np.broadcast_to(leaf.space.low, leaf.space.shape).reshape(-1)
            high = np.broadcast_to(leaf.space.high, leaf.space.shape).reshape(-1)
            rows = ~np.any((flat <= low) | (flat >= high), axis=1)
        keep = rows if keep is None else keep & rows
        shape = [len(value)] + [d for d in tensor.shape.as_list()[1:]]
        feeds[tensor] = value.reshape([-1 if d is None else d for d in shape]).astype(tensor.dtype.as_numpy_dtype)
    return feeds, keep


def logp_of_given_actions(policy, obs_feeds, actions: Mapping[str, np.ndarray],
                          batch_size: int, dist_inputs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The session's ``action_logp`` for a format's sampled ``actions``, and the row mask used.

    With ``dist_inputs`` (the session's own, one row per action), the session is fed those at its
    ``action_dist_inputs`` tensor instead of running the network on ``obs_feeds``; when the
    log-probability needs more than that, the network runs after all. ``obs_feeds``: the
    observations (a mapping, or a callable making it, called only when the network runs)."""
    import tensorflow as tf

    feeds_all, keep = given_action_feeds(policy, actions)
    if dist_inputs is not None and ACTION_DIST_INPUTS in policy.outputs:
        try:
            return _score(policy, {policy.outputs[ACTION_DIST_INPUTS]: dist_inputs}, feeds_all, len(keep), HEAD_BATCH), keep
        except tf.errors.InvalidArgumentError:
            pass
    obs_feeds = obs_feeds() if callable(obs_feeds) else obs_feeds
    obs = {policy.inputs[k]: v for k, v in obs_feeds.items()}
    return _score(policy, obs, feeds_all, len(keep), batch_size), keep


def _score(policy, feeds: Mapping, actions: Mapping, n: int, batch_size: int) -> np.ndarray:
    out = []
    for start in range(0, n, batch_size):
        sl = slice(start, start + batch_size)
        feed_dict = {t: v[sl] for t, v in feeds.items()}
        feed_dict.update({t: v[sl] for t, v in actions.items()})
        if EXPLORE in policy.inputs:  # score them as samples (some policies report 0 when not exploring)
            feed_dict[policy.inputs[EXPLORE]] = True
        out.append(policy.session.run(policy.outputs[ACTION_LOGP], feed_dict))
    return np.concatenate(out)


def rounding_allowance(action_space: gym.Space, dist_inputs: np.ndarray, actions: Mapping[str, np.ndarray]) -> np.ndarray:
    """Per row, how far the log-density of the returned actions may lie from that of the sample
    it was computed for, because the sample was rounded to a Box dtype coarser than float32.

    A format's ``action_logp`` is the density of its float32 sample; the action it returns is that
    sample rounded to float16, and the session can only score the rounded value. With the
    diagonal Gaussian's mean and log-std from ``dist_inputs``, rounding by at most half an ulp
    moves the log-density by at most ``|a - mean| / std**2 * h + h**2 / (2 std**2)`` per component.
    Zero for float32 and float64 Boxes and for discrete leaves.
    """
    from policy_export.policy.distributions import distribution_class

    rows = len(dist_inputs)
    allowance = np.zeros(rows)
    offset = 0
    for i, leaf in enumerate(leaves(action_space)):
        width = distribution_class(leaf.space).required_inputs(leaf.space)
        if isinstance(leaf.space, gym.spaces.Box) and np.dtype(leaf.space.dtype).itemsize < 4:
            returned = np.asarray(actions[action_key(i)]).reshape(rows, -1)
            a = returned.astype(np.float64)
            mean, log_std = np.split(np.asarray(dist_inputs[:, offset:offset + width], np.float64), 2, axis=-1)
            half_ulp = np.spacing(np.abs(returned)).astype(np.float64) / 2
            var = np.exp(2 * log_std)
            allowance += np.sum(np.abs(a - mean) / var * half_ulp + half_ulp**2 / (2 * var), axis=1)
        offset += width
    return allowance


def within_allowance(reference: np.ndarray, actual: np.ndarray, allowance: np.ndarray) -> np.ndarray:
    """``actual`` moved toward ``reference`` by at most ``allowance`` (what the tolerance then judges)."""
    actual = np.asarray(actual, np.float64)
    return actual + np.clip(np.asarray(reference, np.float64) - actual, -allowance, allowance)


def summarize(checks: Sequence[ExplorationCheck]) -> dict[str, Any]:
    """Counts and the smallest p-value, for the manifest."""
    if not checks:
        return {"tests": 0}
    worst = min(checks, key=lambda c: c.p_value)
    return {"tests": len(checks), "failed": sum(not c.passed for c in checks), "threshold": worst.threshold,
            "min_p_value": worst.p_value, "worst": worst.key, "samples_per_runtime": worst.samples,
            "drawn_by": {c.format: c.drawn_by for c in checks}}
