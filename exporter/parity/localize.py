"""Where an ONNX model first departs from the TF graph it was converted from.

When a format fails parity, the outputs say *that* it differs, not *where*. As Polygraphy does
when it marks every layer as an output, the frozen graph and the ONNX model are both run on the
same inputs with every intermediate tensor they share (matched by name: tf2onnx keeps TensorFlow's
tensor names, ``base_model/fc_1/MatMul:0``) fetched, and the tensors are compared in the frozen
graph's topological order. The first one beyond the tolerance is where the model breaks: its
producing node is named in the report.

Only tensors present under the same name in both graphs, with a type ONNX shape inference knows,
are compared; a converter that fuses ops leaves fewer of them, so the answer is "at or before this
tensor". Tensors inside control flow (If/Loop bodies) are not reached.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter.parity.compare import Tolerance
from policy_export.exporter.watchdog import RunTimeoutError, current_limit, run_stoppable
from policy_export.errors import ExportError

log = logging.getLogger(__name__)
SKIP_OPS = {"Const", "Placeholder", "PlaceholderWithDefault", "NoOp", "Assert"}
MAX_ROWS = 64  # intermediate tensors are compared on the first rows of the inputs


@dataclass(frozen=True)
class Divergence:
    """The first intermediate tensor beyond the tolerance, and the nodes that produce it."""

    tensor: str
    tf_node: str
    tf_op: str
    onnx_node: str
    onnx_op: str
    max_abs_err: float
    atol: float
    rtol: float

    def describe(self) -> str:
        return (f"first divergence at tensor {self.tensor} (TF node {self.tf_node!r}, {self.tf_op}; ONNX node "
                f"{self.onnx_node!r}, {self.onnx_op}): max abs err {self.max_abs_err:.3g}, tolerance "
                f"atol={self.atol:g} rtol={self.rtol:g}")


@dataclass(frozen=True)
class Localization:
    """What :func:`localize` compared: how many shared tensors, and the first divergence (or None)."""

    format: str
    compared: int
    first: Divergence | None

    def describe(self) -> str:
        if self.first is None:
            return (f"{self.format}: none of the {self.compared} intermediate tensors shared with the frozen graph "
                    f"diverges; the difference arises after them (or inside control flow)")
        return f"{self.format}: {self.first.describe()} ({self.compared} shared tensors compared)"

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "compared": self.compared,
                "first": asdict(self.first) if self.first is not None else None}


def localize(frozen_graph: Path, onnx_path: Path, input_names: Mapping[str, str],
             feeds: Mapping[str, np.ndarray], tolerance: Tolerance, format_name: str = "onnx") -> Localization:
    """Compare every tensor the frozen graph and the ONNX model share, in topological order.

    ``input_names`` maps signature keys to the frozen graph's tensor names (the manifest's
    ``tensor_names["inputs"]``); ``feeds`` are keyed by signature key (the first rows are used).

    Raises:
        ExportError: a file cannot be read, or nothing could be fed.
    """
    import onnx
    import tensorflow as tf

    from policy_export.exporter import formats
    from policy_export.exporter.trust import check_graph_def, read_graph_def

    tf1 = tf.compat.v1
    graph_def = read_graph_def(frozen_graph)
    check_graph_def(graph_def, str(frozen_graph))
    formats.get(format_name).check_model(Path(onnx_path))
    model = onnx.load(str(onnx_path))
    feeds = {k: np.asarray(v)[:MAX_ROWS] for k, v in feeds.items()}

    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    ordered = _topological_tensors(graph)
    producers = _onnx_producers(model.graph)
    typed = _typed_values(model)
    shared = [t for t in ordered if t.name in producers and t.name in typed]
    if not shared:
        return Localization(format_name, 0, None)

    tf_feeds = {graph.get_tensor_by_name(input_names[k]): v for k, v in feeds.items()
                if k in input_names and _has_tensor(graph, input_names[k])}
    if not tf_feeds:
        raise ExportError("none of the inputs could be fed to the frozen graph")
    limit = current_limit()  # the same deadline as every runtime call; a signal stops the step too
    with tf1.Session(graph=graph) as session:
        options = tf1.RunOptions(timeout_in_ms=max(1, int(limit * 1000)))
        try:
            reference = run_stoppable(lambda: session.run({t.name: t for t in shared}, tf_feeds, options=options),
                                      f"frozen graph {frozen_graph}", session.close)
        except tf.errors.DeadlineExceededError as e:
            raise RunTimeoutError(f"frozen graph {frozen_graph}", limit) from e
    got = _run_onnx_with_outputs(model, [t.name for t in shared], typed, feeds)
    for tensor in shared:
        ref, actual = np.asarray(reference[tensor.name]), got.get(tensor.name)
        if actual is None:
            continue
        err = _excess(ref, np.asarray(actual), tolerance)
        if err is not None:
            node = producers[tensor.name]
            return Localization(format_name, len(shared), Divergence(
                tensor.name, tensor.op.name, tensor.op.type, node.name or "(unnamed)", node.op_type, err,
                tolerance.atol, tolerance.rtol))
    return Localization(format_name, len(shared), None)


def localize_formats(frozen_graph: Path, models: Mapping[str, Path], input_names: Mapping[str, str],
                     feeds: Mapping[str, np.ndarray], tolerances) -> list[dict[str, Any]]:
    """:func:`localize` for each ONNX model in ``models`` (format -> path), as report entries
    (``Localization.to_json()``, or ``{"format", "error"}`` when it could not run)."""
    entries = []
    for fmt, path in models.items():
        tolerance = tolerances.default
        try:
            result = localize(frozen_graph, path, input_names, feeds, tolerance, fmt)
        except Exception as e:  # a localisation that cannot run must not hide the parity failure
            log.debug("localising %s failed", fmt, exc_info=True)
            entries.append({"format": fmt, "error": f"{type(e).__name__}: {e}"})
            continue
        log.info(result.describe())
        entries.append({**result.to_json(), "describe": result.describe()})
    return entries


def _has_tensor(graph, name: str) -> bool:
    try:
        graph.get_tensor_by_name(name)
        return True
    except (KeyError, ValueError):
        return False


def _topological_tensors(graph) -> list:
    """The outputs of every computing op, producers before consumers (Kahn's order, stable)."""
    ops = [op for op in graph.get_operations() if op.type not in SKIP_OPS]
    order, seen = [], set()
    pending = {op.name: {i.op.name for i in op.inputs} | {c.name for c in op.control_inputs} for op in
               graph.get_operations()}
    done = {op.name for op in graph.get_operations() if op.type in SKIP_OPS}
    progress = True
    while progress:
        progress = False
        for op in ops:
            if op.name in seen or not pending[op.name] <= done:
                continue
            seen.add(op.name)
            done.add(op.name)
            order.extend(t for t in op.outputs if t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_bool)
            progress = True
    return order


def _onnx_producers(graph) -> dict[str, Any]:
    return {out: node for node in graph.node for out in node.output}


def _typed_values(model) -> dict[str, Any]:
    """Value name -> ValueInfoProto with an element type, from ONNX shape inference."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as e:  # onnx raises its own inference errors
        log.debug("shape inference failed: %s", e)
        inferred = model
    infos = list(inferred.graph.value_info) + list(inferred.graph.output)
    return {v.name: v for v in infos if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def _run_onnx_with_outputs(model, names: list[str], typed: Mapping[str, Any], feeds: Mapping[str, np.ndarray]):
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for name in names:
        if name not in present:
            probe.graph.output.append(typed[name])
    from policy_export.exporter.sessions import inference_session

    session = inference_session(probe.SerializeToString(), optimization="disable")  # every tensor kept
    inputs = {i.name for i in session.get_inputs()} | {i.name for i in session.get_overridable_initializers()}
    outputs = [o.name for o in session.get_outputs()]
    run_options = ort.RunOptions()
    run_options.log_severity_level = 4

    def stop() -> None:
        run_options.terminate = True

    fed = {k: v for k, v in feeds.items() if k in inputs}
    values = run_stoppable(lambda: session.run(outputs, fed, run_options), "ONNX model (localize)", stop)
    return dict(zip(outputs, values))


def _excess(ref: np.ndarray, got: np.ndarray, tol: Tolerance) -> float | None:
    """The max abs error if ``got`` is beyond the tolerance of ``ref`` (exact for ints), else None."""
    if ref.shape != got.shape:
        if ref.size != got.size:
            return float("inf")
        got = got.reshape(ref.shape)
    if not (np.issubdtype(ref.dtype, np.floating) or np.issubdtype(got.dtype, np.floating)):
        return None if np.array_equal(ref, got) else float(np.max(np.abs(ref.astype(np.float64) - got), initial=0))
    a, b = ref.astype(np.float64), got.astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    if np.all(diff <= tol.atol + tol.rtol * np.abs(a)):
        return None
    return float(np.nanmax(diff))
