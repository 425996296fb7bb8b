"""TF1 graph surgery: the frozen inference GraphDef (variables folded into constants), the
weightless skeleton (variables as placeholders) and the rewrites ONNX converters need."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from policy_export.errors import ExportError

tf1 = tf.compat.v1


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


_VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable"}
_REF_READERS = {"Identity"}  # a VariableV2's readers the skeleton keeps as they are


class NoSkeleton(Exception):
    """The graph's variables are used other than by plain reads."""


def skeleton(policy, output_nodes: list[str]):
    """The policy graph pruned to ``output_nodes`` with its variables as placeholders, and the
    weight inputs: placeholder tensor name -> the session tensor holding its value.

    Raises:
        NoSkeleton: a variable is used other than by plain reads.
    """
    from tensorflow.core.framework import attr_value_pb2

    graph_def = tf1.graph_util.extract_sub_graph(policy.graph.as_graph_def(), output_nodes)
    variables = {n.name: n for n in graph_def.node if n.op in _VARIABLE_OPS}
    weights: dict[str, Any] = {}
    for node in graph_def.node:
        sources = [i.split(":")[0].lstrip("^") for i in node.input]
        if not any(s in variables for s in sources):
            continue
        if node.op == "ReadVariableOp":
            handle = variables[sources[0]]
            weights.setdefault(f"{handle.name}:0", policy.graph.get_tensor_by_name(f"{node.name}:0"))
            dtype = node.attr["dtype"].type
            node.op = "Identity"
            node.ClearField("attr")
            node.attr["T"].CopyFrom(attr_value_pb2.AttrValue(type=dtype))
        elif node.op in _REF_READERS and variables[sources[0]].op != "VarHandleOp":
            weights.setdefault(f"{sources[0]}:0", policy.graph.get_tensor_by_name(f"{sources[0]}:0"))
        else:
            raise NoSkeleton(f"variable {sources[0]} is used by a {node.op} op ({node.name})")
    for node in variables.values():
        dtype, shape = node.attr["dtype"], node.attr["shape"]
        node.op = "Placeholder"
        node.ClearField("attr")
        node.attr["dtype"].CopyFrom(dtype)
        node.attr["shape"].CopyFrom(shape)
    for node in graph_def.node:
        node.device = ""
    missing = [n for n in variables if f"{n}:0" not in weights]
    if missing:
        raise NoSkeleton(f"variables {missing} are never read")
    return replace_sparse_softmax_cross_entropy(graph_def), weights
