"""Check the import contracts of pyproject.toml with import-linter, and that the import graph has
no cycle (imports made only for type checking included).

The distribution maps the root folders ``exporter/``, ``policy/`` and ``signatures/`` into the one
import package ``policy_export`` (setuptools ``package-dir``), which import-linter cannot follow on
disk; so the package is laid out as it is installed, in a temporary directory, and linted there.

    python .ci/lint_imports.py            # exit 0 when every contract holds and no cycle is found
    python .ci/lint_imports.py --plant policy/spaces.py "from policy_export.exporter import cli"
                                          # the same, with one line added to a copied file
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = {"policy_export": "policy_export", "exporter": "policy_export/exporter", "policy": "policy_export/policy",
          "signatures": "policy_export/signatures"}


def lay_out(target: Path) -> Path:
    """Copy the package's sources to ``target`` as they are installed; returns the package's directory."""
    for source, dest in LAYOUT.items():
        shutil.copytree(ROOT / source, target / dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target / "policy_export"


def _plant(tmp: Path, plant: tuple[str, str] | None) -> None:
    """Lay the package out in ``tmp``, with ``plant`` (a repo-relative file, a line) added."""
    lay_out(tmp)
    if plant is not None:
        rel, line = plant
        source = next(k for k in LAYOUT if rel.startswith(k + "/"))
        file = tmp / LAYOUT[source] / rel[len(source) + 1:]
        file.write_text(file.read_text() + "\n" + line + "\n")


def lint(plant: tuple[str, str] | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        _plant(Path(tmp), plant)
        env = {**os.environ, "PYTHONPATH": tmp}
        script = Path(sys.executable).with_name("lint-imports")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "importlinter.cli"]
        return subprocess.run([*command, str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp, env=env,
                              capture_output=True, text=True)


CYCLES = """
import sys
import grimp
graph = grimp.build_graph("policy_export", exclude_type_checking_imports=False)
seen, found = set(), []
for importer in sorted(graph.modules):
    for imported in sorted(graph.find_modules_directly_imported_by(importer)):
        chain = graph.find_shortest_chain(importer=imported, imported=importer) if imported != importer else None
        if chain and frozenset(chain) not in seen:
            seen.add(frozenset(chain))
            found.append(" -> ".join((importer, *chain)))
for line in found:
    print("import cycle:", line)
print(f"Import cycles (type-only imports included): {len(found)}")
sys.exit(1 if found else 0)
"""


def cycles(plant: tuple[str, str] | None = None) -> subprocess.CompletedProcess:
    """Every import cycle among the package's modules (grimp, import-linter's graph), one line each."""
    with tempfile.TemporaryDirectory() as tmp:
        _plant(Path(tmp), plant)
        return subprocess.run([sys.executable, "-c", CYCLES], cwd=tmp, env={**os.environ, "PYTHONPATH": tmp},
                              capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plant", nargs=2, metavar=("FILE", "LINE"), help="add LINE to FILE (repo-relative) first")
    args = parser.parse_args()
    plant = tuple(args.plant) if args.plant else None
    code = 0
    for proc in (lint(plant), cycles(plant)):
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        code = code or proc.returncode
    return code


if __name__ == "__main__":
    sys.exit(main())
