"""The benchmark's yardstick: the minimal ONNX graph computes the policy's deterministic actions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from benchmarks.minimal import minimal_mlp
from conftest import ROOT
from policy_export.exporter.formats.onnx.model import inference_session
from policy_export.exporter.parity.compare import sample_observations


@pytest.mark.parametrize("name", ["cartpole_mlp", "pendulum_mlp"])
def test_minimal_graph_matches_the_policy(name, policies, tmp_path):
    import onnx

    policy = policies(name)
    spec_model = policy.model
    hiddens = [layer.units for layer in spec_model.layers if layer.name.startswith("fc_") and layer.name != "fc_out"]
    activation = spec_model.get_layer("fc_1").activation.__name__
    obs_dim = int(np.prod(policy.observation_space.shape))
    model = minimal_mlp(policy.get_weights(), hiddens, activation, obs_dim, policy.action_space)
    onnx.save(model, tmp_path / "minimal.onnx")
    obs = sample_observations(policy.observation_space, 500, 3)["observations"]
    got = inference_session(tmp_path / "minimal.onnx", threads=1).run(None, {"observations": obs})[0]
    want = policy.run({"observations": obs}, ["actions_0"])["actions_0"]
    if np.issubdtype(want.dtype, np.integer):
        assert np.array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert len(model.graph.node) == 2 * len(hiddens) + 1 + (1 if np.issubdtype(want.dtype, np.integer) else 3)


def test_benchmark_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 0 and "--quick" in proc.stdout
    assert "with --quick, nowhere unless given" in " ".join(proc.stdout.split())
