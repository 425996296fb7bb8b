"""``--observations FILE``: the user's recorded observations as a parity group of their own, on
export, convert and verify; bad files refused before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR
from helpers import cli, notes, one_line_error, snapshot

SPEC = FIXTURES_DIR / "cartpole_mlp"
ROLLOUT = FIXTURES_DIR / "recorded" / "cartpole_rollout.npy"
FAST = ("--explore-samples", "0", "-q")


@pytest.fixture(scope="module")
def recorded_export(tmp_path_factory):
    """cartpole_mlp exported with the rollout and a second, small .npz of observations."""
    root = tmp_path_factory.mktemp("recorded")
    np.savez(root / "more.npz", observations=np.random.default_rng(0).standard_normal((300, 4)) * 0.1)
    done = cli("export", str(SPEC), "--out", str(root / "out"), "--formats", "saved_model,onnx",
               "--observations", str(ROLLOUT), "--observations", str(root / "more.npz"), "--samples", "500", *FAST,
               narrow=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (root / "export.out").write_text(done.stdout)
    return root


def test_export_prints_the_worst_error_on_the_recorded_rows_apart_within_80_columns(recorded_export):
    """The note after the verdict: rows, files, out-of-bounds count, and each format's worst
    error on them; wrapped at 80 columns in a pipe, its continuation lines indented."""
    (note,) = notes((recorded_export / "export.out").read_text(), "on your observations", width=80)
    head, _, worst = note.partition("): ")
    assert head == "on your observations: 500 rows of cartpole_rollout.npy, more.npz (0 outside the space's bounds"
    per_format = dict(part.split(" ", 1) for part in worst.split("; "))
    assert set(per_format) == {"saved_model", "onnx"}
    report = json.loads((recorded_export / "out/parity/report.json").read_text())
    err = report["on_recorded"]["onnx"]["outputs"]["action_dist_inputs"]["max_abs_err"]
    assert per_format["onnx"] == f"{err:.2g} (action_dist_inputs)"


def test_the_recorded_rows_join_the_plan_with_where_they_came_from(recorded_export):
    out = recorded_export / "out"
    doc = json.loads((out / "manifest.json").read_text())
    record = doc["parity"]["recorded"]
    files = {Path(f["path"]).name: f for f in record["files"]}
    rollout = files["cartpole_rollout.npy"]
    assert rollout["rows"] == 1945 and rollout["kind"] == "npy" and len(rollout["sha256"]) == 64
    import hashlib

    assert rollout["sha256"] == hashlib.sha256(ROLLOUT.read_bytes()).hexdigest()
    assert files["more.npz"]["rows"] == 300 and record["rows"] == 500 == rollout["kept"] + files["more.npz"]["kept"]
    assert record["sub_sample"] == {"seed": 0, "limit": 500}
    assert doc["parity"]["plan"]["recorded"] == "parity/recorded.npz"
    with np.load(out / "parity/recorded.npz") as plan:
        indices = plan["indices/0"]
        assert np.all(np.diff(indices) > 0) and len(indices) == rollout["kept"]
        np.testing.assert_array_equal(plan["inputs/observations"][:len(indices)], np.load(ROLLOUT)[indices])
    report = json.loads((out / "parity/report.json").read_text())
    assert set(report["on_recorded"]) == {"saved_model", "onnx"}
    assert report["on_recorded"]["onnx"]["passed"] is True
    assert report["on_recorded"]["onnx"]["outputs"]["action_dist_inputs"]["max_abs_err"] < 1e-5


def test_the_same_seed_keeps_the_same_rows(recorded_export, tmp_path):
    done = cli("export", str(SPEC), "--out", str(tmp_path / "again"), "--formats", "onnx", "--observations",
               str(ROLLOUT), "--observations", str(recorded_export / "more.npz"), "--samples", "500", *FAST)
    assert done.returncode == 0, done.stderr[-2000:]
    with np.load(recorded_export / "out/parity/recorded.npz") as a, np.load(tmp_path / "again/parity/recorded.npz") as b:
        np.testing.assert_array_equal(a["indices/0"], b["indices/0"])
        np.testing.assert_array_equal(a["indices/1"], b["indices/1"])


def test_verify_replays_the_recorded_group_and_takes_new_files(recorded_export):
    out = recorded_export / "out"
    done = cli("verify", str(out), "--report-json", str(recorded_export / "v.json"), "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((recorded_export / "v.json").read_text())
    assert any(r["format"] == "onnx (recorded)" for r in report["records"])
    done = cli("verify", str(out), "--observations", str(ROLLOUT), "--report-json",
               str(recorded_export / "v2.json"), "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((recorded_export / "v2.json").read_text())
    fresh = [r for r in report["records"] if r["format"] == "onnx vs saved_model (recorded)"]
    assert fresh and all(r["passed"] for r in fresh)
    assert report["recorded"]["files"][0]["rows"] == 1945


def test_a_lossy_format_that_differs_only_on_recorded_data_is_caught_only_with_them(tmp_path):
    """int8 weights agree with the session on the space's samples, but not on the states the
    policy visits (near its decision boundary, where a balancing policy lives)."""
    without = cli("export", str(SPEC), "--out", str(tmp_path / "a"), "--formats", "saved_model,onnx_int8", *FAST)
    assert without.returncode == 0, without.stderr[-2000:]
    doc = json.loads((tmp_path / "a/manifest.json").read_text())
    assert doc["parity"]["behaviour"]["onnx_int8/actions_0"]["passed"]
    done = cli("export", str(SPEC), "--out", str(tmp_path / "b"), "--formats", "saved_model,onnx_int8",
               "--observations", str(ROLLOUT), *FAST)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "onnx_int8 (recorded)/actions_0:" in done.stderr and "actions identical to the session's" in done.stderr
    assert not (tmp_path / "b").exists()


def test_out_of_bounds_rows_are_counted_and_kept(tmp_path):
    rows = np.zeros((10, 4), np.float32)
    rows[:3, 0] = 10.0  # CartPole's x is within +-4.8
    np.save(tmp_path / "wide.npy", rows)
    done = cli("export", str(SPEC), "--out", str(tmp_path / "out"), "--formats", "onnx", "--observations",
               str(tmp_path / "wide.npy"), *FAST)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "out/manifest.json").read_text())["parity"]["recorded"]
    assert record["out_of_bounds"] == 3 and record["rows"] == 10 and record["files"][0]["out_of_bounds"] == 3


def _bad(tmp_path: Path, name: str, write) -> Path:
    path = tmp_path / name
    write(path)
    return path


BAD = {
    "an unknown key": ("x.npz", lambda p: np.savez(p, observations=np.zeros((4, 4)), obs2=np.zeros((4, 4))),
                       "obs2 is not an input of the policy"),
    "another shape": ("x.npy", lambda p: np.save(p, np.zeros((4, 5), np.float32)),
                      "rows of shape [5]; the observation space is Box(4,), rows of [4]"),
    "complex numbers": ("x.npy", lambda p: np.save(p, np.zeros((4, 4), np.complex64)),
                        "arrays of complex64 are not read"),
    "NaN": ("x.npy", lambda p: np.save(p, np.where(np.arange(16).reshape(4, 4) == 9, np.nan, 0.0)),
            "row 2 holds NaN or infinity"),
    "an empty file": ("x.npy", lambda p: p.write_bytes(b""), "the file is empty"),
    "no rows": ("x.npy", lambda p: np.save(p, np.zeros((0, 4), np.float32)), "holds no rows"),
    "a truncated file": ("x.npy", lambda p: (np.save(p, np.zeros((100, 4), np.float32)),
                                             p.write_bytes(p.read_bytes()[:-100])), "truncated"),
    "a huge declared shape": ("x.npy", lambda p: (np.save(p, np.zeros((2, 4), np.float32)),
                                                  p.write_bytes(p.read_bytes().replace(b"(2, 4)", b"(99999999999, 4)"))),
                              "truncated"),
    "an object array": ("x.npy", lambda p: np.save(p, np.array([[None] * 4], object), allow_pickle=True),
                        "arrays of object are not read"),
    "another kind of file": ("x.csv", lambda p: p.write_text("1,2,3,4\n"), ".csv is not a kind of file read here"),
    "a single value": ("x.npy", lambda p: np.save(p, np.float32(3)), "a single value, not rows"),
    "not an archive": ("x.npz", lambda p: p.write_bytes(b"PK\x03\x04garbage"), "not an .npz archive"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_file_is_exit_2_naming_it_and_nothing_is_written(tmp_path, case):
    name, write, fragment = BAD[case]
    path = _bad(tmp_path, name, write)
    before = snapshot(tmp_path)
    done = cli("export", str(SPEC), "--out", str(tmp_path / "out"), "--observations", str(path), *FAST)
    one_line_error(done, 2, fragment)
    assert str(path) in done.stderr
    assert snapshot(tmp_path) == before


def test_a_link_or_a_missing_file_is_refused_before_tensorflow(tmp_path, recorded_export):
    target = tmp_path / "real.npy"
    np.save(target, np.zeros((3, 4), np.float32))
    os.symlink(target, tmp_path / "link.npy")
    done = cli("export", str(SPEC), "--out", str(tmp_path / "out"), "--observations", str(tmp_path / "link.npy"))
    one_line_error(done, 2, "not a regular file (a symbolic link is not followed)")
    done = cli("verify", str(recorded_export / "out"), "--observations", str(tmp_path / "missing.npy"))
    one_line_error(done, 2, "missing.npy: no such file")


def test_files_are_streamed_in_chunks(tmp_path, monkeypatch):
    """Rows are read chunk by chunk, CHUNK_BYTES at a time (memory bounded by the chunk and the
    kept rows), from a plain .npy and from a deflated .npz member alike."""
    from policy_export.exporter import recorded
    from policy_export.exporter.parity.compare import sample_inputs  # noqa: F401  (the contract's helpers load)
    from policy_export.policy.spaces import space_from_json

    from policy_export.exporter.recorded import budget

    monkeypatch.setattr(budget, "CHUNK_BYTES", 7 * 16)  # 7 rows of 4 float32 a chunk
    data = np.random.default_rng(3).standard_normal((100, 4)).astype(np.float32)
    np.save(tmp_path / "a.npy", data)
    np.savez_compressed(tmp_path / "b.npz", observations=data)
    space = space_from_json({"type": "Box", "low": -1e9, "high": 1e9, "shape": [4], "dtype": "float32"}, "$", "t")

    class Contract:
        input_keys = ["observations"]
        required_inputs = []

        @staticmethod
        def input(key):
            return None

    for name in ("a.npy", "b.npz"):
        rows = recorded.read_recorded([tmp_path / name], space, Contract, 30, 5)
        kept = rows.indices[0]
        assert len(kept) == 30
        np.testing.assert_array_equal(rows.inputs["observations"], data[kept])
        chunks = list(recorded.open_file(tmp_path / name).columns["observations"].chunks())
        assert [len(c) for c in chunks] == [7] * 14 + [2]  # CHUNK_BYTES of rows at a time


# ---------------------------------------------------------------------------------------- RLlib's offline data

OFFLINE = FIXTURES_DIR / "rllib" / "offline"


def _rllib_rows(case: str, policy: str | None = None) -> np.ndarray:
    """The observations RLlib itself decoded from the case's files (``expected.npz``), each
    episode once (RLlib's Parquet writer writes an episode again with every later batch)."""
    with np.load(OFFLINE / case / "expected.npz") as data:
        if case.startswith("json"):
            lines = sorted({k.split("/")[0] for k in data.files if k.endswith("/obs")}, key=lambda k: int(k[1:]))
            inner = f"/{policy}" if policy else ("/default_policy" if f"{lines[0]}/default_policy/obs" in data.files
                                                 else "")
            return np.concatenate([data[f"{line}{inner}/obs"] for line in lines])
        if case == "parquet_rows":
            return data["obs"]
        episodes, seen = [], set()
        for e in sorted({k.split("/")[0] for k in data.files}, key=lambda k: int(k[1:])):
            if str(data[f"{e}/id"]) not in seen:
                seen.add(str(data[f"{e}/id"]))
                episodes.append(data[f"{e}/obs"][:-1])  # the final observation is acted on by no one
        return np.concatenate(episodes)


@pytest.mark.parametrize("case,policy", [("json_compressed", None), ("json_plain", None), ("json_dqn", None),
                                         ("json_samplebatch", None), ("json_multi_agent", "p1"),
                                         ("parquet_episodes", None), ("parquet_rows", None)])
def test_rllibs_offline_data_reads_as_rllib_decodes_it_without_ray(case, policy):
    import subprocess
    import sys

    data = OFFLINE / case / "data"
    target = data if case.startswith("parquet") else next(data.glob("*.json"))
    code = ("import sys, numpy as np\n"
            "sys.modules['ray'] = None\n"
            "from policy_export.exporter.recorded import open_file\n"
            f"f = open_file({str(target)!r}, {policy!r})\n"
            "rows = np.concatenate(list(f.columns['obs'].chunks()))\n"
            f"np.save({str(Path(os.environ.get('PYTEST_TMP', '/tmp')) / ('rows_' + case + '.npy'))!r}, rows)\n"
            "assert 'ray' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = np.load(Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"rows_{case}.npy")
    np.testing.assert_array_equal(got.astype(np.float64), _rllib_rows(case, policy).astype(np.float64))


def test_an_export_takes_rllib_json_and_parquet_together(tmp_path):
    json_file = next((OFFLINE / "json_compressed/data").glob("*.json"))
    done = cli("export", str(SPEC), "--out", str(tmp_path / "out"), "--formats", "onnx", "--observations",
               str(json_file), "--observations", str(OFFLINE / "parquet_episodes/data"), *FAST)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "out/manifest.json").read_text())["parity"]["recorded"]
    assert [f["kind"] for f in record["files"]] == ["json", "parquet"] and record["rows"] == 32 + 80


def _packed(value) -> str:
    import base64
    import pickle

    import lz4.frame

    return base64.b64encode(lz4.frame.compress(pickle.dumps(value, protocol=5))).decode("ascii")


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_compressed_column_that_would_run_code_is_refused_with_nothing_run(tmp_path):
    marker = tmp_path / "ran"
    line = json.dumps({"type": "SampleBatch", "obs": _packed(_Payload(marker)), "t": [0]})
    (tmp_path / "batch.json").write_text(line + "\n")
    before = snapshot(tmp_path)
    done = cli("export", str(SPEC), "--out", str(tmp_path / "out"), "--observations", str(tmp_path / "batch.json"), "-q")
    one_line_error(done, 2, "system, which is not on the allowlist")
    assert "nothing was run" in done.stderr
    assert not marker.exists() and snapshot(tmp_path) == before


def test_an_episode_with_an_object_array_is_refused(tmp_path):
    import msgpack
    import pyarrow as pa
    import pyarrow.parquet as pq

    cell = msgpack.packb({"id_": "x", "t": 1, "observations": {"lookback": 0, "data": [
        {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [4], b"data": b"\x80\x05N."}] * 2}})
    pq.write_table(pa.table({"item": pa.array([cell], pa.binary())}), tmp_path / "episodes.parquet")
    done = cli("export", str(SPEC), "--out", str(tmp_path / "out"), "--observations", str(tmp_path / "episodes.parquet"),
               "-q")
    one_line_error(done, 2, "an array of objects or records, which is not read")


@pytest.mark.parametrize("line,fragment", [
    ('{"type": "SampleBatch", "obs": "@@@"}', "not base64"),
    ('{"type": "SampleBatch", "obs": "Z2FyYmFnZSE="}', "not an LZ4 frame"),
    ('{"type": "SampleBatch", "obs": "AAAA"}', "not a whole LZ4 frame (truncated)"),
    ('{"type": "Episode", "obs": [[0, 0, 0, 0]]}', "not an RLlib sample batch"),
    ('{"type": "SampleBatch", "obs": [["a", "b", "c", "d"]]}', "not a column of numbers"),
    ('{"type": "MultiAgentBatch", "count": 1, "policy_batches": {"a": {"obs": [[0, 0, 0, 0]]}, '
     '"b": {"obs": [[0, 0, 0, 0]]}}}', "batches of the policies a, b; none is named like this policy"),
    ('not json', "line 1 is not JSON"),
])
def test_a_bad_rllib_json_line_is_exit_2(tmp_path, line, fragment):
    (tmp_path / "bad.json").write_text(line + "\n")
    done = cli("export", str(SPEC), "--out", str(tmp_path / "out"), "--observations", str(tmp_path / "bad.json"), "-q")
    one_line_error(done, 2, fragment)
    assert not (tmp_path / "out").exists()
