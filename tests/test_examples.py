"""Every file in examples/ runs, and prints what the docs say it prints.

Shell scripts run with bash, Python files with this interpreter; each writes under ``tmp_path``
(its one argument), with this environment's ``policy-export`` first on ``PATH``. The docs quote
or link every example, and a quoted copy must be the file itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

EXAMPLES = ROOT / "examples"
RUNNERS = {".sh": ["bash"], ".py": [sys.executable]}
# what each example must print (whitespace collapsed), besides exiting 0
EXPECTED = {
    "export_verify.sh": ["exported", "saved_model, onnx", "files match the manifest, every format matches"],
    "ci_gate.sh": ["files match the manifest, every format matches", "compatible:",
                   "no change to any input or output", "BREAKING:", "dtype changed from int64 to float32",
                   "diff exit code: 1"],
    "rllib_checkpoint.sh": ["PPOTF1Policy", "MeanStdFilter (n=209)", "actions: environment",
                            "policy default_policy: parity", "exported"],
    "python_api.py": ["parity passed: True", "verify passed: True", "required inputs: ['observations']",
                      "actions: ["],
}


def _examples() -> list[str]:
    return sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in RUNNERS)


def _docs() -> dict[str, str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in pages}


def _run(name: str, out: Path) -> subprocess.CompletedProcess:
    path = EXAMPLES / name
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               CI="1", TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([*RUNNERS[path.suffix], str(path), str(out)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", _examples())
def test_example_runs_and_prints_what_the_docs_say(name, tmp_path):
    proc = _run(name, tmp_path)
    printed = " ".join(proc.stdout.split())
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    missing = [text for text in EXPECTED[name] if text not in printed]
    assert not missing, f"{name} did not print {missing}:\n{proc.stdout[-3000:]}"
    if name == "ci_gate.sh":  # the reports a CI keeps
        contract = json.loads((tmp_path / "gate" / "contract.json").read_text())
        assert [i["key"] for i in contract["inputs"] if i["required"]] == ["observations"]
        assert 'failures="0"' in (tmp_path / "gate" / "verify.xml").read_text()
        assert json.loads((tmp_path / "gate" / "verify.json").read_text())["passed"] is True
    if name == "rllib_checkpoint.sh":
        manifest = json.loads((tmp_path / "ppo_filter" / "manifest.json").read_text())
        assert manifest["contract"]["observation_filter"]["class"] == "MeanStdFilter"
        assert manifest["parity"]["passed"] is True


def test_every_example_has_its_expectations():
    assert set(_examples()) == set(EXPECTED), "add the new example's expected output to EXPECTED"


def test_the_docs_show_every_example():
    docs = "\n".join(_docs().values())
    assert not [name for name in _examples() if f"examples/{name}" not in docs]


def test_quoted_examples_are_the_files_themselves():
    """A fenced block after a paragraph that links an example and ends in ':' is that file verbatim."""
    quoted = 0
    for page, text in _docs().items():
        for target, block in re.findall(r"\]\(((?:\.\./)?examples/[\w.-]+)\)[^\n]*(?:\n[^\n]+)*?:\n\n```\w*\n(.*?)```\n",
                                        text, re.S):
            assert block == (ROOT / page).parent.joinpath(target).read_text(), f"{page} quotes a stale {target}"
            quoted += 1
    assert quoted >= 1
