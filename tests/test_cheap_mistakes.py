"""The cheap mistakes are refused first: each is decided before TensorFlow loads, in under 2 s,
with one message on stderr saying what is wrong in the user's terms (a space as ``Box(4,)``,
not numpy's padded print), and a usage error is one line, not the whole usage.

Each case runs the console script as a process (``python -c`` around ``main``, which prints
whether TensorFlow was imported), timed from start to exit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR

CODE = ("import sys\n"
        "from policy_export.exporter.cli import main\n"
        "try:\n"
        "    code = main(sys.argv[1:])\n"
        "except SystemExit as e:  # argparse's usage errors\n"
        "    code = e.code\n"
        "print('tensorflow' in sys.modules)\n"
        "sys.exit(code)")
LIMIT = 2.0  # seconds of the process's own time (CPU, user and system), start to exit
WALL = 8.0  # seconds of wall-clock time, start to exit, on a machine the other tests keep busy


def _run(*args: str, cwd: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """The command in a process of its own: the finished process and the CPU seconds it took
    (user and system; unlike its wall-clock time, not stretched by other work on the machine)."""
    import resource

    environ = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "GITHUB_STEP_SUMMARY")}
    environ.update(env or {})
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=environ)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    assert wall < WALL, f"{wall:.1f} s of wall-clock time"
    return done, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def refused(done: subprocess.CompletedProcess, seconds: float, fragment: str, width: int = 80) -> str:
    """The refusal: exit 2, TensorFlow never imported, under :data:`LIMIT` CPU seconds, one message
    on stderr (its continuation lines, at ``width`` columns, start with a space) holding ``fragment``."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout.strip() == "False", "TensorFlow was imported"
    lines = done.stderr.rstrip("\n").splitlines()
    assert lines and lines[0].startswith("policy-export") and all(line.startswith("  ") for line in lines[1:]), lines
    assert all(len(line) <= width for line in lines), lines
    message = " ".join(" ".join(lines).split())
    assert fragment in message, message
    assert seconds < LIMIT, f"{seconds:.2f} s: {message}"
    return message


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A working directory with the sources, an export of CartPole (made once: the mistakes of
    verify and sign need one), a key pair and recorded observations of the wrong width."""
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec

    from helpers import cli

    ws = tmp_path_factory.mktemp("cheap")
    shutil.copytree(FIXTURES_DIR / "cartpole_mlp", ws / "spec")
    shutil.copytree(FIXTURES_DIR / "rllib" / "checkpoints" / "ppo_filter" / "checkpoint", ws / "ckpt")
    shutil.copytree(FIXTURES_DIR / "rllib" / "newstack" / "ppo_discrete" / "checkpoint", ws / "newstack")
    shutil.copy(FIXTURES_DIR / "sb3" / "ppo_cartpole" / "model.zip", ws / "model.zip")
    key = ec.generate_private_key(ec.SECP256R1())
    (ws / "key.pem").write_bytes(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))
    (ws / "key.pub").write_bytes(key.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo))
    np.save(ws / "obs3.npy", np.zeros((16, 3), np.float32))
    np.savez(ws / "obs3.npz", observations=np.zeros((16, 3), np.float32))
    done = cli("export", str(ws / "spec"), "--out", str(ws / "out"), "--formats", "saved_model,onnx", "--samples", "20",
               "--explore-samples", "0", "-q")
    assert done.returncode == 0, done.stderr
    return ws


def _signing_installed() -> bool:
    from policy_export.exporter.compat import missing_modules

    return not missing_modules(("model_signing", "OpenSSL"))


signing = pytest.mark.skipif(not _signing_installed(), reason="the signing extra is not installed")


@signing
def test_sign_with_the_public_key_is_refused_first(workspace):
    done, seconds = _run("sign", "out", "--sign-key", "key.pub", cwd=workspace)
    refused(done, seconds, "--sign-key key.pub is a public key, not the private one (--public-key takes it)")


@signing
def test_export_signed_with_the_public_key_is_refused_first(workspace):
    done, seconds = _run("export", "spec", "--out", "new", "--sign-key", "key.pub", cwd=workspace)
    refused(done, seconds, "--sign-key key.pub is a public key, not the private one")
    assert not (workspace / "new").exists()


@signing
def test_verify_with_the_private_key_is_refused_first(workspace):
    done, seconds = _run("verify", "out", "--public-key", "key.pem", cwd=workspace)
    refused(done, seconds, "--public-key key.pem is a private key, not the public one (--sign-key takes it)")


@signing
def test_a_file_that_is_no_key_is_refused_first(workspace):
    done, seconds = _run("verify", "out", "--public-key", "spec/policy.json", cwd=workspace)
    refused(done, seconds, "--public-key spec/policy.json: not a PEM key file")


@pytest.mark.parametrize("source", ["spec", "ckpt", "newstack", "model.zip"])
def test_observations_of_the_wrong_width_are_refused_before_export(workspace, source):
    done, seconds = _run("export", source, "--out", "new", "--observations", "obs3.npy", cwd=workspace)
    message = refused(done, seconds, "--observations obs3.npy: rows of shape [3]; the observation space is "
                                     "Box(4,), rows of [4]")
    assert "e+38" not in message and "inf" not in message  # the space as a person reads it


def test_observations_of_the_wrong_width_are_refused_before_verify(workspace):
    done, seconds = _run("verify", "out", "--observations", "obs3.npz", cwd=workspace)
    refused(done, seconds, "--observations obs3.npz: rows of shape [3]; the observation space is Box(4,)")


def test_parquet_without_pyarrow_is_refused_first(workspace, tmp_path):
    blocked = tmp_path / "site"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text("import sys\nsys.modules['pyarrow'] = None  # not installed\n")
    data = FIXTURES_DIR / "rllib" / "offline" / "parquet_rows" / "data"
    for where in (data, next(data.rglob("*.parquet"))):
        done, seconds = _run("export", "spec", "--out", "new", "--observations", str(where), cwd=workspace,
                             env={"PYTHONPATH": str(blocked)})
        refused(done, seconds, "needs the module pyarrow, which is not installed; install the offline extra")


@pytest.mark.parametrize("source", ["ckpt", "newstack", "model.zip", "out"])
def test_a_format_the_source_cannot_have_is_refused_first(workspace, source):
    done, seconds = _run("export", source, "--out", "new", "--formats", "onnx,keras", cwd=workspace)
    refused(done, seconds, "format 'keras' cannot be written for")
    assert "it has no Keras base model; leave it out of --formats" in " ".join(done.stderr.split())


def test_a_missing_option_is_one_line_not_the_usage(workspace):
    done, seconds = _run("export", "spec", cwd=workspace)
    message = refused(done, seconds, "policy-export export: error: the following arguments are required: --out")
    assert "usage:" not in done.stderr.split("(usage")[0] and len(done.stderr.splitlines()) <= 2
    assert "[--formats LIST]" not in done.stderr
    assert message.endswith("(usage: policy-export export --help)")


def test_a_mistyped_format_suggests_one_without_a_stray_semicolon(workspace):
    done, seconds = _run("export", "spec", "--out", "new", "--formats", "onxx,tf_servng", cwd=workspace,
                         env={"COLUMNS": "300"})
    message = refused(done, seconds, "did you mean onnx, tf_serving?", width=300)
    assert "?;" not in message and len(done.stderr.splitlines()) == 1  # COLUMNS=300: one line


def test_bare_command_prints_the_help(workspace):
    done, _ = _run(cwd=workspace)
    assert done.returncode == 0 and done.stdout.startswith("usage: policy-export")
    assert "export" in done.stdout and "docs" in done.stdout and done.stderr == ""


def test_formats_help_never_splits_a_name(workspace):
    from policy_export.exporter import formats

    done = subprocess.run([sys.executable, "-m", "policy_export", "export", "--help"], capture_output=True, text=True,
                          cwd=workspace, env={**os.environ, "COLUMNS": "80"}, timeout=60)
    words = set(done.stdout.replace(",", " ").split())
    assert set(formats.names()) <= words, set(formats.names()) - words


def test_a_missing_extra_names_its_modules_in_plain_words():
    from policy_export.errors import InputError
    from policy_export.exporter.compat import require

    with pytest.raises(InputError, match=r"signing needs the modules no_such_a and no_such_b, which are not installed"):
        require(("no_such_a", "no_such_b"), "signing", "signing")
    with pytest.raises(InputError, match=r"x needs the module no_such_a, which is not installed"):
        require(("no_such_a",), "signing", "x")
