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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Export RL policies built as TF graphs and prove parity.")
    parser.add_argument("--debug", action="store_true", help="show library logs and tracebacks")
    parser.add_argument("-V", "--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show library logs and tracebacks")
    _export_parser(sub, common, "export", "export a policy (a spec directory, an RLlib checkpoint, a SavedModel) to "
                   "every format and check parity")
    _verify_parser(sub, common)
    _serve_parser(sub, common)
    _inspect_parser(sub, common)
    _diff_parser(sub, common)
    _export_parser(sub, common, "convert", "the same as export (kept for RLlib checkpoints and SavedModels): "
                   "a full export with clean keys")
    _rollout_parser(sub, common)
    _many_parsers(sub, common)
    _example_parser(sub, common)
    _sign_parser(sub, common)
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
                        help="export many policies (spec directories, SavedModels, RLlib checkpoints, league files), "
                             "each in its own process, into ROOT/<name>/")
    em.add_argument("sources", nargs="+", metavar="SOURCE")
    core.add(em, core.EXPORT_MANY)
    vm = sub.add_parser("verify-many", parents=[common], help="verify every export under ROOT, each in its own process")
    vm.add_argument("root", metavar="ROOT")
    core.add(vm, core.VERIFY_MANY)


SOURCE_HELP = ("a spec directory (policy.json, or the file itself), an RLlib checkpoint directory (holding "
               "rllib_checkpoint.json; the old API stack's or the new one's, ray 2.1-2.60; read without ray or "
               "torch and without running its pickles), an RLModule directory, a SavedModel directory, or an "
               "export of this package (exported again)")


def _export_parser(sub, common, name: str, help_text: str) -> None:
    """``export`` and its alias ``convert``: the same options, for every source. The options a
    source owns are declared by the source (:mod:`exporter.sources`) and listed in a group of its own."""
    from policy_export.exporter import core_options as core

    ex = sub.add_parser(name, parents=[common], help=help_text)
    ex.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
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
                         help="list the inputs and outputs of an export, a .onnx file or a SavedModel, or the "
                              "policies of an RLlib checkpoint")
    ins.add_argument("path", metavar="PATH",
                     help="export directory, model.onnx, SavedModel directory, or RLlib checkpoint directory")
    core.add(ins, core.INSPECT)


def _diff_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    di = sub.add_parser("diff", parents=[common],
                        help="compare the contracts of two exports: exit 1 on a breaking change")
    di.add_argument("old", metavar="OLD", help="the export (or .onnx / SavedModel) deployed now")
    di.add_argument("new", metavar="NEW", help="the candidate")
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


def _sign_parser(sub, common) -> None:
    from policy_export.exporter import core_options as core

    si = sub.add_parser("sign", parents=[common],
                        help="verify an export, then sign it with OpenSSF Model Signing (the signing extra): the "
                             "signature goes beside it, OUT.sig")
    si.add_argument("out", metavar="OUT", help="export directory")
    core.add(si, core.SIGN)


if __name__ == "__main__":
    print(synopsis(), end="")
