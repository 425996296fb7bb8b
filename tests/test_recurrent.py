"""Recurrent policies: state keys in every format, training-time semantics, stepped parity, rollout."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import RECURRENT
from policy_export.exporter.devices import plan_devices
from policy_export.exporter.rollout import rollout
from policy_export.exporter.formats.tf_runner import TFGraphRunner
from policy_export.policy import InputError, TFPolicy, UnsupportedSpaceError, spec_from_json

STATE_KEYS_IN = ["state_in_0", "state_in_1", "seq_lens", "prev_action", "prev_reward"]
STATE_KEYS_OUT = ["state_out_0", "state_out_1"]


@pytest.mark.parametrize("name", RECURRENT)
def test_state_keys_are_stable_in_every_format(name, exports):
    import onnxruntime as ort

    result, out = exports(name)
    contract = result.manifest["contract"]
    inputs = {i["key"]: i for i in contract["inputs"]}
    outputs = {o["key"]: o for o in contract["outputs"]}
    assert set(STATE_KEYS_IN) <= set(inputs) and set(STATE_KEYS_OUT) <= set(outputs)
    assert inputs["state_in_0"]["shape"] == [None, 32] and inputs["seq_lens"]["dtype"] == "int32"
    assert all(inputs[k]["required"] for k in STATE_KEYS_IN)
    runner = TFGraphRunner.from_saved_model(out / "saved_model", plan_devices("cpu"))
    assert set(STATE_KEYS_IN) <= set(runner.inputs) and set(STATE_KEYS_OUT) <= set(runner.outputs)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [k for k in inputs if inputs[k]["required"]]
    assert set(STATE_KEYS_OUT) <= {o.name for o in session.get_outputs()}
    assert not any(":" in k for k in [*inputs, *outputs])  # never raw tensor names


@pytest.mark.parametrize("name", RECURRENT)
def test_stepped_parity_200_steps_without_drift(name, exports):
    result, _ = exports(name)
    stepped = [r for r in result.parity.records if "stepped" in r.format]
    formats = {r.format for r in stepped}
    assert formats == {f"{f} (stepped 200{s})" for f in ("saved_model", "frozen_graph", "onnx", "onnx_deterministic")
                       for s in ("", " vs sequences")}
    for r in stepped:
        assert r.shape[0] in (200, 10)  # per step, or per chunk end for states vs the training graph
        assert r.worst_step is not None and 0 <= r.worst_step < 200
        if r.exact:
            assert r.mismatches == 0, r.describe()
        else:
            assert r.max_abs_err <= 1e-5, r.describe()
    assert {r.shape[1] for r in stepped} == {4}  # four independent sequences in one batch


def test_training_graph_masks_padding_and_matches_one_step_calls(policies):
    policy = policies("cartpole_lstm")
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(2 * 5, 4)).astype(np.float32)
    prev_a = rng.integers(0, 2, 10)
    prev_r = rng.normal(size=10).astype(np.float32)
    result = policy.compute_actions(obs, prev_action=prev_a, prev_reward=prev_r, seq_lens=[5, 3])
    # the same two sequences, stepped one call at a time through the serving signature
    state = [np.zeros((2, 32), np.float32)] * 2
    for t in range(5):
        rows = [t, 5 + t]
        out = policy.run({"observations": obs[rows], "state_in_0": state[0], "state_in_1": state[1],
                          "seq_lens": np.array([1, 1 if t < 3 else 0], np.int32),
                          "prev_action": prev_a[rows], "prev_reward": prev_r[rows]})
        state = [out["state_out_0"], out["state_out_1"]]
        valid = [0] if t >= 3 else [0, 1]
        np.testing.assert_allclose(out["action_dist_inputs"][valid],
                                   result.fetches["action_dist_inputs"][[rows[i] for i in valid]], atol=1e-5)
    for i in range(2):
        np.testing.assert_allclose(state[i], result.state_out[i], atol=1e-5)  # padding left the state alone


def test_initial_state_and_input_checks(policies):
    policy = policies("cartpole_lstm")
    assert [s.shape for s in policy.get_initial_state()] == [(32,), (32,)]
    obs = np.zeros((6, 4), np.float32)
    with pytest.raises(InputError, match="prev_action"):
        policy.compute_actions(obs)
    with pytest.raises(InputError, match="padded sequences"):
        policy.compute_actions(obs, prev_action=np.zeros(6, np.int64), prev_reward=np.zeros(6), seq_lens=[4, 4, 4, 4])
    with pytest.raises(InputError, match="seq_lens"):
        policy.compute_actions(obs, prev_action=np.zeros(6, np.int64), prev_reward=np.zeros(6), seq_lens=[4, 2])


def test_prev_action_needs_a_single_action_space():
    spec = spec_from_json({
        "format_version": 1, "name": "r", "observation_space": {"type": "Box", "low": -1, "high": 1, "shape": [3]},
        "action_space": {"type": "Tuple", "spaces": [{"type": "Discrete", "n": 2}, {"type": "Discrete", "n": 3}]},
        "model": {"hiddens": [8], "lstm": {"cell_size": 4, "use_prev_action": True}}})
    with pytest.raises(UnsupportedSpaceError, match="use_prev_action"):
        TFPolicy.from_spec(spec)


def test_rollout_of_cartpole_mlp_solves_it_with_identical_actions(exports):
    _, out = exports("cartpole_mlp")
    report = rollout(out, "CartPole-v1", episodes=10, seed=0, device="cpu")
    assert report.formats == ["saved_model", "onnx"] and report.reference == "saved_model"
    assert report.passed and all(e.first_divergence == {"onnx": None} for e in report.episodes)
    assert report.mean_return("saved_model") >= 475 and report.mean_return("onnx") >= 475
    assert [e.returns["saved_model"] for e in report.episodes] == [e.returns["onnx"] for e in report.episodes]
    assert report.max_deviation("onnx") == 0.0  # integer actions: identical


@pytest.mark.parametrize("name", RECURRENT)
def test_rollout_of_recurrent_policy_carries_state_identically(name, exports):
    _, out = exports(name)
    report = rollout(out, "CartPole-v1", episodes=3, seed=5, device="cpu",
                     formats=["saved_model", "onnx", "frozen_graph", "onnx_deterministic"])
    assert report.passed
    assert all(len(set(e.steps.values())) == 1 and e.steps["onnx"] > 0 for e in report.episodes)


def test_rollout_refuses_an_environment_with_other_spaces(exports):
    _, out = exports("cartpole_mlp")
    with pytest.raises(InputError, match="do not match"):
        rollout(out, "Pendulum-v1", episodes=1, device="cpu")
    for env_id in ("NoSuchEnv-v9", "no_such_module:Env-v0", "CartPole-v99"):
        with pytest.raises(InputError, match="cannot make environment"):
            rollout(out, env_id, episodes=1, device="cpu")




def test_rollout_of_trained_pendulum_passes_with_float_actions_within_tolerance(exports):
    _, out = exports("pendulum_mlp")
    report = rollout(out, "Pendulum-v1", episodes=10, seed=0, device="cpu",
                     formats=["saved_model", "onnx", "onnx_deterministic"])
    assert report.passed, report.to_json()
    for fmt in report.formats:
        assert report.mean_return(fmt) >= -400, (fmt, report.mean_return(fmt))
    # float actions differ in the last bits between runtimes, but stay within the parity tolerance
    assert 0.0 <= report.max_deviation("onnx") <= 1e-5
    assert abs(report.mean_return("onnx") - report.mean_return("saved_model")) < 1.0


def test_rollout_reports_a_float_action_beyond_tolerance(exports, monkeypatch):
    from policy_export.exporter import verify

    _, out = exports("pendulum_mlp")
    real = verify.load_runner

    class Shifted:
        """The ONNX runner, its float action moved by 1e-3 from its eighth call (step 7 of the first episode) on."""

        def __init__(self, runner):
            self.runner, self.calls = runner, 0

        def __call__(self, feeds):
            got = dict(self.runner(feeds))
            self.calls += 1
            if self.calls > 7:
                got["actions_0"] = got["actions_0"] + np.float32(1e-3)
            return got

        def close(self):
            self.runner.close()

    def shifted(fmt, root, doc, plan):
        runner = real(fmt, root, doc, plan)
        return Shifted(runner) if fmt == "onnx" else runner

    monkeypatch.setattr(verify, "load_runner", shifted)
    report = rollout(out, "Pendulum-v1", episodes=2, seed=0, device="cpu")
    assert not report.passed
    assert report.episodes[0].first_divergence == {"onnx": 7}
    assert report.episodes[1].first_divergence == {"onnx": 0}
    # the environments drift apart after the first shifted action, so deviations only grow from there
    assert report.max_deviation("onnx") >= 9e-4


def test_rollout_formats_are_checked(exports):
    _, out = exports("cartpole_mlp")
    with pytest.raises(InputError, match="two or more"):
        rollout(out, "CartPole-v1", episodes=1, device="cpu", formats=["onnx"])
    with pytest.raises(InputError, match="cannot play"):
        rollout(out, "CartPole-v1", episodes=1, device="cpu", formats=["onnx", "keras"])
