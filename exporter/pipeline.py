"""The one pipeline from any source to its exports: ``export SOURCE --out OUT`` (and its alias
``convert``), ``export-many``'s jobs and the Python API all run it.

A source is found by the registry (:func:`exporter.sources.detect`), opened (read and checked
before TensorFlow loads), its policies chosen, every target checked, then each policy is loaded
by its source (:class:`~exporter.sources.base.Loaded`: the policy, its record, what it adds to
the contract, a tolerance hint) and exported like any other (:func:`exporter.export.run_export`).

    opened = open_source("checkpoints/ppo", {"policy_id": "default_policy"})
    plan = plan_source(opened, "out/ppo", ExportOptions(samples=500))
    results = run_source(opened, plan, ExportOptions(samples=500))   # policy id -> ExportResult
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy_export.errors import ExportError, InputError
from policy_export.exporter import sources
from policy_export.exporter.devices import plan_devices
from policy_export.exporter.options import ExportOptions, replace
from policy_export.exporter.progress import SILENT, peak_rss_mb
from policy_export.exporter.watchdog import run_limit

if TYPE_CHECKING:  # the export pipeline imports TensorFlow: only once a policy is loaded
    from policy_export.exporter.export import ExportResult


def open_source(path: str | Path, values: Mapping[str, Any] | None = None, *, allowed: tuple[str, ...] | None = None,
                what: str = "source") -> sources.Opened:
    """The source ``path`` is, read and checked with its own option ``values`` (no TensorFlow).

    Raises:
        InputError: not a source (of ``allowed``), or an option another source owns, naming it; the
            source's own errors for what it refuses.
    """
    if Path(path).suffix.lower() == ".onnx":
        raise InputError(f"{what} {path} is a model file exported elsewhere: it is exported with the recording of "
                         "what its framework computed (export MODEL.onnx --reference REF.npz; in Python "
                         "policy_export.export_model)")
    source = sources.detect(path, allowed, what)
    values = dict(values or {})
    refuse_foreign(values, source)
    return source.open(Path(path), values)


def refuse_foreign(values: Mapping[str, Any], source: sources.Source) -> None:
    """The one rule for options: an option of another source than ``source`` is refused, naming its owner.

    Raises:
        InputError: ``values`` names options ``source`` does not own (their flags and owners named).
    """
    own = {o.name for o in source.options}
    foreign = [(o, s) for s in sources.all_sources() if s is not source for o in s.options
               if o.name in values and o.name not in own]
    if foreign:
        flags = list(dict.fromkeys(o.flag for o, _ in foreign))
        owners = " and ".join(dict.fromkeys(s.description for _, s in foreign))
        raise InputError(f"{', '.join(flags)} appl{'ies' if len(flags) == 1 else 'y'} to {owners} only; this source "
                         f"is {source.description}")
    unknown = sorted(set(values) - own - {o.name for s in sources.all_sources() for o in s.options})
    if unknown:
        raise InputError(f"{', '.join(unknown)}: not an option of any source")


def refuse_unchosen_format_options(opts: ExportOptions) -> None:
    """The one rule for options, for the formats' own: one given (not its default) while none of
    the formats that own it is chosen is refused, naming them.

    Raises:
        InputError: such an option, its flag and owners named.
    """
    from policy_export.exporter import formats

    owners: dict[str, tuple[Any, list[str]]] = {}
    for fmt in formats.all_formats():
        for option in fmt.options:
            owners.setdefault(option.name, (option, []))[1].append(fmt.name)
    for name, (option, names) in owners.items():
        if getattr(opts, name) != option.default and not set(names) & set(opts.formats):
            raise InputError(f"{option.flag} applies to the formats {', '.join(names)} only; none of them is "
                             f"chosen (--formats {','.join(opts.formats)})")


# the options of a model file exported elsewhere (exporter.foreign.export), which no source takes
MODEL_FILE_OPTIONS = {"reference": "--reference", "reference_names": "--reference-name",
                      "reference_state_pairs": "--state-pair", "contract_file": "--contract"}


def refuse_model_file_options(opts: ExportOptions, path: Path) -> None:
    """Raises InputError when an option of a model file exported elsewhere is given for a source."""
    given = [flag for name, flag in MODEL_FILE_OPTIONS.items() if getattr(opts, name)]
    if given:
        raise InputError(f"{given[0]} applies to a model file exported elsewhere (MODEL.onnx); {path} is a source "
                         "this package exports from its TF graph, proven against it")


@dataclass(frozen=True)
class SourcePlan:
    """Which policies of an opened source one run exports, and where: ``targets`` maps each policy
    id (``None``: the source's one policy) to its export directory."""

    targets: dict[str | None, Path]
    each: bool
    root: Path


def plan_source(opened: sources.Opened, out: str | Path, opts: ExportOptions) -> SourcePlan:
    """Choose the policies of ``opened`` and check every target and sample budget before any work.

    Raises:
        ExportError: ``out`` cannot hold one export per policy; the target and budget errors of
            :meth:`ExportOptions.check_export`.
    """
    refuse_unchosen_format_options(opts)
    refuse_model_file_options(opts, opened.path)
    ids, each = opened.source.choose(opened)
    root = Path(out).absolute()
    if each and (root.is_symlink() or (root.exists() and not root.is_dir())):
        raise ExportError(f"output path {root} is a symbolic link or a file; the exports go into a directory")
    targets = {pid: (root / pid if each else root) for pid in ids}
    for pid, target in targets.items():
        opts.check_export(opened.policies[pid], target)
    return SourcePlan(targets, each, root)


def run_source(opened: sources.Opened, plan: SourcePlan, opts: ExportOptions) -> dict[str | None, ExportResult]:
    """Export each policy of ``plan`` (checked by :func:`plan_source`); when one fails, the exports
    this call wrote are removed again (and the root when it made it for them) and the error is raised.

    Returns:
        policy id -> :class:`exporter.ExportResult`, in the plan's order.
    """
    import shutil

    created = plan.each and not plan.root.exists()
    done: dict[str | None, ExportResult] = {}
    try:
        with run_limit(opts.run_timeout):
            for pid, target in plan.targets.items():
                done[pid] = _export_one(opened, pid, target, opts)
    except BaseException:
        for pid in done:
            shutil.rmtree(plan.targets[pid], ignore_errors=True)
        if created and plan.root.is_dir() and not any(plan.root.iterdir()):
            plan.root.rmdir()
        raise
    return done


def _export_one(opened: sources.Opened, pid: str | None, out: Path, opts: ExportOptions) -> ExportResult:
    from policy_export.exporter.export import run_export

    device = plan_devices(opts.device)
    stage = opened.source.stage_name(pid)
    start = time.perf_counter()
    with (opts.progress or SILENT).stage(stage):
        loaded = opened.source.load(opened, pid, device)
    took, peak = time.perf_counter() - start, peak_rss_mb()
    try:
        if opened.policies[pid] is None:  # the space is known only now: its sample budgets
            opts.check_policy(loaded.policy.observation_space)
        result = run_export(loaded.policy, out, replace(_with_source(opts, loaded), device=device))
    finally:
        loaded.policy.close()
    result.timings[stage] = took
    result.peak_rss_mb[stage] = peak
    return result


def _with_source(opts: ExportOptions, loaded: sources.Loaded) -> ExportOptions:
    """``opts`` with what the source adds: its record and contract, and its tolerance hint where the
    user gave no tolerance."""
    changes: dict[str, Any] = {}
    if loaded.tolerance is not None and opts.tolerances is None:
        from policy_export.exporter.parity.compare import Tolerance, Tolerances

        changes["tolerances"] = Tolerances(Tolerance(*loaded.tolerance))
    if loaded.record is not None:
        changes["source"] = {**loaded.record, "contract": dict(loaded.contract)}
    return replace(opts, **changes) if changes else opts


# ----------------------------------------------------------------------------- the Python API

EXPORT_FIELDS = frozenset(f.name for f in fields(ExportOptions))


def split_options(keywords: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments split into the sources' options and the export's (:class:`ExportOptions`
    fields, or ``options=`` itself); a keyword neither owns is refused.

    Raises:
        InputError: a keyword no source and no export option owns.
    """
    own = {o.name for s in sources.all_sources() for o in s.options}
    source = {k: v for k, v in keywords.items() if k in own}
    export = {k: v for k, v in keywords.items() if k not in own}
    unknown = sorted(set(export) - EXPORT_FIELDS - {"options"})
    if unknown:
        raise InputError(f"{', '.join(unknown)}: not an option of any source nor of the export")
    return source, export


def export_options(keywords: dict[str, Any], device: Any) -> ExportOptions:
    """The export options: ``options=`` (an :class:`ExportOptions`) or made from ``keywords``, with ``device``."""
    return replace(ExportOptions.make(keywords.pop("options", None), keywords), device=device)


def export_source(source: Any, out: str | Path, *, device: Any = "auto", **keywords: Any) -> dict[str | None, ExportResult]:
    """Export ``source`` (a path the registry recognises: a spec directory, an RLlib checkpoint, a
    SavedModel; see :mod:`exporter.sources`) to ``out``: one export, or one per policy at
    ``out/<policy id>`` with ``all_policies=True``.

    ``keywords`` are the source's own options (``policy_id``, ``signature_key``, ...: each source
    declares them) and :func:`exporter.export_policy`'s (``samples``, ``formats``, ..., or
    ``options=``). An option of another source than the one ``source`` is, is refused.

    Example::

        export_source("checkpoints/ppo", "out/ppo", policy_id="default_policy", samples=500)

    Returns:
        policy id (``None`` for a source of one unnamed policy) -> :class:`exporter.ExportResult`.
    Raises:
        InputError: not a source, or an option it does not take; the source's and the export's errors.
    """
    own, rest = split_options(keywords)
    opts = export_options(rest, device)
    opened = source if isinstance(source, sources.Opened) else open_source(source, own)
    return run_source(opened, plan_source(opened, out, opts), opts)


def sign_verified(out: str | Path, private_key: str | Path | None = None, signature: str | Path | None = None, *,
                  signing_certificate: str | Path | None = None, certificate_chain: tuple = (),
                  keyless: bool = False, password: str | bytes | None = None, **verify_keywords: Any):
    """What ``policy-export sign OUT`` does: verify the export at ``out`` (its files against the
    manifest, then its stored parity plan on every format), and sign it only if that passed.
    Returns ``(VerifyResult, Signed | None)``: ``None`` when verify failed and nothing was signed.
    ``verify_keywords`` go to :func:`exporter.verify.verify_export` (``device``, ``run_timeout``).

    The signing inputs (the extra, the key, its password, the certificates, the signature path)
    are checked first, before TensorFlow loads; the key is read once.

    Raises:
        InputError: as :func:`exporter.signing.sign_export`; ``out`` is not an export.
    """
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.signing import check_sign_inputs, inside_export, sign_export
    from policy_export.exporter.verify import verify_export

    path = check_sign_inputs(out, private_key, signature, signing_certificate=signing_certificate,
                             certificate_chain=certificate_chain, keyless=keyless)
    read_manifest(Path(out))  # not an export: refused before TensorFlow loads
    result = verify_export(out, signature_inside=inside_export(out, path), **verify_keywords)  # re-signed in place
    if not result.passed:
        return result, None
    return result, sign_export(out, private_key, signature, signing_certificate=signing_certificate,
                               certificate_chain=certificate_chain, keyless=keyless, password=password)
