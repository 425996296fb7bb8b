"""The Python API's routes take every source, with errors of the right class: the checkpoint route
converts RLlib's new API stack as well as the old one, a path that is not there is an
``InputError`` (not an "unsafe" checkpoint), and ``read_checkpoint`` names the route for a
checkpoint it does not read. A policy exported again keeps its name."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES_DIR

NEW_STACK = FIXTURES_DIR / "rllib" / "newstack" / "ppo_discrete" / "checkpoint"
OLD_STACK = FIXTURES_DIR / "rllib" / "checkpoints" / "ppo_filter" / "checkpoint"
QUICK = {"samples": 20, "explore_samples": 0, "device": "cpu"}


def test_the_checkpoint_route_converts_a_new_stack_checkpoint(tmp_path):
    from policy_export import convert_checkpoint

    result = convert_checkpoint(NEW_STACK, tmp_path / "new", formats=["saved_model", "onnx"], **QUICK)
    assert result.parity.passed and set(result.formats) == {"saved_model", "onnx"}
    source = json.loads((tmp_path / "new" / "manifest.json").read_text())["source"]
    assert source["converted_from"] == str(NEW_STACK.absolute())


def test_every_policy_of_a_new_stack_checkpoint(tmp_path):
    from policy_export import convert_checkpoint_policies

    done = convert_checkpoint_policies(FIXTURES_DIR / "rllib" / "newstack" / "multi_agent" / "checkpoint",
                                       tmp_path / "league", formats=["onnx"], **QUICK)
    assert len(done) >= 2 and all((tmp_path / "league" / pid / "manifest.json").is_file() for pid in done)


@pytest.mark.parametrize("call", ["read_checkpoint", "convert_checkpoint", "convert_checkpoint_policies",
                                  "export_source"])
def test_a_missing_path_is_an_input_error_not_an_unsafe_checkpoint(call, tmp_path):
    import policy_export
    from policy_export.errors import InputError, UnsafeCheckpointError

    function = getattr(policy_export, call)
    args = (tmp_path / "nothing",) if call == "read_checkpoint" else (tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(InputError, match="nothing: no such directory") as raised:
        function(*args)
    assert not isinstance(raised.value, UnsafeCheckpointError)


def test_read_checkpoint_names_the_route_for_the_new_stack():
    from policy_export import read_checkpoint
    from policy_export.errors import InputError, UnsafeCheckpointError

    for path in (NEW_STACK, FIXTURES_DIR / "rllib" / "newstack" / "module_only" / "checkpoint"):
        with pytest.raises(InputError, match=r"new API stack .*convert_checkpoint\(path, out\) or "
                                             r"export_source\(path, out\)") as raised:
            read_checkpoint(path)
        assert not isinstance(raised.value, UnsafeCheckpointError)
    assert read_checkpoint(OLD_STACK).policies  # the old stack's, as before


def test_the_checkpoint_route_refuses_what_is_no_checkpoint_and_foreign_options(tmp_path):
    from policy_export import convert_checkpoint
    from policy_export.errors import InputError

    with pytest.raises(InputError, match="is not an RLlib new API stack checkpoint .* or an RLlib checkpoint"):
        convert_checkpoint(FIXTURES_DIR / "cartpole_mlp", tmp_path / "out")
    with pytest.raises(InputError, match="--filter-agent applies to an RLlib new API stack checkpoint"):
        convert_checkpoint(OLD_STACK, tmp_path / "out", filter_agent=0)
    assert not (tmp_path / "out").exists()


def test_an_export_exported_again_keeps_the_policys_name(exports, tmp_path):
    from policy_export import export_source

    _, out = exports("cartpole_mlp")
    (again,) = export_source(out, tmp_path / "again", formats=["triton"], **QUICK).values()
    assert again.manifest["name"] == "cartpole_mlp"
    assert (tmp_path / "again" / "triton" / "cartpole_mlp" / "config.pbtxt").is_file()
