"""``convert`` of Keras base-model SavedModels (RLlib >= 2.1 ``policy.export_model``).

The fixtures under ``fixtures/rllib/keras/`` were written by ``fixtures/rllib/make_keras.py``
(ray 2.9.3, TF 2.15): RLlib's own export of trained PPO policies and RLlib's own
``compute_actions(obs, explore=False)`` results. These tests need no ray and run on every
TensorFlow the package supports.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR

KERAS_DIR = FIXTURES_DIR / "rllib" / "keras"
CASES = ["cartpole_ff", "pendulum_box", "dict_obs", "image_conv"]
# the model's (distribution inputs, value) outputs: RLlib's fully connected and vision networks
OUTPUTS = {"image_conv": ("conv_out", "lambda")}
SCRIPT = Path(sys.executable).parent / "policy-export"


def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "policy_export.exporter"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


def case_doc(case: str) -> dict:
    return json.loads((KERAS_DIR / case / "case.json").read_text())


def expected(case: str) -> dict[str, np.ndarray]:
    with np.load(KERAS_DIR / case / "expected.npz", allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def run_required_only(model: Path, exp: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime fed only the inputs it lists as required."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    required = [i.name for i in session.get_inputs()]
    assert required == ["observations"]
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {"observations": exp["obs"]})))


def reference_logp(action_space: dict, dist_inputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """log-probability of ``actions`` under the distribution, in numpy."""
    x = dist_inputs.astype(np.float64)
    if action_space["type"] == "Discrete":
        logsm = x - x.max(-1, keepdims=True)
        logsm = logsm - np.log(np.exp(logsm).sum(-1, keepdims=True))
        return logsm[np.arange(len(actions)), actions]
    mean, log_std = np.split(x, 2, axis=-1)
    z = (actions.reshape(mean.shape) - mean) / np.exp(log_std)
    return (-0.5 * z**2 - log_std).sum(-1) - 0.5 * math.log(2 * math.pi) * mean.shape[-1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One CLI conversion per case (cached)."""
    cache: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in cache:
            out = tmp_path_factory.mktemp("keras") / case
            proc = cli("convert", str(KERAS_DIR / case / "model"), "--out", str(out), "--samples", "300",
                       "--action-space", json.dumps(case_doc(case)["action_space"]))
            assert proc.returncode == 0, proc.stderr
            cache[case] = out
        return cache[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_fixture_is_rllib_keras_base_model(case):
    from policy_export.exporter.sources.keras import is_keras_base_model, signature_outputs

    model = KERAS_DIR / case / "model"
    assert is_keras_base_model(model)
    assert sorted(signature_outputs(model)) == sorted(OUTPUTS.get(case, ("fc_out", "value_out")))
    size = sum(f.stat().st_size for f in (KERAS_DIR / case).rglob("*") if f.is_file())
    assert size < 1_000_000


@pytest.mark.parametrize("case", CASES)
def test_convert_reproduces_rllib_compute_actions(case, converted):
    out = converted(case)
    exp, doc = expected(case), case_doc(case)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    assert manifest["source"]["kind"] == "keras_base_model"
    dist_key, value_key = OUTPUTS.get(case, ("fc_out", "value_out"))
    assert manifest["source"]["key_mapping"]["action_dist_inputs"] == dist_key
    for model in ("model.onnx", "model_deterministic.onnx"):
        got = run_required_only(out / model, exp)
        if doc["action_space"]["type"] == "Discrete":
            assert got["actions_0"].dtype == np.int64
            np.testing.assert_array_equal(got["actions_0"], exp["actions"])
        else:  # RLlib's unclipped mean, in the (normalised) space the graph sees
            np.testing.assert_allclose(got["actions_0"], exp["actions"], rtol=0, atol=1e-5)
        if model == "model.onnx":  # the deterministic model holds the actions alone
            # RLlib's meanings at explore=False: logp 0, prob 1
            np.testing.assert_allclose(got["action_logp"], exp["action_logp"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(got["action_prob"], exp["action_prob"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(got["action_dist_inputs"], exp["action_dist_inputs"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(got[value_key].reshape(-1), exp["vf_preds"], rtol=0, atol=1e-5)


def test_explored_logp_is_the_samples_log_probability(converted):
    import onnxruntime as ort

    case = "pendulum_box"
    out, exp, doc = converted(case), expected(case), case_doc(case)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {"observations": exp["obs"], "explore": np.array(True)})))
    assert not np.allclose(got["actions_0"], exp["actions"], atol=1e-3)  # sampled, not the mean
    want = reference_logp(doc["action_space"], got["action_dist_inputs"], got["actions_0"])
    np.testing.assert_allclose(got["action_logp"], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["action_prob"], np.exp(want), rtol=1e-4, atol=1e-4)


def test_explore_samples_actions(converted):
    import onnxruntime as ort

    out = converted("dict_obs")
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    optional = {i.name for i in session.get_overridable_initializers()}
    assert {"explore", "is_training", "timestep"} <= optional
    obs = np.repeat(expected("dict_obs")["obs"][:1], 2000, axis=0)
    actions, logits = session.run(["actions_0", "action_dist_inputs"], {"observations": obs, "explore": np.array(True)})
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    freq = np.bincount(actions, minlength=3) / len(actions)
    assert len(np.unique(actions)) == 3
    np.testing.assert_allclose(freq, p, atol=0.05)


def test_converted_export_verifies(converted):
    proc = cli("verify", str(converted("pendulum_box")))
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_action_space_is_required(tmp_path):
    proc = cli("convert", str(KERAS_DIR / "cartpole_ff" / "model"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert "--action-space is required" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_action_space_of_the_wrong_width_lists_outputs(tmp_path):
    from policy_export.exporter.convert import convert_saved_model
    from policy_export.errors import ExportError
    from policy_export.policy.spaces import space_from_json

    space = space_from_json({"type": "Discrete", "n": 5})
    with pytest.raises(ExportError, match=r"width 5.*fc_out \[batch, 2\], value_out \[batch, 1\]"):
        convert_saved_model(KERAS_DIR / "cartpole_ff" / "model", tmp_path / "o", action_space=space, device="cpu")
    assert not (tmp_path / "o").exists()


def test_dist_inputs_named_explicitly_must_fit(tmp_path):
    from policy_export.exporter.convert import convert_saved_model
    from policy_export.errors import ExportError
    from policy_export.policy.spaces import space_from_json

    space = space_from_json({"type": "Discrete", "n": 2})
    with pytest.raises(ExportError, match=r"output 'value_out' \[batch, 1\] cannot hold"):
        convert_saved_model(KERAS_DIR / "cartpole_ff" / "model", tmp_path / "o", action_space=space,
                            dist_inputs="value_out", device="cpu")
    with pytest.raises(ExportError, match="'nope' is not an output"):
        convert_saved_model(KERAS_DIR / "cartpole_ff" / "model", tmp_path / "o", action_space=space,
                            dist_inputs="nope", device="cpu")


def test_select_dist_inputs_by_width_and_ambiguity():
    from policy_export.exporter.sources.keras import select_dist_inputs
    from policy_export.errors import ExportError

    outputs = {"logits": [None, 4], "aux": [None, 4], "value": [None, 1]}
    with pytest.raises(ExportError, match="several outputs .*aux, logits.*--dist-inputs"):
        select_dist_inputs(outputs, 4, None, "Discrete(4)")
    assert select_dist_inputs(outputs, 4, "logits", "Discrete(4)") == "logits"
    assert select_dist_inputs(outputs, 1, None, "x") == "value"


def test_observation_space_given_must_fit():
    from policy_export.exporter.sources.keras import load_keras_policy
    from policy_export.errors import InputError
    from policy_export.policy.spaces import space_from_json

    doc = case_doc("dict_obs")
    act = space_from_json(doc["action_space"])
    wrong = {"type": "Dict", "spaces": {"mode": {"type": "Discrete", "n": 4},
                                        "position": doc["env_observation_space"]["spaces"]["position"]}}
    with pytest.raises(InputError, match="does not fit the model's input .* width 6"):
        load_keras_policy(KERAS_DIR / "dict_obs" / "model", act, device="cpu", observation_space=space_from_json(wrong))
    policy, _ = load_keras_policy(KERAS_DIR / "dict_obs" / "model", act, device="cpu",
                                  observation_space=space_from_json(doc["observation_space"]))
    try:
        exp = expected("dict_obs")
        result = policy.compute_actions(exp["obs"])
        np.testing.assert_array_equal(result.actions, exp["actions"])
        np.testing.assert_allclose(result.fetches["action_dist_inputs"], exp["action_dist_inputs"], atol=1e-6, rtol=0)
    finally:
        policy.close()


def test_dict_observation_space_is_flattened_like_rllib(tmp_path):
    """Given the environment's Dict space, the export takes raw observations, one input per leaf."""
    import onnxruntime as ort

    doc, exp = case_doc("dict_obs"), expected("dict_obs")
    out = tmp_path / "out"
    proc = cli("convert", str(KERAS_DIR / "dict_obs" / "model"), "--out", str(out), "--samples", "200",
               "--action-space", json.dumps(doc["action_space"]),
               "--observation-space", json.dumps(doc["env_observation_space"]))
    assert proc.returncode == 0, proc.stderr
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in session.get_inputs()) == ["observations/mode", "observations/position"]
    assert len(np.unique(exp["env_obs/mode"])) > 1
    feeds = {"observations/mode": exp["env_obs/mode"].astype(np.int64),
             "observations/position": exp["env_obs/position"]}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.testing.assert_array_equal(got["actions_0"], exp["actions"])
    np.testing.assert_allclose(got["action_dist_inputs"], exp["action_dist_inputs"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["value_out"].reshape(-1), exp["vf_preds"], rtol=0, atol=1e-5)


def _save_module(path: Path, inputs: dict[str, int], outputs: dict[str, int], seed: int = 0) -> dict:
    """A SavedModel whose signature maps ``inputs`` (name -> width) to linear ``outputs``."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    width_in = sum(inputs.values())
    weights = {k: rng.standard_normal((width_in, w)).astype(np.float32) for k, w in outputs.items()}
    spec = [tf.TensorSpec([None, w], tf.float32, name=k) for k, w in inputs.items()]

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = {k: tf.Variable(v) for k, v in weights.items()}

        @tf.function(input_signature=spec)
        def __call__(self, *args):
            x = tf.concat(list(args), axis=-1) if len(args) > 1 else args[0]
            return {k: tf.matmul(x, self.w[k]) for k in outputs}

    model = Model()
    tf.saved_model.save(model, str(path), signatures={"serving_default": model.__call__})
    return weights


def test_generic_base_model_with_named_dist_inputs(tmp_path):
    """Any base-model SavedModel: a MultiDiscrete head on the output named with dist_inputs."""
    from policy_export.exporter.convert import convert_saved_model
    from policy_export.errors import ExportError
    from policy_export.policy.spaces import space_from_json

    weights = _save_module(tmp_path / "m", {"observations": 3}, {"logits": 5, "aux": 5, "value": 1})
    space = space_from_json({"type": "MultiDiscrete", "nvec": [2, 3]})
    with pytest.raises(ExportError, match="several outputs"):
        convert_saved_model(tmp_path / "m", tmp_path / "o", action_space=space, device="cpu")
    convert_saved_model(tmp_path / "m", tmp_path / "o", action_space=space, dist_inputs="logits",
                        device="cpu", samples=200)
    obs = np.random.default_rng(1).uniform(-1, 1, (64, 3)).astype(np.float32)
    got = run_required_only(tmp_path / "o" / "model.onnx", {"obs": obs})
    logits = obs @ weights["logits"]
    want = np.stack([logits[:, :2].argmax(-1), logits[:, 2:].argmax(-1)], axis=-1)
    np.testing.assert_array_equal(got["actions_0"], want)
    np.testing.assert_allclose(got["aux"], obs @ weights["aux"], rtol=1e-5, atol=1e-5)


def test_recurrent_base_model_is_refused(tmp_path):
    from policy_export.exporter.convert import convert_saved_model
    from policy_export.errors import ExportError
    from policy_export.policy.spaces import space_from_json

    _save_module(tmp_path / "m", {"observations": 3, "state_in_0": 4}, {"fc_out": 2, "state_out_0": 4})
    space = space_from_json({"type": "Discrete", "n": 2})
    with pytest.raises(ExportError, match="looks recurrent .*feed-forward base models only"):
        convert_saved_model(tmp_path / "m", tmp_path / "o", action_space=space, device="cpu")


def test_empty_folder_names_the_lstm_case(tmp_path):
    (tmp_path / "m").mkdir()
    proc = cli("convert", str(tmp_path / "m"), "--out", str(tmp_path / "o"),
               "--action-space", '{"type": "Discrete", "n": 2}')
    assert proc.returncode == 2
    assert "a SavedModel directory (saved_model.pb)" in proc.stderr and "is not a spec directory" in proc.stderr


def test_spaces_from_files_and_named_dist_inputs(tmp_path):
    doc = case_doc("pendulum_box")
    (tmp_path / "act.json").write_text(json.dumps(doc["action_space"]))
    (tmp_path / "obs.json").write_text(json.dumps(doc["observation_space"]))
    out = tmp_path / "out"
    proc = cli("convert", str(KERAS_DIR / "pendulum_box" / "model"), "--out", str(out), "--samples", "200",
               "--action-space", str(tmp_path / "act.json"), "--observation-space", str(tmp_path / "obs.json"),
               "--dist-inputs", "fc_out")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["spaces"]["observation"] == doc["observation_space"]  # parity sampled the real bounds
    assert manifest["spaces"]["action"] == doc["action_space"]
    got = run_required_only(out / "model.onnx", expected("pendulum_box"))
    np.testing.assert_allclose(got["action_dist_inputs"], expected("pendulum_box")["action_dist_inputs"],
                               rtol=0, atol=1e-5)


def test_box_actions_are_rllibs_unclipped_mean(tmp_path):
    from policy_export.exporter.convert import convert_saved_model
    from policy_export.policy.spaces import space_from_json

    weights = _save_module(tmp_path / "m", {"observations": 3}, {"fc_out": 4, "value_out": 1}, seed=3)
    space = space_from_json({"type": "Box", "low": -0.5, "high": 0.5, "shape": [2], "dtype": "float32"})
    convert_saved_model(tmp_path / "m", tmp_path / "o", action_space=space, device="cpu", samples=200)
    obs = np.random.default_rng(2).uniform(-1, 1, (64, 3)).astype(np.float32)
    mean = (obs @ weights["fc_out"])[:, :2]
    assert (np.abs(mean) > 0.5).any() and (np.abs(mean) < 0.5).any()
    for model in ("model.onnx", "model_deterministic.onnx"):
        got = run_required_only(tmp_path / "o" / model, {"obs": obs})
        # RLlib's policy returns the unclipped mean (it clips when it unsquashes for the environment)
        np.testing.assert_allclose(got["actions_0"], mean, rtol=1e-5, atol=1e-5)
