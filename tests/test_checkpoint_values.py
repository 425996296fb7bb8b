"""A checkpoint's config, spaces and filter statistics are checked before a graph is built from them.

Each case reads a real RLlib checkpoint of ``fixtures/rllib/checkpoints/`` and changes one value of
its parsed config or spaces in memory (what a checkpoint written with that value reads as), or,
for the command line, re-writes the value in a copy of a msgpack checkpoint's own file.
"""

from __future__ import annotations

import json
import math
import shutil

import gymnasium as gym
import msgpack
import numpy as np
import pytest

from policy_export.errors import ExportError
from policy_export.exporter.convert import convert_checkpoint
from policy_export.exporter.options import ExportOptions
from policy_export.exporter.sources.checkpoint import read_checkpoint
from policy_export.exporter.sources.safe_pickle import Record
from policy_export.exporter.verify import verify_export
from helpers import cli, messages

from tests.checkpoint_matrix import CHECKPOINTS

ONNX_ONLY = ExportOptions(formats=["onnx"], samples=100, explore_samples=500)


def _policy(checkpoint, pid=None):
    return checkpoint.policy(pid)


def _no_leftovers(tmp_path, out) -> None:
    assert not out.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".pe-")]


def _model(key, value):
    return lambda p: p.config["model"].update({key: value})


def _obs(space):
    def change(p):
        p.observation_space, p.original_observation_space = space, None
    return change


@pytest.mark.parametrize("case,change,message", [
    ("ppo_filter", _model("fcnet_hiddens", [16, 0]), "model.fcnet_hiddens[1] is 0, not an integer from 1"),
    ("ppo_filter", _model("post_fcnet_hiddens", [-3]), "model.post_fcnet_hiddens[0] is -3"),
    ("ppo_filter", _obs(gym.spaces.Box(0, 1, (0,))), "observation_space has shape [0]: it holds no values"),
    ("ppo_filter", lambda p: setattr(p, "action_space", gym.spaces.Box(-1, 1, (0,))),
     "action_space has shape [0]: it holds no values"),
    ("ppo_filter", lambda p: setattr(p, "action_space", gym.spaces.MultiDiscrete([])),
     "action_space is MultiDiscrete([]): a zero-width part"),
    ("ppo_filter", lambda p: setattr(p, "original_observation_space", gym.spaces.MultiDiscrete([1 << 20] * 32)),
     "observation_space flattens to 33554432 values, more than 16777216"),
    ("ppo_lstm", _model("lstm_cell_size", 0), "model.lstm_cell_size is 0, not an integer from 1"),
    ("ppo_lstm", _model("max_seq_len", 0), "model.max_seq_len is 0, not an integer from 1 to 65536"),
    ("ppo_lstm", _model("lstm_cell_size", 16.0), "model.lstm_cell_size is 16.0, not an integer"),
    ("ppo_image", _model("conv_filters", [[8, [4, 4], 2], [0, [4, 4], 2]]), "model.conv_filters[1] filters is 0"),
    ("ppo_image", _model("conv_filters", [[8, [0, 4], 2], [16, [4, 4], 2]]), "model.conv_filters[0] kernel is 0"),
])
def test_a_zero_width_layer_or_space_is_refused_before_tensorflow(tmp_path, case, change, message):
    checkpoint = read_checkpoint(CHECKPOINTS / case / "checkpoint")
    change(_policy(checkpoint))
    out = tmp_path / "out"
    with pytest.raises(ExportError) as info:
        convert_checkpoint(checkpoint, out, device="cpu", options=ONNX_ONLY)
    assert message in str(info.value) and "its config cannot be rebuilt" in str(info.value)
    _no_leftovers(tmp_path, out)


def test_a_zero_width_layer_whose_weights_fit_it_is_refused(tmp_path):
    """Weights of zero width that match a zero-width config pass every shape check: only the
    config check stops the degenerate graph (without it the export is written)."""
    checkpoint = read_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint")
    policy = _policy(checkpoint)
    policy.config["model"]["fcnet_hiddens"] = [16, 0]
    for name, shape in {"fc_2/kernel": (16, 0), "fc_2/bias": (0,), "fc_out/kernel": (0, 2),
                        "fc_value_2/kernel": (16, 0), "fc_value_2/bias": (0,), "value_out/kernel": (0, 1)}.items():
        policy.weights[f"default_policy/{name}"] = np.zeros(shape, np.float32)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"model.fcnet_hiddens\[1\] is 0, not an integer from 1 to 65536"):
        convert_checkpoint(checkpoint, out, device="cpu", options=ONNX_ONLY)
    _no_leftovers(tmp_path, out)


def test_the_command_line_refuses_a_zero_width_layer_with_exit_2(tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(CHECKPOINTS / "policy_msgpack/checkpoint", target)
    state_file = target / "policy_state.msgpck"
    state = msgpack.unpackb(state_file.read_bytes(), strict_map_key=False)
    state["policy_spec"]["config"]["model"]["fcnet_hiddens"] = [0]
    state_file.write_bytes(msgpack.packb(state))
    out = tmp_path / "out"
    run = cli("convert", str(target), "--out", str(out), "--samples", "50", "--device", "cpu", isolated=True)
    assert run.returncode == 2, run.returncode
    assert "model.fcnet_hiddens[0] is 0" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    # one message after the progress lines of the stages that finished (TensorFlow loaded)
    assert len([m for m in messages(run.stderr) if not m.startswith("[policy-export] ")]) == 1, run.stderr[-2000:]
    _no_leftovers(tmp_path, out)


# ------------------------------------------------------------------- values the graph uses

def _filter(**values):
    def change(p):
        for key, value in values.items():
            setattr(p.filter, key, value)
    return change


@pytest.mark.parametrize("case,change,message", [
    ("ppo_filter", _filter(clip=float("nan")), "observation filter clip is nan, not a finite number"),
    ("ppo_filter", _filter(clip=-1.0), "observation filter clip is -1.0, not positive"),
    ("ppo_filter", _filter(n=10**40), "observation filter count is <int of 133 bits>, not an integer"),
    ("ppo_filter", _filter(mean=np.array([0, np.inf, 0, 0])), "filter's mean holds values that are not finite"),
    ("ppo_filter", _filter(m2=np.array([0, np.nan, 0, 0])), "standard deviation holds values that are not finite"),
    ("ppo_filter", lambda p: p.config.update(normalize_actions=Record()), "normalize_actions is <record ?>"),
    ("ppo_filter", _model("vf_share_layers", float("nan")), "model.vf_share_layers is nan, not true or false"),
    ("dqn_c51", lambda p: p.config.update(v_max=float("inf")), "v_max is inf, not a finite number"),
    ("dqn_c51", lambda p: p.config.update(hiddens=[0]), "hiddens[0] is 0"),
])
def test_a_value_the_graph_uses_must_be_finite_and_in_range(tmp_path, case, change, message):
    checkpoint = read_checkpoint(CHECKPOINTS / case / "checkpoint")
    change(_policy(checkpoint))
    out = tmp_path / "out"
    with pytest.raises(ExportError) as info:
        convert_checkpoint(checkpoint, out, device="cpu", options=ONNX_ONLY)
    assert message in str(info.value)
    assert len(str(info.value)) < 1000
    _no_leftovers(tmp_path, out)


def test_unused_values_that_are_not_json_stay_out_of_the_manifest_and_verify_passes(tmp_path):
    checkpoint = read_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint")
    policy = _policy(checkpoint)
    policy.config["model"].update(lstm_cell_size=float("nan"), max_seq_len=10**40, conv_filters=Record(),
                                  conv_activation=float("inf"), lstm_use_prev_action_reward=float("-inf"))
    policy.global_timestep = 10**40
    policy.policy_class = "m" * 5000 + ".PPOTF1Policy"
    policy.weights["default_policy/unused\ud800"] = np.zeros(2, np.float32)  # not UTF-8 text
    policy.weights["default_policy/" + "w" * 2000] = np.zeros(2, np.float32)
    out = tmp_path / "out"
    convert_checkpoint(checkpoint, out, device="cpu", options=ONNX_ONLY)
    source = json.loads((out / "manifest.json").read_text())["source"]
    assert source["model_not_recorded"] == ["conv_activation", "conv_filters", "lstm_cell_size", "max_seq_len"]
    assert source["model"]["fcnet_hiddens"] == [16, 16] and "lstm_cell_size" not in source["model"]
    assert source["global_timestep"] is None and source["policy_class"] is None
    assert source["weights_not_recorded"] == 2 and not any("unused" in n for n in
                                                           source["weights_not_in_the_served_graph"])
    assert verify_export(out, samples=20, device="cpu").passed


def test_a_left_out_filter_with_values_out_of_range_is_recorded_as_null(tmp_path):
    checkpoint = read_checkpoint(CHECKPOINTS / "ppo_filter/checkpoint")
    policy = _policy(checkpoint)
    policy.filter.clip, policy.filter.n = float("nan"), 10**40
    out = tmp_path / "out"
    convert_checkpoint(checkpoint, out, use_filter=False, device="cpu", options=ONNX_ONLY)
    left_out = json.loads((out / "manifest.json").read_text())["source"]["observation_filter_left_out"]
    assert left_out["clip"] is None and left_out["count"] is None and left_out["std"] is None
    assert left_out["mean"] == pytest.approx(policy.filter.mean.tolist()) and not math.isnan(left_out["mean"][0])
    assert verify_export(out, samples=20, device="cpu").passed
