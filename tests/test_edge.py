"""Edge and compressed formats (tflite, tflite_int8, onnx_int8, onnx_fp16) and behavioural parity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES_DIR, spec_exports

EDGE = ["tflite", "tflite_int8", "onnx_int8", "onnx_fp16"]
FIXTURES = ["cartpole_mlp", "pendulum_mlp", "cartpole_lstm", "dict_image_vector"]  # dict_image_vector: 32x32x3 image


def _litert():
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError as e:  # an environment without the standalone interpreter
        pytest.skip(f"ai-edge-litert is not installed: {e}")
    return Interpreter


@pytest.fixture(scope="module")
def edge_exports(tmp_path_factory):
    """Each fixture exported once with the edge formats (and the float ONNX models beside them)."""
    return spec_exports(tmp_path_factory, "edge", {"samples": 500, "explore_samples": 4000,
                                                   "formats": ["saved_model", "onnx_deterministic", *EDGE]})


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("name", FIXTURES)
def test_edge_formats_export_and_verify(name, edge_exports):
    from policy_export.exporter.cli import main

    result, out = edge_exports(name)
    doc = _manifest(out)
    for fmt, path in {"tflite": "model.tflite", "tflite_int8": "model_int8.tflite", "onnx_int8": "model_int8.onnx",
                      "onnx_fp16": "model_fp16.onnx"}.items():
        assert doc["formats"][fmt]["files"] == [path] and (out / path).is_file()
    assert set(doc["behaviour"]) == {"tflite_int8", "onnx_int8", "onnx_fp16"}
    assert doc["behaviour"]["onnx_int8"] == {"min_agreement": 0.99, "max_box_error": 0.02}
    assert doc["parity"]["behaviour"] and all(v["passed"] for v in doc["parity"]["behaviour"].values())
    # tflite is float: checked like every float format, value by value
    tfl = [r for r in result.parity.records if r.format == "tflite"]
    assert tfl and all(r.passed for r in tfl)
    assert not [r for r in result.parity.records if r.format.split(" ")[0] in ("tflite_int8", "onnx_int8", "onnx_fp16")]
    assert doc["formats"]["tflite"]["explores"] is True and doc["formats"]["tflite_int8"]["explores"] is False
    assert "explore_refused" in doc["formats"]["tflite_int8"]
    ops = doc["formats"]["tflite"]["ops"]
    assert ops and not any(op.startswith("CUSTOM") or op in ("FLEX_DELEGATE",) for op in ops)
    assert main(["verify", str(out), "--device", "cpu"]) == 0


def test_tflite_runs_in_litert_with_the_signature_keys(edge_exports):
    Interpreter = _litert()
    from policy_export.exporter.parity.plan import load_plan  # noqa: F401 (the golden files are plain npz)

    for name in ("cartpole_mlp", "cartpole_lstm"):
        _, out = edge_exports(name)
        doc = _manifest(out)
        interpreter = Interpreter(model_path=str(out / "model.tflite"), num_threads=1)
        signatures = interpreter.get_signature_list()
        signature = signatures["serving_default"]
        contract_out = [o["key"] for o in doc["contract"]["outputs"]]
        assert sorted(signature["outputs"]) == sorted(contract_out)
        required = [i["key"] for i in doc["contract"]["inputs"] if i["required"]]
        assert sorted(signature["inputs"]) == sorted(required)  # what the contract calls required, alone
        assert "explore" in signatures["serving_explore"]["inputs"]  # the second signature samples
        golden_in = dict(np.load(out / "parity" / "inputs.npz"))
        golden_out = dict(np.load(out / "parity" / "outputs.npz"))
        runner = interpreter.get_signature_runner("serving_default")
        feeds = {k: golden_in[k][:64] for k in required}
        got = runner(**feeds)  # a client feeding the required inputs gets the deterministic policy
        np.testing.assert_array_equal(got["actions_0"], golden_out["actions_0"][:64])
        for key in contract_out:
            if golden_out[key].dtype.kind == "f":
                np.testing.assert_allclose(got[key], golden_out[key][:64], atol=1e-5, rtol=1e-5)


def test_tflite_runner_feeds_defaults_and_refuses_explore_where_fixed(edge_exports):
    from policy_export.exporter import formats
    from policy_export.exporter.devices import plan_devices
    from policy_export.errors import InputError

    _, out = edge_exports("cartpole_mlp")
    doc = _manifest(out)
    obs = np.zeros((5, 4), np.float32)
    with formats.get("tflite").open(out / "model.tflite", doc, plan_devices("cpu")) as runner:
        assert runner.device_info()["tflite_interpreter"] in ("ai_edge_litert", "tensorflow.lite")
        assert runner({"observations": obs})["actions_0"].shape == (5,)  # explore fed its default
        sampled = np.concatenate([runner({"observations": obs, "explore": np.array(True)})["actions_0"]
                                  for _ in range(20)])
        assert len(set(sampled.tolist())) == 2  # unseeded: fresh draws on every call
        with pytest.raises(InputError, match="dtype float64"):
            runner({"observations": obs.astype(np.float64)})
    with formats.get("tflite_int8").open(out / "model_int8.tflite", doc, plan_devices("cpu")) as runner:
        assert "explore" not in runner.inputs
        runner({"observations": obs, "explore": np.array(False)})
        with pytest.raises(InputError, match="fixed to its default"):
            runner({"observations": obs, "explore": np.array(True)})


def test_behaviour_records_hold_agreement_and_box_error(edge_exports):
    result, _ = edge_exports("cartpole_mlp")
    by = {(c.format, c.key): c for c in result.parity.behaviour}
    int8 = by[("onnx_int8", "actions_0")]
    assert int8.metric == "agreement" and 0.99 <= int8.value < 1.0 and int8.samples == 500
    assert int8.extra["differing"] == round((1 - int8.value) * 500)
    assert by[("onnx_fp16", "actions_0")].value == 1.0
    result, _ = edge_exports("pendulum_mlp")
    by = {(c.format, c.key): c for c in result.parity.behaviour}
    box = by[("onnx_int8", "actions_0")]
    assert box.metric == "box_error" and box.extra["range"] == 4.0  # Pendulum's torque: [-2, 2]
    assert 1e-3 < box.value < 0.02 and box.extra["max_fraction"] >= box.extra["p99_fraction"] >= box.value
    assert by[("onnx_fp16", "actions_0")].value < 1e-3
    result, _ = edge_exports("cartpole_lstm")
    stepped = [c for c in result.parity.behaviour if c.format == "onnx_int8 (stepped 200)"]
    assert {c.key for c in stepped} >= {"actions_0", "state_out_0", "state_out_1"}
    action = next(c for c in stepped if c.key == "actions_0")
    assert action.samples == 800 and action.value >= 0.99
    state = next(c for c in stepped if c.key == "state_out_1")
    assert state.metric == "error" and 0 < state.max_abs_err < 0.1


def test_a_missed_threshold_fails_export_and_verify(edge_exports, tmp_path):
    from policy_export.exporter import export_spec
    from policy_export.exporter.api import ParityFailedError
    from policy_export.exporter.cli import main

    target = tmp_path / "strict"
    with pytest.raises(ParityFailedError, match=r"onnx_int8/actions_0: .* identical .*at least 100\.00% required"):
        export_spec(FIXTURES_DIR / "cartpole_mlp", target, device="cpu", samples=500, explore_samples=0,
                    formats=["onnx_int8"], behaviour={"onnx_int8": {"min_agreement": 1.0}})
    assert not target.exists()
    _, out = edge_exports("cartpole_mlp")
    assert main(["verify", str(out), "--device", "cpu", "--behaviour", "onnx_int8:min_agreement=1"]) == 1
    assert main(["verify", str(out), "--device", "cpu", "--behaviour", "max_box_error=0.5"]) == 0
    assert main(["verify", str(out), "--behaviour", "onnx_int8:min_agreement=2"]) == 2
    assert main(["verify", str(out), "--behaviour", "tflite:min_agreement=0.5"]) == 2  # not a lossy format


def test_a_corrupted_quantised_model_fails_verify(edge_exports, tmp_path):
    """A lossy model that still loads but acts differently, re-signed into the manifest: verify fails."""
    import shutil

    import onnx
    from onnx import numpy_helper

    from policy_export.exporter import manifest
    from policy_export.exporter.cli import main

    _, src = edge_exports("cartpole_mlp")
    out = tmp_path / "resigned"
    shutil.copytree(src, out)
    model = onnx.load(str(out / "model_int8.onnx"))
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        if value.dtype == np.int8 and value.size >= 16:
            init.CopyFrom(numpy_helper.from_array(-value, init.name))  # flip the quantised weights
    onnx.save(model, str(out / "model_int8.onnx"))
    doc = _manifest(out)
    doc["files"] = manifest.file_records(out)
    (out / "manifest.json").write_text(json.dumps(doc, indent=2))
    assert main(["verify", str(out), "--device", "cpu"]) == 1


def test_rollout_of_quantised_cartpole_is_within_five_percent(edge_exports):
    from policy_export.exporter.rollout import rollout

    _, out = edge_exports("cartpole_mlp")
    report = rollout(out, "CartPole-v1", episodes=5, seed=0, device="cpu", formats=["onnx_int8", "tflite"])
    assert report.formats == ["saved_model", "onnx_int8", "tflite"]  # the float model is the reference
    assert report.lossy == ("onnx_int8",)
    assert report.passed
    assert abs(report.relative_return_difference("onnx_int8")) <= 0.05
    assert report.return_difference("tflite") == 0.0 and report.max_deviation("tflite") == 0
    strict = rollout(out, "CartPole-v1", episodes=2, seed=8, device="cpu", formats=["onnx_int8"],
                     return_tolerance=0.0)
    assert strict.to_json()["relative_return_difference"]["onnx_int8"] == strict.relative_return_difference("onnx_int8")
    assert strict.passed == (strict.return_difference("onnx_int8") == 0.0)
