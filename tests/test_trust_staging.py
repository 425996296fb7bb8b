"""Staging replaces only what is the tool's, survives a kill at every step, and never loses a signal.

Each case checks the exit code or exception, the one-line message, and that nothing outside the
tool's own files changed (a snapshot of the test directory before and after).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR, default_signals
from policy_export.exporter.staging import check_target, lock_path, staged_directory
from policy_export.policy import ExportError
from helpers import cli, messages, snapshot

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--formats", "saved_model", "--samples", "8", "--explore-samples", "0", "-q"]


@pytest.fixture(scope="module")
def small_export(tmp_path_factory) -> Path:
    """One small export (cartpole_mlp, SavedModel only, 8 samples) that the tests copy."""
    from policy_export.exporter import export_spec

    out = tmp_path_factory.mktemp("staging") / "small"
    export_spec(FIXTURES_DIR / "cartpole_mlp", out, device="cpu", formats=["saved_model"], samples=8,
                explore_samples=0)
    return out


def run_main(*args: str, cwd: Path | None = None) -> tuple[int, list[str], bool]:
    """``main(args)`` in a fresh interpreter: (exit code, stderr lines, whether TensorFlow was imported)."""
    code = ("import sys; from policy_export.exporter.cli import main; rc = main(sys.argv[1:]); "
            "print('TF' if 'tensorflow' in sys.modules else 'noTF'); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd or ROOT)
    return proc.returncode, messages(proc.stderr), proc.stdout.strip().splitlines()[-1] == "TF"


# ------------------------------------------------------------------------ 1. only what is ours


def test_overwrite_refuses_a_users_directory_holding_a_copy_of_a_manifest_before_tensorflow(tmp_path, small_export):
    home = tmp_path / "thesis"
    (home / "src").mkdir(parents=True)
    shutil.copy(small_export / "manifest.json", home / "manifest.json")
    (home / "thesis.tex").write_text("\\chapter{Results}")
    (home / "src" / "main.c").write_text("int main(){}")
    before = snapshot(tmp_path)
    code, err, tf = run_main("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(home), "--overwrite", *SMALL)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"policy-export: error: refusing to replace {home}: 'src' is not a file of its export "
                      "(remove it or choose another --out)")
    assert not tf  # refused before TensorFlow was imported
    assert snapshot(tmp_path) == before


def test_a_file_added_to_a_real_export_or_a_changed_file_is_never_replaced(tmp_path, small_export):
    out = tmp_path / "exp"
    shutil.copytree(small_export, out)
    (out / "saved_model" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    with pytest.raises(ExportError) as info:
        with staged_directory(out, overwrite=True) as stage:
            (stage / "x").write_text("new")
    assert str(info.value) == (f"refusing to replace {out}: 'saved_model/notes.txt' is not a file of its export "
                               "(remove it or choose another --out)")
    assert snapshot(tmp_path) == before
    (out / "saved_model" / "notes.txt").unlink()
    with (out / "parity" / "inputs.npz").open("ab") as f:
        f.write(b"edited")
    before = snapshot(tmp_path)
    with pytest.raises(ExportError, match=r"'parity/inputs.npz' was changed since it was exported"):
        check_target(out, overwrite=True)
    assert snapshot(tmp_path) == before


def test_a_foreign_file_added_while_the_export_runs_is_caught_before_the_rename(tmp_path, small_export):
    out = tmp_path / "exp"
    shutil.copytree(small_export, out)
    with pytest.raises(ExportError, match="'late.txt' is not a file of its export"):
        with staged_directory(out, overwrite=True) as stage:
            (stage / "x").write_text("new")
            (out / "late.txt").write_text("written during the export")
    assert (out / "late.txt").read_text() == "written during the export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_an_empty_directory_and_an_unchanged_export_are_replaced(tmp_path, small_export):
    empty = tmp_path / "empty"
    empty.mkdir()
    with staged_directory(empty, overwrite=True) as stage:
        (stage / "a").write_text("new")
    out = tmp_path / "exp"
    shutil.copytree(small_export, out)
    with staged_directory(out, overwrite=True) as stage:
        (stage / "b").write_text("new")
    assert [p.name for p in empty.iterdir()] == ["a"] and [p.name for p in out.iterdir()] == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "exp"]


# ------------------------------------------------------------------------ 4. path lengths


def test_a_name_over_name_max_or_a_path_over_path_max_is_refused_before_tensorflow(tmp_path):
    long = tmp_path / ("n" * 256)
    code, err, tf = run_main("export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(long), *SMALL)
    assert code == 2 and len(err) == 1 and not tf, err
    assert "is 256 bytes, longer than the 255-byte limit of a file name; choose a shorter --out" in err[0]
    deep = tmp_path.joinpath(*["d" * 200] * 21)
    with pytest.raises(ExportError, match="too long for a path"):
        check_target(deep, overwrite=False)
    assert list(tmp_path.iterdir()) == []


def test_a_255_byte_name_can_be_exported_and_replaced(tmp_path, small_export):
    out = tmp_path / ("é" * 127 + "x")  # 255 bytes in UTF-8
    assert len(os.fsencode(out.name)) == 255
    for generation in (1, 2):
        with staged_directory(out, overwrite=True) as stage:
            shutil.copytree(small_export, stage, dirs_exist_ok=True)
            assert len(os.fsencode(stage.name)) < 40 and len(os.fsencode(lock_path(out).name)) < 40
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    check_target(out, overwrite=True)  # still a complete export of its own


# ------------------------------------------------------------------------ 2. every crash point

CRASH_SCRIPT = textwrap.dedent(r'''
    import json, os, shutil, sys
    from pathlib import Path
    from policy_export.exporter import staging

    old_src, new_src, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    OPS = ("rename", "replace", "mkdir", "rmdir", "unlink", "fsync", "write")

    def tree(root):
        if not os.path.lexists(root):
            return None
        return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else b"") for p in root.rglob("*"))

    OLD, NEW = tree(old_src), tree(new_src)

    def state():
        t = tree(out)
        return "old" if t == OLD else "new" if t == NEW else "missing" if t is None else "other"

    def leftovers():
        return sorted(p for p in os.listdir(out.parent) if p != out.name)

    results = []
    for fresh in (False, True):
        for when in ("before", "after"):
            n = 0
            while True:
                n += 1
                shutil.rmtree(out, ignore_errors=True)
                if not fresh:
                    shutil.copytree(old_src, out)
                pid = os.fork()
                if pid == 0:
                    count = [0]
                    def wrap(name, real):
                        def op(*a, **k):
                            count[0] += 1
                            if count[0] == n and when == "before":
                                os._exit(9)
                            try:
                                return real(*a, **k)
                            finally:  # after the call, whether it succeeded or raised
                                if count[0] == n:
                                    os._exit(9)
                        return op
                    for name in OPS:
                        setattr(os, name, wrap(name, getattr(os, name)))
                    try:
                        with staging.staged_directory(out, overwrite=True) as stage:
                            for item in sorted(new_src.iterdir()):
                                (shutil.copytree if item.is_dir() else shutil.copy2)(item, stage / item.name)
                    except BaseException:
                        os._exit(3)
                    os._exit(0)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                crashed = state()
                staging.check_target(out, overwrite=True)  # recovery before any work
                checked = state()
                try:
                    with staging.staged_directory(out, overwrite=True):
                        raise LookupError  # the next export fails: it must still leave only OUT
                except LookupError:
                    pass
                results.append({"fresh": fresh, "when": when, "n": n, "code": code, "crashed": crashed,
                                "checked": checked, "final": state(), "leftovers": leftovers()})
                if code != 9:
                    break
    print(json.dumps(results))
''')


def test_a_kill_at_any_step_leaves_the_old_or_the_new_export_after_recovery(tmp_path, small_export):
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(small_export, old)
    shutil.copytree(small_export, new)
    doc = json.loads((new / "manifest.json").read_text())
    (new / "manifest.json").write_text(json.dumps({**doc, "generation": 2}))
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(old), str(new), str(work / "out")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    for r in results:
        assert r["code"] in (9, 0), r
        assert r["crashed"] in (("missing", "new") if r["fresh"] else ("old", "new", "missing")), r
        expected = ("missing", "new") if r["fresh"] else ("old", "new")
        assert r["checked"] in expected and r["final"] == r["checked"] and r["leftovers"] == [], r
    replaced = [r for r in results if not r["fresh"]]
    between = [r for r in replaced if r["crashed"] == "missing"]
    assert between and all(r["checked"] == "old" for r in between)  # put back before any work
    assert {r["checked"] for r in replaced if r["code"] == 9} == {"old", "new"}
    assert all(r["checked"] == "new" for r in results if r["code"] == 0)
    for fresh in (False, True):  # every write, rename, unlink and fsync, before it and after it
        assert min(len([r for r in results if r["fresh"] == fresh and r["when"] == when and r["code"] == 9])
                   for when in ("before", "after")) > (20 if not fresh else 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crash.py", "new", "old", "work"]


# ------------------------------------------------------------------------ 3. signals never lost

SIGNAL_SCRIPT = textwrap.dedent(r'''
    import json, os, shutil, signal, subprocess, sys
    from pathlib import Path
    from policy_export.exporter import cli, commands, manifest, staging

    spec, old_src, base = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    real_write, real_emit, real_rmtree, real_rename = (manifest.write_manifest, commands._emit_reports,
                                                       shutil.rmtree, os.rename)
    SIG = {"TERM": signal.SIGTERM, "INT": signal.SIGINT, "HUP": signal.SIGHUP}

    class Raiser:
        def __init__(self, sig):
            self.sig = sig
        def __del__(self):
            signal.raise_signal(self.sig)  # the handler's exception is swallowed by __del__

    def hooks(case):
        where, sig = case.split(":")[:2]
        sig = SIG[sig]
        manifest.write_manifest, commands._emit_reports, shutil.rmtree, os.rename = (real_write, real_emit,
                                                                                  real_rmtree, real_rename)
        if where == "del":
            def write(*a, **k):
                Raiser(sig)
                return real_write(*a, **k)
            manifest.write_manifest = write
        elif where == "catchall":
            def write(*a, **k):
                try:
                    signal.raise_signal(sig)
                except BaseException:
                    pass
                return real_write(*a, **k)
            manifest.write_manifest = write
        elif where == "then-int":  # SIGTERM, then SIGINT while cleaning up
            def write(*a, **k):
                signal.raise_signal(sig)
            def rmtree(*a, **k):
                os.kill(os.getpid(), signal.SIGINT)
                return real_rmtree(*a, **k)
            manifest.write_manifest, shutil.rmtree = write, rmtree
        elif where == "rename":  # during the renames (signals are held there)
            def rename(src, dst, *a, **k):
                if str(dst).endswith(".old"):  # the old export set aside: the first of the two renames
                    os.kill(os.getpid(), sig)
                return real_rename(src, dst, *a, **k)
            os.rename = rename
        elif where == "after":  # after the export is in place
            def emit(*a, **k):
                signal.raise_signal(sig)
                signal.raise_signal(signal.SIGINT)
                return real_emit(*a, **k)
            commands._emit_reports = emit

    cases = sys.argv[4:]
    results = []
    for i, case in enumerate(cases):
        work = base / f"w{i}"
        work.mkdir()
        out = work / "out"
        shutil.copytree(old_src, out)
        hooks(case)
        import io, contextlib
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(["export", spec, "--out", str(out), "--overwrite", "--formats", "saved_model",
                             "--samples", "8", "--explore-samples", "0", "-q"])
        hooks("none:TERM")
        results.append({"case": case, "code": code, "stderr": err.getvalue(),
                        "handlers": [signal.getsignal(s) is d for s, d in
                                     ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler))],
                        "listing": sorted(os.listdir(work))})
    print(json.dumps(results))
''')


def test_a_signal_is_never_lost_swallowed_repeated_or_after_the_rename(tmp_path, small_export):
    cases = ["del:TERM", "del:INT", "catchall:TERM", "catchall:HUP", "then-int:TERM", "rename:TERM", "after:TERM"]
    script = tmp_path / "signals.py"
    script.write_text(SIGNAL_SCRIPT)
    base = tmp_path / "runs"
    base.mkdir()
    proc = subprocess.run([sys.executable, str(script), str(FIXTURES_DIR / "cartpole_mlp"), str(small_export),
                           str(base), *cases], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          preexec_fn=default_signals)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["case"]: r for r in json.loads(proc.stdout)}
    names = {"TERM": "SIGTERM", "INT": "SIGINT", "HUP": "SIGHUP"}
    old = snapshot(small_export)
    for i, case in enumerate(cases):
        r, out = results[case], base / f"w{i}" / "out"
        assert r["listing"] == ["out"] and r["handlers"] == [True, True], r
        lines = r["stderr"].strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r["stderr"] and "Exception ignored" not in r["stderr"], r
        sig = names[case.split(":")[1]]
        if case.split(":")[0] in ("rename", "after"):  # the export was complete: it stays, and says so
            assert r["code"] == 0, r
            assert lines[0] == f"policy-export: interrupted by {sig} after the export was complete"
            assert snapshot(out) != old and check_target(out, overwrite=True) is None
        else:
            assert r["code"] == 130, r
            assert lines[0] == f"policy-export: interrupted by {sig}; no partial export was left behind"
            assert snapshot(out) == old  # the previous export untouched


@pytest.mark.slow
@pytest.mark.parametrize("run", range(4))
def test_sigterm_at_a_random_time_leaves_the_old_export_or_a_complete_new_one(tmp_path, small_export, run):
    out = tmp_path / "out"
    shutil.copytree(small_export, out)
    old = snapshot(out)
    proc = subprocess.Popen([sys.executable, "-m", "policy_export", "export", str(FIXTURES_DIR / "cartpole_mlp"),
                             "--out", str(out), "--overwrite", "--formats", "saved_model,onnx", "--samples", "8",
                             "--explore-samples", "0", "-q"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    try:  # the signal at a random time, unless the export has finished by then (nothing to signal)
        proc.wait(timeout=random.Random(run).uniform(0.5, 6.0))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM if run % 2 else signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    lines = messages(stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], stderr
    if proc.returncode == 130:
        assert len(lines) == 1 and "no partial export was left behind" in lines[0], stderr
        assert snapshot(out) == old
    else:
        assert proc.returncode == 0, stderr
        assert len(lines) <= 1 and all("after the export was complete" in line for line in lines), stderr
        assert snapshot(out) != old
        verify = cli("verify", str(out), "-q")  # in process: the new export is checked, not the process
        assert verify.returncode == 0, verify.stderr


def test_an_error_a_swallowed_signal_left_behind_is_reported_as_the_interrupt(monkeypatch, capsys):
    """A signal whose interrupt a library swallowed (TensorFlow, inside its own try/except), the
    library then failing in the state it left: one line, the interrupt's, exit 130."""
    import signal

    from policy_export.exporter import cli, commands, staging

    def command(args, console):
        staging._session.pending = signal.SIGTERM  # what the handler records when its interrupt is swallowed
        raise AttributeError("'tuple' object has no attribute '_type_spec'")

    monkeypatch.setattr(commands, "cmd_inspect", command)
    assert cli.main(["inspect", "anything"]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["policy-export: interrupted by SIGTERM; no partial export was left behind"]
