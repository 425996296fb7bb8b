"""Branches no other test reaches: the frozen-graph writer's converter fallback, ONNX when only the
deterministic model converts, TFLite's deterministic fallback for an exploring policy, RLlib's
looped-LSTM fallback (duck-typed, no ray), ``verify --localize --candidate``, ``python -m`` and
one CLI call per exit-code class.

Only public surfaces are used (the console script, ``policy_export``'s API, ``python -m``), with
one exception: the exit-code-3 test monkeypatches the internal named in :data:`CONTRACT_OF`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR
from helpers import cli, notes

# The one internal this file patches (a dotted path, so that it is easy to update when modules move):
# what ``policy-export inspect`` calls to read a contract.
CONTRACT_OF = "policy_export.exporter.inspection.contract_of"

PROG = "policy-export"
COMMANDS = ("export", "verify", "inspect", "diff", "convert", "rollout")


def _tf():
    import tensorflow as tf

    return tf, tf.compat.v1


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _errors(stderr: str) -> list[str]:
    """The tool's own lines on stderr (not its progress lines)."""
    return [line for line in _lines(stderr) if line.startswith(f"{PROG}:")]


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


# ------------------------------------------------------------------------------------ policies


def _embedding_policy():
    """A Discrete observation looked up in a resource-variable embedding: the variable is read by a
    ``ResourceGather``, not by a plain read, so the weightless skeleton cannot stand for the graph."""
    import gymnasium as gym

    from policy_export import TFPolicy

    tf, tf1 = _tf()
    table = np.random.default_rng(7).standard_normal((5, 3)).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        obs = tf1.placeholder(tf.int64, (None,), name="observations")
        emb = tf1.get_variable("embedding", initializer=table, use_resource=True)
        logits = tf.nn.embedding_lookup(emb, obs)
        action = tf.identity(tf.argmax(logits, axis=1), name="actions_0")
        dist_inputs = tf.identity(logits, name="action_dist_inputs")
        sess = tf1.Session(graph=graph)
        sess.run(tf1.global_variables_initializer())
    policy = TFPolicy(gym.spaces.Discrete(5), gym.spaces.Discrete(3), sess, observations=obs,
                      sampled_action=action, action_dist_inputs=dist_inputs)
    return policy, table


def _exploring_policy(sample):
    """Box(4) observations, Discrete(3) actions: ``explore`` picks ``sample(logits)`` (built inside
    a ``tf.cond``) over the argmax; the argmax alone is the deterministic output."""
    import gymnasium as gym

    from policy_export import TFPolicy

    tf, tf1 = _tf()
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(3)
        obs = tf1.placeholder(tf.float32, (None, 4), name="observations")
        explore = tf1.placeholder_with_default(False, (), name="explore")
        w = tf1.get_variable("w", initializer=np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32),
                             use_resource=True)
        logits = tf.matmul(obs, w)
        action = tf.identity(sample(tf, logits, explore), name="actions_0")
        deterministic = tf.identity(tf.argmax(logits, axis=1), name="deterministic_action")
        sess = tf1.Session(graph=graph)
        sess.run(tf1.global_variables_initializer())
    return TFPolicy(gym.spaces.Box(-1.0, 1.0, (4,), np.float32), gym.spaces.Discrete(3), sess,
                    observations=obs, sampled_action=action, explore=explore,
                    deterministic_outputs={"actions_0": deterministic})


def _qint8_noise_sample(tf, logits, explore):
    """Gumbel-max sampling whose uniform noise passes through a qint8 quantise/dequantise: tf2onnx
    has no ONNX type for qint8 and fails the whole conversion; the argmax path holds none of it."""
    uniform = tf.random.uniform(tf.shape(logits))
    noise = tf.quantization.dequantize(tf.quantization.quantize(uniform, 0.0, 1.0, tf.qint8).output, 0.0, 1.0)
    sampled = tf.argmax(logits - tf.math.log(-tf.math.log(noise * 0.98 + 0.01)), axis=1)
    return tf.where(explore, sampled, tf.argmax(logits, axis=1))


def _uniform_int_sample(tf, logits, explore):
    """A uniformly random action (``RandomUniformInt``: allowed in SavedModels, no TFLite builtin)."""
    batch = tf.shape(logits, out_type=tf.int64)[:1]
    return tf.cond(explore, lambda: tf.random.uniform(batch, 0, 3, dtype=tf.int64),
                   lambda: tf.argmax(logits, axis=1))


class _FakeRLlibPolicy:
    """Duck-typed like an old-API-stack RLlib TF policy (what ``from_rllib`` reads; no ray): two
    state tensors (h, c) carried through a ``tf.while_loop`` that is not a Keras LSTM cell."""

    def __init__(self):
        import gymnasium as gym

        tf, tf1 = _tf()
        rng = np.random.default_rng(1)
        self.w = rng.standard_normal((3, 2)).astype(np.float32)
        self.v = rng.standard_normal((2, 2)).astype(np.float32)
        graph = tf.Graph()
        with graph.as_default():
            obs = tf1.placeholder(tf.float32, (None, 3), name="obs")
            h0 = tf1.placeholder(tf.float32, (None, 2), name="state_in_h")
            c0 = tf1.placeholder(tf.float32, (None, 2), name="state_in_c")
            seq_lens = tf1.placeholder(tf.int32, (None,), name="seq_lens")
            w = tf1.get_variable("w", initializer=self.w)
            v = tf1.get_variable("v", initializer=self.v)
            drive = tf.matmul(obs, w)
            _, h, c = tf.while_loop(lambda i, h, c: i < 2, lambda i, h, c: (i + 1, tf.tanh(h + drive), 0.5 * c + h),
                                    (tf.constant(0), h0, c0))
            self._state_outputs = [tf.identity(h, name="state_out_h"), tf.identity(c, name="state_out_c")]
            self._sampled_action = tf.argmax(tf.matmul(h, v), axis=1, name="action")
            self._session = tf1.Session(graph=graph)
            self._session.run(tf1.global_variables_initializer())
        self._obs_input, self._state_inputs, self._seq_lens = obs, [h0, c0], seq_lens
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def get_session(self):
        return self._session

    def reference(self, obs, h, c):
        """What the graph computes, in numpy: two loop iterations, then the action head."""
        drive = obs @ self.w
        for _ in range(2):
            h, c = np.tanh(h + drive), 0.5 * c + h
        return np.argmax(h @ self.v, axis=1), h, c


# ------------------------------------------------------------------------- 1. frozen graph, NoSkeleton


def test_frozen_graph_writer_falls_back_to_tf_freezing_when_the_skeleton_cannot_stand_for_the_graph(tmp_path):
    """``frozen_graph.write``: ``skeleton()`` refuses a variable read by ``ResourceGather``, so the
    file is TF's ``convert_variables_to_constants`` GraphDef; it holds the weights and verifies."""
    from policy_export import export_policy, verify_export

    tf, tf1 = _tf()
    policy, table = _embedding_policy()
    out = tmp_path / "embedding"
    result = export_policy(policy, out, formats=["frozen_graph", "onnx"], samples=8, explore_samples=0, device="cpu")
    policy.close()
    assert result.parity.passed
    # the ONNX writer asks the same skeleton first: its record says it was refused
    assert result.manifest["formats"]["onnx"]["conversion"] == "frozen"
    graph_def = tf1.GraphDef()
    graph_def.ParseFromString((out / "frozen_graph.pb").read_bytes())
    ops = {n.op for n in graph_def.node}
    assert not ops & {"VarHandleOp", "ReadVariableOp", "ResourceGather", "VariableV2"}
    assert "GatherV2" in ops  # TF's converter rewrote the ResourceGather onto the folded constant
    assert [n.name for n in graph_def.node if n.op == "Placeholder"] == ["observations"]
    consts = [tf.make_ndarray(n.attr["value"].tensor) for n in graph_def.node if n.op == "Const"]
    assert any(c.shape == (5, 3) and np.array_equal(c, table) for c in consts)  # the weights, exactly
    record = result.manifest["formats"]["frozen_graph"]
    assert record["files"] == ["frozen_graph.pb"]
    assert record["nodes"] == len(graph_def.node)
    assert record["inputs_kept"] == ["observations"]
    # the frozen graph's deterministic actions are the session's, exactly
    frozen = [r for r in result.parity.records if r.format == "frozen_graph" and r.key == "actions_0"]
    assert len(frozen) == 1 and frozen[0].passed and frozen[0].max_abs_err == 0
    verified = verify_export(out, samples=8, device="cpu")
    assert verified.passed, verified.file_problems
    assert {r.format for r in verified.parity.records} >= {"frozen_graph", "onnx"}


# ------------------------------------------------------------- 2. ONNX: only the deterministic model converts


def test_onnx_alone_that_cannot_be_made_fails_with_the_conversion_error(tmp_path):
    """The full signature does not convert (qint8 in the sampling path): asked for ``onnx`` alone,
    no format can be written, so the export fails with the converter's error, an ExportError
    (CLI exit 2), and nothing is left behind."""
    from policy_export import ExportError, export_policy

    policy = _exploring_policy(_qint8_noise_sample)
    out = tmp_path / "x"
    with pytest.raises(ExportError) as info:
        export_policy(policy, out, formats=["onnx"], opset=17, samples=8, explore_samples=0, device="cpu")
    policy.close()
    assert str(info.value) == "no format could be written: onnx: ONNX conversion (tf2onnx, opset 17) failed: KeyError: tf.qint8"
    assert info.value.exit_code == 2
    assert not out.exists()
    assert _leftovers(tmp_path, set()) == []  # no staging directory, no lock file


def test_a_format_that_cannot_be_made_is_missing_and_the_others_are_written(tmp_path):
    """With ``onnx_deterministic`` beside it, the export is written and proven without
    ``model.onnx``, which the manifest records under ``missing`` with the converter's error."""
    from policy_export import export_policy, verify_export

    policy = _exploring_policy(_qint8_noise_sample)
    out = tmp_path / "x"
    result = export_policy(policy, out, formats=["onnx", "onnx_deterministic"], opset=17, samples=8,
                           explore_samples=0, device="cpu")
    policy.close()
    assert result.missing == {"onnx": "ONNX conversion (tf2onnx, opset 17) failed: KeyError: tf.qint8"}
    assert not result.complete and result.manifest["missing"] == result.missing
    assert set(result.formats) == {"onnx_deterministic"} and not (out / "model.onnx").exists()
    assert (out / "model_deterministic.onnx").is_file() and result.parity.passed
    assert verify_export(out, device="cpu").passed


def test_only_the_deterministic_onnx_model_is_written_when_the_full_signature_does_not_convert(tmp_path):
    from policy_export import export_policy, verify_export

    policy = _exploring_policy(_qint8_noise_sample)
    out = tmp_path / "det"
    result = export_policy(policy, out, formats=["onnx_deterministic"], samples=8, explore_samples=0, device="cpu")
    assert result.parity.passed
    record = result.manifest["formats"]["onnx_deterministic"]
    assert record["files"] == ["model_deterministic.onnx"]
    assert record["inputs"] == ["observations"] and record["outputs"] == ["actions_0"]
    assert record["conversion"] == "skeleton"
    assert set(result.manifest["formats"]) == {"onnx_deterministic"}
    import onnxruntime as ort

    session = ort.InferenceSession(str(out / "model_deterministic.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["observations"]
    obs = np.random.default_rng(5).uniform(-1, 1, (16, 4)).astype(np.float32)
    (got,) = session.run(["actions_0"], {"observations": obs})
    np.testing.assert_array_equal(got, policy.run({"observations": obs})["actions_0"])
    policy.close()
    assert verify_export(out, device="cpu").passed


# --------------------------------------------------------------------- 3. TFLite, explore fallback


def test_tflite_serves_the_deterministic_path_when_sampling_has_no_builtin_op(tmp_path, caplog):
    """``write_tflite``: the explore branch (``RandomUniformInt``) does not convert with builtin ops,
    so the model is converted with ``explore`` fixed to false; the record says so, exploration
    parity leaves tflite out, and the file serves the deterministic actions."""
    from policy_export import export_policy, verify_export

    policy = _exploring_policy(_uniform_int_sample)
    out = tmp_path / "tfl"
    with caplog.at_level(logging.WARNING):
        result = export_policy(policy, out, formats=["saved_model", "tflite"], samples=8, explore_samples=200,
                               device="cpu")
    assert result.parity.passed
    record = result.manifest["formats"]["tflite"]
    assert record["files"] == ["model.tflite"]
    assert record["explores"] is False
    assert record["fixed_inputs"] == ["explore"]
    assert record["quantization"] == "none (float32)"
    prefix = ("sampling is not expressible with TFLite builtin ops (TFLite conversion (builtin ops only) failed: "
              "ConverterError: ")
    assert record["explore_refused"].startswith(prefix), record["explore_refused"]
    assert "RandomUniformInt" in record["explore_refused"]
    assert not any(op.startswith("RANDOM") or op in ("IF", "MULTINOMIAL") for op in record["ops"]), record["ops"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("tflite: ")]
    assert len(warned) == 1 and warned[0].endswith("; writing the deterministic path alone")
    # exploration parity ran for the SavedModel alone
    exploration = result.manifest["parity"]["exploration"]
    assert exploration["tests"] == 4 and exploration["failed"] == 0
    assert set(exploration["drawn_by"]) == {"saved_model"}
    tfl = [r for r in result.parity.records if r.format == "tflite"]
    assert tfl and all(r.passed for r in tfl) and all(r.max_abs_err == 0 for r in tfl if r.key == "actions_0")

    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        import tensorflow as tf

        Interpreter = tf.lite.Interpreter
    interpreter = Interpreter(model_path=str(out / "model.tflite"))
    assert interpreter.get_signature_list()["serving_default"] == {"inputs": ["observations"], "outputs": ["actions_0"]}
    obs = np.random.default_rng(3).uniform(-1, 1, (6, 4)).astype(np.float32)
    got = interpreter.get_signature_runner("serving_default")(observations=obs)["actions_0"]
    np.testing.assert_array_equal(got, policy.run({"observations": obs})["actions_0"])
    policy.close()
    verified = verify_export(out, samples=8, device="cpu")
    assert verified.passed, (verified.file_problems, verified.parity.errors)


# ---------------------------------------------------------------- 4. RLlib live route, loop fallback


def test_from_rllib_keeps_a_loop_it_cannot_take_apart_as_the_serving_graph(tmp_path, caplog):
    """``from_rllib`` on a recurrent policy whose state comes from a while loop that is not a Keras
    LSTM: the one-step rewrite is refused (a warning), the looped graph serves, there is no
    training-time graph and so no stepped parity; the export still passes and verifies."""
    from policy_export import export_policy, from_rllib, verify_export

    fake = _FakeRLlibPolicy()
    with caplog.at_level(logging.WARNING):
        policy = from_rllib(fake)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [("keeping the looped LSTM graph as the serving graph: loop 'rllib/while' has 0 stacked "
                       "output sequences; exactly one is supported")]
    assert policy.is_recurrent and policy.sequence_graph is None
    assert list(policy.inputs) == ["observations", "state_in_0", "state_in_1", "seq_lens", "is_training", "timestep"]
    assert list(policy.outputs) == ["actions_0", "state_out_0", "state_out_1"]
    for key in ("state_out_0", "state_out_1"):
        tensor = policy.outputs[key]
        while tensor.op.type == "Identity":
            tensor = tensor.op.inputs[0]
        assert tensor.op.type in ("While", "StatelessWhile")  # the loop itself serves
    rng = np.random.default_rng(11)
    obs = rng.uniform(-1, 1, (5, 3)).astype(np.float32)
    h, c = (rng.standard_normal((5, 2)).astype(np.float32) for _ in range(2))
    got = policy.run({"observations": obs, "state_in_0": h, "state_in_1": c, "seq_lens": np.ones(5, np.int32)})
    action, h1, c1 = fake.reference(obs, h, c)
    np.testing.assert_array_equal(got["actions_0"], action)
    np.testing.assert_allclose(got["state_out_0"], h1, atol=1e-6)
    np.testing.assert_allclose(got["state_out_1"], c1, atol=1e-6)

    out = tmp_path / "looped"
    result = export_policy(policy, out, samples=8, explore_samples=0, device="cpu")
    assert result.parity.passed
    # keras: no base model; onnx_deterministic: no RLlib distribution to rebuild (both skipped)
    assert list(result.formats) == ["saved_model", "frozen_graph", "onnx"]
    assert result.manifest["parity"]["plan"]["stepped"] is None
    assert {(r.format, r.key) for r in result.parity.records} >= {("onnx", "state_out_1"), ("frozen_graph", "state_out_0")}
    verified = verify_export(out, samples=8, device="cpu")
    assert verified.passed
    assert "stepped: none in the plan" in verified.notes
    policy.close()


# ------------------------------------------------------------------ a small export the CLI tests share


@pytest.fixture(scope="module")
def small_export(tmp_path_factory) -> Path:
    """cartpole_mlp with the formats localisation needs (frozen graph and ONNX), 8 golden samples."""
    from policy_export import export_spec

    out = tmp_path_factory.mktemp("branches") / "cartpole"
    result = export_spec(FIXTURES_DIR / "cartpole_mlp", out, device="cpu", samples=8, explore_samples=100,
                         formats=["saved_model", "frozen_graph", "onnx", "onnx_deterministic"])
    assert result.parity.passed
    return out


def _faulty_copy(source: Path, target: Path, weight: str = "fc_2/kernel:0", delta: float = 0.5) -> Path:
    """A copy of ``source`` (an ONNX file) with one weight changed."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    init = next(i for i in model.graph.initializer if i.name == weight)
    values = numpy_helper.to_array(init).copy()
    values.flat[0] += delta
    init.CopyFrom(numpy_helper.from_array(values, init.name))
    onnx.save(model, str(target))
    return target


# --------------------------------------------------------------- 5. verify --localize --candidate


def test_verify_localize_names_the_tensor_where_an_onnx_candidate_diverges(small_export, tmp_path):
    """``verify --candidate onnx=F --localize``: the candidate (the export's model.onnx with one weight
    of the second hidden layer changed) fails its plan, and localisation names that layer's MatMul."""
    candidate = _faulty_copy(small_export / "model.onnx", tmp_path / "model.opt.onnx")
    before = _sha256(small_export / "model.onnx")
    report = tmp_path / "report.json"
    proc = cli("verify", str(small_export), "--candidate", f"onnx={candidate}", "--localize", "-q",
               "--report-json", str(report))
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(report.read_text())
    assert doc["passed"] is False and doc["file_problems"] == [] and doc["errors"] == {}
    failed = [r for r in doc["records"] if not r["passed"]]
    assert {r["format"] for r in failed} == {"onnx candidate", "onnx candidate (explore)"}
    assert {r["key"] for r in failed if r["format"] == "onnx candidate"} >= {"action_dist_inputs", "action_logp"}
    assert _errors(proc.stderr) == [f"policy-export: verify failed: {len(failed)} problem(s)"]
    (entry,) = doc["localization"]
    assert entry["format"] == "onnx" and entry["compared"] >= 3
    first = entry["first"]
    assert first["tensor"] == "base_model/fc_2/MatMul:0" and first["tf_node"] == "base_model/fc_2/MatMul"
    assert first["tf_op"] == "MatMul" and first["onnx_op"] == "MatMul"
    assert 1e-3 < first["max_abs_err"] <= 0.5 + 1e-6  # one kernel entry moved by 0.5; its inputs are tanh outputs
    plan = notes(proc.stdout, "plan")
    assert f"plan: candidates: onnx={candidate} (the export's own formats are not run)" in plan
    (where,) = [line for line in plan if line.startswith("plan: localize: ")]
    assert where == (f"plan: localize: onnx: first divergence at tensor base_model/fc_2/MatMul:0 (TF node "
                     f"'base_model/fc_2/MatMul', MatMul; ONNX node {first['onnx_node']!r}, MatMul): max abs err "
                     f"{first['max_abs_err']:.3g}, tolerance atol=1e-05 rtol=1e-05 ({entry['compared']} shared "
                     "tensors compared)")
    assert _sha256(small_export / "model.onnx") == before  # the export is only read


def test_verify_localize_with_an_unchanged_onnx_candidate_finds_no_divergence(small_export, tmp_path):
    candidate = tmp_path / "copy.onnx"
    shutil.copyfile(small_export / "model.onnx", candidate)
    proc = cli("verify", str(small_export), "--candidate", f"onnx={candidate}", "--localize", "-q")
    assert proc.returncode == 0, proc.stderr
    assert _errors(proc.stderr) == []
    (where,) = [line for line in notes(proc.stdout, "plan") if line.startswith("plan: localize: ")]
    assert where.startswith("plan: localize: onnx: none of the ")
    assert where.endswith(" intermediate tensors shared with the frozen graph diverges; the difference arises "
                          "after them (or inside control flow)")
    assert f"verified {small_export}: files match the manifest, every candidate matches its plan" in proc.stdout


# ----------------------------------------------------------------------------- 6. python -m


def _python_m(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GITHUB_STEP_SUMMARY")}
    return subprocess.run([sys.executable, "-m", module, *args], check=False, capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


@pytest.mark.parametrize("module", ["policy_export", "policy_export.exporter"])
def test_python_m_help(module, tmp_path):
    proc = _python_m(module, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.startswith(f"usage: {PROG} [-h] [--debug] [-V] COMMAND ...\n")
    assert "Export RL policies built as TF graphs and prove parity." in proc.stdout
    for command in COMMANDS:
        assert f"    {command} " in proc.stdout, command


@pytest.mark.parametrize("module", ["policy_export", "policy_export.exporter"])
def test_python_m_runs_inspect_and_reports_bad_input(module, small_export, tmp_path):
    proc = _python_m(module, "inspect", str(small_export), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["kind"] == "export" and doc["path"] == str(small_export)
    first = doc["inputs"][0]
    assert (first["key"], first["dtype"], first["shape"], first["required"]) == ("observations", "float32", [None, 4], True)
    assert [o["key"] for o in doc["outputs"]] == ["actions_0", "action_dist_inputs", "action_logp", "action_prob"]
    missing = tmp_path / "nowhere"
    proc = _python_m(module, "verify", str(missing), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = _lines(proc.stderr)
    assert line.startswith(f"{PROG}: error: ") and str(missing) in line


def test_python_m_policy_export_runs_verify(small_export, tmp_path):
    proc = _python_m("policy_export", "verify", str(small_export), "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"verified {small_export}: files match the manifest, every format matches" in proc.stdout
    assert _errors(proc.stderr) == []


# ------------------------------------------------------------------------- exit codes, one per class


def test_exit_0_on_success(small_export):
    proc = cli("verify", str(small_export), "--samples", "8", "-q")
    assert proc.returncode == 0, proc.stderr
    assert _errors(proc.stderr) == []
    assert "plan: fresh samples: 8 new observations (seed 1), each format vs saved_model" in notes(proc.stdout, "plan")
    assert f"verified {small_export}: files match the manifest, every format matches" in proc.stdout


def test_exit_1_on_a_failed_check(small_export, tmp_path):
    copy = tmp_path / "tampered"
    shutil.copytree(small_export, copy)
    with open(copy / "frozen_graph.pb", "ab") as f:
        f.write(b"\0")
    proc = cli("verify", str(copy), "-q")
    assert proc.returncode == 1
    assert any(line.startswith("changed file frozen_graph.pb") for line in proc.stdout.splitlines()), proc.stdout
    assert "frozen_graph: not loaded: its files failed the hash check" in proc.stdout
    assert _errors(proc.stderr) == ["policy-export: verify failed: 2 problem(s)"]
    assert "Traceback" not in proc.stderr


def test_exit_2_on_bad_input(tmp_path):
    missing = tmp_path / "no_such_spec"
    out = tmp_path / "out"
    proc = cli("export", str(missing), "--out", str(out))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"policy-export: error: export's source {missing}: no such directory\n"
    assert not out.exists()


@pytest.mark.parametrize("debug", [[], ["--debug"]], ids=["plain", "debug"])
def test_exit_3_on_an_internal_error(debug, tmp_path, monkeypatch, capsys):
    """An exception that is not one of the package's own errors is a bug in the package: exit 3 and
    one line; the traceback only with ``--debug``."""
    from policy_export.exporter.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(CONTRACT_OF, broken)
    code = main([*debug, "inspect", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 3
    assert captured.out == ""
    message = ("policy-export: internal error (a bug in policy-export, please report it): RuntimeError: "
               "boom\\nsecond line" + ("" if debug else "; run with --debug for the traceback"))
    assert captured.err.splitlines()[-1] == message  # user text stays on one line
    if debug:
        assert "Traceback" in captured.err and "RuntimeError: boom" in captured.err
    else:
        assert captured.err == message + "\n"


def test_check_policy_checks_the_sample_budget_of_the_counts_given(monkeypatch):
    """(Once per command: tests/test_options.py, through the CLI and the API.)"""
    from policy_export.exporter import options
    from policy_export.policy.spec import load_spec

    calls = []
    real = options.check_sample_budget
    monkeypatch.setattr(options, "check_sample_budget", lambda *a: calls.append(a[0]) or real(*a))
    space = load_spec(FIXTURES_DIR / "cartpole_mlp").observation_space
    opts = options.ExportOptions(samples=10, explore_samples=0)
    opts.check_policy(space)
    assert calls == [10]
    options.replace(opts, samples=20).check_policy(space)
    assert calls == [10, 20]
    with pytest.raises(options.InputError, match="samples \\(--samples\\) 2000000 exceeds the limit"):
        options.ExportOptions(samples=2_000_000)
    # formats left to the default stay so through any number of copies (unwritable ones are skipped)
    again = options.replace(options.replace(opts, device="cpu"), source={"converted_from": "x"})
    assert not again.explicit_formats and again.formats == options.ExportOptions().formats
    assert options.replace(options.ExportOptions(formats=["onnx"]), device="cpu").explicit_formats
