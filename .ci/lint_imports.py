"""Check the import contracts of pyproject.toml with import-linter.

The distribution maps the root folders ``exporter/``, ``policy/`` and ``signatures/`` into the one
import package ``policy_export`` (setuptools ``package-dir``), which import-linter cannot follow on
disk; so the package is laid out as it is installed, in a temporary directory, and linted there.

    python .ci/lint_imports.py            # exit 0 when every contract holds
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


def lint(plant: tuple[str, str] | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        lay_out(Path(tmp))
        if plant is not None:
            rel, line = plant
            source = next(k for k in LAYOUT if rel.startswith(k + "/"))
            file = Path(tmp) / LAYOUT[source] / rel[len(source) + 1:]
            file.write_text(file.read_text() + "\n" + line + "\n")
        env = {**os.environ, "PYTHONPATH": tmp}
        script = Path(sys.executable).with_name("lint-imports")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "importlinter.cli"]
        return subprocess.run([*command, str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp, env=env,
                              capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plant", nargs=2, metavar=("FILE", "LINE"), help="add LINE to FILE (repo-relative) first")
    args = parser.parse_args()
    proc = lint(tuple(args.plant) if args.plant else None)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
