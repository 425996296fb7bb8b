"""``convert`` takes the parity options ``export`` takes, and honours them: tolerances, per-output
tolerances, the seed of the parity samples, JUnit and JSON reports (one policy and every policy)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from conftest import FIXTURES_DIR
from helpers import cli

CHECKPOINT = FIXTURES_DIR / "rllib" / "checkpoints" / "ppo_filter" / "checkpoint"
MULTI = FIXTURES_DIR / "rllib" / "checkpoints" / "multi_agent" / "checkpoint"
FAST = ("--formats", "onnx", "--samples", "64", "--explore-samples", "0", "-q")


def _records(report: dict) -> dict[tuple[str, str], dict]:
    return {(r["format"], r["key"]): r for r in report["records"]}


def test_tolerances_seed_and_reports_reach_the_convert_of_a_checkpoint(tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    proc = cli("convert", str(CHECKPOINT), "--out", str(tmp_path / "a"), *FAST, "--seed", "7",
               "--atol", "3e-4", "--rtol", "2e-4", "--tolerance", "action_logp=5e-3:0",
               "--report-json", str(report), "--junit", str(junit))
    assert proc.returncode == 0, proc.stderr
    records = _records(json.loads(report.read_text()))
    assert records[("onnx", "action_dist_inputs")]["atol"] == pytest.approx(3e-4)
    assert records[("onnx", "action_dist_inputs")]["rtol"] == pytest.approx(2e-4)
    assert (records[("onnx", "action_logp")]["atol"], records[("onnx", "action_logp")]["rtol"]) == (5e-3, 0.0)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["tolerances"]["per_output"]["action_logp"] == {"atol": 5e-3, "rtol": 0.0}
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("name") == "convert"
    assert {c.get("name") for c in suite.iter("testcase")} >= {"action_dist_inputs", "action_logp", "actions_0"}

    again = cli("convert", str(CHECKPOINT), "--out", str(tmp_path / "b"), *FAST, "--seed", "8")
    assert again.returncode == 0, again.stderr
    first, second = (np.load(tmp_path / d / "parity" / "inputs.npz") for d in ("a", "b"))
    key = sorted(first.files)[0]
    assert first[key].shape == second[key].shape and not np.array_equal(first[key], second[key])


def test_a_zero_tolerance_fails_the_convert_and_still_writes_its_reports(tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    proc = cli("convert", str(CHECKPOINT), "--out", str(tmp_path / "o"), *FAST, "--atol", "0", "--rtol", "0",
               "--report-json", str(report), "--junit", str(junit))
    assert proc.returncode == 1, proc.stderr
    assert not (tmp_path / "o").exists()
    doc = json.loads(report.read_text())
    assert doc["passed"] is False
    failed = [r for r in doc["records"] if not r["passed"]]
    assert failed and all(r["atol"] == 0 and r["rtol"] == 0 and r["max_abs_err"] > 0 for r in failed)
    assert ET.parse(junit).getroot().get("failures") == str(len(failed))


def test_every_policy_gets_its_own_report_section(tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    proc = cli("convert", str(MULTI), "--out", str(tmp_path / "zoo"), "--all-policies", *FAST,
               "--report-json", str(report), "--junit", str(junit))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(report.read_text())
    ids = sorted(p.name for p in (tmp_path / "zoo").iterdir())
    assert doc["passed"] is True and sorted(doc["policies"]) == ids and len(ids) >= 2
    assert all(section["records"] for section in doc["policies"].values())
    suites = ET.parse(junit).getroot().findall("testsuite")
    assert sorted(s.get("name") for s in suites) == [f"convert.{pid}" for pid in ids]


def test_a_tolerance_for_an_output_the_policy_lacks_is_bad_input(tmp_path):
    proc = cli("convert", str(CHECKPOINT), "--out", str(tmp_path / "o"), *FAST, "--tolerance", "no_such=1e-3")
    assert proc.returncode == 2, proc.stderr
    assert "no_such" in proc.stderr and not (tmp_path / "o").exists()
