"""export-many / verify-many on the local pool: every policy in a fresh process, one report,
incremental reruns, a broken policy among good ones, a killed worker, the memory cap."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR

FAST = {"samples": 100, "explore_samples": 500}
CHECKPOINT = FIXTURES_DIR / "rllib" / "checkpoints" / "multi_agent" / "checkpoint"


def _copies(tmp_path: Path, n: int, fixture: str = "cartpole_mlp") -> list[Path]:
    out = []
    for i in range(n):
        target = tmp_path / "sources" / f"p{i}"
        shutil.copytree(FIXTURES_DIR / fixture, target)
        out.append(target)
    return out


def _league(tmp_path: Path) -> Path:
    league = tmp_path / "league.json"
    league.write_text(json.dumps({"policies": [
        {"name": "cart", "source": str(FIXTURES_DIR / "cartpole_mlp"), "options": {"samples": 150}},
        {"source": str(CHECKPOINT), "options": {"formats": ["saved_model", "onnx"]}},
        {"name": "pend", "source": str(FIXTURES_DIR / "pendulum_mlp")},
    ]}))
    return league


@pytest.fixture(scope="module")
def league_run(tmp_path_factory):
    from policy_export.exporter.many import export_many

    tmp = tmp_path_factory.mktemp("many")
    lines: list[str] = []
    result = export_many([_league(tmp)], tmp / "root", jobs=2, progress=lines.append, **FAST)
    return tmp, result, lines


def test_a_league_exports_every_policy_in_its_own_process(league_run):
    tmp, result, lines = league_run
    root = tmp / "root"
    assert result.passed and [r["name"] for r in result.results] == ["cart", "multi_agent-alpha", "multi_agent-beta",
                                                                    "pend"]
    for r in result.results:
        doc = json.loads((root / r["name"] / "manifest.json").read_text())
        assert doc["parity"]["passed"] and r["status"] == "passed" and r["seconds"] > 0
        assert 100 < r["peak_rss_mb"] < 4000 and 0 <= r["max_error"] < 1e-4
    assert len({r["pid"] for r in result.results} | {os.getpid()}) == 5  # a process per policy, none the driver
    cart = json.loads((root / "cart" / "manifest.json").read_text())
    alpha = json.loads((root / "multi_agent-alpha" / "manifest.json").read_text())
    assert cart["parity"]["samples"] == 150 and set(alpha["formats"]) == {"saved_model", "onnx"}  # per-policy options
    assert alpha["source"]["policy_id"] == "alpha"
    assert any("4/4 done, 0 running, 0 failed" in line for line in lines) and any("ETA" in line for line in lines)


def test_one_report_as_json_junit_and_markdown(league_run):
    _, result, _ = league_run
    doc = result.to_json()
    assert doc["summary"] == {"policies": 4, "counts": {"passed": 4}, "failed": [], "seconds": doc["summary"]["seconds"],
                              "passed": True}
    suites = ET.fromstring(result.junit()).findall("testsuite")
    assert [s.get("name") for s in suites] == ["cart", "multi_agent-alpha", "multi_agent-beta", "pend"]
    alpha = suites[2]
    assert {c.get("classname").split(".")[1].split(" ")[0] for c in alpha.findall("testcase")} == {"saved_model", "onnx"}
    assert all(c.find("failure") is None for s in suites for c in s.findall("testcase"))
    markdown = result.markdown("zoo")
    assert markdown.startswith("### zoo: passed") and "| multi_agent-beta | passed |" in markdown


def test_a_rerun_skips_what_is_current_and_redoes_what_changed(league_run, tmp_path):
    from policy_export.exporter.many import export_many

    tmp, first, _ = league_run
    root = tmp / "root"
    again = export_many([tmp / "league.json"], root, jobs=2, progress=lambda line: None, **FAST)
    assert [r["status"] for r in again.results] == ["skipped"] * 4 and again.passed
    # a changed file in one export: that one is not current
    with open(root / "pend" / "model.onnx", "ab") as f:  # no longer the file its manifest names
        f.write(b"\0")
    other = export_many([tmp / "league.json"], root, jobs=2, progress=lambda line: None, **FAST)
    assert {r["name"]: r["status"] for r in other.results} == {"cart": "skipped", "multi_agent-alpha": "skipped",
                                                               "multi_agent-beta": "skipped", "pend": "failed"}
    # not current, and not replaced either: a changed export is someone's, it is named and left alone
    assert "'model.onnx' was changed since it was exported" in other.results[-1]["failures"][0]
    shutil.rmtree(root / "pend")
    redone = export_many([tmp / "league.json"], root, jobs=2, progress=lambda line: None, **FAST)
    assert [r["status"] for r in redone.results] == ["skipped"] * 3 + ["passed"]
    forced = export_many([FIXTURES_DIR / "cartpole_mlp"], tmp_path / "r2", jobs=1, force=True,
                         progress=lambda line: None, **FAST)
    assert forced.results[0]["status"] == "passed"


def test_verify_many_verifies_every_export_in_fresh_processes(league_run):
    from policy_export.exporter.many import verify_many

    tmp, _, _ = league_run
    result = verify_many(tmp / "root", jobs=2, progress=lambda line: None)
    assert result.passed and len(result.results) == 4 and all(r["kind"] == "verify" for r in result.results)
    assert len({r["pid"] for r in result.results}) == 4


def test_a_broken_policy_fails_alone_and_the_cli_names_it(tmp_path, capsys):
    from policy_export.exporter.cli import main

    good = _copies(tmp_path, 2)
    broken = tmp_path / "sources" / "broken"
    shutil.copytree(FIXTURES_DIR / "cartpole_mlp", broken)
    weights = next(broken.glob("*.h5"))
    weights.write_bytes(weights.read_bytes()[:200])  # a truncated weights file
    report = tmp_path / "report.json"
    code = main(["export-many", *map(str, good), str(broken), "--out", str(tmp_path / "root"), "--jobs", "2",
                 "--samples", "100", "--explore-samples", "500", "--report-json", str(report), "-q"])
    assert code == 1
    out = capsys.readouterr().out
    assert "1 of 3 policies failed: broken" in out
    doc = json.loads(report.read_text())
    status = {p["name"]: (p["status"], p["failures"]) for p in doc["policies"]}
    assert status["p0"] == ("passed", []) and status["p1"] == ("passed", [])
    assert status["broken"][0] == "failed" and "broken" in doc["summary"]["failed"]
    assert "h5" in status["broken"][1][0].lower() or "weights" in status["broken"][1][0].lower()
    assert not (tmp_path / "root" / "broken").exists()


def test_bad_sources_and_league_files_are_input_errors(tmp_path, capsys):
    from policy_export.exporter.cli import main

    league = tmp_path / "l.json"
    league.write_text(json.dumps({"policies": [{"source": str(FIXTURES_DIR / "cartpole_mlp"), "options": {"colour": 1}}]}))
    assert main(["export-many", str(league), "--out", str(tmp_path / "r")]) == 2
    assert "unknown option(s) ['colour']" in capsys.readouterr().err
    assert main(["export-many", str(FIXTURES_DIR / "cartpole_mlp"), str(FIXTURES_DIR / "cartpole_mlp"),
                 "--out", str(tmp_path / "r")]) == 2
    assert "two policies would be exported to 'cartpole_mlp'" in capsys.readouterr().err
    assert main(["export-many", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "is not a spec directory" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_driver_never_imports_tensorflow(tmp_path):
    code = ("import sys; from policy_export.exporter.cli import main; "
            f"rc = main(['export-many', {str(FIXTURES_DIR / 'cartpole_mlp')!r}, {str(CHECKPOINT)!r}, '--out', "
            f"{str(tmp_path / 'root')!r}, '--jobs', '2', '--samples', '50', '--explore-samples', '0', '-q']); "
            "heavy = [m for m in ('tensorflow', 'onnxruntime', 'tf2onnx', 'keras', 'tf_keras') if m in sys.modules]; "
            "print('HEAVY', heavy); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stdout


def _children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def test_a_killed_worker_is_retried_in_a_new_process(tmp_path):
    from policy_export.exporter.many import export_many

    sources = _copies(tmp_path, 2)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=export_many(
        sources, tmp_path / "root", jobs=1, progress=lambda line: None, **FAST)))
    thread.start()
    victim = None
    deadline = time.time() + 120
    while victim is None and time.time() < deadline:  # the fork server's child: the first policy's process
        servers = [p for p in _children_of(os.getpid())]
        workers = [c for s in servers for c in _children_of(s)]
        victim = workers[0] if workers else None
        time.sleep(0.2)
    assert victim is not None
    time.sleep(1.0)
    os.kill(victim, signal.SIGKILL)
    thread.join(600)
    result = box["result"]
    assert result.passed and [r["status"] for r in result.results] == ["passed", "passed"]
    assert result.results[0]["attempts"] == 2 and result.results[0]["pid"] != victim
    for r in result.results:
        assert json.loads((tmp_path / "root" / r["name"] / "manifest.json").read_text())["parity"]["passed"]


def test_a_policy_over_the_memory_cap_is_stopped_and_fails(tmp_path):
    from policy_export.exporter.many import export_many

    result = export_many(_copies(tmp_path, 1), tmp_path / "root", jobs=1, memory_mb=150, progress=lambda line: None, **FAST)
    only = result.results[0]
    assert only["status"] == "failed" and "over the memory cap of 150 MiB" in only["failures"][0]
    assert not (tmp_path / "root" / "p0" / "manifest.json").exists() and result.failed == ["p0"]


def test_progress_lines_and_the_live_counts():
    from policy_export.exporter.many import Progress
    from policy_export.exporter.many.jobs import Job

    lines, counts = [], []
    progress = Progress(3, 2, lines.append, counts.append)
    job = Job("a", "spec", "/src/a", "/root/a", "/root")
    progress.started(job, 1)
    progress.finished({"name": "a", "status": "passed", "seconds": 4.0, "failures": []})
    progress.finished({"name": "b", "status": "failed", "seconds": 2.0, "failures": ["parity failed: x"]})
    assert lines[0].startswith("[0/3 done, 1 running, 0 failed") and lines[0].endswith("a: started")
    assert "] a: passed in 4.0 s" in lines[1] and "ETA 4 s" in lines[1]  # mean 4 s x 2 left / 2 workers
    assert lines[2].startswith("[2/3 done, 0 running, 1 failed") and lines[2].endswith("b: failed in 2.0 s: parity failed: x")
    assert len(counts) == 3 and counts[-1].startswith("2/3 done, 0 running, 1 failed")


@pytest.mark.parametrize("make,kind", [
    (lambda p: (p / "policy.json").write_text("{}"), "spec"),
    (lambda p: (p / "rllib_checkpoint.json").write_text("{}"), "checkpoint"),
    (lambda p: (p / "saved_model.pb").write_bytes(b""), "saved_model"),
    (lambda p: ((p / "saved_model").mkdir(), (p / "saved_model" / "saved_model.pb").write_bytes(b""),
                (p / "manifest.json").write_text("{}")), "export"),
])
def test_one_detector_names_each_kind_of_source(tmp_path, make, kind):
    """export, inspect and export-many decide what a path is in one place: the sources' registry."""
    from policy_export.exporter import sources

    make(tmp_path)
    assert sources.detect(tmp_path).name == kind
    if kind == "spec":
        assert sources.detect(tmp_path / "policy.json").name == "spec"


def test_the_detector_names_what_a_path_is_not_and_inner_checkpoints(tmp_path):
    from policy_export.errors import ExportError, InputError
    from policy_export.exporter import sources

    detect = sources.detect
    with pytest.raises(InputError, match="no such directory"):
        detect(tmp_path / "nothing")
    with pytest.raises(InputError, match=r"convert's source .* is not an RLlib checkpoint \(rllib_checkpoint.json\) "
                                         r"or a SavedModel directory \(saved_model.pb\)"):
        detect(tmp_path, ("checkpoint", "saved_model"), "convert's source")
    for step in ("checkpoint_000001", "checkpoint_000002"):
        (tmp_path / step).mkdir()
        (tmp_path / step / "rllib_checkpoint.json").write_text("{}")
    with pytest.raises(ExportError, match="checkpoint_000001, checkpoint_000002: give one of those"):
        detect(tmp_path)
    (tmp_path / "policy.json").write_text("{}")  # a spec beside them: the spec is what the path is
    assert detect(tmp_path).name == "spec"
