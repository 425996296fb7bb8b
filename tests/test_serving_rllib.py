"""The serving targets on policies RLlib wrote (checkpoints converted without ray): a DQN whose
optional inputs (no explore) stay inputs, and an LSTM with previous action and reward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES_DIR

CHECKPOINTS = FIXTURES_DIR / "rllib" / "checkpoints"
SERVING = ["saved_model", "triton", "tf_serving", "openvino"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("openvino", reason="OpenVINO is not installed (the serving extra)")
    from policy_export.exporter import convert_checkpoint

    made = {}

    def get(name: str):
        if name not in made:
            out = tmp_path_factory.mktemp("serving_rllib") / name
            convert_checkpoint(CHECKPOINTS / name / "checkpoint", out, device="cpu", samples=100, explore_samples=1000,
                               stepped_steps=20, formats=SERVING)
            made[name] = out
        return made[name]

    return get


def test_a_dqn_without_explore_serves_its_optional_inputs_in_openvino_and_folds_them_for_triton(converted):
    from policy_export.exporter.cli import main

    out = converted("dqn_c51")
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["parity"]["passed"] and "missing" not in doc
    assert list(doc["formats"]["triton"]["models"]) == ["q_agent"]  # no sampling model: DQN does not explore here
    assert doc["formats"]["triton"]["models"]["q_agent"]["inputs"] == ["observations"]
    errors = doc["parity"]["max_abs_err"]
    assert errors["openvino/q_values"] < 1e-5 and errors["triton/q_values"] < 1e-5
    import openvino as ov

    model = ov.Core().read_model(str(out / "openvino" / "model.xml"))
    assert sorted(p.get_any_name() for p in model.inputs) == ["is_training", "observations", "timestep"]
    assert main(["verify", str(out), "-q"]) == 0


def test_an_rllib_lstm_with_previous_action_and_reward_on_every_target(converted):
    out = converted("ppo_lstm_prev")
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["parity"]["passed"]
    record = doc["formats"]["triton"]["models"]["default_policy"]
    assert record["inputs"] == ["observations", "prev_action", "prev_reward"]
    assert [s for s, _ in record["states"]] == ["state_in_0", "state_in_1"]
    stepped = {k: v for k, v in doc["parity"]["max_abs_err"].items() if "(stepped" in k}
    assert any(k.startswith("triton (stepped") for k in stepped) and any(k.startswith("openvino (stepped") for k in stepped)
    assert max(stepped.values()) < 1e-4
    request = json.loads((out / "tf_serving" / "default_policy" / "requests" / "predict_request.json").read_text())
    assert {"prev_action", "prev_reward", "state_in_0", "seq_lens"} <= set(request["inputs"])
    assert np.all(np.asarray(request["inputs"]["state_in_0"]) == 0)
