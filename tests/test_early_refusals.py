"""Mistakes a person makes at the command line are refused before TensorFlow loads, with a
suggestion where one name is close to another."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import FIXTURES_DIR
from helpers import one_line_error

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
    one_line_error(done, 2, "unknown format(s) ['onxx']; did you mean onnx?")
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
