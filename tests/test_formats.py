"""Formats as plugins and runners with one lifecycle: the registry, capabilities, feed checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from policy_export.exporter import export_policy, formats
from policy_export.exporter.devices import plan_devices
from policy_export.policy import InputError


def manifest_of(out):
    return json.loads((out / "manifest.json").read_text())


def test_capabilities_decide_what_each_format_is_checked_for():
    signature = [f.name for f in formats.with_capability("signature")]
    edge = ["tflite", "tflite_int8", "onnx_int8", "onnx_fp16"]
    serving = ["openvino", "openvino_bf16", "triton", "tf_serving"]
    assert signature == ["saved_model", "frozen_graph", "onnx", "onnx_deterministic", "onnx_explore", *edge, *serving]
    # what may explore; whether one export's file does is its manifest record's (Format.explores)
    assert [f.name for f in formats.with_capability("explores")] == ["saved_model", "frozen_graph", "onnx", "onnx_explore",
                                                                     "tflite", *serving]
    assert [f.name for f in formats.with_capability("onnx")] == ["onnx", "onnx_deterministic", "onnx_explore"]
    assert [f.name for f in formats.with_capability("reference", ["onnx", "frozen_graph"])] == ["frozen_graph"]
    assert [f.name for f in formats.with_capability("lossy")] == ["tflite_int8", "onnx_int8", "onnx_fp16", "openvino_bf16"]
    # edge formats and serving targets are opt-in
    assert formats.default_names() == tuple(f for f in formats.names() if f not in [*edge, *serving, "onnx_explore"])
    assert not formats.get("triton").explores({"explores": False}) and formats.get("triton").explores({"explores": True})
    assert not formats.get("openvino").explores({"explores": False})


@pytest.mark.parametrize("name", ["saved_model", "frozen_graph", "onnx", "onnx_deterministic"])
def test_every_runner_checks_its_feeds_against_the_contract(name, exports):
    _, out = exports("cartpole_mlp")
    fmt = formats.get(name)
    obs = np.zeros((3, 4), np.float32)
    with fmt.open(out / fmt.path, manifest_of(out), plan_devices("cpu")) as runner:
        assert runner.inputs["observations"].dtype == "float32"
        assert runner.inputs["observations"].shape[1:] == (4,)
        assert "actions_0" in runner.outputs
        assert runner({"observations": obs})["actions_0"].shape == (3,)
        with pytest.raises(InputError, match=r"observations: dtype float64, expected float32"):
            runner({"observations": obs.astype(np.float64)})
        with pytest.raises(InputError, match=r"observations: shape \[3, 5\], expected \[batch, 4\]"):
            runner({"observations": np.zeros((3, 5), np.float32)})
        with pytest.raises(InputError, match=r"has no input\(s\) \['obs'\]"):
            runner({"obs": obs})
    with pytest.raises(InputError, match="is closed"):
        runner({"observations": obs})


def test_frozen_graph_runner_accepts_inputs_that_freezing_pruned(exports):
    result, out = exports("cartpole_mlp")
    pruned = {s["key"] for s in result.manifest["contract"]["inputs"]} - set(result.manifest["formats"]["frozen_graph"]["inputs_kept"])
    assert "is_training" in pruned  # nothing depends on it, so the frozen graph does not hold it
    fmt = formats.get("frozen_graph")
    with fmt.open(out / fmt.path, manifest_of(out), plan_devices("cpu")) as runner:
        assert "is_training" not in runner.inputs and "is_training" in runner.accepted
        got = runner({"observations": np.ones((2, 4), np.float32), "is_training": np.array(True)})
        assert got["actions_0"].dtype == np.int64


def wrapped_policy():
    """A hand-built graph wrapped as a policy: no Keras base model, no deterministic outputs."""
    import gymnasium as gym
    import tensorflow as tf

    from policy_export.policy import TFPolicy

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        obs = tf1.placeholder(tf.float32, (None, 3), name="obs")
        w = tf1.get_variable("w", initializer=np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3))
        action = tf.argmax(tf.matmul(obs, w), axis=1, name="action")
        sess = tf1.Session(graph=graph)
        sess.run(tf1.global_variables_initializer())
    return TFPolicy(gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3), sess,
                    observations=obs, sampled_action=action)


def test_a_named_format_the_policy_cannot_have_is_refused(tmp_path):
    policy = wrapped_policy()
    with pytest.raises(InputError, match="format 'keras' cannot be written: the policy has no Keras base model"):
        export_policy(policy, tmp_path / "x", formats=["onnx", "keras"], samples=16, device="cpu")
    with pytest.raises(InputError, match="format 'onnx_deterministic' cannot be written: the policy exposes no"):
        export_policy(policy, tmp_path / "x", formats=["onnx_deterministic"], samples=16, device="cpu")
    with pytest.raises(InputError, match="format 'onnx_explore' cannot be written: the policy has no optional inputs"):
        export_policy(policy, tmp_path / "x", formats=["onnx", "onnx_explore"], samples=16, device="cpu")
    assert not (tmp_path / "x").exists()
    result = export_policy(policy, tmp_path / "y", samples=16, device="cpu")
    assert list(result.formats) == ["saved_model", "frozen_graph", "onnx"]  # left to the default: skipped


def test_a_new_format_is_one_module(tmp_path, monkeypatch, policies):
    """A plugin registered at run time is written, checked and verified like the built-in ones."""
    from policy_export.exporter.formats import base
    from policy_export.exporter.formats.tf_runner import TFGraphRunner
    from policy_export.signatures.contract import Contract

    class Copy(base.Format):  # a second frozen graph under another name: enough to exercise the plumbing
        name, path, order = "frozen_copy", "frozen_copy.pb", 25
        capabilities = base.Capabilities(reference=True, needs_frozen_graph=True)

        def write(self, ctx, target):
            from policy_export.exporter.formats.frozen_graph import write_frozen_graph

            record = write_frozen_graph(ctx, target)
            return type(record)(self.name, record.files, record.details)

        def open(self, path, manifest, device):
            return TFGraphRunner.from_graph_def(path, manifest["tensor_names"], device,
                                                Contract.from_json(manifest["contract"]))

    registry = {f.name: f for f in formats.all_formats()}
    registry["frozen_copy"] = Copy()
    registry = dict(sorted(registry.items(), key=lambda kv: kv[1].order))
    monkeypatch.setattr(formats, "_REGISTRY", registry)
    monkeypatch.setattr("policy_export.exporter.options.ALL_FORMATS", tuple(registry))
    from policy_export.exporter import verify_export

    result = export_policy(policies("cartpole_mlp"), tmp_path / "x",
                           formats=["frozen_copy", "onnx"], samples=32, device="cpu")
    assert list(result.formats) == ["frozen_copy", "onnx"]
    assert {r.format for r in result.parity.records} >= {"frozen_copy", "onnx"}
    assert any(c.format == "frozen_copy" for c in result.parity.exploration)
    verified = verify_export(tmp_path / "x", samples=20, device="cpu")
    assert verified.passed
    assert any(r.format == "onnx vs frozen_copy" for r in verified.parity.records)



def test_defaults_filled_in_keep_a_scalar_a_scalar():
    from policy_export.exporter.formats.runner import TensorMeta, with_defaults

    metas = {"observations": TensorMeta("observations", "float32", (None, 2)), "timestep": TensorMeta("timestep", "int64", ())}
    arrays = with_defaults("m", metas, {"observations": np.zeros((3, 2), np.float64)}, {"timestep": np.asarray(0)})
    assert arrays["timestep"].shape == () and arrays["timestep"].dtype == np.int64
    assert arrays["observations"].dtype == np.float32 and arrays["observations"].flags.c_contiguous
    with pytest.raises(InputError, match="required input 'observations' is missing"):
        with_defaults("m", metas, {}, {"timestep": np.asarray(0)})
