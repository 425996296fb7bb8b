"""Bad input gets a clear error; faults leave no damage. Each case is its own test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES_DIR
from policy_export.exporter import export_policy, export_spec, formats
from policy_export.exporter.staging import staged_directory
from policy_export.policy import ExportError, PolicyExportError, SpecError, WeightsError, load_spec
from policy_export.policy.h5io import read_h5_weights, write_h5_weights
from helpers import cli, messages

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "40")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def spec_copy(tmp_path: Path, name: str = "cartpole_mlp") -> Path:
    target = tmp_path / "spec"
    shutil.copytree(FIXTURES_DIR / name, target)
    return target


def test_missing_weights_file_is_exit_2(tmp_path):
    spec = spec_copy(tmp_path)
    (spec / "weights.h5").unlink()
    proc = cli("export", str(spec), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "$.weights: file not found" in proc.stderr and "weights.h5" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_truncated_h5_is_a_weights_error(tmp_path):
    data = (FIXTURES_DIR / "cartpole_mlp" / "weights.h5").read_bytes()
    path = tmp_path / "w.h5"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="not a readable HDF5"):
        read_h5_weights(path)


def test_renamed_layer_names_both_sides(tmp_path, policies):
    weights = read_h5_weights(FIXTURES_DIR / "cartpole_mlp" / "weights.h5")
    weights["dense_9/kernel"] = weights.pop("fc_2/kernel")
    bad = write_h5_weights(tmp_path / "renamed.h5", weights)
    with pytest.raises(WeightsError) as info:
        policies("cartpole_mlp").import_model_from_h5(bad)
    assert "missing weight 'fc_2/kernel'" in str(info.value) and "unexpected weight 'dense_9/kernel'" in str(info.value)


def test_output_under_a_file_is_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(blocker / "out"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_not_writable_directory_is_refused(tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    with pytest.raises(ExportError, match="is not writable"):
        with staged_directory(tmp_path / "out"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_existing_non_export_directory_is_never_replaced(tmp_path):
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    with pytest.raises(ExportError, match="holds no valid policy-export manifest"):
        with staged_directory(precious, overwrite=True):
            pass
    assert (precious / "thesis.txt").read_text() == "years of work"


def test_full_disk_mid_export_leaves_nothing(tmp_path, policies, monkeypatch):
    def full_disk(ctx, target):
        target.write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(formats.get("onnx"), "write", full_disk)
    with pytest.raises(ExportError, match="No space left on device; nothing was left behind"):
        export_policy(policies("cartpole_mlp"), tmp_path / "out", samples=32, explore_samples=0, device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_full_disk_in_the_real_onnx_writer_is_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
    from policy_export.exporter import cli
    from policy_export.exporter.formats.onnx import model as onnx_model

    def full_disk(f, lazy):  # the weights no longer fit once the graph is written
        f.write(b"partial")
        raise OSError(28, "No space left on device", f.name)

    monkeypatch.setattr(onnx_model, "_append_initializers", full_disk)
    out = tmp_path / "out"
    code = cli.main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--samples", "16",
                     "--explore-samples", "0", "--device", "cpu"])
    *progress, err = capsys.readouterr().err.strip().splitlines()
    # the stages that finished before the disk filled up each printed their line; the error is one line
    assert code == 2 and err.startswith("policy-export: error:")
    assert [line.split(":")[0] for line in progress] == ["[policy-export] graph build",
                                                         "[policy-export] write saved_model",
                                                         "[policy-export] write frozen_graph"]
    assert "No space left on device" in err and "model" in err
    assert list(tmp_path.iterdir()) == []


def test_interrupt_mid_export_leaves_nothing(tmp_path, policies, monkeypatch):
    def interrupted(ctx, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(formats.get("frozen_graph"), "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_policy(policies("cartpole_mlp"), tmp_path / "out", samples=32, explore_samples=0, device="cpu")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_killed_export_leaves_no_export_and_the_next_one_cleans_up(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "policy_export", "export", str(FIXTURES_DIR / "cartpole_mlp"),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".pe-*.partial/saved_model")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # never a half-written export at the target
    assert list(tmp_path.glob(".pe-*.partial"))  # the killed process could not clean up
    result = export_spec(FIXTURES_DIR / "cartpole_mlp", out, formats=["onnx"], samples=32, explore_samples=0,
                         device="cpu")
    assert result.parity.passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # stale partial and lock are gone


def test_keras_file_with_a_lambda_layer_is_refused(tmp_path):
    import tf_keras as keras

    from policy_export.exporter.formats.keras.model import KerasRunner

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Lambda(lambda x: x * 2)(inputs))
    path = tmp_path / "evil.h5"
    model.save(path, save_format="h5")
    with pytest.raises(ExportError, match="'Lambda' is not built into tf-keras"):
        KerasRunner(path)


def test_verify_checks_a_swapped_onnx_file_before_loading(tmp_path, exports):
    _, out = exports("cartpole_mlp")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "model.onnx").write_bytes(b"\x08\x07garbage that is not onnx")
    proc = cli("verify", str(copy), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["errors"]["onnx"] == "not loaded: its files failed the hash check"  # never loaded
    assert "changed file model.onnx (sha256 differs from the manifest)" in report["file_problems"]


def test_unexpected_errors_point_to_debug(tmp_path, monkeypatch):
    from policy_export.exporter import cli as cli_module
    from policy_export.exporter import commands

    def boom(*args, **kwargs):
        raise ZeroDivisionError("simulated bug")

    monkeypatch.setattr(commands, "cmd_verify", boom)
    assert cli_module.main(["verify", str(tmp_path)]) == 3


# ------------------------------------------------------------------ fuzzing


def _mutate(obj, path: list, value):
    """``obj`` with the item at ``path`` (keys, or indexes into lists and sorted dict keys) set to ``value``."""
    if not path:
        return value
    head, *rest = path
    if isinstance(obj, dict):
        key = head if isinstance(head, str) else (sorted(obj)[head % len(obj)] if obj else "k")
        return {**obj, key: _mutate(obj.get(key), rest, value)}
    if isinstance(obj, list) and obj:
        i = head % len(obj) if isinstance(head, int) else 0
        return [*obj[:i], _mutate(obj[i], rest, value), *obj[i + 1:]]
    return value


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=8)
KEYS = st.sampled_from(["format_version", "name", "observation_space", "action_space", "model", "weights", "seed",
                        "type", "low", "high", "shape", "dtype", "n", "nvec", "spaces", "hiddens", "activation",
                        "conv_filters", "lstm", "cell_size", "start", "extra"])


@FUZZ
@given(path=st.lists(KEYS | st.integers(0, 3), min_size=1, max_size=4), value=JSON_VALUES)
def test_fuzzed_spec_files_give_only_package_errors(path, value, tmp_path_factory):
    base = json.loads((FIXTURES_DIR / "tuple_action" / "policy.json").read_text())
    spec_dir = tmp_path_factory.mktemp("fuzz")
    shutil.copy(FIXTURES_DIR / "tuple_action" / "weights.h5", spec_dir / "weights.h5")
    (spec_dir / "policy.json").write_text(json.dumps(_mutate(base, path, value)))
    try:
        load_spec(spec_dir)
    except PolicyExportError:
        pass  # the package's own error, with a message


@FUZZ
@given(text=st.text(max_size=200))
def test_fuzzed_spec_text_gives_only_package_errors(text, tmp_path_factory):
    spec_dir = tmp_path_factory.mktemp("fuzz")
    (spec_dir / "policy.json").write_text(text)
    with pytest.raises(SpecError):
        load_spec(spec_dir)


@FUZZ
@given(data=st.data())
def test_fuzzed_h5_files_give_only_weights_errors_and_change_nothing(data, policies, tmp_path_factory):
    policy = policies("cartpole_mlp")
    before = policy.get_weights()
    raw = bytearray((FIXTURES_DIR / "cartpole_mlp" / "weights.h5").read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "attrs"]))
    path = tmp_path_factory.mktemp("fuzz") / "w.h5"
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 20))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
        path.write_bytes(bytes(raw))
    elif how == "truncate":
        path.write_bytes(bytes(raw[: data.draw(st.integers(0, len(raw) - 1))]))
    else:
        path.write_bytes(bytes(raw))
        with h5py.File(path, "a") as f:
            names = [n.decode() for n in f.attrs["layer_names"]]
            victim = data.draw(st.sampled_from(names))
            f[victim].attrs["weight_names"] = np.array(data.draw(st.lists(st.text(
                alphabet="abc/:0_", min_size=1, max_size=8), max_size=3)), dtype="S")
    try:
        policy.import_model_from_h5(path)
        imported = True
    except WeightsError:
        imported = False
    after = policy.get_weights()
    if not imported:  # absent: not one weight changed
        assert all(np.array_equal(before[k], after[k]) for k in before)
        return
    # a flipped byte inside a weight array can still be a valid file: then the import is whole,
    # every weight exactly what the file holds
    assert how == "flip"
    stored = read_h5_weights(path)
    assert sorted(stored) == sorted(after) and all(np.array_equal(stored[k], after[k]) for k in after)
    policy.set_weights(before)


# ------------------------------------------------------------------ regressions found in review


def test_a_lock_file_left_by_a_dead_process_does_not_block(tmp_path):
    from policy_export.exporter.staging import lock_path

    lock_path(tmp_path / "out").write_text("")  # left empty by a kill between create and write
    with staged_directory(tmp_path / "out") as stage:
        (stage / "manifest.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_glob_characters_in_the_name_touch_no_other_export(tmp_path):
    other = tmp_path / ".run1.partial-abc"
    other.mkdir()
    with staged_directory(tmp_path / "run[1]") as stage:
        (stage / "manifest.json").write_text("{}")
    assert other.is_dir()


def test_an_export_killed_between_its_renames_gets_its_old_export_back(tmp_path):
    from policy_export.exporter.staging import _write_journal

    old = tmp_path / ".pe-0123456789abcdef.old"
    old.mkdir()
    (old / "manifest.json").write_text('{"old": true}')
    _write_journal(tmp_path / "out", {"partial": None, "old": old.name})
    with pytest.raises(ExportError):  # no --overwrite: the restored export stays
        with staged_directory(tmp_path / "out") as stage:
            (stage / "manifest.json").write_text("{}")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == {"old": True}


def test_export_directory_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with staged_directory(tmp_path / "out") as stage:
            (stage / "manifest.json").write_text("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("args, fragment", [
    (["--atol", "nan"], "atol must be a finite number"),
    (["--rtol", "-1"], "rtol must be a finite number"),
    (["--seed", "-1"], "seed (--seed) must be at least 0, got -1"),
    (["--junit", "/nonexistent/dir/j.xml"], "does not exist"),
])
def test_more_bad_cli_input_is_exit_2(args, fragment, tmp_path):
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "out"), *args)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
    assert len(messages(proc.stderr)) == 1


@pytest.mark.parametrize("space, fragment", [
    ({"type": "Box", "low": -1, "high": 255, "shape": [2], "dtype": "uint8"}, "do not fit uint8"),
    ({"type": "Box", "low": 0, "high": 2.5, "shape": [2], "dtype": "int32"}, "whole-number bounds"),
    ({"type": "Dict", "spaces": {"a b": {"type": "Discrete", "n": 2}}}, "key 'a b'"),
])
def test_spaces_that_would_be_mangled_are_refused(space, fragment):
    from policy_export.policy import spec_from_json

    obj = {"format_version": 1, "name": "x", "observation_space": space, "action_space": {"type": "Discrete", "n": 2},
           "model": {"hiddens": [4]}}
    with pytest.raises(SpecError, match=fragment):
        spec_from_json(obj)


def test_verify_reports_broken_golden_files_and_unknown_formats_as_failed_checks(tmp_path, exports):
    _, out = exports("cartpole_mlp")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with np.load(copy / "parity" / "inputs.npz") as data:
        np.savez(copy / "parity" / "inputs.npz", observations=data["observations"][:, :3])
    doc = json.loads((copy / "manifest.json").read_text())
    doc["formats"]["coreml"] = {"files": []}
    (copy / "manifest.json").write_text(json.dumps(doc))
    proc = cli("verify", str(copy), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert "changed file parity/inputs.npz (sha256 differs from the manifest)" in report["file_problems"]
    assert "unknown format 'coreml'" in report["errors"]["coreml"]
    assert report["errors"]["parity"] == "golden files not loaded: they failed the hash check"
    assert report["records"] == []  # nothing ran on inputs that failed their hash
    from policy_export.exporter.manifest import file_records

    doc["files"] = file_records(copy)  # re-signed: the golden files load, and no longer fit the model
    (copy / "manifest.json").write_text(json.dumps(doc))
    proc = cli("verify", str(copy), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr
    assert "onnx" in json.loads((tmp_path / "r.json").read_text())["errors"]


def test_recurrent_inputs_are_checked_like_feed_forward_ones(policies):
    from policy_export.policy import InputError

    policy = policies("cartpole_lstm")
    good = dict(prev_action=np.zeros(4, np.int64), prev_reward=np.zeros(4, np.float32))
    with pytest.raises(InputError, match="safely cast"):
        policy.compute_actions(np.full((4, 4), "1.5"), **good)
    with pytest.raises(InputError, match="seq_lens must be integers"):
        policy.compute_actions(np.zeros((4, 4), np.float32), seq_lens=[0.5] * 4, **good)
    with pytest.raises(InputError, match="state has 1 arrays"):
        policy.compute_actions(np.zeros((4, 4), np.float32), state=[np.zeros((4, 32))], **good)
    with pytest.raises(InputError, match="prev_action has 3 rows"):
        policy.compute_actions(np.zeros((4, 4), np.float32), prev_action=np.zeros(3, np.int64),
                               prev_reward=np.zeros(4, np.float32))


def test_keras_op_layers_are_accepted_and_nested_lambdas_refused(tmp_path):
    import tensorflow as tf
    import tf_keras as keras

    from policy_export.exporter.formats.keras.model import KerasRunner, check_config_safe

    inputs = keras.Input((3,))
    model = keras.Model(inputs, tf.concat([inputs, inputs[:, :1]], axis=-1))  # TFOpLambda, SlicingOpLambda
    model.save(tmp_path / "ops.h5", save_format="h5")
    out = KerasRunner(tmp_path / "ops.h5")({model.inputs[0].name.split(":")[0]: np.ones((2, 3), np.float32)})
    assert next(iter(out.values())).shape == (2, 4)
    nested = {"class_name": "Functional", "config": {"layers": [{"class_name": "Bidirectional", "config": {
        "layer": {"class_name": "LSTM", "config": {}},
        "backward_layer": {"class_name": "Lambda", "config": {"function": "..."}}}}]}}
    with pytest.raises(ExportError, match="'Lambda'"):
        check_config_safe(nested, "x.h5")
