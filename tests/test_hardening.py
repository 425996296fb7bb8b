"""Hostile files, paths and signals: a clear refusal with the promised exit code, and nothing lost.

Every negative case checks the exit code, that stderr is one line, and that no file outside the
tool's own output changed (a snapshot of the test directory before and after).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import FIXTURES_DIR, default_signals
from policy_export.exporter import manifest
from policy_export.exporter.staging import _write_journal, journal_path, lock_path, staged_directory
from policy_export.policy import ExportError, InputError, SpecError, WeightsError, spec_from_json
from policy_export.policy.h5io import read_h5_weights
from helpers import cli, messages, one_line_error, resign, snapshot

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ helpers


def copy_export(exports, tmp_path: Path, name: str = "cartpole_mlp") -> Path:
    _, out = exports(name)
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    return copy


def make_saved_model(path: Path, kind: str, victim: Path) -> None:
    """A small TF1 SavedModel whose init op, outputs or functions do something hostile to ``victim``."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), tf1.Session(graph=graph) as sess:
        x = tf1.placeholder(tf.float32, [None, 4], name="obs")
        w = tf1.get_variable("w", [4, 2])
        y = tf.matmul(x, w)
        sess.run(tf1.global_variables_initializer())
        extra = {}
        if kind == "main_op_writes":
            extra["main_op"] = tf.group(tf.io.write_file(str(victim), "pwned"))
        elif kind == "legacy_init_reads":
            extra["legacy_init_op"] = tf.group(tf1.assign(w, tf.zeros([4, 2])), tf.io.read_file(str(victim)))
        elif kind == "output_writes":
            with tf.control_dependencies([tf.io.write_file(str(victim), "pwned")]):
                y = tf.identity(y)
        elif kind == "py_func":
            y = tf1.py_func(lambda a: a, [y], tf.float32)
        elif kind == "save_in_init":
            extra["main_op"] = tf.group(tf.raw_ops.SaveV2(prefix=str(victim), tensor_names=["w"],
                                                          shape_and_slices=[""], tensors=[w]))
        elif kind == "queue_in_init":
            extra["main_op"] = tf.group(tf1.FIFOQueue(3, tf.float32).enqueue(1.0))
        elif kind == "function_writes":
            @tf.function
            def f(a):
                tf.io.write_file(str(victim), "pwned")
                return a

            y = f(y)
        elif kind != "clean":
            raise ValueError(kind)
        sig = tf1.saved_model.predict_signature_def({"observations": x}, {"actions": y})
        builder = tf1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map={"serving_default": sig}, **extra)
        builder.save()


HOSTILE = {
    "main_op_writes": "WriteFile", "legacy_init_reads": "ReadFile", "output_writes": "WriteFile",
    "py_func": "PyFunc", "save_in_init": "SaveV2", "queue_in_init": "FIFOQueueV2", "function_writes": "WriteFile",
}


# ------------------------------------------------------------------------ 1. data loss and clobbering


def test_overwrite_never_replaces_a_directory_with_a_foreign_manifest(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "manifest.json").write_text('{"name": "my web app", "icons": []}')
    (site / "index.html").write_text("<html></html>")
    before = snapshot(tmp_path)
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(site), "--overwrite")
    one_line_error(proc, 2, "holds no valid policy-export manifest")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("doc", [
    {},
    {"manifest_version": 1, "contract": "x", "files": [], "formats": {}, "tensor_names": {}, "tolerances": {}},
    {"manifest_version": 1, "contract": {"inputs": [], "outputs": []}, "files": "all",
     "formats": {}, "tensor_names": {}, "tolerances": {"default": {"atol": 0, "rtol": 0}}},
])
def test_staging_refuses_to_replace_a_directory_whose_manifest_does_not_validate(tmp_path, doc):
    target = tmp_path / "out"
    target.mkdir()
    (target / "manifest.json").write_text(json.dumps(doc))
    (target / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(ExportError, match="no valid policy-export manifest"):
        with staged_directory(target, overwrite=True):
            pass
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_a_real_export(tmp_path, exports):
    target = copy_export(exports, tmp_path)
    with staged_directory(target, overwrite=True) as stage:
        (stage / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock_path(tmp_path / "out").symlink_to(victim)
    before = snapshot(tmp_path)
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "out"))
    one_line_error(proc, 2, "lock file")
    assert snapshot(tmp_path) == before


def test_a_fifo_lock_file_is_refused_without_hanging(tmp_path):
    os.mkfifo(lock_path(tmp_path / "out"))
    with pytest.raises(ExportError, match="not a regular file"):
        with staged_directory(tmp_path / "out"):
            pass
    assert not (tmp_path / "out").exists()


def test_a_hard_linked_lock_file_is_never_truncated(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.link(victim, lock_path(tmp_path / "out"))
    with staged_directory(tmp_path / "out") as stage:
        (stage / "manifest.json").write_text("{}")
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim.txt"]


def test_stale_cleanup_touches_only_what_the_journal_names(tmp_path):
    backup = tmp_path / ".out.old-backup-2024"
    keep = tmp_path / ".pe-0000000000000000.old"
    partial = tmp_path / ".pe-1111111111111111.partial"
    for d in (backup, keep, partial):
        d.mkdir()
        (d / "manifest.json").write_text('{"user": true}')
    ours = tmp_path / ".pe-abcdefabcdef1234.partial"
    ours.mkdir()
    (ours / "half.bin").write_text("x")
    _write_journal(tmp_path / "out", {"partial": ours.name, "old": None})
    before = snapshot(tmp_path, skip=(ours.name, journal_path(tmp_path / "out").name))
    with staged_directory(tmp_path / "out") as stage:
        (stage / "manifest.json").write_text("{}")
    after = snapshot(tmp_path, skip=("out",))
    assert after == before  # the user's directories are exactly as they were
    assert not ours.exists()  # ours is gone
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == {}  # no user dir was moved into place


def test_a_journalled_old_export_is_restored_and_an_unjournalled_one_is_not(tmp_path):
    mine = tmp_path / ".pe-2222222222222222.old"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"user": true}')
    with pytest.raises(ExportError):  # nothing restored, so the stage lands; then the next export refuses
        with staged_directory(tmp_path / "out") as stage:
            (stage / "manifest.json").write_text('{"new": true}')
        with staged_directory(tmp_path / "out") as stage:
            pass
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == {"new": True}
    assert json.loads((mine / "manifest.json").read_text()) == {"user": True}
    shutil.rmtree(tmp_path / "out")
    ours = tmp_path / ".pe-3333333333333333.old"
    ours.mkdir()
    (ours / "manifest.json").write_text('{"old": true}')
    _write_journal(tmp_path / "out", {"partial": None, "old": ours.name})
    with pytest.raises(ExportError):
        with staged_directory(tmp_path / "out") as stage:
            pass
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == {"old": True}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json"] and mine.is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_termination_signals_clean_up_like_an_interrupt(tmp_path, sig):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "policy_export", "export", str(FIXTURES_DIR / "cartpole_mlp"),
                             "--out", str(out), "--samples", "64"], cwd=ROOT, preexec_fn=default_signals,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".pe-*.partial/saved_model")) and time.time() < deadline:
        time.sleep(0.02)
    assert list(tmp_path.glob(".pe-*.partial")), "the export never started staging"
    proc.send_signal(getattr(signal, sig))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    *progress, last = messages(stderr)  # the stages that finished first, one line each
    assert all(re.fullmatch(r"\[policy-export\] [^:]+: \d+\.\d s", line) for line in progress), stderr
    assert f"interrupted by {sig}" in last and "no partial export was left behind" in last
    assert list(tmp_path.iterdir()) == []  # no partial directory, no lock, no export


def test_signals_as_interrupts_leaves_an_applications_own_handler_alone():
    from policy_export.exporter.staging import signals_as_interrupts

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    hangup = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal gives it (nohup ignores it)
    try:
        with signals_as_interrupts():
            assert signal.getsignal(signal.SIGTERM) is mine
            assert signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # ignored on entry (nohup): it stays ignored
        with signals_as_interrupts():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGHUP, hangup)


# ---------------------------------------------------------------------------- 2. running code from files


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_saved_models_are_refused_before_loading_naming_the_op(tmp_path, kind):
    from policy_export.exporter.trust import UnsafeModelError, check_saved_model

    victim = tmp_path / "victim"
    make_saved_model(tmp_path / "sm", kind, victim)
    with pytest.raises(UnsafeModelError) as info:
        check_saved_model(tmp_path / "sm")
    assert info.value.op == HOSTILE[kind] and repr(HOSTILE[kind]) in str(info.value)
    assert info.value.node and repr(info.value.node) in str(info.value)
    assert not victim.exists()


def test_a_clean_saved_model_and_every_export_format_pass_the_check(tmp_path, exports):
    from policy_export.exporter.trust import check_saved_model

    make_saved_model(tmp_path / "sm", "clean", tmp_path / "victim")
    check_saved_model(tmp_path / "sm")
    _, out = exports("cartpole_mlp")
    check_saved_model(out / "saved_model")
    check_saved_model(out / "keras" / "saved_model")


RLLIB_SAVED_MODELS = sorted(str(p.parent.relative_to(FIXTURES_DIR))
                            for p in (FIXTURES_DIR / "rllib").glob("*/*/*/saved_model.pb"))


@pytest.mark.skipif(not RLLIB_SAVED_MODELS, reason="no RLlib SavedModel fixtures")
@pytest.mark.parametrize("rel", RLLIB_SAVED_MODELS)
def test_rllib_saved_models_with_whole_training_graphs_pass_the_check(rel):
    from policy_export.exporter import trust

    path = FIXTURES_DIR / rel  # the training graph is pruned away: only the serving subgraph is checked
    for meta in trust.read_saved_model(path).meta_graphs:
        trust.check_meta_graph(trust.prune_to_serving(meta), str(path), budget=trust.saved_model_budget(path))


def test_a_restore_op_reading_another_path_is_refused(tmp_path):
    from tensorflow.core.protobuf import saved_model_pb2

    from policy_export.exporter.trust import UnsafeModelError, check_saved_model

    make_saved_model(tmp_path / "sm", "clean", tmp_path / "victim")
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((tmp_path / "sm" / "saved_model.pb").read_bytes())
    graph = proto.meta_graphs[0].graph_def
    restore = next(n for n in graph.node if n.op == "RestoreV2")
    const = graph.node.add()
    const.CopyFrom(next(n for n in graph.node if n.name == restore.input[0]))
    const.name = "elsewhere"
    const.attr["value"].tensor.string_val[:] = [b"/etc/some/checkpoint"]
    restore.input[0] = "elsewhere"
    (tmp_path / "sm" / "saved_model.pb").write_bytes(proto.SerializeToString())
    with pytest.raises(UnsafeModelError, match="RestoreV2.*path other than"):
        check_saved_model(tmp_path / "sm")


def test_inspect_refuses_a_hostile_saved_model_with_exit_2(tmp_path):
    victim = tmp_path / "victim"
    make_saved_model(tmp_path / "sm", "main_op_writes", victim)
    before = snapshot(tmp_path)
    proc = cli("inspect", str(tmp_path / "sm"))
    one_line_error(proc, 2, "op 'WriteFile'")
    assert snapshot(tmp_path) == before and not victim.exists()


@pytest.mark.parametrize("where", ["saved_model", "keras/saved_model"])
def test_verify_refuses_a_resigned_export_whose_saved_model_writes_a_file(tmp_path, exports, where):
    export = copy_export(exports, tmp_path)
    victim = tmp_path / "victim"
    shutil.rmtree(export / where)
    make_saved_model(export / where, "main_op_writes", victim)
    resign(export)
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr
    assert "WriteFile" in proc.stdout and not victim.exists()
    report = json.loads((tmp_path / "r.json").read_text())
    fmt = "saved_model" if where == "saved_model" else "keras"
    assert "op 'WriteFile'" in report["errors"][fmt]


def test_verify_never_loads_files_that_failed_their_hash(tmp_path, exports):
    export = copy_export(exports, tmp_path)
    victim = tmp_path / "victim"
    shutil.rmtree(export / "saved_model")
    make_saved_model(export / "saved_model", "clean", victim)
    (export / "model.onnx").write_bytes((export / "model.onnx").read_bytes() + b"\0")
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    report = json.loads((tmp_path / "r.json").read_text())
    for fmt in ("saved_model", "onnx"):
        assert report["errors"][fmt] == "not loaded: its files failed the hash check"
    assert "changed file model.onnx (sha256 differs from the manifest)" in report["file_problems"]
    assert not any(r["format"] in ("saved_model", "onnx") for r in report["records"])
    assert any(r["format"] == "frozen_graph" and r["passed"] for r in report["records"])


def test_a_pinned_manifest_digest_catches_a_resigned_export(tmp_path, exports):
    export = copy_export(exports, tmp_path)
    pin = hashlib.sha256((export / "manifest.json").read_bytes()).hexdigest()
    proc = cli("verify", str(export), "--expect-manifest-sha256", pin.upper())
    assert proc.returncode == 0, proc.stderr
    victim = tmp_path / "victim"
    shutil.rmtree(export / "saved_model")
    make_saved_model(export / "saved_model", "clean", victim)
    resign(export)
    proc = cli("verify", str(export), "--expect-manifest-sha256", pin, "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["records"] == [] and "nothing was loaded" in report["file_problems"][0]
    one_line_error(cli("verify", str(export), "--expect-manifest-sha256", "12ab"), 2, "64 hexadecimal digits")


def test_a_manifest_with_no_formats_or_an_unaccounted_model_fails_verify(tmp_path, exports):
    export = copy_export(exports, tmp_path)
    doc = json.loads((export / "manifest.json").read_text())
    (export / "manifest.json").write_text(json.dumps({**doc, "formats": {}}))
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    assert "the manifest lists no formats: nothing can be checked" in json.loads((tmp_path / "r.json").read_text())["file_problems"]
    formats = dict(doc["formats"])
    del formats["onnx"]
    (export / "manifest.json").write_text(json.dumps({**doc, "formats": formats}))
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    assert "file model.onnx belongs to no format in the manifest" in json.loads((tmp_path / "r.json").read_text())["file_problems"]


def _hostile_h5(tmp_path: Path, how: str) -> Path:
    src = FIXTURES_DIR / "cartpole_mlp" / "weights.h5"
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"TOPSECRET" * 200)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.ones((4, 64), "f4")
    path = tmp_path / f"{how}.h5"
    shutil.copy(src, path)
    with h5py.File(path, "r+") as f:
        layer = f.attrs["layer_names"][0].decode()
        group = f[layer]
        name = group.attrs["weight_names"][0].decode()
        shape = group[name].shape
        del group[name]
        if how == "external_storage":
            group.create_dataset(name, shape=shape, dtype="f4", external=[(str(secret), 0, h5py.h5f.UNLIMITED)])
        elif how == "external_link":
            group[name] = h5py.ExternalLink(str(other), "/x")
        elif how == "virtual":
            layout = h5py.VirtualLayout(shape=shape, dtype="f4")
            layout[:] = h5py.VirtualSource(str(other), "x", shape=shape)
            group.create_virtual_dataset(name, layout)
        elif how == "declares_16_gib":
            group.create_dataset(name, shape=(65536, 65536), dtype="f4", chunks=(1024, 1024))
    return path


@pytest.mark.parametrize("how, fragment", [
    ("external_storage", "external file"), ("external_link", "external link"),
    ("virtual", "virtual dataset"), ("declares_16_gib", "limit of"),
])
def test_h5_weights_never_read_data_outside_the_file_or_beyond_the_limit(tmp_path, how, fragment):
    path = _hostile_h5(tmp_path, how)
    assert path.stat().st_size < 100_000
    with pytest.raises(WeightsError, match=fragment):
        read_h5_weights(path)


def test_an_export_with_h5_external_storage_is_refused_and_leaks_nothing(tmp_path):
    spec = tmp_path / "spec"
    shutil.copytree(FIXTURES_DIR / "cartpole_mlp", spec)
    shutil.move(_hostile_h5(tmp_path, "external_storage"), spec / "weights.h5")
    before = snapshot(tmp_path)
    proc = cli("export", str(spec), "--out", str(tmp_path / "out"), "--samples", "16")
    one_line_error(proc, 2, "external file")
    assert snapshot(tmp_path) == before


def test_misshapen_h5_weights_are_not_read_when_shapes_are_expected(tmp_path):
    path = _hostile_h5(tmp_path, "declares_16_gib")
    expected = {k: v.shape for k, v in read_h5_weights(FIXTURES_DIR / "cartpole_mlp" / "weights.h5").items()}
    weights = read_h5_weights(path, expected_shapes=expected)
    assert weights["fc_1/kernel"].shape == (65536, 65536) and weights["fc_1/kernel"].strides == (0, 0)


# ------------------------------------------------------------------ 3. special files and size bombs


@pytest.mark.parametrize("rel, kind", [
    ("parity/inputs.npz", "fifo"), ("frozen_graph.pb", "fifo"), ("model.onnx", "dev_zero"),
    ("saved_model/saved_model.pb", "dev_zero"),
])
def test_special_files_in_an_export_are_changed_files_and_never_read(tmp_path, exports, rel, kind):
    export = copy_export(exports, tmp_path)
    (export / rel).unlink()
    if kind == "fifo":
        os.mkfifo(export / rel)
    else:
        (export / rel).symlink_to("/dev/zero")
    start = time.time()
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr
    assert time.time() - start < 120
    report = json.loads((tmp_path / "r.json").read_text())
    label = "FIFO" if kind == "fifo" else "symbolic link"
    assert f"changed file {rel} (a {label}, not a regular file)" in report["file_problems"]


def _npz_bomb(path: Path, shape: tuple[int, ...]) -> None:
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("observations.npy", header.getvalue() + b"\0" * 1024)


def test_an_npz_whose_headers_declare_gigabytes_is_refused_before_loading(tmp_path, exports):
    _npz_bomb(tmp_path / "bomb.npz", (1 << 31, 4))
    with pytest.raises(ExportError, match="MiB limit"):
        manifest.load_npz(tmp_path / "bomb.npz")
    export = copy_export(exports, tmp_path)
    _npz_bomb(export / "parity" / "inputs.npz", (1 << 31, 4))
    resign(export)
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    assert "MiB limit" in json.loads((tmp_path / "r.json").read_text())["errors"]["parity"]


def _spec(tmp_path: Path, **changes) -> Path:
    doc = json.loads((FIXTURES_DIR / "cartpole_mlp" / "policy.json").read_text())
    doc.pop("weights", None)
    for key, value in changes.items():
        if key.startswith("model_"):
            doc["model"] = {**doc["model"], key[len("model_"):]: value}
        else:
            doc[key] = value
    spec = tmp_path / "spec"
    spec.mkdir(exist_ok=True)
    (spec / "policy.json").write_text(json.dumps(doc))
    return spec


@pytest.mark.parametrize("changes, fragment", [
    ({"observation_space": {"type": "Box", "low": 0, "high": 1, "shape": [100000, 100000]}}, "limit of 16777216"),
    ({"action_space": {"type": "Discrete", "n": 2**70}}, "limit of 1048576 categories"),
    ({"action_space": {"type": "MultiDiscrete", "nvec": [2**40, 2]}}, "limit of 1048576"),
    ({"action_space": {"type": "MultiBinary", "n": [2**40, 2**40]}}, "limit of 16777216"),
    ({"model_hiddens": [1000000000]}, "at most 65536 units"),
    ({"model_hiddens": [60000, 60000]}, "weights exceed the limit"),
    ({"model_lstm": {"cell_size": 2**40}}, "limit of 4096"),
])
def test_size_bombs_in_a_spec_fail_fast_naming_the_limit(tmp_path, changes, fragment):
    spec = _spec(tmp_path, **changes)
    before = snapshot(tmp_path)
    start = time.time()
    proc = cli("export", str(spec), "--out", str(tmp_path / "out"))
    one_line_error(proc, 2, fragment)
    assert time.time() - start < 30
    assert snapshot(tmp_path) == before


def test_deep_nesting_is_refused_naming_the_limit(tmp_path):
    for depth, fragment in ((300, "nested deeper than the limit of 32"), (100_000, "nested too deeply")):
        spec = _spec(tmp_path, observation_space="DEEP")
        nested = '{"type": "Dict", "spaces": {"x": ' * depth + '{"type": "Discrete", "n": 2}' + "}}" * depth
        text = (spec / "policy.json").read_text().replace('"DEEP"', nested)
        (spec / "policy.json").write_text(text)
        proc = cli("export", str(spec), "--out", str(tmp_path / "out"))
        one_line_error(proc, 2, fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--samples", "1000000000"], "limit of 1000000"),
    (["--explore-samples", "100000000"], "limit of"),
])
def test_sample_counts_are_capped_before_anything_is_written(tmp_path, args, fragment):
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "out"), *args)
    one_line_error(proc, 2, fragment)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ 4. silent corruption


def _space(space: dict):
    doc = json.loads((FIXTURES_DIR / "cartpole_mlp" / "policy.json").read_text())
    doc.pop("weights", None)
    return spec_from_json({**doc, "observation_space": space}).observation_space


def test_integer_box_bounds_stay_exact_over_the_whole_int64_range():
    from policy_export.policy.spaces import space_from_json, space_to_json

    box = _space({"type": "Box", "low": -2**63, "high": 2**63 - 1, "shape": [3], "dtype": "int64"})
    assert box.low.dtype == np.int64 and int(box.low[0]) == -2**63 and int(box.high[0]) == 2**63 - 1
    doc = space_to_json(box)
    assert doc["low"] == -2**63 and doc["high"] == 2**63 - 1
    again = space_from_json(json.loads(json.dumps(doc)))
    assert np.array_equal(again.low, box.low) and np.array_equal(again.high, box.high)
    near = _space({"type": "Box", "low": [2**53 + 1, 0], "high": 2**62 + 1, "dtype": "int64"})
    assert int(near.low[0]) == 2**53 + 1 and int(near.high[0]) == 2**62 + 1


@pytest.mark.parametrize("space, fragment", [
    ({"type": "Box", "low": 0, "high": 2**63, "shape": [2], "dtype": "int64"}, "do not fit int64"),
    ({"type": "Box", "low": -129, "high": 0, "shape": [2], "dtype": "int8"}, "do not fit int8"),
    ({"type": "Box", "low": 0, "high": "inf", "shape": [2], "dtype": "int32"}, "needs finite bounds"),
    ({"type": "Box", "low": -1e6, "high": 1e6, "shape": [2], "dtype": "float16"}, "does not fit float16"),
    ({"type": "Box", "low": -1e39, "high": 0, "shape": [2], "dtype": "float32"}, "does not fit float32"),
    ({"type": "Discrete", "n": 4, "start": 2**63 - 2}, "do not fit int64"),
    ({"type": "Discrete", "n": 4, "start": -2**63 - 1}, "do not fit int64"),
    ({"type": "Dict", "spaces": {"a.b": {"type": "Discrete", "n": 2}, "a_b": {"type": "Discrete", "n": 2}}},
     "both become 'a_b'"),
    ({"type": "Dict", "spaces": {"a": {"type": "Dict", "spaces": {"b_c": {"type": "Discrete", "n": 2}}},
                                 "a_b": {"type": "Dict", "spaces": {"c": {"type": "Discrete", "n": 2}}}}},
     "both become 'a_b_c'"),
])
def test_values_a_dtype_cannot_hold_and_colliding_names_are_refused(space, fragment):
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(")):
        _space(space)


def test_float_bounds_that_fit_and_infinities_are_kept():
    box = _space({"type": "Box", "low": -65504, "high": "inf", "shape": [2], "dtype": "float16"})
    assert box.low[0] == -65504 and np.isinf(box.high[0])


def test_colliding_dict_keys_give_one_line_exit_2(tmp_path):
    space = {"type": "Dict", "spaces": {"a.b": {"type": "Box", "low": 0, "high": 1, "shape": [2]},
                                        "a_b": {"type": "Box", "low": 0, "high": 1, "shape": [2]}}}
    proc = cli("export", str(_spec(tmp_path, observation_space=space)), "--out", str(tmp_path / "out"))
    one_line_error(proc, 2, "both become 'a_b'")


# ------------------------------------------------------------------------------------------ 5. output


def test_inspect_shows_batch_shapes_and_user_text_is_not_markup(tmp_path, exports):
    _, out = exports("cartpole_mlp")
    proc = cli("inspect", str(out))
    assert proc.returncode == 0 and "[batch, 4]" in proc.stdout
    proc = cli("diff", str(out), str(out))
    assert proc.returncode == 0 and "compatible" in proc.stdout


def test_verify_prints_markup_like_file_names_literally(tmp_path, exports):
    export = copy_export(exports, tmp_path)
    (export / "x[").mkdir()
    (export / "x[" / "oops]").write_text("x")
    (export / "[bold]y").write_text("y")
    proc = cli("verify", str(export))
    assert proc.returncode == 1, proc.stderr
    assert "extra file x[/oops] (not in the manifest)" in proc.stdout
    assert "extra file [bold]y (not in the manifest)" in proc.stdout


@pytest.mark.slow
def test_an_output_path_with_glob_characters_exports_and_verifies(tmp_path):
    out = tmp_path / "exp_[1]"
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--samples", "64",
               "--explore-samples", "0")
    assert proc.returncode == 0, proc.stderr
    proc = cli("verify", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp_[1]"]


def test_bad_options_and_paths_are_exit_2_before_anything_is_written(tmp_path, exports):
    spec = str(FIXTURES_DIR / "cartpole_mlp")
    out = tmp_path / "out"
    (tmp_path / "keep").mkdir()
    before = snapshot(tmp_path)
    one_line_error(cli("export", spec, "--out", str(out), "--formats", ""), 2, "formats (--formats) is empty")
    one_line_error(cli("export", spec, "--out", str(out), "--formats", " , "), 2, "formats (--formats) is empty")
    one_line_error(cli("export", spec, "--out", str(tmp_path / "keep" / ".."), "--overwrite"), 2,
                   "holds no valid policy-export manifest")
    one_line_error(cli("export", spec, "--out", str(out), "--report-json", str(tmp_path / "keep")), 2,
                   "is a directory")
    one_line_error(cli("export", spec, "--out", str(out), "--report-json", str(tmp_path / "nodir" / "r.json")), 2,
                   "does not exist")
    one_line_error(cli("export", spec, "--out", str(out),
                       env_extra={"GITHUB_STEP_SUMMARY": str(tmp_path / "nodir" / "s.md")}), 2, "GITHUB_STEP_SUMMARY")
    assert snapshot(tmp_path) == before
    _, export = exports("cartpole_mlp")
    one_line_error(cli("verify", str(export), "--tolerance", "no_such_output=1e-3"), 2, "unknown output(s) ['no_such_output']")
    one_line_error(cli("verify", str(export), "--report-json", str(export / "r.json")), 2, "inside the export")
    assert not (export / "r.json").exists()


@pytest.mark.parametrize("change, fragment", [
    ({"contract": "x"}, "contract: expected"),
    ({"files": "x"}, "files: expected"),
    ({"formats": ["onnx"]}, "formats: expected"),
    ({"files": [{"path": "../../etc/passwd", "size": 1, "sha256": "0" * 64}]}, "files: expected"),
    ({"tolerances": {"default": "tight"}}, "tolerances: expected"),
])
def test_malformed_manifest_fields_are_exit_2(tmp_path, exports, change, fragment):
    export = copy_export(exports, tmp_path)
    doc = json.loads((export / "manifest.json").read_text())
    (export / "manifest.json").write_text(json.dumps({**doc, **change}))
    one_line_error(cli("verify", str(export)), 2, fragment)


def test_newlines_in_json_keys_do_not_add_lines_to_errors(tmp_path):
    space = {"type": "Dict", "spaces": {"a\nb\npolicy-export: all good": {"type": "Discrete", "n": 2}}}
    proc = cli("export", str(_spec(tmp_path, observation_space=space)), "--out", str(tmp_path / "out"))
    one_line_error(proc, 2, "must be letters")
    doc = json.loads((FIXTURES_DIR / "cartpole_mlp" / "policy.json").read_text())
    doc["bad\nkey"] = 1
    (tmp_path / "spec" / "policy.json").write_text(json.dumps(doc))
    one_line_error(cli("export", str(tmp_path / "spec"), "--out", str(tmp_path / "out")), 2, "unknown key")


def test_every_format_is_a_registered_plugin_with_its_own_path():
    from policy_export.exporter import formats

    paths = formats.paths()
    assert list(paths) == ["saved_model", "frozen_graph", "onnx", "onnx_deterministic", "onnx_explore", "keras",
                           "tflite", "tflite_int8", "onnx_int8", "onnx_fp16", "openvino", "openvino_bf16", "triton",
                           "tf_serving"]
    assert paths["onnx"] == "model.onnx" and paths["keras"] == "keras" and paths["tflite"] == "model.tflite"
    assert paths["onnx_explore"] == "model_explore.onnx"
    assert paths["triton"] == "triton" and paths["tf_serving"] == "tf_serving" and paths["openvino"] == "openvino"
    assert len(set(paths.values())) == len(paths)  # no two formats write the same path
    with pytest.raises(InputError, match="unknown format 'tflite_nope'"):
        formats.get("tflite_nope")


def test_rollout_refuses_an_export_whose_files_failed_their_hash(tmp_path, exports):
    export = copy_export(exports, tmp_path)
    victim = tmp_path / "victim"
    shutil.rmtree(export / "saved_model")
    make_saved_model(export / "saved_model", "clean", victim)
    proc = cli("rollout", str(export), "--env", "CartPole-v1", "--episodes", "1")
    one_line_error(proc, 1, "nothing was loaded")
    assert "changed file saved_model/saved_model.pb" in proc.stderr
    _, out = exports("cartpole_mlp")
    proc = cli("rollout", str(out), "--env", "CartPole-v1", "--episodes", "1")
    assert proc.returncode == 0, proc.stderr


def _onnx_file(path: Path, metadata: str | None = None, sequence_input: bool = False) -> Path:
    import onnx
    from onnx import TensorProto, helper

    if sequence_input:
        x = helper.make_tensor_sequence_value_info("x", TensorProto.FLOAT, [2])
        node = helper.make_node("SequenceAt", ["x", "i"], ["y"])
        inputs = [x, helper.make_tensor_value_info("i", TensorProto.INT64, [])]
    else:
        node = helper.make_node("Identity", ["x"], ["y"])
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if metadata is not None:
        helper.set_model_props(model, {"policy_export.contract": metadata})
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("kind, fragment", [
    ("metadata_not_json", "metadata is not valid"),
    ("metadata_wrong_shape", "metadata is not valid"),
    ("sequence_input", "not a tensor"),
])
def test_inspect_of_odd_onnx_files_is_exit_2(tmp_path, kind, fragment):
    from policy_export.exporter.formats.onnx.model import CONTRACT_METADATA

    assert CONTRACT_METADATA == "policy_export.contract"
    metadata = {"metadata_not_json": "{not json", "metadata_wrong_shape": '{"inputs": 3}'}.get(kind)
    path = _onnx_file(tmp_path / "m.onnx", metadata, kind == "sequence_input")
    one_line_error(cli("inspect", str(path)), 2, fragment)


@pytest.mark.parametrize("dtype", [0, 20])  # DT_INVALID, DT_RESOURCE
def test_inspect_of_a_saved_model_with_a_non_tensor_signature_dtype_is_exit_2(tmp_path, dtype):
    from tensorflow.core.protobuf import saved_model_pb2

    make_saved_model(tmp_path / "sm", "clean", tmp_path / "victim")
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((tmp_path / "sm" / "saved_model.pb").read_bytes())
    proto.meta_graphs[0].signature_def["serving_default"].inputs["observations"].dtype = dtype
    (tmp_path / "sm" / "saved_model.pb").write_bytes(proto.SerializeToString())
    one_line_error(cli("inspect", str(tmp_path / "sm")), 2, "has dtype")


def test_a_frozen_graph_with_side_effect_or_checkpoint_ops_is_refused(tmp_path, exports):
    import tensorflow as tf

    from policy_export.exporter.trust import UnsafeModelError, check_graph_def

    _, out = exports("cartpole_mlp")
    clean = tf.compat.v1.GraphDef()
    clean.ParseFromString((out / "frozen_graph.pb").read_bytes())
    check_graph_def(clean, "frozen_graph.pb")
    graph = tf.Graph()
    with graph.as_default():
        tf.io.write_file(str(tmp_path / "victim"), "pwned")
    with pytest.raises(UnsafeModelError, match="'WriteFile'"):
        check_graph_def(graph.as_graph_def(), "evil.pb")
    assert not (tmp_path / "victim").exists()


def test_an_output_path_that_is_a_symlink_or_a_lock_that_is_a_directory_is_refused(tmp_path, exports):
    real = copy_export(exports, tmp_path)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    lock_path(tmp_path / "other").mkdir()
    before = snapshot(tmp_path)
    with pytest.raises(ExportError, match="symbolic link"):
        with staged_directory(tmp_path / "link", overwrite=True):
            pass
    with pytest.raises(ExportError, match="lock file"):
        with staged_directory(tmp_path / "other"):
            pass
    assert snapshot(tmp_path) == before


def test_a_symlinked_directory_in_an_export_is_never_followed(tmp_path, exports):
    export = copy_export(exports, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(export / "parity", elsewhere)
    (export / "parity").symlink_to(elsewhere, target_is_directory=True)
    proc = cli("verify", str(export), "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert "changed file parity (a symbolic link, not a regular file)" in report["file_problems"]
    assert report["errors"]["parity"] == "golden files not loaded: they failed the hash check"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_largest_finite_float_bounds_round_trip_through_json(dtype):
    import gymnasium as gym

    from policy_export.policy.spaces import space_from_json, space_to_json

    top = np.finfo(dtype).max
    box = gym.spaces.Box(-top, top, (2,), dtype)
    again = space_from_json(json.loads(json.dumps(space_to_json(box))))
    assert np.array_equal(again.low, box.low) and np.array_equal(again.high, box.high)


def test_an_error_raised_while_an_interrupt_unwinds_is_still_an_interrupt(monkeypatch, capsys):
    # TensorFlow's device scope raises RuntimeError when an interrupt unwinds it mid-export
    from policy_export.exporter import commands
    from policy_export.exporter.cli import main

    def interrupted_in_a_scope(args, console):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("Exiting device scope without proper scope nesting.") from None

    monkeypatch.setattr(commands, "cmd_inspect", interrupted_in_a_scope)
    assert main(["inspect", "anything"]) == 130
    assert "interrupted by SIGINT" in capsys.readouterr().err
