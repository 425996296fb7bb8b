"""The ``policy-export`` command line's arguments (:func:`build_parser`), exit codes and text helpers."""

from __future__ import annotations

import argparse

from policy_export.exporter import defaults as D

PROG = "policy-export"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_PARTIAL = 4  # written and proven, but a format asked for could not be made (--allow-partial: 0)
EXIT_INTERRUPTED = 130  # SIGINT, SIGTERM and SIGHUP alike


def one_line(text: object) -> str:
    """``text`` on one line: newlines and other control characters escaped (user text cannot add lines)."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text))


def _parity_options(p: argparse.ArgumentParser, samples_default: int | None) -> None:
    p.add_argument("--samples", type=int, default=samples_default, metavar="N",
                   help="observations sampled for parity" + (f" (default {samples_default})" if samples_default else
                                                             " (default 0: golden inputs only)"))
    p.add_argument("--atol", type=float, default=None, metavar="X",
                   help=f"default absolute tolerance ({D.DEFAULT_ATOL:g})")
    p.add_argument("--rtol", type=float, default=None, metavar="X",
                   help=f"default relative tolerance ({D.DEFAULT_RTOL:g})")
    p.add_argument("--tolerance", action="append", default=[], metavar="KEY=ATOL[:RTOL]",
                   help="tolerance for one output; repeatable")
    p.add_argument("--allow-non-finite", action="append", default=[], metavar="KEY",
                   help="output that may hold NaN or infinity (matching the reference's); repeatable")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="where TF and ONNX Runtime run (default auto: the GPU where one is visible)")
    _tf32_option(p)
    from policy_export.exporter import formats  # the registry: light, no runtime is imported

    lossy = ", ".join(f.name for f in formats.with_capability("lossy"))
    p.add_argument("--behaviour", action="append", default=[], metavar="[FORMAT:]NAME=VALUE",
                   help=f"threshold of a lossy format ({lossy}; without FORMAT: all): "
                        "min_agreement (default 0.99) or max_box_error (default 0.02); repeatable")
    p.add_argument("--report-json", metavar="F", help="write the parity report as JSON to F")
    p.add_argument("--junit", metavar="F", help="write JUnit XML (one test case per format and output) to F")


def _tf32_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-tf32", action="store_true",
                   help="let GPUs compute float32 matmuls in TF32 (off by default, in TF and ONNX Runtime alike); "
                        "the default tolerance then becomes at least 1e-2")


def _run_timeout_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS",
                   help="longest one call into a runtime (ONNX Runtime, TF, TFLite, Keras) may take before it "
                        "is stopped and fails the check, exit 1 (default 600)")


def _partial_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-partial", action="store_true",
                   help="exit 0 when some formats could not be made (they are listed, and recorded under "
                        "'missing' in the manifest); by default that is exit 4, so that CI requires every format")


def _formats_argument(p: argparse.ArgumentParser) -> None:
    from policy_export.exporter import formats  # the registry: light, no runtime is imported

    default = formats.default_names()
    p.add_argument("--formats", default=None, metavar="LIST",
                   help=f"comma-separated subset of {','.join(default)} (the default) and the opt-in "
                        f"{','.join(n for n in formats.names() if n not in default)}")


def _quiet_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress on stderr (by default each stage is shown with its elapsed time: a live "
                        "display on a terminal, one line per stage otherwise)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Export RL policies built as TF graphs and prove parity.")
    parser.add_argument("--debug", action="store_true", help="show library logs and tracebacks")
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


def _many_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="policies at a time on this machine, each in a process of its own (default: the number of cores)")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run each policy as a Ray task on a running cluster instead ('auto': the cluster this "
                        "machine is part of); needs the ray extra")
    p.add_argument("--memory-mb", type=float, default=None, metavar="MB",
                   help="memory cap per policy: a local process over it is killed and its policy fails; on Ray, "
                        "the memory each task reserves")
    p.add_argument("--policy-timeout", type=float, default=None, metavar="SECONDS",
                   help="wall-clock time each policy's process may take before it is killed and its policy fails "
                        "(default 1800)")
    p.add_argument("--no-preload", action="store_true",
                   help="start each local process from scratch (it imports TensorFlow itself) instead of forking "
                        "it from a process that imported TensorFlow, ONNX Runtime and tf2onnx once")
    p.add_argument("--samples", type=int, default=None, metavar="N")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--report-json", default=None, metavar="F", help="write the report over every policy as JSON")
    p.add_argument("--junit", default=None, metavar="F", help="JUnit XML: a test suite per policy, a test case per format and output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _many_parsers(sub, common) -> None:
    em = sub.add_parser("export-many", parents=[common],
                        help="export many policies (spec directories, SavedModels, RLlib checkpoints, league files), "
                             "each in its own process, into ROOT/<name>/")
    em.add_argument("sources", nargs="+", metavar="SOURCE")
    em.add_argument("--out", required=True, metavar="ROOT")
    _formats_argument(em)
    em.add_argument("--explore-samples", type=int, default=None, metavar="N")
    em.add_argument("--force", action="store_true", help="export every policy again, also those whose export is current")
    _many_options(em)
    vm = sub.add_parser("verify-many", parents=[common], help="verify every export under ROOT, each in its own process")
    vm.add_argument("root", metavar="ROOT")
    _many_options(vm)


SOURCE_HELP = ("a spec directory (policy.json, or the file itself), an RLlib checkpoint directory (holding "
               "rllib_checkpoint.json; read without ray and without running its pickles), a SavedModel directory, "
               "or an export of this package (exported again)")


def _export_parser(sub, common, name: str, help_text: str) -> None:
    """``export`` and its alias ``convert``: the same options, for every source. The options a
    source owns are declared by the source (:mod:`exporter.sources`) and listed in a group of its own."""
    from policy_export.exporter import sources

    ex = sub.add_parser(name, parents=[common], help=help_text)
    ex.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    ex.add_argument("--out", required=True, metavar="OUT", help="export directory to write")
    _formats_argument(ex)
    ex.add_argument("--opset", type=int, default=D.DEFAULT_OPSET, metavar="N",
                    help=f"ONNX opset (default {D.DEFAULT_OPSET})")
    ex.add_argument("--seed", type=int, default=D.EXPORT_SEED, metavar="S",
                    help=f"seed of the parity samples (default {D.EXPORT_SEED})")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing export at OUT")
    ex.add_argument("--inputs-as-nchw", action="store_true",
                    help="ONNX model takes rank-4 image inputs as NCHW (other inputs keep their layout)")
    ex.add_argument("--explore-samples", type=int, default=D.DEFAULT_EXPLORE_SAMPLES, metavar="N",
                    help="sampled actions per runtime for exploration parity (default 10000; 0 skips)")
    ex.add_argument("--external-data-threshold", type=int, default=D.DEFAULT_EXTERNAL_DATA_THRESHOLD, metavar="BYTES",
                    help="ONNX models whose weights exceed this many bytes keep them in a .data file beside the "
                         f"model (default {D.DEFAULT_EXTERNAL_DATA_THRESHOLD}; one protobuf stops at 2 GiB)")
    _parity_options(ex, D.DEFAULT_SAMPLES)
    _run_timeout_option(ex)
    _partial_option(ex)
    _quiet_option(ex)
    _declared_groups(ex, [(f"{s.description} only", s.options) for s in sources.all_sources()])
    _declared_groups(ex, format_option_groups())


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
    ve = sub.add_parser("verify", parents=[common], help="check an export's files and re-run its formats against golden outputs")
    ve.add_argument("out", metavar="OUT", help="export directory")
    ve.add_argument("--seed", type=int, default=D.VERIFY_SEED, metavar="S",
                    help=f"seed of fresh samples (default {D.VERIFY_SEED})")
    ve.add_argument("--expect-manifest-sha256", metavar="HEX", default=None,
                    help="fail unless manifest.json has this sha256 (pin the digest kept outside the export)")
    ve.add_argument("--localize", action="store_true",
                    help="name the first intermediate tensor where each ONNX model leaves the frozen graph")
    ve.add_argument("--candidate", action="append", default=[], metavar="FORMAT=PATH",
                    help="check a model file transformed downstream (e.g. onnx=model.opt.onnx) against the "
                         "export's stored parity plan instead of the export's own formats; repeatable")
    ve.add_argument("--server", choices=("triton",), default=None,
                    help="also serve the export with a real Triton server (the serve extra) on free ports of "
                         "127.0.0.1 and check it through Triton's HTTP and gRPC clients, a row per protocol")
    _parity_options(ve, 0)
    _run_timeout_option(ve)
    _quiet_option(ve)


def _serve_parser(sub, common) -> None:
    se = sub.add_parser("serve", parents=[common],
                        help="serve an export with a real Triton Inference Server (HTTP and gRPC) until Ctrl-C")
    se.add_argument("out", metavar="OUT", help="export directory")
    se.add_argument("--port", type=int, default=D.SERVE_HTTP_PORT, metavar="N",
                    help=f"HTTP port (default {D.SERVE_HTTP_PORT})")
    se.add_argument("--grpc-port", type=int, default=D.SERVE_GRPC_PORT, metavar="N",
                    help=f"gRPC port (default {D.SERVE_GRPC_PORT})")
    se.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    se.add_argument("--model-name", default="policy", metavar="NAME",
                    help="the batched model's name; the sampling model is NAME_explore (default policy)")
    se.add_argument("--max-batch-size", type=int, default=D.TRITON_MAX_BATCH_SIZE, metavar="N",
                    help=f"most rows one batch of the batched model holds (default {D.TRITON_MAX_BATCH_SIZE})")
    se.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                    help="where the export's model runs (default auto: the GPU where one is visible)")


def _inspect_parser(sub, common) -> None:
    ins = sub.add_parser("inspect", parents=[common],
                         help="list the inputs and outputs of an export, a .onnx file or a SavedModel, or the "
                              "policies of an RLlib checkpoint")
    ins.add_argument("path", metavar="PATH",
                     help="export directory, model.onnx, SavedModel directory, or RLlib checkpoint directory")
    ins.add_argument("--signature", default="serving_default", metavar="KEY", help="SavedModel signature")
    ins.add_argument("--tag", default="serve", metavar="TAG", help="SavedModel tag")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _diff_parser(sub, common) -> None:
    di = sub.add_parser("diff", parents=[common],
                        help="compare the contracts of two exports: exit 1 on a breaking change")
    di.add_argument("old", metavar="OLD", help="the export (or .onnx / SavedModel) deployed now")
    di.add_argument("new", metavar="NEW", help="the candidate")
    di.add_argument("--json", action="store_true", help="print JSON instead of a summary")


def _rollout_parser(sub, common) -> None:
    ro = sub.add_parser("rollout", parents=[common],
                        help="play an environment with the export's TF and ONNX runtimes and compare their actions")
    ro.add_argument("out", metavar="OUT", help="export directory")
    ro.add_argument("--env", required=True, metavar="ENV_ID", help="gymnasium environment id, e.g. CartPole-v1")
    ro.add_argument("--episodes", type=int, default=D.DEFAULT_EPISODES, metavar="N",
                    help=f"episodes (default {D.DEFAULT_EPISODES})")
    ro.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the first episode (default 0)")
    ro.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    _tf32_option(ro)
    ro.add_argument("--report-json", metavar="F", help="write the rollout report as JSON to F")
    ro.add_argument("--formats", default=None, metavar="LIST",
                    help="comma-separated formats that play, the first is the reference unless it is lossy "
                         "(the float SavedModel is then the reference) (default saved_model,onnx; also "
                         "frozen_graph, onnx_deterministic, tflite, tflite_int8, onnx_int8, onnx_fp16)")
    ro.add_argument("--return-tolerance", type=float, default=D.DEFAULT_RETURN_TOLERANCE, metavar="X",
                    help="lossy formats: largest relative difference of the mean return from the reference's "
                         f"(default {D.DEFAULT_RETURN_TOLERANCE})")
    _run_timeout_option(ro)


if __name__ == "__main__":
    print(synopsis(), end="")
