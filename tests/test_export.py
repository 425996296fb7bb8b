"""Exports: every fixture x format written, parity measured, opset honoured, writes atomic."""

from __future__ import annotations

import json
import threading

import gymnasium as gym
import numpy as np
import onnx
import pytest
import tensorflow as tf

from conftest import FIXTURES, FIXTURES_DIR, FORMATS, RECURRENT
from policy_export.exporter.formats.keras.model import output_keys
from policy_export.exporter import api, export_policy, export_spec, formats, verify_export
from policy_export.exporter.manifest import sha256
from policy_export.exporter.parity.compare import DEFAULT_BATCH, Tolerance, Tolerances
from policy_export.policy import ExportBusyError, ExportError, ExportExistsError, InputError, TFPolicy

tf1 = tf.compat.v1
LAYOUT = {
    "saved_model": ["saved_model/saved_model.pb", "saved_model/variables"],
    "frozen_graph": ["frozen_graph.pb"],
    "onnx": ["model.onnx"],
    "onnx_deterministic": ["model_deterministic.onnx"],
    "keras": ["keras/saved_model/saved_model.pb", "keras/base_model.keras", "keras/base_model.h5"],
}
PARITY_FORMATS = {"saved_model": ["saved_model"], "frozen_graph": ["frozen_graph"], "onnx": ["onnx"],
                  "onnx_deterministic": ["onnx_deterministic"],
                  "keras": ["keras_saved_model", "keras_v3", "keras_h5"]}


def test_matrix_covers_every_fixture():
    bundled = sorted(p.parent.name for p in FIXTURES_DIR.glob("*/policy.json"))
    assert bundled == sorted(FIXTURES)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", FIXTURES)
def test_format_written_and_matches_the_session(name, fmt, exports):
    result, out = exports(name)
    for rel in LAYOUT[fmt]:
        assert (out / rel).exists(), rel
    records = [r for r in result.parity.records if r.format in PARITY_FORMATS[fmt]]
    if fmt == "keras":
        expected_keys = output_keys(len(result.formats["keras"].details["outputs"]))
    elif fmt == "onnx_deterministic":
        expected_keys = [o["key"] for o in result.manifest["contract"]["outputs"]
                         if o["key"].startswith(("actions_", "state_out_"))]
    else:
        expected_keys = [o["key"] for o in result.manifest["contract"]["outputs"]]
    assert sorted({r.key for r in records}) == sorted(expected_keys)
    for r in records:
        assert r.passed, r.describe()
        assert r.shape[0] == 1000
        if r.exact:
            assert r.mismatches == 0
        else:
            assert r.max_abs_err <= 1e-5, r.describe()


@pytest.mark.parametrize("name", FIXTURES)
def test_onnx_parity_on_1000_samples(name, exports):
    """Actions identical, float outputs within 1e-5 absolute, on 1,000 sampled observations."""
    result, out = exports(name)
    onnx_records = {r.key: r for r in result.parity.records if r.format == "onnx"}
    action_keys = list(result.manifest["keys"]["actions"])
    assert action_keys and set(action_keys) <= set(onnx_records)
    for record in onnx_records.values():
        if record.exact:
            assert record.mismatches == 0, record.describe()  # every integer action identical
        else:
            assert record.max_abs_err <= 1e-5, record.describe()
    report = json.loads((out / "parity" / "report.json").read_text())
    assert report["passed"] is True and report["samples"] == 1000
    assert report["devices"]["tf_device"] == "/CPU:0"


@pytest.mark.parametrize("name", FIXTURES)
def test_manifest_lists_every_file_with_its_hash(name, exports):
    result, out = exports(name)
    doc = json.loads((out / "manifest.json").read_text())
    listed = {f["path"]: f for f in doc["files"]}
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(listed) == on_disk
    some = listed["model.onnx"]
    assert some["sha256"] == sha256(out / "model.onnx") and some["size"] == (out / "model.onnx").stat().st_size
    assert doc["opset"] == 17 and doc["versions"]["tensorflow"].startswith("2.")
    obs_keys = list(doc["keys"]["observations"])
    recurrent = ["state_in_0", "state_in_1", "seq_lens", "prev_action", "prev_reward"] if name in RECURRENT else []
    assert [i["key"] for i in doc["contract"]["inputs"]] == obs_keys + recurrent + ["explore", "is_training", "timestep"]
    explore = doc["contract"]["inputs"][len(obs_keys) + len(recurrent)]
    assert explore == {"key": "explore", "dtype": "bool", "shape": [], "required": False, "default": False}


@pytest.mark.parametrize("name", FIXTURES)
def test_golden_files_reproduce_the_session(name, exports, policies):
    _, out = exports(name)
    n = DEFAULT_BATCH  # the golden outputs were computed in batches of this size (matmul results
    # can differ in the last bit between batch shapes, so compare the same batch)
    with np.load(out / "parity" / "inputs.npz") as golden_in, np.load(out / "parity" / "outputs.npz") as golden_out:
        feeds = {k: golden_in[k][:n] for k in golden_in.files}
        got = policies(name).run(feeds)
        for key, value in got.items():
            np.testing.assert_array_equal(value, golden_out[key][:n])


@pytest.mark.parametrize("name", FIXTURES)
def test_deterministic_model_is_the_action_path_alone(name, exports):
    """No random ops, no explore switch; runs on ONNX's reference evaluator, which has no random ops."""
    from onnx.reference import ReferenceEvaluator

    result, out = exports(name)
    model = onnx.load(out / "model_deterministic.onnx")
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "If"}
    contract = result.manifest["contract"]
    assert [i.name for i in model.graph.input] == [i["key"] for i in contract["inputs"] if i["required"]]
    assert [o.name for o in model.graph.output] == [o["key"] for o in contract["outputs"]
                                                    if o["key"].startswith(("actions_", "state_out_"))]
    with np.load(out / "parity" / "inputs.npz") as golden_in, np.load(out / "parity" / "outputs.npz") as golden_out:
        feeds = {k: golden_in[k][:16] for k in golden_in.files}
        got = dict(zip([o.name for o in model.graph.output], ReferenceEvaluator(model).run(None, feeds)))
        for key, value in got.items():
            if np.issubdtype(value.dtype, np.floating):
                np.testing.assert_allclose(value, golden_out[key][:16], atol=1e-5)
            else:
                np.testing.assert_array_equal(value, golden_out[key][:16])


@pytest.mark.parametrize("opset", [13, 15])
def test_requested_opset_is_the_files_opset(opset, tmp_path):
    result = export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "o", device="cpu", formats=["onnx"],
                         opset=opset, samples=64)
    model = onnx.load(tmp_path / "o" / "model.onnx")
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    assert result.manifest["opset"] == opset
    assert set(result.formats) == {"onnx"}
    assert not (tmp_path / "o" / "saved_model").exists()


def test_unsupported_opset_and_format_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="opset 9"):
        export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "a", opset=9)
    with pytest.raises(InputError, match="unknown format"):
        export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "b", formats=["coreml"])
    assert list(tmp_path.iterdir()) == []


def test_existing_export_needs_overwrite(tmp_path, policies):
    policy = policies("cartpole_mlp")
    out = tmp_path / "x"
    first = export_policy(policy, out, formats=["onnx"], samples=32, device="cpu")
    stamp = (out / "manifest.json").read_text()
    with pytest.raises(ExportExistsError, match="--overwrite"):
        export_policy(policy, out, formats=["onnx"], samples=32, device="cpu")
    assert (out / "manifest.json").read_text() == stamp
    second = export_policy(policy, out, formats=["onnx", "frozen_graph"], samples=32, device="cpu", overwrite=True)
    assert set(second.formats) == {"onnx", "frozen_graph"} and set(first.formats) == {"onnx"}
    assert (out / "frozen_graph.pb").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no temporary siblings left


def test_failure_mid_export_leaves_nothing_and_keeps_the_previous(tmp_path, policies, monkeypatch):
    policy = policies("cartpole_mlp")
    out = tmp_path / "x"
    export_policy(policy, out, formats=["onnx"], samples=32, device="cpu")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def broken_writer(ctx, target):
        target.write_bytes(b"half")
        raise ExportError("disk full (simulated)")

    monkeypatch.setattr(formats.get("frozen_graph"), "write", broken_writer)
    with pytest.raises(ExportError, match="simulated"):
        export_policy(policy, out, formats=["onnx", "frozen_graph"], samples=32, device="cpu", overwrite=True)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]
    with pytest.raises(ExportError, match="simulated"):
        export_policy(policy, tmp_path / "new", formats=["frozen_graph"], samples=32, device="cpu")
    assert not (tmp_path / "new").exists()


def test_parity_failure_writes_nothing(tmp_path, policies, monkeypatch):
    from policy_export.exporter.formats.onnx import model as onnx_model

    policy = policies("cartpole_mlp")
    real = onnx_model.OnnxRunner.__call__

    def skewed(self, feeds):
        out = real(self, feeds)
        out["action_logp"] = out["action_logp"] + 1e-3
        return out

    monkeypatch.setattr(onnx_model.OnnxRunner, "__call__", skewed)
    with pytest.raises(api.ParityFailedError) as info:
        export_policy(policy, tmp_path / "x", formats=["onnx"], samples=64, device="cpu", explore_samples=0)
    failed = info.value.report.failures()
    assert [(r.format, r.key) for r in failed] == [("onnx", "action_logp")]
    assert failed[0].max_abs_err == pytest.approx(1e-3, rel=1e-2)
    assert failed[0].min_atol_to_pass >= 9e-4
    assert list(tmp_path.iterdir()) == []


def test_per_output_tolerance_is_recorded_and_used(tmp_path, policies):
    policy = policies("pendulum_mlp")
    tol = Tolerances(per_output={"action_logp": Tolerance(1e-4, 0.0)})
    result = export_policy(policy, tmp_path / "x", formats=["onnx"], samples=64, device="cpu", tolerances=tol)
    assert result.manifest["tolerances"]["per_output"] == {"action_logp": {"atol": 1e-4, "rtol": 0.0}}
    logp = [r for r in result.parity.records if r.key == "action_logp"][0]
    assert (logp.atol, logp.rtol) == (1e-4, 0.0)
    with pytest.raises(InputError, match="unknown output"):
        export_policy(policy, tmp_path / "y", tolerances=Tolerances(per_output={"nope": Tolerance()}))


def test_concurrent_exports_to_one_path(tmp_path, policies):
    """One completes, the other fails clearly; what is on disk is one complete export."""
    a, b = policies("cartpole_mlp"), policies("pendulum_mlp")
    out = tmp_path / "x"
    errors: list[Exception] = []
    results = []
    start = threading.Barrier(2)

    def run(policy):
        start.wait()
        try:
            results.append(export_policy(policy, out, formats=["onnx", "frozen_graph"], samples=64, device="cpu"))
        except (ExportBusyError, ExportExistsError) as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1 and len(errors) == 1
    assert verify_export(out, device="cpu").passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_wrapped_session_exports_and_verifies(tmp_path):
    graph = tf.Graph()
    with graph.as_default():
        obs = tf1.placeholder(tf.float32, (None, 3), name="obs")
        explore = tf1.placeholder_with_default(False, (), name="explore")
        w = tf1.get_variable("w", initializer=np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3))
        logits = tf.matmul(obs, w)
        greedy = tf.argmax(logits, axis=1)
        sampled = tf.squeeze(tf.random.categorical(logits, 1), 1)
        action = tf.identity(tf.cond(explore, lambda: sampled, lambda: greedy), name="action")
        logp = -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=action, logits=logits)
        value = tf.reduce_sum(obs, axis=1, name="value")
        sess = tf1.Session(graph=graph)
        sess.run(tf1.global_variables_initializer())
    policy = TFPolicy(gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(3), sess,
                      observations=obs, sampled_action=action, action_logp=logp, action_dist_inputs=logits,
                      explore=explore, extra_fetches={"vf_preds": value})
    result = export_policy(policy, tmp_path / "x", samples=200, device="cpu")
    # no Keras model and no deterministic outputs declared: those two formats are skipped
    assert set(result.formats) == {"saved_model", "frozen_graph", "onnx"}
    assert "vf_preds" in [o["key"] for o in result.manifest["contract"]["outputs"]]
    assert result.parity.passed
    assert verify_export(tmp_path / "x", samples=50, device="cpu").passed


@pytest.mark.gpu
def test_gpu_export_runs_both_runtimes_on_the_gpu(tmp_path):
    result = export_spec(FIXTURES_DIR / "pendulum_mlp", tmp_path / "g", device="gpu", samples=256)
    assert result.parity.devices["tf_device"] == "/GPU:0"
    assert result.parity.devices["onnxruntime_providers_used"][0] == "CUDAExecutionProvider"
    assert result.parity.passed
