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
