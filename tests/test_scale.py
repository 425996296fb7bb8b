"""Scale: one conversion for both ONNX models, weights kept out of the converter, external data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from conftest import FIXTURES_DIR
from policy_export.exporter import export_policy, export_spec, verify_export
from policy_export.exporter.formats.onnx.trust import check_external_data
from policy_export.policy import ExportError


def test_both_onnx_models_come_from_one_conversion_of_a_weightless_graph(policies, tmp_path, monkeypatch):
    import tf2onnx

    calls = []
    real = tf2onnx.convert.from_graph_def

    def counting(graph_def, **kwargs):
        consts = [n for n in graph_def.node if n.op == "Const"]
        calls.append((sum(len(n.attr["value"].tensor.tensor_content) for n in consts), len(kwargs["output_names"])))
        return real(graph_def, **kwargs)

    monkeypatch.setattr(tf2onnx.convert, "from_graph_def", counting)
    result = export_policy(policies("cartpole_mlp"), tmp_path / "x", samples=64, explore_samples=0, device="cpu")
    assert len(calls) == 1  # model.onnx and model_deterministic.onnx from one conversion
    const_bytes, outputs = calls[0]
    weights = sum(v.nbytes for v in policies("cartpole_mlp").get_weights().values())
    assert weights > 1000 and const_bytes < 100  # no weight reached the converter
    assert outputs == len(result.manifest["contract"]["outputs"]) + 1  # + the deterministic actions
    assert result.manifest["formats"]["onnx"]["conversion"] == "skeleton"
    assert result.parity.passed


def test_a_graph_whose_variables_the_skeleton_cannot_stand_for_is_frozen_instead(tmp_path):
    """A ref variable read by a MatMul directly (no read snapshot): converted the classic way."""
    import gymnasium as gym
    import tensorflow as tf

    from policy_export.policy import TFPolicy

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        obs = tf1.placeholder(tf.float32, (None, 3), name="obs")
        w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32), use_resource=True)
        scaled = tf.raw_ops.ResourceGather(resource=w.handle, indices=[0, 1, 2], dtype=tf.float32)
        action = tf.argmax(tf.matmul(obs, scaled), axis=1, name="action")
        sess = tf1.Session(graph=graph)
        sess.run(tf1.global_variables_initializer())
    policy = TFPolicy(gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3), sess,
                      observations=obs, sampled_action=action)
    result = export_policy(policy, tmp_path / "x", formats=["onnx"], samples=32, device="cpu")
    assert result.manifest["formats"]["onnx"]["conversion"] == "frozen"
    assert result.parity.passed


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    out = tmp_path_factory.mktemp("external") / "x"
    result = export_spec(FIXTURES_DIR / "image_uint8", out, device="cpu", samples=64, explore_samples=2000,
                         external_data_threshold=1024)
    return result, out


def test_models_over_the_threshold_keep_their_weights_in_external_data(external):
    result, out = external
    for fmt, name in (("onnx", "model.onnx"), ("onnx_deterministic", "model_deterministic.onnx")):
        assert result.manifest["formats"][fmt]["files"] == [name, f"{name}.data"]
        model = onnx.load(str(out / name), load_external_data=False)
        external_tensors = [i.name for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
        assert external_tensors  # the weights live in the .data file
        assert (out / name).stat().st_size < (out / f"{name}.data").stat().st_size
        assert (out / f"{name}.data").stat().st_mode & 0o777 == (out / name).stat().st_mode & 0o777
    listed = {f["path"] for f in result.manifest["files"]}
    assert {"model.onnx.data", "model_deterministic.onnx.data"} <= listed
    assert result.parity.passed and verify_export(out, samples=20, device="cpu").passed


def test_a_changed_external_data_file_fails_verify(external, tmp_path):
    _, out = external
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = copy / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    result = verify_export(copy, device="cpu")
    assert not result.passed
    assert any("model.onnx.data" in p for p in result.file_problems)
    assert "not loaded" in result.parity.errors["onnx"]


@pytest.mark.parametrize("location", ["../outside.data", "/etc/passwd", "sub/dir.data", "missing.data"])
def test_external_data_outside_the_model_directory_is_refused_before_loading(external, tmp_path, location):
    _, out = external
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    tensor = next(i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    (tmp_path / "m").mkdir()
    target = tmp_path / "m" / "model.onnx"
    onnx.save(model, str(target))
    shutil.copy(out / "model.onnx.data", tmp_path / "m" / "model.onnx.data")
    with pytest.raises(ExportError, match="refusing to read it|missing or not a regular file"):
        check_external_data(target)


def test_the_cli_takes_the_threshold(tmp_path):
    from policy_export.exporter import cli

    out = tmp_path / "x"
    code = cli.main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--samples", "16",
                     "--explore-samples", "0", "--device", "cpu", "--formats", "onnx",
                     "--external-data-threshold", "0"])
    assert code == 0
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["formats"]["onnx"]["files"] == ["model.onnx", "model.onnx.data"]
    assert cli.main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "y"),
                     "--external-data-threshold", "-1"]) == 2


def test_exploration_draws_through_the_action_head_as_a_full_run_would(exports, monkeypatch):
    """ONNX Runtime seeds its random ops: the head, fed the network's output once per probe,
    returns exactly the samples the whole model returns for the repeated probes."""
    from policy_export.exporter.parity import exploration
    from policy_export.exporter import formats
    from policy_export.exporter.devices import plan_devices

    result, out = exports("cartpole_mlp")
    doc = json.loads((out / "manifest.json").read_text())
    probe = {"observations": np.array([[0.1, 0.2, -0.1, 0.3], [1.0, -1.0, 0.5, 0.0]], np.float32)}
    monkeypatch.setattr(exploration, "HEAD_BATCH", 256)  # the same calls as the full run makes
    fmt = formats.get("onnx")
    with fmt.open(out / fmt.path, doc, plan_devices("cpu")) as runner:
        drawn, how = exploration.draw(runner, probe, 500, 256)
    with fmt.open(out / fmt.path, doc, plan_devices("cpu")) as runner:
        full = exploration.sample_actions(runner, exploration.repeated_observations(probe, 2, 1000), 256)
    assert how == "head"
    np.testing.assert_array_equal(drawn["actions_0"], full["actions_0"])
    np.testing.assert_allclose(drawn["action_logp"], full["action_logp"], atol=1e-6)
    assert set(np.unique(drawn["actions_0"])) == {0, 1}  # actually sampled, not the argmax


def test_a_head_that_needs_the_observations_draws_through_the_network(tmp_path):
    import gymnasium as gym
    import tensorflow as tf

    from policy_export.policy import TFPolicy

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        obs = tf1.placeholder(tf.float32, (None, 3), name="obs")
        explore = tf1.placeholder_with_default(False, (), name="explore")
        w = tf1.get_variable("w", initializer=np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3))
        logits = tf.identity(tf.matmul(obs, w), name="logits")
        # the sampler reads the observations again, beside the distribution inputs
        sampled = tf.squeeze(tf.random.categorical(logits + 0.0 * tf.reduce_sum(obs, 1, keepdims=True), 1), 1)
        action = tf.identity(tf.cond(explore, lambda: sampled, lambda: tf.argmax(logits, 1)), name="action")
        sess = tf1.Session(graph=graph)
        sess.run(tf1.global_variables_initializer())
    policy = TFPolicy(gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3), sess,
                      observations=obs, sampled_action=action, action_dist_inputs=logits, explore=explore)
    result = export_policy(policy, tmp_path / "x", formats=["saved_model", "onnx"], samples=32, device="cpu",
                           explore_samples=2000)
    assert result.parity.passed and len(result.parity.exploration) == 2 * 4
    assert {c.drawn_by for c in result.parity.exploration} == {"network"}
    assert verify_export(tmp_path / "x", device="cpu").passed


def test_spec_policies_draw_through_their_heads_in_every_format(exports):
    result, _ = exports("pendulum_mlp")
    assert result.manifest["parity"]["exploration"]["drawn_by"] == {
        "saved_model": "head", "frozen_graph": "head", "onnx": "head"}
