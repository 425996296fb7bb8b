"""Mistakes a person makes at the command line are refused before TensorFlow loads, with a
suggestion where one name is close to another."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import FIXTURES_DIR
from helpers import messages, one_line_error

CODE = ("import sys\n"
        "from policy_export.exporter.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print('tensorflow' in sys.modules)\n"
        "sys.exit(code)")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from helpers import cli

    out = tmp_path_factory.mktemp("early") / "out"
    done = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--formats", "onnx",
               "--explore-samples", "0", "--samples", "50", "-q")
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("args,fragment", [
    (("--env", "CartPle-v1"), "'CartPle-v1' is not a registered gymnasium environment; did you mean CartPole-v1?"),
    (("--env", "Pendulum-v1"), "Pendulum-v1's spaces"),
])
def test_a_wrong_environment_is_refused_before_tensorflow(export, args, fragment):
    done = _run("rollout", str(export), *args)
    one_line_error(done, 2, fragment)
    assert done.stdout.strip() == "False"


def test_a_mistyped_format_gets_a_suggestion_before_tensorflow(tmp_path):
    done = _run("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "o"), "--formats", "onxx")
    one_line_error(done, 2, "unknown format(s) ['onxx']: choose from saved_model,")
    assert done.stderr.rstrip().endswith("did you mean onnx?")
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("args,fragment", [
    (("verify", "/nonexistent/out"), "/nonexistent/out: no such export directory"),
    (("inspect", "/nonexistent/model.onnx"), "/nonexistent/model.onnx: no such file or directory"),
    (("diff", "/nonexistent/a", "/nonexistent/b"), "/nonexistent/a: no such file or directory"),
    (("rollout", "/nonexistent/out", "--env", "CartPole-v1"), "/nonexistent/out: no such export directory"),
])
def test_a_missing_path_is_named_as_missing(args, fragment):
    from helpers import cli

    one_line_error(cli(*args), 2, fragment)


# ------------------------------------------------------------------ a weights file that does not fit

SPEC_FIXTURES = sorted(p.parent.name for p in FIXTURES_DIR.glob("*/policy.json"))
_IMAGE = {"type": "Box", "low": 0, "high": 255, "shape": [21, 17, 3], "dtype": "uint8"}
MORE_SPECS = {  # what the fixtures do not cover: two image stacks, no hidden layer, an LSTM over images
    "two_images": {"observation_space": {"type": "Dict", "spaces": {
        "a": _IMAGE, "b": {**_IMAGE, "shape": [9, 30, 1]}, "v": {"type": "MultiDiscrete", "nvec": [2, 3]}}},
        "action_space": {"type": "Box", "low": -1, "high": 1, "shape": [2, 3], "dtype": "float32"},
        "model": {"hiddens": [], "activation": "relu", "conv_filters": [[4, [3, 3], 2], [6, [2, 5], 3]]}},
    "lstm_images": {"observation_space": _IMAGE, "action_space": {"type": "MultiDiscrete", "nvec": [2, 5]},
                    "model": {"hiddens": [8], "activation": "tanh", "conv_filters": [[4, [3, 3], 2]],
                              "lstm": {"cell_size": 5, "max_seq_len": 4, "use_prev_action": True,
                                       "use_prev_reward": False}}},
}


@pytest.mark.parametrize("name", SPEC_FIXTURES + list(MORE_SPECS))
def test_the_expected_weights_are_the_built_models(name):
    """:func:`policy.layout.expected_weights` (no TensorFlow) lists the built model's weights, in its order."""
    from policy_export.policy.layout import expected_weights
    from policy_export.policy.spec import spec_from_json
    from policy_export.policy.template import template_spec
    from policy_export.policy.tf_policy import TFPolicy

    if name in MORE_SPECS:
        spec = spec_from_json({"format_version": 1, "name": name, "seed": 0, **MORE_SPECS[name]})
    else:
        spec = template_spec(FIXTURES_DIR / name)
    policy = TFPolicy.from_spec(spec)
    try:
        built = [(key, tuple(value.shape)) for key, value in policy.get_weights().items()]
    finally:
        policy.close()
    assert list(expected_weights(spec).items()) == built


def _bad_spec(tmp_path, how: str):
    """A copy of the CartPole spec whose weights.h5 is ``how`` wrong."""
    import shutil

    import numpy as np

    from policy_export.policy.h5io import read_h5_weights, write_h5_weights

    spec = tmp_path / how
    spec.mkdir()
    shutil.copy(FIXTURES_DIR / "cartpole_mlp" / "policy.json", spec / "policy.json")
    weights = read_h5_weights(FIXTURES_DIR / "cartpole_mlp" / "weights.h5")
    if how == "transposed":
        weights["fc_1/kernel"] = weights["fc_1/kernel"].T.copy()
    elif how == "missing_layer":
        weights = {k: v for k, v in weights.items() if not k.startswith("fc_2/")}
    elif how == "extra_layer":
        weights.update({"fc_3/kernel": np.zeros((16, 16), np.float32), "fc_3/bias": np.zeros(16, np.float32)})
    write_h5_weights(spec / "weights.h5", weights)
    if how == "not_hdf5":
        (spec / "weights.h5").write_bytes(b"weights saved by another tool\n")
    return spec


HINT = ("name your model's layers like the policy's (Dense(..., name='fc_1')), or write a file with the policy's "
        "names and shapes with policy_export.write_weights_template(spec, path) and fill in your arrays; see "
        "docs/spec.md, \"Layer and weight names\"")


@pytest.mark.parametrize("how,fragments", [
    ("transposed", ["weight 'fc_1/kernel' has shape [16, 4], the policy expects [4, 16]"]),
    ("not_hdf5", ["not a readable HDF5 weights file ("]),
    ("missing_layer", ["missing weight 'fc_2/kernel'; missing weight 'fc_2/bias'; hint: the file's layers "
                       "(fc_1, fc_out) are not the policy's (fc_1, fc_2, fc_out); " + HINT]),
    ("extra_layer", ["unexpected weight 'fc_3/kernel' (the policy has no such layer weight); unexpected weight "
                     "'fc_3/bias' (the policy has no such layer weight); hint: the file's layers (fc_1, fc_2, "
                     "fc_out, fc_3) are not the policy's (fc_1, fc_2, fc_out); " + HINT]),
])
def test_weights_that_do_not_fit_are_refused_before_tensorflow(tmp_path, how, fragments):
    spec = _bad_spec(tmp_path, how)
    done = _run("export", str(spec), "--out", str(tmp_path / "out"), "--formats", "onnx")
    one_line_error(done, 2, f"cannot use weights from {spec / 'weights.h5'}: {fragments[0]}")
    assert done.stdout.strip() == "False"
    assert done.stderr.count("hint:") == (0 if how in ("transposed", "not_hdf5") else 1)
    assert not (tmp_path / "out").exists()


KERAS_MODEL = """
import sys
import tf_keras as keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(2)])
model.save_weights(sys.argv[1])
"""


def test_a_users_own_keras_weights_are_refused_before_tensorflow_with_the_renaming(tmp_path):
    import shutil

    spec = tmp_path / "mine"
    spec.mkdir()
    shutil.copy(FIXTURES_DIR / "cartpole_mlp" / "policy.json", spec / "policy.json")
    made = subprocess.run([sys.executable, "-c", KERAS_MODEL, str(spec / "weights.h5")], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    done = _run("export", str(spec), "--out", str(tmp_path / "out"), "--formats", "onnx")
    one_line_error(done, 2, "6 missing weight(s), the policy's: 'fc_1/kernel' [4, 16], 'fc_1/bias' [16]")
    assert done.stdout.strip() == "False"
    message = messages(done.stderr)[0]  # wrapped at 80 columns: joined again
    assert ("6 unexpected weight(s), the policy has no such layer weight: 'dense/kernel' [4, 16], 'dense/bias' [16], "
            "'dense_1/kernel' [16, 16]") in message
    assert ("hint: the file's layers (dense, dense_1, dense_2) are not the policy's (fc_1, fc_2, fc_out); its weights "
            "have the policy's shapes in the same order, only the names differ (dense -> fc_1, dense_1 -> fc_2, "
            "dense_2 -> fc_out): " + HINT) in message
    assert done.stderr.count("hint:") == 1


def test_the_early_refusal_words_it_as_the_policy_does(tmp_path):
    """The same WeightsError from load_spec (no TensorFlow) as from TFPolicy.import_model_from_h5."""
    from policy_export.errors import WeightsError
    from policy_export.policy.spec import load_spec
    from policy_export.policy.template import template_spec
    from policy_export.policy.tf_policy import TFPolicy

    for how in ("transposed", "missing_layer", "extra_layer"):
        spec = _bad_spec(tmp_path, how)
        with pytest.raises(WeightsError) as early:
            load_spec(spec)
        policy = TFPolicy.from_spec(template_spec(spec))
        try:
            with pytest.raises(WeightsError) as built:
                policy.import_model_from_h5(spec / "weights.h5")
        finally:
            policy.close()
        assert str(early.value) == str(built.value)
    # a file that is not HDF5 at all (or empty) is refused here too
    for data in (b"not hdf5", b""):
        (spec / "weights.h5").write_bytes(data)
        with pytest.raises(WeightsError, match=r"weights\.h5: not a readable HDF5 weights file \("):
            load_spec(spec)


API_CODE = """
import dataclasses, sys
from pathlib import Path
from policy_export import WeightsError, export_spec, load_spec
from policy_export.policy.spec import spec_from_json
import json
spec = spec_from_json(json.loads(Path(sys.argv[1], "policy.json").read_text()), base_dir=Path(sys.argv[1]))
try:
    export_spec(spec, sys.argv[2], formats=("onnx",))
except WeightsError as e:
    print(type(e).__name__, "tensorflow" in sys.modules, Path(sys.argv[2]).exists())
    print(e)
"""


def test_a_spec_object_given_to_the_api_is_checked_before_tensorflow_too(tmp_path):
    """export_spec(PolicySpec) checks the weights file as load_spec does, before TensorFlow."""
    spec = _bad_spec(tmp_path, "transposed")
    done = subprocess.run([sys.executable, "-c", API_CODE, str(spec), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, message = done.stdout.splitlines()[:2]
    assert first == "WeightsError False False"
    assert "weight 'fc_1/kernel' has shape [16, 4], the policy expects [4, 16]" in message
