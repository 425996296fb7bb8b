"""``from_rllib`` on a live policy of every RLlib TF algorithm the installed ray still carries
(:mod:`tests.rllib_live_matrix`; ``python -m tests.rllib_live_matrix`` prints the table docs/rllib-algorithms.md quotes).

``model.onnx``, fed only the inputs ONNX Runtime lists as required, must reproduce RLlib's
``policy.compute_actions(obs, explore=False)``: discrete actions identical, floats within 1e-5.
The export's own parity (its exploration check included) runs against the wrapped policy's
graph, which is RLlib's graph; the exploring paths are also compared with RLlib's own
``compute_actions(explore=True)``. TD3, DDPG and A3C skip on ray >= 2.8, which keeps only
deprecation stubs of them; they run on ray 2.7.
"""

from __future__ import annotations

import numpy as np
import pytest

# TensorFlow first: imported before it, RLlib switches TF's v2 behaviour off for the whole process
pytest.importorskip("tensorflow")
pytest.importorskip("ray.rllib")
pytest.importorskip("gymnasium")

from tests.rllib_live_matrix import (  # noqa: E402
    ATOL, CASES, FORMATS, FORMATS_OF, RECURRENT, NotCarried, export_case, largest_errors, observations, run_listed,
    stepped_errors,
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            try:
                cache[name] = export_case(name, tmp_path_factory.mktemp("live"))
            except NotCarried as e:
                cache[name] = e
        if isinstance(cache[name], NotCarried):
            pytest.skip(str(cache[name]))
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(set(CASES) - RECURRENT))
def test_model_onnx_reproduces_compute_actions(name, exported):
    policy, out, result = exported(name)
    assert result.parity.passed, [f.describe() for f in result.parity.failures()] or result.parity.errors
    formats = FORMATS_OF.get(name, FORMATS)
    assert set(formats) <= set(result.formats), result.missing
    errors = largest_errors(policy, out)
    assert set(errors) == {"model.onnx", *(["model_deterministic.onnx"] if "onnx_deterministic" in formats else [])}
    for model, row in errors.items():
        # prev_action/prev_reward, which these networks never read, are left out
        assert row.pop("listed inputs") == ["observations"], model
        assert {"actions_0", *(["action_dist_inputs"] if model == "model.onnx" else [])} <= set(row), (model, sorted(row))
        for key, err in row.items():
            assert err <= ATOL, (model, key, err)  # inf: a discrete action differs
    actions = policy.compute_actions(observations(), explore=False)[0]
    assert len(np.unique(np.asarray(actions), axis=0)) > 1  # random weights: more than one action


@pytest.mark.parametrize("name", ["dqn_dueling_double_nstep", "sac_box", "sac_discrete", "appo", "td3"])
def test_exploration_is_checked_against_rllibs_graph(name, exported):
    _, _, result = exported(name)
    checks = result.parity.exploration
    assert checks and all(c.passed for c in checks), [c.describe() for c in checks if not c.passed]
    assert "onnx" in {c.format for c in checks}, sorted({c.format for c in checks})


def _same_moments(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Per component, mean and standard deviation agree within 5 standard errors of their
    difference (the standard error of a sample std is about std / sqrt(2n))."""
    n = len(ours)
    spread = np.sqrt((ours.var(0) + theirs.var(0)) / n)
    assert np.all(np.abs(ours.mean(0) - theirs.mean(0)) <= 5 * spread + 1e-6), (ours.mean(0), theirs.mean(0))
    assert np.all(np.abs(ours.std(0) - theirs.std(0)) <= 5 * spread / np.sqrt(2) + 1e-6), (ours.std(0), theirs.std(0))


def _onnx_outputs(path, feeds):
    return run_listed(path, feeds)[1]


def test_epsilon_greedy_follows_rllibs_schedule(exported):
    """DQN's model.onnx, exploring, takes the greedy action as often as RLlib's own
    ``compute_actions(explore=True, timestep=t)`` does, along its epsilon schedule."""
    policy, out, _ = exported("dqn_dueling_double_nstep")
    obs = np.repeat(observations(1, seed=4), 3000, axis=0)
    greedy = policy.compute_actions(obs[:1], explore=False)[0][0]
    shares = {}
    for t in (0, 5_000, 1_000_000):
        rllib = policy.compute_actions(obs, explore=True, timestep=t)[0]
        ours = _onnx_outputs(out / "model.onnx", {"observations": obs, "explore": np.array(True),
                                                  "timestep": np.array(t, np.int64)})["actions_0"]
        shares[t] = (float(np.mean(ours == greedy)), float(np.mean(rllib == greedy)))
        assert abs(shares[t][0] - shares[t][1]) < 0.06, shares  # 3000 draws each: about 5 standard errors
    assert shares[0][1] < 0.35 < 0.45 < shares[5_000][1] < 0.8 < 0.95 < shares[1_000_000][1], shares


def test_sac_samples_and_logp_are_rllibs(exported):
    """SAC's model.onnx samples the squashed Gaussian as RLlib's ``compute_actions(explore=True)``
    does, within [-1, 1], and reports each sample's log-probability as RLlib's own distribution
    gives it."""
    import tensorflow as tf
    from ray.rllib.models.tf.tf_action_dist import SquashedGaussian

    policy, out, _ = exported("sac_box")
    # two observations where the squashed Gaussian is widest (random weights saturate most)
    candidates = observations(64, seed=5)
    mean, log_std = np.split(_onnx_outputs(out / "model.onnx", {"observations": candidates})["action_dist_inputs"], 2, -1)
    obs = np.repeat(candidates[np.argsort((log_std - np.abs(mean)).sum(-1))[-2:]], 2000, axis=0)
    got = _onnx_outputs(out / "model.onnx", {"observations": obs, "explore": np.array(True)})
    rllib = policy.compute_actions(obs, explore=True)[0]
    for half in (slice(0, 2000), slice(2000, 4000)):
        ours, theirs = got["actions_0"][half], rllib[half]
        assert np.abs(ours).max() <= 1.0 and ours.std(0).min() > 0.01
        _same_moments(ours, theirs)
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        dist = SquashedGaussian(tf.constant(got["action_dist_inputs"]), None)
        want = session.run(dist.logp(tf.constant(got["actions_0"])))
    # the log-density of a squashed sample goes through atanh, which near +-1 turns one float32
    # step of the action into a visible change: compared where every component is inside 0.999
    inside = np.abs(got["actions_0"]).max(axis=1) < 0.999
    assert inside.sum() > 500
    np.testing.assert_allclose(got["action_logp"][inside], want[inside], rtol=1e-4, atol=1e-4)


def test_ddpg_ou_exploration_is_refused_with_the_reason(exported):
    """OU noise is state kept between calls: no explore input, RLlib's actor action, and why."""
    _, out, result = exported("ddpg_ou")
    manifest = result.manifest
    assert "ou_state" in manifest["explore_refused"]
    assert "explore" not in {s["key"] for s in manifest["contract"]["inputs"]}


@pytest.mark.parametrize("timestep", [0, 1_000_000])
def test_td3_gaussian_noise_is_rllibs(exported, timestep):
    """TD3 explores as RLlib's ``GaussianNoise``: uniform over the bounds before its random
    timesteps, the actor's action plus scheduled Gaussian noise (clipped) after."""
    policy, out, _ = exported("td3")
    obs = np.repeat(observations(1, seed=6), 3000, axis=0)
    ours = _onnx_outputs(out / "model.onnx", {"observations": obs, "explore": np.array(True),
                                              "timestep": np.array(timestep, np.int64)})["actions_0"]
    theirs = policy.compute_actions(obs, explore=True, timestep=timestep)[0]
    _same_moments(ours, theirs)
    assert ours.std(0).min() > 0.05 and np.abs(ours).max() <= 1.0


def test_r2d2_steps_like_rllib(exported):
    """R2D2's recurrent Q-network, one step per call, the LSTM state carried by ONNX Runtime:
    20 steps over 4 sequences against RLlib's ``compute_actions`` with its state fed back."""
    policy, out, result = exported("r2d2")
    assert result.parity.passed, [f.describe() for f in result.parity.failures()] or result.parity.errors
    row = stepped_errors(policy, out)["model.onnx"]
    assert sorted(row.pop("listed inputs")) == ["observations", "seq_lens", "state_in_0", "state_in_1"]
    assert {"actions_0", "state_out_0", "state_out_1"} <= set(row), sorted(row)
    for key, err in row.items():
        assert err <= ATOL, (key, err)
