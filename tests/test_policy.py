"""TFPolicy: actions, weights, h5 import/export, and wrapping a user's own session."""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import h5py
import numpy as np
import pytest
import tensorflow as tf

from conftest import FIXTURES, FIXTURES_DIR
from policy_export.policy import InputError, TFPolicy, WeightsError, load_spec
from policy_export.policy.h5io import read_h5_weights, write_h5_weights
from policy_export.policy.spaces import leaves

tf1 = tf.compat.v1


def observations(policy: TFPolicy, n: int = 64, seed: int = 0):
    """A batch of ``n`` sampled observations in the space's own nest (dict/tuple of arrays)."""
    space = policy.observation_space
    space.seed(seed)
    samples = [space.sample() for _ in range(n)]

    def stack(sub, items):
        if isinstance(sub, gym.spaces.Dict):
            return {k: stack(v, [x[k] for x in items]) for k, v in sub.spaces.items()}
        if isinstance(sub, gym.spaces.Tuple):
            return tuple(stack(v, [x[i] for x in items]) for i, v in enumerate(sub.spaces))
        return np.stack(items)

    return stack(space, samples)


def act(policy: TFPolicy, obs, explore: bool = False):
    """compute_actions, giving a recurrent policy zero previous actions and rewards."""
    n = len(next(iter(policy.observation_feeds(obs).values())))
    extra = {}
    if "prev_action" in policy.inputs:
        t = policy.inputs["prev_action"]
        extra["prev_action"] = np.zeros((n, *t.shape.as_list()[1:]), t.dtype.as_numpy_dtype)
    if "prev_reward" in policy.inputs:
        extra["prev_reward"] = np.zeros(n, np.float32)
    return policy.compute_actions(obs, explore=explore, **extra)


def action_leaves(policy: TFPolicy, fetches) -> list[tuple[gym.Space, np.ndarray]]:
    return [(leaf.space, fetches[f"actions_{i}"]) for i, leaf in enumerate(leaves(policy.action_space))]


def fresh_policy(name: str, seed: int) -> TFPolicy:
    """The fixture's architecture with weights initialised from another seed (no weights file)."""
    spec = dataclasses.replace(load_spec(FIXTURES_DIR / name), weights=None, seed=seed)
    return TFPolicy.from_spec(spec)


@pytest.mark.parametrize("name", FIXTURES)
def test_deterministic_actions_are_repeatable_and_explore_samples(name, policies):
    policy = policies(name)
    obs = observations(policy, 256)
    first = act(policy, obs).fetches
    again = act(policy, obs).fetches
    sampled = act(policy, obs, explore=True).fetches
    differs = False
    for (space, det), (_, rep), (_, smp) in zip(*(action_leaves(policy, f) for f in (first, again, sampled))):
        assert np.array_equal(det, rep) and det.shape[0] == 256
        assert all(space.contains(a) for a in det) and all(space.contains(a) for a in smp)
        differs |= not np.array_equal(det, smp)
    assert differs


def test_discrete_action_is_argmax_and_prob_matches_softmax(policies):
    policy = policies("cartpole_mlp")
    out = policy.compute_actions(observations(policy)).fetches
    logits = out["action_dist_inputs"]
    assert np.array_equal(out["actions_0"], logits.argmax(axis=1))
    softmax = np.exp(logits - logits.max(1, keepdims=True))
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_allclose(out["action_prob"], softmax.max(axis=1), rtol=1e-5)
    np.testing.assert_allclose(out["action_logp"], np.log(softmax.max(axis=1)), atol=1e-5)


def test_box_action_is_clipped_mean_with_gaussian_logp(policies):
    policy = policies("pendulum_mlp")
    out = policy.compute_actions(observations(policy)).fetches
    mean, log_std = np.split(out["action_dist_inputs"], 2, axis=1)
    low, high = policy.action_space.low, policy.action_space.high
    np.testing.assert_allclose(out["actions_0"], np.clip(mean, low, high), atol=1e-6)
    expected_logp = (-log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)  # density at the mean
    np.testing.assert_allclose(out["action_logp"], expected_logp, atol=1e-5)


@pytest.mark.parametrize("name", FIXTURES)
def test_h5_round_trip_gives_identical_outputs(name, policies, tmp_path):
    source = policies(name)
    path = source.export_weights_h5(tmp_path / "w.h5")
    target = fresh_policy(name, seed=123)
    obs = observations(source)
    before = act(target, obs).fetches["action_dist_inputs"]
    want = act(source, obs).fetches["action_dist_inputs"]
    assert before.shape == want.shape
    assert not np.allclose(before, want)  # a different seed really gives different weights
    target.import_model_from_h5(path)
    got = act(target, obs).fetches
    for key, value in act(source, obs).fetches.items():
        np.testing.assert_array_equal(got[key], value)
    target.close()


def test_h5_is_loadable_by_keras_by_name(policies, tmp_path):
    import tf_keras as keras

    policy = policies("cartpole_mlp")
    path = policy.export_weights_h5(tmp_path / "w.h5")
    model = keras.Model.from_config(policy.model.get_config())
    model.load_weights(str(path), by_name=True)
    obs = observations(policy)
    np.testing.assert_allclose(model(obs).numpy(), policy.compute_actions(obs).fetches["action_dist_inputs"], atol=1e-6)


def _corrupt(src, dst, edit):
    weights = read_h5_weights(src)
    edit(weights)
    write_h5_weights(dst, weights)
    return dst


@pytest.mark.parametrize("edit, fragments", [
    (lambda w: w.__setitem__("fc_1/kernel", np.zeros((4, 17), np.float32)),
     ["'fc_1/kernel' has shape [4, 17], the policy expects [4, 16]"]),
    (lambda w: (w.__setitem__("fc_2/kernel", np.zeros((3, 3), np.float32)),
                w.__setitem__("fc_out/bias", np.zeros(5, np.float32))),
     ["'fc_2/kernel' has shape [3, 3]", "'fc_out/bias' has shape [5]"]),
    (lambda w: w.pop("fc_2/bias"), ["missing weight 'fc_2/bias'"]),
    (lambda w: w.__setitem__("fc_9/kernel", np.zeros((2, 2), np.float32)), ["unexpected weight 'fc_9/kernel'"]),
    (lambda w: w.__setitem__("fc_1/bias", np.full(16, np.nan, np.float32)), ["'fc_1/bias' holds NaN or Inf"]),
])
def test_bad_h5_names_every_problem_and_changes_nothing(edit, fragments, tmp_path):
    policy = fresh_policy("cartpole_mlp", seed=5)
    good = FIXTURES_DIR / "cartpole_mlp" / "weights.h5"
    bad = _corrupt(good, tmp_path / "bad.h5", edit)
    before = policy.get_weights()
    with pytest.raises(WeightsError) as info:
        policy.import_model_from_h5(bad)
    for fragment in fragments:
        assert fragment in str(info.value)
    after = policy.get_weights()
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])
    policy.close()


def test_non_finite_weights_allowed_when_asked(tmp_path):
    policy = fresh_policy("cartpole_mlp", seed=5)
    bad = _corrupt(FIXTURES_DIR / "cartpole_mlp" / "weights.h5", tmp_path / "inf.h5",
                   lambda w: w.__setitem__("fc_out/bias", np.array([np.inf, 0], np.float32)))
    policy.import_model_from_h5(bad, allow_non_finite=True)
    assert np.isinf(policy.get_weights()["fc_out/bias"][0])
    policy.close()


@pytest.mark.parametrize("content", [b"", b"not an hdf5 file at all", b"\x89HDF\r\n\x1a\n" + b"\0" * 40])
def test_unreadable_h5_is_a_weights_error(content, tmp_path):
    path = tmp_path / "w.h5"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match="not a readable HDF5"):
        read_h5_weights(path)


def test_h5_without_keras_layout(tmp_path):
    path = tmp_path / "w.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(WeightsError, match="not a Keras weights file"):
        read_h5_weights(path)


@pytest.mark.parametrize("obs, fragment", [
    (np.zeros((2, 5), np.float32), "expected shape [batch, 4], got [2, 5]"),
    (np.zeros((4,), np.float32), "expected shape [batch, 4], got [4]"),
    (np.array([["a"] * 4]), "cannot be safely cast"),
])
def test_wrong_observations_are_input_errors(obs, fragment, policies):
    with pytest.raises(InputError) as info:
        policies("cartpole_mlp").compute_actions(obs)
    assert fragment in str(info.value)


def test_wrapping_a_hand_built_session():
    """A user's own graph: placeholders, variables, no Keras model, no explore switch."""
    graph = tf.Graph()
    with graph.as_default():
        obs = tf1.placeholder(tf.float32, (None, 3), name="my_obs")
        w = tf1.get_variable("w", initializer=np.arange(6, dtype=np.float32).reshape(3, 2) / 10)
        logits = tf.matmul(obs, w, name="logits")
        action = tf.argmax(logits, axis=1, name="act")
        logp = tf.reduce_max(tf.nn.log_softmax(logits), axis=1)
        sess = tf1.Session(graph=graph)
        sess.run(tf1.global_variables_initializer())
    space = gym.spaces.Box(-1, 1, (3,), np.float32)
    policy = TFPolicy(space, gym.spaces.Discrete(2), sess, observations=obs, sampled_action=action,
                      action_logp=logp, action_dist_inputs=logits)
    assert list(policy.inputs) == ["observations"]
    assert list(policy.outputs) == ["actions_0", "action_dist_inputs", "action_logp", "action_prob"]
    x = np.array([[1, 0, 0], [0, 0, -1]], np.float32)
    result = policy.compute_actions(x)
    np.testing.assert_array_equal(result.actions, [1, 0])
    np.testing.assert_allclose(result.fetches["action_prob"], np.exp(result.fetches["action_logp"]))
    assert list(policy.get_weights()) == ["w"]
    with pytest.raises(InputError, match="no explore input"):
        policy.compute_actions(x, explore=True)


def test_optional_inputs_no_output_reads_are_left_out():
    """prev_action is read by the logits, prev_reward and an extra input by nothing: only the first stays."""
    graph = tf.Graph()
    with graph.as_default():
        obs = tf1.placeholder(tf.float32, (None, 3), name="obs")
        prev_action = tf1.placeholder(tf.int64, (None,), name="prev_action")
        prev_reward = tf1.placeholder(tf.float32, (None,), name="prev_reward")
        unread = tf1.placeholder(tf.float32, (None, 2), name="unread")
        logits = tf.concat([obs, tf.one_hot(prev_action, 2)], axis=1)[:, :2]
        action = tf.argmax(logits, axis=1)
        sess = tf1.Session(graph=graph)
    space = gym.spaces.Box(-1, 1, (3,), np.float32)
    policy = TFPolicy(space, gym.spaces.Discrete(2), sess, observations=obs, sampled_action=action,
                      action_dist_inputs=logits, prev_action=prev_action, prev_reward=prev_reward,
                      extra_inputs={"unread": unread})
    assert list(policy.inputs) == ["observations", "prev_action"]
    assert policy.unused_inputs == ["prev_reward", "unread"]


@pytest.mark.parametrize("name", ["pendulum_mlp", "dict_image_vector", "cartpole_lstm"])
def test_weights_from_a_seed_are_reproducible(name):
    spec = dataclasses.replace(load_spec(FIXTURES_DIR / name), weights=None)
    first, second = TFPolicy.from_spec(spec), TFPolicy.from_spec(spec)
    other = TFPolicy.from_spec(dataclasses.replace(spec, seed=spec.seed + 1))
    a, b, c = first.get_weights(), second.get_weights(), other.get_weights()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], c[k]) for k in a if k.endswith("kernel"))
    for p in (first, second, other):
        p.close()
