"""Write the Triton model repository: ``triton/<name>/config.pbtxt`` and
``triton/<name>/<version>/model.onnx`` (batched, deterministic, required inputs only), and for a
policy that samples ``triton/<name>_explore/`` (the sampling model, optional inputs declared
``optional: true``, not batched). See :mod:`.graph` for why the two differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from policy_export.errors import ConversionError, ExportError
from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.triton import config as tc
from policy_export.exporter.formats.triton.graph import (
    START, all_nodes, fold_optional_inputs, make_stepwise, state_pairs,
)
from policy_export.signatures.contract import Contract

EXPLORE_SUFFIX = "_explore"
CONFIG = "config.pbtxt"
MODEL_FILE = "model.onnx"


def write_repository(ctx: ExportContext, target: Path, format_name: str) -> FormatRecord:
    """Both models and their configs under ``target`` (the export's ``triton/``)."""
    from policy_export.exporter.formats.onnx.compress import deterministic_onnx, full_onnx
    from policy_export.exporter.formats.onnx.model import RANDOM_OPS

    contract = ctx.signature.contract
    refused = None
    try:
        full = full_onnx(ctx, target.parent)
    except ConversionError as e:  # the sampling branch did not convert: serve the deterministic model
        try:
            full, sig = deterministic_onnx(ctx, target.parent)
        except ExportError as no_deterministic:
            raise ConversionError(f"{e}; and {no_deterministic}") from e
        contract, refused = sig.contract, f"the full signature did not convert to ONNX ({e})"
    samples = bool({n.op_type for n in all_nodes(full.graph)} & RANDOM_OPS) and \
        any(s.key == "explore" for s in contract.inputs)
    models: dict[str, Any] = {}
    files: list[str] = []
    batched = _copy(full)
    fold_optional_inputs(batched, contract)
    models[ctx.model_name] = _write_model(ctx, target, ctx.model_name, batched, contract, batch=True, files=files)
    if samples:
        name = ctx.model_name + EXPLORE_SUFFIX
        models[name] = _write_model(ctx, target, name, full, contract, batch=False, files=files)
    details = {"models": models, "recurrent": bool(state_pairs(contract)), "explores": samples,
               "backend": "onnxruntime", "version": ctx.model_version,
               "checked_with_triton_schema": all(m["checked_with_triton_schema"] for m in models.values())}
    if refused:
        details["explore_refused"] = refused
    return FormatRecord(format_name, tuple(f"{target.name}/{f}" for f in files), details)


def _write_model(ctx: ExportContext, target: Path, name: str, model, contract: Contract, batch: bool,
                 files: list[str]) -> dict[str, Any]:
    from policy_export.exporter.formats import coverage
    from policy_export.exporter.formats.onnx import model as onnx_model

    make_stepwise(model, contract, batched=batch)
    coverage.check_onnx_runtime(model, f"Triton model {name!r}")
    config = _config(ctx, name, model, contract, batch)
    text = tc.render(config)
    checked = tc.check_with_triton_schema(text, f"{name}/{CONFIG}")
    model_dir = target / name / str(ctx.model_version)
    model_dir.mkdir(parents=True)
    written = onnx_model.save(model, model_dir / MODEL_FILE, ctx.external_data_threshold)
    onnx_model.check_saved(model_dir / MODEL_FILE)
    (target / name / CONFIG).write_text(text)
    rel = f"{name}/{ctx.model_version}"
    files += [f"{name}/{CONFIG}", *(f"{rel}/{Path(f).name}" for f in written)]
    return {"config": f"{name}/{CONFIG}", "model": f"{rel}/{MODEL_FILE}", "max_batch_size": config.max_batch_size,
            "inputs": [t.name for t in config.inputs], "outputs": [t.name for t in config.outputs],
            "optional_inputs": [t.name for t in config.inputs if t.optional],
            "states": [[s.name, out] for s, out in config.states], "control_start": config.control_start,
            "checked_with_triton_schema": checked}


def _config(ctx: ExportContext, name: str, model, contract: Contract, batch: bool) -> tc.ModelConfig:
    pairs = state_pairs(contract)
    state_ins, state_outs = {p[0] for p in pairs}, {p[1] for p in pairs}
    graph = model.graph
    initialized = {i.name for i in graph.initializer}
    optional = {i.name: i.name in initialized for i in graph.input}
    one_sequence = bool(pairs) and not batch  # a recurrent model that does not batch: one sequence per request
    inputs = _pin_first(tc.tensors(graph.input, batch, optional, leave_out=state_ins | {START}), one_sequence)
    # outputs as the model declares them: the backend compares output dims exactly (inputs loosely)
    outputs = tc.tensors(graph.output, batch, leave_out=state_outs)
    by_name = {i.name: i for i in graph.input}
    states = tuple((_pin_first((tc.value_tensor(by_name[i], batch),), one_sequence)[0], o) for i, o in pairs)
    for state, _ in states:
        if any(d < 0 for d in state.dims):
            raise ConversionError(f"state {state.name!r} has an open dimension {list(state.dims)}; Triton's implicit "
                                  "state needs fixed dims for its zero initial state")
    notes = (f"policy-export: {'batched, deterministic (required inputs only)' if batch else 'samples when explore is true; not batched'}",)
    return tc.ModelConfig(name=name, max_batch_size=_max_batch(batch), inputs=inputs, outputs=outputs, states=states,
                          control_start=START if pairs else None, version=ctx.model_version, notes=notes,
                          preferred_batch_sizes=())


def _max_batch(batch: bool) -> int:
    from policy_export.exporter.defaults import TRITON_MAX_BATCH_SIZE

    return TRITON_MAX_BATCH_SIZE if batch else 0


def _pin_first(tensors: tuple[tc.Tensor, ...], pin: bool) -> tuple[tc.Tensor, ...]:
    """With ``pin``, an open first dimension becomes 1 (one sequence per request)."""
    if not pin:
        return tensors
    return tuple(tc.Tensor(t.name, t.data_type, (1, *t.dims[1:]) if t.dims and t.dims[0] == -1 and t.reshape is None
                           else t.dims, t.reshape, t.optional) for t in tensors)


def _copy(model):
    from policy_export.exporter.compat import import_onnx

    copy = import_onnx().ModelProto()
    copy.CopyFrom(model)
    return copy

