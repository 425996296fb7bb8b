"""``convert`` of RLlib checkpoints: the exported ``model.onnx`` against RLlib's own outputs.

The checkpoints under ``fixtures/rllib/checkpoints/`` were written by RLlib itself (ray 2.9.3,
``ray25_*`` by 2.5.1; ``fixtures/rllib/make_checkpoints.py``), with RLlib's ``policy.compute_actions(explore=False)`` on
its own filtered observations in ``expected.npz``. Each test converts a checkpoint without ray and
feeds ``model.onnx`` the raw environment observations and only the inputs its contract requires.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policy_export.errors import ExportError, WeightsError
from policy_export.exporter.convert import convert_checkpoint, convert_checkpoint_policies
from policy_export.exporter.options import ExportOptions
from policy_export.exporter.sources.checkpoint import read_checkpoint
from policy_export.exporter.sources.checkpoint_policy import load_checkpoint_policy
from helpers import cli

from tests.checkpoint_matrix import (
    ATOL, CASES, CHECKPOINTS, OnnxPolicy, case_record, expected_outputs, onnx_errors, passes, raw_observations,
)

ONNX_ONLY = ExportOptions(formats=["onnx"], samples=200, explore_samples=1000)  # what the RLlib comparison runs
PARAMS = [(case, pid) for case in CASES for pid in case_record(case)["policy_ids"]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(case, policy id, actions) -> the export directory, converted once per module."""
    made: dict[tuple[str, str, str], Path] = {}

    def get(case: str, pid: str, actions: str = "environment") -> Path:
        key = (case, pid, actions)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{case}_{actions}") / pid
            convert_checkpoint(CHECKPOINTS / case / "checkpoint", out, policy_id=pid, actions=actions,
                               device="cpu", options=ONNX_ONLY)
            made[key] = out
        return made[key]

    return get


@pytest.mark.parametrize("case,pid", PARAMS)
def test_model_onnx_reproduces_rllib_on_raw_observations(exported, case, pid):
    errors = onnx_errors(exported(case, pid), case, pid)
    assert set(errors) >= {"actions_0", "action_dist_inputs"}
    if "state_in_0" in OnnxPolicy(exported(case, pid)).required:
        assert set(errors) >= {"state_out_0", "state_out_1"}
    assert passes(errors), errors  # discrete actions identical, floats within 1e-5 + 1e-5 * |RLlib's|


BOX_CASES = [(c, p) for c, p in PARAMS if f"{p}/env_actions" in expected_outputs(c)]


@pytest.mark.parametrize("case,pid", BOX_CASES)
def test_policy_actions_are_rllibs_compute_actions(exported, case, pid):
    expected = expected_outputs(case)
    policy = OnnxPolicy(exported(case, pid, "policy"))
    errors = onnx_errors(exported(case, pid, "policy"), case, pid, "policy")
    assert passes(errors), errors
    assert policy.manifest["contract"]["actions"] == "policy"
    if case_record(case)["normalize_actions"]:
        env = OnnxPolicy(exported(case, pid)).run(raw_observations(expected, pid))["actions_0"]
        assert not np.allclose(env, expected[f"{pid}/actions"].reshape(env.shape), atol=1e-3), \
            "the environment's action equals the policy's: the case does not test the unsquashing"


RECURRENT = [(c, p) for c, p in PARAMS if f"{p}/state_in_0" in expected_outputs(c)]


@pytest.mark.parametrize("case,pid", RECURRENT)
def test_the_rebuilt_lstm_runs_whole_sequences_as_rllib_stepped_them(case, pid):
    expected = expected_outputs(case)
    policy, _ = load_checkpoint_policy(read_checkpoint(CHECKPOINTS / case / "checkpoint").policy(pid))
    steps, batch = expected[f"{pid}/actions"].shape

    def rows(name):  # [T, B, ...] -> B sequences of T contiguous rows
        value = np.swapaxes(expected[f"{pid}/{name}"], 0, 1)
        return value.reshape(batch * steps, *value.shape[2:])

    prev = {k: rows(k) for k in ("prev_action", "prev_reward") if f"{pid}/{k}" in expected}
    result = policy.compute_actions(rows("obs"), state=[expected[f"{pid}/state_in_{i}"][0] for i in range(2)],
                                    seq_lens=np.full(batch, steps, np.int32), **prev)
    np.testing.assert_array_equal(np.asarray(result.actions), rows("actions"))
    np.testing.assert_allclose(result.fetches["vf_preds"], rows("vf_preds"), atol=ATOL, rtol=1e-5)
    for i in range(2):
        np.testing.assert_allclose(result.state_out[i], expected[f"{pid}/state_out_{i}"][-1], atol=ATOL, rtol=1e-5)


def test_a_recurrent_export_is_stepped_against_its_sequence_graph(exported):
    report = json.loads((exported("ppo_lstm", "default_policy") / "parity/report.json").read_text())
    stepped = [r for r in report["records"] if "vs sequences" in r["format"]]
    assert {r["format"].split(" ")[0] for r in stepped} == {"onnx"}
    assert all(r["passed"] for r in stepped) and {"actions_0", "state_out_0"} <= {r["key"] for r in stepped}


def test_the_filter_and_its_statistics_are_in_the_contract(exported):
    case = case_record("ppo_filter")
    manifest = OnnxPolicy(exported("ppo_filter", "default_policy")).manifest
    recorded = manifest["contract"]["observation_filter"]
    rllib = case["filters"]["default_policy"]
    assert recorded["class"] == rllib["class"] == "MeanStdFilter" and recorded["count"] == rllib["n"]
    np.testing.assert_allclose(recorded["mean"], rllib["mean"], rtol=1e-12)
    np.testing.assert_allclose(recorded["std"], rllib["std"], rtol=1e-12)
    assert manifest["contract"]["actions"] == "environment"
    source = manifest["source"]
    assert source["kind"] == "rllib_checkpoint" and source["ray_version"] == "2.9.3"
    assert "default_policy/fc_2/kernel" in source["weights_used"]


def test_no_filter_takes_rllibs_filteredraw_observations(tmp_path):
    expected = expected_outputs("ppo_filter")
    out = tmp_path / "raw"
    convert_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint", out, use_filter=False, device="cpu", options=ONNX_ONLY)
    policy = OnnxPolicy(out)
    got = policy.run({"observations": expected["default_policy/filtered"]})
    np.testing.assert_array_equal(got["actions_0"], expected["default_policy/actions"])
    np.testing.assert_allclose(got["action_dist_inputs"], expected["default_policy/action_dist_inputs"],
                               atol=ATOL, rtol=0)
    assert policy.manifest["contract"]["observation_filter"] is None
    assert policy.manifest["source"]["observation_filter_left_out"]["class"] == "MeanStdFilter"


def test_a_policy_checkpoint_without_its_filter_says_so(tmp_path):
    out = tmp_path / "o"
    run = cli("convert", str(CHECKPOINTS / "policy_no_connectors/checkpoint"), "--out", str(out), "--samples", "100",
              "--explore-samples", "500", "--device", "cpu", "--formats", "onnx")
    assert run.returncode == 0, run.stderr
    assert "connectors off carries no observation filter" in run.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["contract"]["observation_filter"] is None
    assert case_record("policy_no_connectors")["filters"]["default_policy"]["class"] == "MeanStdFilter"
    assert "algorithm_state.pkl" in manifest["source"]["observation_filter_note"]


def test_all_policies_one_export_each(tmp_path):
    results = convert_checkpoint_policies(CHECKPOINTS / "multi_agent/checkpoint", tmp_path / "league", device="cpu",
                                          options=ONNX_ONLY)
    assert sorted(results) == ["alpha", "beta"]
    sizes = {}
    for pid in results:
        manifest = json.loads((tmp_path / "league" / pid / "manifest.json").read_text())
        assert manifest["source"]["policy_id"] == pid
        sizes[pid] = len(manifest["source"]["weights_used"])
    assert sizes == {"alpha": 8, "beta": 12}  # [16] and [8, 8]: their own networks


def test_a_failing_policy_leaves_no_export_behind(tmp_path):
    checkpoint = read_checkpoint(CHECKPOINTS / "multi_agent/checkpoint")
    last = list(checkpoint.policies)[-1]
    checkpoint.policies[last].config["model"]["custom_model"] = "MyNet"
    out = tmp_path / "league"
    with pytest.raises(ExportError, match="custom model 'MyNet'"):
        convert_checkpoint_policies(checkpoint, out, device="cpu", options=ONNX_ONLY)
    assert not out.exists()


def test_weights_that_do_not_fit_the_config_are_named():
    policy = read_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint").policy()
    policy.weights["default_policy/fc_2/kernel"] = np.zeros((16, 8), np.float32)
    with pytest.raises(WeightsError, match=r"fc_2/kernel has shape \[16, 8\], the config implies \[16, 16\]"):
        load_checkpoint_policy(policy)
    del policy.weights["default_policy/fc_2/kernel"]
    with pytest.raises(WeightsError, match="does not hold"):
        load_checkpoint_policy(policy)


@pytest.mark.parametrize("index,shape,message", [
    (4, (16, 3), r"weight 4 is \[16, 3\], where the network its config describes has fc_out/kernel \[16, 2\]"),
    (2, (4, 17), r"weight 2 is \[4, 17\], where the network its config describes has fc_value_1/kernel \[4, 16\]"),
    (7, (2,), r"weight 7 is \[2\], where the network its config describes has value_out/bias \[1\]"),
])
def test_a_tf2_weight_of_the_right_rank_and_the_wrong_size_is_named(tmp_path, index, shape, message):
    checkpoint = read_checkpoint(CHECKPOINTS / "ppo_tf2/checkpoint")
    policy = checkpoint.policy()
    policy.weight_list[index] = np.zeros(shape, np.float32)  # same rank as the layout's weight at that place
    out = tmp_path / "out"
    with pytest.raises(WeightsError, match=message):
        convert_checkpoint(checkpoint, out, device="cpu", options=ONNX_ONLY)
    assert not out.exists()


@pytest.mark.parametrize("change,message", [
    (lambda p: p.config["model"].update(custom_model="MyNet"), "custom model 'MyNet'.*from_rllib"),
    (lambda p: setattr(p, "policy_class", "MyTFPolicy"), "MyTFPolicy is not one the package rebuilds"),
    (lambda p: setattr(p, "observation_space", __import__("gymnasium").spaces.Box(0, 1, (4, 4))),
     "ComplexInputNetwork"),
    (lambda p: p.config["model"].update(use_attention=True, attention_use_n_prev_rewards=1),
     "attention net fed previous actions or rewards is not rebuilt"),
])
def test_what_is_not_rebuilt_is_named(change, message):
    policy = read_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint").policy()
    change(policy)
    with pytest.raises(ExportError, match=message):
        load_checkpoint_policy(policy)


def test_convert_runs_where_ray_cannot_be_imported(tmp_path):
    out = tmp_path / "out"
    code = ("import sys; sys.modules['ray'] = None\n"
            "from policy_export.exporter.cli import main\n"
            f"code = main(['convert', {str(CHECKPOINTS / 'ppo_lstm/checkpoint')!r}, '--out', {str(out)!r}, "
            "'--samples', '100', '--device', 'cpu'])\n"
            "assert sys.modules['ray'] is None\n"
            "sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["source"]["network"] == "actor_critic"


# ------------------------------------------------------------------------------- hostile, CLI

class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _hostile_pickle(target: Path, marker: Path) -> None:
    (target / "policy_state.pkl").write_bytes(pickle.dumps({"weights": {"w": _Payload(str(marker))}}))


def _msgpack_bomb(target: Path, marker: Path) -> None:
    shutil.rmtree(target)
    shutil.copytree(CHECKPOINTS / "policy_msgpack/checkpoint", target)
    (target / "policy_state.msgpck").write_bytes(b"\xdf\xff\xff\xff\xff")


def _huge_array(target: Path, marker: Path) -> None:
    (target / "policy_state.pkl").write_bytes(
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + pickle.dumps((1 << 40,), 2)[2:-1]
        + b"C\x01b\x87R.")


def _symlinked_state(target: Path, marker: Path) -> None:
    outside = target.parent / "elsewhere.pkl"
    shutil.move(target / "policy_state.pkl", outside)
    (target / "policy_state.pkl").symlink_to(outside)


def _state_file_outside(target: Path, marker: Path) -> None:
    meta = json.loads((target / "rllib_checkpoint.json").read_text())
    (target / "rllib_checkpoint.json").write_text(json.dumps({**meta, "state_file": "../elsewhere.pkl"}))
    shutil.copy(target / "policy_state.pkl", target.parent / "elsewhere.pkl")
    (target / "policy_state.pkl").unlink()


@pytest.mark.parametrize("make", [_hostile_pickle, _msgpack_bomb, _huge_array, _symlinked_state, _state_file_outside])
def test_a_hostile_checkpoint_is_exit_2_with_nothing_run_or_written(tmp_path, make):
    target = tmp_path / "ck"
    shutil.copytree(CHECKPOINTS / "policy_cloudpickle/checkpoint", target)
    marker = tmp_path / "ran"
    make(target, marker)
    out = tmp_path / "out"
    run = cli("convert", str(target), "--out", str(out))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "error:" in run.stderr and "Traceback" not in run.stderr
    assert not marker.exists() and not out.exists()


@pytest.mark.parametrize("args,message", [
    (["--signature", "x"], "--signature applies to a SavedModel directory (saved_model.pb) only"),
    (["--policy-id", "gamma"], "holds no policy 'gamma'; its policy ids: alpha, beta"),
    ([], "holds 2 policies"),
    (["--policy-id", "alpha", "--all-policies"], "exclude each other"),
])
def test_checkpoint_options_are_checked_before_anything_runs(tmp_path, args, message):
    run = cli("convert", str(CHECKPOINTS / "multi_agent/checkpoint"), "--out", str(tmp_path / "o"), *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert not (tmp_path / "o").exists()


def test_a_directory_of_checkpoints_names_them(tmp_path):
    for step in ("checkpoint_000001", "checkpoint_000002"):
        shutil.copytree(CHECKPOINTS / "policy_msgpack/checkpoint", tmp_path / "run" / step)
    run = cli("convert", str(tmp_path / "run"), "--out", str(tmp_path / "o"))
    assert run.returncode == 2 and "checkpoint_000001, checkpoint_000002: give one of those" in run.stderr, run.stderr


def test_checkpoint_options_on_a_saved_model_are_refused(tmp_path):
    saved_model = CHECKPOINTS.parent / "legacy_algos" / "dqn_plain" / "saved_model"  # RLlib 2.0.1's export
    run = cli("convert", str(saved_model), "--out", str(tmp_path / "o"), "--no-filter")
    assert run.returncode == 2, run.stderr
    assert ("--no-filter applies to an RLlib new API stack checkpoint (torch RLModules) and an RLlib checkpoint "
            "(rllib_checkpoint.json) only") in run.stderr, run.stderr


def test_cli_all_policies(tmp_path):
    run = cli("convert", str(CHECKPOINTS / "multi_agent/checkpoint"), "--out", str(tmp_path / "o"), "--all-policies",
              "--samples", "100", "--explore-samples", "500", "--device", "cpu", "--formats", "onnx")
    assert run.returncode == 0, run.stderr
    assert "MeanStdFilter (n=" in run.stdout
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["alpha", "beta"]


@pytest.mark.parametrize("change,message", [
    (lambda p: p.config["model"].update(fcnet_hiddens="sixteen"), "config cannot be rebuilt"),
    (lambda p: p.config["model"].update(fcnet_activation="Swish"), None),  # RLlib lower-cases it
    (lambda p: p.config["model"].update(fcnet_activation="getattr"), "not one this package rebuilds"),
])
def test_config_values_are_checked(change, message):
    policy = read_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint").policy()
    change(policy)
    if message is None:
        load_checkpoint_policy(policy)[0].close()
        return
    with pytest.raises(ExportError, match=message):
        load_checkpoint_policy(policy)


def test_a_none_activation_is_linear_as_in_rllib():
    policy = read_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint").policy()
    tanh, _ = load_checkpoint_policy(policy)
    policy.config["model"]["fcnet_activation"] = None
    linear, _ = load_checkpoint_policy(policy)
    obs = expected_outputs("ppo_filter")["default_policy/obs"]
    a, b = (p.run(p.observation_feeds(obs))["action_dist_inputs"] for p in (tanh, linear))
    assert np.abs(a - b).max() > 1e-3


def test_inspect_lists_a_checkpoints_policies(tmp_path):
    run = cli("inspect", str(CHECKPOINTS / "multi_agent/checkpoint"), "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["kind"] == "rllib_checkpoint" and doc["ray_version"] == "2.9.3"
    by_id = {p["policy_id"]: p for p in doc["policies"]}
    assert sorted(by_id) == ["alpha", "beta"] and {p["network"] for p in by_id.values()} == {"actor_critic"}
    assert by_id["alpha"]["observation_filter"]["count"] == case_record("multi_agent")["filters"]["alpha"]["n"]
    assert by_id["alpha"]["weights"] == 8 and by_id["beta"]["weights"] == 12
    target = tmp_path / "ck"
    shutil.copytree(CHECKPOINTS / "policy_cloudpickle/checkpoint", target)
    (target / "policy_state.pkl").write_bytes(pickle.dumps({"weights": {"w": _Payload(str(tmp_path / "ran"))}}))
    run = cli("inspect", str(target))
    assert run.returncode == 2 and "system, which is not on the allowlist" in run.stderr and not (tmp_path / "ran").exists()
