"""The commands of the ``policy-export`` command line: each turns its parsed arguments into the
Python API's options (:mod:`exporter.options`, which check them before TensorFlow loads), runs the
pipeline and renders the result. Errors go up to :func:`exporter.cli.main` unchanged.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from rich.markup import escape

from policy_export.exporter.cli_args import EXIT_CHECK_FAILED, EXIT_OK, EXIT_PARTIAL, PROG, one_line


def _tolerances(args, base=None):
    from policy_export.exporter.parity.compare import Tolerance, Tolerances
    from policy_export.errors import InputError

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
    from policy_export.exporter.parity.behaviour import parse_override

    overrides: dict[str, dict[str, float]] = {}
    for item in getattr(args, "behaviour", []) or []:
        fmt, name, value = parse_override(item)
        overrides.setdefault(fmt, {})[name] = value
    return {"behaviour": overrides} if overrides else {}


def _check_report_paths(args, export_dir: str | None = None) -> None:
    """Report files (and ``$GITHUB_STEP_SUMMARY``) must be writable where asked, and outside the
    export (a file inside it would fail the next verify): checked before any work is done."""
    from policy_export.exporter.staging import normalise
    from policy_export.errors import InputError

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
        from policy_export.errors import ExportError

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


def _device_plan(args):
    """The device plan of a command: ``--device`` with TF32 pinned off unless ``--allow-tf32``."""
    from policy_export.exporter.devices import plan_devices

    return plan_devices(args.device, allow_tf32=args.allow_tf32)


def _heavy_imports(args) -> None:
    """Import TensorFlow and friends quietly; called after the cheap input checks."""
    from policy_export.exporter.quiet import quiet_libraries

    quiet_libraries(getattr(args, "debug", False))


def _formats_option(text: str | None) -> list[str] | None:
    """``--formats a,b`` as a list (``None`` when not given; an empty list when given empty)."""
    return None if text is None else [f.strip() for f in text.split(",") if f.strip()]


def cmd_export(args, console) -> int:
    from policy_export.exporter.options import ExportOptions
    from policy_export.policy.spec import load_spec

    start = time.perf_counter()
    # every cheap check first (the options check themselves): bad input fails before TensorFlow loads
    opts = ExportOptions(formats=_formats_option(args.formats), opset=args.opset, samples=args.samples,
                         seed=args.seed, tolerances=_tolerances(args), overwrite=args.overwrite,
                         explore_samples=args.explore_samples, inputs_as_nchw=args.inputs_as_nchw,
                         external_data_threshold=args.external_data_threshold, progress=args.progress,
                         run_timeout=args.run_timeout, model_name=args.model_name,
                         model_version=args.model_version, **_behaviour_option(args))
    _check_report_paths(args, args.out)
    spec = load_spec(args.spec)  # parsed once: the export builds its policy from this spec
    opts.check_export(spec.observation_space, args.out)
    _heavy_imports(args)

    from policy_export.errors import ParityFailedError
    from policy_export.exporter.export import run_export_spec
    from policy_export.exporter.options import replace
    from policy_export.exporter.reports import parity_table

    try:
        result = run_export_spec(spec, args.out, replace(opts, device=_device_plan(args)))
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
    return _partial_status(console, result, args)


def _partial_status(console, result, args) -> int:
    """Name each format that could not be made; exit 4 then, unless ``--allow-partial``."""
    for name, reason in result.missing.items():
        console.print(f"[yellow]not written[/yellow]: {escape(name)}: {escape(one_line(reason))}", soft_wrap=True)
    if result.missing and not args.allow_partial:
        console.print(f"{len(result.missing)} format(s) could not be made (exit {EXIT_PARTIAL}; "
                      "--allow-partial accepts that)")
        return EXIT_PARTIAL
    return EXIT_OK


def cmd_verify(args, console) -> int:
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.options import VerifyOptions
    from policy_export.exporter.parity.compare import Tolerances
    from policy_export.exporter.parity.replay import parse_candidates

    doc = read_manifest(Path(args.out))  # read once: verify takes it as read
    opts = VerifyOptions(samples=args.samples, seed=args.seed,
                         tolerances=_tolerances(args, Tolerances.from_json(doc["tolerances"])),
                         expect_manifest_sha256=args.expect_manifest_sha256,
                         candidates=parse_candidates(args.candidate), localize=args.localize,
                         progress=args.progress, run_timeout=args.run_timeout, server=args.server,
                         **_behaviour_option(args))
    _check_report_paths(args, args.out)
    candidates = opts.candidates
    _heavy_imports(args)

    from policy_export.exporter.options import replace
    from policy_export.exporter.reports import parity_table
    from policy_export.exporter.verify import verify_export

    result = verify_export(args.out, replace(opts, device=_device_plan(args)), manifest_doc=doc)
    args.progress.close()
    _emit_reports(args, result.parity, "verify", result.file_problems,
                  extra={"path": str(result.path), "plan": result.notes})
    devices = result.parity.devices
    console.print(parity_table(result.parity, f"verify {escape(args.out)}: stored parity plan "
                                              f"({result.parity.samples} golden samples; "
                                              f"TF {devices.get('tf_device')}, ONNX Runtime "
                                              f"{', '.join(devices.get('onnxruntime_providers_used', []))})"))
    for note in result.notes:
        console.print(f"plan: {escape(one_line(note))}", soft_wrap=True, highlight=False)
    from policy_export.exporter.reports import record_problems

    for problem in (result.file_problems + [f"{k}: {v}" for k, v in result.parity.errors.items()]
                    + record_problems(result.parity)):
        console.print(f"[bold red]{escape(one_line(problem))}[/bold red]", soft_wrap=True, highlight=False)
    if not result.passed:
        failed = len(result.parity.failures()) + len(result.file_problems) + len(result.parity.errors)
        print(f"{PROG}: verify failed: {failed} problem(s)", file=sys.stderr)
        return EXIT_CHECK_FAILED
    what = "every candidate matches its plan" if candidates else "every format matches"
    console.print(f"verified [bold]{escape(args.out)}[/bold]: files match the manifest, {what}")
    return EXIT_OK


def cmd_serve(args, console) -> int:
    from policy_export.exporter.compat import require
    from policy_export.exporter.options import check_model_name

    check_model_name(args.model_name)
    require(("pytriton", "tritonclient"), "serve", "serving with Triton")  # before TensorFlow loads
    _heavy_imports(args)
    from policy_export.exporter.serve.server import TritonServer, serve_forever

    server = TritonServer.start(args.out, http_port=args.port, grpc_port=args.grpc_port, host=args.host,
                                model_name=args.model_name, max_batch_size=args.max_batch_size,
                                device=args.device)

    def ready() -> None:
        for model in server.models:
            batching = f"batched, up to {model.max_batch_size} rows" if model.batched else "not batched"
            inputs = ", ".join(f"{w.key}{' (optional)' if w.optional else ''}" for w in model.inputs)
            console.print(f"model {escape(model.name)} ({batching}): inputs {escape(inputs)}; outputs "
                          f"{escape(', '.join(w.key for w in model.outputs))}", soft_wrap=True, highlight=False)
        ends = server.endpoints()
        console.print(f"HTTP  http://{ends['http']}/v2/models/{escape(server.models[0].name)}/infer", highlight=False)
        console.print(f"gRPC  {ends['grpc']}", highlight=False)
        console.print(f"ready: serving {escape(args.out)} through {server.engine.format} (Ctrl-C to stop)",
                      highlight=False)

    serve_forever(server, ready)
    console.print("stopped", highlight=False)
    return EXIT_OK


def _contract(path: str, args=None):
    """Read a contract; TensorFlow is imported (quietly) only for the formats that need it."""
    from policy_export.exporter.inspection import contract_of, find_model

    hit = find_model(Path(path))
    if hit is not None and hit[0].inspect_needs_tensorflow:
        _heavy_imports(args)
    return contract_of(path, getattr(args, "signature", "serving_default"), getattr(args, "tag", "serve"))


def cmd_inspect(args, console) -> int:
    from rich.table import Table
    from rich.text import Text

    from policy_export.exporter.inspection import contract_json
    from policy_export.exporter.sources.checkpoint import is_rllib_checkpoint

    if is_rllib_checkpoint(args.path):  # the one source inspect reads itself (exports and models otherwise)
        return _inspect_checkpoint(args, console)
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


def _inspect_checkpoint(args, console) -> int:
    """``inspect CHECKPOINT_DIR``: each policy, its spaces, filter, and what convert would rebuild."""
    import json

    from rich.table import Table
    from rich.text import Text

    from policy_export.errors import ExportError
    from policy_export.exporter.sources.checkpoint import read_checkpoint

    checkpoint = read_checkpoint(args.path)  # the safe reader, before TensorFlow loads
    _heavy_imports(args)
    from policy_export.exporter.sources.checkpoint_policy import filter_record, network_kind

    rows = []
    for policy in checkpoint.policies.values():
        try:
            rebuilt = network_kind(policy)
        except ExportError as e:
            rebuilt = f"not rebuilt: {e}"
        rows.append({"policy_id": policy.policy_id, "policy_class": policy.policy_class,
                     "observation_space": str(policy.original_observation_space or policy.observation_space),
                     "action_space": str(policy.action_space), "weights": policy.weight_count,
                     "framework": policy.framework,
                     "observation_filter": filter_record(policy.filter), "filter_note": policy.filter_note,
                     "network": rebuilt})
    if args.json:
        print(json.dumps({"kind": "rllib_checkpoint", "type": checkpoint.type, "format": checkpoint.format,
                          "ray_version": checkpoint.ray_version, "policies": rows}, indent=2))
        return EXIT_OK
    table = Table(title=escape(f"{args.path} (RLlib {checkpoint.type} checkpoint, {checkpoint.format}, ray "
                               f"{checkpoint.ray_version})"), title_justify="left")
    for column in ("policy id", "class", "observations", "actions", "filter", "network"):
        table.add_column(column)
    for r in rows:
        filt = r["observation_filter"]
        table.add_row(*(Text(one_line(str(v))) for v in (
            r["policy_id"], r["policy_class"].rsplit(".", 1)[-1], r["observation_space"], r["action_space"],
            f"{filt['class']} (n={filt['count']})" if filt else "none", r["network"])))
    console.print(table)
    return EXIT_OK


def cmd_diff(args, console) -> int:
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

    from policy_export.errors import InputError

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


def cmd_convert(args, console) -> int:
    from policy_export.errors import InputError
    from policy_export.exporter.options import ExportOptions

    opts = ExportOptions(formats=_formats_option(args.formats), opset=args.opset, samples=args.samples,
                         explore_samples=args.explore_samples, overwrite=args.overwrite, progress=args.progress,
                         run_timeout=args.run_timeout, model_name=args.model_name,
                         model_version=args.model_version)
    from policy_export.exporter.sources.detect import detect

    if detect(args.saved_model, ("checkpoint", "saved_model"), "convert's source").kind == "checkpoint":
        return _convert_checkpoint(args, console, opts)
    checkpoint_only = [flag for flag, given in (("--policy-id", args.policy_id), ("--all-policies", args.all_policies),
                                                ("--no-filter", args.no_filter),
                                                ("--actions", args.actions != "environment")) if given]
    if checkpoint_only:
        raise InputError(f"{', '.join(checkpoint_only)} apply to RLlib checkpoints only; {args.saved_model} holds no "
                         f"rllib_checkpoint.json")
    pairs = []
    for item in args.state:
        a, sep, b = item.partition("=")
        if not sep or not a or not b:
            raise InputError(f"--state {item!r}: expected IN_KEY=OUT_KEY")
        pairs.append((a, b))
    spaces = {name: _space_option(getattr(args, name), f"--{name.replace('_', '-')}")
              for name in ("observation_space", "action_space")}
    opts.check_export(spaces["observation_space"], args.out)  # without one, budgets once the model is read
    _heavy_imports(args)
    from policy_export.exporter.convert import SourceOptions, run_convert_saved_model
    from policy_export.exporter.options import replace
    from policy_export.exporter.reports import parity_table

    source = SourceOptions(signature_key=args.signature or "serving_default", tag=args.tag or "serve",
                           state_pairs=pairs or None, dist_inputs=args.dist_inputs, weights=args.weights, **spaces)
    result = run_convert_saved_model(args.saved_model, args.out, source, replace(opts, device=_device_plan(args)))
    args.progress.close()
    console.print(parity_table(result.parity, f"parity: {result.parity.samples} samples, source SavedModel session"))
    for new, old in result.manifest["source"]["key_mapping"].items():
        console.print(f"  {escape(one_line(old))} -> {escape(one_line(new))}", soft_wrap=True)
    console.print(f"converted [bold]{escape(one_line(args.saved_model))}[/bold] to "
                  f"[bold]{escape(one_line(str(result.path)))}[/bold]: {', '.join(result.formats)}", soft_wrap=True)
    return _partial_status(console, result, args)


def _convert_checkpoint(args, console, opts) -> int:
    """``convert`` of an RLlib checkpoint: read and checked before TensorFlow loads."""
    from policy_export.errors import InputError
    from policy_export.exporter.sources.checkpoint import read_checkpoint

    savedmodel_only = [flag for flag, given in (
        ("--signature", args.signature), ("--tag", args.tag), ("--state", args.state), ("--dist-inputs", args.dist_inputs),
        ("--weights", args.weights),
        ("--observation-space", args.observation_space), ("--action-space", args.action_space)) if given]
    if savedmodel_only:
        raise InputError(f"{', '.join(savedmodel_only)} apply to SavedModels only; {args.saved_model} is an RLlib "
                         f"checkpoint, whose spaces and signature come from the checkpoint itself")
    if args.all_policies and args.policy_id:
        raise InputError("--policy-id and --all-policies exclude each other")
    checkpoint = read_checkpoint(args.saved_model)  # the safe reader: nothing is imported or run
    chosen = list(checkpoint.policies.values()) if args.all_policies else [checkpoint.policy(args.policy_id)]
    opts.check_checkpoint(chosen, args.out, each=args.all_policies)
    _heavy_imports(args)
    from policy_export.exporter.convert import run_convert_checkpoint
    from policy_export.exporter.options import replace
    from policy_export.exporter.reports import parity_table

    results = run_convert_checkpoint(checkpoint, chosen, args.out, replace(opts, device=_device_plan(args)),
                                     each=args.all_policies, use_filter=not args.no_filter, actions=args.actions)
    args.progress.close()
    status = EXIT_OK
    for pid, result in results.items():
        source = result.manifest["source"]
        console.print(parity_table(result.parity, f"policy {pid}: parity, {result.parity.samples} samples vs the "
                                                  f"rebuilt policy's TF session"))
        filt = source.get("observation_filter")
        framework = " (framework tf2: its unnamed weights laid out in RLlib's variable order)" \
            if source.get("framework") == "tf2" else ""
        console.print(f"  {escape(source['policy_class'])}: {escape(source['network'])} network, "
                      f"{len(source['weights_used'])} weights{framework}; observation filter: "
                      f"{escape(filt['class']) + ' (n=' + str(filt['count']) + ')' if filt else 'none'}; "
                      f"actions: {args.actions}", soft_wrap=True)
        if source.get("observation_filter_note"):
            console.print(f"  [yellow]note[/yellow]: {escape(source['observation_filter_note'])}", soft_wrap=True)
        console.print(f"converted [bold]{escape(one_line(args.saved_model))}[/bold] policy {escape(pid)} to "
                      f"[bold]{escape(one_line(str(result.path)))}[/bold]: {', '.join(result.formats)}", soft_wrap=True)
        status = max(status, _partial_status(console, result, args))
    return status


def cmd_rollout(args, console) -> int:
    from policy_export.exporter.manifest import read_manifest

    from policy_export.exporter.options import RolloutOptions, replace

    doc = read_manifest(Path(args.out))  # read once: the rollout takes it as read
    opts = RolloutOptions(episodes=args.episodes, seed=args.seed, formats=_formats_option(args.formats),
                          return_tolerance=args.return_tolerance, run_timeout=args.run_timeout)
    _check_report_paths(args, args.out)
    _heavy_imports(args)
    from policy_export.exporter.reports import write_json
    from policy_export.exporter.rollout import rollout

    report = rollout(args.out, args.env, replace(opts, device=_device_plan(args)), manifest_doc=doc)
    _print_rollout(console, report, args)
    if args.report_json:
        try:
            write_json(args.report_json, report.to_json())
        except OSError as e:  # checked writable before the rollout: it changed meanwhile
            from policy_export.errors import ExportError

            raise ExportError(f"cannot write a report: {e}") from e
    if not report.passed:
        ref = report.reference
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

def _print_rollout(console, report, args) -> None:
    """The rollout's table of episodes and its summary lines."""
    from rich.table import Table

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


def _many_options(args) -> dict:
    keys = {"samples": args.samples, "seed": args.seed}
    if getattr(args, "explore_samples", None) is not None:
        keys["explore_samples"] = args.explore_samples
    formats = _formats_option(getattr(args, "formats", None))
    if formats is not None:
        keys["formats"] = formats
    return {k: v for k, v in keys.items() if v is not None}


def _many_run_options(args) -> dict:
    return dict(jobs=args.jobs, ray=args.ray, memory_mb=args.memory_mb, preload=not args.no_preload)


@contextlib.contextmanager
def _many_progress(args):
    """Progress of export-many/verify-many: none with ``-q``; on a terminal the event lines with a
    live status line under them (done, running, failed, ETA); plain lines on stderr otherwise."""
    from policy_export.exporter.progress import live_terminal

    if args.quiet:
        yield {"progress": lambda line: None}
        return
    if not live_terminal():
        yield {}
        return
    from rich.console import Console

    err = Console(stderr=True)
    with err.status("starting") as status:
        yield {"progress": lambda line: err.print(escape(line), highlight=False, soft_wrap=True),
               "status": lambda counts: status.update(escape(counts))}


def cmd_export_many(args, console) -> int:
    from policy_export.exporter.many import export_many

    _check_report_paths(args, args.out)
    run = _many_run_options(args)
    with _many_progress(args) as shown:
        result = export_many(args.sources, args.out, force=args.force, **run, **shown, **_many_options(args))
    return _many_report(args, console, result, f"export-many {args.out}")


def cmd_verify_many(args, console) -> int:
    from policy_export.exporter.many import verify_many

    _check_report_paths(args, args.root)
    run = _many_run_options(args)
    with _many_progress(args) as shown:
        result = verify_many(args.root, **run, **shown, **_many_options(args))
    return _many_report(args, console, result, f"verify-many {args.root}")


def _many_report(args, console, result, title: str) -> int:
    from policy_export.exporter.many import report

    try:
        if args.report_json:
            report.write(args.report_json, report.dumps(result.to_json()))
        if args.junit:
            report.write(args.junit, result.junit())
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            with open(summary, "a", encoding="utf-8") as f:
                f.write(result.markdown(title))
    except OSError as e:
        from policy_export.errors import ExportError

        raise ExportError(f"cannot write a report: {e}") from e
    console.print(report.table(result.results, escape(title)))
    counts = ", ".join(f"{v} {k}" for k, v in sorted(report.summary(result.results, result.seconds)["counts"].items()))
    if not result.passed:
        console.print(f"{len(result.failed)} of {len(result.results)} policies failed: "
                      f"{escape(', '.join(result.failed))} ({counts}; {result.seconds:.1f} s)", soft_wrap=True)
        return EXIT_CHECK_FAILED
    console.print(f"{len(result.results)} policies: {counts} in {result.seconds:.1f} s")
    return EXIT_OK
