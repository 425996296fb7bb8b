"""RLlib checkpoints as users have them: saved to a relative or absolute path, moved or copied
afterwards, in either state format, and written by ``framework("tf2")`` (eager) policies.

All of them were written by RLlib itself (``fixtures/rllib/make_checkpoints.py``): ``saved_relative``
by ``algo.save("checkpoint")`` (RLlib records ``state_file`` as ``checkpoint/algorithm_state.pkl``),
``multi_agent_msgpack`` by RLlib's ``convert_to_msgpack_checkpoint`` into a relative directory, the
others by ``algo.save(<absolute path>)`` on another machine's path, and the ``*_tf2`` ones with
``framework("tf2")``, whose weights are a list without names.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

from policy_export.errors import UnsafeCheckpointError, WeightsError
from policy_export.exporter.convert import convert_checkpoint
from policy_export.exporter.options import ExportOptions
from policy_export.exporter.sources.checkpoint import read_checkpoint
from policy_export.exporter.sources.checkpoint_policy import eager_layout, load_checkpoint_policy, network_kind
from helpers import cli

from tests.checkpoint_matrix import CASES, CHECKPOINTS, case_record, onnx_errors, passes

ONNX_ONLY = ExportOptions(formats=["onnx"], samples=200, explore_samples=1000)
# one of each kind of checkpoint RLlib writes, and how the state_file it records reads
KINDS = {"saved_relative": "Algorithm, cloudpickle, relative", "multi_agent_msgpack": "Algorithm, msgpack, relative",
         "ppo_filter": "Algorithm, cloudpickle, absolute", "multi_agent": "Algorithm, multi-agent, absolute",
         "policy_cloudpickle": "Policy, cloudpickle", "policy_msgpack": "Policy, msgpack",
         "ray25_ppo_filter": "Algorithm (ray 2.5.1, Tune-style), absolute", "ppo_tf2": "Algorithm, tf2, absolute",
         "ray25_saved_relative": "Algorithm (ray 2.5.1, Tune-style), relative, stale"}


def _state_file(case: str) -> str:
    return json.loads((CHECKPOINTS / case / "checkpoint/rllib_checkpoint.json").read_text()).get("state_file", "")


def test_the_fixtures_hold_each_saving_habit():
    recorded = {case: _state_file(case) for case in KINDS}
    assert recorded["saved_relative"] == "checkpoint/algorithm_state.pkl"
    # ray 2.5 saved into checkpoint/checkpoint_000001/, which is the checkpoint given here: stale
    assert recorded["ray25_saved_relative"] == "checkpoint/checkpoint_000001/algorithm_state.pkl"
    assert recorded["multi_agent_msgpack"] == "checkpoint/algorithm_state.msgpck"
    assert os.path.isabs(recorded["ppo_filter"]) and os.path.isabs(recorded["ray25_ppo_filter"])
    assert recorded["policy_msgpack"] == "policy_state.msgpck"  # a Policy checkpoint records the bare name
    assert read_checkpoint(CHECKPOINTS / "multi_agent_msgpack/checkpoint").format == "msgpack"


@pytest.mark.parametrize("case", sorted(KINDS))
def test_a_moved_or_copied_checkpoint_reads_as_where_it_was_saved(tmp_path, case):
    original = read_checkpoint(CHECKPOINTS / case / "checkpoint")
    copied = tmp_path / "copy"
    shutil.copytree(CHECKPOINTS / case / "checkpoint", copied)  # the recorded path: the original, or nowhere
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.copytree(copied, tmp_path / "to_move")
    shutil.move(tmp_path / "to_move", moved)  # the recorded path points nowhere now
    for where in (copied, moved):
        read = read_checkpoint(where)
        assert sorted(read.policies) == sorted(original.policies) == case_record(case)["policy_ids"]
        for pid, policy in read.policies.items():
            mine = original.policies[pid]
            assert policy.weight_count == mine.weight_count
            pairs = zip(policy.weight_list, mine.weight_list) if policy.weight_list is not None else \
                ((policy.weights[k], mine.weights[k]) for k in mine.weights)
            assert all(np.array_equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("case", ["saved_relative", "multi_agent_msgpack", "ray25_saved_relative"])
def test_a_moved_checkpoint_converts_and_matches_rllib(tmp_path, monkeypatch, case):
    moved = tmp_path / "moved"
    shutil.copytree(CHECKPOINTS / case / "checkpoint", moved)
    monkeypatch.chdir(tmp_path)  # where the recorded relative path would land: it holds no checkpoint
    for pid in case_record(case)["policy_ids"]:
        out = tmp_path / "out" / pid
        convert_checkpoint(moved, out, policy_id=pid, device="cpu", options=ONNX_ONLY)
        errors = onnx_errors(out, case, pid)
        assert passes(errors), errors


def test_the_cli_converts_a_relative_save_from_another_directory(tmp_path):
    run = cli("convert", str(CHECKPOINTS / "saved_relative/checkpoint"), "--out", str(tmp_path / "o"),
              "--samples", "100", "--explore-samples", "500", "--device", "cpu", "--formats", "onnx")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "o/model.onnx").is_file()


def _with_state_file(tmp_path, value) -> object:
    target = tmp_path / "ck"
    shutil.copytree(CHECKPOINTS / "saved_relative/checkpoint", target)
    meta = json.loads((target / "rllib_checkpoint.json").read_text())
    (target / "rllib_checkpoint.json").write_text(json.dumps({**meta, "state_file": value}))
    return target


@pytest.mark.parametrize("value", ["checkpoint/algorithm_state.pkl", "/gone/for/good/algorithm_state.pkl",
                                   "../../algorithm_state.pkl", "algorithm_state.pkl"])
def test_a_state_file_that_names_the_state_file_anywhere_else_is_ignored(tmp_path, value):
    assert read_checkpoint(_with_state_file(tmp_path, value)).policy().weight_count == 8


@pytest.mark.parametrize("value,message", [
    ("policies/default_policy/policy_state.pkl", "names another file"),
    ("/etc/passwd", "names another file"),
    ("checkpoint/evil.pkl", "names another file"),
    (["algorithm_state.pkl"], "is not a path"),
    ("", "is not a path"),
])
def test_a_state_file_naming_another_file_is_refused(tmp_path, value, message):
    with pytest.raises(UnsafeCheckpointError, match=message):
        read_checkpoint(_with_state_file(tmp_path, value))


def test_a_state_file_naming_another_file_inside_the_checkpoint_is_refused(tmp_path):
    target = _with_state_file(tmp_path, "sub/algorithm_state.pkl")
    (target / "sub").mkdir()
    shutil.copy(target / "algorithm_state.pkl", target / "sub/algorithm_state.pkl")
    with pytest.raises(UnsafeCheckpointError, match="another file inside the checkpoint"):
        read_checkpoint(target)


def test_a_state_file_through_a_link_leaving_the_checkpoint_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = _with_state_file(tmp_path, "link/algorithm_state.pkl")
    shutil.copy(target / "algorithm_state.pkl", outside / "algorithm_state.pkl")
    (target / "link").symlink_to(outside)
    with pytest.raises(UnsafeCheckpointError, match="another file inside the checkpoint"):
        read_checkpoint(target)
    # and the state file itself a link out of the directory: never followed
    target = tmp_path / "ck2"
    shutil.copytree(CHECKPOINTS / "saved_relative/checkpoint", target)
    (target / "algorithm_state.pkl").unlink()
    (target / "algorithm_state.pkl").symlink_to(outside / "algorithm_state.pkl")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        read_checkpoint(target)


def test_the_policies_are_those_under_policies_as_rllib_lists_them(tmp_path):
    """RLlib's get_checkpoint_info takes the policy ids from the entries of policies/, not from the
    JSON's policy_ids: a policy directory removed after saving is not looked for."""
    target = tmp_path / "ck"
    shutil.copytree(CHECKPOINTS / "multi_agent/checkpoint", target)
    shutil.rmtree(target / "policies/beta")
    assert sorted(read_checkpoint(target).policies) == ["alpha"]
    (target / "policies/beta").symlink_to(target / "policies/alpha")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        read_checkpoint(target)


# ------------------------------------------------------------------------------ framework("tf2")

TF2 = [c for c in CASES if case_record(c).get("framework") == "tf2"]
TF1 = [c for c in CASES if case_record(c).get("framework", "tf") == "tf"]


def test_the_tf2_fixtures_cover_each_family():
    kinds = {network_kind(read_checkpoint(CHECKPOINTS / c / "checkpoint").policy()) for c in TF2}
    assert kinds == {"actor_critic", "q_learning", "soft_actor", "deterministic_actor"}
    models = [case_record(c)["model"] for c in TF2]
    assert any(m.get("use_lstm") for m in models) and any(m.get("conv_filters") for m in models)
    assert any(m.get("free_log_std") for m in models)
    assert {case_record(c)["ray_version"] for c in TF2} == {"2.9.3", "2.5.1"}


@pytest.mark.parametrize("case", TF2)
def test_a_tf2_checkpoint_holds_a_list_that_the_layout_fits(case):
    for policy in read_checkpoint(CHECKPOINTS / case / "checkpoint").policies.values():
        assert policy.framework == "tf2" and not policy.weights
        layout = eager_layout(policy, network_kind(policy))
        assert [tuple(w.shape) for w in policy.weight_list] == [shape for _, shape in layout]


def _graph_names(policy) -> list[tuple[str, tuple]]:
    """A framework("tf") checkpoint's weights in RLlib's model.variables() order, the policy
    scope dropped."""
    return [(name.split("/", 1)[1], tuple(w.shape)) for name, w in policy.weights.items()]


def _unsuffixed(names: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """Layer names without TF's uniquifying suffix (SAC's Q-nets reuse the actor's fc_1: fc_1_1, fc_1_2)."""
    return [(re.sub(r"_\d+(?=/)", "", name), shape) for name, shape in names]


@pytest.mark.parametrize("case", TF1)
def test_the_layout_is_rllibs_own_variable_order(case):
    """The order the layout gives is the order RLlib's own framework("tf") checkpoints list their
    named weights in (the same model.variables()), for every network and configuration here."""
    for policy in read_checkpoint(CHECKPOINTS / case / "checkpoint").policies.values():
        kind = network_kind(policy)
        ours, theirs = eager_layout(policy, kind), _graph_names(policy)
        if kind == "soft_actor":  # the graph scopes the Q-nets by suffix, the layout by prefix
            ours = _unsuffixed([(re.sub(r"^(twin_)?q_net/", "", name), shape) for name, shape in ours])
            theirs = _unsuffixed(theirs)
        if kind == "deterministic_actor":  # the graph scopes DDPG's Q-nets as Keras's Sequential does
            ours = [(re.sub(r"^(twin_)?q_model/sequential(_\d+)?/", "", name), shape) for name, shape in ours]
            theirs = [(re.sub(r"^sequential(_\d+)?/", "", name), shape) for name, shape in theirs]
        assert ours == theirs


def _policy(case: str):
    return read_checkpoint(CHECKPOINTS / case / "checkpoint").policy()


def test_a_tf2_list_of_another_length_is_refused_with_both_named():
    policy = _policy("ppo_tf2")
    policy.config["model"]["fcnet_hiddens"] = [16, 16]
    with pytest.raises(WeightsError, match=r"holds 8 weights, the network its config describes has 12 "
                                           r"\(fc_1/kernel \[4, 16\]"):
        load_checkpoint_policy(policy)


def test_a_tf2_list_whose_shapes_do_not_fit_names_each_place():
    policy = _policy("ppo_box_tf2")
    policy.weight_list[0], policy.weight_list[4] = policy.weight_list[4], policy.weight_list[0]
    with pytest.raises(WeightsError) as raised:
        load_checkpoint_policy(policy)
    message = str(raised.value)
    assert "weight 0 is [16, 8], where the network its config describes has fc_1/kernel [3, 16]" in message
    assert "weight 4 is [3, 16]" in message and "model.variables()" in message


def test_a_tf2_list_the_same_shapes_cannot_tell_apart_follows_rllibs_order():
    """fc_1 and fc_value_1 have the same shape; the list's order is what tells them apart, and the
    export computes what RLlib computes only in RLlib's order (the matrix test), not swapped."""
    policy = _policy("ppo_tf2")
    layout = eager_layout(policy, network_kind(policy))
    assert [name for name, _ in layout[:4]] == ["fc_1/kernel", "fc_1/bias", "fc_value_1/kernel", "fc_value_1/bias"]
    assert layout[0][1] == layout[2][1]
    obs = np.load(CHECKPOINTS / "ppo_tf2/expected.npz")["default_policy/obs"]
    right, _ = load_checkpoint_policy(policy)
    policy.weight_list[0], policy.weight_list[2] = policy.weight_list[2], policy.weight_list[0]
    swapped, _ = load_checkpoint_policy(policy)
    a, b = (p.run(p.observation_feeds(obs))["action_dist_inputs"] for p in (right, swapped))
    assert np.abs(a - b).max() > 1e-3
    np.testing.assert_allclose(a, np.load(CHECKPOINTS / "ppo_tf2/expected.npz")["default_policy/action_dist_inputs"],
                               atol=1e-5, rtol=1e-5)


def test_inspect_says_a_checkpoint_is_tf2(tmp_path):
    run = cli("inspect", str(CHECKPOINTS / "sac_tf2/checkpoint"), "--json")
    assert run.returncode == 0, run.stderr
    policy = json.loads(run.stdout)["policies"][0]
    assert (policy["framework"], policy["weights"], policy["network"]) == ("tf2", 19, "soft_actor")
    assert policy["policy_class"] == "SACTFPolicy"  # RLlib pickles this eager class by value: read as its name
