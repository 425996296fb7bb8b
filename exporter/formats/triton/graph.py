"""The ONNX models of a Triton repository, made from ``model.onnx``'s model.

Triton's ONNX Runtime backend decides what a model may be:

- a model that batches (``max_batch_size > 0``) may have no optional input (the backend refuses
  to load it), so the batched model has the optional inputs folded to their defaults: it takes the
  required inputs alone and is deterministic;
- the sampling model keeps the optional inputs (``explore``...) as overridable initializers, which
  the backend accepts as inputs declared ``optional: true``; it does not batch;
- a recurrent model served with implicit state takes one step per request: ``seq_lens`` is made
  inside the model (one step per sequence), and a ``START`` control input (``int32`` ``[1]`` per
  request, 1 on a sequence's first step) zeroes the state the server feeds back, so a client
  sends only the per-step inputs.
"""

from __future__ import annotations

import numpy as np

from policy_export.errors import ConversionError
from policy_export.exporter.compat import import_onnx
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import SEQ_LENS, is_state_in

onnx = import_onnx()
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

START = "START"


def state_pairs(contract: Contract, pairs=None) -> list[tuple[str, str]]:
    """``(state_in_i, state_out_i)`` for each state the contract carries, in order; ``pairs``
    (input, output fed back) where a model exported elsewhere names its state otherwise."""
    if pairs:
        bad = [f"{a}={b}" for a, b in pairs if a not in contract.input_keys or b not in contract.output_keys]
        if bad:
            raise ConversionError(f"state pair(s) {', '.join(bad)} do not name an input and an output of the model")
        return [(a, b) for a, b in pairs]
    outs = set(contract.output_keys)
    pairs = []
    for key in contract.input_keys:
        if is_state_in(key):
            out = "state_out_" + key[len("state_in_"):]
            if out not in outs:
                raise ConversionError(f"state input {key!r} has no output {out!r} to pair with for implicit state")
            pairs.append((key, out))
    return pairs


def fold_optional_inputs(model, contract: Contract) -> list[str]:
    """Make every optional input of ``model`` a constant holding its default (a model that
    batches on Triton may have no optional input); returns the inputs folded."""
    optional = {s.key for s in contract.inputs if not s.required}
    keep = [i for i in model.graph.input if i.name not in optional]
    folded = [i.name for i in model.graph.input if i.name in optional]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    read = {name for node in all_nodes(model.graph) for name in node.input}
    unused = [i for i in model.graph.initializer if i.name in folded and i.name not in read]
    for init in unused:
        model.graph.initializer.remove(init)
    return folded


def all_nodes(graph):
    """Every node of ``graph``, its subgraphs' included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from all_nodes(sub)


def make_stepwise(model, contract: Contract, batched: bool, pairs=None) -> None:
    """Make a recurrent ``model`` take one step per request with its state fed back by the server:
    ``seq_lens`` (ones) is computed inside, and a ``START`` input zeroes every state where it is 1.
    A model that batches keeps each state as ``[batch, size]``; one that does not (one sequence a
    request) may keep it in any layout (a torch LSTM's ``[layers, 1, size]``)."""
    graph = model.graph
    pairs = state_pairs(contract, pairs)
    if not pairs:
        return
    first = pairs[0][0]
    nodes = []
    if any(i.name == SEQ_LENS for i in graph.input):
        spec = contract.input(SEQ_LENS)
        _remove_input(graph, SEQ_LENS)
        nodes += _ones_like_batch(graph, first, SEQ_LENS, np.dtype(spec.dtype))
    graph.input.append(helper.make_tensor_value_info(START, TensorProto.INT32, ["batch", 1] if batched else [1]))
    keep = "policy_export/start/keep"
    nodes.append(helper.make_node("Equal", [START, "policy_export/start/zero"], [keep + "_raw"]))
    graph.initializer.append(numpy_helper.from_array(np.zeros((), np.int32), "policy_export/start/zero"))
    # batched: [batch, 1] against [batch, size] states; one sequence a request: a scalar against any layout
    ranks = {len(contract.input(state_in).shape) for state_in, _ in pairs}
    if batched and ranks != {2}:
        raise ConversionError(f"a state of rank {max(ranks - {2})}; a model that batches is written for [batch, size] "
                              "states (one that does not batch takes any layout)")
    gate = np.asarray([-1, 1] if batched else [], np.int64)
    graph.initializer.append(numpy_helper.from_array(gate, "policy_export/start/shape"))
    nodes.append(helper.make_node("Reshape", [keep + "_raw", "policy_export/start/shape"], [keep]))
    for state_in, _ in pairs:
        gated = f"policy_export/start/{state_in}"
        _rename_reads(graph, state_in, gated)
        zero = f"policy_export/start/{state_in}/zero"
        elem = next(i for i in graph.input if i.name == state_in).type.tensor_type.elem_type
        graph.initializer.append(numpy_helper.from_array(np.zeros((), helper.tensor_dtype_to_np_dtype(elem)), zero))
        nodes.append(helper.make_node("Where", [keep, state_in, zero], [gated]))
    _prepend(graph, nodes)


def _ones_like_batch(graph, source: str, name: str, dtype: np.dtype) -> list:
    """Nodes computing ``name`` = ones of ``dtype``, one per row of ``source`` (opset 13 ops)."""
    base = f"policy_export/{name}"
    for suffix, value in (("/begin", [0]), ("/end", [1])):
        graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.int64), base + suffix))
    value = numpy_helper.from_array(np.ones((1,), dtype), "value")
    return [helper.make_node("Shape", [source], [base + "/shape"]),
            helper.make_node("Slice", [base + "/shape", base + "/begin", base + "/end"], [base + "/batch"]),
            helper.make_node("ConstantOfShape", [base + "/batch"], [name], value=value)]


def _remove_input(graph, name: str) -> None:
    keep = [i for i in graph.input if i.name != name]
    del graph.input[:]
    graph.input.extend(keep)


def _rename_reads(graph, old: str, new: str) -> None:
    """Every read of ``old`` (in the graph's nodes and their subgraphs) becomes a read of ``new``."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                if not any(o == old for n in sub.node for o in n.output):
                    _rename_reads(sub, old, new)
    for out in graph.output:
        if out.name == old:
            raise ConversionError(f"state input {old!r} is also a graph output; it cannot be gated by {START}")


def _prepend(graph, nodes) -> None:
    existing = list(graph.node)
    del graph.node[:]
    graph.node.extend([*nodes, *existing])
