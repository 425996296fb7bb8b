"""Runtimes a hostile model cannot hold (deadlines, signals) and declared sizes of ONNX tensors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from conftest import FIXTURES_DIR, default_signals  # noqa: F401  (the fixtures' home, for the exports fixture)
from helpers import cli
from helpers import one_line_error, snapshot

ROOT = Path(__file__).resolve().parent.parent
INT64_MAX = 2**63 - 1


def _real_io(export: Path):
    """The export's ONNX inputs (and their optional defaults), so that a hostile model takes the same feeds."""
    real = onnx.load(str(export / "model.onnx"))
    names = {i.name for i in real.graph.input}
    return list(real.graph.input), [i for i in real.graph.initializer if i.name in names]


def loop_model(export: Path, path: Path, trip_count: int = INT64_MAX) -> Path:
    """A model taking the export's inputs whose Loop (trip count ``trip_count``) does real work per iteration."""
    inputs, defaults = _real_io(export)
    w = helper.make_tensor("W", T.FLOAT, [4, 4], (np.eye(4, dtype=np.float32) * 0.5).ravel())
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Constant", [], ["Wb"], value=w),
         helper.make_node("MatMul", ["acc_in", "Wb"], ["m"]),
         helper.make_node("Tanh", ["m"], ["acc_out"])],
        "body",
        [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
         helper.make_tensor_value_info("acc_in", T.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []),
         helper.make_tensor_value_info("acc_out", T.FLOAT, [None, 4])])
    nodes = [helper.make_node("Constant", [], ["M"], value=helper.make_tensor("Mv", T.INT64, [], [trip_count])),
             helper.make_node("Constant", [], ["C"], value=helper.make_tensor("Cv", T.BOOL, [], [True])),
             helper.make_node("Loop", ["M", "C", "observations"], ["action_dist_inputs"], body=body)]
    graph = helper.make_graph(nodes, "evil", inputs,
                              [helper.make_tensor_value_info("action_dist_inputs", T.FLOAT, [None, 4])],
                              initializer=defaults)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def sized_model(export: Path, path: Path, kind: str) -> Path:
    """A small file declaring far more than it holds, in one of several places."""
    inputs, defaults = _real_io(export)
    out = [helper.make_tensor_value_info("y", T.FLOAT, None)]
    nodes, inits = [helper.make_node("Identity", ["observations"], ["y"])], list(defaults)
    if kind == "initializer_no_data":  # 1e9 floats, no data at all
        big = T(); big.name, big.data_type = "huge", T.FLOAT
        big.dims.extend([1000, 1000000])
        inits.append(big)
        nodes = [helper.make_node("Add", ["observations", "huge"], ["y"])]
    elif kind == "raw_data_short":  # dims say 1e9 floats, raw data holds 16 bytes
        big = T(); big.name, big.data_type = "huge", T.FLOAT
        big.dims.extend([1000, 1000000])
        big.raw_data = b"\0" * 16
        inits.append(big)
        nodes = [helper.make_node("Add", ["observations", "huge"], ["y"])]
    elif kind == "constant_in_loop_body":
        big = T(); big.name, big.data_type = "body_const", T.FLOAT
        big.dims.extend([1000, 1000000])
        big.raw_data = b"\0" * 16
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
             helper.make_node("Constant", [], ["k"], value=big),
             helper.make_node("Identity", ["acc_in"], ["acc_out"])], "body",
            [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
             helper.make_tensor_value_info("acc_in", T.FLOAT, None)],
            [helper.make_tensor_value_info("cond_out", T.BOOL, []), helper.make_tensor_value_info("acc_out", T.FLOAT, None)])
        nodes = [helper.make_node("Constant", [], ["M"], value=helper.make_tensor("Mv", T.INT64, [], [1])),
                 helper.make_node("Constant", [], ["C"], value=helper.make_tensor("Cv", T.BOOL, [], [True])),
                 helper.make_node("Loop", ["M", "C", "observations"], ["y"], body=body)]
    elif kind == "constant_of_shape":  # a 4e12-byte zero tensor from a constant shape
        nodes = [helper.make_node("Constant", [], ["shape"], value_ints=[1000000, 1000000]),
                 helper.make_node("ConstantOfShape", ["shape"], ["z"],
                                  value=helper.make_tensor("v", T.FLOAT, [1], [0.0])),
                 helper.make_node("ReduceSum", ["z"], ["s"], keepdims=0),
                 helper.make_node("Add", ["observations", "s"], ["y"])]
    graph = helper.make_graph(nodes, "evil", inputs, out, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture(scope="module")
def export(exports, tmp_path_factory):
    _, out = exports("cartpole_mlp")
    return out


# ------------------------------------------------------------------------------------ the watchdog


def test_run_limits_are_validated():
    from policy_export.exporter.watchdog import DEFAULT_RUN_TIMEOUT, current_limit, run_limit
    from policy_export.errors import InputError

    assert current_limit() == DEFAULT_RUN_TIMEOUT == 600.0
    for bad in (0, -1, float("nan"), float("inf"), "soon"):
        with pytest.raises(InputError, match="run_timeout"):
            with run_limit(bad):
                pass
    with run_limit(2.5) as limit:
        assert limit == current_limit() == 2.5
    assert current_limit() == DEFAULT_RUN_TIMEOUT


def test_a_call_that_ignores_stop_is_left_behind_and_never_run_again():
    from policy_export.exporter.watchdog import RunTimeoutError, Stoppable

    release, stopped = threading.Event(), []
    watch = Stoppable("model m", grace=0.2)
    start = time.monotonic()
    with pytest.raises(RunTimeoutError, match=r"model m did not finish one run within the limit of 0\.3 s"):
        watch.run(release.wait, stop=lambda: stopped.append(True), timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 1.5
    assert stopped == [True] and watch.stuck
    with pytest.raises(RunTimeoutError):
        watch.run(lambda: 1, timeout=5)
    release.set()
    assert RunTimeoutError("x", 1).exit_code == 1
    assert Stoppable("ok").run(lambda: 42, timeout=5) == 42


# -------------------------------------------------------------------------------- ONNX Runtime Loop


def test_an_endless_onnx_loop_is_stopped_at_the_run_limit(export, tmp_path):
    from policy_export.exporter.devices import plan_devices
    from policy_export.exporter.formats.onnx.model import OnnxRunner
    from policy_export.exporter.watchdog import RunTimeoutError, run_limit

    path = loop_model(export, tmp_path / "loop.onnx")
    obs = np.zeros((2, 4), np.float32)
    with OnnxRunner(path, plan_devices("cpu")) as runner:
        assert loop_model(export, tmp_path / "short.onnx", 3)  # an honest Loop runs as before
        start = time.monotonic()
        with run_limit(1.0), pytest.raises(RunTimeoutError) as info:
            runner({"observations": obs})
        elapsed = time.monotonic() - start
        assert 1.0 <= elapsed < 2.0, elapsed  # ONNX Runtime honours RunOptions.terminate inside the Loop
        assert not runner.stuck
        assert f"ONNX model {path} did not finish one run within the limit of 1 s" in str(info.value)
    with OnnxRunner(tmp_path / "short.onnx", plan_devices("cpu")) as runner:
        assert runner({"observations": obs})["action_dist_inputs"].shape == (2, 4)


def test_verify_fails_an_endless_loop_candidate_at_the_run_limit(export, tmp_path):
    path = loop_model(export, tmp_path / "loop.onnx")
    before = snapshot(export)
    start = time.monotonic()
    proc = cli("verify", str(export), "--candidate", f"onnx={path}", "--run-timeout", "2", "-q",
               "--report-json", str(tmp_path / "r.json"))
    elapsed = time.monotonic() - start
    one_line_error(proc, 1, "verify failed: 1 problem(s)")
    assert elapsed < 60, elapsed
    error = json.loads((tmp_path / "r.json").read_text())["errors"]["onnx candidate"]
    assert error == (f"ONNX model {path} did not finish one run within the limit of 2 s "
                     "(--run-timeout); the run "
                     "was stopped: the model loops or computes far beyond what a policy needs")
    assert snapshot(export) == before


def test_a_bad_run_timeout_is_exit_2_before_anything_runs(export, tmp_path):
    for value in ("0", "-3", "nan", "inf"):
        proc = cli("verify", str(export), "--run-timeout", value)
        one_line_error(proc, 2, "run_timeout (--run-timeout) must be above 0")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_verify_inside_an_endless_onnx_loop(export, tmp_path, sig):
    path = loop_model(export, tmp_path / "loop.onnx")
    proc = subprocess.Popen([sys.executable, "-m", "policy_export", "verify", str(export), "--candidate", f"onnx={path}"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.time() + 120
    while not any("load plan" in line for line in lines) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert any("load plan" in line for line in lines), lines
    time.sleep(2.0)  # the candidate's session is open and inside its Loop
    assert proc.poll() is None
    sent = time.monotonic()
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=30)
    elapsed = time.monotonic() - sent
    reader.join(5)
    assert proc.returncode == 130, lines
    assert elapsed < 5, elapsed
    *progress, last = [line.rstrip("\n") for line in lines]
    assert all(line.startswith("[policy-export] ") for line in progress), lines
    assert f"interrupted by {sig}" in last and "Traceback" not in "".join(lines)


# --------------------------------------------------------------------------------- declared sizes


@pytest.mark.parametrize("kind, fragment", [
    ("initializer_no_data", "tensor 'huge' declares 4000000000 bytes (dims [1000, 1000000]) but holds 0 values"),
    ("raw_data_short", "tensor 'huge' declares 4000000000 bytes (dims [1000, 1000000]) but holds 16 bytes of raw"),
    ("constant_in_loop_body", "subgraph node 'Constant' attribute 'value': tensor 'body_const' declares 4000000000"),
    ("constant_of_shape", "ConstantOfShape output 'z' declares 4000000000000 bytes, beyond the"),
])
def test_onnx_tensors_declaring_more_than_the_file_holds_are_refused_before_onnx_runtime(export, tmp_path, kind,
                                                                                        fragment):
    from policy_export.exporter.devices import plan_devices
    from policy_export.errors import DeclaredSizeError
    from policy_export.exporter.formats.onnx.model import OnnxRunner

    path = sized_model(export, tmp_path / f"{kind}.onnx", kind)
    import onnxruntime as ort

    created = []
    original = ort.InferenceSession.__init__
    ort.InferenceSession.__init__ = lambda self, *a, **k: (created.append(a), original(self, *a, **k))[1]
    try:
        with pytest.raises(DeclaredSizeError) as info:
            OnnxRunner(path, plan_devices("cpu"))
    finally:
        ort.InferenceSession.__init__ = original
    assert fragment in str(info.value) and str(path) in str(info.value)
    assert info.value.exit_code == 2 and created == []


@pytest.mark.parametrize("fmt", ["onnx", "onnx_explore"])
def test_verify_refuses_a_candidate_declaring_a_gigabyte_it_does_not_hold(export, tmp_path, fmt):
    path = sized_model(export, tmp_path / "big.onnx", "initializer_no_data")
    proc = cli("verify", str(export), "--candidate", f"{fmt}={path}", "-q", "--report-json", str(tmp_path / "r.json"))
    one_line_error(proc, 1, "verify failed: 1 problem(s)")
    error = json.loads((tmp_path / "r.json").read_text())["errors"][f"{fmt} candidate"]
    assert "tensor 'huge' declares 4000000000 bytes" in error and "refusing to load it" in error


def test_the_exports_own_onnx_models_pass_and_declare_their_weights(export):
    from policy_export.exporter.formats.onnx.model import weight_bytes
    from policy_export.exporter.formats.onnx.trust import check_declared_sizes

    model = onnx.load(str(export / "model.onnx"), load_external_data=False)
    total = check_declared_sizes(model, export / "model.onnx")
    assert 0 < total <= weight_bytes(model) <= (export / "model.onnx").stat().st_size


# ---------------------------------------------------------------------------------- TF While loop


def test_an_endless_tf_while_in_a_frozen_graph_is_stopped_at_the_run_limit(tmp_path):
    import tensorflow as tf

    from policy_export.exporter.devices import plan_devices
    from policy_export.exporter.formats.tf_runner import TFGraphRunner
    from policy_export.exporter.watchdog import RunTimeoutError, run_limit

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="observations")
        _, y = tf1.while_loop(lambda i, a: i < tf.constant(2**62, tf.int64),
                              lambda i, a: (i + 1, tf.tanh(a * 1.0001)), [tf.constant(0, tf.int64), x])
        tf.identity(y, name="action_dist_inputs")
    path = tmp_path / "while.pb"
    path.write_bytes(graph.as_graph_def().SerializeToString())
    names = {"inputs": {"observations": "observations:0"}, "outputs": {"action_dist_inputs": "action_dist_inputs:0"}}
    with TFGraphRunner.from_graph_def(path, names, plan_devices("cpu")) as runner:  # passes the op check
        start = time.monotonic()
        with run_limit(1.0), pytest.raises(RunTimeoutError, match=f"frozen graph {path} did not finish one run"):
            runner({"observations": np.ones((2, 4), np.float32)})
        assert 1.0 <= time.monotonic() - start < 2.5 and not runner.stuck


def test_the_tf_action_head_keeps_the_run_limit():
    """Exploration draws feed the head directly; a head that loops is stopped like any other run."""
    import tensorflow as tf

    from policy_export.exporter.formats.tf_runner import tf_head
    from policy_export.exporter.watchdog import RunTimeoutError, run_limit
    from policy_export.signatures.keys import ACTION_DIST_INPUTS, EXPLORE, action_key

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        dist = tf1.placeholder(tf.float32, [None, 2], name="dist")
        explore = tf1.placeholder_with_default(False, [], name="explore")
        _, looped = tf.while_loop(lambda i, x: i < (1 << 62), lambda i, x: (i + 1, x * 1.0),
                                  (tf.constant(0, tf.int64), dist))
        actions = tf.argmax(looped, axis=-1)
    with tf1.Session(graph=graph) as session:
        run = tf_head(session, {EXPLORE: explore}, {ACTION_DIST_INPUTS: dist, action_key(0): actions})
        start = time.monotonic()
        with run_limit(1.0), pytest.raises(RunTimeoutError, match="TF action head did not finish one run within "
                                                                  "the limit of 1 s"):
            run({ACTION_DIST_INPUTS: np.zeros((1, 2), np.float32), EXPLORE: np.array(False)})
        assert time.monotonic() - start < 4.0


def test_convert_stops_an_endless_while_in_the_files_own_session_at_the_run_limit(tmp_path):
    """The legacy route runs the file's own graph as the reference: its runs keep the limit too."""
    import shutil

    import tensorflow as tf

    from conftest import splice_into_serving_path

    model = tmp_path / "model"
    shutil.copytree(FIXTURES_DIR / "rllib" / "legacy" / "cartpole_ff" / "saved_model", model)
    def build(obs):
        _, = tf.while_loop(lambda i: i < tf.constant(2**62, tf.int64), lambda i: i + 1,
                           [tf.cast(tf.size(obs), tf.int64)], name="endless")
        return next(op.name for op in obs.graph.get_operations() if op.type in ("While", "StatelessWhile"))

    splice_into_serving_path(model / "saved_model.pb", build)
    start = time.monotonic()
    proc = cli("convert", str(model), "--out", str(tmp_path / "out"), "--samples", "8", "--run-timeout", "2", "-q")
    elapsed = time.monotonic() - start
    one_line_error(proc, 1, f"SavedModel {model} did not finish one run within the limit of 2 s")
    assert not (tmp_path / "out").exists() and elapsed < 60, elapsed
