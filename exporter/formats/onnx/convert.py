"""One tf2onnx conversion for both ONNX models, with the weights kept out of the converter.

tf2onnx's optimiser passes grow with every weight tensor in the graph (each pass re-serialises the
constants), so converting a frozen graph costs many copies of the weights in memory and most of an
export's time. Instead:

1. **Skeleton.** The policy graph, pruned to the union of the signature's outputs and the
   deterministic outputs, with each variable replaced by a placeholder of its dtype and shape
   (``VarHandleOp``/``VariableV2`` -> ``Placeholder``, ``ReadVariableOp`` -> ``Identity``). It holds no
   weight bytes, so it is a few kilobytes at any model size and never near protobuf's 2 GiB limit.
2. **One conversion** of the skeleton, the weights being graph inputs.
3. **Weights in.** Each weight input becomes an initializer, read from the session one variable at
   a time; ops that only reshape a weight (``Transpose``, ``Cast``, ``Identity``) are folded into it.
4. **Split.** ``model.onnx`` keeps what the signature's outputs need; ``model_deterministic.onnx``
   what the deterministic outputs need, with the required inputs only (an optional input it reads
   becomes a constant holding the default).

A graph the skeleton cannot stand for (a variable read by anything but a plain read, a converter
error on the placeholders) is converted the classic way instead: frozen once, for both models'
outputs, then converted once and split the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policy_export.exporter.compat import import_onnx

onnx = import_onnx()
from onnx import helper, numpy_helper  # noqa: E402

from policy_export.errors import ConversionError, ExportError  # noqa: E402

log = logging.getLogger(__name__)

DETERMINISTIC_PREFIX = "deterministic__"
_FOLDABLE = {"Transpose", "Cast", "Identity"}


@dataclass
class Converted:
    """Both models (``deterministic`` is ``None`` without deterministic outputs) and how they were made."""

    full: Any
    deterministic: Any
    route: str  # "skeleton" or "frozen"
    nchw: list[str] = field(default_factory=list)  # inputs transposed to NCHW
    weights: int = 0
    session: Any = None
    weight_tensors: Mapping[str, Any] = field(default_factory=dict)  # weight input -> session tensor
    full_error: str = ""  # why the full model did not convert, when only the deterministic one did

    def take(self, which: str):
        """``"full"`` or ``"deterministic"``, with its weights read in from the session and the
        ops that only reshape a weight folded; the model is no longer held here afterwards.

        Raises:
            ExportError: that model was taken already (or the policy has no deterministic outputs).
        """
        model, lazy = self.take_lazy(which)
        for name, weight in lazy.items():
            model.graph.initializer.append(_initializer(name, weight.value()))
        return model

    def take_lazy(self, which: str) -> tuple[Any, dict[str, "LazyWeight"]]:
        """Like :meth:`take`, but the weights stay in the session: the model declares none of them,
        and each :class:`LazyWeight` (name -> weight) reads its value when it is written
        (:func:`exporter.formats.onnx.model.save`), so that one weight at a time is in memory."""
        model = getattr(self, which)
        if model is None and which == "full" and self.full_error:
            raise ConversionError(self.full_error)
        if model is None:
            raise ExportError(f"the {which} ONNX model is not available (taken already, or not converted)")
        setattr(self, which, None)
        graph = model.graph
        used = names_read(graph) | {o.name for o in graph.output}
        weights = {k: t for k, t in self.weight_tensors.items() if k in used}
        keep = [i for i in graph.input if i.name not in weights]
        del graph.input[:]
        graph.input.extend(keep)
        lazy = {name: LazyWeight(np.dtype(t.dtype.as_numpy_dtype), tuple(t.shape.as_list()),
                                 lambda t=t: np.asarray(self.session.run(t))) for name, t in weights.items()}
        fold_weight_ops(graph, lazy)
        return model, lazy


@dataclass
class LazyWeight:
    """A weight that is read when it is written: dtype, shape, and how to compute its value."""

    dtype: np.dtype
    shape: tuple[int, ...]
    value: Any  # () -> np.ndarray

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _initializer(name: str, value: np.ndarray):
    tensor = onnx.TensorProto()
    tensor.name = name
    tensor.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
    tensor.dims.extend(value.shape)
    tensor.raw_data = little_endian(value).tobytes()
    return tensor


def little_endian(value: np.ndarray) -> np.ndarray:
    """``value`` as ONNX stores raw data: C order, little-endian (no copy where it is already)."""
    value = np.require(value, requirements="C")
    return value.astype(value.dtype.newbyteorder("<"), copy=False)


def onnx_models(ctx) -> Converted:
    """Both ONNX models of the export, from one conversion (:func:`convert_both`) shared by every
    ONNX format written (kept in ``ctx`` until it is released)."""
    return ctx.cached("onnx", lambda: convert_both(ctx))


def convert_both(ctx) -> Converted:
    """Convert the policy once for ``model.onnx`` and ``model_deterministic.onnx``. When the full
    signature does not convert (a sampling branch tf2onnx cannot handle, say) but the deterministic
    outputs exist, those are converted alone; taking the full model then raises the full model's
    conversion error.

    Raises:
        ExportError: the conversion fails, or a model fails its checks.
    """
    from policy_export.signatures.builder import build_deterministic_signature

    sig = ctx.signature
    det = build_deterministic_signature(ctx.policy)
    full_error = ""
    converted, aliases = _union_outputs(sig, det)
    try:
        model, nchw, route, weights = _convert(ctx, sig, converted)
        pairs = [(outputs_key(sig, det, k), k) for k in det.outputs] if det is not None else []
    except ExportError as e:
        if det is None:
            raise
        log.info("the full signature does not convert (%s); converting the deterministic outputs alone", e)
        full_error = str(e)
        model, nchw, route, weights = _convert(ctx, sig, {t.name: DETERMINISTIC_PREFIX + k for k, t in det.outputs.items()})
        pairs = [(DETERMINISTIC_PREFIX + k, k) for k in det.outputs]
    # split first, weights after: each model gets its weights from the session when it is taken,
    # so at most one model's weights are in memory at a time
    full = None if full_error else prune(model, [(aliases.get(k, k), k) for k in sig.outputs], sig.contract,
                                         sig.contract, set(weights))
    deterministic = prune(model, pairs, det.contract, sig.contract, set(weights)) if det is not None else None
    del model
    return Converted(full, deterministic, route, nchw, len(weights), session=ctx.policy.session, weight_tensors=weights,
                     full_error=full_error)


def _convert(ctx, sig, outputs: Mapping[str, str]):
    """One tf2onnx conversion of ``outputs`` (tensor name -> converted name): of the skeleton, or of
    the frozen graph where the skeleton cannot stand for the graph or does not convert. Returns the
    model, the NCHW inputs, the route and the weight inputs (name -> session tensor)."""
    from policy_export.exporter.tfgraph import NoSkeleton, skeleton

    try:
        graph_def, weights = skeleton(ctx.policy, sorted({n.split(":")[0] for n in outputs}))
    except NoSkeleton as e:
        log.info("converting the frozen graph: %s", e)
    else:
        try:
            model, nchw = _tf2onnx(ctx, graph_def, sig, outputs, list(weights))
            return model, nchw, "skeleton", weights
        except ExportError as e:
            log.info("the skeleton does not convert (%s); converting the frozen graph", e)
    from policy_export.exporter import tfgraph

    graph_def = tfgraph.freeze_tensors(ctx.policy, list(outputs))
    model, nchw = _tf2onnx(ctx, graph_def, sig, outputs, [])
    return model, nchw, "frozen", {}


def outputs_key(sig, det, key: str) -> str:
    """The name the converted graph gives deterministic output ``key``: the signature key of the
    same tensor when the signature outputs it, else ``deterministic__<key>``."""
    tensor = det.outputs[key].name
    same = [k for k, t in sig.outputs.items() if t.name == tensor]
    return same[0] if same else DETERMINISTIC_PREFIX + key


def _union_outputs(sig, det) -> tuple[dict[str, str], dict[str, str]]:
    """Tensor name -> converted name, for every signature output and every deterministic output;
    and the aliases: signature key -> the key converted for the same tensor. (RLlib's DQN
    signature gives ``q_values`` and ``action_dist_inputs`` one tensor; a converter names each
    tensor once, so the second key becomes an ``Identity`` of the first in the model.)"""
    outputs: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for key, tensor in sig.outputs.items():
        if tensor.name in outputs:
            aliases[key] = outputs[tensor.name]
            continue
        outputs[tensor.name] = key
    for key, tensor in (det.outputs.items() if det is not None else ()):
        outputs.setdefault(tensor.name, DETERMINISTIC_PREFIX + key)
    return outputs, aliases


def _tf2onnx(ctx, graph_def, sig, outputs: Mapping[str, str], weight_inputs: list[str]):
    import tf2onnx

    present = {n.name for n in graph_def.node}
    inputs = {k: t.name for k, t in sig.inputs.items() if t.op.name in present}
    rename = {**{name: key for key, name in inputs.items()}, **outputs}
    nchw = [k for k in ctx.policy.image_inputs if k in inputs] if ctx.inputs_as_nchw else []
    try:
        model, _ = tf2onnx.convert.from_graph_def(
            graph_def, name=ctx.policy.name, input_names=list(inputs.values()) + weight_inputs,
            output_names=list(outputs), opset=ctx.opset, tensors_to_rename=rename,
            inputs_as_nchw=[inputs[k] for k in nchw] or None,
        )
    except Exception as e:  # tf2onnx raises many kinds; say which stage failed
        raise ConversionError(f"ONNX conversion (tf2onnx, opset {ctx.opset}) failed: {type(e).__name__}: {e}") from e
    return model, nchw


def fold_weight_ops(graph, lazy: dict[str, LazyWeight] | None = None) -> int:
    """Fold ``Transpose``/``Cast``/``Identity`` nodes whose only input is a weight (an initializer,
    or one of ``lazy``) into a new weight (tf2onnx leaves them when the weights are inputs); returns
    how many were folded. A lazy weight's fold is applied when its value is read."""
    lazy = lazy if lazy is not None else {}
    inputs = {i.name for i in graph.input}
    folded = 0
    changed = True
    while changed:
        changed = False
        initializers = {i.name: i for i in graph.initializer if i.name not in inputs}
        consumers: dict[str, int] = {}
        for node in graph.node:
            for name in node.input:
                consumers[name] = consumers.get(name, 0) + 1
        outputs = {o.name for o in graph.output}
        for node in list(graph.node):
            if node.op_type not in _FOLDABLE or len(node.input) != 1 or node.output[0] in outputs:
                continue
            source = node.input[0]
            if source not in initializers and source not in lazy:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            perm = attrs.get("perm") if node.op_type == "Transpose" else None
            cast = helper.tensor_dtype_to_np_dtype(attrs["to"]) if node.op_type == "Cast" else None

            def apply(value, node_type=node.op_type, perm=perm, cast=cast):
                if node_type == "Transpose":
                    return np.transpose(value, perm)
                return value.astype(cast) if node_type == "Cast" else value

            if source in lazy:
                weight = lazy[source]
                shape = weight.shape
                if node.op_type == "Transpose":
                    shape = tuple(shape[i] for i in perm) if perm else tuple(reversed(shape))
                lazy[node.output[0]] = LazyWeight(np.dtype(cast) if cast is not None else weight.dtype, shape,
                                                  lambda w=weight, f=apply: f(w.value()))
                if consumers.get(source, 0) <= 1:
                    del lazy[source]
            else:
                value = apply(numpy_helper.to_array(initializers[source]))
                graph.initializer.append(_initializer(node.output[0], value))
                if consumers.get(source, 0) <= 1:
                    graph.initializer.remove(initializers[source])
            graph.node.remove(node)
            folded += 1
            changed = True
            break
    return folded


def prune(model, outputs: list[tuple[str, str]], contract, full_contract, weight_inputs=frozenset()):
    """A new model with what ``outputs`` (converted name, key) need: nodes, initializers (If/Loop
    bodies' reads counted) and the ``contract``'s inputs; an input of ``full_contract`` that is
    not in ``contract`` but is read becomes a constant holding its default. Graph inputs named in
    ``weight_inputs`` that are read stay inputs (the weights go in later)."""
    graph = model.graph
    need = needed(graph, [src for src, _ in outputs])
    out = onnx.ModelProto()
    out.ir_version = model.ir_version
    out.opset_import.extend(model.opset_import)
    out.producer_name = model.producer_name
    out.metadata_props.extend(model.metadata_props)
    g = out.graph
    g.name = graph.name
    g.node.extend(n for n in graph.node if any(o in need for o in n.output))
    g.initializer.extend(i for i in graph.initializer if i.name in need)
    own = set(contract.input_keys)
    defaults = {s.key: s for s in full_contract.inputs if not s.required}
    initialized = {i.name for i in g.initializer}
    for value in graph.input:
        if value.name in own or (value.name in weight_inputs and value.name in need):
            g.input.append(value)
        elif value.name in need and value.name not in initialized:
            spec = defaults.get(value.name)
            if spec is None:
                raise ExportError(f"the deterministic outputs need the required input {value.name!r}, "
                                  "which their signature does not take")
            g.initializer.append(numpy_helper.from_array(np.asarray(spec.default, np.dtype(spec.dtype)), value.name))
    declared = {o.name: o for o in graph.output}
    for src, key in outputs:
        value = g.output.add()
        value.CopyFrom(declared[src])
        if src != key:
            g.node.append(helper.make_node("Identity", [src], [key], name=f"{key}/output"))
            value.name = key
    return out


def needed(graph, outputs: list[str], stop: str | None = None) -> set[str]:
    """Every name ``outputs`` depend on in ``graph`` (node outputs, initializers, graph inputs;
    If/Loop bodies' reads counted), not looking past the tensor ``stop``."""
    producer = {o: n for n in graph.node for o in n.output}
    need: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if not name or name in need:
            continue
        need.add(name)
        node = producer.get(name)
        if node is None or name == stop:
            continue
        stack.extend(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                stack.extend(names_read(sub))
    return need


def names_read(graph) -> set[str]:
    """Every name a node of ``graph`` or of its subgraphs (If/Loop bodies) reads."""
    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                names |= names_read(sub)
    return names


def head_model(model, source: str):
    """``model`` cut at tensor ``source``: a model taking ``source`` (and ``explore``) that
    computes the actions and ``action_logp``/``action_prob`` from it; ``None`` when those read
    any other graph input, or a weight kept in external data."""
    from policy_export.signatures.keys import ACTION_LOGP, ACTION_PROB, EXPLORE, is_action

    graph = model.graph
    wanted = [o for o in graph.output if is_action(o.name) or o.name in (ACTION_LOGP, ACTION_PROB)]
    declared = {o.name: o for o in graph.output}
    if source not in declared or not any(is_action(o.name) for o in wanted):
        return None
    need = needed(graph, [o.name for o in wanted], stop=source)
    initializers = [i for i in graph.initializer if i.name in need]
    initialized = {i.name for i in initializers}
    if any(i.data_location == onnx.TensorProto.EXTERNAL for i in initializers):
        return None
    graph_inputs = {i.name: i for i in graph.input}
    reads = {n for n in need if n in graph_inputs and n not in initialized} | (
        {EXPLORE} if EXPLORE in need and EXPLORE in graph_inputs else set())
    if reads - {EXPLORE}:
        return None
    cut = onnx.ModelProto()
    cut.ir_version = model.ir_version
    cut.opset_import.extend(model.opset_import)
    g = cut.graph
    g.name = f"{graph.name}_head"
    g.input.append(declared[source])
    g.input.extend(graph_inputs[n] for n in sorted(reads))
    g.initializer.extend(i for i in initializers if i.name != EXPLORE)
    g.node.extend(n for n in graph.node if any(o in need for o in n.output) and source not in n.output)
    g.output.extend(wanted)
    return cut
