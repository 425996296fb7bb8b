"""The ``triton`` format: each config.pbtxt parsed with Triton's own ModelConfig schema
(tritonclient's model_config_pb2), checked against its ONNX model by the rules Triton's ONNX
Runtime backend applies when it loads a model, and the models run as the server would feed them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES_DIR, spec_exports

FIXTURES = ["cartpole_mlp", "dict_image_vector", "cartpole_lstm", "tuple_action"]


@pytest.fixture(scope="module")
def triton_exports(tmp_path_factory):
    """``triton_exports(name)`` -> the path of the fixture's export with a Triton repository."""
    get = spec_exports(tmp_path_factory, "triton", lambda name: {
        "samples": 200, "explore_samples": 2000, "formats": ["saved_model", "triton"],
        "model_name": f"{name}-policy", "model_version": 3})
    return lambda name: get(name)[1]


def _schema():
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        pytest.skip(f"tritonclient[grpc] is not installed (the serving extra): {e}")
    return text_format, model_config_pb2


def _parse(path):
    text_format, pb = _schema()
    return text_format.Parse(path.read_text(), pb.ModelConfig()), pb


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


_ORT = {"tensor(float)": "TYPE_FP32", "tensor(int64)": "TYPE_INT64", "tensor(int32)": "TYPE_INT32",
        "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(double)": "TYPE_FP64"}


def _backend_rules(config, pb, session):
    """What Triton's ONNX Runtime backend checks when it loads the model (ValidateInputs,
    ValidateOutputs, ValidateBooleanSequenceControl); returns the problems."""
    problems = []
    dtype = lambda v: pb.DataType.Name(v)  # noqa: E731
    required = [i for i in config.input if not i.optional]
    expected = len(required) + len(config.sequence_batching.control_input) + len(config.sequence_batching.state)
    model_inputs = {a.name: a for a in session.get_inputs()}
    overridable = {a.name: a for a in session.get_overridable_initializers()}
    if len(model_inputs) != expected:
        problems.append(f"configuration expects {expected} inputs, model provides {len(model_inputs)}")
    skip = 1 if config.max_batch_size > 0 else 0
    for io in (*config.input, *config.output):  # core: no empty reshape in a model that does not batch
        if config.max_batch_size == 0 and io.HasField("reshape") and not io.reshape.shape:
            problems.append(f"{io.name}: empty reshape in a model that does not batch")
    for state in config.sequence_batching.state:  # core's sequence batcher: a concrete initial state
        if any(d < 0 for d in state.initial_state[0].dims) or not state.initial_state[0].name:
            problems.append(f"state {state.input_name}: initial_state needs fixed dims and a name")
    for io in config.input:
        if io.optional and config.max_batch_size != 0:
            problems.append(f"optional input {io.name} in a model that batches")
        arg = model_inputs.get(io.name) or overridable.get(io.name)
        if arg is None:
            problems.append(f"no model input {io.name}")
            continue
        problems += _compare(io, arg, skip, dtype)
    outputs = {a.name: a for a in session.get_outputs()}
    for io in config.output:
        if io.name not in outputs:
            problems.append(f"no model output {io.name}")
        else:
            problems += _compare(io, outputs[io.name], skip, dtype, exact=True)
    for control in config.sequence_batching.control_input:
        arg = model_inputs[control.name]
        if [d if isinstance(d, int) else -1 for d in arg.shape][skip:] != [1]:
            problems.append(f"control {control.name} has dims {arg.shape}")
    for state in config.sequence_batching.state:
        if state.input_name not in model_inputs or state.output_name not in outputs:
            problems.append(f"state {state.input_name}/{state.output_name} not in the model")
        else:
            problems += _compare(state, model_inputs[state.input_name], skip, dtype)
    return problems


def _compare(io, arg, skip: int, dtype, exact: bool = False) -> list[str]:
    """The backend's dims check: inputs loosely (-1 in the model takes any size), outputs exactly."""
    name = getattr(io, "name", None) or io.input_name
    if _ORT[arg.type] != dtype(io.data_type):
        return [f"{name}: config {dtype(io.data_type)}, model {arg.type}"]
    model = [d if isinstance(d, int) else -1 for d in arg.shape]
    if not model:
        return [] if all(d == 1 for d in io.dims) else [f"scalar {name} declared {list(io.dims)}"]
    has_reshape = "reshape" in io.DESCRIPTOR.fields_by_name and io.HasField("reshape")
    dims = list(io.reshape.shape) if has_reshape else list(io.dims)
    model = model[skip:]
    if len(model) != len(dims) or any(m != d if exact else (m != -1 and m != d) for m, d in zip(model, dims)):
        return [f"{name}: model dims {model} vs config {dims}"]
    return []


@pytest.mark.parametrize("name", FIXTURES)
def test_every_config_parses_with_tritons_schema_and_matches_its_model(name, triton_exports):
    out = triton_exports(name)
    doc = json.loads((out / "manifest.json").read_text())
    info = doc["formats"]["triton"]
    contract = doc["contract"]
    required = {s["key"] for s in contract["inputs"] if s["required"]}
    states = {s["key"] for s in contract["inputs"] if s["key"].startswith("state_in_")}
    model_name = f"{name}-policy"
    assert set(info["models"]) == {model_name, model_name + "_explore"}
    for entry, record in info["models"].items():
        config, pb = _parse(out / "triton" / record["config"])
        assert config.name == entry and config.backend == "onnxruntime"
        assert list(config.version_policy.specific.versions) == [3]
        assert (out / "triton" / entry / "3" / "model.onnx").is_file()
        problems = _backend_rules(config, pb, _session(out / "triton" / entry / "3" / "model.onnx"))
        assert problems == [], problems
        names = {i.name for i in config.input}
        outputs = {o.name for o in config.output}
        assert outputs == {s["key"] for s in contract["outputs"] if not s["key"].startswith("state_out_")}
        if config.max_batch_size > 0:
            assert config.max_batch_size == 256 and not any(i.optional for i in config.input)
            assert names == required - states - {"seq_lens"}
        else:
            assert {i.name for i in config.input if i.optional} == {"explore", "is_training", "timestep"}
        if states:
            assert {s.input_name for s in config.sequence_batching.state} == states
            assert all(s.initial_state[0].zero_data for s in config.sequence_batching.state)
            start = config.sequence_batching.control_input[0]
            assert start.name == "START" and start.control[0].kind == pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START
            assert list(start.control[0].int32_false_true) == [0, 1]
        elif config.max_batch_size > 0:
            assert config.HasField("dynamic_batching")


def test_a_config_the_schema_rejects_is_caught(tmp_path):
    from policy_export.errors import ConversionError
    from policy_export.exporter.formats.triton.config import check_with_triton_schema

    _schema()
    assert check_with_triton_schema('name: "x"\nmax_batch_size: 4\n', "ok")
    with pytest.raises(ConversionError, match="no_such_field"):
        check_with_triton_schema('name: "x"\nno_such_field: 1\n', "bad")


def _saved_model(out):
    from policy_export.exporter import formats
    from policy_export.exporter.devices import plan_devices

    doc = json.loads((out / "manifest.json").read_text())
    return formats.get("saved_model").open(out / "saved_model", doc, plan_devices("cpu"))


def test_the_batched_model_batches_like_dynamic_batching(triton_exports):
    out = triton_exports("cartpole_mlp")
    session = _session(out / "triton" / "cartpole_mlp-policy" / "3" / "model.onnx")
    obs = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    together = session.run(None, {"observations": obs})
    one_by_one = [session.run(None, {"observations": obs[i:i + 1]}) for i in range(8)]
    for k, batched in enumerate(together):
        np.testing.assert_allclose(batched, np.concatenate([r[k] for r in one_by_one]), rtol=1e-6, atol=1e-6)
    with _saved_model(out) as tf_runner:
        ref = tf_runner({"observations": obs})
    names = [o.name for o in session.get_outputs()]
    np.testing.assert_array_equal(dict(zip(names, together))["actions_0"], ref["actions_0"])
    np.testing.assert_allclose(dict(zip(names, together))["action_dist_inputs"], ref["action_dist_inputs"], atol=1e-5)


def test_the_sampling_model_samples_only_when_explore_is_sent(triton_exports):
    out = triton_exports("cartpole_mlp")
    session = _session(out / "triton" / "cartpole_mlp-policy_explore" / "3" / "model.onnx")
    assert [a.name for a in session.get_inputs()] == ["observations"]  # explore and the rest: optional
    obs = np.zeros((500, 4), np.float32)
    greedy = session.run(["actions_0"], {"observations": obs})[0]
    sampled = session.run(["actions_0"], {"observations": obs, "explore": np.asarray(True)})[0]
    assert len(set(greedy.tolist())) == 1
    assert 0.05 < np.mean(sampled != greedy) < 0.95


def test_implicit_state_as_the_sequence_batcher_feeds_it(triton_exports):
    """Two sequences batched in one model: each step sends observations alone; the server feeds back
    the state the model returned, and START on a sequence's first step zeroes whatever it held."""
    out = triton_exports("cartpole_lstm")
    session = _session(out / "triton" / "cartpole_lstm-policy" / "3" / "model.onnx")
    names = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(1)
    steps = 12
    obs = rng.normal(size=(steps, 2, 4)).astype(np.float32)
    state = [rng.normal(size=(2, 32)).astype(np.float32) * 5 for _ in range(2)]  # stale state from an old sequence
    prev_action, prev_reward = np.zeros(2, np.int64), np.zeros(2, np.float32)
    served, reference = [], []
    with _saved_model(out) as tf_runner:
        ref_state = [np.zeros((2, 32), np.float32) for _ in range(2)]
        for t in range(steps):
            start = np.full((2, 1), 1 if t == 0 else 0, np.int32)
            feeds = {"observations": obs[t], "prev_action": prev_action, "prev_reward": prev_reward,
                     "state_in_0": state[0], "state_in_1": state[1], "START": start}
            got = dict(zip(names, session.run(None, feeds)))
            state = [got["state_out_0"], got["state_out_1"]]
            ref = tf_runner({"observations": obs[t], "prev_action": prev_action, "prev_reward": prev_reward,
                             "state_in_0": ref_state[0], "state_in_1": ref_state[1], "seq_lens": np.ones(2, np.int32)})
            ref_state = [ref["state_out_0"], ref["state_out_1"]]
            served.append(got["action_dist_inputs"])
            reference.append(ref["action_dist_inputs"])
            prev_action, prev_reward = got["actions_0"], rng.normal(size=2).astype(np.float32)
    np.testing.assert_allclose(np.stack(served), np.stack(reference), atol=1e-5, rtol=1e-5)


def test_export_verify_and_a_tampered_config(triton_exports, tmp_path):
    import shutil

    from policy_export.exporter.cli import main

    out = triton_exports("tuple_action")
    assert main(["verify", str(out), "-q"]) == 0
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    config = copy / "triton" / "tuple_action-policy" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 256", "max_batch_size: 8"))
    assert main(["verify", str(copy), "-q"]) == 1


def test_an_op_onnx_runtime_lacks_refuses_the_format_naming_it(monkeypatch, tmp_path):
    from policy_export.exporter.cli import main
    from policy_export.exporter.formats import coverage

    kernels = dict(coverage._ort_cpu_kernels())
    kernels.pop(("ai.onnx", "Tanh"))
    monkeypatch.setattr(coverage, "_ort_cpu_kernels", lambda: kernels)
    out = tmp_path / "out"
    code = main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--formats", "saved_model,triton",
                 "--samples", "50", "--explore-samples", "0", "-q"])
    assert code == 4
    doc = json.loads((out / "manifest.json").read_text())
    assert "ai.onnx::Tanh" in doc["missing"]["triton"] and "ONNX Runtime" in doc["missing"]["triton"]
    assert "in node" in doc["missing"]["triton"] and not (out / "triton").exists()


def test_a_model_name_a_server_cannot_use_is_refused(tmp_path):
    from policy_export.exporter.cli import main

    code = main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "o"), "--formats", "triton",
                 "--model-name", "a/b", "-q"])
    assert code == 2 and not (tmp_path / "o").exists()


def test_inspect_and_diff_read_a_triton_model_directory(triton_exports, capsys):
    from policy_export.exporter.cli import main

    _schema()
    out = triton_exports("cartpole_lstm")
    repo = out / "triton"
    assert main(["inspect", str(repo / "cartpole_lstm-policy"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "triton" and doc["signature_key"] == "cartpole_lstm-policy"
    assert [(i["key"], i["dtype"], i["shape"]) for i in doc["inputs"]] == [
        ("observations", "float32", [None, 4]), ("prev_action", "int64", [None]), ("prev_reward", "float32", [None])]
    # a repository holding two models is not guessed at
    assert main(["inspect", str(repo)]) == 2
    assert "name one" in capsys.readouterr().err
    # the same model is compatible with itself; the sampling model takes more (optional) inputs
    assert main(["diff", str(repo / "cartpole_lstm-policy"), str(repo / "cartpole_lstm-policy")]) == 0
    assert "no change to any input or output" in capsys.readouterr().out
    assert main(["diff", str(repo / "cartpole_lstm-policy_explore"), str(repo / "cartpole_lstm-policy"), "--json"]) == 1
    changes = json.loads(capsys.readouterr().out)["changes"]
    assert {c["key"] for c in changes if c["what"] == "was removed"} == {"explore", "is_training", "timestep"}


def test_a_config_that_is_not_a_model_config_is_an_input_error(tmp_path, capsys):
    from policy_export.exporter.cli import main

    _schema()
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "m"\nplatform: 7 7\n')
    assert main(["inspect", str(model)]) == 2
    assert "not a valid Triton ModelConfig" in capsys.readouterr().err


def test_when_the_sampling_branch_does_not_convert_the_deterministic_model_is_served(monkeypatch, tmp_path):
    from policy_export.errors import ConversionError
    from policy_export.exporter import export_spec
    from policy_export.exporter.formats.onnx import compress

    def refuse(ctx, stage):
        raise ConversionError("tf2onnx: no converter for the sampling op")

    monkeypatch.setattr(compress, "full_onnx", refuse)
    out = tmp_path / "out"
    result = export_spec(FIXTURES_DIR / "cartpole_lstm", out, device="cpu", samples=50, explore_samples=0,
                         stepped_steps=10, formats=["saved_model", "triton"])
    info = result.manifest["formats"]["triton"]
    assert result.parity.passed and "no converter for the sampling op" in info["explore_refused"]
    assert list(info["models"]) == ["cartpole_lstm"] and info["explores"] is False
    assert info["models"]["cartpole_lstm"]["outputs"] == ["actions_0"]
    checked = {k.split("/")[1] for k in result.manifest["parity"]["max_abs_err"] if k.startswith("triton")}
    assert checked == {"actions_0", "state_out_0", "state_out_1"}
