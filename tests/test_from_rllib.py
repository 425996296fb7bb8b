"""``from_rllib(policy)``: live RLlib TF policies (old API stack) exported with every format.

Each policy is built in-process (``PPOTF1Policy(obs_space, action_space, config)`` in a fresh
graph, no ``ray.init``), given random weights so that outputs are far from RLlib's
near-zero initial head, wrapped, exported, and ONNX Runtime — fed only the inputs it lists as
required — is compared with RLlib's own ``policy.compute_actions(obs, explore=False)``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

# TensorFlow first: imported before it, RLlib switches TF's v2 behaviour off for the whole process
pytest.importorskip("tensorflow")
pytest.importorskip("ray.rllib")
gym = pytest.importorskip("gymnasium")

ATOL = 1e-5


def build(obs_space, action_space, model: dict, seed: int, **env):
    """A PPO TF1 policy with random weights (seeded)."""
    import tensorflow as tf
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.ppo.ppo_tf_policy import PPOTF1Policy

    config = (PPOConfig().framework("tf").rollouts(num_rollout_workers=0).training(model=model)
              .environment(**env).to_dict())
    with tf.Graph().as_default(), tf.compat.v1.variable_scope("default_policy"):
        policy = PPOTF1Policy(obs_space, action_space, config)
    rng = np.random.default_rng(seed)
    weights = policy.get_weights()
    policy.set_weights({k: ((0.1 if k.endswith("bias") else 0.7) * rng.standard_normal(np.shape(v)))
                        .astype(np.asarray(v).dtype) for k, v in weights.items()})
    return policy


def dict_space():
    return gym.spaces.Dict({"mode": gym.spaces.Discrete(3), "position": gym.spaces.Box(-2, 2, (2,), np.float32)})


@pytest.fixture(scope="module")
def policies():
    from ray.rllib.models.preprocessors import get_preprocessor

    box_obs = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    prep = get_preprocessor(dict_space())(dict_space())
    return {
        "discrete": build(box_obs, gym.spaces.Discrete(3), {"fcnet_hiddens": [16, 16]}, 0),
        "box": build(box_obs, gym.spaces.Box(-2.0, 2.0, (2,), np.float32), {"fcnet_hiddens": [16]}, 1,
                     normalize_actions=True),
        "dict_obs": build(prep.observation_space, gym.spaces.Discrete(2), {"fcnet_hiddens": [16]}, 2),
        "lstm": build(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Discrete(2),
                      {"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 5,
                       "lstm_use_prev_action": True, "lstm_use_prev_reward": True}, 3),
        "lstm_box": build(gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Box(-2.0, 2.0, (2,), np.float32),
                          {"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 7,
                           "lstm_use_prev_action": True}, 5, normalize_actions=True),
    }


@pytest.fixture(scope="module")
def exported(policies, tmp_path_factory):
    from policy_export import export_policy, from_rllib

    cache = {}

    def get(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp("rllib") / name
            result = export_policy(from_rllib(policies[name]), out, samples=300, explore_samples=2000, device="cpu")
            assert result.parity.passed
            cache[name] = (out, result)
        return cache[name]

    return get


def onnx_session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def observations(name: str, n: int = 64) -> np.ndarray:
    from ray.rllib.models.preprocessors import get_preprocessor

    rng = np.random.default_rng(10)
    if name == "dict_obs":
        space = dict_space()
        space.seed(10)
        prep = get_preprocessor(space)(space)
        return np.stack([prep.transform(space.sample()) for _ in range(n)]).astype(np.float32)
    width = 3 if name == "lstm" else 4
    return rng.uniform(-1, 1, (n, width)).astype(np.float32)


@pytest.mark.parametrize("name", ["discrete", "box", "dict_obs"])
def test_onnx_reproduces_compute_actions(name, policies, exported):
    policy = policies[name]
    out, result = exported(name)
    obs = observations(name)
    actions, _, fetches = policy.compute_actions(obs, explore=False)
    for model in ("model.onnx", "model_deterministic.onnx"):
        session = onnx_session(out / model)
        assert [i.name for i in session.get_inputs()] == ["observations"]
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"observations": obs})))
        if np.issubdtype(np.asarray(actions).dtype, np.integer):
            np.testing.assert_array_equal(got["actions_0"], actions)
        else:  # unclipped, in the normalised space, as RLlib returns them
            np.testing.assert_allclose(got["actions_0"], actions, rtol=0, atol=ATOL)
        if model == "model.onnx":
            for key in ("action_dist_inputs", "action_logp", "action_prob", "vf_preds"):
                np.testing.assert_allclose(got[key], fetches[key], rtol=0, atol=ATOL, err_msg=key)
    assert len(np.unique(actions)) > 1  # random weights: the test sees more than one action
    assert {"onnx", "onnx_deterministic", "saved_model", "frozen_graph"} <= set(result.formats)


def test_explore_is_an_optional_input_defaulting_to_false(policies, exported):
    out, _ = exported("discrete")
    manifest = json.loads((out / "manifest.json").read_text())
    contract = {s["key"]: s for s in manifest["contract"]["inputs"]}
    assert contract["explore"]["required"] is False and contract["explore"]["default"] is False
    session = onnx_session(out / "model.onnx")
    obs = np.repeat(observations("discrete")[:1], 3000, axis=0)
    actions, logp, logits = session.run(["actions_0", "action_logp", "action_dist_inputs"],
                                        {"observations": obs, "explore": np.array(True)})
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    np.testing.assert_allclose(np.bincount(actions, minlength=3) / len(actions), p, atol=0.04)
    np.testing.assert_allclose(np.exp(logp), p[actions], rtol=1e-4)  # sampled: the actions' own logp


@pytest.mark.parametrize("name", ["lstm", "lstm_box"])
def test_lstm_stepped_matches_compute_actions(name, policies, exported):
    policy = policies[name]
    out, result = exported(name)
    stepped = [r for r in result.parity.records if "stepped" in r.format and r.format.startswith("onnx")]
    assert stepped and all(r.passed for r in stepped)
    session = onnx_session(out / "model.onnx")
    required = {i.name for i in session.get_inputs()}
    uses_reward = name == "lstm"
    assert required == {"observations", "state_in_0", "state_in_1", "seq_lens", "prev_action",
                        *(["prev_reward"] if uses_reward else [])}
    rng = np.random.default_rng(5)
    batch, steps = 4, 20
    h_ref = [np.zeros((batch, 8), np.float32) for _ in range(2)]
    h_onnx = [s.copy() for s in h_ref]
    prev_a = np.zeros((batch, *policy.action_space.shape), policy.action_space.dtype)
    seen = []
    for step in range(steps):
        obs = rng.uniform(-1, 1, (batch, 3)).astype(np.float32)
        prev_r = rng.standard_normal(batch).astype(np.float32)
        actions, state, fetches = policy.compute_actions(obs, state_batches=h_ref, prev_action_batch=prev_a,
                                                         prev_reward_batch=prev_r, explore=False)
        feeds = {"observations": obs, "state_in_0": h_onnx[0], "state_in_1": h_onnx[1],
                 "seq_lens": np.ones(batch, np.int32), "prev_action": prev_a}
        if uses_reward:
            feeds["prev_reward"] = prev_r
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        if np.issubdtype(actions.dtype, np.integer):
            np.testing.assert_array_equal(got["actions_0"], actions, err_msg=f"step {step}")
        else:
            np.testing.assert_allclose(got["actions_0"], actions, rtol=0, atol=ATOL, err_msg=f"step {step}")
        for i in range(2):
            np.testing.assert_allclose(got[f"state_out_{i}"], state[i], rtol=0, atol=ATOL, err_msg=f"step {step}")
        np.testing.assert_allclose(got["action_dist_inputs"], fetches["action_dist_inputs"], rtol=0, atol=ATOL)
        np.testing.assert_allclose(got["vf_preds"], fetches["vf_preds"], rtol=0, atol=ATOL)
        h_ref, h_onnx, prev_a = list(state), [got["state_out_0"], got["state_out_1"]], actions
        seen.append(actions)
    assert np.abs(h_ref[0]).max() > 0.05 and len(np.unique(np.concatenate(seen), axis=0)) > 1


def test_raw_dict_observations(policies, tmp_path):
    """Given the environment's Dict space, the export takes raw observations, one input per leaf."""
    from ray.rllib.models.preprocessors import get_preprocessor

    from policy_export import export_policy, from_rllib

    policy = policies["dict_obs"]
    assert policy.observation_space.original_space == dict_space()
    export_policy(from_rllib(policy, observation_space=dict_space()), tmp_path / "raw", samples=200,
                  explore_samples=0, device="cpu")
    space = dict_space()
    space.seed(3)
    raw = [space.sample() for _ in range(64)]
    flat = np.stack([get_preprocessor(space)(space).transform(o) for o in raw]).astype(np.float32)
    actions, _, fetches = policy.compute_actions(flat, explore=False)
    session = onnx_session(tmp_path / "raw" / "model.onnx")
    assert sorted(i.name for i in session.get_inputs()) == ["observations/mode", "observations/position"]
    feeds = {"observations/mode": np.array([o["mode"] for o in raw], np.int64),
             "observations/position": np.stack([o["position"] for o in raw])}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.testing.assert_array_equal(got["actions_0"], actions)
    np.testing.assert_allclose(got["action_dist_inputs"], fetches["action_dist_inputs"], rtol=0, atol=ATOL)


def test_wrapped_policy_is_a_snapshot(policies):
    from policy_export import from_rllib

    policy = policies["box"]
    wrapped = from_rllib(policy)
    obs = observations("box")
    before = wrapped.compute_actions(obs).fetches["action_dist_inputs"]
    _, _, fetches = policy.compute_actions(obs, explore=False)
    np.testing.assert_allclose(before, fetches["action_dist_inputs"], rtol=0, atol=1e-6)
    assert wrapped.action_space == gym.spaces.Box(-1.0, 1.0, (2,), np.float32)  # normalize_actions
    assert wrapped.deterministic_outputs is not None
    wrapped.close()


def test_not_an_rllib_policy():
    from policy_export import from_rllib
    from policy_export.errors import InputError

    with pytest.raises(InputError, match="old API stack"):
        from_rllib(object())


def test_dqn_epsilon_greedy_assignments_are_dropped(tmp_path):
    """DQN's actions wait for an exploration-timestep assignment; the serving graph drops it.

    Its epsilon-greedy branch holds a while loop tf2onnx cannot convert, so the full ONNX model
    is left out; the SavedModel, frozen graph and deterministic ONNX model are exported.
    """
    import tensorflow as tf
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.algorithms.dqn.dqn_tf_policy import DQNTFPolicy

    from policy_export import export_policy, from_rllib

    config = DQNConfig().framework("tf").rollouts(num_rollout_workers=0).training(model={"fcnet_hiddens": [16]})
    with tf.Graph().as_default(), tf.compat.v1.variable_scope("default_policy"):
        policy = DQNTFPolicy(gym.spaces.Box(-1.0, 1.0, (4,), np.float32), gym.spaces.Discrete(3), config.to_dict())
    rng = np.random.default_rng(4)
    policy.set_weights({k: (0.7 * rng.standard_normal(np.shape(v))).astype(np.asarray(v).dtype)
                        for k, v in policy.get_weights().items()})
    result = export_policy(from_rllib(policy), tmp_path / "dqn", samples=200, explore_samples=1000, device="cpu",
                           formats=["saved_model", "frozen_graph", "onnx_deterministic"])
    assert result.parity.passed and "onnx_deterministic" in result.formats
    obs = observations("discrete")
    actions, _, _ = policy.compute_actions(obs, explore=False)
    (got,) = onnx_session(tmp_path / "dqn" / "model_deterministic.onnx").run(["actions_0"], {"observations": obs})
    np.testing.assert_array_equal(got, actions)
    assert len(np.unique(actions)) > 1


def test_flattening_matches_rllib_preprocessor():
    """The in-graph flattening equals RLlib's own preprocessor on a nested space."""
    import tensorflow as tf
    from ray.rllib.models.preprocessors import get_preprocessor

    from policy_export.exporter.sources.rllib import flatten_like_preprocessor, preprocessor_width
    from policy_export.policy.spaces import leaf_dtype, leaf_shape, leaf_values, leaves

    space = gym.spaces.Dict({
        "a": gym.spaces.Discrete(3, start=2),
        "b": gym.spaces.Tuple((gym.spaces.Box(-1, 1, (2, 2), np.float32), gym.spaces.MultiDiscrete([2, 3]))),
        "c": gym.spaces.MultiBinary(3),
    })
    space.seed(0)
    samples = [space.sample() for _ in range(16)]
    prep = get_preprocessor(space)(space)
    want = np.stack([prep.transform(s) for s in samples])
    assert preprocessor_width(space) == want.shape[1] == prep.size
    graph = tf.Graph()
    with graph.as_default():
        ph = {leaf.key("observations"): tf.compat.v1.placeholder(tf.as_dtype(leaf_dtype(leaf.space)),
                                                                 (None, *leaf_shape(leaf.space)))
              for leaf in leaves(space)}
        flat = flatten_like_preprocessor(space, ph, tf.float32)
    per_leaf = [leaf_values(space, s, "observations") for s in samples]
    feeds = {ph[k]: np.stack([np.asarray(v[k]) for v in per_leaf]).astype(ph[k].dtype.as_numpy_dtype) for k in ph}
    with tf.compat.v1.Session(graph=graph) as session:
        np.testing.assert_allclose(session.run(flat, feeds), want, rtol=0, atol=1e-7)
