"""export-many with hostile sources: the driver reads a checkpoint's names only (never a state
file), a refused checkpoint fails alone, a policy past its time limit is killed, and one hostile
checkpoint next to a good policy leaves the good one exported, the driver's memory and the run's
time bounded. ROOT given as an existing file is a one-line input error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR

CHECKPOINTS = FIXTURES_DIR / "rllib" / "checkpoints"
MULTI = CHECKPOINTS / "multi_agent" / "checkpoint"
BOMB_MB = 160  # MiB of a pickle that pushes one None per byte (a stack slot each, where it is loaded)


def _bomb(path: Path, megabytes: int = BOMB_MB) -> None:
    """A state pickle whose loading takes about ten times its size in memory (one stack slot per byte)."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x80\x04")
        chunk = b"N" * (1 << 20)
        for _ in range(megabytes):
            f.write(chunk)


def _hostile_state(path: Path, how: str) -> None:
    path.unlink(missing_ok=True)
    if how == "fifo":  # opening it to read would wait for a writer forever
        os.mkfifo(path)
    elif how == "link_to_dev_zero":  # an endless file through a link
        os.symlink("/dev/zero", path)
    else:
        _bomb(path, 16)


@pytest.mark.parametrize("how", ["fifo", "link_to_dev_zero", "memory_bomb"])
def test_the_driver_lists_a_checkpoint_by_names_and_never_opens_its_state(tmp_path, how):
    from policy_export.exporter.many.jobs import expand

    ck = tmp_path / "league_run" / "checkpoint"
    shutil.copytree(MULTI, ck)
    for state in (ck / "algorithm_state.pkl", ck / "policies" / "alpha" / "policy_state.pkl",
                  ck / "policies" / "beta" / "policy_state.pkl"):
        _hostile_state(state, how)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        jobs = expand([ck], tmp_path / "root", {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 5
    assert [(j.name, j.policy_id, j.refused) for j in jobs] == [("league_run-alpha", "alpha", ""),
                                                                 ("league_run-beta", "beta", "")]
    assert all(len(j.digest) == 64 for j in jobs)  # the files hashed as bytes (a link or FIFO is not read)
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB allocated listing a checkpoint"


def test_names_and_digests_need_no_state_and_change_with_the_bytes(tmp_path):
    from policy_export.exporter.many.jobs import expand

    ck = tmp_path / "ckpt"
    shutil.copytree(MULTI, ck)
    shutil.rmtree(ck / "policies")  # ids only inside the state: one job, its own process reads them
    (ck / "algorithm_state.pkl").write_bytes(b"not a pickle")
    [job] = expand([ck], tmp_path / "root", {})
    assert (job.name, job.policy_id, job.refused) == ("ckpt", None, "")
    (ck / "algorithm_state.pkl").write_bytes(b"not a pickle either")
    assert expand([ck], tmp_path / "root", {})[0].digest != job.digest
    policy = tmp_path / "single"
    shutil.copytree(CHECKPOINTS / "policy_cloudpickle" / "checkpoint", policy)
    _bomb(policy / "policy_state.pkl", 1)
    assert [(j.name, j.policy_id) for j in expand([policy], tmp_path / "root", {})] == [("single", "default_policy")]


def _refuse(ck: Path, how: str) -> None:
    meta = ck / "rllib_checkpoint.json"
    if how == "policy_link":
        os.symlink("/etc", ck / "policies" / "gamma")
    elif how == "policy_name":
        (ck / "policies" / "alpha").rename(ck / "policies" / "al pha")
    elif how == "policies_link":
        shutil.rmtree(ck / "policies")
        os.symlink(MULTI / "policies", ck / "policies")
    elif how == "duplicate_key":
        meta.write_text('{"type": "Algorithm", "type": "Policy", "checkpoint_version": "1.1"}')
    elif how == "nan":
        meta.write_text('{"type": "Algorithm", "checkpoint_version": NaN}')
    elif how == "json_bomb":
        meta.write_text('{"type": "Algorithm", "pad": "' + "x" * (2 << 20) + '"}')
    elif how == "meta_link":
        meta.unlink()
        os.symlink(MULTI / "rllib_checkpoint.json", meta)
    elif how == "type":
        meta.write_text('{"type": "Trainer"}')


REFUSED = [("policy_link", "policies/gamma is not a directory (a symbolic link is not followed)"),
           ("policy_name", "entry 'al pha' is not a plain policy name"),
           ("policies_link", "policies is not a directory (a symbolic link is not followed)"),
           ("duplicate_key", "duplicate key 'type'"),
           ("nan", "NaN"),
           ("json_bomb", "limit of 1048576 bytes"),
           ("meta_link", "a symbolic link"),
           ("type", "type 'Trainer' is neither 'Algorithm' nor 'Policy'")]


@pytest.mark.parametrize("how, fragment", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_checkpoint_whose_listing_is_refused_fails_without_a_process(tmp_path, how, fragment):
    from policy_export.exporter.many import export_many

    ck = tmp_path / "evil"
    shutil.copytree(MULTI, ck)
    _refuse(ck, how)
    lines: list[str] = []
    result = export_many([ck], tmp_path / "root", progress=lines.append)
    [only] = result.results
    assert result.failed == ["evil"] and only["status"] == "failed" and only["seconds"] == 0.0
    why = only["failures"][0]
    assert why.startswith("refused before running: UnsafeCheckpointError: ") and fragment in why, why
    assert len(why) <= 600
    assert not (tmp_path / "root" / "evil").exists()
    assert not any("started" in line for line in lines)  # no process was started for it


def test_a_policy_past_its_time_limit_is_killed_and_fails(tmp_path):
    from policy_export.exporter.many import export_many

    start = time.perf_counter()  # a fresh process (no fork server to wait for) with half a second to export
    result = export_many([FIXTURES_DIR / "cartpole_mlp"], tmp_path / "root", jobs=1, policy_timeout=0.5, preload=False,
                         progress=lambda line: None, samples=50, explore_samples=0, formats=["saved_model"])
    [only] = result.results
    assert only["status"] == "failed" and result.failed == ["cartpole_mlp"]
    assert only["failures"] == [only["failures"][0]] and "over the time limit of 0.5 s per policy" in only["failures"][0]
    assert only["attempts"] == 1 and only["seconds"] < 5  # killed, not retried
    assert not (tmp_path / "root" / "cartpole_mlp" / "manifest.json").exists()
    assert time.perf_counter() - start < 30


def test_bad_caps_are_input_errors():
    from policy_export.errors import InputError
    from policy_export.exporter.many import export_many, verify_many

    for bad in (0, -1, float("nan"), float("inf"), True, "10"):
        with pytest.raises(InputError, match="policy_timeout must be a number of seconds above 0"):
            export_many([FIXTURES_DIR / "cartpole_mlp"], "/nonexistent/root", policy_timeout=bad)
        with pytest.raises(InputError, match="policy_timeout must be a number of seconds above 0"):
            verify_many("/nonexistent/root", policy_timeout=bad)


def test_root_an_existing_file_is_exit_2_with_one_line(tmp_path, capsys):
    from policy_export.exporter.cli import main

    file = tmp_path / "zoo"
    file.write_text("a file")
    assert main(["export-many", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(file), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"ROOT (--out) {file}: exists and is not a directory" in err[0], err
    assert main(["export-many", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(file / "below"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"({file} is not a directory)" in err[0], err
    assert main(["verify-many", str(file), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"verify-many's ROOT {file}: exists and is not a directory" in err[0], err
    assert file.read_text() == "a file"


DRIVER = """
import sys, time
from policy_export.exporter.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
# this process only (the policies' processes are the fork server's children, not counted here)
# this process's own peak (VmHWM: ru_maxrss would carry the RSS of the process that started it over exec)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("DRIVER", hwm, time.perf_counter() - start, file=sys.stderr)
sys.exit(code)
"""


def test_a_hostile_checkpoint_next_to_a_good_policy_fails_alone_with_the_driver_bounded(tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(CHECKPOINTS / "policy_cloudpickle" / "checkpoint", bad)
    _bomb(bad / "policy_state.pkl")  # 160 MiB: merely reading it in the driver would pass the bound below
    report = tmp_path / "report.json"
    command = [sys.executable, "-c", DRIVER, "export-many", str(FIXTURES_DIR / "cartpole_mlp"), str(bad),
               "--out", str(tmp_path / "zoo"), "--jobs", "2", "--memory-mb", "1000", "--samples", "50",
               "--explore-samples", "0", "--formats", "saved_model", "--report-json", str(report), "-q"]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "1 of 2 policies failed: bad" in proc.stdout
    driver_kb, _ = proc.stderr.split("DRIVER ")[1].split()[:2]
    assert int(driver_kb) < 128 * 1024, f"driver peak {int(driver_kb) / 1024:.0f} MiB"
    doc = json.loads(report.read_text())
    by_name = {p["name"]: p for p in doc["policies"]}
    assert by_name["cartpole_mlp"]["status"] == "passed"
    assert json.loads((tmp_path / "zoo" / "cartpole_mlp" / "manifest.json").read_text())["parity"]["passed"]
    assert by_name["bad"]["status"] in ("failed", "error") and doc["summary"]["failed"] == ["bad"]
    assert by_name["bad"]["failures"] and all(len(f) <= 700 for f in by_name["bad"]["failures"])
    assert not (tmp_path / "zoo" / "bad").exists()
    assert wall < 240
