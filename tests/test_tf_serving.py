"""The ``tf_serving`` format: a TF Serving base path, its models.config and golden predict requests.

What needs TF Serving's own protos (``tensorflow-serving-api``) skips without it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tensorflow as tf

from conftest import FIXTURES_DIR
from policy_export.errors import ExportError, InputError
from policy_export.exporter import export_spec, formats
from policy_export.exporter.cli import main
from policy_export.exporter.devices import plan_devices
from policy_export.exporter.formats.tf_serving import golden, layout

SERVING_API = "tensorflow-serving-api (TF Serving's protos) is not installed"
EXPORTS = {  # fixture -> model name; each exported once for this module
    "cartpole_mlp": "cartpole",
    "cartpole_lstm": "cartpole_lstm",
    "dict_image_vector": "dict.image-vector",
    "pendulum_mlp": "pendulum",
    "tuple_action": "tuple_action",
}


def serving_protos():
    pytest.importorskip("tensorflow_serving", reason=SERVING_API)
    from tensorflow_serving.apis import predict_pb2
    from tensorflow_serving.config import model_server_config_pb2

    return predict_pb2, model_server_config_pb2


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(fixture: str):
        if fixture not in made:
            out = tmp_path_factory.mktemp("tf_serving") / fixture
            samples = (300, 2000) if fixture == "cartpole_mlp" else (40, 200)
            result = export_spec(FIXTURES_DIR / fixture, out, device="cpu", samples=samples[0],
                                 explore_samples=samples[1], stepped_steps=20,
                                 formats=["saved_model", "tf_serving"], model_name=EXPORTS[fixture])
            made[fixture] = (result, out)
        return made[fixture]

    return get


def model_dir(out, fixture):
    return out / "tf_serving" / EXPORTS[fixture]


def read_json(path):
    return json.loads(path.read_text(encoding="utf-8"))


def test_is_an_opt_in_directory_format():
    fmt = formats.get("tf_serving")
    assert fmt.is_directory and fmt.path == "tf_serving"
    assert not fmt.capabilities.default and "tf_serving" not in formats.default_names()
    assert fmt.capabilities.signature and fmt.capabilities.explores and fmt.capabilities.steps_state


@pytest.mark.parametrize("fixture", sorted(EXPORTS))
def test_layout_version_directory_holds_the_saved_model_alone(fixture, exported):
    result, out = exported(fixture)
    name = EXPORTS[fixture]
    assert result.parity.passed
    base = model_dir(out, fixture)
    assert sorted(p.name for p in base.iterdir()) == ["1", "requests"]  # "requests" is not a number: no version
    assert sorted(p.name for p in (base / "1").iterdir()) == ["saved_model.pb", "variables"]
    info = result.manifest["formats"]["tf_serving"]
    assert (info["model_name"], info["model_version"]) == (name, 1)
    assert info["saved_model"] == f"tf_serving/{name}/1" and info["base_path"] == f"/models/{name}"
    assert info["mount"]["source"] == f"tf_serving/{name}" and info["mount"]["target"] == f"/models/{name}"
    assert info["requests"]["signature"] == "serving_default"
    listed = {f["path"] for f in result.files if f["path"].startswith("tf_serving/")}
    assert listed == set(info["files"]) and f"tf_serving/{name}/requests/predict_response.json" in listed
    ran = {r.format for r in result.parity.records}
    assert "tf_serving" in ran and "tf_serving (explore)" in ran  # golden and exploration parity ran on it


def test_models_config_parses_with_tf_servings_own_proto(exported):
    _, config_pb2 = serving_protos()
    from google.protobuf import text_format

    _, out = exported("cartpole_mlp")
    text = (out / "tf_serving" / "models.config").read_text(encoding="utf-8")
    config = text_format.Parse(text, config_pb2.ModelServerConfig())
    (model,) = config.model_config_list.config
    assert model.name == "cartpole" and model.base_path == "/models/cartpole"
    assert model.model_platform == "tensorflow"
    assert list(model.model_version_policy.specific.versions) == [1]
    assert text == text_format.MessageToString(config)  # exactly what TF Serving's proto prints
    for name, version in (("a", 7), ("m.v-2_x", 2**63 - 1)):  # the writer's text for other names/versions
        built = config_pb2.ModelServerConfig()
        entry = built.model_config_list.config.add(name=name, base_path=f"/models/{name}", model_platform="tensorflow")
        entry.model_version_policy.specific.versions.append(version)
        assert layout.model_config_text(name, f"/models/{name}", version) == text_format.MessageToString(built)


def _json_tensors(doc, section, keys):
    """The JSON's tensors by key (a REST answer with a single output holds the bare value)."""
    return doc[section] if len(keys) != 1 or section == "inputs" else {keys[0]: doc[section]}


@pytest.mark.parametrize("fixture", sorted(EXPORTS))
def test_pb_request_and_response_hold_the_json_values(fixture, exported):
    predict_pb2, _ = serving_protos()
    result, out = exported(fixture)
    requests = model_dir(out, fixture) / "requests"
    body, answer = read_json(requests / "predict_request.json"), read_json(requests / "predict_response.json")
    assert body["signature_name"] == "serving_default"
    request = predict_pb2.PredictRequest.FromString((requests / "predict_request.pb").read_bytes())
    response = predict_pb2.PredictResponse.FromString((requests / "predict_response.pb").read_bytes())
    for spec in (request.model_spec, response.model_spec):
        assert (spec.name, spec.version.value, spec.signature_name) == (EXPORTS[fixture], 1, "serving_default")
    contract = result.manifest["contract"]
    # the required inputs alone: the SignatureDef's defaults hold the optional ones
    assert set(request.inputs) == set(body["inputs"]) == {s["key"] for s in contract["inputs"] if s["required"]}
    for key, proto in request.inputs.items():
        value = tf.make_ndarray(proto)
        assert value.dtype == np.dtype(next(s["dtype"] for s in contract["inputs"] if s["key"] == key))
        np.testing.assert_array_equal(value, np.asarray(body["inputs"][key], value.dtype))
    outputs = _json_tensors(answer, "outputs", [s["key"] for s in contract["outputs"]])
    assert set(response.outputs) == set(outputs)
    for key, proto in response.outputs.items():
        value = tf.make_ndarray(proto)
        np.testing.assert_array_equal(value, np.asarray(outputs[key], value.dtype))
    # byte for byte what TF Serving's own classes serialise (map entries in key order)
    assert request.SerializeToString(deterministic=True) == (requests / "predict_request.pb").read_bytes()
    assert response.SerializeToString(deterministic=True) == (requests / "predict_response.pb").read_bytes()


@pytest.mark.parametrize("fixture", sorted(EXPORTS))
def test_json_request_run_through_the_saved_model_gives_the_json_response(fixture, exported):
    result, out = exported(fixture)
    base = model_dir(out, fixture)
    body, answer = read_json(base / "requests/predict_request.json"), read_json(base / "requests/predict_response.json")
    contract = result.manifest["contract"]
    dtypes = {s["key"]: s["dtype"] for s in contract["inputs"] + contract["outputs"]}
    tensors = {k: tf.constant(np.asarray(v, dtypes[k])) for k, v in body["inputs"].items()}
    # as TF Serving's predict path does (saved_model::GetInputValues): inputs the request leaves
    # out are fed the SignatureDef's defaults; without them it would refuse the request
    signature = _signature_def(base / "1", body["signature_name"])
    assert set(signature.inputs) - set(tensors) == set(signature.defaults) == {
        s["key"] for s in contract["inputs"] if not s["required"]}
    for key, proto in signature.defaults.items():
        tensors[key] = tf.constant(tf.make_ndarray(proto))
        spec = next(s for s in contract["inputs"] if s["key"] == key)
        assert tf.make_ndarray(proto).tolist() == spec["default"]
    loaded = tf.saved_model.load(str(base / "1"))
    got = loaded.signatures[body["signature_name"]](**tensors)
    expected = _json_tensors(answer, "outputs", [s["key"] for s in contract["outputs"]])
    assert set(got) == set(expected)
    for key, value in got.items():
        np.testing.assert_allclose(value.numpy(), np.asarray(expected[key], dtypes[key]), rtol=0, atol=1e-6)
    assert "explore" not in body["inputs"]  # left to its default: the deterministic action


def _signature_def(saved_model_dir, key):
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel.FromString((saved_model_dir / "saved_model.pb").read_bytes())
    return proto.meta_graphs[0].signature_def[key]


def test_recurrent_request_starts_sequences_from_the_initial_state(exported):
    _, out = exported("cartpole_lstm")
    body = read_json(model_dir(out, "cartpole_lstm") / "requests/predict_request.json")["inputs"]
    rows = len(body["observations"])
    assert rows == golden.ROWS and body["seq_lens"] == [1] * rows
    for key in ("state_in_0", "state_in_1"):
        assert np.asarray(body[key]).shape == (rows, 32) and not np.any(body[key])
    assert body["prev_action"] == [0] * rows and body["prev_reward"] == [0.0] * rows


def test_json_floats_are_the_float32_values_exactly():
    values = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)
    text = json.dumps(golden.rest_request("serving_default", {"x": values}))
    np.testing.assert_array_equal(np.asarray(json.loads(text)["inputs"]["x"], np.float32), values)
    assert golden.rest_response({"only": np.array([1.5])}) == {"outputs": [1.5]}  # one output: the bare value


@pytest.mark.parametrize("fixture", sorted(EXPORTS))
def test_every_signature_passes_tensorflows_servability_check(fixture, exported):
    from policy_export.exporter.trust import read_saved_model

    _, out = exported(fixture)
    metas = read_saved_model(model_dir(out, fixture) / "1").meta_graphs
    signatures = {k: s for m in metas for k, s in m.signature_def.items() if not k.startswith("__")}
    assert "serving_default" in signatures
    assert all(tf.compat.v1.saved_model.is_valid_signature(s) for s in signatures.values())


def test_an_unservable_signature_is_refused_by_name(tmp_path):
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    meta = proto.meta_graphs.add()
    meta.meta_info_def.tags.append("serve")
    good = meta.signature_def["serving_default"]
    good.method_name = "tensorflow/serving/predict"
    good.inputs["x"].name, good.outputs["y"].name = "x:0", "y:0"
    meta.signature_def["scores"].method_name = "tensorflow/serving/classify"  # classify needs string inputs
    meta.signature_def["scores"].inputs["x"].name = "x:0"
    (tmp_path / "saved_model.pb").write_bytes(proto.SerializeToString())
    with pytest.raises(ExportError, match="signature 'scores'.*cannot be served"):
        layout.check_servable(tmp_path)
    del meta.signature_def["scores"]
    (tmp_path / "saved_model.pb").write_bytes(proto.SerializeToString())
    assert layout.check_servable(tmp_path) == ["serving_default"]


def test_illegal_model_names_are_refused(tmp_path):
    with pytest.raises(InputError, match="model name"):
        export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "out", formats=["tf_serving"], model_name="a/b")
    assert main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "cli"), "--formats",
                 "tf_serving", "--model-name", "a/b"]) == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / "cli").exists()
    for name, version in (("../up", 1), ("a/b", 1), ("ok", 0), ("ok", True), (None, 1)):
        with pytest.raises(ExportError):
            layout.Layout.of(tmp_path, name, version)


def test_a_manifest_naming_another_path_is_not_followed(exported):
    result, out = exported("cartpole_mlp")
    doc = json.loads(json.dumps(result.manifest))
    doc["formats"]["tf_serving"]["model_name"] = "../saved_model"
    with pytest.raises(ExportError, match="not a legal model name"):
        formats.get("tf_serving").open(out / "tf_serving", doc, plan_devices("cpu"))


def test_verify_passes_and_a_tampered_golden_response_is_named(exported, tmp_path, capsys):
    _, out = exported("cartpole_mlp")
    assert main(["verify", str(out), "--samples", "50"]) == 0
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    response = model_dir(copy, "cartpole_mlp") / "requests/predict_response.json"
    doc = read_json(response)
    doc["outputs"]["actions_0"][0] = 1 - doc["outputs"]["actions_0"][0]
    response.write_text(json.dumps(doc) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["verify", str(copy), "--samples", "50"]) != 0
    printed = capsys.readouterr()
    assert "tf_serving/cartpole/requests/predict_response.json" in printed.out + printed.err


def test_inspect_and_diff_read_a_base_path_and_its_newest_version(exported, tmp_path, capsys):
    import shutil

    from policy_export.exporter.cli import main

    _, out = exported("cartpole_mlp")
    base = model_dir(out, "cartpole_mlp")
    for where in (out / "tf_serving", base):  # the layout, or one model's base path
        assert main(["inspect", str(where), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["kind"] == "tf_serving" and doc["signature_key"] == "serving_default"
        assert {i["key"]: i["required"] for i in doc["inputs"]} == {
            "observations": True, "explore": False, "is_training": False, "timestep": False}
    # a newer version of another policy in the same base path: diff sees the interface change
    served = tmp_path / "served"
    shutil.copytree(base, served / "cartpole")
    _, other = exported("pendulum_mlp")
    shutil.copytree(model_dir(other, "pendulum_mlp") / "1", served / "cartpole" / "2")
    assert main(["diff", str(base), str(served / "cartpole"), "--json"]) == 1
    changes = json.loads(capsys.readouterr().out)["changes"]
    assert any(c["key"] == "observations" and c["kind"] == "breaking" for c in changes)
