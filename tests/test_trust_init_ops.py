"""Loading a SavedModel runs ops of the file (the restore op, the init op, variable initializers)
before any signature: on every route that loads one, those runs keep the run limit and a signal
stops them, like every later run (one loader: exporter.trust.open_saved_model)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR, ROOT, default_signals, splice_endless_init
from helpers import cli
from helpers import one_line_error, snapshot

LEGACY = FIXTURES_DIR / "rllib" / "legacy" / "cartpole_ff" / "saved_model"
KERAS = FIXTURES_DIR / "rllib" / "keras" / "cartpole_ff" / "model"
CARTPOLE_ACTIONS = json.dumps({"type": "Discrete", "n": 2})
LIMIT_MESSAGE = "did not finish one run within the limit of 2 s (--run-timeout)"


def _endless_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    splice_endless_init(target / "saved_model.pb")
    return target


@pytest.fixture(scope="module")
def export(exports):
    _, out = exports("cartpole_mlp")
    return out


@pytest.mark.parametrize("source, extra", [(LEGACY, ()), (KERAS, ("--action-space", CARTPOLE_ACTIONS))],
                         ids=["rllib_export", "keras_base_model"])
def test_convert_stops_an_endless_init_at_the_run_limit(tmp_path, source, extra):
    model = _endless_copy(source, tmp_path / "model")
    start = time.monotonic()
    proc = cli("convert", str(model), "--out", str(tmp_path / "out"), *extra, "--run-timeout", "2", "-q")
    elapsed = time.monotonic() - start
    one_line_error(proc, 1, f"SavedModel {model} {LIMIT_MESSAGE}")
    assert not (tmp_path / "out").exists() and elapsed < 60, elapsed


def test_the_untouched_files_convert(tmp_path):
    """The same routes without the endless init (the loader is not refusing everything)."""
    proc = cli("convert", str(LEGACY), "--out", str(tmp_path / "out"), "--samples", "16",
               "--formats", "saved_model", "--run-timeout", "30", "-q")
    assert proc.returncode == 0, proc.stderr


def test_verify_stops_an_endless_init_in_a_candidate_at_the_run_limit(export, tmp_path):
    """The verify route: the runner of the SavedModel format (and of the TF Serving layout, which
    opens its version directory with the same runner)."""
    candidate = _endless_copy(export / "saved_model", tmp_path / "candidate")
    before = snapshot(export)
    start = time.monotonic()
    proc = cli("verify", str(export), "--candidate", f"saved_model={candidate}", "--run-timeout", "2", "-q",
               "--report-json", str(tmp_path / "r.json"))
    elapsed = time.monotonic() - start
    one_line_error(proc, 1, "verify failed: 1 problem(s)")
    errors = json.loads((tmp_path / "r.json").read_text())["errors"]
    assert len(errors) == 1 and LIMIT_MESSAGE in next(iter(errors.values())), errors
    assert elapsed < 90, elapsed
    assert snapshot(export) == before


def test_the_keras_runner_stops_an_endless_init_at_the_run_limit(export, tmp_path):
    from policy_export.exporter.formats.keras.model import KerasRunner
    from policy_export.exporter.watchdog import RunTimeoutError, run_limit

    model = _endless_copy(export / "keras" / "saved_model", tmp_path / "saved_model")
    start = time.monotonic()
    with run_limit(1.0), pytest.raises(RunTimeoutError, match=f"SavedModel {model} did not finish one run"):
        KerasRunner(model)
    assert time.monotonic() - start < 30


# the command, with TensorFlow and the loader imported first and "ready" said on stderr: what
# follows is the SavedModel's load, inside the init's loop within a second
_READY_THEN_CLI = ("import sys, tensorflow, policy_export.exporter.sources.legacy; sys.stderr.write('ready\\n'); "
                   "sys.stderr.flush(); from policy_export.exporter.cli import console_main; sys.exit(console_main())")


def test_a_signal_stops_convert_inside_an_endless_init(tmp_path):
    model = _endless_copy(LEGACY, tmp_path / "model")
    proc = subprocess.Popen([sys.executable, "-c", _READY_THEN_CLI, "convert", str(model), "--out", str(tmp_path / "o")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    line = proc.stderr.readline()
    while line not in ("ready\n", ""):  # TensorFlow's import chatter
        line = proc.stderr.readline()
    assert line == "ready\n"
    time.sleep(3.0)  # the default run limit is 600 s: the init's loop is running
    assert proc.poll() is None
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert time.monotonic() - sent < 5
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
