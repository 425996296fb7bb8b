"""Exit codes survive a closed pipe: ``policy-export verify OUT | head -1`` exits with verify's
own code. Every command runs as the console script, once with its output read to the end and once
with its stderr closed at once and its stdout closed after one line, and the two exit codes must
be the same (with no traceback, and no "Exception ignored" from the interpreter's last flush).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR
from helpers import SCRIPT

QUICK = ("--samples", "20", "--explore-samples", "0")


def _command(args) -> list[str]:
    base = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "policy_export"]
    return [*base, *map(str, args)]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GITHUB_STEP_SUMMARY")}


def run_open(args) -> subprocess.CompletedProcess:
    """The command with both streams read to the end."""
    return subprocess.run(_command(args), capture_output=True, text=True, timeout=300, env=_env())


def run_closed(args, close: tuple[str, ...] = ("stdout", "stderr")) -> tuple[int, str]:
    """The command with the streams in ``close`` closed by their reader early: stderr at once,
    stdout after its first line. Returns the exit code and what the other stream (if any) got."""
    with tempfile.TemporaryFile() as kept:
        streams = {name: subprocess.PIPE if name in close else kept for name in ("stdout", "stderr")}
        proc = subprocess.Popen(_command(args), env=_env(), **streams)
        try:
            if proc.stderr is not None:
                proc.stderr.close()
            if proc.stdout is not None:
                proc.stdout.readline()
                proc.stdout.close()
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kept.seek(0)
        return code, kept.read().decode(errors="replace")


def assert_same_code(args, expected: int, close: tuple[str, ...] = ("stdout", "stderr")) -> None:
    opened = run_open(args)
    assert opened.returncode == expected, (opened.returncode, opened.stderr[-2000:])
    code, other = run_closed(args, close)
    assert code == opened.returncode, (args, close, code, other[-2000:])
    for word in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert word not in other, other[-2000:]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Exports of CartPole (onnx; and saved_model with onnx, which rollout runs), one of Pendulum
    (a breaking change against CartPole's), a tampered copy of the first, and a root holding a
    copy of the first (for verify-many); made in this process (the console script's export is
    tested below)."""
    from policy_export.exporter import export_spec

    root = tmp_path_factory.mktemp("pipes")
    paths = {"a": root / "a", "b": root / "b", "both": root / "both", "tampered": root / "tampered",
             "many": root / "many"}
    for key, fixture, formats in (("a", "cartpole_mlp", ["onnx"]), ("b", "pendulum_mlp", ["onnx"]),
                                  ("both", "cartpole_mlp", ["saved_model", "onnx"])):
        export_spec(FIXTURES_DIR / fixture, paths[key], device="cpu", formats=formats, samples=20,
                    explore_samples=0)
    shutil.copytree(paths["a"], paths["tampered"])
    with open(paths["tampered"] / "model.onnx", "ab") as f:
        f.write(b"\0")
    shutil.copytree(paths["a"], paths["many"] / "cartpole_mlp")
    paths["root"] = root
    return paths


def test_export(made):
    args = ["export", FIXTURES_DIR / "cartpole_mlp", "--out", made["root"] / "export", "--formats", "onnx",
            "--overwrite", *QUICK]
    assert_same_code(args, 0)


def test_convert_bad_input(made):
    """The same command as export (tested above), here its input rejected."""
    assert_same_code(["convert", FIXTURES_DIR / "cartpole_mlp", "--out", made["root"] / "convert",
                      "--opset", "99"], 2)


@pytest.mark.parametrize("close", [("stdout",), ("stderr",)])
def test_a_verify_that_passed_still_passes(made, close):
    assert_same_code(["verify", made["a"], "--samples", "20"], 0, close)


def test_a_verify_that_failed_still_fails(made):
    assert_same_code(["verify", made["tampered"], "--samples", "20"], 1)


def test_inspect_json(made):
    assert_same_code(["inspect", made["a"], "--json"], 0)


def test_diff_keeps_its_verdict(made):
    assert_same_code(["diff", made["a"], made["a"]], 0)
    for close in (("stdout",), ("stderr",)):
        assert_same_code(["diff", made["a"], made["b"]], 1, close)


def test_rollout(made):
    assert_same_code(["rollout", made["both"], "--env", "CartPole-v1", "--episodes", "1"], 0)


def test_serve_bad_input(made):
    """Without a server (or the serve extra): its input checked, exit 2 either way."""
    assert_same_code(["serve", made["root"] / "missing"], 2)


def test_export_many(made):
    """Its policies run in processes of their own, which inherit the closed stderr."""
    assert_same_code(["export-many", FIXTURES_DIR / "cartpole_mlp", "--out", made["root"] / "many2",
                      "--formats", "onnx", "--jobs", "1", "--force", *QUICK], 0)


def test_verify_many(made):
    assert_same_code(["verify-many", made["many"], "--jobs", "1", "--samples", "20"], 0)


def test_bad_input_usage_help_and_version(made):
    assert_same_code(["verify", made["root"] / "missing"], 2)
    assert_same_code(["verify"], 2)  # argparse's usage error
    assert_same_code(["--help"], 0)
    assert_same_code(["--version"], 0)


def test_example(made):
    assert_same_code(["example", made["a"]], 2)  # not empty
    target = made["root"] / "example"
    code, _ = run_closed(["example", target])
    assert code == 0 and (target / "policy.json").is_file()


def test_sign_bad_input(made):
    """Its request checked before anything is signed (a key that is not there), exit 2 either way."""
    assert_same_code(["sign", made["a"], "--sign-key", made["root"] / "no-key.pem"], 2)


def test_docs(made):
    assert_same_code(["docs"], 0)
    assert_same_code(["docs", "ci-gate"], 0)  # a page longer than one pipe buffer, its reader gone
    assert_same_code(["docs", "no-such-page"], 2)


def test_every_command_is_tested_here():
    from policy_export.exporter.cli_args import build_parser

    tested = {"export", "convert", "verify", "inspect", "diff", "rollout", "serve", "export-many", "verify-many",
              "example", "sign", "docs"}
    assert set(build_parser().command_parsers) == tested
