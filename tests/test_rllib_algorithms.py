"""Every RLlib algorithm fixture converted, and every written format against RLlib's own actions.

The fixtures are RLlib's own exports (``fixtures/rllib/make_legacy_algos.py``,
``make_keras_algos.py``); the reference is RLlib's ``compute_actions(explore=False)`` in each
fixture's ``expected.npz``. See :mod:`tests.rllib_matrix` (``python -m tests.rllib_matrix``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests import rllib_matrix

pytestmark = pytest.mark.slow

# What cannot be made or run yet, per case: the formats that may fail or be missing. Anything
# else must be written and reproduce RLlib within 1e-5 (discrete actions identical).
# DDPG's Ornstein-Uhlenbeck noise keeps state between calls: exploration is refused
STATEFUL_EXPLORATION = {case for case in rllib_matrix.cases()
                        if rllib_matrix.load_case(*case)[0].get("exploration_class") == "OrnsteinUhlenbeckNoise"}
KNOWN_GAPS = {
    ("legacy_algos", "r2d2"): {"onnx_deterministic"},  # recurrent: no separate deterministic model
    # explore refused: model.onnx is deterministic
    **{case: {"onnx_deterministic"} for case in STATEFUL_EXPLORATION},
}
NOT_CONVERTED = {
    ("keras_algos", "dqn"),  # RLlib's Keras model holds the base network only, not the Q head
    ("keras_algos", "sac_box"), ("keras_algos", "sac_discrete"), ("keras_algos", "cql"),  # export_model wrote nothing
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("algos")


@pytest.fixture(scope="module")
def rows(work):
    return {(route, name): rllib_matrix.run_case(route, name, work) for route, name in rllib_matrix.cases()}


def test_every_fixture_is_listed(rows):
    assert len(rows) >= 25
    assert NOT_CONVERTED <= set(rows)


@pytest.mark.parametrize("case", rllib_matrix.cases(), ids=lambda c: f"{c[0]}/{c[1]}")
def test_written_formats_reproduce_rllib(rows, case):
    row = rows[case]
    if case in NOT_CONVERTED:
        assert "failed" in row, f"{case} converts now: take it out of NOT_CONVERTED"
        return
    assert "failed" not in row, row.get("failed")
    gaps = KNOWN_GAPS.get(case, set())
    for name, record in row["formats"].items():
        short = "model.onnx" if name.startswith("model.onnx") else name
        if "failed" in record:
            assert short in gaps, f"{name}: {record['failed']}"
            continue
        for key, err in record["errors"].items():
            assert err <= rllib_matrix.ATOL and not math.isinf(err), f"{name} {key}: {err}"
    working = {("model.onnx" if f.startswith("model.onnx") else f) for f, r in row["formats"].items()
               if "failed" not in r}
    for name in ("saved_model", "frozen_graph", "onnx", "onnx_deterministic"):
        assert name in working or name in gaps, f"{name} not written: {row.get('missing')}"
    closed = gaps & working
    assert not closed, f"{sorted(closed)} work now: take them out of KNOWN_GAPS"


def test_inputs_no_output_reads_are_left_out(rows):
    """RLlib's SAC signature carries prev_action/prev_reward; its feed-forward network never reads them."""
    for case in (("legacy_algos", "sac_discrete"), ("legacy_algos", "cql")):
        assert set(rows[case]["unused_inputs"]) == {"prev_action", "prev_reward"}, case
    sac = rows[("legacy_algos", "sac_discrete")]["formats"]
    listed = next(r for f, r in sac.items() if f.startswith("model.onnx"))
    assert listed["errors"]["actions"] == 0.0


def test_every_legacy_export_is_written_whole(rows):
    """Every ray 2.0.1 fixture converts, and no format is missing from its export."""
    for (route, name), row in rows.items():
        if route == "legacy_algos":
            assert "failed" not in row and row["missing"] == {}, (name, row.get("failed"), row.get("missing"))


def test_stateful_exploration_is_refused_with_the_reason(rows):
    """DDPG's Ornstein-Uhlenbeck noise keeps state between calls: the export serves RLlib's
    deterministic path, has no explore input, and its manifest says why."""
    assert {name for _, name in STATEFUL_EXPLORATION} >= {"ddpg", "ddpg_ou", "ddpg_tf_first"}
    for case in STATEFUL_EXPLORATION:
        ddpg = rows[case]
        assert "explore" not in ddpg["inputs"] and "ou_state" in ddpg["explore_refused"], case
        assert ddpg["formats"]["saved_model"]["errors"]["actions"] <= rllib_matrix.ATOL
    for name, row in rows.items():
        if name not in STATEFUL_EXPLORATION and "failed" not in row:
            assert row["explore_refused"] is None, name


def test_tensorflow_imported_before_rllib_gives_functional_conds(rows):
    """A script that imports TensorFlow before RLlib leaves TF's v2 control flow on: RLlib's
    tf.cond are functional If ops (no Switch). Those exports convert whole and reproduce RLlib,
    the explore switch folded through the If (DDPG: the deterministic path without the noise
    state's update; DQN: explore kept, greedy by default)."""
    from tensorflow.core.protobuf import saved_model_pb2

    cases = [c for c in rllib_matrix.cases() if rllib_matrix.load_case(*c)[0].get("tensorflow_imported_first")]
    assert {name for _, name in cases} >= {"ddpg_tf_first", "dqn_tf_first"}
    for route, name in cases:
        model = saved_model_pb2.SavedModel()
        model.ParseFromString((rllib_matrix.FIXTURES / route / name / "saved_model/saved_model.pb").read_bytes())
        ops = {n.op for n in model.meta_graphs[0].graph_def.node}
        assert ops & {"If", "StatelessIf"} and not ops & {"Switch", "Merge"}, (name, sorted(ops))
        assert "failed" not in rows[(route, name)] and rows[(route, name)]["missing"] == {}
    assert "explore" in rows[("legacy_algos", "dqn_tf_first")]["inputs"]


def _greedy_share(run, obs: np.ndarray, timestep: int, n: int = 3000) -> float:
    feeds = {"observations": np.repeat(obs[None], n, axis=0), "explore": np.array(True),
             "timestep": np.array(timestep, np.int64)}
    out = run(feeds)
    greedy = int(np.argmax(out["action_dist_inputs"][0]))
    return float(np.mean(out["actions_0"] == greedy))


def test_epsilon_greedy_follows_rllibs_schedule_in_onnx(rows, work):
    """DQN's model.onnx explores as RLlib's own graph (run by TensorFlow from the SavedModel) does:
    epsilon from the timestep input along the schedule RLlib's loop looked up (1.0 at the start
    of RLlib's default schedule, its final epsilon past the end)."""
    import onnxruntime as ort

    from policy_export.exporter.devices import plan_devices
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.verify import load_runner

    assert "failed" not in rows[("legacy_algos", "dqn_plain")]
    out = work / "legacy_algos-dqn_plain"
    _, expected = rllib_matrix.load_case("legacy_algos", "dqn_plain")
    obs = expected["observations"][0]
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    onnx_run = lambda feeds: dict(zip(names, session.run(None, feeds)))  # noqa: E731
    with load_runner("saved_model", out, read_manifest(out), plan_devices("cpu")) as tf_run:
        for timestep in (0, 5_000, 1_000_000):
            a, b = _greedy_share(onnx_run, obs, timestep), _greedy_share(tf_run, obs, timestep)
            assert abs(a - b) < 0.06, (timestep, a, b)  # 3000 draws each: about 5 standard errors
            if timestep == 0:
                assert 0.4 < a < 0.6  # epsilon 1: uniform over the 2 actions
            if timestep == 1_000_000:
                assert a > 0.95  # the final epsilon
