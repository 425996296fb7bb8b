"""Everything a person reads fits the width: every command (each source kind for ``export`` and
``inspect``, ``--verbose``, ``rollout``, ``export-many`` with a failing policy, the signature
checks, ``docs``, a usage error) run through a pipe at 80 columns and on a pseudo-terminal of 80
columns. No line is wider, nothing is cut inside a word or a path (every word printed at 80
columns is a word the same command prints at 400), no line ends in a space, and every path is
printed as it was typed (relative here: the working directory never shows).

The commands run in two processes (the pipe run, then the terminal run), each calling the command
line in-process one command after another, so TensorFlow loads once per process."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR

WIDTH = 80
FAST = ["--samples", "20", "--explore-samples", "0"]
RUNNER = r'''
import contextlib, io, json, os, sys, time
from policy_export.exporter.cli import main

mode, commands, results = sys.argv[1:4]
done = []
for i, command in enumerate(json.load(open(commands))):
    if "copy" in command:  # not a command: files put where the next command reads them
        import shutil
        for source, target in command["copy"]:
            (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, target)
        done.append({"i": i, "columns": None, "code": 0, "stdout": "", "stderr": "", "seconds": 0.0})
        continue
    wide = mode == "pipe" and command.get("wide", True)
    for columns in (("400", None) if wide else (None,)):  # wide first: the reference
        saved = dict(os.environ)
        os.environ.pop("COLUMNS", None)
        if columns:
            os.environ["COLUMNS"] = columns
        os.environ.update(command.get("env", {}))
        start = time.perf_counter()
        if mode == "pipe":
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(command["argv"])
                except SystemExit as e:
                    code = e.code
            done.append({"i": i, "columns": columns, "code": code, "stdout": out.getvalue(),
                         "stderr": err.getvalue(), "seconds": time.perf_counter() - start})
        else:
            for stream in (sys.stdout, sys.stderr):
                stream.write(f"@@ {i}\n")
                stream.flush()
            try:
                code = main(command["argv"])
            except SystemExit as e:
                code = e.code
            sys.stdout.flush(); sys.stderr.flush()
            done.append({"i": i, "code": code, "seconds": time.perf_counter() - start})
        os.environ.clear()
        os.environ.update(saved)
json.dump(done, open(results, "w"))
'''
SGR = re.compile(r"\x1b\[[0-9;]*m")
CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n")


def _keys(folder: Path) -> None:
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (folder / "key.pem").write_bytes(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()))
    (folder / "key.pub").write_bytes(key.public_key().public_bytes(s.Encoding.PEM,
                                                                   s.PublicFormat.SubjectPublicKeyInfo))


def _workspace(root: Path) -> Path:
    """A working directory holding a copy of each kind of source, under short relative names."""
    ws = root / "ws"
    for name, src in {"spec": FIXTURES_DIR / "cartpole_mlp", "lstm": FIXTURES_DIR / "cartpole_lstm",
                      "ckpt": FIXTURES_DIR / "rllib" / "checkpoints" / "ppo_filter" / "checkpoint",
                      "newstack": FIXTURES_DIR / "rllib" / "newstack" / "ppo_discrete" / "checkpoint",
                      "sb3": FIXTURES_DIR / "sb3" / "ppo_cartpole",
                      "legacy": FIXTURES_DIR / "rllib" / "legacy" / "cartpole_ff" / "saved_model",
                      "foreign": FIXTURES_DIR / "foreign" / "torch_mlp_static"}.items():
        shutil.copytree(src, ws / name)
    (ws / "bad").mkdir()
    (ws / "bad" / "policy.json").write_text('{"format_version": 1, "name": "bad"}')
    shutil.copytree(ws / "spec", ws / "bad_weights")
    (ws / "bad_weights" / "weights.h5").unlink()
    _keys(ws)
    return ws


def _commands(signing: bool) -> list[dict]:
    """Every command, each source kind, as a person types them (relative paths)."""
    export = ["export", "--overwrite", *FAST]
    commands = [
        {"argv": [*export[:1], "spec", "--out", "out/mlp", "--formats", "saved_model,onnx,triton,tf_serving",
                  "--overwrite", "--samples", "20", "--explore-samples", "400"]},
        {"argv": [*export, "lstm", "--out", "out/lstm", "--formats", "onnx,onnx_int8", "--verbose"]},
        {"argv": [*export, "ckpt", "--out", "out/ckpt", "--formats", "onnx"]},
        {"argv": [*export, "newstack", "--out", "out/new", "--formats", "onnx"]},
        {"argv": [*export, "sb3/model.zip", "--out", "out/sb3", "--formats", "saved_model,onnx"]},
        {"argv": ["convert", "legacy", "--out", "out/legacy", "--formats", "onnx", "--overwrite", *FAST]},
        {"argv": [*export, "out/mlp", "--out", "out/re", "--formats", "triton"]},
        {"argv": ["verify", "out/mlp"], "env": {"GITHUB_STEP_SUMMARY": "summary.md"}},
        {"argv": ["verify", "out/lstm", "--verbose"]},
        {"argv": ["verify", "foreign/policy.onnx", "--reference", "foreign/reference.npz"]},
        *({"argv": ["inspect", path]} for path in ("spec", "ckpt", "newstack", "sb3/model.zip", "out/mlp",
                                                   "out/mlp/model.onnx", "out/mlp/saved_model", "out/re/triton/cartpole_mlp",
                                                   "out/mlp/tf_serving", "foreign/policy.onnx")),
        {"argv": ["diff", "out/mlp", "out/sb3"]},
        {"argv": ["diff", "out/mlp", "out/lstm"]},
        {"argv": ["rollout", "out/mlp", "--env", "CartPole-v1", "--episodes", "2"]},
        # two policies that fail before TensorFlow loads (a spec with no spaces, one whose weights are not there)
        {"argv": ["export-many", "bad", "bad_weights", "--out", "zoo", "--formats", "onnx", "--samples", "20",
                  "--explore-samples", "0", "--force", "--jobs", "2"]},
        {"argv": ["export", "spec"]},  # a usage error: one line
        {"argv": ["docs"]},
        {"argv": ["inspect", "--help"]},
        {"argv": ["export", "--help"]},
    ]
    if signing:
        commands += [
            {"argv": ["sign", "out/mlp", "--sign-key", "key.pem"]},
            {"argv": ["verify", "out/mlp", "--public-key", "key.pub"]},
            {"copy": [["out/mlp", "signed/mlp"], ["out/mlp.sig", "signed/mlp.sig"]]},
            # its layout checked at 80 columns and on a terminal (its words not against a run at 400: a
            # policy of its own process loads TensorFlow each time, so it runs once per mode)
            {"argv": ["verify-many", "signed", "--public-key", "key.pub"], "wide": False},
        ]
    return commands


def _run(mode: str, ws: Path, commands: list[dict]) -> tuple[list[dict], bytes, bytes]:
    """The commands run in one process: ``pipe`` (stdout and stderr captured, not terminals) or
    ``pty`` (each on a pseudo-terminal of 80 columns); the results, and the terminals' bytes."""
    (ws / "commands.json").write_text(json.dumps(commands))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "CI", "GITHUB_STEP_SUMMARY", "LINES")}
    argv = [sys.executable, "-c", RUNNER, mode, "commands.json", "results.json"]
    if mode == "pipe":
        done = subprocess.run(argv, cwd=ws, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((ws / "results.json").read_text()), b"", b""
    env.update(TERM="xterm-256color")
    masters, slaves = zip(*(os.openpty() for _ in range(2)))
    for fd in slaves:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, WIDTH, 0, 0))
    child = subprocess.Popen(argv, cwd=ws, env=env, stdin=subprocess.DEVNULL, stdout=slaves[0], stderr=slaves[1])
    for fd in slaves:
        os.close(fd)
    data, open_fds = {fd: b"" for fd in masters}, set(masters)
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [], 1.0)
        for fd in ready:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # EIO: the child closed its side
                chunk = b""
            if chunk:
                data[fd] += chunk
            else:
                open_fds.discard(fd)
        if not ready and child.poll() is not None:
            break
    assert child.wait(timeout=900) == 0, data[masters[1]][-3000:]
    for fd in masters:
        os.close(fd)
    return json.loads((ws / "results.json").read_text()), data[masters[0]], data[masters[1]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(workspace, commands, pipe results by command index and width, terminal stdout and stderr
    by command index, terminal results)."""
    from policy_export.exporter.compat import missing_modules

    ws = _workspace(tmp_path_factory.mktemp("width"))
    commands = _commands(signing=not missing_modules(("model_signing", "OpenSSL")))
    piped, _, _ = _run("pipe", ws, commands)
    by_width = {(r["i"], r["columns"]): r for r in piped}
    for made in ("zoo", "signed"):
        shutil.rmtree(ws / made, ignore_errors=True)
    terminal, out, err = _run("pty", ws, commands)
    return ws, commands, by_width, _split(out), _split(err), terminal


def _split(raw: bytes) -> dict[int, str]:
    """A terminal's bytes by command (the runner writes ``@@ i`` before each)."""
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
    parts = re.split(r"@@ (\d+)\n", text)  # after a live display's control codes, too
    return {int(parts[k]): parts[k + 1] for k in range(1, len(parts) - 1, 2)}


def _tokens(text: str) -> set[str]:
    """The words of ``text``: numbers as ``#`` and digests as ``<hex>`` (timings and the exports'
    digests differ from run to run), a table's rule as ``─``."""
    return {"─" if set(t) == {"─"} else re.sub(r"\d+", "#", re.sub(r"[0-9a-f]{16,}", "<hex>", t))
            for t in SGR.sub("", text).split()}


def _left_out_notes(lines: list[str]) -> set[int]:
    """The lines of ``left out: ...`` notes (a table's columns left out at this width)."""
    skip, inside = set(), False
    for n, line in enumerate(lines):
        inside = line.startswith("left out: ") or (inside and line.startswith(" "))
        if inside:
            skip.add(n)
    return skip


def _check_text(text: str, wide: str, where: str, terminal: bool = False) -> None:
    lines = SGR.sub("", text).splitlines()
    long = [line for line in lines if len(line) > WIDTH]
    assert not long, f"{where}: lines wider than {WIDTH}:\n" + "\n".join(long)
    trailing = [line for line in lines if line != line.rstrip()]
    assert not trailing, f"{where}: lines ending in a space: {trailing}"
    assert "…" not in text, where
    known = _tokens(wide)
    skip = _left_out_notes(lines)
    cut = {t for n, line in enumerate(lines) if n not in skip for t in _tokens(line)} - known
    assert not cut, f"{where}: words not printed at 400 columns (cut?): {sorted(cut)}\n{text}"


def _name(commands, i: int) -> str:
    return "policy-export " + " ".join(commands[i].get("argv", ["(copy)"]))


def test_every_command_fits_80_columns_through_a_pipe(runs):
    ws, commands, by_width, _, _, _ = runs
    for i in range(len(commands)):
        narrow = by_width[(i, None)]
        wide = by_width.get((i, "400"), narrow)  # run once: its words are its own
        assert narrow["code"] == wide["code"], (_name(commands, i), narrow["stderr"])
        for stream in ("stdout", "stderr"):
            _check_text(narrow[stream], wide[stream], f"{_name(commands, i)} ({stream})")
        assert max((len(line) for line in wide["stdout"].splitlines()), default=0) > 0 or not narrow["stdout"]


def test_every_command_fits_a_terminal_of_80_columns(runs):
    ws, commands, by_width, out, err, terminal = runs
    for i in range(len(commands)):
        name = _name(commands, i)
        assert terminal[i]["code"] == by_width[(i, None)]["code"], name
        reference = by_width.get((i, "400"), by_width[(i, None)])["stdout"]
        _check_text(out.get(i, ""), reference, f"{name} (terminal stdout)", terminal=True)
        # stderr: the live display redraws its lines; no piece of it between two control codes is wider
        pieces = [p for p in CONTROL.split(SGR.sub("", err.get(i, ""))) if p]
        assert all(len(p) <= WIDTH for p in pieces), (name, [p for p in pieces if len(p) > WIDTH])


def _screen(text: str, rows: int = 50) -> list[str]:
    """What a terminal of :data:`WIDTH` columns and ``rows`` rows shows once ``text`` (a live
    display's frames) is written: lines scroll into the history, moving up stops at the top row."""
    history, view, row, col = [], [[] for _ in range(rows)], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", SGR.sub("", text)):
        if token == "\r":
            col = 0
        elif token == "\n":
            col = 0
            if row == rows - 1:
                history.append("".join(view.pop(0)))
                view.append([])
            else:
                row += 1
        elif token.startswith("\x1b["):
            code, arg = token[-1], token[2:-1]
            if code == "A":
                row = max(0, row - int(arg or 1))
            elif code == "K":
                view[row] = [] if arg == "2" else view[row][:col]
        else:
            line = view[row]
            line.extend(" " * (col - len(line)))
            line[col:col + 1] = [token]
            col += 1
    return [line.rstrip() for line in history + ["".join(v) for v in view] if line.strip()]


def test_a_terminal_says_at_once_what_the_first_seconds_go_to_and_draws_each_stage_once(runs):
    """The first export's live display starts with ``load TensorFlow``; once it is done, each
    stage of an export (the LSTM's too) is on the screen once."""
    ws, commands, _, _, err, _ = runs
    first = _screen(err[0])
    assert first[0].startswith("✓ load TensorFlow"), first
    lstm = next(i for i, c in enumerate(commands) if "lstm" in c.get("argv", []) and c["argv"][0] == "export")
    for i in (0, lstm):
        shown = [line.split()[1:-2] for line in _screen(err[i]) if line.startswith("✓ ")]
        names = [" ".join(n).split(" ━")[0] for n in shown]
        assert len(names) == len(set(names)) and "write manifest" in names[-1], _screen(err[i])


def test_paths_are_printed_as_typed(runs):
    """Every path was typed relative: the working directory (and the checkout the fixtures came
    from) never shows, in any command's output, through a pipe or on a terminal."""
    ws, commands, by_width, out, err, _ = runs
    absolute = (str(ws), str(ws.resolve()), str(FIXTURES_DIR))
    for (i, columns), r in by_width.items():
        for stream in ("stdout", "stderr"):
            text = " ".join(r[stream].split())
            assert not any(a in r[stream] for a in absolute), (_name(commands, i), columns, r[stream])
            assert not any(a in text for a in absolute)
    for i, text in {**out, **err}.items():
        assert not any(a in text for a in absolute), (_name(commands, i), text)
    exported = by_width[(0, None)]["stdout"]
    assert "exported out/mlp: saved_model, onnx, triton, tf_serving (" in " ".join(exported.split())
    assert "full table: --verbose, or out/mlp/parity/report.json" in exported


def _flat(text: str) -> str:
    return " ".join(SGR.sub("", text).split())


def test_what_was_checked_is_said(runs):
    ws, commands, by_width, _, _, _ = runs
    index = {tuple(c.get("argv", ())): i for i, c in enumerate(commands)}

    def out(*argv: str) -> str:
        return _flat(by_width[(index[argv], None)]["stdout"])

    # a bit-identical format's line shows its error, 0, not the p-value of its sampling test
    verdict = by_width[(0, None)]["stdout"].splitlines()
    saved_model = next(line for line in verdict if line.startswith("saved_model "))
    assert saved_model.split()[2] == "0" and "p " not in saved_model, saved_model
    # the step summary's heading names what was verified
    assert (ws / "summary.md").read_text().startswith("### verify out/mlp: passed")
    # two policies with the same interface: the weights differ
    assert "weights: differ" in out("diff", "out/mlp", "out/sb3")
    # the re-export keeps the policy's name, in the manifest and as the Triton model
    manifest = json.loads((ws / "out" / "re" / "manifest.json").read_text())
    assert manifest["name"] == "cartpole_mlp" and (ws / "out" / "re" / "triton" / "cartpole_mlp").is_dir()
    if ("verify", "out/mlp", "--public-key", "key.pub") in index:
        assert "verified out/mlp: the signature matches, files match the manifest" in out(
            "verify", "out/mlp", "--public-key", "key.pub")
        assert "signatures checked: 1 of 1 match" in out("verify-many", "signed", "--public-key", "key.pub")


def test_export_many_names_the_failed_policy_in_full(runs):
    ws, commands, by_width, _, _, _ = runs
    i = next(i for i, c in enumerate(commands) if c.get("argv", [""])[0] == "export-many")
    narrow = by_width[(i, None)]
    assert narrow["code"] == 1
    text = _flat(narrow["stdout"])
    assert "bad failed: SpecError: invalid policy spec bad/policy.json" in text
    assert "bad_weights failed: " in text and "2 of 2 policies failed: bad, bad_weights" in text


def test_a_usage_error_is_one_line(runs):
    ws, commands, by_width, _, _, _ = runs
    i = next(i for i, c in enumerate(commands) if c.get("argv") == ["export", "spec"])
    narrow = by_width[(i, None)]
    assert narrow["code"] == 2 and narrow["stdout"] == ""
    assert _flat(narrow["stderr"]) == ("policy-export export: error: the following arguments are required: --out "
                                       "(usage: policy-export export --help)")
