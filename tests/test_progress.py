"""Progress output: one line per stage with its elapsed time when stderr is not a terminal (or
``CI`` is set), a live display on a terminal, nothing with ``--quiet`` or from the Python API
unless asked for."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR
from helpers import messages

SCRIPT = Path(sys.executable).parent / "policy-export"
LINE = re.compile(r"^\[policy-export\] (?P<name>[^:]+): (?P<seconds>\d+\.\d) s$")
FAST = ("--samples", "32", "--explore-samples", "40", "--device", "cpu")
EXPORT_STAGES = ["load TensorFlow", "graph build", "write saved_model", "write frozen_graph", "write onnx",
                 "write onnx_deterministic", "write keras", "parity session", "parity saved_model",
                 "parity frozen_graph", "parity onnx", "parity onnx_deterministic", "parity keras", "write manifest"]
VERIFY_STAGES = ["load TensorFlow", "check files", "load plan", "parity saved_model", "parity frozen_graph", "parity onnx",
                 "parity onnx_deterministic", "parity keras"]


def cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "policy_export"]
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GITHUB_STEP_SUMMARY")}
    env.update(env_extra or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, env=env)


def stages(stderr: str) -> list[str]:
    """The stage names of ``stderr``, every line checked to be a progress line."""
    names = []
    for line in stderr.splitlines():
        m = LINE.match(line)
        assert m, f"not a progress line: {line!r} in\n{stderr}"
        names.append(m["name"])
    return names


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("progress") / "cartpole"
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), *FAST)
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_export_prints_one_line_per_stage_in_order(exported):
    _, proc = exported
    assert stages(proc.stderr) == EXPORT_STAGES
    assert "[policy-export]" not in proc.stdout  # progress never goes to stdout
    assert "exported " in proc.stdout and "parity" in proc.stdout


def test_export_quiet_prints_no_progress(tmp_path):
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "out"), *FAST, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "exported " in " ".join(proc.stdout.split())


def test_verify_prints_one_line_per_stage_and_ci_means_plain(exported):
    out, _ = exported
    proc = cli("verify", str(out), "--samples", "16", "--localize", env_extra={"CI": "true"})
    assert proc.returncode == 0, proc.stderr
    assert stages(proc.stderr) == [*VERIFY_STAGES, "fresh samples", "localize"]
    assert "verified " in proc.stdout and "[policy-export]" not in proc.stdout
    quiet = cli("verify", str(out), "-q")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_failed_verify_ends_with_its_one_line(exported, tmp_path):
    import shutil

    out, _ = exported
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    (copy / "frozen_graph.pb").write_bytes(b"changed")
    proc = cli("verify", str(copy))
    assert proc.returncode == 1
    *progress, last = messages(proc.stderr)
    assert last.startswith("policy-export: verify failed:")
    assert stages("\n".join(progress))[:3] == ["load TensorFlow", "check files", "load plan"]


def test_convert_prints_its_stages(tmp_path):
    proc = cli("convert", str(FIXTURES_DIR / "rllib" / "legacy" / "cartpole_ff" / "saved_model"),
               "--out", str(tmp_path / "out"), "--samples", "32", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    names = stages(proc.stderr)
    assert names[:2] == ["load TensorFlow", "load SavedModel"] and names[-1] == "write manifest"
    assert "write onnx" in names and "parity session" in names and "parity onnx" in names


def test_bad_input_is_one_line_and_no_progress(tmp_path):
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(tmp_path / "out"), "--samples", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["policy-export: error: samples (--samples) must be at least 1, got 0"]


class Recorder:
    """A Progress that records each stage's name, total and rows advanced."""

    def __init__(self):
        self.stages: list[tuple[str, int | None, int]] = []

    @contextlib.contextmanager
    def stage(self, name, total=None):
        from policy_export.exporter.progress import Task

        task = Task(name, total)
        yield task
        self.stages.append((name, total, task.completed))

    def close(self, failed=False):
        pass


def test_python_api_is_silent_by_default_and_reports_when_asked(tmp_path, policies, capfd):
    from policy_export.exporter import export_policy, verify_export

    policy = policies("cartpole_mlp")
    result = export_policy(policy, tmp_path / "a", samples=48, explore_samples=40, device="cpu")
    verify_export(tmp_path / "a", samples=8, device="cpu").raise_if_failed()
    captured = capfd.readouterr()
    assert "[policy-export]" not in captured.err + captured.out

    recorder = Recorder()
    result = export_policy(policy, tmp_path / "b", samples=48, explore_samples=40, device="cpu", progress=recorder)
    names = [name for name, _, _ in recorder.stages]
    assert names == EXPORT_STAGES[2:]  # "load TensorFlow" is the command line's, "graph build" export_spec's
    assert set(result.timings) >= {"write onnx", "parity", "write manifest"}
    totals = {name: (total, done) for name, total, done in recorder.stages}
    # the session runs 48 golden rows, the base model's 48, and 4 observations x 10 draws
    assert totals["parity session"] == (48 + 48 + 40, 48 + 48 + 40)
    for fmt in ("saved_model", "frozen_graph", "onnx"):
        assert totals[f"parity {fmt}"] == (48 + 40, 48 + 40)  # every bar ends full
    assert totals["parity keras"][0] is None  # checked on the base model: no bar

    recorder = Recorder()
    verify_export(tmp_path / "b", samples=8, device="cpu", progress=recorder).raise_if_failed()
    assert [name for name, _, _ in recorder.stages] == [*VERIFY_STAGES[1:], "fresh samples"]  # no TF to load
    assert all(total == done for _, total, done in recorder.stages if total)
    assert dict((n, t) for n, t, _ in recorder.stages)["fresh samples"] == 8 * 4  # saved_model and 3 others


def test_plain_reporter_lines():
    from policy_export.exporter.progress import PlainProgress

    buf = io.StringIO()
    progress = PlainProgress(buf, heartbeat=0.05)
    with progress.stage("write onnx"):
        pass
    with pytest.raises(ValueError):
        with progress.stage("write keras"):
            raise ValueError("a failed stage prints no line; the error speaks for it")
    with progress.stage("parity onnx", total=1000) as task:
        task.advance(250)
        time.sleep(0.2)  # longer than the heartbeat: "still running" lines
    progress.close()
    with progress.stage("after close"):
        pass
    lines = buf.getvalue().splitlines()
    assert lines[0] == "[policy-export] write onnx: 0.0 s"
    assert LINE.match(lines[-1]) and lines[-1].startswith("[policy-export] parity onnx: ")
    beats = lines[1:-1]
    assert beats and all(re.fullmatch(r"\[policy-export\] parity onnx: still running after \d+ s "
                                      r"\(250 of 1,000 rows\)", b) for b in beats)
    assert not any("write keras" in line or "after close" in line for line in lines)


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_the_command_line_picks_its_reporter():
    from policy_export.exporter.progress import SILENT, PlainProgress, RichProgress, for_terminal

    tty, pipe = Tty(), io.StringIO()
    assert for_terminal(True, {}, stream=tty) is SILENT
    assert isinstance(for_terminal(False, {"TERM": "xterm"}, stream=tty), RichProgress)
    assert isinstance(for_terminal(False, {"CI": "true"}, stream=tty), PlainProgress)
    assert isinstance(for_terminal(False, {"TERM": "dumb"}, stream=tty), PlainProgress)
    assert isinstance(for_terminal(False, {}, stream=pipe), PlainProgress)
    assert isinstance(for_terminal(False, {"FORCE_COLOR": "1"}, stream=pipe), PlainProgress)


def test_rich_display_shows_stages_and_clears_before_an_error():
    from rich.console import Console

    from policy_export.exporter.progress import RichProgress

    buf = io.StringIO()
    progress = RichProgress(Console(file=buf, force_terminal=True, width=100))
    with progress.stage("write onnx"):
        pass
    with progress.stage("parity onnx", total=512) as task:
        task.advance(512)
    progress.close()
    text = buf.getvalue()
    assert "write onnx" in text and "parity onnx" in text and "512/512" in text and " s" in text

    buf = io.StringIO()
    progress = RichProgress(Console(file=buf, force_terminal=True, width=100))
    with pytest.raises(OSError):
        with progress.stage("write onnx"):
            raise OSError("disk full")
    progress.close(failed=True)
    assert progress._progress.live.transient  # the display is erased: the error line stands alone
    progress.close()  # idempotent


def test_export_records_peak_memory_at_the_end_of_each_stage(tmp_path):
    from conftest import FIXTURES_DIR
    from policy_export.exporter import export_spec

    result = export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "x", device="cpu", samples=32, explore_samples=0,
                         formats=["onnx"])
    peaks = result.peak_rss_mb
    assert {"graph build", "write onnx", "parity session", "parity onnx", "write manifest"} <= set(peaks)
    assert all(100 < v < 64 * 1024 for v in peaks.values())  # MiB: a TF process, not bytes or KiB
    order = [name for name in peaks if name != "graph build"]  # export's stages, in the order they ran
    assert all(peaks[a] <= peaks[b] for a, b in zip(order, order[1:]))  # a high-water mark
    assert peaks["graph build"] <= peaks[order[0]]
