"""A recurrent SavedModel carries ``get_initial_state`` (as TF-Agents' PolicySaver does), so a TF
Serving client asks the export for the state an episode starts from."""

from __future__ import annotations

import numpy as np

from conftest import FIXTURES_DIR


def test_a_recurrent_saved_model_serves_its_initial_state(tmp_path):
    import tensorflow as tf

    from policy_export import export_spec

    result = export_spec(FIXTURES_DIR / "cartpole_lstm", tmp_path / "out", formats=["saved_model"], samples=20,
                         explore_samples=0, stepped_steps=4, device="cpu")
    contract = {s["key"]: s for s in result.manifest["contract"]["inputs"]}
    loaded = tf.saved_model.load(str(tmp_path / "out/saved_model"))
    start = {k: v.numpy() for k, v in loaded.signatures["get_initial_state"](batch_size=tf.constant(3)).items()}
    assert sorted(start) == sorted(k for k in contract if k.startswith("state_in_"))
    for key, value in start.items():
        assert value.shape == (3, *contract[key]["shape"][1:]) and not value.any()
        assert value.dtype == np.dtype(contract[key]["dtype"])
    assert "get_initial_state" not in tf.saved_model.load(
        str(_feedforward(tmp_path))).signatures


def _feedforward(tmp_path):
    from policy_export import export_spec

    export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "ff", formats=["saved_model"], samples=20,
                explore_samples=0, device="cpu")
    return tmp_path / "ff/saved_model"
