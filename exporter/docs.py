"""``policy-export docs``: the documentation and examples, where the package is installed from a
wheel as much as in a checkout.

The wheel carries ``docs/*.md``, ``examples/*`` and the fixtures the examples run on
(``policy_export/docs``, ``policy_export/examples``, ``policy_export/fixtures``); the README is
the wheel's own description (its metadata). In a checkout they are the repository's folders.

- :func:`topics`: every page and example, each with its first line;
- :func:`text`: one of them, as it is (Markdown, or the script);
- :func:`write_tree`: all of them written to a directory laid out as the repository is
  (``README.md``, ``docs/``, ``examples/``, ``fixtures/``), so that the README's links resolve
  there and ``bash DIR/examples/ci_gate.sh`` runs as in a checkout.
"""

from __future__ import annotations

import os
import shutil
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from policy_export.errors import InputError

FOLDERS = ("docs", "examples", "fixtures")
# the fixtures the examples run on (examples/*.sh and examples/python_api.py read them)
EXAMPLE_FIXTURES = ("cartpole_mlp", "pendulum_mlp", "rllib/checkpoints/ppo_filter")


def _folder(name: str) -> Any:
    """Where ``name`` (one of :data:`FOLDERS`) is: inside the installed package (a wheel), else the
    checkout's folder of that name; ``None`` where neither has it."""
    try:
        inside = resources.files("policy_export").joinpath(name)
        if inside.is_dir():
            return inside
    except (ModuleNotFoundError, OSError):
        pass
    checkout = Path(__file__).resolve().parent.parent / name  # exporter/ is at the checkout's top
    return checkout if checkout.is_dir() else None


def readme() -> str:
    """The README: the checkout's, else the wheel's description (the same file)."""
    checkout = Path(__file__).resolve().parent.parent / "README.md"
    if checkout.is_file():
        return checkout.read_text(encoding="utf-8")
    try:
        meta = metadata.metadata("policy-export")
    except metadata.PackageNotFoundError:
        return ""
    return meta.get_payload() or meta.get("Description", "") or ""


def license_text() -> str:
    """The license: the checkout's ``LICENSE``, else the one the wheel's ``.dist-info`` carries."""
    checkout = Path(__file__).resolve().parent.parent / "LICENSE"
    if checkout.is_file():
        return checkout.read_text(encoding="utf-8")
    try:
        dist = metadata.distribution("policy-export")
    except metadata.PackageNotFoundError:
        return ""
    for name in ("LICENSE", "licenses/LICENSE"):
        text = dist.read_text(name)
        if text:
            return text
    return ""


def _pages() -> dict[str, Any]:
    """Topic name -> file: ``README``, every docs page by its name (``ci-gate``), every example by
    its file name (``ci_gate.sh``)."""
    found: dict[str, Any] = {"README": None}
    docs, examples = _folder("docs"), _folder("examples")
    if docs is not None:
        for entry in sorted(docs.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".md") and entry.name != "README.md":
                found[entry.name[:-3]] = entry
        if docs.joinpath("README.md").is_file():
            found["index"] = docs.joinpath("README.md")
    if examples is not None:
        for entry in sorted(examples.iterdir(), key=lambda e: e.name):
            if entry.name.endswith((".sh", ".py")):
                found[entry.name] = entry
    return found


def _first_line(body: str) -> str:
    """A page's title, or a script's first sentence (its first comment or docstring)."""
    lines = [line.strip().lstrip("#").strip().strip('"').strip() for line in body.splitlines()
             if not line.startswith("#!")]
    first = next((i for i, line in enumerate(lines) if line), None)
    if first is None:
        return ""
    if not body.lstrip().startswith(("#!", '"""')) or body.lstrip().startswith("# "):
        return lines[first]
    sentence = []
    for line in lines[first:]:
        if not line:
            break
        sentence.append(line)
    text = " ".join(sentence)
    return text.split(". ")[0].rstrip(".") + "."


def topics() -> list[tuple[str, str]]:
    """Every topic and its first line (a page's title, a script's first sentence)."""
    out = []
    for name, entry in _pages().items():
        body = readme() if entry is None else entry.read_text(encoding="utf-8")
        out.append((name, _first_line(body)))
    return out


def text(topic: str) -> str:
    """The page or example ``topic`` (see :func:`topics`; ``docs/ci-gate.md``, ``ci-gate.md`` and
    ``examples/ci_gate.sh`` name the same as their short names), as it is.

    Raises:
        InputError: no such topic (the topics named).
    """
    pages = _pages()
    name = topic.removeprefix("docs/").removeprefix("examples/")
    if name.endswith(".md") and name[:-3] in pages:
        name = name[:-3]
    if name == "README.md":
        name = "README"
    if name not in pages:
        from policy_export.exporter.core_options import did_you_mean

        raise InputError(f"no documentation topic {topic!r}: choose from {', '.join(pages)}"
                         f"{did_you_mean([name], list(pages))}")
    entry = pages[name]
    return readme() if entry is None else entry.read_text(encoding="utf-8")


def _copy(entry: Any, target: Path) -> int:
    """``entry`` (a file or folder of the package's resources) copied to ``target``; files copied."""
    if entry.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        return sum(_copy(child, target / child.name) for child in entry.iterdir() if child.name != "__pycache__")
    target.write_bytes(entry.read_bytes())
    if entry.name.endswith(".sh"):
        os.chmod(target, 0o755)
    return 1


def write_tree(directory: str | os.PathLike) -> tuple[Path, int]:
    """Write the README, ``docs/``, ``examples/`` and the fixtures the examples use to
    ``directory`` (new, or empty), laid out as the repository is; returns it and the files written.

    Raises:
        InputError: ``directory`` is a file, a link, or a directory that is not empty.
    """
    target = Path(directory)
    if target.is_symlink():
        raise InputError(f"{target}: is a symbolic link; refusing to write through it (nothing was written)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InputError(f"{target}: is not a new or empty directory (nothing was written)")
    staging = target.parent / f".{target.name}.writing"
    if staging.exists() or staging.is_symlink():
        raise InputError(f"{staging}: exists; remove it (a write that did not finish)")
    try:
        staging.mkdir(parents=True)
        count = 0
        for name, body in (("README.md", readme()), ("LICENSE", license_text())):
            if body:
                (staging / name).write_text(body, encoding="utf-8")
                count += 1
        for name in ("docs", "examples"):
            found = _folder(name)
            if found is not None:
                count += _copy(found, staging / name)
        fixtures = _folder("fixtures")
        for name in EXAMPLE_FIXTURES:
            entry = fixtures.joinpath(name) if fixtures is not None else None
            if entry is None or not entry.is_dir():
                data = _folder_in_data(name)
                if data is None:
                    continue
                entry = data
            count += _copy(entry, staging / "fixtures" / name)
        if target.exists():
            target.rmdir()
        staging.rename(target)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise InputError(f"{target}: cannot write the documentation: {e.strerror or e} (nothing was written)") from None
    return target, count


def _folder_in_data(name: str) -> Any:
    """A fixture the package carries as data for ``policy-export example`` (the CartPole spec)."""
    try:
        entry = resources.files("policy_export").joinpath("data", name)
        return entry if entry.is_dir() else None
    except (ModuleNotFoundError, OSError):
        return None


def read_docs(topic: str | None = None) -> str | list[tuple[str, str]]:
    """What ``policy-export docs [TOPIC]`` prints, as data: the page or example ``topic`` as it is
    (:func:`text`), or without one every topic and its first line (:func:`topics`)."""
    return topics() if topic is None else text(topic)
