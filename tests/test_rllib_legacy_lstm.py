"""Converting RLlib 2.0.1 LSTM SavedModels (whole training graph, LSTM as a while loop) to one-step exports.

Fixtures (committed, see their make scripts): ``fixtures/rllib/legacy/lstm`` (CartPole, Discrete,
prev action and reward, cell 16, TF1 control flow) and ``fixtures/rllib/legacy/lstm_alt``
(Pendulum, Box action, no prev inputs, cell 12, control flow v2). Each export's ONNX model is
stepped 200 times over 4 sequences carrying its own state and compared with RLlib's own
``compute_actions`` outputs and with the original SavedModel's session (its loop, explore off).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from policy_export.exporter.convert import convert_saved_model
from policy_export.exporter.sources.lstm_step import one_step_outputs
from policy_export.errors import ExportError

tf1 = tf.compat.v1
ort = pytest.importorskip("onnxruntime")
LEGACY = Path(__file__).resolve().parents[1] / "fixtures" / "rllib" / "legacy"
ATOL = 1e-5
FLOAT_OUTPUTS = ("state_out_0", "state_out_1", "action_dist_inputs", "action_logp", "action_prob", "vf_preds")
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
              "tensor(double)": np.float64, "tensor(bool)": np.bool_}


@pytest.fixture(scope="module", params=["lstm", "lstm_alt"])
def converted(request, tmp_path_factory):
    case = LEGACY / request.param
    out = tmp_path_factory.mktemp(request.param) / "export"
    result = convert_saved_model(case / "saved_model", out)
    with np.load(case / "expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    return case, out, result, expected


def step_onnx(model: Path, expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Step the ONNX model through the recorded inputs, fed only what it requires, carrying its own state."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    required = {i.name: ORT_DTYPES[i.type] for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    steps, batch = expected["observations"].shape[:2]
    state = [expected["state_in_0"][0], expected["state_in_1"][0]]
    collected: dict[str, list] = {}
    for t in range(steps):
        feeds = {"observations": expected["observations"][t], "state_in_0": state[0], "state_in_1": state[1],
                 "seq_lens": np.ones(batch)}
        feeds.update({k: expected[k][t] for k in ("prev_action", "prev_reward") if k in expected})
        assert set(required) <= set(feeds), f"the model requires {sorted(required)}"
        out = dict(zip(names, session.run(None, {k: np.asarray(feeds[k]).astype(d) for k, d in required.items()})))
        state = [out["state_out_0"], out["state_out_1"]]
        for key, value in out.items():
            collected.setdefault(key, []).append(value)
    return {k: np.stack(v) for k, v in collected.items()}


def step_original(saved_model: Path, expected: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Step RLlib's own SavedModel (its LSTM loop) with explore off, carrying its own state."""
    graph = tf.Graph()
    with graph.as_default(), tf1.Session(graph=graph) as session:
        meta = tf1.saved_model.loader.load(session, ["serve"], str(saved_model))
        sig = meta.signature_def["serving_default"]
        inputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.inputs.items()}
        outputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.outputs.items()}
        state_in = sorted(k for k in inputs if ":" in k)
        state_out = sorted((k for k in outputs if ":" in k), key=lambda k: int(k.split(":")[0].rsplit("_", 1)[1]))
        fetch = {"actions_0": outputs["actions_0"], "state_out_0": outputs[state_out[0]],
                 "state_out_1": outputs[state_out[1]], **{k: outputs[k] for k in FLOAT_OUTPUTS[2:]}}
        explore = graph.get_tensor_by_name("default_policy/is_exploring:0")
        steps, batch = expected["observations"].shape[:2]
        state = [expected["state_in_0"][0], expected["state_in_1"][0]]
        collected: dict[str, list] = {}
        for t in range(steps):
            feeds = {inputs["observations"]: expected["observations"][t], inputs["seq_lens"]: np.ones(batch, np.int32),
                     inputs[state_in[0]]: state[0], inputs[state_in[1]]: state[1], explore: False}
            feeds.update({inputs[k]: expected[k][t] for k in ("prev_action", "prev_reward") if k in inputs})
            out = session.run(fetch, feeds)
            state = [out["state_out_0"], out["state_out_1"]]
            for key, value in out.items():
                collected.setdefault(key, []).append(value)
    return {k: np.stack(v) for k, v in collected.items()}


def assert_matches(reference: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    ref_actions = reference["actions"] if "actions" in reference else reference["actions_0"]
    actions = got["actions_0"].reshape(ref_actions.shape)
    if np.issubdtype(ref_actions.dtype, np.integer):
        np.testing.assert_array_equal(actions, ref_actions)
    else:
        np.testing.assert_allclose(actions, ref_actions, rtol=0, atol=ATOL)
    for key in FLOAT_OUTPUTS:
        np.testing.assert_allclose(got[key], reference[key].reshape(got[key].shape), rtol=0, atol=ATOL, err_msg=key)


def test_onnx_steps_like_rllib(converted):
    _, out, _, expected = converted
    got = step_onnx(out / "model.onnx", expected)
    assert got["state_out_0"].shape == expected["state_out_0"].shape
    assert_matches(expected, got)
    # the recurrent state really carries information: it changes over the 200 steps
    assert np.abs(np.diff(got["state_out_1"], axis=0)).max() > 1e-3


def test_onnx_steps_like_the_original_session(converted):
    case, out, _, expected = converted
    original = step_original(case / "saved_model", expected)
    got = step_onnx(out / "model.onnx", expected)
    assert_matches(original, got)


def test_export_holds_a_step_and_reports_stepped_parity(converted):
    import onnx

    _, out, result, _ = converted
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert not ops & {"Loop", "Scan", "SequenceInsert", "SequenceAt"}, ops
    frozen = tf1.GraphDef()
    frozen.ParseFromString((out / "frozen_graph.pb").read_bytes())
    assert not {n.op for n in frozen.node} & {"Enter", "Exit", "While", "StatelessWhile", "TensorListReserve",
                                              "TensorArrayV3"}
    report = json.loads((out / "parity" / "report.json").read_text())
    assert report["passed"]
    for fmt in ("saved_model", "frozen_graph", "onnx"):
        records = [r for r in report["records"] if r["format"] == f"{fmt} (stepped 200 vs sequences)"]
        assert {r["key"] for r in records} >= {"actions_0", "state_out_0", "state_out_1", "vf_preds"}
        errs = [r["max_abs_err"] for r in records]
        assert all(r["passed"] for r in records)
        assert all(isinstance(e, float) and 0 <= e <= ATOL for e in errs), errs
    onnx_errs = [r["max_abs_err"] for r in report["records"]
                 if r["format"] == "onnx (stepped 200 vs sequences)" and not r["exact"]]
    assert max(onnx_errs) > 0  # a different runtime: real, nonzero float differences
    assert result.manifest["source"]["key_mapping"]["state_out_0"].startswith("default_policy/model_1/lstm/while/")


# ---------------------------------------------------------------------------- graphs built here


def _lstm_graph(cell: int, obs_size: int, **lstm_args):
    """An RLlib-like TF1 graph: [B*T, obs] rows reshaped by seq_lens, masked Keras LSTM, a dense head."""
    import tf_keras

    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(0)
        obs = tf1.placeholder(tf.float32, (None, obs_size), name="obs")
        seq_lens = tf1.placeholder(tf.int32, (None,), name="seq_lens")
        h0 = tf1.placeholder(tf.float32, (None, cell), name="h")
        c0 = tf1.placeholder(tf.float32, (None, cell), name="c")
        batch = tf.shape(seq_lens)[0]
        time = tf.shape(obs)[0] // batch
        x = tf.reshape(tf_keras.layers.Dense(6, activation="tanh")(obs), [batch, time, 6])
        lstm = tf_keras.layers.LSTM(cell, return_sequences=True, return_state=True, **lstm_args)
        y, h, c = lstm(x, mask=tf.sequence_mask(seq_lens, time), initial_state=[h0, c0])
        head = tf.identity(tf_keras.layers.Dense(3)(tf.reshape(y, [-1, cell])), name="head")
        init = tf1.global_variables_initializer()
    session = tf1.Session(graph=graph)
    session.run(init)
    inputs = {"observations": obs, "seq_lens": seq_lens, "state_in_0": h0, "state_in_1": c0}
    outputs = {"actions_0": head, "state_out_0": h, "state_out_1": c}
    return session, inputs, outputs


@pytest.mark.parametrize("control_flow_v2", [False, True])
def test_step_reproduces_a_keras_lstm_loop(control_flow_v2):
    """Any cell size, activation pair and loop form: 12 steps of the one-step graph equal the loop over 12."""
    was = tf1.control_flow_v2_enabled()
    (tf1.enable_control_flow_v2 if control_flow_v2 else tf1.disable_control_flow_v2)()
    try:
        session, inputs, outputs = _lstm_graph(5, 4, activation="relu", recurrent_activation="sigmoid")
    finally:
        (tf1.enable_control_flow_v2 if was else tf1.disable_control_flow_v2)()
    step, sequence = one_step_outputs(session, inputs, outputs, ["state_in_0", "state_in_1"],
                                      ["state_out_0", "state_out_1"])
    assert sequence is not None and sequence.outputs["state_out_0"] is outputs["state_out_0"]
    rng = np.random.default_rng(1)
    steps, batch = 12, 3
    obs = rng.standard_normal((batch, steps, 4)).astype(np.float32)
    state0 = [rng.standard_normal((batch, 5)).astype(np.float32) for _ in range(2)]
    loop = session.run(outputs, {inputs["observations"]: obs.reshape(-1, 4), inputs["seq_lens"]: [steps] * batch,
                                 inputs["state_in_0"]: state0[0], inputs["state_in_1"]: state0[1]})
    state, heads = state0, []
    for t in range(steps):
        got = session.run(step, {inputs["observations"]: obs[:, t], inputs["seq_lens"]: np.ones(batch, np.int32),
                                 inputs["state_in_0"]: state[0], inputs["state_in_1"]: state[1]})
        state = [got["state_out_0"], got["state_out_1"]]
        heads.append(got["actions_0"])
    np.testing.assert_allclose(np.stack(heads, 1).reshape(-1, 3), loop["actions_0"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(state[0], loop["state_out_0"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(state[1], loop["state_out_1"], rtol=0, atol=ATOL)
    # a padding row (seq_lens 0) passes its state through
    got = session.run(step, {inputs["observations"]: obs[:, 0], inputs["seq_lens"]: np.array([1, 0, 1], np.int32),
                             inputs["state_in_0"]: state0[0], inputs["state_in_1"]: state0[1]})
    np.testing.assert_array_equal(got["state_out_1"][1], state0[1][1])
    assert not np.allclose(got["state_out_1"][0], state0[1][0])


def test_refuses_a_cell_it_cannot_rebuild():
    session, inputs, outputs = _lstm_graph(4, 3, recurrent_activation="hard_sigmoid")
    with pytest.raises(ExportError, match="activations"):
        one_step_outputs(session, inputs, outputs, ["state_in_0", "state_in_1"], ["state_out_0", "state_out_1"])


def test_cli_refuses_an_lstm_it_cannot_rebuild(tmp_path, capsys):
    """An RLlib-style SavedModel whose loop holds a cell this cannot rebuild: exit 2, one line naming it."""
    from policy_export.exporter.cli import main

    session, inputs, outputs = _lstm_graph(4, 3, recurrent_activation="hard_sigmoid")
    src = tmp_path / "saved_model"
    with session.graph.as_default():
        actions = tf.argmax(outputs["actions_0"], axis=-1, name="actions")
        info = tf1.saved_model.utils.build_tensor_info
        sig = tf1.saved_model.signature_def_utils.build_signature_def(
            inputs={"observations": info(inputs["observations"]), "seq_lens": info(inputs["seq_lens"]),
                    "h:0": info(inputs["state_in_0"]), "c:0": info(inputs["state_in_1"])},
            outputs={"actions_0": info(actions), "lstm_h:0": info(outputs["state_out_0"]),
                     "lstm_c:0": info(outputs["state_out_1"])},
            method_name="tensorflow/serving/predict")
        builder = tf1.saved_model.Builder(str(src))
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={"serving_default": sig})
        builder.save()
    assert main(["convert", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("policy-export: error:") and "supported activations" in line, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_onnx_padding_row_passes_its_state_through(converted):
    _, out, _, expected = converted
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    required = {i.name: ORT_DTYPES[i.type] for i in session.get_inputs()}
    feeds = {"observations": expected["observations"][5], "state_in_0": expected["state_in_0"][5],
             "state_in_1": expected["state_in_1"][5], "seq_lens": np.array([1, 0, 1, 1]),
             **{k: expected[k][5] for k in ("prev_action", "prev_reward") if k in expected}}
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, {k: np.asarray(feeds[k]).astype(d) for k, d in required.items()})))
    for i in range(2):
        np.testing.assert_array_equal(got[f"state_out_{i}"][1], feeds[f"state_in_{i}"][1])
        np.testing.assert_allclose(got[f"state_out_{i}"][[0, 2, 3]], expected[f"state_out_{i}"][5][[0, 2, 3]],
                                   rtol=0, atol=ATOL)
    assert not np.allclose(expected["state_out_1"][5][1], feeds["state_in_1"][1])
