"""The action head (:mod:`policy.head`) on every kind of action space, checked against numpy.

With ``explore`` false the actions are the deterministic sample (argmax, ``logit > 0``, the
Gaussian mean); ``action_logp`` is the log-probability of that action (``logp="action"``) or 0
(``logp="sampled"``, RLlib's meaning); with ``explore`` true it is the log-probability of the
sample, whichever the meaning. The deterministic path computes what the exploring path computes
with ``explore`` false, without random ops.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import tensorflow as tf

from policy_export.policy.distributions import ActionDistribution, Deterministic, OneLeaf, SquashedGaussian
from policy_export.policy.head import LOGP_MEANINGS, ActionHead, action_head, deterministic_outputs
from policy_export.policy.spaces import leaves
from policy_export.signatures.keys import ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB, action_key

tf1 = tf.compat.v1
BATCH = 256
RANDOM_OPS = {"Multinomial", "RandomStandardNormal", "RandomUniform", "If", "StatelessIf"}

SPACES = {
    "discrete": gym.spaces.Discrete(4),
    "discrete_start": gym.spaces.Discrete(3, start=-1),
    "multidiscrete": gym.spaces.MultiDiscrete([3, 2, 4]),
    "multibinary": gym.spaces.MultiBinary(3),
    "box": gym.spaces.Box(-0.5, 0.5, (2,), np.float32),
    "box_2d": gym.spaces.Box(-np.inf, np.inf, (2, 2), np.float32),
    "tuple": gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (2,), np.float32))),
    "dict": gym.spaces.Dict({"move": gym.spaces.MultiDiscrete([2, 3]), "press": gym.spaces.MultiBinary(2)}),
}

CASES = [(name, logp) for name in SPACES for logp in LOGP_MEANINGS]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def reference(space: gym.Space, x: np.ndarray, clip: bool):
    """numpy: ``(deterministic action per leaf, logp(raw actions) function)``."""
    parts, widths = [], []
    for leaf in leaves(space):
        s = leaf.space
        widths.append(int(s.n) if isinstance(s, gym.spaces.Discrete) else int(np.sum(s.nvec))
                      if isinstance(s, gym.spaces.MultiDiscrete) else 2 * int(np.prod(s.shape))
                      if isinstance(s, gym.spaces.Box) else int(np.prod(s.shape)))
        parts.append(s)
    chunks = np.split(x, np.cumsum(widths)[:-1], axis=-1)
    det, logps = [], []
    for s, c in zip(parts, chunks):
        if isinstance(s, gym.spaces.Discrete):
            det.append(np.argmax(c, -1) + int(s.start))
            logps.append(lambda a, c=c, s=s: _log_softmax(c)[np.arange(len(a)), a - int(s.start)])
        elif isinstance(s, gym.spaces.MultiDiscrete):
            pieces = np.split(c, np.cumsum(s.nvec)[:-1], axis=-1)
            det.append(np.stack([np.argmax(p, -1) for p in pieces], -1))
            logps.append(lambda a, pieces=pieces: sum(_log_softmax(p)[np.arange(len(a)), a[:, i]]
                                                      for i, p in enumerate(pieces)))
        elif isinstance(s, gym.spaces.MultiBinary):
            det.append((c > 0).astype(np.int8))
            logps.append(lambda a, c=c: (a * _log_sigmoid(c) + (1 - a) * _log_sigmoid(-c)).sum(-1))
        else:
            mean, log_std = np.split(c, 2, axis=-1)
            action = np.clip(mean, s.low.reshape(-1), s.high.reshape(-1)) if clip else mean
            det.append(action.reshape(-1, *s.shape))
            logps.append(lambda a, mean=mean, log_std=log_std: (
                -0.5 * ((a.reshape(mean.shape) - mean) / np.exp(log_std)) ** 2 - log_std).sum(-1)
                - 0.5 * math.log(2 * math.pi) * mean.shape[-1])
    return det, lambda raw: sum(f(np.asarray(a)) for f, a in zip(logps, raw))


def in_graph(space: gym.Space, make):
    """``(graph, dist_inputs placeholder, explore placeholder, make(dist_inputs, explore))``, built
    in a new seeded graph."""
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(0)
        width = ActionDistribution.required_inputs(space)
        dist_inputs = tf1.placeholder(tf.float32, (None, width), name=ACTION_DIST_INPUTS)
        explore = tf1.placeholder_with_default(False, (), name="explore")
        return graph, dist_inputs, explore, make(dist_inputs, explore)


def build(space: gym.Space, **options):
    """``(graph, dist_inputs placeholder, explore placeholder, head)``."""
    return in_graph(space, lambda dist_inputs, explore: action_head(space, dist_inputs, explore, **options))


def run(graph, fetches, feeds):
    with tf1.Session(graph=graph) as session:
        return session.run(fetches, feeds)


def inputs_for(space: gym.Space, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (1.5 * rng.standard_normal((BATCH, ActionDistribution.required_inputs(space)))).astype(np.float32)


def op_types(graph: tf.Graph, tensors) -> set[str]:
    """The op types ``tensors`` depend on in the graph (a ``tf.cond``'s branches are functions:
    its ``If`` op stands for them)."""
    sub = tf1.graph_util.extract_sub_graph(graph.as_graph_def(), sorted({t.op.name for t in tensors}))
    return {node.op for node in sub.node}


@pytest.mark.parametrize("name, logp", CASES)
def test_deterministic_actions_and_logp_when_not_exploring(name, logp):
    space = SPACES[name]
    clip = logp == "action"
    graph, dist_inputs, _, head = build(space, clip=clip, logp=logp)
    x = inputs_for(space)
    actions, raw, got_logp, det = run(graph, (head.actions, head.raw_actions, head.action_logp, head.deterministic),
                                      {dist_inputs: x})
    want, logp_of = reference(space, x, clip)
    assert len(actions) == len(want) == len(list(leaves(space)))
    for got, expected, leaf in zip(actions, want, leaves(space)):
        assert got.shape == (BATCH, *leaf.space.shape)
        assert got.dtype == np.dtype(leaf.space.dtype)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    want_logp = logp_of(raw) if logp == "action" else np.zeros(BATCH)
    np.testing.assert_allclose(got_logp, want_logp, rtol=1e-5, atol=1e-5)
    # the deterministic path: the same values, no explore switch and no random op
    for i, expected in enumerate(want):
        np.testing.assert_allclose(det[action_key(i)], expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(det[ACTION_LOGP], want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(det[ACTION_PROB], np.exp(want_logp), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(det[ACTION_DIST_INPUTS], x)
    assert not op_types(graph, head.deterministic.values()) & RANDOM_OPS
    assert all(t.name.startswith("deterministic/") for t in head.deterministic.values())


@pytest.mark.parametrize("name, logp", CASES)
def test_exploring_samples_and_scores_the_sample(name, logp):
    space = SPACES[name]
    graph, dist_inputs, explore, head = build(space, clip=True, logp=logp)
    x = inputs_for(space, seed=1)
    actions, raw, got_logp = run(graph, (head.actions, head.raw_actions, head.action_logp),
                                 {dist_inputs: x, explore: True})
    want, logp_of = reference(space, x, clip=True)
    np.testing.assert_allclose(got_logp, logp_of(raw), rtol=1e-4, atol=1e-4)
    assert any(not np.allclose(a, w) for a, w in zip(actions, want)), "exploring returned the deterministic actions"
    for got, r, leaf in zip(actions, raw, leaves(space)):
        s = leaf.space
        if isinstance(s, gym.spaces.Box):  # the served action clipped, the raw sample not
            np.testing.assert_allclose(got, np.clip(r.reshape(got.shape), s.low, s.high), rtol=0, atol=1e-6)
            if np.isfinite(s.low).all():
                assert (np.abs(r) > s.high.max()).any()
        else:
            np.testing.assert_array_equal(got, r.reshape(got.shape))
    assert op_types(graph, head.actions) & {"If", "StatelessIf"}


def test_box_actions_unclipped_when_asked():
    space = SPACES["box"]
    graph, dist_inputs, _, head = build(space, clip=False, logp="sampled")
    x = inputs_for(space)
    actions, det = run(graph, (head.actions, head.deterministic), {dist_inputs: x})
    mean = x[:, :2]
    assert (np.abs(mean) > 0.5).any()
    np.testing.assert_allclose(actions[0], mean, rtol=0, atol=0)
    np.testing.assert_allclose(det[action_key(0)], mean, rtol=0, atol=0)


def test_transform_applies_to_both_paths_and_extra_joins_the_deterministic_path():
    space = SPACES["tuple"]

    def make(dist_inputs, explore):
        value = tf.reduce_sum(dist_inputs, -1)
        return action_head(space, dist_inputs, explore, transform=lambda acts: [acts[0] * 10, acts[1] + 100.0],
                           extra={"value": value}), value

    graph, dist_inputs, _, (head, value) = in_graph(space, make)
    x = inputs_for(space)
    actions, det, v = run(graph, (head.actions, head.deterministic, value), {dist_inputs: x})
    want, _ = reference(space, x, clip=True)
    np.testing.assert_array_equal(actions[0], want[0] * 10)
    np.testing.assert_allclose(actions[1], want[1] + 100.0, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(det[action_key(0)], want[0] * 10)
    np.testing.assert_allclose(det[action_key(1)], want[1] + 100.0, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(det["value"], v)
    assert [t.op.name for t in head.actions] == ["actions_0", "actions_1"]
    assert head.action_logp.op.name.startswith("action_logp")


def test_without_explore_the_deterministic_path_is_served():
    space = SPACES["discrete"]
    graph, dist_inputs, _, head = in_graph(space, lambda x, _: action_head(space, x, None, clip=False, logp="sampled"))
    assert isinstance(head, ActionHead) and head.explore is None
    assert head.actions == [head.deterministic[action_key(0)]]
    assert head.action_logp is head.deterministic[ACTION_LOGP]
    assert not any(op.type in ("If", "StatelessIf") for op in graph.get_operations())
    x = inputs_for(space)
    actions, logp = run(graph, (head.actions, head.action_logp), {dist_inputs: x})
    np.testing.assert_array_equal(actions[0], np.argmax(x, -1))
    np.testing.assert_array_equal(logp, np.zeros(BATCH))


def test_one_leaf_distributions():
    box = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    x = inputs_for(box)

    def make(dist_inputs, explore):
        actor = tf.identity(dist_inputs[:, :2] * 3.0)
        return (action_head(OneLeaf(SquashedGaussian(dist_inputs, box)), dist_inputs, explore, clip=False,
                            logp="sampled"),
                action_head(OneLeaf(Deterministic(actor, box)), actor, None, clip=False, logp="sampled"))

    graph, dist_inputs, explore, (squashed, greedy) = in_graph(box, make)
    with tf1.Session(graph=graph) as session:
        det, logp = session.run((squashed.actions[0], squashed.action_logp), {dist_inputs: x})
        np.testing.assert_allclose(det, np.tanh(x[:, :2]), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(logp, np.zeros(BATCH))
        sampled, logp = session.run((squashed.actions[0], squashed.action_logp), {dist_inputs: x, explore: True})
        assert np.all(np.abs(sampled) <= 1.0) and not np.allclose(sampled, np.tanh(x[:, :2]))
        std = np.exp(np.clip(x[:, 2:], -5.0, 2.0))
        raw = np.arctanh(np.clip(sampled, -1 + 1e-6, 1 - 1e-6))
        gauss = (-0.5 * ((raw - x[:, :2]) / std) ** 2 - np.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)
        want = gauss - np.log(1 - np.tanh(raw) ** 2 + 1e-6).sum(-1)
        finite = np.abs(sampled).max(-1) < 0.999  # atanh near the bounds magnifies float32 rounding
        np.testing.assert_allclose(logp[finite], want[finite], rtol=1e-3, atol=1e-3)
        # the actor's output is the action, served as it is (no clipping)
        got, logp = session.run((greedy.actions[0], greedy.action_logp), {dist_inputs: x})
        np.testing.assert_allclose(got, x[:, :2] * 3.0, rtol=1e-6)
        assert (np.abs(got) > 1.0).any()
        np.testing.assert_array_equal(logp, np.zeros(BATCH))


def test_deterministic_outputs_without_postprocessing_keep_the_distributions_shape():
    space = SPACES["box_2d"]
    graph, dist_inputs, _, (plain, shaped) = in_graph(space, lambda x, _: (
        deterministic_outputs(space, x, logp="sampled", postprocess=False),
        deterministic_outputs(space, x, logp="sampled")))
    x = inputs_for(space)
    got_plain, got_shaped = run(graph, (plain, shaped), {dist_inputs: x})
    np.testing.assert_array_equal(got_plain[action_key(0)], x[:, :4])
    np.testing.assert_array_equal(got_shaped[action_key(0)], x[:, :4].reshape(-1, 2, 2))
    np.testing.assert_array_equal(got_plain[ACTION_PROB], np.ones(BATCH))


def test_outputs_are_keyed_and_ordered_like_a_signature():
    space = SPACES["tuple"]
    graph, dist_inputs, explore, head = build(space, deterministic=False)
    assert head.deterministic is None
    with graph.as_default():
        state = tf.zeros_like(dist_inputs)
        outputs = head.outputs([state])
    assert list(outputs) == ["actions_0", "actions_1", "state_out_0", ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB]
    x = inputs_for(space)
    logp, prob = run(graph, (outputs[ACTION_LOGP], outputs[ACTION_PROB]), {dist_inputs: x, explore: True})
    np.testing.assert_allclose(prob, np.exp(logp), rtol=1e-6)


def test_unknown_logp_meaning_is_refused():
    space = SPACES["discrete"]
    with pytest.raises(ValueError, match="logp 'zero'"):
        in_graph(space, lambda x, _: action_head(space, x, None, logp="zero"))
