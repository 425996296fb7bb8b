"""One import package, ``policy_export``; nothing else lands at the top level of an environment.
The wheel holds the license, the full metadata and the example spec ``policy-export example`` writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from conftest import ROOT
from helpers import cli, one_line_error, snapshot


def test_every_installed_package_lives_under_policy_export():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]
    assert packages[0] == "policy_export"
    assert all(p == "policy_export" or p.startswith("policy_export.") for p in packages)
    assert config["project"]["scripts"]["policy-export"] == "policy_export.exporter.cli:console_main"


def test_every_source_package_is_installed():
    """A wheel holds only the packages listed: every folder of the sources with an ``__init__.py``
    must be; the others listed are folders of data only (the docs, the examples and the fixtures
    they run on, for ``policy-export docs``), each mapped to its folder and holding no module."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    dirs = config["tool"]["setuptools"]["package-dir"]
    found = set()
    data = {package for package, folder in dirs.items() if not (ROOT / folder / "__init__.py").exists()}
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == listed - data
    assert data == {"policy_export.docs", "policy_export.examples", "policy_export.fixtures.cartpole_mlp",
                    "policy_export.fixtures.pendulum_mlp", "policy_export.fixtures.rllib.checkpoints.ppo_filter"}


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


# ----------------------------------------------------------------------------- the wheel

@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built as a user would (``pip wheel``, build isolation) from a copy of the sources,
    so that the checkout gains no build/ folder."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    keep = ("pyproject.toml", "README.md", "LICENSE", "policy_export", "policy", "signatures", "exporter", "docs",
            "examples", "fixtures/cartpole_mlp", "fixtures/pendulum_mlp", "fixtures/rllib/checkpoints/ppo_filter")
    for name in keep:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (src).mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = out.glob("policy_export-*.whl")
    return wheel


def test_the_wheel_holds_the_license_the_example_spec_and_full_metadata(wheel):
    from email.parser import Parser

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with zipfile.ZipFile(wheel) as opened:
        names = opened.namelist()
        (license_file,) = [n for n in names if ".dist-info/" in n and n.endswith("LICENSE")]
        assert opened.read(license_file) == (ROOT / "LICENSE").read_bytes()
        for name in EXAMPLE_FILES:
            assert opened.read(f"policy_export/data/cartpole_mlp/{name}") == (FIXTURE / name).read_bytes()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(opened.read(meta_name).decode())
    assert meta["Name"] == "policy-export" and meta["Version"] == config["version"]
    classifiers = meta.get_all("Classifier")
    assert classifiers == config["classifiers"]
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    assert [c for c in classifiers if c.startswith("Programming Language :: Python :: 3.")] == [
        "Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12"]
    assert meta["Keywords"]


def test_the_license_is_apache_2_as_declared():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}


# ----------------------------------------------------------------------------- --version, example

EXAMPLE_FILES = ("policy.json", "weights.h5")
FIXTURE = ROOT / "fixtures" / "cartpole_mlp"


def test_the_bundled_example_is_the_cartpole_fixture():
    from policy_export.exporter.example import example_files

    assert example_files() == {name: (FIXTURE / name).read_bytes() for name in EXAMPLE_FILES}
    assert sorted(p.name for p in FIXTURE.iterdir()) == sorted(EXAMPLE_FILES)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    from importlib import metadata

    proc = cli(flag)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"policy-export {metadata.version('policy-export')}\n"


def test_example_writes_the_spec_and_it_exports(tmp_path):
    target = tmp_path / "cartpole"
    proc = cli("example", str(target))
    assert proc.returncode == 0, proc.stderr
    assert f"policy-export export {target} --out OUT" in proc.stdout
    assert sorted(p.name for p in target.iterdir()) == sorted(EXAMPLE_FILES)
    proc = cli("export", str(target), "--out", str(tmp_path / "out"), "--formats", "onnx", "--samples", "20",
               "--explore-samples", "0", "--quiet")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "model.onnx").is_file()


def test_example_refuses_a_directory_that_is_not_empty_and_a_file(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    for target in (tmp_path, tmp_path / "mine.txt"):
        proc = cli("example", str(target))
        one_line_error(proc, 2, str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    assert (tmp_path / "mine.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("example", str(empty)).returncode == 0


@pytest.mark.parametrize("kind", ["a link to an empty folder", "a link to nowhere"])
def test_example_never_writes_through_a_link(tmp_path, kind):
    real = tmp_path / "real"
    if kind == "a link to an empty folder":
        real.mkdir()
    (tmp_path / "link").symlink_to(real)
    before = snapshot(tmp_path)
    one_line_error(cli("example", str(tmp_path / "link")), 2, "is a symbolic link; refusing to write through it")
    assert snapshot(tmp_path) == before


def test_the_wheel_holds_tritons_model_config_schema(wheel):
    """``inspect`` and the Triton format parse config.pbtxt with the schema the package ships."""
    with zipfile.ZipFile(wheel) as opened:
        data = opened.read("policy_export/exporter/formats/triton/model_config.binpb")
    assert data == (ROOT / "exporter" / "formats" / "triton" / "model_config.binpb").read_bytes()


def test_the_readme_commands_run_from_the_wheel_installed_outside_the_checkout(wheel, tmp_path):
    """The wheel installed into a folder of its own (its dependencies are this environment's), run
    from a directory outside the checkout: ``--version``, ``example``, then the README's main job
    (export the example, verify the export), which imports nothing from the checkout."""
    from importlib import metadata

    target, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, text=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(target)}
    script = str(target / "bin" / "policy-export")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, script, *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)

    where = subprocess.run([sys.executable, "-c", "import policy_export; print(policy_export.__file__)"], cwd=work,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(target / "policy_export" / "__init__.py")
    assert run("--version").stdout == f"policy-export {metadata.version('policy-export')}\n"
    done = run("example", "cartpole")
    assert done.returncode == 0 and "policy-export export cartpole --out OUT" in done.stdout, done.stderr
    done = run("export", "cartpole", "--out", "out/cartpole", "--formats", "saved_model,onnx,triton", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exported out/cartpole: saved_model, onnx, triton (" in done.stdout  # the path as typed
    done = run("verify", "out/cartpole", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "verified out/cartpole: files match the manifest, every format matches"
    done = run("inspect", "out/cartpole/triton/cartpole_mlp", "--json")
    assert done.returncode == 0 and json.loads(done.stdout), done.stderr[-2000:]
    # the documentation, from the wheel: a page as it is; the whole of it where the README's links work
    done = run("docs", "ci-gate")
    assert done.returncode == 0 and done.stdout == (ROOT / "docs" / "ci-gate.md").read_text(), done.stderr[-2000:]
    done = run("docs", "--write", "manual")
    assert done.returncode == 0, done.stderr[-2000:]
    manual = work / "manual"
    assert (manual / "README.md").read_text() == (ROOT / "README.md").read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", (manual / "README.md")
                                                                            .read_text(), flags=re.S))]
    assert links and all((manual / t).exists() for t in links if t and not re.match(r"[a-z]+:", t)), links
    done = subprocess.run(["bash", str(manual / "examples" / "export_verify.sh"), "out/example"], cwd=work,
                          env={**env, "PATH": f"{target / 'bin'}:{os.environ['PATH']}"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "every format matches" in done.stdout, done.stderr[-2000:]
