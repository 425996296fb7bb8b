"""A policy exported elsewhere, checked against what its training framework computed.

``verify MODEL.onnx --reference REF.npz`` (:func:`verify_reference`): the ONNX file (from
``torch.onnx``, rsl_rl's exporter, Isaac Lab, SB3's recipe...) passes the ONNX door
(:mod:`exporter.formats.onnx.trust`: no link, external data beside it, sizes and nodes bounded),
its inputs and outputs are read from the graph, the recording (:mod:`exporter.recorded.reference`)
is checked against them before anything runs, and ONNX Runtime replays every recorded row as the
model's batch allows (:class:`~exporter.parity.groups.reference.ReferenceGroup`): every recorded
output within its tolerance, discrete outputs identical, recurrent state fed back episode by
episode, the first diverging output and row named. No TensorFlow is loaded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter.devices import DevicePlan, plan_ort_devices
from policy_export.exporter.options import VerifyOptions, check_tolerance_keys
from policy_export.exporter.parity.compare import ParityReport, Tolerances
from policy_export.exporter.parity.groups.reference import Port, ReferenceGroup
from policy_export.exporter.progress import SILENT
from policy_export.exporter.watchdog import run_limit

FORMAT = "onnx"
# options of verify that apply to an export, not to a model file
EXPORT_ONLY = {"candidates": "--candidate", "expect_manifest_sha256": "--expect-manifest-sha256", "server": "--server",
               "observations": "--observations", "localize": "--localize", "samples": "--samples"}


def is_model_file(path: str | Path) -> bool:
    """Whether ``path`` names a model file this checks against a recording (an ``.onnx``) rather than an export."""
    return Path(path).suffix.lower() == ".onnx"


def check_reference_options(model: str | Path, opts: VerifyOptions) -> None:
    """Refuse what does not apply to a model file checked against a recording, before anything runs.

    Raises:
        InputError: no ``--reference``, or an option of an export's verify.
    """
    if opts.reference is None:
        raise InputError(f"{model} is a model file, not an export: check it against a recording of what its "
                         "framework computed with --reference REF.npz (policy_export.recording writes one)")
    given = [flag for name, flag in EXPORT_ONLY.items() if getattr(opts, name, None)]
    if given:
        raise InputError(f"{given[0]} applies to an export, not to a model file checked against --reference")


def model_contract(model: Path):
    """The graph's inputs and outputs as it declares them (a :class:`~signatures.Contract`; the
    model's metadata is not trusted for it), through the ONNX door first.

    Raises:
        ExportError: the file is refused by the ONNX door.
    """
    from policy_export.exporter.formats.onnx.model import onnx_contract

    return onnx_contract(model, metadata=False)


def ports(model: Path, contract=None) -> tuple[list[Port], list[Port], list[str]]:
    """The graph's inputs and outputs as it declares them, and the inputs it gives a default."""
    contract = contract if contract is not None else model_contract(model)
    inputs = [Port(s.key, s.dtype, tuple(s.shape)) for s in contract.inputs]
    outputs = [Port(s.key, s.dtype, tuple(s.shape)) for s in contract.outputs]
    return inputs, outputs, [s.key for s in contract.inputs if not s.required]


def verify_reference(model: str | Path, options: VerifyOptions | None = None, **keywords: Any):
    """Check ``model`` against a recording (``reference=``; see the module's description); a
    :class:`~exporter.verify.VerifyResult` whose report has a record per compared output and
    replay. The options are a :class:`~exporter.options.VerifyOptions` or its fields as
    keywords (``reference``, ``reference_names``, ``reference_state_pairs``, ``tolerances``, ``device``,
    ``run_timeout``, ``progress``)::

        verify_reference("policy.onnx", reference="reference.npz").passed

    Raises:
        InputError: the recording does not fit the graph, or a bad option. ExportError: the model
            file is refused by the ONNX door.
    """
    from policy_export.exporter.formats.onnx.model import OnnxRunner
    from policy_export.exporter.recorded.reference import read_reference
    from policy_export.exporter.verify import VerifyResult

    model = Path(model)
    opts = VerifyOptions.make(options, keywords)
    check_reference_options(model, opts)
    if not model.is_file() and not model.is_symlink():
        raise InputError(f"{model}: no such model file")
    progress = opts.progress or SILENT
    graph_in, graph_out, optional = ports(model)  # the model through the ONNX door first
    recording = read_reference(opts.reference)  # and checked against the graph, before any stage is shown
    where = f"--reference {recording.path}"
    group = ReferenceGroup.make(recording.arrays, graph_in, graph_out, where, opts.reference_names,
                                list((opts.reference_state_pairs or {}).items()) or None, optional)
    group.record = recording.record
    tolerances = opts.tolerances or Tolerances()
    check_tolerance_keys(tolerances, [p.name for p in graph_out])
    device = opts.device if isinstance(opts.device, DevicePlan) else plan_ort_devices(opts.device)
    report = ParityReport(f"the recording {recording.path}", recording.rows, 0, device.to_json())
    start = time.perf_counter()
    with run_limit(opts.run_timeout), progress.stage(f"parity {FORMAT}", recording.rows):
        with OnnxRunner(model, device) as runner:
            report.devices.update(runner.device_info())
            group.replay_rows(FORMAT, runner, tolerances, report)
    report.seconds[FORMAT] = time.perf_counter() - start
    notes = group.describe() + _first_divergence(report)
    return VerifyResult(model, [], report, notes)


def _first_divergence(report: ParityReport) -> list[str]:
    """The output that leaves its tolerance first, and where."""
    failed = [r for r in report.records if not r.passed]
    if not failed:
        return []
    first = min(failed, key=lambda r: _row(r.first_divergence))
    where = f" at {first.first_divergence}" if first.first_divergence else f": {first.problem}"
    return [f"first diverging: output {first.key}{where} ({first.format})"]


def _row(text: str) -> int:
    try:
        return int(text.split()[1]) if text.startswith("row ") else 1 << 62
    except (IndexError, ValueError):
        return 1 << 62


def describe_ports(model: Path) -> dict[str, Any]:
    """The graph's inputs and outputs, for messages and records."""
    graph_in, graph_out, optional = ports(model)
    return {"inputs": [p.name for p in graph_in], "outputs": [p.name for p in graph_out], "optional": optional}
