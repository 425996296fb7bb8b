"""The ``policy-export`` command line's arguments (:func:`build_parser`), exit codes and text helpers."""

from __future__ import annotations

import argparse


PROG = "policy-export"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_PARTIAL = 4  # written and proven, but a format asked for could not be made (--allow-partial: 0)
EXIT_INTERRUPTED = 130  # SIGINT, SIGTERM and SIGHUP alike


def one_line(text: object) -> str:
    """``text`` on one line: newlines and other control characters escaped (user text cannot add lines)."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text))


class _Formatter(argparse.HelpFormatter):
    """argparse's help, its section headings wrapped at the width as its text is (a heading
    names the sources that own a group of options, and can be long)."""

    def start_section(self, heading):
        import textwrap

        room = max(self._width - self._current_indent, 20)
        lines = textwrap.wrap(heading or "", room - 1, break_long_words=False, break_on_hyphens=False)
        super().start_section("\n  ".join(lines) if lines else heading)


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage error is one line (what is wrong, and where the usage is),
    as every other error of the command line, instead of the whole usage first; its help fits
    the width (:class:`_Formatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        import sys

        from policy_export.exporter.screen import width_of, wrap

        text = f"{self.prog}: error: {one_line(message)} (usage: {self.prog} --help)"
        for line in wrap(text, width_of(sys.stderr), rest="  "):
            print(line, file=sys.stderr)
        self.exit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Export RL policies built as TF graphs and prove parity.")
    parser.add_argument("--debug", action="store_true", help="show library logs and tracebacks")
    parser.add_argument("-V", "--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show library logs and tracebacks")
    _export_parser(sub, common, "export", "export a policy (any SOURCE below) to every format and check parity")
    _verify_parser(sub, common)
    _serve_parser(sub, common)
    _inspect_parser(sub, common)
    _diff_parser(sub, common)
    _export_parser(sub, common, "convert", "the same as export (kept for RLlib checkpoints and SavedModels)")
    _rollout_parser(sub, common)
    _many_parsers(sub, common)
    _example_parser(sub, common)
    _sign_parser(sub, common)
    _docs_parser(sub, common)
    parser.command_parsers = dict(sub.choices)  # name -> its parser (synopsis() reads them)
    return parser


def synopsis(width: int = 100) -> str:
    """Every command's usage, made from the parser (so from the declarations it is built from), as
    the docs quote it: ``python -m policy_export.exporter.cli_args``."""
    lines = []
    for name, command in build_parser().command_parsers.items():
        command.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=width)
        first, *rest = command.format_usage().rstrip().splitlines()
        lines += [first.removeprefix("usage: ")] + [line[len("usage: "):] for line in rest]
    return "\n".join(lines) + "\n"


def _many_parsers(sub, common) -> None:
    from policy_export.exporter import core_options as core

    em = sub.add_parser("export-many", parents=[common],
                        help="export many policies, each in its own process, into ROOT/<name>/")
    em.add_argument("sources", nargs="+", metavar="SOURCE",
                    help=f"{either(source_kinds())}; or a league file (JSON) naming them")
    core.add(em, core.EXPORT_MANY)
    vm = sub.add_parser("verify-many", parents=[common], help="verify every export under ROOT, each in its own process")
    vm.add_argument("root", metavar="ROOT")
    core.add(vm, core.VERIFY_MANY)


def source_kinds(shows_itself: bool = False) -> list[str]:
    """What each registered source is (its ``description``), for help texts; with ``shows_itself``
    only the sources ``inspect`` describes."""
    from policy_export.exporter import sources

    return [s.description for s in sources.all_sources() if s.shows_itself or not shows_itself]


def readable_models() -> list[str]:
    """What ``inspect`` and ``diff`` read of each format outside an export, for help texts."""
    from policy_export.exporter import formats

    found = [f for f in formats.all_formats() if f.inspect_order is not None]
    return [f.inspect_description for f in sorted(found, key=lambda f: f.inspect_order)]


def either(kinds: list[str]) -> str:
    """``a, b or c``."""
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"


def _source_help() -> str:
    return f"{either(source_kinds())} (read without running anything it holds); or an ONNX model another " \
           "framework exported, with --reference"


def _export_parser(sub, common, name: str, help_text: str) -> None:
    """``export`` and its alias ``convert``: the same options, for every source. The options a
    source owns are declared by the source (:mod:`exporter.sources`) and listed in a group of its own."""
    from policy_export.exporter import core_options as core

    ex = sub.add_parser(name, parents=[common], help=help_text)
    ex.add_argument("source", metavar="SOURCE", help=_source_help())
    ex.add_argument("--out", required=True, metavar="OUT", help="export directory to write")
    core.add(ex, core.EXPORT)
    _declared_groups(ex, source_option_groups())
    _declared_groups(ex, format_option_groups())


def source_option_groups() -> list[tuple[str, tuple]]:
    """The options the sources own, one group per set of sources that declare them: (title, options)."""
    from policy_export.exporter import sources

    owners: dict[int, tuple[object, list[str]]] = {}
    for source in sources.all_sources():
        for option in source.options:
            owners.setdefault(id(option), (option, []))[1].append(source.description)
    groups: dict[tuple[str, ...], list] = {}
    for option, names in owners.values():
        groups.setdefault(tuple(names), []).append(option)
    return [(f"{' and '.join(names)} only", tuple(options)) for names, options in groups.items()]


def format_option_groups() -> list[tuple[str, tuple]]:
    """The options the formats own, one group per declaration they share: (title, options)."""
    from policy_export.exporter import formats

    owners: dict[tuple, list[str]] = {}
    for fmt in formats.all_formats():
        if fmt.options:
            owners.setdefault(tuple(fmt.options), []).append(fmt.name)
    return [(f"the formats {', '.join(names)} only", options) for options, names in owners.items()]


def _declared_groups(parser, groups) -> None:
    """Each (title, options) as an argument group, every flag made from its declaration."""
    for title, options in groups:
        if options:
            group = parser.add_argument_group(title)
            for option in options:
                option.add_to(group)


def _verify_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    ve = sub.add_parser("verify", parents=[common], help="check an export's files and re-run its formats against golden outputs")
    ve.add_argument("out", metavar="OUT", help="export directory")
    core.add(ve, core.VERIFY)


def _serve_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    se = sub.add_parser("serve", parents=[common],
                        help="serve an export with a real Triton Inference Server (HTTP and gRPC) until Ctrl-C")
    se.add_argument("out", metavar="OUT", help="export directory")
    core.add(se, core.SERVE)


def _inspect_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    ins = sub.add_parser("inspect", parents=[common],
                         help="list the inputs and outputs of an export or a model, or what a source holds")
    ins.add_argument("path", metavar="PATH",
                     help=f"{either(['an export directory', *readable_models()])}: its inputs and outputs; or "
                          f"{either(source_kinds(shows_itself=True))}: what it holds")
    core.add(ins, core.INSPECT)


def _diff_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    di = sub.add_parser("diff", parents=[common],
                        help="compare the contracts of two exports (or models): exit 1 on a breaking change; says "
                             "whether their weights differ")
    di.add_argument("old", metavar="OLD",
                    help=f"what is deployed now: {either(['an export directory', *readable_models()])}")
    di.add_argument("new", metavar="NEW", help="the candidate (any of the same)")
    core.add(di, core.DIFF)


def _rollout_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    ro = sub.add_parser("rollout", parents=[common],
                        help="play an environment with the export's TF and ONNX runtimes and compare their actions")
    ro.add_argument("out", metavar="OUT", help="export directory")
    core.add(ro, core.ROLLOUT)


def installed_version() -> str:
    """The installed distribution's version (``policy-export`` in pyproject.toml)."""
    from importlib import metadata

    try:
        return metadata.version(PROG)
    except metadata.PackageNotFoundError:  # imported from a checkout that is not installed
        from policy_export import __version__

        return __version__


class _Version(argparse.Action):
    """``--version``/``-V``: ``policy-export <version>`` on stdout, exit 0 (the version is read
    only when asked for)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import sys

        print(f"{PROG} {installed_version()}", file=sys.stdout)
        parser.exit(EXIT_OK)


def _example_parser(sub, common) -> None:
    ex = sub.add_parser("example", parents=[common],
                        help="write the bundled CartPole spec (policy.json and its weights) to DIR, to export it")
    ex.add_argument("dir", metavar="DIR", help="directory to write (new, or empty)")


def _docs_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    do = sub.add_parser("docs", parents=[common],
                        help="print a page of the documentation or an example (installed from a wheel too); "
                             "without TOPIC, the list of them")
    do.add_argument("topic", metavar="TOPIC", nargs="?",
                    help="a page (README, ci-gate, api, install, ...) or an example (ci_gate.sh, python_api.py)")
    core.add(do, core.DOCS)


def _sign_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    si = sub.add_parser("sign", parents=[common],
                        help="verify an export, then sign it with OpenSSF Model Signing (the signing extra): the "
                             "signature goes beside it, OUT.sig")
    si.add_argument("out", metavar="OUT", help="export directory")
    core.add(si, core.SIGN)


if __name__ == "__main__":
    print(synopsis(), end="")
