"""Spec files and spaces: round trips, and every problem reported with its JSON path."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest

from conftest import FIXTURES, FIXTURES_DIR
from policy_export.errors import SpecError, UnsupportedSpaceError
from policy_export.policy.spaces import leaves, space_from_json, space_to_json
from policy_export.policy.spec import load_spec, spec_from_json

BASE = {
    "format_version": 1,
    "name": "t",
    "observation_space": {"type": "Box", "low": -1.0, "high": 1.0, "shape": [3], "dtype": "float32"},
    "action_space": {"type": "Discrete", "n": 2},
    "model": {"hiddens": [8], "activation": "tanh"},
}


def with_(path: str, value):
    """A copy of BASE with the dotted ``path`` set to ``value`` (``None`` deletes it)."""
    obj = json.loads(json.dumps(BASE))
    *parents, last = path.split(".")
    node = obj
    for p in parents:
        node = node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return obj


def problems_of(obj) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        spec_from_json(obj)
    return info.value.problems


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_specs_load(name):
    spec = load_spec(FIXTURES_DIR / name)
    assert spec.name == name
    assert spec.weights is not None and spec.weights.is_file()


@pytest.mark.parametrize("space", [
    gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
    gym.spaces.Box(np.array([-4.8, -np.inf], np.float32), np.array([4.8, np.inf], np.float32)),
    gym.spaces.Box(0, 255, (8, 8, 3), np.uint8),
    gym.spaces.Discrete(5, start=2),
    gym.spaces.MultiDiscrete([3, 4]),
    gym.spaces.MultiBinary(6),
    gym.spaces.Dict({"camera": gym.spaces.Box(0, 255, (4, 4, 1), np.uint8),
                     "state": gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.Box(-1, 1, (2,))])}),
])
def test_space_json_round_trip(space):
    obj = space_to_json(space)
    again = space_from_json(json.loads(json.dumps(obj)))
    assert again == space
    assert space_to_json(again) == obj


def test_leaves_follow_flatten_order_with_nest_paths():
    space = gym.spaces.Dict({"b": gym.spaces.Discrete(2),
                             "a": gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.MultiBinary(2)])})
    keys = [leaf.key("observations") for leaf in leaves(space)]
    assert keys == ["observations/a/0", "observations/a/1", "observations/b"]
    assert gym.spaces.flatdim(space) == 3 + 2 + 2


@pytest.mark.parametrize("obj, path, fragment", [
    (with_("name", None), "$.name", "missing"),
    (with_("bogus", 1), "$.bogus", "unknown key"),
    (with_("format_version", 2), "$.format_version", "expected 1"),
    (with_("model.hiddens", [8, -1]), "$.model.hiddens", "positive integers"),
    (with_("model.activation", "gelu2"), "$.model.activation", "expected one of"),
    (with_("model.dropout", 0.1), "$.model.dropout", "unknown key"),
    (with_("model.lstm", {"cell_size": 0}), "$.model.lstm.cell_size", "positive integer"),
    (with_("observation_space.low", 2.0), "$.observation_space", "low > high"),
    (with_("observation_space.low", float("nan")), "$.observation_space.low", "NaN"),
    (with_("observation_space.dtype", "complex64"), "$.observation_space.dtype", "expected one of"),
    (with_("observation_space.type", "Boxx"), "$.observation_space.type", "expected one of"),
    (with_("action_space.n", 0), "$.action_space.n", "positive integer"),
    (with_("action_space.m", 0), "$.action_space.m", "unknown key for Discrete"),
    (with_("seed", -3), "$.seed", "expected an integer"),
])
def test_each_problem_has_its_json_path(obj, path, fragment):
    problems = problems_of(obj)
    assert any(p == path and fragment in msg for p, msg in problems), problems


def test_all_problems_reported_at_once():
    obj = with_("model.activation", "nope")
    obj["action_space"] = {"type": "Discrete", "n": -1}
    obj["extra"] = True
    paths = {p for p, _ in problems_of(obj)}
    assert {"$.model.activation", "$.action_space.n", "$.extra"} <= paths


@pytest.mark.parametrize("kind", ["Text", "Graph", "Sequence"])
def test_unsupported_space_is_named(kind):
    with pytest.raises(UnsupportedSpaceError, match=kind) as info:
        spec_from_json(with_("observation_space", {"type": kind}))
    assert info.value.where == "$.observation_space"


def test_malformed_json_reports_line_and_column(tmp_path):
    (tmp_path / "policy.json").write_text('{"name": "x",\n  "format_version": 1,,}')
    with pytest.raises(SpecError, match=r"line 2 column"):
        load_spec(tmp_path)


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        load_spec(tmp_path)


def test_weights_path_resolves_relative_to_the_file(tmp_path):
    (tmp_path / "policy.json").write_text(json.dumps(dict(BASE, weights="w/weights.h5")))
    with pytest.raises(SpecError, match=r"\$\.weights: file not found"):
        load_spec(tmp_path)  # checked before any TensorFlow work
    (tmp_path / "w").mkdir()
    from policy_export.policy.h5io import write_h5_weights
    from policy_export.policy.layout import expected_weights

    shapes = expected_weights(spec_from_json(dict(BASE)))
    write_h5_weights(tmp_path / "w" / "weights.h5", {k: np.zeros(v, np.float32) for k, v in shapes.items()})
    assert load_spec(tmp_path).weights == tmp_path / "w" / "weights.h5"  # its names and shapes checked too


def test_spec_round_trip():
    spec = spec_from_json(dict(BASE, seed=7))
    again = spec_from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec


def test_non_default_inputs_names_the_optional_inputs_fed_something_else():
    """Which served model takes a feed: every optional input at its default, the batched one."""
    from policy_export.signatures.contract import Contract

    contract = Contract.from_json({"inputs": [
        {"key": "observations", "dtype": "float32", "shape": [None, 4], "required": True},
        {"key": "seq_lens", "dtype": "int32", "shape": [None], "required": False, "default": [1]},
        {"key": "explore", "dtype": "bool", "shape": [], "required": False, "default": False},
        {"key": "timestep", "dtype": "int64", "shape": [], "required": False, "default": 0},
    ], "outputs": [{"key": "actions_0", "dtype": "int64", "shape": [None]}]})
    obs = np.zeros((3, 4), np.float32)
    assert contract.non_default_inputs({"observations": obs}) == []  # optional inputs left out
    assert contract.non_default_inputs({"observations": obs, "explore": np.array(False)}) == []
    assert contract.non_default_inputs({"observations": obs, "explore": np.array([False, False, False]),
                                        "timestep": np.zeros(3, np.int64)}) == []  # arrays of the defaults
    assert contract.non_default_inputs({"observations": obs, "explore": np.array(True)}) == ["explore"]
    assert contract.non_default_inputs({"explore": np.array([False, True]), "timestep": np.int64(7)}) \
        == ["explore", "timestep"]
    assert contract.non_default_inputs({"seq_lens": np.array([5, 2], np.int32)}) == []  # not a switch
    assert contract.non_default_inputs({"timestep": np.zeros((2, 2), np.int64) + 1}) == ["timestep"]
    assert contract.input("explore").is_default(False) and not contract.input("observations").is_default(obs)
