"""``convert`` on RLlib 2.0.1's own policy SavedModels (fixtures/rllib/legacy, made by make_legacy.py).

Each converted model must reproduce RLlib's ``compute_actions(explore=False)`` recorded in the
fixture's expected.npz: discrete actions exactly, floats within 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from policy_export.exporter.cli import main
from policy_export.exporter.convert import convert_saved_model
from policy_export.exporter.sources.legacy import load_saved_model_policy, read_meta_graph
from policy_export.policy.spaces import space_from_json

LEGACY = Path(__file__).resolve().parent.parent / "fixtures" / "rllib" / "legacy"
FEED_FORWARD = ["cartpole_ff", "pendulum_box", "dict_obs", "multidiscrete"]
FETCHES = ["action_dist_inputs", "action_logp", "action_prob", "vf_preds"]
TRAINING_OPS = {"ResourceApplyAdam", "ApplyAdam", "SparseSoftmaxCrossEntropyWithLogitsGrad", "BroadcastGradientArgs"}
ATOL = 1e-5


def case(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    info = json.loads((LEGACY / name / "case.json").read_text())
    with np.load(LEGACY / name / "expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    return info, expected


def spaces(info: dict) -> dict:
    return {"observation_space": space_from_json(info["observation_space"]),
            "action_space": space_from_json(info["action_space"])}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(name)`` -> (ExportResult, out): each case converted once with its case.json spaces."""
    cache = {}
    base = tmp_path_factory.mktemp("legacy")

    def get(name: str):
        if name not in cache:
            info, _ = case(name)
            out = base / name
            cache[name] = (convert_saved_model(LEGACY / name / "saved_model", out, device="cpu", **spaces(info)), out)
        return cache[name]

    return get


def check_against_rllib(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    actions = np.asarray(got["actions_0"])
    if np.issubdtype(expected["actions"].dtype, np.integer):
        np.testing.assert_array_equal(actions, expected["actions"])
    else:
        np.testing.assert_allclose(actions, expected["actions"], rtol=0, atol=ATOL)
    for key in FETCHES:
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=ATOL, err_msg=key)


@pytest.mark.parametrize("name", FEED_FORWARD)
def test_onnx_reproduces_rllib_compute_actions(name, converted):
    import onnxruntime as ort

    _, expected = case(name)
    _, out = converted(name)
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    required = [i.name for i in sess.get_inputs()]
    assert required == ["observations"], f"ONNX Runtime lists {required} as inputs"
    names = [o.name for o in sess.get_outputs()]
    values = sess.run(names, {"observations": expected["observations"]})
    check_against_rllib(dict(zip(names, values)), expected)


@pytest.mark.parametrize("name", FEED_FORWARD)
def test_exported_saved_model_reproduces_rllib(name, converted):
    from policy_export.exporter.devices import plan_devices
    from policy_export.exporter.formats.tf_runner import TFGraphRunner

    _, expected = case(name)
    _, out = converted(name)
    with TFGraphRunner.from_saved_model(out / "saved_model", plan_devices("cpu")) as runner:
        got = runner({"observations": expected["observations"]})
    check_against_rllib(got, expected)


@pytest.mark.parametrize("name", FEED_FORWARD)
def test_hidden_explore_switch_becomes_explore_input_default_false(name, converted):
    result, _ = converted(name)
    explore = next(s for s in result.manifest["contract"]["inputs"] if s["key"] == "explore")
    assert explore["required"] is False and explore["default"] is False
    assert result.manifest["source"]["explore"] == {
        "from": "default_policy/is_exploring", "in_source_signature": False, "original_default": True, "default": False}
    # exploration parity ran on every format, on the policy's sampled actions
    formats = {c.format for c in result.parity.exploration}
    assert formats == {"saved_model", "frozen_graph", "onnx"}
    assert all(c.passed for c in result.parity.exploration)
    assert all(c.samples >= 2000 for c in result.parity.exploration)


def test_exploration_actually_samples(converted):
    """With explore on, the converted ONNX model samples (RLlib's default); off, it is deterministic."""
    import onnxruntime as ort

    _, expected = case("pendulum_box")
    _, out = converted("pendulum_box")
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    obs = np.repeat(expected["observations"][:1], 2000, axis=0)
    sampled = sess.run(["actions_0"], {"observations": obs, "explore": np.array(True)})[0]
    mean = sess.run(["actions_0"], {"observations": obs[:1]})[0]
    np.testing.assert_allclose(mean, expected["actions"][:1], atol=ATOL)
    log_std = expected["action_dist_inputs"][0, 1]
    assert sampled.std() == pytest.approx(np.exp(log_std), rel=0.1)
    assert sampled.mean() == pytest.approx(mean[0, 0], abs=4 * np.exp(log_std) / np.sqrt(2000))


@pytest.mark.parametrize("name", FEED_FORWARD)
def test_training_graph_is_pruned(name, converted):
    from tensorflow.core.protobuf import saved_model_pb2

    result, out = converted(name)
    source = read_meta_graph(LEGACY / name / "saved_model").graph_def
    model = saved_model_pb2.SavedModel()
    model.ParseFromString((out / "saved_model" / "saved_model.pb").read_bytes())
    exported = model.meta_graphs[0].graph_def
    assert TRAINING_OPS & {n.op for n in source.node}, "the source should hold the training graph"
    assert not TRAINING_OPS & {n.op for n in exported.node}
    assert not [n.name for n in exported.node if "gradients" in n.name or "/Adam" in n.name]
    pruned = result.manifest["source"]["pruned"]
    assert pruned["nodes_before"] == len(source.node) > 1000
    assert pruned["nodes_after"] < len(source.node) / 4
    assert len(exported.node) < len(source.node) / 3  # the builder adds its save/restore ops


def test_spaces_recorded_and_huge_bounds_sampled_finite(converted):
    info, _ = case("cartpole_ff")
    result, out = converted("cartpole_ff")
    assert result.manifest["spaces"]["observation"]["high"][1] > 1e38  # RLlib's bound is kept as given
    assert result.manifest["source"]["spaces"] == {"observation": "given", "action": "given"}
    with np.load(out / "parity" / "inputs.npz") as data:
        obs = data["observations"]
    assert np.all(np.isfinite(obs)) and np.abs(obs[:, [1, 3]]).max() < 10  # standard normal where unbounded
    assert 0.5 < obs[:, 1].std() < 1.5
    assert np.abs(obs[:, 0]).max() <= 4.8 and obs[:, 0].std() > 2  # uniform over the finite bounds


def test_converted_export_verifies_with_fresh_samples(converted):
    """verify draws fresh observations from the manifest's spaces (RLlib's huge bounds included)."""
    _, out = converted("cartpole_ff")
    assert main(["verify", str(out), "--samples", "100", "--device", "cpu"]) == 0


def test_sampling_space_treats_huge_bounds_as_unbounded():
    import gymnasium as gym

    from policy_export.exporter.parity.compare import LARGE_BOUND, sample_observations, sampling_space

    big = np.finfo(np.float32).max
    box = gym.spaces.Box(np.array([-big, 0, -5, -np.inf], np.float32), np.array([big, big, 5, 2], np.float32))
    sub = sampling_space(box)
    np.testing.assert_array_equal(sub.low, [-np.inf, 0, -5, -np.inf])
    np.testing.assert_array_equal(sub.high, [np.inf, np.inf, 5, 2])
    obs = sample_observations(box, 4000, 0)["observations"]
    assert box.contains(obs[0]) and np.all(np.isfinite(obs))
    assert abs(obs[:, 0].mean()) < 0.1 and 0.9 < obs[:, 0].std() < 1.1  # standard normal
    assert obs[:, 1].min() >= 0 and 0.9 < obs[:, 1].mean() < 1.1  # low + standard exponential
    assert obs[:, 2].min() >= -5 and obs[:, 2].max() <= 5 and obs[:, 2].std() > 2.5  # uniform
    assert obs[:, 3].max() <= 2  # high - standard exponential
    within = gym.spaces.Box(-LARGE_BOUND, LARGE_BOUND, (2,), np.float32)
    assert sampling_space(within) is within
    ints = gym.spaces.Box(0, 2**40, (2,), np.int64)
    assert sampling_space(ints) is ints


def test_normalised_box_action_space_recorded(converted):
    result, _ = converted("pendulum_box")
    assert result.manifest["spaces"]["action"] == {"type": "Box", "low": -1, "high": 1, "shape": [1], "dtype": "float32"}
    assert "normalize_actions" in result.manifest["source"]["spaces"]["action_note"]


def test_cli_converts_without_flags(tmp_path, capsys):
    _, expected = case("cartpole_ff")
    out = tmp_path / "out"
    assert main(["convert", str(LEGACY / "cartpole_ff" / "saved_model"), "--out", str(out),
                 "--device", "cpu", "--samples", "200"]) == 0
    assert "default_policy/is_exploring:0 -> explore" in capsys.readouterr().out
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["source"]["spaces"]["observation"] == "inferred from the tensors"
    assert doc["spaces"]["observation"] == {"type": "Box", "low": -1, "high": 1, "shape": [4], "dtype": "float32"}
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["observations"]
    actions = sess.run(["actions_0"], {"observations": expected["observations"]})[0]
    np.testing.assert_array_equal(actions, expected["actions"])
    assert main(["verify", str(out), "--device", "cpu"]) == 0


def test_cli_space_options(tmp_path, capsys):
    info, _ = case("dict_obs")
    space_file = tmp_path / "obs.json"
    space_file.write_text(json.dumps(info["observation_space"]))
    out = tmp_path / "out"
    assert main(["convert", str(LEGACY / "dict_obs" / "saved_model"), "--out", str(out), "--device", "cpu",
                 "--samples", "100",
                 "--observation-space", str(space_file), "--action-space", json.dumps(info["action_space"])]) == 0
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["spaces"]["observation"]["low"] == info["observation_space"]["low"]
    assert doc["source"]["spaces"] == {"observation": "given", "action": "given"}


@pytest.mark.parametrize("option, value, message", [
    ("--observation-space", "{not json", "--observation-space: not valid JSON"),
    ("--observation-space", '{"type": "Discrete", "n": 2, "n": 3}', "duplicate key"),
    ("--observation-space", '{"type": "Box", "low": -1}', "$.high: missing"),
    ("--action-space", "missing-file.json", "neither JSON text nor a readable file"),
    ("--action-space", '{"type": "Discrete", "n": 0}', "$.n: expected a positive integer"),
    ("--observation-space", '{"type": "Box", "low": -1, "high": 1, "shape": [5]}', "shape [5]"),
    ("--observation-space", json.dumps({"type": "Dict", "spaces": {
        "pos": {"type": "Box", "low": -1, "high": 1, "shape": [2]},
        "vel": {"type": "Box", "low": -2, "high": 2, "shape": [3]}}}), "RLlib flattens Dict/Tuple observations"),
    ("--action-space", '{"type": "Box", "low": -1, "high": 1, "shape": [1]}', "shape [1]"),
    ("--action-space", '{"type": "Box", "low": -1, "high": 1, "shape": []}', "dtype float32"),
])
def test_cli_bad_space_exits_2(option, value, message, tmp_path, capsys):
    name = "dict_obs" if "Dict" in value else "cartpole_ff"
    code = main(["convert", str(LEGACY / name / "saved_model"), "--out", str(tmp_path / "out"),
                 "--device", "cpu", option, value])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_lstm_keys_mapped_and_session_reproduces_rllib():
    """State keys pair as RLlib computes them; stepping the converted session reproduces RLlib's sequence."""
    info, expected = case("lstm")
    policy, source = load_saved_model_policy(LEGACY / "lstm" / "saved_model", device="cpu", **spaces(info))
    try:
        mapping = source["key_mapping"]
        assert mapping["state_in_0"] == "default_policy/state_in_0:0"
        assert mapping["state_in_1"] == "default_policy/state_in_1:0"
        assert mapping["state_out_0"].startswith("default_policy/model_1/lstm/while/")
        dtypes = {k: policy.inputs[k].dtype.name for k in ("seq_lens", "prev_action", "prev_reward", "explore")}
        assert dtypes == {"seq_lens": "int32", "prev_action": "int64", "prev_reward": "float32", "explore": "bool"}
        assert policy.defaults["explore"] == np.False_
        assert source["pruned"]["nodes_after"] < source["pruned"]["nodes_before"] / 3
        steps, batch = expected["actions"].shape
        state = [expected["state_in_0"][0], expected["state_in_1"][0]]
        assert not np.any(state[0]) and not np.any(state[1])
        for t in range(steps):
            got = policy.run({"observations": expected["observations"][t], "state_in_0": state[0],
                              "state_in_1": state[1], "seq_lens": np.ones(batch, np.int32),
                              "prev_action": expected["prev_action"][t], "prev_reward": expected["prev_reward"][t]})
            np.testing.assert_array_equal(got["actions_0"], expected["actions"][t], err_msg=f"step {t}")
            for key in ("state_out_0", "state_out_1", *FETCHES):
                np.testing.assert_allclose(got[key], expected[key][t], rtol=0, atol=ATOL, err_msg=f"{key} step {t}")
            state = [got["state_out_0"], got["state_out_1"]]  # carried by the converted policy itself
    finally:
        policy.close()


def test_lstm_swapped_state_pairs_do_not_reproduce_rllib():
    """The pairing matters: swapping the state outputs breaks the sequence (so the test above can fail)."""
    info, expected = case("lstm")
    meta = read_meta_graph(LEGACY / "lstm" / "saved_model")
    outs = sorted(k for k in meta.signature_def["serving_default"].outputs if ":" in k)
    pairs = [("default_policy/state_in_0:0", outs[1]), ("default_policy/state_in_1:0", outs[0])]
    policy, _ = load_saved_model_policy(LEGACY / "lstm" / "saved_model", device="cpu", state_pairs=pairs)
    try:
        got = policy.run({"observations": expected["observations"][1], "state_in_0": expected["state_in_0"][1],
                          "state_in_1": expected["state_in_1"][1], "seq_lens": np.ones(4, np.int32),
                          "prev_action": expected["prev_action"][1], "prev_reward": expected["prev_reward"][1]})
        assert not np.allclose(got["state_out_0"], expected["state_out_0"][1], atol=ATOL)
    finally:
        policy.close()


@pytest.mark.parametrize("samples, fragment", [("0", "at least 1"), ("1000000000", "exceeds the limit")])
def test_convert_caps_samples_before_loading(tmp_path, samples, fragment, capsys):
    from policy_export.exporter import cli as cli_module

    out = tmp_path / "out"
    code = cli_module.main(["convert", str(LEGACY / "cartpole_ff" / "saved_model"), "--out", str(out),
                            "--samples", samples])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err
    assert not out.exists()
