"""Help texts and lists are made from the registries that own the facts: every source kind, every
format ``inspect`` reads and every format a rollout can play is named where the help promises it,
and the API's command map names every command (tests/test_api_commands.py)."""

from __future__ import annotations

import argparse

from policy_export.exporter import formats, sources
from policy_export.exporter.cli_args import build_parser


def _help(*path: str) -> str:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=10_000)
    return " ".join(parser.format_help().split())


def test_every_source_is_named_by_the_commands_that_take_it():
    kinds = [s.description for s in sources.all_sources()]
    assert len(kinds) >= 6
    for command in ("export", "convert", "export-many"):
        text = _help(command)
        assert all(" ".join(k.split()) in text for k in kinds), (command, kinds)
    shown = [s.description for s in sources.all_sources() if s.shows_itself]
    assert all(k in _help("inspect") for k in shown)


def test_every_format_inspect_reads_is_named_by_inspect_and_diff():
    readable = [f for f in formats.all_formats() if f.inspect_order is not None]
    assert {f.name for f in readable} >= {"onnx", "saved_model", "triton", "tf_serving"}
    for command in ("inspect", "diff"):
        text = _help(command)
        assert all(f.inspect_description and f.inspect_description in text for f in readable), command


def test_rollout_help_names_every_format_that_plays():
    text = _help("rollout")
    playable = [f.name for f in formats.with_capability("signature")]
    assert len(playable) >= 10
    assert all(name in text for name in playable)
    assert not [f.name for f in formats.all_formats() if f.name not in playable and f" {f.name}," in text]


def test_one_format_is_the_localisation_graph():
    assert formats.localisation_graph().name == "frozen_graph"
