"""An export exported again (the ``export`` source): new formats from an export alone, the same
contract, refused when its SavedModel or manifest is not what was pinned or written."""

from __future__ import annotations

import json

import pytest

from conftest import spec_exports
from helpers import cli, snapshot

FAST = ("--samples", "64", "--explore-samples", "0", "-q")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(fixture name) -> an export holding its SavedModel and ONNX model only."""
    get = spec_exports(tmp_path_factory, "export_source", {"formats": ["saved_model", "onnx"], "samples": 64,
                                                            "explore_samples": 0})
    return lambda name: get(name)[1]


@pytest.mark.parametrize("name", ["cartpole_mlp", "cartpole_lstm"])
def test_an_export_gets_new_formats_with_the_same_contract(small, tmp_path, name):
    original = small(name)
    proc = cli("export", str(original), "--out", str(tmp_path / "again"), "--formats",
               "frozen_graph,onnx", *FAST)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "again" / "manifest.json").read_text())
    first = json.loads((original / "manifest.json").read_text())
    assert sorted(doc["formats"]) == ["frozen_graph", "onnx"]
    assert doc["contract"] == first["contract"] and doc["spaces"] == first["spaces"]
    assert doc["source"]["kind"] == "export" and doc["source"]["converted_from"] == str(original)
    diff = cli("diff", str(original), str(tmp_path / "again"), "--json")
    assert diff.returncode == 0 and json.loads(diff.stdout)["changes"] == [], diff.stdout


def test_a_changed_saved_model_is_refused_before_it_is_loaded(small, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small("cartpole_mlp"), copy)
    data = next((copy / "saved_model" / "variables").glob("variables.data-*"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size, another weight
    data.write_bytes(bytes(raw))
    before = snapshot(tmp_path)
    proc = cli("export", str(copy), "--out", str(tmp_path / "again"), *FAST)
    assert proc.returncode == 2, proc.stderr
    assert "saved_model/ does not match the manifest (changed file saved_model/variables/variables.data" \
        in proc.stderr and "nothing was loaded" in proc.stderr
    assert snapshot(tmp_path) == before  # nothing written


def test_the_manifest_pin_and_foreign_options_are_checked_first(small, tmp_path):
    original = small("cartpole_mlp")
    wrong = cli("export", str(original), "--out", str(tmp_path / "a"), "--expect-manifest-sha256", "0" * 64, *FAST)
    assert wrong.returncode == 2 and f"does not have the sha256 {'0' * 64}" in wrong.stderr, wrong.stderr
    foreign = cli("export", str(original), "--out", str(tmp_path / "b"), "--policy-id", "x", *FAST)
    assert foreign.returncode == 2, foreign.stderr
    assert ("--policy-id applies to an RLlib new API stack checkpoint (torch RLModules) and an RLlib checkpoint "
            "(rllib_checkpoint.json) only; this source is an export of "
            "this package") in foreign.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
