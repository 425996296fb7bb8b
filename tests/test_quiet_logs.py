"""TensorFlow, absl and LiteRT keep their log lines off stderr: the Python API loads TensorFlow
quietly when one of its calls is the first to import it, and LiteRT's XNNPACK line stays hidden
(the command line shows both with --debug); a user who asks for the logs gets them, and an error
still reaches the user with stderr put back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import FIXTURES_DIR
from helpers import cli

XNNPACK = "INFO: Created TensorFlow Lite XNNPACK delegate for CPU."
# a line of TensorFlow's C++ logging: "I0000 00:00:... file.cc:12] ..." (TF >= 2.16, absl's format) or
# "2024-01-01 12:00:00.000000: I tensorflow/.../file.cc:12] ..." (TF 2.15)
TF_LINE = re.compile(r"^(?:[IWEF]\d{4} |\d{4}-\d\d-\d\d [\d:.]+: [IWEF] ).*\.cc:\d+\]", re.MULTILINE)

API_SCRIPT = textwrap.dedent("""\
    import logging, sys
    import policy_export
    if "show" in sys.argv:
        policy_export.show_library_logs()
    out = sys.argv[1]
    result = policy_export.export_spec({fixture!r}, out, formats=["onnx", "tflite"], samples=8, explore_samples=0,
                                       device="cpu")
    policy_export.verify_export(out, device="cpu").raise_if_failed()
    print(sorted(result.formats), logging.getLogger("tensorflow").getEffectiveLevel())
""").format(fixture=str(FIXTURES_DIR / "cartpole_mlp"))


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without the log settings the suite sets, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY")}
    return {**env, **extra}


def _python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=env if env is not None else _env())


def test_the_api_writes_nothing_to_stderr(tmp_path):
    done = _python(API_SCRIPT, str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]  # no TF/absl startup lines, no cuInit, no XNNPACK
    assert done.stdout == "['onnx', 'tflite'] 40\n"  # the tensorflow logger at ERROR


@pytest.mark.parametrize("how", ["TF_CPP_MIN_LOG_LEVEL=0", "show_library_logs()"])
def test_a_user_who_asks_for_the_logs_gets_them(tmp_path, how):
    env = _env(TF_CPP_MIN_LOG_LEVEL="0") if how.startswith("TF_") else _env()
    done = _python(API_SCRIPT, str(tmp_path / "out"), *([] if how.startswith("TF_") else ["show"]), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert TF_LINE.search(done.stderr), done.stderr[-3000:]  # TF's C++ lines
    assert XNNPACK in done.stderr
    assert done.stdout == "['onnx', 'tflite'] 30\n"  # the tensorflow logger left at its default


def test_tensorflow_imported_by_the_user_is_left_alone():
    code = ("import logging, os, sys\n"
            "import policy_export\n"
            "import tensorflow\n"
            "print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'), logging.getLogger('tensorflow').level,\n"
            "      any('policy_export' in type(f).__module__ for f in sys.meta_path))\n")
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["None", "0", "False"]  # no variable set, logger untouched, finder gone


def test_a_failing_tensorflow_import_reaches_the_user_and_stderr_comes_back(tmp_path):
    """A TensorFlow that fails while loading: its error propagates, what it wrote to descriptor 2
    is written out, and descriptor 2 is stderr again afterwards."""
    fake = tmp_path / "site" / "tensorflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os\nos.write(2, b'E0000 loader.cc:1] the reason it failed\\n')\n"
                                      "raise ImportError('this tensorflow cannot load')\n")
    code = ("import os, sys\n"
            "before = os.fstat(2).st_ino\n"
            "import policy_export\n"
            "try:\n"
            "    policy_export.TFPolicy\n"
            "except ImportError as e:\n"
            "    print('raised:', e)\n"
            "os.write(2, b'stderr is back\\n')\n"
            "print(os.fstat(2).st_ino == before)\n")
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    done = _python(code, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["raised: this tensorflow cannot load", "True"]
    assert done.stderr.splitlines() == ["E0000 loader.cc:1] the reason it failed", "stderr is back"]


def test_held_output_keeps_warnings_and_gives_everything_back_on_an_error(capfd, monkeypatch):
    from policy_export.exporter import quiet

    monkeypatch.setitem(quiet._state, "hide_runtime", True)
    with quiet.library_output():
        os.write(2, f"{XNNPACK}\nERROR: a real problem\n".encode())
    assert capfd.readouterr().err == "ERROR: a real problem\n"

    with pytest.raises(RuntimeError, match="boom"):
        with quiet.library_output():
            os.write(2, f"{XNNPACK}\n".encode())
            raise RuntimeError("boom")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == f"{XNNPACK}\nafter\n"  # all of it on an error; fd 2 put back

    monkeypatch.setitem(quiet._state, "hide_runtime", False)  # --debug, show_library_logs()
    with quiet.library_output():
        os.write(2, f"{XNNPACK}\n".encode())
    assert capfd.readouterr().err == f"{XNNPACK}\n"


def test_the_command_line_hides_litert_lines_unless_debug(tmp_path):
    out = str(tmp_path / "out")
    done = cli("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", out, "--formats", "tflite", "--samples", "8",
               "--explore-samples", "0", "--device", "cpu", "-q", isolated=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]
    done = cli("verify", out, "--device", "cpu", "-q", isolated=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]
    done = cli("verify", out, "--device", "cpu", "-q", "--debug", isolated=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert XNNPACK in done.stderr.splitlines()


def test_the_converter_summary_of_tensorflow_2_15_is_dropped_and_other_lines_kept():
    from policy_export.exporter.quiet import without_converter_summary

    lines = ["Summary on the non-converted ops:\n", "---------------------------------\n",
             " * Accepted dialects: tfl, builtin, func\n", "\n", "- tf.If:    1 occurrences  (i64: 1)\n",
             "  (f32: 2)\n", f"{XNNPACK}\n", "ERROR: a real problem\n", "- not the summary's\n"]
    assert without_converter_summary(lines) == ["ERROR: a real problem\n", "- not the summary's\n"]
