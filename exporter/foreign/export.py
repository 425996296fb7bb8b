"""``export MODEL.onnx --reference REF.npz --out OUT``: a policy exported elsewhere made an export
like any other, without TensorFlow.

Before anything is written the model passes the ONNX door and its contract is read from the graph
(names, dtypes, dynamic dims; :func:`~exporter.foreign.model_contract`), the recording is fitted
to it (:class:`~exporter.parity.groups.reference.ReferenceGroup`), the contract file (optional:
spaces and which outputs are actions; :mod:`.contract_file`) is checked against it, and every
format chosen must be one written from an ONNX model alone (capability ``from_onnx``: ``onnx``,
the compressed ONNX models, OpenVINO's IRs, the Triton repository); the others need the TF graph
and are refused by name.

Then, as for every export: each format is written into a staging directory (``model.onnx`` is the
model itself, its weights inline or in ``model.onnx.data``), the recording is replayed on each
one fresh from disk (lossy formats judged by their behavioural thresholds on the actions), and
the recording is stored as the export's parity plan (``parity/reference.npz``) with the manifest
(sha256 of every file, the versions, the contract, where the model and the recording came from),
so that ``verify OUT`` replays it, and ``sign``, ``diff`` and ``verify-many`` take it. The export
is renamed into place only if every format passed.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.errors import ConversionError, ExportError, InputError, ParityFailedError
from policy_export.exporter import formats as registry
from policy_export.exporter import manifest
from policy_export.exporter.devices import plan_ort_devices
from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.options import ExportOptions, check_tolerance_keys, serving_name
from policy_export.exporter.parity import behaviour as behaviour_thresholds
from policy_export.exporter.parity import replay
from policy_export.exporter.parity.compare import ParityReport, Tolerances
from policy_export.exporter.parity.groups.reference import ReferenceGroup, judged_outputs
from policy_export.exporter.parity.plan import ParityPlan, write_plan
from policy_export.exporter.parity.plan import manifest_record as parity_manifest_record
from policy_export.exporter.progress import SILENT, MemoryTrace
from policy_export.exporter.results import PARITY_DIR, ExportResult, disk_errors, remove_written, timed_stage
from policy_export.exporter.staging import staged_directory
from policy_export.exporter.watchdog import run_limit

log = logging.getLogger(__name__)

DEFAULT_FORMATS = ("onnx",)
# the options of an export this package builds from a TF graph, which a model exported elsewhere has no use for
BUILT_ONLY = {"samples": "--samples", "explore_samples": "--explore-samples", "stepped_steps": "stepped_steps",
              "observations": "--observations", "inputs_as_nchw": "--inputs-as-nchw", "opset": "--opset",
              "seed": "--seed", "source": "source"}


class ModelFileSource:
    """What the command line prints of an export's source, for a model exported elsewhere."""

    name = "onnx_model"
    description = "an ONNX model exported elsewhere"
    counted = "recorded rows"

    def __init__(self, recording: str):
        self.reference = f"the recording {recording}"

    def summary(self, record) -> list[str]:
        if not record:
            return []
        return [f"model: {record.get('file')} (sha256 {str(record.get('sha256'))[:12]}...), exported by "
                f"{record.get('producer')}"]


def from_onnx_names() -> list[str]:
    """The formats written from an ONNX model alone."""
    return [f.name for f in registry.with_capability("from_onnx")]


def check_model_options(opts: ExportOptions) -> None:
    """Refuse the options that apply to an export built from a TF graph, and a missing recording.

    Raises:
        InputError: naming the option.
    """
    if opts.reference is None:
        raise InputError("a model file exported elsewhere is exported with the recording of what its framework "
                         "computed: --reference REF.npz (policy_export.recording writes one)")
    defaults = ExportOptions()
    given = [flag for name, flag in BUILT_ONLY.items() if getattr(opts, name) != getattr(defaults, name)]
    if given:
        raise InputError(f"{given[0]} applies to a policy exported from its TF graph; a model file exported elsewhere "
                         "is checked on every row of its --reference recording")


@dataclass
class ModelExport:
    """One ``export MODEL.onnx``, planned: everything read and checked, nothing written yet."""

    model: Path
    out: Path
    opts: ExportOptions
    contract: Any
    contract_doc: dict[str, Any]
    group: ReferenceGroup
    recording: Any
    chosen: list
    tolerances: Tolerances
    thresholds: dict

    def run(self) -> ExportResult:
        """Write, prove and rename into place (see the module's description)."""
        progress = MemoryTrace(self.opts.progress or SILENT)
        timings: dict[str, float] = {}
        missing: dict[str, str] = {}
        device = self.opts.device if not isinstance(self.opts.device, str) else plan_ort_devices(self.opts.device)
        from policy_export.exporter.formats.onnx.model import model_opset, producer
        from policy_export.exporter.formats.onnx.trust import read_model

        head = read_model(self.model)  # without its weights: the opset and producer
        opset, made_by = model_opset(head) or 0, producer(head)
        del head
        ctx = ExportContext(policy=None, signature=None, device=device, opset=opset,
                            external_data_threshold=self.opts.external_data_threshold,
                            model_name=self.opts.model_name or serving_name(self.model.stem),
                            model_version=self.opts.model_version, model_file=self.model, own_contract=self.contract,
                            state_pairs=tuple(self.group.state_pairs))
        with disk_errors(self.out), staged_directory(self.out, self.opts.overwrite, checked=True) as stage:
            records: dict[str, FormatRecord] = {}
            for fmt in self.chosen:
                with timed_stage(timings, f"write {fmt.name}", progress):
                    try:
                        records[fmt.name] = fmt.write(ctx, stage / fmt.path)
                    except ConversionError as e:
                        log.warning("%s: not written: %s", fmt.name, e)
                        missing[fmt.name] = str(e)
                        remove_written(stage / fmt.path)
            ctx.release()
            if not records:
                raise ExportError("no format could be written: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
            start = time.perf_counter()
            plan = ParityPlan()
            plan.add(self.group)
            report = ParityReport(f"the recording {self.recording.path.name}", self.recording.rows, 0, device.to_json())
            info = {k: r.details for k, r in records.items()}
            contract_json = {**self.contract.to_json(), **self.contract_doc}
            checks = replay.Replay(plan, self.contract, self.tolerances, self.opts.batch_size, info, progress,
                                   behaviour=self.thresholds)
            view = {"tensor_names": _tensor_names(self.contract), "contract": contract_json, "formats": info}
            replay.check_formats(stage, [f.name for f in self.chosen if f.name in records], view, device, checks,
                                 report)
            timings["parity"] = time.perf_counter() - start
            with timed_stage(timings, "write manifest", progress):
                doc = self._manifest(stage, records, plan, report, contract_json, opset, made_by, missing)
            if not report.passed:
                raise ParityFailedError("parity failed, nothing was written: "
                                        + "; ".join(r.describe() for r in report.failures())
                                        + "".join(f"; {k}: {v}" for k, v in report.errors.items()), report)
        return ExportResult(self.out, records, doc["files"], report, doc, timings, progress.peaks, missing)

    def _manifest(self, stage: Path, records, plan: ParityPlan, report: ParityReport, contract_json: dict,
                  opset: int, made_by: str, missing: dict[str, str]) -> dict[str, Any]:
        (stage / PARITY_DIR).mkdir()
        write_plan(stage, plan)
        (stage / PARITY_DIR / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n",
                                                       encoding="utf-8")
        doc: dict[str, Any] = {
            "manifest_version": manifest.MANIFEST_VERSION,
            "name": self.model.stem,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": manifest.versions(),
            "opset": opset,
            "contract": contract_json,
            "tensor_names": _tensor_names(self.contract),
            "formats": {name: {"files": list(r.files), **r.details} for name, r in records.items()},
            "tolerances": self.tolerances.to_json(),
            "parity": {"passed": report.passed, "reference": report.reference, "samples": report.samples,
                       "seed": report.seed, "devices": report.devices,
                       "max_abs_err": {f"{r.format}/{r.key}": r.max_abs_err for r in report.records},
                       "plan": parity_manifest_record(plan)},
            "source": {"kind": ModelFileSource.name, "file": self.model.name, "sha256": manifest.sha256(self.model),
                       "producer": made_by, "reference": self.recording.record},
            "files": [],
        }
        if self.thresholds:
            doc["behaviour"] = behaviour_thresholds.to_json(self.thresholds)
            doc["parity"]["behaviour"] = behaviour_thresholds.summarize(report.behaviour)
        if missing:
            doc["missing"] = dict(missing)
        doc["files"] = manifest.file_records(stage)
        manifest.write_manifest(stage, doc)
        return doc


def _tensor_names(contract) -> dict[str, dict[str, str]]:
    """The graph's own names: an ONNX model's inputs and outputs are its contract's keys."""
    return {"inputs": {k: k for k in contract.input_keys}, "outputs": {k: k for k in contract.output_keys}}


def plan_model_export(model: str | Path, out: str | Path, opts: ExportOptions) -> ModelExport:
    """Read and check everything an export of ``model`` needs, before anything is written (no TensorFlow).

    Raises:
        InputError: a bad option, a format that needs the TF graph, a recording or contract file
            that does not fit the graph. ExportError: the model is refused by the ONNX door, or
            the target cannot be written.
    """
    from policy_export.exporter.foreign import model_contract, ports
    from policy_export.exporter.foreign.contract_file import read_contract_file
    from policy_export.exporter.pipeline import refuse_unchosen_format_options
    from policy_export.exporter.recorded.reference import read_reference

    model = Path(model)
    check_model_options(opts)
    names = list(opts.formats) if opts.explicit_formats else list(DEFAULT_FORMATS)
    written = from_onnx_names()
    refused = [n for n in names if n not in written]
    if refused:
        raise InputError(f"format {refused[0]!r} is made from the TensorFlow graph, which a model exported elsewhere "
                         f"does not have; the formats written from an ONNX model: {', '.join(written)}")
    chosen = [registry.get(n) for n in names]
    for fmt in chosen:
        fmt.check_installed()
    refuse_unchosen_format_options(replace_formats(opts, names))
    if not model.is_file() and not model.is_symlink():
        raise InputError(f"{model}: no such model file")
    contract = model_contract(model)  # the model through the ONNX door first
    graph_in, graph_out, optional = ports(model, contract)
    recording = read_reference(opts.reference)
    group = ReferenceGroup.make(recording.arrays, graph_in, graph_out, f"--reference {recording.path}",
                                opts.reference_names, list((opts.reference_state_pairs or {}).items()) or None, optional)
    group.record = recording.record
    contract_doc = read_contract_file(opts.contract_file, contract) if opts.contract_file else {}
    if "actions" in contract_doc:
        unrecorded = [a for a in contract_doc["actions"] if a not in group.outputs]
        if unrecorded:
            raise InputError(f"--contract {opts.contract_file}: action {unrecorded[0]!r} is not in the recording "
                             f"(it records {', '.join(group.outputs)}); record every action")
    group.judged = judged_outputs(contract_doc, contract, list(group.outputs), f"--contract {opts.contract_file}")
    tolerances = opts.tolerances or Tolerances()
    check_tolerance_keys(tolerances, contract.output_keys)
    thresholds = behaviour_thresholds.resolve([f.name for f in chosen if f.capabilities.lossy], opts.behaviour)
    opts.check_export(None, out)
    return ModelExport(model, Path(out), opts, contract, contract_doc, group, recording, chosen, tolerances,
                       thresholds)


def replace_formats(opts: ExportOptions, names: list[str]) -> ExportOptions:
    from policy_export.exporter.options import replace

    return replace(opts, formats=names)


def export_model(model: str | Path, out: str | Path, options: ExportOptions | None = None,
                 **keywords: Any) -> ExportResult:
    """Export ``model`` (an ONNX model exported elsewhere) to ``out``, proven against the recording
    ``reference=`` of what its training framework computed (see the module's description).

    The options are an :class:`~exporter.options.ExportOptions` or its fields as keywords:
    ``reference`` (required), ``reference_names``, ``reference_state_pairs``, ``contract_file``,
    ``formats`` (default ``["onnx"]``; those written from an ONNX model alone), ``tolerances``,
    ``behaviour``, ``model_name``, ``model_version``, ``external_data_threshold``, ``overwrite``,
    ``device``, ``progress``, ``run_timeout``::

        export_model("policy.onnx", "out/policy", reference="reference.npz",
                     formats=["onnx", "onnx_int8", "openvino"]).parity.passed

    Returns:
        an :class:`~exporter.export.ExportResult`.
    Raises:
        InputError, ExportError: see :func:`plan_model_export`. ParityFailedError: a format
            differs from the recording (nothing is written).
    """
    opts = ExportOptions.make(options, keywords)
    job = plan_model_export(model, out, opts)
    with run_limit(opts.run_timeout):
        return job.run()
