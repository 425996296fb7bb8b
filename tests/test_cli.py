"""The ``policy-export`` command line end to end, as CI would call it.

:func:`cli` runs the command in-process (its behaviour: exit code, stdout, stderr) unless a test
needs what only a process shows (library noise on the real stderr, a working directory, an
environment): ``isolated=True``, ``cwd`` or ``env_extra`` run the console script in a subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers import cli, messages
from conftest import FIXTURES_DIR

NOISE = ("I0000", "WARNING: All log messages", "cuda", "tensorflow", "Traceback", "oneDNN")


def assert_quiet(stderr: str) -> None:
    for word in NOISE:
        assert word not in stderr, f"library noise on stderr: {stderr[:500]}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "cartpole"
    junit = out.parent / "export.xml"
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--samples", "300",
               "--junit", str(junit), "--report-json", str(out.parent / "export.json"), isolated=True)
    assert proc.returncode == 0, proc.stderr
    assert_quiet(proc.stderr)
    assert "onnx" in proc.stdout and "pass" in proc.stdout and "FAIL" not in proc.stdout
    return out


def test_export_then_verify(exported, tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n")
    proc = cli("verify", str(exported), "--samples", "100", env_extra={"GITHUB_STEP_SUMMARY": str(summary)})
    assert proc.returncode == 0, proc.stderr
    assert_quiet(proc.stderr)
    assert "verified" in proc.stdout and "CPUExecutionProvider" in proc.stdout
    text = summary.read_text()
    assert text.startswith(f"# earlier step\n### verify {exported}: passed")  # appended, not overwritten
    assert "| onnx | actions_0 | 0 | 0 | 0 | 0 | exact | pass |" in text


def test_export_reports(exported):
    report = json.loads((exported.parent / "export.json").read_text())
    assert report["passed"] is True and report["samples"] == 300
    keys = {(r["format"], r["key"]) for r in report["records"]}
    assert ("onnx", "actions_0") in keys and ("keras_h5", "base_model_out") in keys
    suite = ET.parse(exported.parent / "export.xml").getroot()
    cases = suite.findall(".//testcase")
    assert len(cases) == len(report["records"]) + len(report["exploration"])
    assert len(report["exploration"]) >= 3 * 4  # 3 formats x 4 observations, chi-square each
    assert all(c["test"] == "chi-square homogeneity" and c["passed"] for c in report["exploration"])
    assert suite.find(".//failure") is None


def test_tampered_export_fails_verify_naming_the_file(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    with open(copy / "model.onnx", "ab") as f:
        f.write(b"\0")
    junit = tmp_path / "verify.xml"
    proc = cli("verify", str(copy), "--junit", str(junit))
    assert proc.returncode == 1
    assert "changed file model.onnx" in proc.stdout
    failures = ET.parse(junit).getroot().findall(".//failure")
    assert any("model.onnx" in (f.get("message") or "") for f in failures)


def test_existing_output_is_exit_2_without_traceback(exported):
    proc = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(exported), isolated=True)
    assert proc.returncode == 2
    assert len(messages(proc.stderr)) == 1 and "--overwrite" in proc.stderr
    assert_quiet(proc.stderr)


@pytest.mark.parametrize("setup, args, fragment", [
    (lambda d: (d / "policy.json").write_text("{nope"), [], "not valid JSON"),
    (lambda d: (d / "policy.json").write_text(json.dumps({"format_version": 1})), [], "$.name: missing"),
    (lambda d: None, [], "is not a spec directory (policy.json)"),
    (lambda d: shutil.copytree(FIXTURES_DIR / "cartpole_mlp", d, dirs_exist_ok=True), ["--opset", "3"], "opset 3"),
    (lambda d: shutil.copytree(FIXTURES_DIR / "cartpole_mlp", d, dirs_exist_ok=True), ["--formats", "coreml"],
     "unknown format"),
    (lambda d: shutil.copytree(FIXTURES_DIR / "cartpole_mlp", d, dirs_exist_ok=True), ["--tolerance", "x"],
     "KEY=ATOL"),
])
def test_bad_input_is_one_line_and_exit_2(setup, args, fragment, tmp_path):
    spec = tmp_path / "spec"
    spec.mkdir()
    setup(spec)
    proc = cli("export", str(spec), "--out", str(tmp_path / "out"), *args)
    assert proc.returncode == 2, proc.stderr
    lines = messages(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("policy-export: error:") and fragment in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_verify_of_a_non_export_is_exit_2(tmp_path):
    proc = cli("verify", str(tmp_path))
    assert proc.returncode == 2 and "has no manifest.json" in proc.stderr


def test_usage_error_is_exit_2():
    proc = cli("export")
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_module_entry_point_and_fast_help():
    proc = subprocess.run([sys.executable, "-c",
                           "import sys, policy_export.exporter.cli; policy_export.exporter.cli.build_parser(); print('tensorflow' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False"  # --help does not import TensorFlow
    proc = subprocess.run([sys.executable, "-m", "policy_export", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "verify" in proc.stdout
