"""Inputs stay inside their directory, JSON is read strictly, weights are exact, file checks use hashes.

Every negative case checks the exit code, the one stderr line, and that nothing outside the
tool's own files changed (a snapshot of the test directory before and after).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import FIXTURES_DIR
from policy_export.exporter import formats, manifest
from policy_export.policy import TFPolicy, WeightsError, load_spec
from policy_export.policy.jsonio import JSONError, loads
from helpers import cli
from helpers import one_line_error, snapshot

SPEC = FIXTURES_DIR / "cartpole_mlp"


@pytest.fixture(scope="module")
def small_export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trust") / "exp"
    proc = cli("export", str(SPEC), "--out", str(out), "--formats", "saved_model,onnx", "--samples", "8")
    assert proc.returncode == 0, proc.stderr
    return out


def _spec_dir(tmp_path: Path, **changes) -> Path:
    spec = tmp_path / "spec"
    shutil.copytree(SPEC, spec)
    doc = json.loads((spec / "policy.json").read_text())
    doc.update(changes)
    (spec / "policy.json").write_text(json.dumps(doc))
    return spec


# ------------------------------------------------------------------ weights stay in the spec directory


@pytest.mark.parametrize("how, fragment", [
    ("absolute", "is an absolute path"),
    ("dotdot", "leaves the spec's directory through '..'"),
    ("symlink_out", "is a symbolic link"),
    ("symlinked_dir", "is a symbolic link"),
])
def test_weights_outside_the_spec_directory_are_refused_with_exit_2(tmp_path, how, fragment):
    host = tmp_path / "host"
    host.mkdir()
    shutil.copy(SPEC / "weights.h5", host / "secret.h5")  # a valid weights file the spec must not reach
    spec = _spec_dir(tmp_path)
    weights = {"absolute": str(host / "secret.h5"), "dotdot": "../host/secret.h5",
               "symlink_out": "w.h5", "symlinked_dir": "d/secret.h5"}[how]
    if how == "symlink_out":
        (spec / "w.h5").symlink_to(host / "secret.h5")
    elif how == "symlinked_dir":
        (spec / "d").symlink_to(host)
    doc = json.loads((spec / "policy.json").read_text())
    (spec / "policy.json").write_text(json.dumps({**doc, "weights": weights}))
    before = snapshot(tmp_path)
    proc = cli("export", str(spec), "--out", str(tmp_path / "out"), "--formats", "saved_model", "--samples", "8")
    one_line_error(proc, 2, "$.weights: ")
    assert fragment in proc.stderr and "inside the spec's directory" in proc.stderr
    assert snapshot(tmp_path) == before


def test_weights_inside_the_spec_directory_still_load(tmp_path):
    spec = _spec_dir(tmp_path, weights="./sub//weights.h5")
    (spec / "sub").mkdir()
    shutil.move(spec / "weights.h5", spec / "sub" / "weights.h5")
    assert load_spec(spec).weights == spec / "sub" / "weights.h5"


def test_a_symlinked_weights_file_is_refused_by_the_reader_itself(tmp_path):
    from policy_export.policy.h5io import read_h5_weights

    (tmp_path / "w.h5").symlink_to(SPEC / "weights.h5")
    with pytest.raises(WeightsError, match="symbolic link"):
        read_h5_weights(tmp_path / "w.h5")
    assert read_h5_weights(SPEC / "weights.h5")["fc_1/kernel"].dtype == np.float32


# ------------------------------------------------------------------------------------ strict JSON


@pytest.mark.parametrize("text, fragment", [
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('[NaN]', "NaN is not a JSON number"),
    ('[Infinity]', "Infinity is not a JSON number"),
    ('[-Infinity]', "-Infinity is not a JSON number"),
    ('[1e999]', "overflows a float"),
    ("[" + "9" * 5000 + "]", "5000 digits exceeds the limit of 30"),
    ('["\\ud800"]', "unpaired surrogate"),
    ("[" * 900 + "]" * 900, "nested too deeply"),
])
def test_the_strict_reader_refuses_what_python_would_accept(text, fragment):
    with pytest.raises(JSONError, match="x.json: ") as info:
        loads(text, "x.json")
    assert fragment in str(info.value) and info.value.exit_code == 2
    with pytest.raises(JSONError, match="not UTF-8"):
        loads(b'{"a": "\xff"}', "x.json")
    assert loads('{"a": [1, -2.5e3, "inf", null, true]}') == {"a": [1, -2500.0, "inf", None, True]}


@pytest.mark.parametrize("edit, fragment", [
    (lambda t: t.replace('"seed": 0', '"seed": ' + "1" * 5000), "5000 digits"),
    (lambda t: t.replace('"seed": 0', '"seed": 0, "seed": 1'), "duplicate key 'seed'"),
    (lambda t: t.replace('"seed": 0', '"seed": NaN'), "NaN is not a JSON number"),
])
def test_a_spec_with_huge_ints_duplicates_or_nan_is_exit_2(tmp_path, edit, fragment):
    spec = _spec_dir(tmp_path, seed=0)
    text = (spec / "policy.json").read_text()
    (spec / "policy.json").write_text(edit(text))
    assert edit(text) != text
    before = snapshot(tmp_path)
    proc = cli("export", str(spec), "--out", str(tmp_path / "out"), "--formats", "saved_model", "--samples", "8")
    one_line_error(proc, 2, fragment)
    assert snapshot(tmp_path) == before


def _manifest_cases(doc: dict) -> list[tuple[str, str]]:
    text = json.dumps(doc)
    first = doc["files"][0]
    twice = {**doc, "files": [*doc["files"], {**first, "sha256": "0" * 64}]}
    return [
        (text.replace('"manifest_version": 1', '"manifest_version": ' + "1" * 5000, 1), "5000 digits"),
        (text.replace('"manifest_version": 1', '"manifest_version": 1, "manifest_version": 1', 1),
         "duplicate key 'manifest_version'"),
        (text.replace('"atol": ', '"atol": Infinity, "x": ', 1), "Infinity is not a JSON number"),
        (json.dumps(twice), f"{first['path']!r} is listed more than once"),
        (json.dumps({**doc, "files": [{**first, "path": "./" + first["path"]}, *doc["files"][1:]]}),
         "normalised relative POSIX paths"),
        (json.dumps({**doc, "files": [{**first, "path": "saved_model//x"}, *doc["files"][1:]]}),
         "normalised relative POSIX paths"),
    ]


def test_malformed_manifests_are_exit_2_naming_the_problem(tmp_path, small_export):
    export = tmp_path / "exp"
    shutil.copytree(small_export, export)
    doc = json.loads((export / "manifest.json").read_text())
    for text, fragment in _manifest_cases(doc):
        (export / "manifest.json").write_text(text)
        before = snapshot(tmp_path)
        proc = cli("verify", str(export))
        one_line_error(proc, 2, fragment)
        assert "manifest.json" in proc.stderr
        assert snapshot(tmp_path) == before


def test_check_files_flags_a_file_listed_twice(small_export):
    doc = json.loads((small_export / "manifest.json").read_text())
    first = doc["files"][0]
    check = manifest.check_files(small_export, {**doc, "files": [*doc["files"], dict(first)]}, formats.paths())
    assert check.problems == [f"file {first['path']} is listed more than once in the manifest"]
    assert not check.trusted(first["path"])
    assert manifest.check_files(small_export, doc, formats.paths()).problems == []


# -------------------------------------------------------------------------------- exact weights


@pytest.mark.parametrize("dtype, fragment", [
    ("c8", "complex"), ("c16", "complex"), ("bool", "complex, bool"), ("S4", "complex, bool, string"),
    ([("a", "f4"), ("b", "f4")], "compound"),
])
def test_h5_weights_that_are_not_real_numbers_are_refused_naming_the_dataset(tmp_path, dtype, fragment):
    path = tmp_path / "w.h5"
    shutil.copy(SPEC / "weights.h5", path)
    with h5py.File(path, "r+") as f:
        group = f["fc_1"]
        name = group.attrs["weight_names"][0].decode()
        shape = group[name].shape
        del group[name]
        group.create_dataset(name, data=np.ones(shape, dtype=dtype) if dtype != "S4" else np.full(shape, b"1"))
    policy = TFPolicy.from_spec(load_spec(SPEC))
    before = policy.get_weights()
    with pytest.raises(WeightsError, match=r"weight 'fc_1/kernel' \(dataset /fc_1/fc_1/kernel:0\) has dtype") as info:
        policy.import_model_from_h5(path)
    assert fragment in str(info.value)
    assert all(np.array_equal(v, policy.get_weights()[k]) for k, v in before.items())  # nothing assigned


def test_weights_are_never_changed_by_a_cast(policies):
    policy = policies("cartpole_mlp")
    kept = policy.get_weights()
    try:
        exact = {k: v.astype(np.float64) for k, v in kept.items()}
        policy.set_weights(exact)  # float64 values float32 holds exactly: accepted, bit for bit
        assert all(np.array_equal(v, policy.get_weights()[k]) for k, v in kept.items())
        lossy = dict(exact)
        lossy["fc_1/kernel"] = lossy["fc_1/kernel"] + 1e-12
        with pytest.raises(WeightsError, match="'fc_1/kernel' has dtype float64 values that float32 cannot hold exactly"):
            policy.set_weights(lossy)
        huge = dict(exact)
        huge["fc_1/bias"] = np.full_like(huge["fc_1/bias"], 1e300)
        with pytest.raises(WeightsError, match="'fc_1/bias' has dtype float64 values"):
            policy.set_weights(huge)
        with pytest.raises(WeightsError, match="'fc_1/bias' has dtype complex64"):
            policy.set_weights({**exact, "fc_1/bias": kept["fc_1/bias"].astype(np.complex64) + 1j})
    finally:
        policy.set_weights(kept)


# ------------------------------------------------- the file check compares hashes, not sizes


@pytest.mark.parametrize("rel", ["model.onnx", "parity/inputs.npz"])
def test_one_flipped_byte_of_the_same_size_fails_verify_naming_the_file(tmp_path, small_export, rel):
    export = tmp_path / "exp"
    shutil.copytree(small_export, export)
    target = export / rel
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    assert target.stat().st_size == (small_export / rel).stat().st_size
    before = snapshot(tmp_path, skip=("r.json",))
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert f"changed file {rel} (sha256 differs from the manifest)" in report["file_problems"]
    if rel == "model.onnx":
        assert report["errors"]["onnx"] == "not loaded: its files failed the hash check"
        assert not any(r["format"] == "onnx" for r in report["records"])
    assert snapshot(tmp_path, skip=("r.json",)) == before


def test_a_keras_op_layer_naming_a_file_writing_tf_function_is_refused_before_loading(tmp_path):
    import h5py
    import tensorflow as tf
    import tf_keras as keras

    from policy_export.exporter.formats.keras.model import OP_LAMBDA_FUNCTIONS, KerasRunner
    from policy_export.policy import ExportError

    inputs = keras.Input((3,))
    model = keras.Model(inputs, tf.concat([inputs, inputs], axis=-1))  # a real TFOpLambda layer
    path = tmp_path / "ops.h5"
    model.save(path, save_format="h5")
    with h5py.File(path, "r+") as f:
        config = f.attrs["model_config"]
        config = config.decode() if isinstance(config, bytes) else config
        assert '"function": "concat"' in config
        f.attrs["model_config"] = config.replace('"function": "concat"', '"function": "io.write_file"')
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ExportError, match=r"TFOpLambda names TF function 'io.write_file'"):
        KerasRunner(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert "io.write_file" not in OP_LAMBDA_FUNCTIONS and "concat" in OP_LAMBDA_FUNCTIONS


@pytest.mark.parametrize("factor, fails", [(3.0, True), (0.3, False)])
def test_rollout_fails_a_float_action_off_by_a_few_times_its_tolerance(exports, monkeypatch, factor, fails):
    from policy_export.exporter import verify
    from policy_export.exporter.parity.compare import Tolerances
    from policy_export.exporter.rollout import rollout

    _, out = exports("pendulum_mlp")
    tol = Tolerances.from_json(manifest.read_manifest(out)["tolerances"]).for_output("actions_0")
    real = verify.load_runner

    class Shifted:
        """The ONNX runner with its float action moved by ``factor`` times its tolerance."""

        def __init__(self, runner):
            self.runner = runner

        def __call__(self, feeds):
            result = dict(self.runner(feeds))
            a = result["actions_0"]
            result["actions_0"] = (a + factor * (tol.atol + tol.rtol * np.abs(a))).astype(a.dtype)
            return result

        def close(self):
            self.runner.close()

    def load_runner(fmt, *args, **kwargs):
        runner = real(fmt, *args, **kwargs)
        return Shifted(runner) if fmt == "onnx" else runner

    monkeypatch.setattr(verify, "load_runner", load_runner)
    # one step each: later steps would compound the shift through the environment's dynamics
    report = rollout(out, "Pendulum-v1", episodes=3, max_steps=1, device="cpu", formats=["saved_model", "onnx"])
    assert report.passed is (not fails)
    assert ("onnx" in report.failed_formats()) is fails
    assert report.max_deviation("onnx") > 0.25 * factor * tol.atol
