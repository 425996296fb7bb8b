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
from policy_export.exporter.screen import error_line


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
    """``--behaviour [FORMAT:]NAME=VALUE`` items as the API's ``behaviour`` overrides (``None`` when
    none is given, so that the API's defaults and the manifest's thresholds apply)."""
    from policy_export.exporter.parity.behaviour import parse_override

    overrides: dict[str, dict[str, float]] = {}
    for item in getattr(args, "behaviour", []) or []:
        fmt, name, value = parse_override(item)
        overrides.setdefault(fmt, {})[name] = value
    return {"behaviour": overrides or None}


# The declared options each command consumes itself, not as a field of its options object (those
# are copied by core_options.from_parsed): what makes a field (the tolerances, the device plan),
# where reports go, what is printed, and the signing requests. tests/test_declared_values.py fails
# for a declared option that is neither.
CONSUMED = {
    "export": {"atol", "rtol", "tolerance", "allow_non_finite", "allow_tf32", "report_json", "junit",
               "allow_partial", "quiet", "verbose", "sign_key", "sign_key_password_env", "signing_certificate",
               "certificate_chain", "sign_keyless", "signature_file"},
    "verify": {"candidate", "atol", "rtol", "tolerance", "allow_non_finite", "allow_tf32", "report_json", "junit",
               "quiet", "verbose", "public_key", "certificate_chain", "identity", "identity_issuer", "signature_file"},
    "rollout": {"env", "allow_tf32", "report_json"},
}


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


def _observations_fit(observations, doc: dict) -> None:
    """``--observations`` files checked against the observation space the manifest records (their
    headers only, before TensorFlow loads); nothing to check without either."""
    spaces = doc.get("spaces") if isinstance(doc, dict) else None
    if not observations or not isinstance(spaces, dict) or "observation" not in spaces:
        return
    from policy_export.exporter.recorded import check_fit
    from policy_export.policy.spaces import space_from_json

    check_fit(observations, space_from_json(spaces["observation"], "$.spaces.observation", "manifest.json"))


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
    signature = (extra or {}).get("signature")
    if args.junit:
        Path(args.junit).write_text(reports.junit_xml(report, suite, file_problems, signature), encoding="utf-8")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(reports.markdown_summary(report, _summary_title(args, suite), file_problems, signature))


def _summary_title(args, suite: str, path: str | None = None) -> str:
    """The step summary's heading: the command and what it checked, as typed (``export
    fixtures/cartpole_mlp -> out/cartpole``, ``verify out/cartpole``)."""
    from policy_export.exporter.screen import one_line as shown

    out = path or getattr(args, "out", None) or ""
    source = getattr(args, "source", None)
    command = getattr(args, "command", suite)
    return shown(f"{command} {source} -> {out}" if source else f"{command} {out}")


def _device_plan(args):
    """The device plan of a command: ``--device`` with TF32 pinned off unless ``--allow-tf32``."""
    from policy_export.exporter.devices import plan_devices

    return plan_devices(args.device, allow_tf32=args.allow_tf32)


def _heavy_imports(args) -> None:
    """Import TensorFlow and friends quietly; called after the cheap input checks. The import is a
    progress stage of its own (``load TensorFlow``), so a terminal says at once what the seconds
    go to."""
    from policy_export.exporter.progress import SILENT
    from policy_export.exporter.quiet import quiet_libraries

    if "tensorflow" in sys.modules:  # loaded already (a command run in-process after another)
        quiet_libraries(getattr(args, "debug", False))
        return
    with (getattr(args, "progress", None) or SILENT).stage("load TensorFlow"):
        quiet_libraries(getattr(args, "debug", False))


def _formats_option(text: str | None) -> list[str] | None:
    """``--formats a,b`` as a list (``None`` when not given; an empty list when given empty)."""
    return None if text is None else [f.strip() for f in text.split(",") if f.strip()]


def export_options(args):
    """The export's own options (core: not a source's) from the command line, checked (no TensorFlow)."""
    from policy_export.exporter.options import ExportOptions

    from policy_export.exporter import core_options as core

    given = args.atol is not None or args.rtol is not None or args.tolerance or args.allow_non_finite
    return core.from_parsed(ExportOptions, args, core.EXPORT + core.format_options(),
                            formats=_formats_option(args.formats), tolerances=_tolerances(args) if given else None,
                            progress=args.progress, **_behaviour_option(args))


def verify_options(args, tolerances=None):
    """``verify``'s options from the command line (``tolerances``: the export's, which the flags
    change), checked (no TensorFlow)."""
    from policy_export.exporter import core_options as core
    from policy_export.exporter.options import VerifyOptions
    from policy_export.exporter.parity.replay import parse_candidates

    return core.from_parsed(VerifyOptions, args, core.VERIFY, tolerances=_tolerances(args, tolerances),
                            candidates=parse_candidates(args.candidate), progress=args.progress,
                            **_behaviour_option(args))


def rollout_options(args):
    """``rollout``'s options from the command line, checked (no TensorFlow)."""
    from policy_export.exporter import core_options as core
    from policy_export.exporter.options import RolloutOptions

    return core.from_parsed(RolloutOptions, args, core.ROLLOUT, formats=_formats_option(args.formats))


def _source_values(args) -> dict:
    """The sources' options given on the command line (an option not given is absent)."""
    from policy_export.exporter import sources

    return {o.name: getattr(args, o.name) for s in sources.all_sources() for o in s.options if hasattr(args, o.name)}


def cmd_export(args, console) -> int:
    """``export SOURCE --out OUT`` (and ``convert``, its alias) for every source: read and checked
    before TensorFlow loads, then each chosen policy exported with parity."""
    from policy_export.exporter import pipeline
    from policy_export.exporter.foreign import is_model_file

    start = time.perf_counter()
    opts = export_options(args)  # every cheap check first: bad input fails before TensorFlow loads
    _check_report_paths(args, args.out)
    sign_to = _sign_request(args)
    if is_model_file(args.source):
        return _export_model_file(args, console, opts, sign_to, start)
    opened = pipeline.open_source(args.source, _source_values(args), what=f"{args.command}'s source")
    plan = pipeline.plan_source(opened, args.out, opts)
    _formats_the_source_makes(opened, opts, named=args.formats is not None)
    _heavy_imports(args)

    from policy_export.exporter.options import replace

    with _reports_on_failure(args):
        results = pipeline.run_source(opened, plan, replace(opts, device=_device_plan(args)))
    args.progress.close()
    reports_by_policy = {pid: r.parity for pid, r in results.items()}
    paths = {pid: str(r.path) for pid, r in results.items()}
    try:  # signed before the reports are written: they name the signer
        signed = _sign_exports(args, paths, sign_to)
    except Exception:
        _emit_policy_reports(args, reports_by_policy, paths)
        raise
    _emit_policy_reports(args, reports_by_policy, paths, {pid: entry for pid, (_, entry) in signed.items()})
    status = EXIT_OK
    for pid, result in results.items():
        _print_result(console, opened.source, pid, result, args.verbose)
        status = max(status, _partial_status(console, result, args))
    console.print(f"{len(results)} export{'s' if len(results) > 1 else ''} in {time.perf_counter() - start:.1f} s")
    for pid, (done, _) in signed.items():
        print_note(console, "signed", f"{paths[pid]} ({done.files} files) with {done.signer}: {done.signature}")
    return status


cmd_convert = cmd_export  # the alias: the same command, every option export takes


def _formats_the_source_makes(opened, opts, named: bool) -> None:
    """A format named in ``--formats`` that no policy of the source can have (the Keras base model
    of a source that loads none) is refused before TensorFlow loads; left to the default, it is
    skipped as the export skips it."""
    if not named:
        return
    from policy_export.errors import InputError
    from policy_export.exporter import formats

    source = opened.source
    for name in opts.formats:
        if formats.get(name).capabilities.base_model and not source.has_base_model:
            raise InputError(f"format {name!r} cannot be written for {source.description}: it has no Keras base "
                             "model; leave it out of --formats")


def _export_model_file(args, console, opts, sign_to, start: float) -> int:
    """``export MODEL.onnx --reference REF.npz --out OUT``: a policy exported elsewhere, made an
    export without TensorFlow (:mod:`exporter.foreign.export`)."""
    from policy_export.exporter.devices import plan_ort_devices
    from policy_export.exporter.foreign.export import ModelFileSource, plan_model_export
    from policy_export.exporter.options import replace

    source_options = sorted(k for k in _source_values(args))
    if source_options:
        from policy_export.errors import InputError
        from policy_export.exporter import sources

        flag = next(o.flag for s in sources.all_sources() for o in s.options if o.name == source_options[0])
        raise InputError(f"{flag} applies to a source this package reads; {args.source} is a model file exported "
                         "elsewhere")
    opts = replace(opts, device=plan_ort_devices(args.device, args.allow_tf32))
    job = plan_model_export(args.source, args.out, opts)
    from policy_export.exporter.watchdog import run_limit

    with _reports_on_failure(args), run_limit(opts.run_timeout):
        result = job.run()
    args.progress.close()
    paths = {None: str(result.path)}
    try:
        signed = _sign_exports(args, paths, sign_to)
    except Exception:
        _emit_policy_reports(args, {None: result.parity}, paths)
        raise
    _emit_policy_reports(args, {None: result.parity}, paths, {pid: entry for pid, (_, entry) in signed.items()})
    _print_result(console, ModelFileSource(job.recording.path.name), None, result, args.verbose)
    status = _partial_status(console, result, args)
    console.print(f"1 export in {time.perf_counter() - start:.1f} s")
    for pid, (done, _) in signed.items():
        print_note(console, "signed", f"{paths[pid]} ({done.files} files) with {done.signer}: {done.signature}")
    return status


def _print_result(console, source, pid, result, verbose: bool = False) -> None:
    """One export's verdict (one line per format; ``verbose``: the full table first), then its
    recorded, source and "exported" lines, and where the full table is."""
    from policy_export.exporter.reports import print_verdict

    devices = result.parity.devices
    where = f" ({devices.get('tf_device')}, {', '.join(devices.get('onnxruntime_providers_used', []))})" \
        if devices.get("tf_device") else ""
    title = (f"{'' if pid is None else f'policy {pid}: '}parity: {result.parity.samples} {getattr(source, 'counted', 'samples')} vs "
             f"{source.reference}{where}")
    print_verdict(console, result.parity, title, verbose)
    recorded = recorded_line(result.parity, (result.manifest.get("parity") or {}).get("recorded"))
    if recorded:
        print_note(console, "on your observations", recorded)
    for line in source.summary(result.manifest.get("source")):
        console.print(escape(one_line(line)), soft_wrap=True)
    console.print(f"exported [bold]{escape(one_line(str(result.path)))}[/bold]: {', '.join(result.formats)} "
                  f"({len(result.files)} files)", soft_wrap=True)
    if not verbose:
        _full_table_hint(console, Path(result.path) / "parity" / "report.json")


def print_note(console, label: str, note: object) -> None:
    """``label: note``, wrapped at the console's width (80 columns through a pipe) with its
    continuation lines indented under the note: a line that starts with a space continues the one
    above. Words are never split (a path stays whole); paths show as the user typed them."""
    from policy_export.exporter.screen import note as say

    say(console, label, note)


def _full_table_hint(console, report: str | Path | None) -> None:
    """Where the full parity table is: ``--verbose``, or the report file (``None``: ``--report-json``)."""
    from policy_export.exporter.screen import say

    say(console, f"full table: --verbose, or {report if report else '--report-json FILE'}")


def recorded_line(report, record) -> str | None:
    """One line on the recorded group, apart from the space's samples: how many rows of which
    files, the worst error per format on them, and whether every format passed there."""
    from policy_export.exporter.parity.compare import recorded_summary

    summary = recorded_summary(report)
    if not summary or not record:
        return None
    worst = []
    for fmt, entry in summary.items():
        errors = [(v.get("max_abs_err", 0.0), k) for k, v in entry["outputs"].items() if "max_abs_err" in v]
        shown = f"{max(errors)[0]:.2g} ({max(errors)[1]})" if errors else \
            ", ".join(f"{k} {v['metric']} {v['value']:.2%}" for k, v in entry["outputs"].items())
        worst.append(f"{fmt} {shown}{'' if entry['passed'] else ' FAILED'}")
    files = ", ".join(Path(f["path"]).name for f in record.get("files", []))
    return (f"{record.get('rows')} rows of {files} ({record.get('out_of_bounds', 0)} outside the "
            f"space's bounds): " + "; ".join(worst))


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
    from policy_export.exporter.foreign import is_model_file
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.parity.compare import Tolerances

    if is_model_file(args.out):
        return _verify_model_file(args, console)
    if args.reference is not None:
        from policy_export.errors import InputError

        raise InputError(f"--reference checks a model file (MODEL.onnx) against a recording; {args.out} is an export "
                         "(its stored plan is replayed: verify OUT)")
    doc = read_manifest(Path(args.out))  # read once: verify takes it as read
    opts = verify_options(args, Tolerances.from_json(doc["tolerances"]))
    _check_report_paths(args, args.out)
    _observations_fit(opts.observations, doc)  # a file of another shape: refused before TensorFlow loads
    signature = _signature_request(args)
    candidates = opts.candidates
    from policy_export.exporter.parity.plan import golden_planned

    built = golden_planned(doc)  # else a policy exported elsewhere: its recording replayed, no TensorFlow
    if built:
        _heavy_imports(args)
        device = _device_plan(args)
    else:
        from policy_export.exporter.devices import plan_ort_devices

        device = plan_ort_devices(args.device, args.allow_tf32)

    from policy_export.exporter.options import replace
    from policy_export.exporter.verify import verify_export

    from policy_export.exporter.signing import inside_export

    inside = inside_export(args.out, signature["signature"]) if signature else None  # OUT/model.sig: not extra
    result = verify_export(args.out, replace(opts, device=device), manifest_doc=doc, signature_inside=inside)
    args.progress.close()
    signed = _check_signature(args, console, signature, result.file_problems)
    _emit_reports(args, result.parity, "verify", result.file_problems,
                  extra={"path": str(result.path), "plan": result.notes, **signed})
    return _verify_outcome(args, console, result, built, signed, candidates)


def _verify_outcome(args, console, result, built: bool, signed: dict, candidates) -> int:
    """What ``verify`` prints once it has run (the verdict, the plan, each problem, the last line
    saying what was checked) and its exit code."""
    from policy_export.exporter.reports import print_verdict

    devices = result.parity.devices
    ort = f"ONNX Runtime {', '.join(devices.get('onnxruntime_providers_used', []))}"
    what = (f"stored parity plan ({result.parity.samples} golden samples; TF {devices.get('tf_device')}, {ort})"
            if built else f"the stored recording ({result.parity.samples} rows; {ort})")
    print_verdict(console, result.parity, f"verify {args.out}: {what}", args.verbose)
    for note in result.notes:
        print_note(console, "plan", note)
    from policy_export.exporter.reports import record_problems

    for problem in (result.file_problems + [f"{k}: {v}" for k, v in result.parity.errors.items()]
                    + record_problems(result.parity)):
        console.print(f"[bold red]{escape(one_line(problem))}[/bold red]", soft_wrap=True, highlight=False)
    if not args.verbose:
        _full_table_hint(console, args.report_json)
    if not result.passed:
        failed = len(result.parity.failures()) + len(result.file_problems) + len(result.parity.errors)
        error_line(f"{PROG}: verify failed: {failed} problem(s)")
        return EXIT_CHECK_FAILED
    what = "every candidate matches its plan" if candidates else "every format matches"
    checked = "the signature matches, " if signed else ""  # verify --public-key: say it was checked
    console.print(f"verified [bold]{escape(args.out)}[/bold]: {checked}files match the manifest, {what}")
    return EXIT_OK


def _verify_model_file(args, console) -> int:
    """``verify MODEL.onnx --reference REF.npz``: a model exported elsewhere against its framework's recording."""
    from policy_export.exporter.foreign import check_reference_options, verify_reference
    from policy_export.exporter.reports import print_verdict, record_problems

    opts = verify_options(args)
    check_reference_options(args.out, opts)
    if _signature_request(args) is not None:
        from policy_export.errors import InputError

        raise InputError("--public-key checks an export's signature; a model file checked against --reference has none")
    _check_report_paths(args)
    from policy_export.exporter.options import replace

    from policy_export.exporter.devices import plan_ort_devices

    result = verify_reference(args.out, replace(opts, device=plan_ort_devices(args.device, args.allow_tf32)))
    args.progress.close()
    _emit_reports(args, result.parity, "verify", [], extra={"path": str(result.path), "plan": result.notes})
    print_verdict(console, result.parity, f"verify {args.out}: against {result.parity.reference} "
                  f"({result.parity.samples} rows; ONNX Runtime "
                  f"{', '.join(result.parity.devices.get('onnxruntime_providers_used', []))})", args.verbose)
    for note in result.notes:
        print_note(console, "plan", note)
    for problem in [f"{k}: {v}" for k, v in result.parity.errors.items()] + record_problems(result.parity):
        console.print(f"[bold red]{escape(one_line(problem))}[/bold red]", soft_wrap=True, highlight=False)
    if not args.verbose:
        _full_table_hint(console, args.report_json)
    if not result.passed:
        print(f"{PROG}: verify failed: {len(result.parity.failures()) + len(result.parity.errors)} problem(s)",
              file=sys.stderr)
        return EXIT_CHECK_FAILED
    console.print(f"verified [bold]{escape(args.out)}[/bold]: every recorded output matches")
    return EXIT_OK


def cmd_serve(args, console) -> int:
    from policy_export.exporter.compat import require
    from policy_export.exporter.options import check_model_name

    if args.model_name is not None:
        check_model_name(args.model_name)
    require(("pytriton", "tritonclient"), "serve", "serving with Triton")  # before TensorFlow loads
    _heavy_imports(args)
    from policy_export.exporter.serve.server import TritonServer, serve_forever

    server = TritonServer.start(args.out, http_port=args.port, grpc_port=args.grpc_port, host=args.host,
                                model_name=args.model_name)

    def ready() -> None:
        for line in server.describe():
            console.print(escape(line), soft_wrap=True, highlight=False)
        console.print(f"ready: serving {escape(args.out)}'s Triton repository (Ctrl-C to stop)", highlight=False)

    serve_forever(server, ready)
    console.print("stopped", highlight=False)
    return EXIT_OK


def _contract_imports(path: str, args=None) -> None:
    """TensorFlow imported (quietly) before reading ``path``'s contract, where its format needs it."""
    from policy_export.exporter.inspection import find_model

    hit = find_model(Path(path))
    if hit is not None and hit[0].inspect_needs_tensorflow:
        _heavy_imports(args)


def _contract(path: str, args=None):
    """Read a contract; TensorFlow is imported (quietly) only for the formats that need it."""
    from policy_export.exporter.inspection import contract_of

    _contract_imports(path, args)
    return contract_of(path, getattr(args, "signature", "serving_default"), getattr(args, "tag", "serve"))


def cmd_inspect(args, console) -> int:
    from policy_export.exporter.inspection import contract_json
    from policy_export.exporter.screen import Column, print_table

    shown = _inspect_source(args, console)
    if shown is not None:
        return shown
    kind, contract = _contract(args.path, args)
    if args.json:
        print(contract_json(kind, Path(args.path), contract))
        return EXIT_OK
    rows = []
    for side, specs in (("input", contract.inputs), ("output", contract.outputs)):
        for s in specs:
            need = "required" if s.required else f"default {s.default!r}"
            rows.append((side, s.key, s.dtype, s.shape_text(), need if side == "input" else ""))
    columns = [Column(""), Column("key"), Column("dtype", keep=1), Column("shape"), Column("required / default", keep=2)]
    print_table(console, f"{args.path} ({kind}, signature {contract.signature_key})", columns, rows, more="--json")
    return EXIT_OK


def _inspect_source(args, console) -> int | None:
    """``inspect`` of a source that shows itself (an RLlib checkpoint: its policies, spaces, filter and
    network), read before TensorFlow loads; ``None`` when ``args.path`` is no such source."""
    import json

    from policy_export.exporter import sources
    from policy_export.exporter.inspection import brief_spaces
    from policy_export.exporter.screen import Column, print_table

    source = next((s for s in sources.all_sources() if s.shows_itself and s.detect(Path(args.path))), None)
    if source is None:
        return None
    opened = source.open(Path(args.path), {})
    if not source.light_inspect:
        _heavy_imports(args)
    shown = source.inspect(opened)
    if args.json:
        print(json.dumps(shown.json, indent=2))
        return EXIT_OK
    # the first two columns name what a row is; the others may be left out at a narrow width, the last first
    columns = [Column(c, keep=None if i < 2 else len(shown.columns) - i) for i, c in enumerate(shown.columns)]
    print_table(console, shown.title, columns, [tuple(brief_spaces(one_line(str(v))) for v in row) for row in shown.rows],
                more="--json")
    return EXIT_OK


def cmd_diff(args, console) -> int:
    import json

    from policy_export.exporter.inspection import diff_exports, weights_line

    for path in (args.old, args.new):
        _contract_imports(path, args)
    result = diff_exports(args.old, args.new)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        console.print(f"[bold]{'compatible' if result['compatible'] else 'BREAKING'}[/bold]: "
                      f"{escape(one_line(f'{args.old} -> {args.new}'))}")
        for change in result["changes"]:
            style = "red" if change["kind"] == "breaking" else "green"
            what = f"{change['side']} {change['key']}: {change['what']}"
            console.print(f"  [{style}]{change['kind']}[/{style}] {escape(one_line(what))}")
        if not result["changes"]:
            console.print("  no change to any input or output")
        console.print(f"  {escape(weights_line(result['weights']))}")
    return EXIT_OK if result["compatible"] else EXIT_CHECK_FAILED


@contextlib.contextmanager
def _reports_on_failure(args):
    """A failed parity check still writes ``--report-json``/``--junit`` (and the step summary), then
    goes on up as the failure it is."""
    from policy_export.errors import ParityFailedError

    try:
        yield
    except ParityFailedError as e:
        args.progress.close(failed=True)
        if e.report is not None:
            _emit_reports(args, e.report, "convert")
        raise


def _emit_policy_reports(args, reports_by_policy: dict, paths: dict, signatures: dict | None = None) -> None:
    """The reports of ``convert`` over one policy (as ``export`` writes them) or several
    (``--all-policies``: the JSON keyed by policy id, a JUnit test suite per policy); with
    ``signatures`` (policy id -> the ``signature`` entry of an export signed) each names its signer."""
    signatures = signatures or {}
    if len(reports_by_policy) == 1:
        (pid, report), = reports_by_policy.items()
        signed = {"signature": signatures[pid]} if pid in signatures else {}
        _emit_reports(args, report, "convert", extra={"path": paths[pid], "policy_id": pid, **signed})
        return
    from policy_export.exporter import reports

    try:
        if args.report_json:
            reports.write_json(args.report_json, {
                "passed": all(r.passed for r in reports_by_policy.values()),
                "policies": {pid: {"path": paths[pid], "passed": r.passed, **r.to_json(),
                                   **({"signature": signatures[pid]} if pid in signatures else {})}
                             for pid, r in reports_by_policy.items()}})
        if args.junit:
            Path(args.junit).write_text(reports.junit_many({f"convert.{pid}": r for pid, r in reports_by_policy.items()},
                                                           {f"convert.{pid}": e for pid, e in signatures.items()}),
                                        encoding="utf-8")
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            with open(summary, "a", encoding="utf-8") as f:
                f.writelines(reports.markdown_summary(r, f"{_summary_title(args, 'convert', paths[pid])} "
                                                         f"(policy {pid})", (), signatures.get(pid))
                             for pid, r in reports_by_policy.items())
    except OSError as e:
        from policy_export.errors import ExportError

        raise ExportError(f"cannot write a report: {e}") from e


def cmd_rollout(args, console) -> int:
    from policy_export.exporter.manifest import read_manifest

    from policy_export.exporter.options import replace

    from policy_export.exporter.core_options import ROLLOUT_ENV
    from policy_export.exporter.rollout import check_environment

    doc = read_manifest(Path(args.out))  # read once: the rollout takes it as read
    opts = rollout_options(args)
    _check_report_paths(args, args.out)
    check_environment(doc, ROLLOUT_ENV.check(args.env), args.out)  # before TensorFlow loads
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
        error_line(f"{PROG}: rollout failed: {'; '.join(parts)}")
        return EXIT_CHECK_FAILED
    return EXIT_OK

def _print_rollout(console, report, args) -> None:
    """The rollout's table of episodes (fitted to the width: the first-divergence columns are left
    out before the returns) and its summary lines."""
    from rich.text import Text

    from policy_export.exporter.screen import Column, print_table

    ref, others = report.reference, report.formats[1:]
    columns = [Column("episode seed", justify="right", wraps=True)]
    columns += [Column(f"return {f}", keep=10 + i, justify="right") for i, f in enumerate(report.formats)]
    columns.append(Column("steps", keep=5, justify="right", wraps=False))
    columns += [Column(f"{f}: first divergence", keep=8 - i, justify="right") for i, f in enumerate(others)]
    rows = []
    for e in report.episodes:
        steps = "/".join(str(e.steps[f]) for f in report.formats)
        cells = [Text("none") if e.first_divergence[f] is None
                 else Text(f"step {e.first_divergence[f]} (lossy)") if f in report.lossy
                 else Text(f"step {e.first_divergence[f]}", style="bold red") for f in others]
        rows.append((str(e.seed), *(f"{e.returns[f]:.1f}" for f in report.formats), steps, *cells))
    print_table(console, f"rollout {args.out} in {args.env} (deterministic actions; reference {ref})", columns, rows,
                more="--report-json")
    console.print(escape("mean return: " + ", ".join(f"{f} {report.mean_return(f):.1f}" for f in report.formats)))
    console.print(escape("largest action deviation from the reference: "
                         + ", ".join(f"{f} {report.max_deviation(f):.3g}" for f in others)))
    console.print(escape("mean return difference from the reference: "
                  + ", ".join(f"{f} {report.return_difference(f):+.1f} ({report.relative_return_difference(f):+.2%}"
                              + (f", lossy: at most {report.return_tolerance:.0%}" if f in report.lossy else "") + ")"
                              for f in others)))


def _many_options(args) -> dict:
    keys = {"samples": args.samples, "seed": args.seed}
    if getattr(args, "explore_samples", None) is not None:
        keys["explore_samples"] = args.explore_samples
    formats = _formats_option(getattr(args, "formats", None))
    if formats is not None:
        keys["formats"] = formats
    return {k: v for k, v in keys.items() if v is not None}


def _many_run_options(args) -> dict:
    return dict(jobs=args.jobs, ray=args.ray, memory_mb=args.memory_mb, preload=args.preload,
                policy_timeout=args.policy_timeout)


@contextlib.contextmanager
def _many_progress(args):
    """Progress of export-many/verify-many: none with ``-q``; on a terminal the event lines with a
    live status line under them (done, running, failed, ETA); plain lines on stderr otherwise."""
    from policy_export.exporter.progress import live_terminal

    if args.quiet:
        yield {"progress": lambda line: None}
        return
    if not live_terminal():
        yield {"progress": error_line}  # one line per event on stderr, wrapped at its width
        return
    from policy_export.exporter.progress import terminal_console
    from policy_export.exporter.screen import say

    err = terminal_console()
    try:
        with err.status("starting") as status:
            yield {"progress": lambda line: say(err, line), "status": lambda counts: status.update(escape(counts))}
    finally:
        close = getattr(err.file, "close_with_display", None)
        if close is not None:
            close()


def cmd_export_many(args, console) -> int:
    from policy_export.exporter.many import export_many

    _check_report_paths(args, args.out)
    run = _many_run_options(args)
    sign = _many_sign_request(args)
    with _many_progress(args) as shown:
        result = export_many(args.sources, args.out, force=args.force, sign=sign, **run, **shown,
                             **_many_options(args))
    return _many_report(args, console, result, f"export-many {args.out}")


def cmd_verify_many(args, console) -> int:
    from policy_export.exporter.many import verify_many

    _check_report_paths(args, args.root)
    run = _many_run_options(args)
    with _many_progress(args) as shown:
        result = verify_many(args.root, signature=_many_signature_request(args), **run, **shown,
                             **_many_options(args))
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
    report.print_report(console, result.results, title)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(report.summary(result.results, result.seconds)["counts"].items()))
    if not result.passed:
        console.print(f"{len(result.failed)} of {len(result.results)} policies failed: "
                      f"{escape(', '.join(result.failed))} ({counts}; {result.seconds:.1f} s)", soft_wrap=True)
        return EXIT_CHECK_FAILED
    console.print(f"{len(result.results)} policies: {counts} in {result.seconds:.1f} s")
    return EXIT_OK


def cmd_example(args, console) -> int:
    """``example DIR``: the bundled CartPole spec written to DIR, and the command that exports it."""
    import shlex

    from policy_export.exporter.example import write_example

    target = write_example(args.dir)
    console.print(f"wrote the CartPole spec to {escape(str(target))}; export it with:", soft_wrap=True, highlight=False)
    console.print(escape(f"{PROG} export {shlex.quote(str(target))} --out OUT"), soft_wrap=True, highlight=False)
    return EXIT_OK


def _sign_request(args):
    """``export --sign-key``: the signing request checked before any work (the extra, the key, a
    signature path beside the export or at its top); ``None`` when no signing was asked for."""
    if not (getattr(args, "sign_key", None) or getattr(args, "sign_keyless", False)):
        for flag in ("signing_certificate", "certificate_chain", "signature_file", "sign_key_password_env"):
            if getattr(args, flag, None):
                from policy_export.errors import InputError

                raise InputError(f"--{flag.replace('_', '-')} signs the export: give --sign-key KEY (or --sign-keyless)")
        return None
    from policy_export.exporter.signing import check_sign_inputs

    path = check_sign_inputs(args.out, args.sign_key, getattr(args, "signature_file", None),
                             signing_certificate=args.signing_certificate,
                             certificate_chain=args.certificate_chain, keyless=args.sign_keyless)
    args.sign_password = _sign_password(args)
    return path


def _sign_password(args) -> bytes | None:
    """The password of an encrypted ``--sign-key``: from ``--sign-key-password-env VAR``, else
    asked (no echo) where stdin is a terminal; checked against the key now, before any work."""
    import getpass

    from policy_export.exporter.signing import key_password

    try:
        interactive = sys.stdin is not None and sys.stdin.isatty()
    except (OSError, ValueError):  # a closed or replaced stdin: not a terminal
        interactive = False
    return key_password(args.sign_key, args.sign_key_password_env, signing_certificate=args.signing_certificate,
                        ask=getpass.getpass if interactive else None)


def _many_sign_request(args):
    """``export-many --sign-key``: the signing request, checked (and the key's password read) before
    anything runs; ``None`` when no signing was asked for."""
    if _sign_request(args) is None:
        return None
    from policy_export.exporter.signing import SignRequest

    return SignRequest(args.sign_key, args.signing_certificate, tuple(args.certificate_chain), args.sign_keyless,
                       args.sign_password)


def _many_signature_request(args) -> dict | None:
    """``verify-many --public-key`` (or a certificate chain, or an identity): how each export's
    signature is checked; ``None`` when none is to be."""
    request = dict(public_key=args.public_key, certificate_chain=args.certificate_chain, identity=args.identity,
                   issuer=args.identity_issuer)
    return request if any(request.values()) else None


def _sign_exports(args, paths: dict, sign_to) -> dict:
    """Sign each export just written (``paths``: policy id -> export; ``sign_to``: the signature
    path of a single one): policy id -> (what was signed, the reports' ``signature`` entry)."""
    if sign_to is None:
        return {}
    from policy_export.errors import InputError
    from policy_export.exporter.signing import sign_export

    if len(paths) > 1 and args.signature_file:
        raise InputError(f"--signature-file names one file and {len(paths)} exports were written (unsigned); sign each "
                         f"with `{PROG} sign OUT --sign-key KEY` (each signature then goes beside its export)")
    out = {}
    for pid, path in paths.items():
        start = time.perf_counter()
        signed = sign_export(path, args.sign_key, args.signature_file if len(paths) == 1 else None,
                             signing_certificate=args.signing_certificate, certificate_chain=args.certificate_chain,
                             keyless=args.sign_keyless, password=getattr(args, "sign_password", None))
        out[pid] = signed, {"path": str(signed.signature), "passed": True, "signer": signed.signer, **signed.info,
                            "files": signed.files, "problems": [], "seconds": round(time.perf_counter() - start, 3)}
    return out


_SIGNATURE_FLAGS = ("signature_file", "public_key", "certificate_chain", "identity", "identity_issuer")


def _signature_request(args):
    """``verify --public-key`` (and the other signature flags): the check's inputs, checked before
    any work; ``None`` when no signature is to be checked."""
    if not any(getattr(args, flag, None) for flag in _SIGNATURE_FLAGS):
        return None
    from policy_export.exporter.signing import check_verify_inputs

    request = dict(signature=args.signature_file, public_key=args.public_key, certificate_chain=args.certificate_chain,
                   identity=args.identity, issuer=args.identity_issuer)
    request["signature"] = check_verify_inputs(args.out, **request)
    return request


def _check_signature(args, console, request, problems: list) -> dict:
    """Check the export's signature (when asked): its problems join the file problems; returns the
    ``signature`` entry of ``--report-json`` (empty when no signature was checked)."""
    if request is None:
        return {}
    from policy_export.exporter.signing import verify_signature

    start = time.perf_counter()
    check = verify_signature(args.out, **request)
    problems.extend(check.problems)
    if check.passed:
        print_note(console, "signature", f"{check.signature} signed by {check.signer}; covers {len(check.files)} "
                   "files, the export as its manifest lists it")
    return {"signature": {**check.to_json(), "seconds": round(time.perf_counter() - start, 3)}}


def cmd_sign(args, console) -> int:
    """``sign OUT --sign-key KEY``: verify the export (files and parity plan), then sign it."""
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.pipeline import sign_verified
    from policy_export.exporter.signing import check_sign_inputs

    check_sign_inputs(args.out, args.sign_key, args.signature_file, signing_certificate=args.signing_certificate,
                      certificate_chain=args.certificate_chain, keyless=args.sign_keyless)
    password = _sign_password(args)
    read_manifest(Path(args.out))  # not an export: refused before TensorFlow loads
    _heavy_imports(args)
    result, signed = sign_verified(args.out, args.sign_key, args.signature_file,
                                   signing_certificate=args.signing_certificate,
                                   certificate_chain=tuple(args.certificate_chain), keyless=args.sign_keyless,
                                   password=password)
    if signed is None:
        for problem in (result.file_problems + [f"{k}: {v}" for k, v in result.parity.errors.items()]
                        + [r.describe() for r in result.parity.failures()]):
            console.print(f"[bold red]{escape(one_line(problem))}[/bold red]", soft_wrap=True, highlight=False)
        error_line(f"{PROG}: sign refused: {args.out} fails verify; nothing was signed")
        return EXIT_CHECK_FAILED
    print_note(console, "verified and signed", f"{args.out} ({signed.files} files) with {signed.signer}: "
               f"{signed.signature}")
    return EXIT_OK


def cmd_docs(args, console) -> int:
    """``docs [TOPIC]``: a page or an example printed as it is (Markdown, a script); without
    TOPIC the list of them; ``--write DIR``: all of them written out (:mod:`exporter.docs`)."""
    from policy_export.exporter import docs
    from policy_export.exporter.screen import Column, print_table, say

    if args.write is not None:
        if args.topic is not None:
            from policy_export.errors import InputError

            raise InputError("docs --write DIR writes every topic; give no TOPIC with it")
        target, count = docs.write_tree(args.write)
        say(console, f"wrote {count} files to {target}: README.md, docs/, examples/ and the fixtures the examples "
                     f"use; e.g. bash {target}/examples/ci_gate.sh")
        return EXIT_OK
    if args.topic is None:
        print_table(console, f"{PROG} docs TOPIC prints one of these ({PROG} docs --write DIR writes them all):",
                    [Column("topic"), Column("what it is", keep=1)], docs.topics())
        return EXIT_OK
    sys.stdout.write(docs.text(args.topic))  # the page as it is, as --json prints data
    return EXIT_OK
