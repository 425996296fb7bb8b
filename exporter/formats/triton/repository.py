"""Write the Triton model repository: ``triton/<name>/config.pbtxt`` and
``triton/<name>/<version>/model.onnx`` (batched, deterministic, required inputs only), and for a
policy that samples ``triton/<name>_explore/`` (the sampling model, optional inputs declared
``optional: true``, not batched). See :mod:`.graph` for why the two differ. A model exported
elsewhere is served as it is, and batched only where every input and output has an open first
dimension (a static batch of 1, or a torch LSTM's state with its batch on the second axis, is
served one request at a time: ``max_batch_size: 0``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from policy_export.errors import ConversionError, ExportError
from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.triton import config as tc
from policy_export.exporter.formats.triton.graph import (
    START, all_nodes, fold_optional_inputs, make_stepwise, state_pairs,
)
from policy_export.exporter.formats.triton.runner import EXPLORE_SUFFIX
from policy_export.signatures.contract import Contract

CONFIG = "config.pbtxt"
MODEL_FILE = "model.onnx"


def write_repository(ctx: ExportContext, target: Path, format_name: str) -> FormatRecord:
    """Both models and their configs under ``target`` (the export's ``triton/``)."""
    from policy_export.exporter.formats.onnx.compress import deterministic_onnx, full_onnx
    from policy_export.exporter.formats.onnx.model import RANDOM_OPS

    contract = ctx.contract
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
    # a model exported elsewhere batches on Triton only where every input and output has an open first dim
    batch = ctx.model_file is None or _batches(batched)
    models[ctx.model_name] = _write_model(ctx, target, ctx.model_name, batched, contract, batch=batch, files=files)
    if samples:
        name = ctx.model_name + EXPLORE_SUFFIX
        models[name] = _write_model(ctx, target, name, full, contract, batch=False, files=files)
    details = {"models": models, "recurrent": bool(state_pairs(contract, ctx.state_pairs)), "explores": samples,
               "backend": "onnxruntime", "version": ctx.model_version,
               "checked_with_triton_schema": all(m["checked_with_triton_schema"] for m in models.values())}
    if refused:
        details["explore_refused"] = refused
    return FormatRecord(format_name, tuple(f"{target.name}/{f}" for f in files), details)


def _write_model(ctx: ExportContext, target: Path, name: str, model, contract: Contract, batch: bool,
                 files: list[str]) -> dict[str, Any]:
    from policy_export.exporter.formats import coverage
    from policy_export.exporter.formats.onnx import model as onnx_model

    make_stepwise(model, contract, batched=batch, pairs=ctx.state_pairs)
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
    pairs = state_pairs(contract, ctx.state_pairs)
    state_ins, state_outs = {p[0] for p in pairs}, {p[1] for p in pairs}
    graph = model.graph
    initialized = {i.name for i in graph.initializer}
    optional = {i.name: i.name in initialized for i in graph.input}
    one_sequence = bool(pairs) and not batch  # a recurrent model that does not batch: one sequence per request
    # the sampling model's [batch] tensors as [rows, 1], as the batched model's (a reshape: the model is unchanged)
    columns = tc.rows_as_column if name.endswith(EXPLORE_SUFFIX) else tuple
    inputs = _pin_first(columns(tc.tensors(graph.input, batch, optional, leave_out=state_ins | {START})), one_sequence)
    # outputs as the model declares them: the backend compares output dims exactly (inputs loosely)
    outputs = columns(tc.tensors(graph.output, batch, leave_out=state_outs))
    by_name = {i.name: i for i in graph.input}
    states = tuple((_pin_open((tc.value_tensor(by_name[i], batch),), one_sequence)[0], o) for i, o in pairs)
    for state, _ in states:
        if any(d < 0 for d in state.dims):
            raise ConversionError(f"state {state.name!r} has an open dimension {list(state.dims)}; Triton's implicit "
                                  "state needs fixed dims for its zero initial state")
    if name.endswith(EXPLORE_SUFFIX):
        role = "samples when explore is true; not batched"
    elif batch:
        role = "batched, deterministic (required inputs only)"
    else:  # a model exported elsewhere whose batch is fixed, or whose state keeps its batch off the first axis
        role = "the model as exported; not batched (one request is the model's own batch)"
    notes = (f"policy-export: {role}",)
    return tc.ModelConfig(name=name, max_batch_size=_max_batch(batch), inputs=inputs, outputs=outputs, states=states,
                          control_start=START if pairs else None, version=ctx.model_version, notes=notes,
                          preferred_batch_sizes=())


def _max_batch(batch: bool) -> int:
    from policy_export.exporter.defaults import TRITON_MAX_BATCH_SIZE

    return TRITON_MAX_BATCH_SIZE if batch else 0


def _pin_first(tensors: tuple[tc.Tensor, ...], pin: bool) -> tuple[tc.Tensor, ...]:
    """With ``pin``, an open first dimension becomes 1 (one sequence per request), in ``dims`` and
    in a ``reshape`` that starts with it."""
    if not pin:
        return tensors

    def pinned(shape):
        return (1, *shape[1:]) if shape and shape[0] == -1 else shape

    return tuple(tc.Tensor(t.name, t.data_type, pinned(t.dims), t.reshape if not t.reshape else pinned(t.reshape),
                           t.optional) for t in tensors)


def _pin_open(tensors: tuple[tc.Tensor, ...], pin: bool) -> tuple[tc.Tensor, ...]:
    """With ``pin``, every open dimension of a state becomes 1 (one sequence per request; a torch
    LSTM keeps its batch on the second axis): its zero initial state needs fixed dims."""
    if not pin:
        return tensors

    def pinned(shape):
        return tuple(1 if d == -1 else d for d in shape) if shape else shape

    return tuple(tc.Tensor(t.name, t.data_type, pinned(t.dims), pinned(t.reshape) if t.reshape else t.reshape,
                           t.optional) for t in tensors)


def _batches(model) -> bool:
    """Whether every input and output of ``model`` has an open first dimension (Triton's ONNX
    Runtime backend batches a model only then)."""
    def open_first(value) -> bool:
        dims = value.type.tensor_type.shape.dim
        return len(dims) > 0 and not dims[0].HasField("dim_value")

    initialized = {i.name for i in model.graph.initializer}
    return all(open_first(v) for v in (*(i for i in model.graph.input if i.name not in initialized),
                                       *model.graph.output))


def _copy(model):
    from policy_export.exporter.compat import import_onnx

    copy = import_onnx().ModelProto()
    copy.CopyFrom(model)
    return copy

