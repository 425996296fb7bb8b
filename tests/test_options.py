"""Each check of an option is made once, in :mod:`exporter.options`, from the command line and the
Python API alike; the stages after it take the checked options as they are."""

from __future__ import annotations

import re

import pytest

from conftest import FIXTURES_DIR
from policy_export.errors import ExportError, InputError
from policy_export.exporter import options

SPEC = FIXTURES_DIR / "cartpole_mlp"
CHECKPOINT = FIXTURES_DIR / "rllib" / "checkpoints" / "multi_agent" / "checkpoint"


class Stop(Exception):
    """Stands for the pipeline's work once the checks are done."""


@pytest.fixture
def counted(monkeypatch):
    """The calls of each check made before an export's work: ``budget`` (the sample count of each
    sample budget) and ``target`` (each output directory checked before the work)."""
    from policy_export.exporter import staging

    calls = {"budget": [], "target": []}
    budget, target = options.check_sample_budget, staging.check_target
    monkeypatch.setattr(options, "check_sample_budget", lambda n, *a: calls["budget"].append(n) or budget(n, *a))
    counting = lambda out, overwrite: calls["target"].append(str(out)) or target(out, overwrite)  # noqa: E731
    monkeypatch.setattr(options, "check_target", counting)
    monkeypatch.setattr(staging, "check_target", counting)
    return calls


def _stop(*args, **kwargs):
    raise Stop


def test_replace_checks_only_what_it_changes(monkeypatch):
    seen = []
    for name, rule in options.ExportOptions.RULES.items():
        monkeypatch.setitem(options.ExportOptions.RULES, name, lambda v, name=name, rule=rule: seen.append(name) or rule(v))
    opts = options.ExportOptions(formats=["onnx"], samples=10)
    assert seen == list(options.ExportOptions.RULES)  # every field once, when made
    seen.clear()
    again = options.replace(options.replace(opts, device="cpu"), source={"converted_from": "x"})
    assert seen == [] and again.formats == ("onnx",) and again.explicit_formats
    with pytest.raises(InputError, match=r"samples \(--samples\) must be at least 1, got 0"):
        options.replace(opts, samples=0)
    assert seen == ["samples"]
    default = options.replace(opts, formats=None)
    assert not default.explicit_formats and default.formats == options.ExportOptions().formats
    with pytest.raises(TypeError, match="no option"):
        options.replace(opts, colour="red")


def test_an_api_export_checks_its_budget_and_target_once(tmp_path, counted):
    from policy_export.exporter import export_spec

    out = tmp_path / "out"
    result = export_spec(SPEC, out, device="cpu", formats=["onnx"], samples=16, explore_samples=0)
    assert result.parity.passed and (out / "manifest.json").is_file()
    assert counted == {"budget": [16], "target": [str(out)]}  # staging checks under its lock only


def test_a_cli_export_checks_before_tensorflow_and_the_pipeline_does_not_again(tmp_path, counted, monkeypatch):
    from policy_export.exporter import export
    from policy_export.exporter.cli import main

    monkeypatch.setattr(export, "_Export", _stop)  # the pipeline past its entry
    out = tmp_path / "out"
    assert main(["export", str(SPEC), "--out", str(out), "--samples", "16", "--explore-samples", "3",
                 "--device", "cpu", "-q"]) == 3  # Stop is no error of the package's
    assert counted == {"budget": [16, 3 * options.DEFAULT_OBSERVATIONS], "target": [str(out)]}


def test_a_checkpoint_is_checked_once_per_policy_from_the_cli_and_the_api(tmp_path, counted, monkeypatch):
    from policy_export.exporter import convert, pipeline
    from policy_export.exporter.cli import main

    monkeypatch.setattr(pipeline, "_export_one", _stop)
    out = tmp_path / "league"
    assert main(["convert", str(CHECKPOINT), "--out", str(out), "--all-policies", "--samples", "20",
                 "--explore-samples", "0", "--device", "cpu", "-q"]) == 3
    assert counted == {"budget": [20, 20], "target": [str(out / "alpha"), str(out / "beta")]}
    for key in counted:
        counted[key].clear()
    with pytest.raises(Stop):
        convert.convert_checkpoint_policies(CHECKPOINT, out, device="cpu", samples=20, explore_samples=0)
    assert counted == {"budget": [20, 20], "target": [str(out / "alpha"), str(out / "beta")]}
    assert not out.exists()


def test_a_file_where_a_checkpoints_exports_go_is_refused_alike(tmp_path, capsys):
    from policy_export.exporter.cli import main
    from policy_export.exporter.convert import convert_checkpoint_policies

    blocker = tmp_path / "file"
    blocker.write_text("x")
    message = f"output path {blocker} is a symbolic link or a file; the exports go into a directory"
    with pytest.raises(ExportError) as info:
        convert_checkpoint_policies(CHECKPOINT, blocker, device="cpu")
    assert str(info.value) == message
    assert main(["convert", str(CHECKPOINT), "--out", str(blocker), "--all-policies"]) == 2
    assert capsys.readouterr().err.strip() == f"policy-export: error: {message}"


def test_rollout_formats_given_empty_are_refused_alike(tmp_path, capsys, monkeypatch):
    from policy_export.exporter import manifest
    from policy_export.exporter.cli import main

    message = "formats (--formats): give two or more formats, e.g. saved_model,onnx"
    with pytest.raises(InputError, match=re.escape(message)):
        options.RolloutOptions(formats=[])
    monkeypatch.setattr(manifest, "read_manifest", lambda path: {})  # any export: refused before it is used
    assert main(["rollout", str(tmp_path), "--env", "CartPole-v1", "--formats", " , "]) == 2
    assert message in capsys.readouterr().err


def test_many_jobs_and_memory_are_refused_before_anything_runs_alike(tmp_path, capsys):
    from policy_export.exporter.cli import main
    from policy_export.exporter.many import export_many, verify_many

    root = tmp_path / "root"
    with pytest.raises(InputError, match=r"jobs \(--jobs\) must be at least 1, got 0"):
        export_many([SPEC], root, jobs=0)
    with pytest.raises(InputError, match=r"memory_mb \(--memory-mb\) must be a number of MiB above 0, got -1"):
        verify_many(tmp_path, memory_mb=-1)
    assert main(["export-many", str(SPEC), "--out", str(root), "--jobs", "0"]) == 2
    assert "jobs (--jobs) must be at least 1, got 0" in capsys.readouterr().err
    assert main(["verify-many", str(tmp_path), "--memory-mb", "0"]) == 2
    assert "memory_mb (--memory-mb) must be a number of MiB above 0, got 0.0" in capsys.readouterr().err
    assert not root.exists()


def test_an_option_whose_owner_is_not_in_play_is_refused_naming_it(tmp_path, capsys):
    from policy_export.exporter import export_spec
    from policy_export.exporter.cli import main

    message = ("--model-name applies to the formats triton, tf_serving only; none of them is chosen "
               "(--formats saved_model,onnx)")
    with pytest.raises(InputError, match=re.escape(message)):
        export_spec(SPEC, tmp_path / "a", formats=["saved_model", "onnx"], model_name="mine")
    assert main(["export", str(SPEC), "--out", str(tmp_path / "b"), "--formats", "saved_model,onnx",
                 "--model-name", "mine"]) == 2
    assert message in capsys.readouterr().err
    assert main(["export", str(SPEC), "--out", str(tmp_path / "c"), "--weights", "w.index"]) == 2
    assert ("--weights applies to a SavedModel directory (saved_model.pb) only; this source is a spec directory "
            "(policy.json)") in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _flags(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag not in ("--help", "--debug")}


def test_every_flag_of_every_command_is_a_declaration():
    """No command has a flag of its own making: each is the declaration of the core, a source or a
    format, and the parser keeps the declaration's default."""
    from policy_export.exporter import cli_args, core_options, formats, sources

    declared = [o for group in (core_options.EXPORT, core_options.VERIFY, core_options.SERVE, core_options.INSPECT,
                                core_options.DIFF, core_options.ROLLOUT, core_options.EXPORT_MANY, core_options.DOCS)
                for o in group if o.cli]
    declared += [o for s in sources.all_sources() for o in s.options]
    declared += [o for f in formats.all_formats() for o in f.options]
    parsers = cli_args.build_parser().command_parsers
    flags = set().union(*(_flags(p) for p in parsers.values()))
    assert flags - {"--out"} <= {o.flag for o in declared}
    assert {o.flag for o in core_options.EXPORT if o.cli} <= _flags(parsers["export"]) == _flags(parsers["convert"])
    args = parsers["export"].parse_args(["src", "--out", "o"])
    assert (args.samples, args.seed, args.opset, args.tolerance) == (core_options.SAMPLES.default, 0, 17, [])
    args = parsers["export-many"].parse_args(["src", "--out", "o", "--no-preload"])
    assert args.preload is False and parsers["verify-many"].parse_args(["r"]).preload is True


@pytest.mark.parametrize("field,value,message", [
    ("seed", -1, "seed (--seed) must be at least 0, got -1"),
    ("samples", 0, "samples (--samples) must be at least 1, got 0"),
    ("explore_samples", 10**9, "explore_samples (--explore-samples) 1000000000 exceeds the limit of 1000000"),
    ("opset", 12, "opset 12 is not supported; choose 13..21"),
])
def test_a_declared_rule_refuses_alike_from_the_api_and_the_command_line(tmp_path, capsys, field, value, message):
    from helpers import cli

    with pytest.raises(InputError, match=re.escape(message)):
        options.ExportOptions(**{field: value})
    done = cli("export", str(SPEC), "--out", str(tmp_path / "o"), "--" + field.replace("_", "-"), str(value))
    assert done.returncode == 2 and message in done.stderr and not (tmp_path / "o").exists()


def test_the_rules_of_the_options_classes_are_the_declarations():
    from policy_export.exporter import core_options

    for cls, group in ((options.ExportOptions, core_options.EXPORT), (options.VerifyOptions, core_options.VERIFY),
                       (options.RolloutOptions, core_options.ROLLOUT)):
        fields = {f.name for f in options.dataclasses.fields(cls)}
        with_rule = {o.name for o in group if o.rule is not None and o.name in fields}
        assert with_rule and with_rule <= set(cls.RULES)
    assert options.VerifyOptions(samples=0).samples == 0  # verify's own declaration: 0 is golden inputs only
    with pytest.raises(InputError, match="return_tolerance"):
        options.RolloutOptions(return_tolerance=-1.0)


def test_the_league_keys_are_made_from_the_declarations():
    from policy_export.exporter import core_options
    from policy_export.exporter.many.jobs import league_options

    keys = league_options()
    assert {o.name for o in core_options.EXPORT if o.league} <= set(keys)
    assert keys["formats"] is list and keys["samples"] is int and keys["inputs_as_nchw"] is bool
    assert keys["observation_space"] == (dict, str) and "overwrite" not in keys and "policy_id" not in keys
