"""The OpenVINO IR: converted by ``openvino.convert_model`` from the export's ONNX model, checked,
then saved with ``openvino.save_model(..., compress_to_fp16=False)`` (float32 weights).

The ONNX model is ``model.onnx`` where that format was written in the same export, else a finished
copy of the export's one conversion (:func:`exporter.formats.onnx.convert.onnx_models`). Before
OpenVINO converts it, two things are changed in a copy:

- the optional inputs (``explore``, ``is_training``, ``timestep``...) are graph inputs backed by an
  initializer holding the default in ONNX; OpenVINO's ONNX reader turns such an input into a
  constant, so the copy declares them as plain inputs (the runner feeds the defaults);
- except where the explore branch holds random ops: OpenVINO does not sample faithfully (its
  ``Multinomial`` draws the same samples on every call of a compiled model, and its normal samples
  fail exploration parity), so such a model keeps its optional inputs as the constants OpenVINO
  makes of them, serves the deterministic path alone, and its record says ``explores: false``
  with the reason.

After conversion every contract input and output must be an IR input or output of its signature
key with the contract's dtype and rank, and the CPU plugin must support every op of the model
(``Core.query_model``); otherwise the format is refused with a :class:`ConversionError` naming what
is wrong (for an op: its type, its name and the outputs it feeds).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import ConversionError, ExportError
from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.openvino.names import XML_NAME

log = logging.getLogger(__name__)
ONNX_FILENAME = "model.onnx"
RANDOM_OPS = {"Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli"}


def source_onnx(ctx: ExportContext, stage: Path, scratch: Path) -> Path:
    """The export's full ONNX model as a file: ``model.onnx`` in ``stage`` where it was written
    already, else a finished copy of the export's conversion saved in ``scratch``.

    Raises:
        ConversionError: the full signature did not convert to ONNX.
    """
    written = Path(stage) / ONNX_FILENAME
    if written.is_file() and not written.is_symlink():
        return written
    if ctx.model_file is not None:  # a model exported elsewhere, passed by the ONNX door already
        return ctx.model_file
    from policy_export.exporter.compat import import_onnx
    from policy_export.exporter.formats.onnx import model as onnx_model
    from policy_export.exporter.formats.onnx.convert import onnx_models

    onnx = import_onnx()
    converted = onnx_models(ctx)
    if converted.full is None:
        if converted.full_error:
            raise ConversionError(converted.full_error)
        raise ExportError("the ONNX model was released before the OpenVINO model was made")
    model = onnx.ModelProto()
    model.CopyFrom(converted.full)  # weightless: the weights go into the copy
    copy = type(converted)(model, None, converted.route, converted.nchw, converted.weights,
                           converted.session, converted.weight_tensors)
    model, lazy = copy.take_lazy("full")
    onnx_model.finish_model(model, ctx.contract, ctx.opset, converted.nchw)
    target = Path(scratch) / ONNX_FILENAME
    onnx_model.save(model, target, ctx.external_data_threshold, lazy)
    return target


def prepare_onnx(source: Path, target: Path, contract) -> tuple[list[str], str | None]:
    """Write to ``target`` the copy of ``source`` that OpenVINO converts (see the module
    docstring); returns what was changed (for the format record) and, where the model cannot
    explore in OpenVINO, why."""
    import onnx

    model = onnx.load(str(source))
    sampling = sorted(_op_types(model.graph) & RANDOM_OPS)
    if sampling:
        onnx.save_model(model, str(target))
        return [], (f"the explore branch samples with {', '.join(sampling)}, which OpenVINO does not reproduce "
                    "faithfully (its Multinomial repeats its draws on every call of a compiled model; its normal "
                    "samples fail exploration parity): the optional inputs are fixed to their defaults, the IR "
                    "serves the deterministic path alone")
    optional = {s.key for s in contract.inputs if not s.required}
    graph = model.graph
    inputs = {i.name for i in graph.input}
    backed = [i for i in graph.initializer if i.name in inputs and i.name in optional]
    for init in backed:
        graph.initializer.remove(init)
    onnx.save_model(model, str(target))
    return ([f"optional inputs {sorted(i.name for i in backed)} kept as inputs"] if backed else []), None


def _op_types(graph) -> set[str]:
    """The op types of ``graph`` and of its subgraphs."""
    from onnx import AttributeProto

    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                found |= _op_types(attr.g)
            for sub in attr.graphs:
                found |= _op_types(sub)
    return found


def convert(onnx_path: Path):
    """``openvino.convert_model`` of the ONNX file.

    Raises:
        ConversionError: OpenVINO's converter fails.
    """
    import openvino as ov

    try:
        return ov.convert_model(str(onnx_path))
    except Exception as e:  # the converter raises its own error types
        raise ConversionError(f"openvino.convert_model fails on the ONNX model: {type(e).__name__}: {e}") from e


def name_ports(model, contract, fixed: bool = False) -> None:
    """Give each IR input and output exactly its signature key as its tensor name (``fixed``: the
    optional inputs were made constants, and are not looked for).

    Raises:
        ConversionError: a contract input or output is not in the IR, or has another dtype or rank.
    """
    inputs = [s for s in contract.inputs if s.required or not fixed]
    for what, ports, specs in (("input", model.inputs, inputs), ("output", model.outputs, contract.outputs)):
        by_name = {n: port for port in ports for n in port.get_names()}
        for spec in specs:
            port = by_name.get(spec.key)
            if port is None:
                raise ConversionError(f"the OpenVINO model has no {what} {spec.key!r} (it has "
                                      f"{sorted(by_name)}); the contract's {what}s must all be kept")
            check_port(port, spec, what)
            port.get_tensor().set_names({spec.key})


def check_port(port, spec, what: str) -> None:
    """Raises ConversionError when ``port``'s dtype, rank or fixed dims disagree with ``spec``."""
    dtype = np.dtype(port.get_element_type().to_dtype()).name
    shape = port.get_partial_shape()
    rank = shape.rank.get_length() if shape.rank.is_static else None
    wrong = dtype != np.dtype(spec.dtype).name or rank != len(spec.shape)
    if not wrong and rank is not None:
        wrong = any(d is not None and shape[i].is_static and shape[i].get_length() != d for i, d in enumerate(spec.shape))
    if wrong:
        raise ConversionError(f"the OpenVINO model's {what} {spec.key!r} is {dtype} {shape}; the contract has "
                              f"{spec.dtype} {list(spec.shape)}")


def check_ops(core, model, device: str = "CPU") -> None:
    """Every op of ``model`` must be supported by ``device`` (``Core.query_model``).

    Raises:
        ConversionError: naming each unsupported op's type and name, and the outputs it feeds.
    """
    supported = core.query_model(model, device)
    missing = [op for op in model.get_ops() if op.get_friendly_name() not in supported]
    if not missing:
        return
    feeds = _outputs_fed(model)
    parts = []
    for op in missing[:10]:
        fed = feeds.get(op.get_friendly_name(), [])
        where = f", feeding {', '.join(fed)}" if fed else ""
        parts.append(f"{op.get_type_name()} {op.get_friendly_name()!r}{where}")
    more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
    raise ConversionError(f"OpenVINO's {device} plugin does not support op(s) of the converted model: "
                          + "; ".join(parts) + more)


def _outputs_fed(model) -> dict[str, list[str]]:
    """Op friendly name -> the model outputs (by tensor name) it feeds."""
    fed: dict[str, set[str]] = {}
    for output in model.outputs:
        key = output.get_any_name()
        stack, seen = [output.get_node()], set()
        while stack:
            node = stack.pop()
            name = node.get_friendly_name()
            if name in seen:
                continue
            seen.add(name)
            fed.setdefault(name, set()).add(key)
            stack.extend(v.get_node() for v in node.input_values())
    return {k: sorted(v) for k, v in fed.items()}


def write_openvino(ctx: ExportContext, target: Path, name: str, precision: str) -> FormatRecord:
    """Convert, check and save the IR to the directory ``target`` (``model.xml``, ``model.bin``)."""
    import openvino as ov

    contract = ctx.contract
    model, notes, fixed, seconds = ctx.cached("openvino", lambda: _converted(ctx, target.parent))
    core = ov.Core()
    check_ops(core, model)
    target.mkdir(parents=True, exist_ok=True)
    try:
        ov.save_model(model, str(target / XML_NAME), compress_to_fp16=False)
    except Exception as e:  # OpenVINO raises RuntimeError and its own types
        raise ExportError(f"openvino.save_model fails: {type(e).__name__}: {e}") from e
    details: dict[str, Any] = {
        "openvino": ov.__version__, "inference_precision": precision, "device": "CPU",
        "source": "model.onnx's conversion", "changes": notes,
        "inputs": contract.input_keys, "outputs": contract.output_keys,
        "ops": sorted({op.get_type_name() for op in model.get_ops()}),
        "conversion_seconds": seconds,
    }
    if fixed is not None:
        details.update(explores=False, explores_reason=fixed,
                       fixed_inputs=[s.key for s in contract.inputs if not s.required])
    return FormatRecord(name, (target.name,), details)


def _converted(ctx: ExportContext, stage: Path):
    """The checked, named OpenVINO model of the export (made once for both IR formats), what was
    changed in its ONNX source, and the seconds it took."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="policy-export-openvino-") as tmp:
        source = source_onnx(ctx, stage, Path(tmp))
        ready = Path(tmp) / "openvino_input.onnx"
        notes, fixed = prepare_onnx(source, ready, ctx.contract)
        model = convert(ready)
    name_ports(model, ctx.contract, fixed is not None)
    return model, notes, fixed, round(time.perf_counter() - started, 3)
