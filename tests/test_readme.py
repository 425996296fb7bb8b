"""The README's set-up commands are the ones CI runs."""

from __future__ import annotations

import re

from conftest import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(blocks) >= 2, "the README needs its two set-up commands"
    main_job, tests = blocks[0], blocks[1]
    assert "policy-export export fixtures/cartpole_mlp" in main_job and "policy-export verify" in main_job
    assert tests in (ROOT / ".ci" / "run").read_text()


def _slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces as '-')."""
    slugs, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            slugs.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return slugs


def test_every_relative_link_of_the_docs_resolves():
    """README.md and docs/*.md: each relative link names a file that exists, and a heading of it."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = page.parent / path if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_the_docs_synopsis_is_the_one_the_parser_makes():
    """docs/ci-gate.md quotes every command's usage as ``python -m policy_export.exporter.cli_args`` prints it."""
    from policy_export.exporter.cli_args import synopsis

    text = (ROOT / "docs" / "ci-gate.md").read_text()
    assert "```\n" + synopsis() + "```\n" in text, "run python -m policy_export.exporter.cli_args into docs/ci-gate.md"


def _first_install(text: str, prefix: str) -> list[str]:
    """The packages of the first ``pip install`` line starting with ``prefix`` (continuations joined)."""
    import shlex

    joined = text.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if ln.strip().startswith(prefix))
    words = shlex.split(line.split("#")[0])
    return sorted(w for w in words[words.index("install") + 1:] if not w.startswith("-"))


def test_the_rllib_recipe_of_the_install_docs_is_what_ci_installs():
    docs = (ROOT / "docs/install.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    assert _first_install(docs, 'pip install "ray[rllib]') == _first_install(ci, '.venv-oldest/bin/pip install -q "ray')
    assert 'pip install "policy-export[rllib]"' in docs and '.venv-oldest/bin/pip install -q -e ".[test,rllib,' in ci
