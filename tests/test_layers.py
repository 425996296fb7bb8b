"""The package's structure, as tools check it: import-linter's contracts (pyproject.toml) hold and
catch a back-import; functions stay small."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import ROOT

LINT = ROOT / ".ci" / "lint_imports.py"
MAX_LINES, MAX_PARAMS = 60, 8
MIRROR = "mirrors RLlib"  # a comment on a def's line or the one above: the signature mirrors RLlib's


def lint(*plant: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LINT), *(("--plant", *plant) if plant else ())],
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    proc = lint()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 7 kept, 0 broken." in proc.stdout
    assert "Import cycles (type-only imports included): 0" in proc.stdout


def test_a_planted_type_only_cycle_is_found():
    """A module imported lazily by another imports it back for type checking only: still a cycle."""
    proc = lint("exporter/formats/tflite/interpreter.py",
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from policy_export.exporter.formats.tflite import convert")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Contracts: 7 kept, 0 broken." in proc.stdout  # no layer broken: the cycle is what fails
    assert ("import cycle: policy_export.exporter.formats.tflite.convert -> "
            "policy_export.exporter.formats.tflite.interpreter -> policy_export.exporter.formats.tflite.convert"
            in proc.stdout), proc.stdout


@pytest.mark.parametrize("file, line, broken", [
    ("policy/spaces.py", "from policy_export.exporter import cli", "policy and signatures import nothing from"),
    ("exporter/formats/base.py", "from policy_export.exporter.parity import replay", "exporter layers"),
    ("exporter/manifest.py", "import policy_export.exporter.staging", "exporter layers"),
    ("exporter/sources/spec_dir.py", "from policy_export.exporter.formats import onnx",
     "the wings: sources and formats are independent"),
    ("exporter/parity/compare.py", "from policy_export.exporter.formats.onnx import model",
     "parity imports no format family's own module"),
    ("exporter/many/work.py", "import policy_export.exporter.sources.rllib_checkpoint",
     "the command line and many policies reach sources only through the registry"),
])
def test_a_planted_back_import_breaks_a_contract(file, line, broken):
    proc = lint(file, line)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{broken}" in proc.stdout and "BROKEN" in proc.stdout


def _functions():
    for folder in ("exporter", "policy", "signatures", "policy_export"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield path.relative_to(ROOT), node, lines


def test_functions_are_at_most_60_lines_and_8_parameters():
    too_long, too_many = [], []
    for path, node, lines in _functions():
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        if node.end_lineno - start + 1 > MAX_LINES:
            too_long.append(f"{path}:{node.lineno} {node.name} ({node.end_lineno - start + 1} lines)")
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]
        count = len([p for p in params if p.arg not in ("self", "cls")])
        mirrored = any(MIRROR in lines[i] for i in (node.lineno - 2, node.lineno - 1) if i >= 0)
        if count > MAX_PARAMS and not mirrored:
            too_many.append(f"{path}:{node.lineno} {node.name} ({count} parameters)")
    assert not too_long and not too_many, "\n".join(too_long + too_many)
