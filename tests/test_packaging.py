"""One import package, ``policy_export``; nothing else lands at the top level of an environment."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from conftest import ROOT


def test_every_installed_package_lives_under_policy_export():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]
    assert packages[0] == "policy_export"
    assert all(p == "policy_export" or p.startswith("policy_export.") for p in packages)
    assert config["project"]["scripts"]["policy-export"] == "policy_export.exporter.cli:console_main"


def test_every_source_package_is_installed():
    """A wheel holds only the packages listed: every folder of the sources with an ``__init__.py`` must be."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    dirs = config["tool"]["setuptools"]["package-dir"]
    found = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == listed


def test_installed_import_name_and_no_top_level_collisions(tmp_path):
    # a user's own project with modules named like the repo folders, run from its own directory
    (tmp_path / "policy.py").write_text("NAME = 'the user policy'\n")
    (tmp_path / "exporter").mkdir()
    (tmp_path / "exporter" / "__init__.py").write_text("NAME = 'the user exporter'\n")
    code = (
        "import importlib.util, sys\n"
        "import policy, exporter\n"
        "import policy_export\n"
        "from policy_export import PolicyExportError, load_spec\n"
        "from policy_export.exporter.cli import build_parser\n"
        "build_parser()\n"
        "print(policy.NAME, '|', exporter.NAME, '|', importlib.util.find_spec('signatures'), '|',\n"
        "      'tensorflow' in sys.modules, '|', load_spec.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("the user policy | the user exporter | None | False | "
                                  "policy_export.policy.spec")


def test_public_api_names_resolve():
    import policy_export

    for name in policy_export.__all__:
        assert getattr(policy_export, name) is not None, name
