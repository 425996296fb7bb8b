"""Every gymnasium space: keys per leaf, image layout, exploration statistics, property tests."""

from __future__ import annotations

import json
import os

import gymnasium as gym
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES_DIR
from policy_export.exporter import ParityFailedError, export_policy, export_spec
from policy_export.exporter.formats.onnx import model as onnx_model
from policy_export.exporter.formats.tf_runner import TFGraphRunner
from policy_export.exporter.devices import plan_devices
from policy_export.exporter.defaults import DEFAULT_ALPHA
from policy_export.policy import TFPolicy, UnsupportedSpaceError, spec_from_json
from policy_export.policy.spaces import leaves, space_to_json

settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("thorough", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def onnx_io(path) -> tuple[dict, dict]:
    model = onnx.load(path)
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    return {i.name: dims(i) for i in model.graph.input}, {o.name: dims(o) for o in model.graph.output}


def test_dict_observation_leaves_are_keyed_by_nest_path_in_every_format(exports):
    result, out = exports("dict_image_vector")
    expected = ["observations/camera", "observations/state"]
    assert list(result.manifest["keys"]["observations"]) == expected
    assert result.manifest["keys"]["observations"]["observations/camera"] == ["camera"]
    with TFGraphRunner.from_saved_model(out / "saved_model", plan_devices("cpu")) as runner:
        assert set(expected) <= set(runner.inputs)
        assert runner.inputs["observations/camera"].dtype == "uint8"
    inputs, _ = onnx_io(out / "model.onnx")
    assert inputs["observations/camera"] == ["batch", 32, 32, 3]  # NHWC kept by default
    assert inputs["observations/state"] == ["batch", 5]


def test_tuple_action_outputs_follow_flatten_order(exports):
    result, out = exports("tuple_action")
    outputs = {o["key"]: o for o in result.manifest["contract"]["outputs"]}
    assert outputs["actions_0"]["dtype"] == "int64" and outputs["actions_0"]["shape"] == [None]
    assert outputs["actions_1"]["dtype"] == "float32" and outputs["actions_1"]["shape"] == [None, 2]
    assert outputs["action_dist_inputs"]["shape"] == [None, 3 + 2 * 2]
    assert result.manifest["keys"]["actions"] == {"actions_0": ["0"], "actions_1": ["1"]}
    _, onnx_outputs = onnx_io(out / "model.onnx")
    assert list(onnx_outputs)[:2] == ["actions_0", "actions_1"]


@pytest.mark.parametrize("name, kinds", [
    ("tuple_action", {"chi-square homogeneity", "two-sample Kolmogorov-Smirnov"}),
    ("multibinary_action", {"chi-square homogeneity"}),
    ("discrete_obs", {"chi-square homogeneity"}),
    ("pendulum_mlp", {"two-sample Kolmogorov-Smirnov"}),
])
def test_exploration_parity_states_its_tests_and_passes(name, kinds, exports):
    result, _ = exports(name)
    checks = result.parity.exploration
    assert {c.test for c in checks} == kinds
    assert {c.format for c in checks} == {"saved_model", "frozen_graph", "onnx"}
    assert all(c.samples * 4 >= 10_000 for c in checks)  # 4 observations, >= 10,000 draws per runtime
    threshold = DEFAULT_ALPHA / (len(checks) / 3)  # Bonferroni over each format's family of tests
    assert DEFAULT_ALPHA == 1e-6
    assert all(c.threshold == pytest.approx(threshold) and c.p_value >= threshold for c in checks)
    logp = [r for r in result.parity.records if r.key == "action_logp of its samples"]
    assert {r.format for r in logp} == {"saved_model (explore)", "frozen_graph (explore)", "onnx (explore)"}
    assert all(r.passed and r.max_abs_err <= 1e-5 and r.shape[0] > 1000 for r in logp)
    summary = result.manifest["parity"]["exploration"]
    assert summary["tests"] == len(checks) and summary["failed"] == 0


def skew_sampled_outputs(monkeypatch, change):
    """Make ONNX Runtime's sampled outputs pass through ``change``: a runner called with ``explore``
    on, and its action head (which exploration parity draws through)."""
    real_call, real_head = onnx_model.OnnxRunner.__call__, onnx_model.OnnxRunner.head

    def call(self, feeds):
        out = real_call(self, feeds)
        return change(out) if bool(np.asarray(feeds.get("explore", False))) else out

    def head(self):
        run = real_head(self)
        return None if run is None else (lambda feeds: change(run(feeds)))

    monkeypatch.setattr(onnx_model.OnnxRunner, "__call__", call)
    monkeypatch.setattr(onnx_model.OnnxRunner, "head", head)


@pytest.mark.parametrize("name, corrupt", [
    ("cartpole_mlp", lambda a: np.where(np.arange(len(a)) % 5 == 0, 1 - a, a)),  # flip 20% of choices
    # halve the spread and shift it (the trained policy's samples often sit on the bounds, where a
    # wider spread alone would be clipped away)
    ("pendulum_mlp", lambda a: np.clip(a * 0.5 + 0.3, -2, 2).astype(a.dtype)),
])
def test_exploration_check_catches_a_different_distribution(name, corrupt, policies, tmp_path, monkeypatch):
    def skewed(out):
        out["actions_0"] = corrupt(out["actions_0"])
        return out

    skew_sampled_outputs(monkeypatch, skewed)
    with pytest.raises(ParityFailedError) as info:
        export_policy(policies(name), tmp_path / "x", formats=["onnx"], samples=64, device="cpu")
    failed = info.value.report.failures()
    assert any(getattr(f, "test", None) for f in failed)
    assert all(f.format.startswith("onnx") for f in failed)
    assert not (tmp_path / "x").exists()


def test_inputs_as_nchw_transposes_image_inputs_only(tmp_path):
    out = tmp_path / "nchw"
    result = export_spec(FIXTURES_DIR / "dict_image_vector", out, device="cpu", formats=["onnx", "saved_model"],
                         samples=128, explore_samples=2000, inputs_as_nchw=True)
    inputs, _ = onnx_io(out / "model.onnx")
    assert inputs["observations/camera"] == ["batch", 3, 32, 32]
    assert inputs["observations/state"] == ["batch", 5]
    assert result.formats["onnx"].details["nchw_inputs"] == ["observations/camera"]
    assert TFGraphRunner.from_saved_model(out / "saved_model", plan_devices("cpu")).inputs["observations/camera"].shape == (None, 32, 32, 3)
    assert result.parity.passed
    onnx_records = [r for r in result.parity.records if r.format == "onnx"]
    assert onnx_records and all(r.passed for r in onnx_records)


@pytest.mark.parametrize("where, space, fragment", [
    ("observation_space", {"type": "Text"}, "Text"),
    ("observation_space", {"type": "Graph"}, "Graph"),
    ("action_space", {"type": "Sequence"}, "Sequence"),
])
def test_unsupported_space_types_are_named(where, space, fragment):
    obj = {"format_version": 1, "name": "u", "observation_space": {"type": "Box", "low": 0, "high": 1, "shape": [2]},
           "action_space": {"type": "Discrete", "n": 2}, "model": {"hiddens": [4]}, where: space}
    with pytest.raises(UnsupportedSpaceError, match=fragment):
        spec_from_json(obj)


def test_integer_box_action_is_unsupported_with_its_path():
    spec = spec_from_json({
        "format_version": 1, "name": "u", "observation_space": {"type": "Box", "low": 0, "high": 1, "shape": [2]},
        "action_space": {"type": "Dict", "spaces": {"move": {"type": "Box", "low": 0, "high": 3, "shape": [2],
                                                              "dtype": "int32"}}},
        "model": {"hiddens": [4]}})
    with pytest.raises(UnsupportedSpaceError, match=r"action_space/move"):
        TFPolicy.from_spec(spec)


# ------------------------------------------------------------------ property-based

def leaf_spaces(allow_image: bool):
    boxes = st.builds(lambda shape, bound: gym.spaces.Box(-bound, bound, tuple(shape), np.float32),
                      st.lists(st.integers(1, 3), min_size=1, max_size=2), st.sampled_from([1.0, 5.0]))
    leaves_ = [boxes,
               st.builds(lambda n, start: gym.spaces.Discrete(n, start=start), st.integers(2, 5), st.integers(-1, 2)),
               st.builds(lambda nvec: gym.spaces.MultiDiscrete(nvec), st.lists(st.integers(2, 4), min_size=1, max_size=3)),
               st.builds(gym.spaces.MultiBinary, st.integers(1, 4))]
    if allow_image:
        leaves_.append(st.builds(lambda hw: gym.spaces.Box(0, 255, (hw, hw, 3), np.uint8), st.sampled_from([8, 12])))
    return st.one_of(*leaves_)


def nested(leaf, depth: int = 2):
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.builds(gym.spaces.Tuple, st.lists(children, min_size=1, max_size=3)),
            st.builds(lambda d: gym.spaces.Dict(d),
                      st.dictionaries(st.sampled_from(["a", "b", "pos", "cam"]), children, min_size=1, max_size=3)),
        ),
        max_leaves=4,
    )


def action_leaf():
    return st.one_of(
        st.builds(lambda n: gym.spaces.Discrete(n), st.integers(2, 5)),
        st.builds(lambda nvec: gym.spaces.MultiDiscrete(nvec), st.lists(st.integers(2, 4), min_size=1, max_size=3)),
        st.builds(gym.spaces.MultiBinary, st.integers(1, 4)),
        st.builds(lambda n: gym.spaces.Box(-1.0, 1.0, (n,), np.float32), st.integers(1, 3)),
    )


@pytest.mark.slow
@given(obs=nested(leaf_spaces(allow_image=True)), act=nested(action_leaf()),
       hiddens=st.lists(st.integers(1, 24), min_size=1, max_size=3),
       activation=st.sampled_from(["tanh", "relu", "elu", "swish", "linear"]), seed=st.integers(0, 1000))
def test_random_spaces_export_with_parity(obs, act, hiddens, activation, seed, tmp_path_factory):
    spec = spec_from_json(json.loads(json.dumps({
        "format_version": 1, "name": "prop", "observation_space": space_to_json(obs),
        "action_space": space_to_json(act), "seed": seed,
        "model": {"hiddens": hiddens, "activation": activation, "conv_filters": [[4, [3, 3], 2]]}})))
    policy = TFPolicy.from_spec(spec)
    try:
        out = tmp_path_factory.mktemp("prop") / "x"
        result = export_policy(policy, out, formats=["onnx"], samples=64, explore_samples=2000, device="cpu")
    finally:
        policy.close()
    assert result.parity.passed, [f.describe() for f in result.parity.failures()]
    inputs, outputs = onnx_io(out / "model.onnx")
    assert [k for k in inputs if k.startswith("observations")] == [leaf.key("observations") for leaf in leaves(obs)]
    assert [k for k in outputs if k.startswith("actions_")] == [f"actions_{i}" for i in range(len(list(leaves(act))))]


def test_two_sample_tests_agree_with_scipy_stats():
    from scipy import stats

    from policy_export.exporter.parity.exploration import chi_square_homogeneity, ks_two_sample

    rng = np.random.default_rng(0)
    for k in (2, 3, 6):
        a, b = rng.integers(0, k, 2500), rng.integers(0, k, 2500)
        b[:80] = 0  # a real difference, so p-values are not all near 1
        table = np.array([[np.sum(a == c) for c in range(k)], [np.sum(b == c) for c in range(k)]])
        expected = stats.chi2_contingency(table)
        assert chi_square_homogeneity(a, b) == pytest.approx((expected.statistic, expected.pvalue), rel=1e-9)
    a, b = rng.normal(size=3000), rng.normal(0.08, 1.0, size=3000)
    expected = stats.ks_2samp(a, b, method="asymp")
    statistic, p_value = ks_two_sample(a, b)
    assert statistic == pytest.approx(expected.statistic, abs=1e-12)
    assert p_value == pytest.approx(expected.pvalue, rel=0.05)  # limiting vs finite-n distribution


F16_SPEC = {"format_version": 1, "name": "f16", "observation_space": {"type": "Box", "low": -1, "high": 1, "shape": [3]},
            "action_space": {"type": "Box", "low": -2, "high": 2, "shape": [2], "dtype": "float16"},
            "model": {"hiddens": [8]}, "seed": 1}


def test_float16_box_actions_pass_exploration_parity(tmp_path):
    policy = TFPolicy.from_spec(spec_from_json(F16_SPEC))
    result = export_policy(policy, tmp_path / "f16", formats=["saved_model", "onnx"], samples=200, device="cpu")
    logp = [r for r in result.parity.records if r.key == "action_logp of its samples"]
    assert result.parity.passed and len(logp) == 2 and all(r.passed for r in logp)
    assert all(r.max_abs_err <= 1e-5 for r in logp)


def test_float16_logp_check_still_catches_a_wrong_logp(tmp_path, monkeypatch):
    def off(out):
        out["action_logp"] = out["action_logp"] + np.float32(0.01)  # far beyond what rounding explains
        return out

    skew_sampled_outputs(monkeypatch, off)
    policy = TFPolicy.from_spec(spec_from_json(F16_SPEC))
    with pytest.raises(ParityFailedError) as info:
        export_policy(policy, tmp_path / "f16", formats=["onnx"], samples=200, device="cpu")
    failed = [f for f in info.value.report.failures() if getattr(f, "key", "") == "action_logp of its samples"]
    assert failed and failed[0].format == "onnx (explore)" and failed[0].max_abs_err > 5e-3
