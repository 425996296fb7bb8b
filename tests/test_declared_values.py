"""Every declared option reaches the code that uses it. The command line's options objects are
made from the declarations (``core_options.from_parsed``): each declared flag that is a field of
``ExportOptions``, ``VerifyOptions`` or ``RolloutOptions`` is given a value unlike its default
on a real command line, and the options object the command builds must hold it; every other
declared flag is one the command consumes itself (``commands.CONSUMED``), by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from policy_export.exporter import commands
from policy_export.exporter import core_options as core
from policy_export.exporter.cli_args import build_parser
from policy_export.exporter.options import ExportOptions, RolloutOptions, VerifyOptions

COMMANDS = {
    "export": (ExportOptions, core.EXPORT + core.format_options(), commands.export_options),
    "verify": (VerifyOptions, core.VERIFY, commands.verify_options),
    "rollout": (RolloutOptions, core.ROLLOUT, commands.rollout_options),
}
# the fields the command line makes from other flags (and their own test below), not copied
MADE = {"formats", "tolerances", "behaviour", "progress", "candidates"}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_declared_flag_is_a_field_or_consumed_by_its_command(command):
    cls, options, _ = COMMANDS[command]
    declared = {o.name for o in options if o.cli}
    fields = _fields(cls)
    consumed = commands.CONSUMED[command]
    assert not declared - fields - consumed, f"{command}: declared, but reaching nothing: {declared - fields - consumed}"
    assert not consumed & fields, f"{command}: consumed by hand and a field too: {consumed & fields}"
    assert consumed <= declared, f"{command}: consumes what it does not declare: {consumed - declared}"


def _probe(option, tmp_path) -> list[str]:
    """Command-line words giving ``option`` a value unlike its default, valid under its rule."""
    special = {
        "observations": [str(tmp_path / "rows.npy")],
        "reference": [str(tmp_path / "ref.npz")],
        "reference_names": ["obs=observations"],
        "reference_state_pairs": ["h_in=h_out"],
        "expect_manifest_sha256": ["ab" * 32],
        "model_name": ["probe_model"],
        "server": None,  # needs the serve extra: its own test (test_serve.py)
        "formats": None, "behaviour": None,  # MADE
    }
    if option.name in special:
        values = special[option.name]
        if values is None:
            return []
        return [w for v in values for w in (option.flag, v)]
    if option.kind == "flag":
        return [option.flag]
    if option.kind == "choice":
        return [option.flag, next(c for c in option.choices if c != option.default)]
    if option.type is int:
        return [option.flag, str((option.default or 0) + 1)]
    if option.type is float:
        return [option.flag, str((option.default or 5.0) + 0.5)]
    return [option.flag, str(tmp_path / f"{option.name}.json")]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_declared_field_reaches_the_options_object(command, tmp_path):
    np.save(tmp_path / "rows.npy", np.zeros((3, 4), np.float32))
    np.savez(tmp_path / "ref.npz", obs=np.zeros((3, 4), np.float32))
    cls, options, build = COMMANDS[command]
    fields = _fields(cls) - MADE
    default = cls()
    probed = [o for o in options if o.cli and o.name in fields and _probe(o, tmp_path)]
    assert len(probed) >= {"export": 15, "verify": 8, "rollout": 4}[command]
    for option in probed:
        head = {"export": ["export", "spec", "--out", "o"], "verify": ["verify", "o"],
                "rollout": ["rollout", "o", "--env", "CartPole-v1"]}[command]
        args = build_parser().parse_args(head + _probe(option, tmp_path))
        args.progress = None
        made = build(args)
        assert getattr(made, option.name) != getattr(default, option.name), \
            f"{command} {option.flag}: given on the command line, but its options object holds the default"


def test_the_fields_made_from_other_flags():
    args = build_parser().parse_args(["export", "spec", "--out", "o", "--formats", "onnx,saved_model", "--atol", "0.5",
                                      "--tolerance", "actions_0=0.25", "--behaviour", "onnx_int8:min_agreement=0.9"])
    args.progress = None
    made = commands.export_options(args)
    assert set(made.formats) == {"onnx", "saved_model"}
    assert made.tolerances.default.atol == 0.5 and made.tolerances.per_output["actions_0"].atol == 0.25
    assert made.behaviour == {"onnx_int8": {"min_agreement": 0.9}}
    args = build_parser().parse_args(["rollout", "o", "--env", "CartPole-v1", "--formats", "onnx,saved_model"])
    assert list(commands.rollout_options(args).formats) == ["onnx", "saved_model"]
