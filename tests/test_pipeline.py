"""A deployment pipeline end to end: export, verify, tamper, diff, convert, inspect, JUnit."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tensorflow as tf

from conftest import FIXTURES_DIR
from policy_export.exporter import export_policy
from policy_export.exporter.convert import convert_saved_model
from policy_export.exporter.sources.legacy import load_saved_model_policy
from policy_export.exporter.inspection import contract_of
from policy_export.policy import ExportError, TFPolicy
from policy_export.signatures.contract import Contract, TensorSpec
from policy_export.signatures.diff import diff_contracts
from helpers import cli

tf1 = tf.compat.v1


LEGACY = FIXTURES_DIR / "rllib" / "legacy"


def _signature_keys(model: Path) -> tuple[list[str], list[str]]:
    """The raw input and output keys of the SavedModel's serving signature, as RLlib wrote them."""
    from policy_export.exporter.trust import read_saved_model

    sig = read_saved_model(model).meta_graphs[0].signature_def["serving_default"]
    return sorted(sig.inputs), sorted(sig.outputs)


@pytest.mark.parametrize("case", ["cartpole_ff", "lstm"])
def test_convert_an_rllib_export_and_verify_it(case, tmp_path):
    """RLlib's own export_model output: raw tensor names as state keys become clean contract keys."""
    src = LEGACY / case / "saved_model"
    raw_in, raw_out = _signature_keys(src)
    result = convert_saved_model(src, tmp_path / "out", device="cpu", samples=50)
    keys_in = [i["key"] for i in result.manifest["contract"]["inputs"]]
    keys_out = [o["key"] for o in result.manifest["contract"]["outputs"]]
    assert not any(":" in k for k in keys_in + keys_out)
    mapping = result.manifest["source"]["key_mapping"]
    state = {k: v for k, v in mapping.items() if k.startswith("state_")}
    if case == "lstm":
        expected = json.loads((LEGACY / case / "case.json").read_text())["state_keys"]
        assert {k: state[k] for k in expected} == expected
        assert {state["state_out_0"], state["state_out_1"]} <= set(raw_out)
        assert {"state_in_0", "state_in_1", "seq_lens"} <= set(keys_in)
        assert {"state_out_0", "state_out_1"} <= set(keys_out)
    else:
        assert state == {}
    assert "vf_preds" in keys_out
    records = {(r.format, r.key): r for r in result.parity.records}
    assert records[("onnx", "actions_0")].mismatches == 0
    assert all(r.passed and (r.exact or r.max_abs_err <= 1e-5) for r in result.parity.records)
    # a feed-forward legacy policy's hidden is_exploring switch gives it a deterministic model
    written = {"saved_model", "frozen_graph", "onnx"}
    if case == "cartpole_ff":
        written.add("onnx_deterministic")
        assert records[("onnx_deterministic", "actions_0")].mismatches == 0
    assert set(result.formats) == written
    # the converted export verifies like any other, from the command line
    proc = cli("verify", str(tmp_path / "out"), "--samples", "50")
    assert proc.returncode == 0, proc.stderr
    # and the original can be inspected as it is, raw keys and all
    kind, contract = contract_of(src)
    assert kind == "saved_model" and sorted(contract.input_keys) == raw_in


@pytest.mark.slow
def test_convert_state_pairs_given_explicitly(tmp_path):
    """The state pairs of RLlib's LSTM export given on the command line are the ones used."""
    src = LEGACY / "lstm" / "saved_model"
    natural = tmp_path / "natural"
    assert cli("convert", str(src), "--out", str(natural), "--samples", "20", "-q").returncode == 0
    mapping = json.loads((natural / "manifest.json").read_text())["source"]["key_mapping"]
    pairs = [f"{mapping[f'state_in_{i}']}={mapping[f'state_out_{i}']}" for i in range(2)]
    out = tmp_path / "out"
    proc = cli("convert", str(src), "--out", str(out), "--samples", "20", "-q",
               "--state", pairs[0], "--state", pairs[1])
    assert proc.returncode == 0, proc.stderr
    given = json.loads((out / "manifest.json").read_text())["source"]["key_mapping"]
    assert {k: given[k] for k in mapping if k.startswith("state_")} == \
        {k: v for k, v in mapping.items() if k.startswith("state_")}
    proc = cli("convert", str(src), "--out", str(tmp_path / "x"), "--state", f"{mapping['state_in_0']}=nope")
    assert proc.returncode == 2 and "state pairs" in proc.stderr


def test_convert_refuses_what_is_not_a_policy_saved_model(tmp_path):
    with pytest.raises(ExportError, match="not a SavedModel"):
        convert_saved_model(tmp_path, tmp_path / "out")
    with pytest.raises(ExportError, match="no signature 'nope'"):
        load_saved_model_policy(LEGACY / "cartpole_ff" / "saved_model", signature_key="nope", device="cpu")


def _contract(inputs, outputs) -> Contract:
    return Contract(tuple(inputs), tuple(outputs))


OBS = TensorSpec("observations", "float32", (None, 4))
EXPLORE = TensorSpec("explore", "bool", (), required=False, default=False)
ACT = TensorSpec("actions_0", "int64", (None,))


@pytest.mark.parametrize("new, breaking, fragment", [
    (_contract([OBS, EXPLORE], [ACT]), False, None),
    (_contract([OBS, EXPLORE], [ACT, TensorSpec("vf_preds", "float32", (None,))]), False, "added"),
    (_contract([OBS, EXPLORE, TensorSpec("timestep", "int64", (), False, 0)], [ACT]), False, "optional"),
    (_contract([OBS], [ACT]), True, "removed"),
    (_contract([OBS, EXPLORE], []), True, "removed"),
    (_contract([TensorSpec("observations", "float64", (None, 4)), EXPLORE], [ACT]), True, "dtype"),
    (_contract([TensorSpec("observations", "float32", (None, 5)), EXPLORE], [ACT]), True, "dimension 1"),
    (_contract([TensorSpec("observations", "float32", (None, 4, 1)), EXPLORE], [ACT]), True, "rank"),
    (_contract([OBS, EXPLORE, TensorSpec("seq_lens", "int32", (None,))], [ACT]), True, "required input"),
    (_contract([OBS, TensorSpec("explore", "bool", ())], [ACT]), True, "became required"),
    (_contract([OBS, TensorSpec("explore", "bool", (), False, True)], [ACT]), True, "default changed"),
])
def test_diff_classifies_each_change(new, breaking, fragment):
    result = diff_contracts(_contract([OBS, EXPLORE], [ACT]), new)
    assert result.compatible is (not breaking)
    if fragment:
        assert any(fragment in c.what for c in result.changes), result.changes


@pytest.mark.slow
def test_deployment_pipeline(tmp_path, policies, exports):
    """Export, verify, tamper, diff against changed policies, inspect, with JUnit CI can read."""
    _, v1 = exports("cartpole_mlp")
    work = tmp_path / "v1"
    shutil.copytree(v1, work)
    assert cli("verify", str(work), "--junit", str(tmp_path / "ok.xml")).returncode == 0
    cases = ET.parse(tmp_path / "ok.xml").getroot().findall(".//testcase")
    names = {(c.get("classname"), c.get("name")) for c in cases}
    assert ("verify.onnx", "actions_0") in names and ("verify.files", "sha256") in names
    assert ("verify.keras_h5", "base_model_out") in names

    tampered = tmp_path / "tampered"
    shutil.copytree(v1, tampered)
    (tampered / "parity" / "report.json").write_text("{}")
    proc = cli("verify", str(tampered), "--junit", str(tmp_path / "bad.xml"))
    assert proc.returncode == 1 and "changed file parity/report.json" in proc.stdout
    failures = ET.parse(tmp_path / "bad.xml").getroot().findall(".//failure")
    assert [f.get("message") for f in failures] == ["changed file parity/report.json (sha256 differs from the manifest)"]

    # compatible: the same policy with an extra output
    policy = policies("cartpole_mlp")
    with policy.graph.as_default():
        value = tf.reduce_sum(policy.inputs["observations"], axis=1)
    extended = TFPolicy(policy.observation_space, policy.action_space, policy.session,
                        observations=policy.inputs["observations"], sampled_action=policy.outputs["actions_0"],
                        action_logp=policy.outputs["action_logp"], action_prob=policy.outputs["action_prob"],
                        action_dist_inputs=policy.outputs["action_dist_inputs"], explore=policy.inputs["explore"],
                        is_training=policy.inputs["is_training"], timestep=policy.inputs["timestep"],
                        extra_fetches={"vf_preds": value}, model=policy.model, model_io=policy.model_io)
    v2 = tmp_path / "v2"
    export_policy(extended, v2, samples=64, explore_samples=0, device="cpu", formats=["onnx"])
    proc = cli("diff", str(v1), str(v2), "--json")
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout)["changes"] == [
        {"kind": "compatible", "side": "output", "key": "vf_preds", "what": "was added"}]

    # breaking: a policy with three actions (action_dist_inputs changes width)
    spec_dir = tmp_path / "three"
    shutil.copytree(FIXTURES_DIR / "cartpole_mlp", spec_dir)
    spec = json.loads((spec_dir / "policy.json").read_text())
    spec["action_space"]["n"] = 3
    del spec["weights"]
    (spec_dir / "policy.json").write_text(json.dumps(spec))
    v3 = tmp_path / "v3"
    assert cli("export", str(spec_dir), "--out", str(v3), "--formats", "onnx", "--samples", "64",
               "--explore-samples", "0").returncode == 0
    proc = cli("diff", str(v1), str(v3))
    assert proc.returncode == 1 and "action_dist_inputs" in proc.stdout and "BREAKING" in proc.stdout

    # inspect reads an export, a bare ONNX file and a SavedModel alike
    contract = [i["key"] for i in json.loads((v1 / "manifest.json").read_text())["contract"]["inputs"]]
    for target in (v1, v1 / "model.onnx", v1 / "saved_model"):
        proc = cli("inspect", str(target), "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        keys = [i["key"] for i in doc["inputs"]]
        # a SavedModel's signature is a protobuf map: the same keys, in no promised order
        assert (sorted(keys) if doc["kind"] == "saved_model" else keys) == (
            sorted(contract) if doc["kind"] == "saved_model" else contract)
        explore = [i for i in doc["inputs"] if i["key"] == "explore"][0]
        assert explore["required"] is False and explore["default"] is False


def test_inspect_refuses_files_that_are_not_models(tmp_path):
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"not onnx")
    proc = cli("inspect", str(fake))
    assert proc.returncode == 2 and "not a valid ONNX model" in proc.stderr
    (tmp_path / "sm").mkdir()
    (tmp_path / "sm" / "saved_model.pb").write_bytes(b"\x00garbage")
    proc = cli("inspect", str(tmp_path / "sm"))
    assert proc.returncode == 2 and "not a SavedModel" in proc.stderr
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 2 and "is not an export directory" in proc.stderr
