"""The ``policy-export`` command line: a thin layer over the Python API.

Exit codes: 0 success; 1 a check failed (parity, hashes); 2 bad input or usage (one line on
stderr, no traceback); 3 an unexpected internal error (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.markup import escape

from policy_export.exporter import defaults as D

PROG = "policy-export"
EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
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
    p.add_argument("--behaviour", action="append", default=[], metavar="[FORMAT:]NAME=VALUE",
                   help="threshold of a lossy format (tflite_int8, onnx_int8, onnx_fp16; without FORMAT: all): "
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

    ex = sub.add_parser("export", parents=[common], help="export a policy spec directory to every format and check parity")
    ex.add_argument("spec", metavar="SPEC_DIR", help="directory holding policy.json (or the file itself)")
    ex.add_argument("--out", required=True, metavar="OUT", help="export directory to write")
    ex.add_argument("--formats", default=None, metavar="LIST",
                    help="comma-separated subset of saved_model,frozen_graph,onnx,onnx_deterministic,keras "
                         "(the default) and the opt-in edge formats tflite,tflite_int8,onnx_int8,onnx_fp16")
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
    _quiet_option(ex)

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
    _parity_options(ve, 0)
    _run_timeout_option(ve)
    _quiet_option(ve)

    ins = sub.add_parser("inspect", parents=[common],
                         help="list the inputs and outputs of an export, a .onnx file or a SavedModel")
    ins.add_argument("path", metavar="PATH", help="export directory, model.onnx, or SavedModel directory")
    ins.add_argument("--signature", default="serving_default", metavar="KEY", help="SavedModel signature")
    ins.add_argument("--tag", default="serve", metavar="TAG", help="SavedModel tag")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")

    di = sub.add_parser("diff", parents=[common],
                        help="compare the contracts of two exports: exit 1 on a breaking change")
    di.add_argument("old", metavar="OLD", help="the export (or .onnx / SavedModel) deployed now")
    di.add_argument("new", metavar="NEW", help="the candidate")
    di.add_argument("--json", action="store_true", help="print JSON instead of a summary")

    co = sub.add_parser("convert", parents=[common],
                        help="turn an existing TF1 SavedModel (e.g. RLlib's) into a full export with clean keys")
    co.add_argument("saved_model", metavar="SAVED_MODEL_DIR")
    co.add_argument("--out", required=True, metavar="OUT")
    co.add_argument("--signature", default="serving_default", metavar="KEY")
    co.add_argument("--tag", default="serve", metavar="TAG")
    co.add_argument("--opset", type=int, default=D.DEFAULT_OPSET, metavar="N")
    co.add_argument("--samples", type=int, default=D.DEFAULT_SAMPLES, metavar="N")
    co.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    _tf32_option(co)
    co.add_argument("--overwrite", action="store_true")
    co.add_argument("--state", action="append", default=[], metavar="IN_KEY=OUT_KEY",
                    help="pair a state input with its output, in order (repeat); default: natural order of names")
    co.add_argument("--observation-space", default=None, metavar="JSON|FILE",
                    help="the observation space the graph takes, in policy.json's space format (JSON text or a "
                         ".json file); parity samples from it (default: inferred from the tensors)")
    co.add_argument("--action-space", default=None, metavar="JSON|FILE",
                    help="the action space the graph computes, same format (default: inferred from the tensors)")
    co.add_argument("--dist-inputs", default=None, metavar="KEY",
                    help="Keras base models: the output holding the action distribution inputs "
                         "(default: the one output of the width the action space needs)")
    _run_timeout_option(co)
    _quiet_option(co)

    ro = sub.add_parser("rollout", parents=[common],
                        help="play an environment with the export's TF and ONNX runtimes and compare their actions")
    ro.add_argument("out", metavar="OUT", help="export directory")
    ro.add_argument("--env", required=True, metavar="ENV_ID", help="gymnasium environment id, e.g. CartPole-v1")
    ro.add_argument("--episodes", type=int, default=10, metavar="N", help="episodes (default 10)")
    ro.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the first episode (default 0)")
    ro.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    _tf32_option(ro)
    ro.add_argument("--report-json", metavar="F", help="write the rollout report as JSON to F")
    ro.add_argument("--formats", default=None, metavar="LIST",
                    help="comma-separated formats that play, the first is the reference unless it is lossy "
                         "(the float SavedModel is then the reference) (default saved_model,onnx; also "
                         "frozen_graph, onnx_deterministic, tflite, tflite_int8, onnx_int8, onnx_fp16)")
    ro.add_argument("--return-tolerance", type=float, default=0.05, metavar="X",
                    help="lossy formats: largest relative difference of the mean return from the reference's "
                         "(default 0.05)")
    _run_timeout_option(ro)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code.

    SIGINT, SIGTERM and SIGHUP are handled until it returns: before an export is in place they
    stop it (nothing left behind, exit 130); once it is in place the export is complete, so the
    command finishes, says on stderr that it was interrupted after the export was complete, and
    exits 0.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    from policy_export.exporter.staging import Interrupted, signals_as_interrupts

    with signals_as_interrupts() as signals:  # SIGTERM and SIGHUP clean up like Ctrl-C
        try:
            code = _run(args)
            signals.record_only()
        except KeyboardInterrupt as e:  # raised where _run could not report it (progress set-up)
            signals.record_only()
            code = _interrupted(e.signum if isinstance(e, Interrupted) else None)
        late = signals.take()
        if late is not None and code != EXIT_INTERRUPTED:
            import signal

            if signals.complete:
                print(f"{PROG}: interrupted by {signal.Signals(late).name} after the export was complete",
                      file=sys.stderr)
            else:  # the signal was swallowed where Python ignores exceptions; the command did not stop
                code = _interrupted(late)
        return code


def _interrupted(signum: int | None) -> int:
    import signal

    how = signal.Signals(signum).name if signum is not None else "SIGINT"
    print(f"{PROG}: interrupted by {how}; no partial export was left behind", file=sys.stderr)
    return EXIT_INTERRUPTED


def _run(args) -> int:
    """Run the command of ``args``; every error becomes its exit code and one line on stderr."""
    from rich.console import Console

    from policy_export.exporter.progress import SILENT, for_terminal
    from policy_export.exporter.staging import Interrupted, signals_as_interrupts

    width = None if sys.stdout.isatty() else 200  # CI logs: no wrapping or clipping of the parity table
    out, err = Console(width=width), Console(stderr=True)
    # progress of the long commands goes to stderr; stdout (tables, JSON) is unchanged by it
    args.progress = (for_terminal(args.quiet, console=err) if args.command in ("export", "verify", "convert")
                     else SILENT)
    with signals_as_interrupts() as signals:  # the session main() holds
        try:
            commands = {"export": _cmd_export, "verify": _cmd_verify, "rollout": _cmd_rollout,
                        "inspect": _cmd_inspect, "diff": _cmd_diff, "convert": _cmd_convert}
            return commands[args.command](args, out)
        except KeyboardInterrupt as e:
            signals.record_only()  # a second signal while reporting is only recorded
            args.progress.close(failed=True)
            return _interrupted(e.signum if isinstance(e, Interrupted) else None)
        except Exception as e:  # the one place every error is turned into an exit code
            signals.record_only()
            from policy_export.policy.errors import PolicyExportError

            args.progress.close(failed=True)  # a live display is cleared: the error line stands alone
            if args.debug:
                err.print_exception()
            if isinstance(e, PolicyExportError):
                report = getattr(e, "report", None)
                if report is not None:
                    from policy_export.exporter.reports import parity_table

                    out.print(parity_table(report, "parity"))
                print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
                return e.exit_code
            print(f"{PROG}: internal error: {type(e).__name__}: {one_line(e)} (run with --debug for the traceback)",
                  file=sys.stderr)
            return EXIT_INTERNAL
        finally:
            args.progress.close()


def _tolerances(args, base=None):
    from policy_export.exporter.parity import Tolerance, Tolerances
    from policy_export.policy.errors import InputError

    tol = base or Tolerances()
    default = Tolerance(args.atol if args.atol is not None else tol.default.atol,
                        args.rtol if args.rtol is not None else tol.default.rtol)
    per_output = dict(tol.per_output)
    for item in args.tolerance:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--tolerance {item!r}: expected KEY=ATOL[:RTOL]")
        per_output[key] = Tolerance.parse(value)
    return Tolerances(default, per_output, tol.allow_non_finite | frozenset(args.allow_non_finite))


def _behaviour_option(args) -> dict:
    """``--behaviour [FORMAT:]NAME=VALUE`` items as the API's ``behaviour`` overrides (only when given,
    so that the API's defaults and the manifest's thresholds apply otherwise)."""
    from policy_export.exporter.behaviour import parse_override

    overrides: dict[str, dict[str, float]] = {}
    for item in getattr(args, "behaviour", []) or []:
        fmt, name, value = parse_override(item)
        overrides.setdefault(fmt, {})[name] = value
    return {"behaviour": overrides} if overrides else {}


def _check_run_timeout(args) -> None:
    from policy_export.exporter.watchdog import check_run_timeout

    if args.run_timeout is not None:
        check_run_timeout(args.run_timeout, "--run-timeout")


def _check_seed(args) -> None:
    from policy_export.policy.errors import InputError

    if not 0 <= args.seed < 2**31:
        raise InputError(f"--seed must be in [0, 2**31), got {args.seed}")


def _check_report_paths(args, export_dir: str | None = None) -> None:
    """Report files (and ``$GITHUB_STEP_SUMMARY``) must be writable where asked, and outside the
    export (a file inside it would fail the next verify): checked before any work is done."""
    from policy_export.exporter.staging import normalise
    from policy_export.policy.errors import InputError

    targets = [(f"--{flag.replace('_', '-')}", getattr(args, flag, None)) for flag in ("report_json", "junit")]
    targets.append(("GITHUB_STEP_SUMMARY", os.environ.get("GITHUB_STEP_SUMMARY")))
    inside = normalise(export_dir) if export_dir else None
    for what, target in targets:
        if not target:
            continue
        path = normalise(target)
        if path.is_dir():
            raise InputError(f"{what} {target}: is a directory")
        if not path.parent.is_dir():
            raise InputError(f"{what} {target}: directory {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise InputError(f"{what} {target}: not writable")
        if inside is not None and (path == inside or inside in path.parents):
            raise InputError(f"{what} {target}: is inside the export {export_dir}; write reports elsewhere")


def _emit_reports(args, report, suite: str, file_problems=(), extra: dict | None = None) -> None:
    try:
        _write_reports(args, report, suite, file_problems, extra)
    except OSError as e:
        from policy_export.policy.errors import ExportError

        raise ExportError(f"cannot write a report: {e}") from e


def _write_reports(args, report, suite: str, file_problems=(), extra: dict | None = None) -> None:
    from policy_export.exporter import reports

    if args.report_json:
        reports.write_json(args.report_json, {**(extra or {}), "file_problems": list(file_problems),
                                              "passed": report.passed and not file_problems, **report.to_json()})
    if args.junit:
        Path(args.junit).write_text(reports.junit_xml(report, suite, file_problems), encoding="utf-8")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(reports.markdown_summary(report, suite, file_problems))


def _check_samples(args, obs_space) -> None:
    """``--samples`` (and ``--explore-samples``) within the limits, before anything is allocated."""
    from policy_export.exporter.exploration import DEFAULT_OBSERVATIONS
    from policy_export.policy.spaces import check_sample_budget

    check_sample_budget(args.samples, obs_space, "--samples")
    explore = getattr(args, "explore_samples", 0)
    if explore:
        check_sample_budget(explore * DEFAULT_OBSERVATIONS, obs_space,
                            f"--explore-samples {explore} x {DEFAULT_OBSERVATIONS} observations:")


def _check_tolerance_keys(args, doc) -> None:
    """``--tolerance KEY=...`` must name an output of the export (a typo would silently check nothing)."""
    from policy_export.policy.errors import InputError

    outputs = [o.get("key") for o in doc["contract"]["outputs"]]
    known = set(outputs) | set(doc["tolerances"].get("per_output", {}))
    for item in args.tolerance:
        key = item.partition("=")[0]
        if key not in known:
            raise InputError(f"--tolerance {item!r}: {key!r} is not an output of the export; outputs are {outputs}")
    for key in args.allow_non_finite:
        if key not in outputs:
            raise InputError(f"--allow-non-finite {key!r} is not an output of the export; outputs are {outputs}")


def _device_plan(args):
    """The device plan of a command: ``--device`` with TF32 pinned off unless ``--allow-tf32``."""
    from policy_export.exporter.devices import plan_devices

    return plan_devices(args.device, allow_tf32=args.allow_tf32)


def _heavy_imports(args) -> None:
    """Import TensorFlow and friends quietly; called after the cheap input checks."""
    from policy_export.exporter.quiet import quiet_libraries

    quiet_libraries(getattr(args, "debug", False))


def _cmd_export(args, console) -> int:
    from policy_export.exporter.context import check_opset, resolve_formats
    from policy_export.exporter.staging import check_target
    from policy_export.policy.errors import InputError
    from policy_export.policy.spec import load_spec

    start = time.perf_counter()
    # cheap checks first: bad input fails in a fraction of a second, before TensorFlow loads
    if args.formats is not None and not [f for f in args.formats.split(",") if f.strip()]:
        raise InputError("--formats is empty; name at least one format, or leave the option out for all")
    formats = resolve_formats([f.strip() for f in args.formats.split(",") if f.strip()] if args.formats else None)
    check_opset(args.opset)
    if args.samples < 1:
        raise InputError(f"--samples must be at least 1, got {args.samples}")
    if args.explore_samples < 0:
        raise InputError(f"--explore-samples must be 0 or more, got {args.explore_samples}")
    if args.external_data_threshold < 0:
        raise InputError(f"--external-data-threshold must be 0 or more, got {args.external_data_threshold}")
    _check_seed(args)
    _check_run_timeout(args)
    _check_report_paths(args, args.out)
    tolerances = _tolerances(args)
    spec = load_spec(args.spec)
    _check_samples(args, spec.observation_space)
    check_target(Path(args.out).absolute(), args.overwrite)
    _heavy_imports(args)

    from policy_export.exporter.api import ParityFailedError, export_spec
    from policy_export.exporter.reports import parity_table

    try:
        result = export_spec(args.spec, args.out, device=_device_plan(args), formats=formats, opset=args.opset,
                             samples=args.samples, seed=args.seed, tolerances=tolerances,
                             overwrite=args.overwrite, explore_samples=args.explore_samples,
                             inputs_as_nchw=args.inputs_as_nchw,
                             external_data_threshold=args.external_data_threshold, progress=args.progress,
                             run_timeout=args.run_timeout, **_behaviour_option(args))
    except ParityFailedError as e:
        args.progress.close(failed=True)
        if e.report is not None:
            _emit_reports(args, e.report, "export")
        raise
    args.progress.close()
    _emit_reports(args, result.parity, "export", extra={"path": str(result.path)})
    console.print(parity_table(result.parity, f"parity: {result.parity.samples} samples vs the TF session "
                                              f"({result.parity.devices.get('tf_device')}, "
                                              f"{', '.join(result.parity.devices.get('onnxruntime_providers_used', []))})"))
    console.print(f"exported [bold]{escape(str(result.path))}[/bold]: {', '.join(result.formats)} "
                  f"({len(result.files)} files) in {time.perf_counter() - start:.1f} s")
    return EXIT_OK


def _cmd_verify(args, console) -> int:
    from policy_export.exporter.manifest import MANIFEST, read_manifest
    from policy_export.exporter.parity import Tolerances

    from policy_export.policy.errors import InputError

    doc = read_manifest(Path(args.out))
    tolerances = _tolerances(args, Tolerances.from_json(doc["tolerances"]))
    _check_seed(args)
    if args.samples < 0:
        raise InputError(f"--samples must be 0 or more, got {args.samples}")
    _check_run_timeout(args)
    _check_report_paths(args, args.out)
    _check_tolerance_keys(args, doc)
    from policy_export.exporter.replay import parse_candidates

    candidates = parse_candidates(args.candidate)
    if args.samples:
        from policy_export.policy.spaces import space_from_json

        _check_samples(args, space_from_json(doc.get("spaces", {}).get("observation"), "$.spaces.observation",
                                             str(Path(args.out) / MANIFEST)))
    _heavy_imports(args)

    from policy_export.exporter.api import verify_export
    from policy_export.exporter.reports import parity_table

    result = verify_export(args.out, samples=args.samples, seed=args.seed, device=_device_plan(args),
                           tolerances=tolerances, expect_manifest_sha256=args.expect_manifest_sha256,
                           candidates=candidates, localize=args.localize, progress=args.progress,
                           run_timeout=args.run_timeout, **_behaviour_option(args))
    args.progress.close()
    _emit_reports(args, result.parity, "verify", result.file_problems,
                  extra={"path": str(result.path), "plan": result.notes})
    devices = result.parity.devices
    console.print(parity_table(result.parity, f"verify {escape(args.out)}: stored parity plan "
                                              f"({result.parity.samples} golden samples; "
                                              f"TF {devices.get('tf_device')}, ONNX Runtime "
                                              f"{', '.join(devices.get('onnxruntime_providers_used', []))})"))
    for note in result.notes:
        console.print(f"plan: {escape(one_line(note))}", soft_wrap=True)
    from policy_export.exporter.reports import record_problems

    for problem in (result.file_problems + [f"{k}: {v}" for k, v in result.parity.errors.items()]
                    + record_problems(result.parity)):
        console.print(f"[bold red]{escape(one_line(problem))}[/bold red]", soft_wrap=True)
    if not result.passed:
        failed = len(result.parity.failures()) + len(result.file_problems) + len(result.parity.errors)
        print(f"{PROG}: verify failed: {failed} problem(s)", file=sys.stderr)
        return EXIT_CHECK_FAILED
    what = "every candidate matches its plan" if candidates else "every format matches"
    console.print(f"verified [bold]{escape(args.out)}[/bold]: files match the manifest, {what}")
    return EXIT_OK


def _contract(path: str, args=None):
    """Read a contract; TensorFlow is imported (quietly) only for SavedModels."""
    from policy_export.exporter.inspection import contract_of

    if (Path(path) / "saved_model.pb").is_file():
        _heavy_imports(args)
    return contract_of(path, getattr(args, "signature", "serving_default"), getattr(args, "tag", "serve"))


def _cmd_inspect(args, console) -> int:
    from rich.table import Table
    from rich.text import Text

    from policy_export.exporter.inspection import contract_json

    kind, contract = _contract(args.path, args)
    if args.json:
        print(contract_json(kind, Path(args.path), contract))
        return EXIT_OK
    table = Table(title=escape(f"{args.path} ({kind}, signature {contract.signature_key})"), title_justify="left")
    for column in ("", "key", "dtype", "shape", "required / default"):
        table.add_column(column)
    for side, specs in (("input", contract.inputs), ("output", contract.outputs)):
        for s in specs:
            need = "required" if s.required else f"default {s.default!r}"
            table.add_row(*(Text(one_line(v)) for v in (side, s.key, s.dtype, s.shape_text(),
                                                          need if side == "input" else "")))
    console.print(table)
    return EXIT_OK


def _cmd_diff(args, console) -> int:
    import json

    from policy_export.signatures.diff import diff_contracts

    (_, old), (_, new) = _contract(args.old, args), _contract(args.new, args)
    result = diff_contracts(old, new)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        console.print(f"[bold]{'compatible' if result.compatible else 'BREAKING'}[/bold]: "
                      f"{escape(one_line(f'{args.old} -> {args.new}'))}")
        for change in result.changes:
            style = "red" if change.kind == "breaking" else "green"
            console.print(f"  [{style}]{change.kind}[/{style}] "
                          f"{escape(one_line(f'{change.side} {change.key}: {change.what}'))}", soft_wrap=True)
        if not result.changes:
            console.print("  no change to any input or output")
    return EXIT_OK if result.compatible else EXIT_CHECK_FAILED


def _space_option(value: str | None, option: str):
    """A gymnasium space from JSON text or a .json file (policy.json's space format); ``None`` stays ``None``.

    Raises:
        InputError: unreadable file. JSONError: invalid or non-strict JSON. SpecError: JSON that is not a valid space.
    """
    import json

    from policy_export.policy.errors import InputError

    if value is None:
        return None
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"{option} {value!r}: neither JSON text nor a readable file ({e.strerror})") from e
    from policy_export.policy import jsonio
    from policy_export.policy.spaces import space_from_json

    obj = jsonio.loads(text, option)  # strict: duplicate keys, NaN, huge integers are exit 2

    return space_from_json(obj, "$", option)


def _cmd_convert(args, console) -> int:
    from policy_export.exporter.context import check_opset
    from policy_export.exporter.staging import check_target
    from policy_export.policy.errors import ExportError, InputError

    check_opset(args.opset)
    _check_run_timeout(args)
    if not (Path(args.saved_model) / "saved_model.pb").is_file():
        raise ExportError(f"{args.saved_model} is not a SavedModel directory (no saved_model.pb)")
    check_target(Path(args.out).absolute(), args.overwrite)
    pairs = []
    for item in args.state:
        a, sep, b = item.partition("=")
        if not sep or not a or not b:
            raise InputError(f"--state {item!r}: expected IN_KEY=OUT_KEY")
        pairs.append((a, b))
    spaces = {name: _space_option(getattr(args, name), f"--{name.replace('_', '-')}")
              for name in ("observation_space", "action_space")}
    if args.samples < 1:
        raise InputError(f"--samples must be at least 1, got {args.samples}")
    if spaces["observation_space"] is not None:
        _check_samples(args, spaces["observation_space"])
    else:  # the observation space is known only once the model is read; the count alone is capped now
        from policy_export.policy.spaces import MAX_SAMPLES

        if args.samples > MAX_SAMPLES:
            raise InputError(f"--samples {args.samples} exceeds the limit of {MAX_SAMPLES}")
    _heavy_imports(args)
    from policy_export.exporter.convert import convert_saved_model
    from policy_export.exporter.reports import parity_table
    from policy_export.exporter.watchdog import run_limit

    with run_limit(args.run_timeout):
        result = convert_saved_model(args.saved_model, args.out, signature_key=args.signature, tag=args.tag,
                                     device=_device_plan(args), opset=args.opset, samples=args.samples,
                                     overwrite=args.overwrite, state_pairs=pairs or None, dist_inputs=args.dist_inputs,
                                     progress=args.progress, **spaces)
    args.progress.close()
    console.print(parity_table(result.parity, f"parity: {result.parity.samples} samples, source SavedModel session"))
    for new, old in result.manifest["source"]["key_mapping"].items():
        console.print(f"  {old} -> {new}")
    console.print(f"converted [bold]{args.saved_model}[/bold] to [bold]{result.path}[/bold]: {', '.join(result.formats)}")
    return EXIT_OK


def _rollout_formats(text: str | None) -> list[str] | None:
    from policy_export.policy.errors import InputError

    if text is None:
        return None
    formats = [f.strip() for f in text.split(",") if f.strip()]
    if not formats:
        raise InputError("--formats: give two or more formats, e.g. saved_model,onnx")
    return formats


def _cmd_rollout(args, console) -> int:
    from rich.markup import escape
    from rich.table import Table

    from policy_export.exporter.manifest import read_manifest
    from policy_export.policy.errors import InputError

    read_manifest(Path(args.out))
    if args.episodes < 1:
        raise InputError(f"--episodes must be at least 1, got {args.episodes}")
    _check_seed(args)
    _check_run_timeout(args)
    formats = _rollout_formats(args.formats)
    _heavy_imports(args)
    from policy_export.exporter.reports import write_json
    from policy_export.exporter.rollout import rollout

    report = rollout(args.out, args.env, episodes=args.episodes, seed=args.seed, device=_device_plan(args),
                     formats=formats, return_tolerance=args.return_tolerance, run_timeout=args.run_timeout)
    ref, others = report.reference, report.formats[1:]
    table = Table(title=f"rollout {escape(str(args.out))} in {escape(args.env)} (deterministic actions; "
                        f"reference {ref})", title_justify="left")
    table.add_column("episode seed", justify="right")
    for f in report.formats:
        table.add_column(f"return {f}", justify="right")
    table.add_column("steps", justify="right")
    for f in others:
        table.add_column(f"{f}: first divergence", justify="right")
    for e in report.episodes:
        steps = "/".join(str(e.steps[f]) for f in report.formats)
        cells = ["none" if e.first_divergence[f] is None
                 else f"step {e.first_divergence[f]} (lossy)" if f in report.lossy
                 else f"[bold red]step {e.first_divergence[f]}[/bold red]" for f in others]
        table.add_row(str(e.seed), *(f"{e.returns[f]:.1f}" for f in report.formats), steps, *cells)
    console.print(table)
    console.print("mean return: " + ", ".join(f"{f} {report.mean_return(f):.1f}" for f in report.formats))
    console.print("largest action deviation from the reference: "
                  + ", ".join(f"{f} {report.max_deviation(f):.3g}" for f in others))
    console.print("mean return difference from the reference: "
                  + ", ".join(f"{f} {report.return_difference(f):+.1f} ({report.relative_return_difference(f):+.2%}"
                              + (f", lossy: at most {report.return_tolerance:.0%}" if f in report.lossy else "") + ")"
                              for f in others))
    if args.report_json:
        try:
            write_json(args.report_json, report.to_json())
        except OSError as e:
            raise InputError(f"--report-json {args.report_json}: {e.strerror}") from e
    if not report.passed:
        failed = report.failed_formats()
        bad = [f for f in failed if f not in report.lossy]
        parts = []
        if bad:
            parts.append(f"{', '.join(bad)} chose actions beyond the parity tolerance of {ref}'s "
                         f"(largest deviation {max(report.max_deviation(f) for f in bad):.3g})")
        parts += [f"{f}'s mean return differs from {ref}'s by {report.relative_return_difference(f):+.2%} "
                  f"(at most {report.return_tolerance:.0%})" for f in failed if f in report.lossy]
        print(f"{PROG}: rollout failed: {'; '.join(parts)}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
