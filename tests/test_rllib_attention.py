"""RLlib's attention net (``use_attention``: ``AttentionWrapper`` around ``GTrXLNet``) converted from a checkpoint.

The checkpoints under ``fixtures/rllib/checkpoints/attention/`` were written by RLlib 2.9.3 itself
(``fixtures/rllib/make_attention.py``), with RLlib's own ``policy.compute_actions(explore=False)``
stepped over 4 sequences of 12 steps in ``expected.npz``: each step fed the memory window
``state_in_<i>`` ``[B, memory, attention_dim]``, the row RLlib returned (``state_out_<i>``)
appended to the window for the next step. Each test converts a checkpoint without ray and steps
``model.onnx`` on the raw observations, its own ``state_out_<i>`` (the next window) fed back.
"""

from __future__ import annotations

import numpy as np
import pytest

from policy_export.errors import ExportError, WeightsError
from policy_export.exporter.convert import convert_checkpoint
from policy_export.exporter.options import ExportOptions
from policy_export.exporter.sources.checkpoint import read_checkpoint
from policy_export.exporter.sources.checkpoint_policy import load_checkpoint_policy

from tests.checkpoint_matrix import ATOL, RTOL, CHECKPOINTS, OnnxPolicy, case_record, expected_outputs

ROOT = CHECKPOINTS / "attention"
CASES = ["ppo_attention", "ppo_attention_box"]
PID = "default_policy"
ONNX_ONLY = ExportOptions(formats=["onnx"], samples=200, explore_samples=1000)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            out = tmp_path_factory.mktemp(case) / "export"
            convert_checkpoint(ROOT / case / "checkpoint", out, device="cpu", options=ONNX_ONLY)
            made[case] = out
        return made[case]

    return get


def _error(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max abs error, max error in units of ATOL + RTOL * |RLlib's|)."""
    err = np.abs(got.astype(np.float64) - want.reshape(got.shape))
    return float(err.max()), float((err / (ATOL + RTOL * np.abs(want.reshape(got.shape)))).max())


def stepped_errors(policy: OnnxPolicy, expected: dict) -> dict[str, tuple[float, float]]:
    """``model.onnx`` stepped as RLlib was, against RLlib's outputs at every step."""
    units = sum(1 for k in expected if k.startswith(f"{PID}/state_in_"))
    state = [expected[f"{PID}/state_in_{i}"][0] for i in range(units)]
    steps = expected[f"{PID}/obs"].shape[0]
    actions = "env_actions" if f"{PID}/env_actions" in expected else "actions"
    worst: dict[str, tuple[float, float]] = {}
    for t in range(steps):
        got = policy.run({"observations": expected[f"{PID}/obs"][t], "seq_lens": np.ones(len(state[0]), np.int32),
                          **{f"state_in_{i}": s for i, s in enumerate(state)}})
        want = expected[f"{PID}/{actions}"][t]
        found = {"action_dist_inputs": _error(got["action_dist_inputs"], expected[f"{PID}/action_dist_inputs"][t]),
                 "vf_preds": _error(got["vf_preds"], expected[f"{PID}/vf_preds"][t])}
        if np.issubdtype(want.dtype, np.integer):
            assert np.array_equal(got["actions_0"], want), (t, got["actions_0"], want)
        else:
            found["actions_0"] = _error(got["actions_0"], want)
        for i in range(units):  # RLlib's row is the last row of the export's next window
            found[f"state_out_{i}"] = _error(got[f"state_out_{i}"][:, -1], expected[f"{PID}/state_out_{i}"][t])
            if t + 1 < steps:
                found[f"window_{i}"] = _error(got[f"state_out_{i}"], expected[f"{PID}/state_in_{i}"][t + 1])
        worst.update({k: max(v, worst.get(k, (0.0, 0.0))) for k, v in found.items()})
        state = [got[f"state_out_{i}"] for i in range(units)]
    return worst


@pytest.mark.parametrize("case", CASES)
def test_model_onnx_steps_as_rllib_stepped_the_attention_net(exported, case):
    policy = OnnxPolicy(exported(case))
    units = case_record(case, ROOT)["model"]["attention_num_transformer_units"]
    memory, dim = (case_record(case, ROOT)["model"][k] for k in ("attention_memory_inference", "attention_dim"))
    assert policy.required == ["observations", *(f"state_in_{i}" for i in range(units)), "seq_lens"]
    inputs = {s["key"]: s for s in policy.manifest["contract"]["inputs"]}
    assert inputs["state_in_0"]["shape"] == [None, memory, dim]
    errors = stepped_errors(policy, expected_outputs(case, ROOT))
    print(case, {k: f"{v[0]:.1e}" for k, v in errors.items()})  # the largest absolute error per output
    assert {"action_dist_inputs", "vf_preds", "state_out_0", "window_0"} <= set(errors)
    assert all(units_ <= 1.0 for _, units_ in errors.values()), errors


def test_a_sequence_of_length_zero_keeps_its_memory(exported):
    policy = OnnxPolicy(exported("ppo_attention"))
    expected = expected_outputs("ppo_attention", ROOT)
    window = expected[f"{PID}/state_in_0"][5]
    got = policy.run({"observations": expected[f"{PID}/obs"][5], "state_in_0": window,
                      "seq_lens": np.array([1, 0, 1, 0], np.int32)})
    np.testing.assert_array_equal(got["state_out_0"][[1, 3]], window[[1, 3]])
    np.testing.assert_allclose(got["state_out_0"][[0, 2]], expected[f"{PID}/state_in_0"][6][[0, 2]], atol=1e-5)


def _policy(case: str = "ppo_attention"):
    return read_checkpoint(ROOT / case / "checkpoint").policy()


@pytest.mark.parametrize("change,error,message", [
    ({"attention_use_n_prev_actions": 2}, ExportError, "the attention net fed previous actions or rewards"),
    ({"attention_memory_inference": 0}, ExportError, "model.attention_memory_inference is 0, not an integer from 1"),
    ({"attention_dim": 0}, ExportError, "model.attention_dim is 0, not an integer from 1"),
    ({"use_lstm": True}, ExportError, "use_lstm and use_attention are both set"),
    ({"attention_dim": 32}, WeightsError, r"dense/kernel has shape \[16, 16\], the config implies \[16, 32\]"),
    ({"attention_head_dim": 4}, WeightsError, r"shape \[2, 8\], the config implies \[2, 4\]"),
    ({"attention_num_transformer_units": 2}, WeightsError, "implies 3 unnamed Dense layers .* and 4 position biases"),
])
def test_a_config_that_does_not_fit_the_attention_weights_is_refused(change, error, message):
    policy = _policy()
    policy.config["model"].update(change)
    with pytest.raises(error, match=message):
        load_checkpoint_policy(policy)


def test_a_missing_attention_layer_is_named():
    policy = _policy()
    for name in [n for n in policy.weights if "/mha_1/gru_gate/" in n]:
        del policy.weights[name]
    with pytest.raises(WeightsError, match=r"implies one mha_1/gru_gate\* layer, the checkpoint holds 0"):
        load_checkpoint_policy(policy)


def test_a_tf2_attention_checkpoint_is_refused_by_name():
    policy = read_checkpoint(CHECKPOINTS / "ppo_tf2/checkpoint").policy()
    policy.config["model"].update(use_attention=True)
    with pytest.raises(ExportError, match=r"framework\('tf2'\) attention net is not rebuilt: RLlib's eager "
                                          r"checkpoint keeps one of the variables that share a name"):
        load_checkpoint_policy(policy)
