"""The frozen inference GraphDef: the serving graph with its variables folded into constants."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

from policy_export.exporter.protowire import field, header
from policy_export.exporter.context import ExportContext, FormatRecord
from policy_export.policy.errors import ExportError

tf1 = tf.compat.v1
FILENAME = "frozen_graph.pb"


def freeze(policy, signature) -> tf1.GraphDef:
    """Fold the session's variables into constants, keeping only what the outputs need, then
    rewrite the ops ONNX converters get wrong (:func:`replace_sparse_softmax_cross_entropy`)."""
    return freeze_tensors(policy, [t.name for t in signature.outputs.values()])


def freeze_tensors(policy, tensor_names: list[str]) -> tf1.GraphDef:
    """:func:`freeze` for the tensors named ``tensor_names``."""
    output_nodes = sorted({n.split(":")[0] for n in tensor_names})
    try:
        with policy.graph.as_default():
            frozen = tf1.graph_util.convert_variables_to_constants(
                policy.session, policy.graph.as_graph_def(), output_nodes
            )
    except (tf.errors.OpError, ValueError, AssertionError) as e:
        raise ExportError(f"freezing the policy graph failed: {e}") from e
    return replace_sparse_softmax_cross_entropy(frozen)


XENT_OP = "SparseSoftmaxCrossEntropyWithLogits"


def replace_sparse_softmax_cross_entropy(graph_def: tf1.GraphDef) -> tf1.GraphDef:
    """Each ``SparseSoftmaxCrossEntropyWithLogits`` whose loss alone is used, as
    ``-sum(one_hot(labels, n) * log_softmax(logits), -1)`` under the same node name.

    Categorical log-probabilities in RLlib's graphs (one per MultiDiscrete component) use this op;
    tf2onnx converts several of them in one graph into nodes that share one depth, which ONNX
    Runtime then refuses ("Incompatible dimensions"). The replacement computes the same loss with
    ops every converter handles. Ops whose gradient output is used, or whose class count is not
    static, are left as they are. Returns a new GraphDef (the input is not changed).
    """
    if not any(n.op == XENT_OP for n in graph_def.node):
        return graph_def
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    targets = {}
    for op in graph.get_operations():
        if op.type != XENT_OP or op.outputs[1].consumers():
            continue
        classes = op.inputs[0].shape[-1] if op.inputs[0].shape.rank else None
        if classes is not None:
            targets[op.name] = (int(classes), op.inputs[0].dtype, op.inputs[1].dtype)
    if not targets:
        return graph_def
    out = tf1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name not in targets:
            out.node.add().CopyFrom(node)
            continue
        classes, dtype, label_dtype = targets[node.name]
        logits, labels = node.input[0], node.input[1]
        for new in _xent_nodes(classes, dtype, label_dtype):
            added = out.node.add()
            added.CopyFrom(new)
            added.name = node.name if new.name == "loss" else f"{node.name}/onnx_safe/{new.name}"
            added.device = node.device
            del added.input[:]
            for inp in new.input:
                ctrl, name = ("^", inp[1:]) if inp.startswith("^") else ("", inp)
                base = name.split(":")[0]
                mapped = {"logits": logits, "labels": labels}.get(base)
                added.input.append(ctrl + (mapped if mapped else f"{node.name}/onnx_safe/{name}"))
    return out


def _xent_nodes(classes: int, dtype: tf.DType, label_dtype: tf.DType) -> list:
    """NodeDefs of the replacement, over inputs named ``logits`` and ``labels``; output ``loss``."""
    scratch = tf.Graph()
    with scratch.as_default():
        logits = tf1.placeholder(dtype, (None, classes), name="logits")
        labels = tf1.placeholder(label_dtype, (None,), name="labels")
        picked = tf.one_hot(labels, classes, dtype=dtype) * tf.nn.log_softmax(logits)
        tf.negative(tf.reduce_sum(picked, axis=-1), name="loss")
    return [n for n in scratch.as_graph_def().node if n.name not in ("logits", "labels")]


def write(ctx: ExportContext, target: Path) -> FormatRecord:
    """Write the frozen GraphDef to ``target``.

    The graph is the weightless skeleton (:func:`exporter.onnx_convert.skeleton`) with each variable
    placeholder written as a constant holding the session's value, streamed node by node
    (:func:`stream_graph_def`): one variable's bytes in memory at a time, not a GraphDef holding
    every weight and then its serialisation. A graph the skeleton cannot stand for is frozen by
    TensorFlow's converter instead; the file is the same GraphDef either way.
    """
    from policy_export.exporter.onnx_convert import NoSkeleton, skeleton

    output_nodes = sorted({t.op.name for t in ctx.signature.outputs.values()})
    try:
        graph_def, weights = skeleton(ctx.policy, output_nodes)
    except NoSkeleton:
        graph_def, weights = ctx.frozen_graph_def(), {}
    nodes = stream_graph_def(graph_def, target, _constant_values(ctx.policy.session, weights))
    present = {n.name for n in graph_def.node}
    kept = [k for k, t in ctx.signature.inputs.items() if t.op.name in present]
    return FormatRecord("frozen_graph", (target.name,), {"nodes": nodes, "inputs_kept": kept})


def _constant_values(session, weights):
    """Placeholder node name -> a callable returning its value from the session (read when written)."""
    return {name.split(":")[0]: (lambda tensor=tensor: session.run(tensor)) for name, tensor in weights.items()}


_NODE, _LIBRARY, _VERSIONS = 1, 2, 4  # GraphDef's field numbers


def _const_node(name: str, dtype: int, value: np.ndarray):
    """The GraphDef ``node`` field of a ``Const`` node holding ``value``, as byte chunks whose last
    is the array's own buffer (nothing copies the weights; protobuf allows fields in any order).

    NodeDef{name, op, attr{"dtype"}, attr{"value": AttrValue{tensor: TensorProto{dtype, shape,
    tensor_content}}}}, with ``tensor_content`` written last at every level."""
    head = tf1.NodeDef(name=name, op="Const")
    head.attr["dtype"].type = dtype
    tensor = tf.make_tensor_proto(np.zeros((), value.dtype))  # dtype and shape fields, no content
    tensor.ClearField("float_val")
    tensor.ClearField("double_val")
    tensor.ClearField("int_val")
    tensor.ClearField("int64_val")
    tensor.ClearField("bool_val")
    tensor.ClearField("half_val")
    tensor.ClearField("tensor_content")
    tensor.tensor_shape.CopyFrom(tf.TensorShape(value.shape).as_proto())
    content = memoryview(value).cast("B")
    tensor_head = tensor.SerializeToString() + header(4, content.nbytes)  # tensor_content = 4
    tensor_len = len(tensor_head) + content.nbytes
    attr_head = header(8, tensor_len)  # AttrValue.tensor = 8
    attr_len = len(attr_head) + tensor_len
    key = b"value"
    entry_head = field(1, key) + header(2, attr_len)
    entry_len = len(entry_head) + attr_len
    node_head = head.SerializeToString() + header(5, entry_len)  # NodeDef.attr = 5
    node_len = len(node_head) + entry_len
    return [header(_NODE, node_len) + node_head + entry_head + attr_head + tensor_head, content]


def stream_graph_def(graph_def: tf1.GraphDef, target: Path, constants=None) -> int:
    """Serialise ``graph_def`` to ``target`` one node at a time; the nodes named in ``constants``
    (name -> callable returning the value) are written as ``Const`` nodes holding that value.
    Returns the node count. The bytes are a GraphDef as ``SerializeToString`` would write it
    (protobuf allows a message's fields in any order)."""
    constants = constants or {}
    with open(target, "wb") as f:
        for node in graph_def.node:
            if node.name in constants:
                value = np.require(constants[node.name](), requirements="C")  # keeps 0-d arrays 0-d
                for chunk in _const_node(node.name, node.attr["dtype"].type, value):
                    f.write(chunk)
                del value
            else:
                f.write(field(_NODE, node.SerializeToString()))
        if graph_def.HasField("library"):
            f.write(field(_LIBRARY, graph_def.library.SerializeToString()))
        f.write(field(_VERSIONS, graph_def.versions.SerializeToString()))
    return len(graph_def.node)
