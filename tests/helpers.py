"""Helpers the test modules share (never imported from another test module): the command line run
in-process or as a process, snapshots of a tree, one-line error checks, and an attacker's
re-signed manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "policy-export"


def cli(*args: str, cwd: Path | None = None, env_extra: dict | None = None,
        isolated: bool = False, narrow: bool = False) -> subprocess.CompletedProcess:
    """``policy-export ARGS``, in this process unless it needs one of its own; unwrapped (the
    suite's ``COLUMNS``: see conftest.py), or with ``narrow`` as through a person's pipe: no
    ``COLUMNS``, so 80 columns."""
    if not (isolated or cwd or env_extra or os.environ.get("POLICY_EXPORT_CLI_TESTS_IN_SUBPROCESS")):
        return _in_process(args, narrow)
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "policy_export"]
    dropped = ("TF_CPP_MIN_LOG_LEVEL", "GITHUB_STEP_SUMMARY", *(("COLUMNS",) if narrow else ()))
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(env_extra or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def _in_process(args, narrow: bool = False) -> subprocess.CompletedProcess:
    """``policy-export ARGS`` run by :func:`policy_export.exporter.cli.main` in this process, its
    stdout and stderr captured (as text, as a subprocess's would be)."""
    import contextlib
    import io

    from policy_export.exporter.cli import main

    out, err = io.StringIO(), io.StringIO()
    dropped = ("GITHUB_STEP_SUMMARY", *(("COLUMNS",) if narrow else ()))
    saved = {k: os.environ.pop(k) for k in dropped if k in os.environ}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: usage errors and --help
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.environ.update(saved)
    return subprocess.CompletedProcess(["policy-export", *args], code, out.getvalue(), err.getvalue())


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every entry under ``root`` (not following links) with its kind and content digest."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel.split("/")[0] in skip:
                continue
            st = os.lstat(full)
            if os.path.islink(full):
                out[rel] = "link:" + os.readlink(full)
            elif os.path.isfile(full):
                out[rel] = "file:" + hashlib.sha256(full.read_bytes()).hexdigest()
            elif os.path.isdir(full):
                out[rel] = "dir"
            else:
                out[rel] = f"special:{st.st_mode:o}"
    return out


def notes(stdout: str, label: str, width: int | None = None) -> list[str]:
    """The ``label: ...`` notes a command printed, each joined from its wrapped lines (a line that
    starts with a space continues the one above); with ``width``, every printed line of them fits
    it, but for one word (a path) longer than that, which is never split."""
    found: list[str] = []
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{label}: "):
            parts = [line]
            for more in lines[i + 1:]:
                if not more.startswith(" " * (len(label) + 2)):
                    break
                parts.append(more.strip())
            assert width is None or all(len(p) <= width or " " not in p.removeprefix(f"{label}: ").strip()
                                        for p in lines[i:i + len(parts)]), parts
            found.append(" ".join(parts))
    return found


def messages(stream: str) -> list[str]:
    """The messages of a command's stderr (or stdout), each joined from its lines: the command
    line wraps a message at the width (80 columns through a pipe) and a line that starts with a
    space continues the one above."""
    found: list[str] = []
    for line in stream.strip("\n").splitlines():
        if line.startswith(" ") and found:
            found[-1] += " " + line.strip()
        elif line.strip():
            found.append(line.rstrip())
    return found


def one_line_error(proc, code: int, fragment: str) -> None:
    """Exit ``code``, one message on stderr (wrapped at the width: see :func:`messages`) holding ``fragment``."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = messages(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def resign(export: Path) -> None:
    """Rewrite the manifest's file list for the files now present (what an attacker would do)."""
    doc = json.loads((export / "manifest.json").read_text())
    from policy_export.exporter import manifest

    doc["files"] = manifest.file_records(export)
    (export / "manifest.json").write_text(json.dumps(doc, indent=2))


def copy_of(exports, name: str, tmp_path: Path) -> Path:
    _, out = exports(name)
    copy = tmp_path / name
    shutil.copytree(out, copy)
    return copy


def verify_cli(*args: str, tmp_path: Path) -> tuple[int, dict]:
    """``policy-export verify`` in process; returns the exit code and the JSON report."""
    from policy_export.exporter.cli import main

    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*.json')))}.json"
    code = main(["verify", *args, "--device", "cpu", "--report-json", str(report)])
    return code, (json.loads(report.read_text()) if report.exists() else {})


def descendants(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, and theirs (read from ``/proc``)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{parent}\n" in status:
                found.append(int(entry.name))
                todo.append(int(entry.name))
    return found


def bypass_normaliser(model):
    """The consumer of the observation normaliser (the element-wise ops between the ``obs`` input
    and the first layer, against initializers) reads the raw observation instead."""
    initializers = {i.name for i in model.graph.initializer}
    value = model.graph.input[0].name
    chain = value
    while True:
        nxt = [n for n in model.graph.node if chain in n.input and n.op_type in ("Sub", "Div", "Mul", "Add")
               and all(i == chain or i in initializers for i in n.input)]
        if not nxt:
            break
        chain = nxt[0].output[0]
    assert chain != value, "no normaliser found"
    for node in model.graph.node:
        node.input[:] = [value if i == chain else i for i in node.input]
    return model
