"""TF1 graph surgery: the frozen inference GraphDef (variables folded into constants), the
weightless skeleton (variables as placeholders) and the rewrites ONNX converters need."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from policy_export.errors import ExportError

tf1 = tf.compat.v1


def freeze(policy, signature) -> tf1.GraphDef:
    """Fold the session's variables into constants, keeping only what the outputs need (variable
    updates no output reads left out: :func:`drop_write_only_updates`), then rewrite the ops ONNX
    converters get wrong (:func:`replace_sparse_softmax_cross_entropy`)."""
    return freeze_tensors(policy, [t.name for t in signature.outputs.values()])


def freeze_tensors(policy, tensor_names: list[str]) -> tf1.GraphDef:
    """:func:`freeze` for the tensors named ``tensor_names``."""
    output_nodes = sorted({n.split(":")[0] for n in tensor_names})
    graph_def, _ = drop_write_only_updates(policy.graph.as_graph_def(), output_nodes)
    try:
        with policy.graph.as_default():
            frozen = tf1.graph_util.convert_variables_to_constants(policy.session, graph_def, output_nodes)
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

    graph_def, _ = drop_write_only_updates(policy.graph.as_graph_def(), output_nodes)
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


# ---------------------------------------------------------------------------- state updates, dead branches

ASSIGN_OPS = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "Assign", "AssignAdd", "AssignSub"}
_READ_OPS = {"ReadVariableOp", "Identity", "ResourceGather"}


def _split_input(name: str) -> tuple[str, str, bool]:
    """``^a`` -> (``a``, ``0``, True); ``a:1`` -> (``a``, ``1``, False)."""
    control = name.startswith("^")
    node, _, port = name.lstrip("^").partition(":")
    return node, port or "0", control


def drop_write_only_updates(graph_def: tf1.GraphDef, output_nodes: list[str]) -> tuple[tf1.GraphDef, list[str]]:
    """``graph_def`` pruned to ``output_nodes`` without the variable updates no output reads.

    RLlib's serving graphs update bookkeeping variables on every call (EpsilonGreedy's
    ``last_timestep``, say) and make the actions wait for the update with a control edge. The
    outputs never read those variables, so the update changes nothing a caller sees, but a
    converter cannot express it (tf2onnx: "passed int64 ... incompatible with expected resource").
    An update is dropped when the outputs reach it only through control edges and read its
    variable nowhere: state that an output does read (an Ornstein-Uhlenbeck noise state, say) is
    kept, and converting it then fails as before. Returns the new GraphDef and the dropped nodes.
    """
    graph_def = tf1.graph_util.extract_sub_graph(graph_def, output_nodes)
    nodes = {n.name: n for n in graph_def.node}
    updates = {n.name for n in graph_def.node if n.op in ASSIGN_OPS}
    if not updates:
        return graph_def, []
    read_vars, data_reached = set(), set()
    stack = list(output_nodes)
    while stack:  # data edges only
        name = stack.pop()
        if name in data_reached or name not in nodes:
            continue
        data_reached.add(name)
        node = nodes[name]
        for inp in node.input:
            src, _, control = _split_input(inp)
            if not control:
                stack.append(src)
        if node.op in _READ_OPS and node.input:
            read_vars.add(_variable_of(nodes, node.input[0]))
    dropped = sorted(u for u in updates if u not in data_reached
                     and _variable_of(nodes, nodes[u].input[0]) not in read_vars)
    if not dropped:
        return graph_def, []
    gone = set(dropped)
    for node in graph_def.node:
        keep = [i for i in node.input if not (i.startswith("^") and i[1:] in gone)]
        if len(keep) != len(node.input):
            del node.input[:]
            node.input.extend(keep)
    return tf1.graph_util.extract_sub_graph(graph_def, output_nodes), dropped


def _variable_of(nodes: dict, name: str) -> str:
    """The variable node an update's or read's first input comes from (through Identity nodes)."""
    src = _split_input(name)[0]
    seen = set()
    while src in nodes and nodes[src].op == "Identity" and src not in seen and nodes[src].input:
        seen.add(src)
        src = _split_input(nodes[src].input[0])[0]
    return src


def pin_bool(graph_def: tf1.GraphDef, name: str, value: bool) -> None:
    """Make node ``name`` (a bool placeholder) the constant ``value``, in place."""
    node = next(n for n in graph_def.node if n.name == name)
    node.op = "Const"
    del node.input[:]
    node.ClearField("attr")
    node.attr["dtype"].type = tf.bool.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.bool))


def fold_constant_switches(graph_def: tf1.GraphDef) -> int:
    """Remove the branches of TF1 ``tf.cond`` (``Switch``/``Merge``) whose predicate is a constant,
    in place: the untaken side's nodes go, each such ``Switch`` becomes an ``Identity`` of its
    data and each ``Merge`` left with one live input an ``Identity`` of it. Returns how many
    switches were folded (0: nothing changed)."""
    nodes = {n.name: n for n in graph_def.node}
    constant = {}
    for node in graph_def.node:
        if node.op == "Const" and node.attr["dtype"].type == tf.bool.as_datatype_enum:
            value = tf.make_ndarray(node.attr["value"].tensor)
            if value.size == 1:
                constant[node.name] = bool(value.reshape(()))

    def const_of(inp: str):
        src = _split_input(inp)[0]
        seen = set()
        while src in nodes and nodes[src].op == "Identity" and src not in seen:
            seen.add(src)
            src = _split_input(nodes[src].input[0])[0]
        return constant.get(src)

    taken = {n.name: const_of(n.input[1]) for n in graph_def.node
             if n.op in ("Switch", "RefSwitch") and const_of(n.input[1]) is not None}
    if not taken:
        return 0
    dead_outputs = {f"{name}:{0 if value else 1}" for name, value in taken.items()}
    dead: set[str] = set()

    def is_dead_input(inp: str) -> bool:
        src, port, control = _split_input(inp)
        return src in dead or (not control and f"{src}:{port}" in dead_outputs)

    _mark_dead(graph_def, nodes, dead, is_dead_input)
    keep = _rewrite_live(graph_def, dead, taken, is_dead_input)
    del graph_def.node[:]
    graph_def.node.extend(keep)
    return len(taken)


def _mark_dead(graph_def, nodes: dict, dead: set, is_dead_input) -> None:
    """Add to ``dead`` every node an untaken branch feeds (a loop's ``Merge``: through its entry)."""
    def from_loop(inp: str) -> bool:
        src = nodes.get(_split_input(inp)[0])
        return src is not None and src.op == "NextIteration"

    changed = True
    while changed:
        changed = False
        for node in graph_def.node:
            if node.name in dead:
                continue
            data = [i for i in node.input if not i.startswith("^")]
            if node.op in ("Merge", "RefMerge"):
                entries = [i for i in data if not from_loop(i)]
                now_dead = (any(is_dead_input(i) for i in entries) if len(entries) < len(data)
                            else all(is_dead_input(i) for i in data))
            else:
                now_dead = any(is_dead_input(i) for i in data)
            if now_dead:
                dead.add(node.name)
                changed = True


def _rewrite_live(graph_def, dead: set, taken: dict, is_dead_input) -> list:
    """The live nodes, with folded switches and single-input merges as ``Identity`` nodes."""
    keep = []
    for node in graph_def.node:
        if node.name in dead:
            continue
        inputs = [i for i in node.input if not (i.startswith("^") and _split_input(i)[0] in dead)]
        if node.op in ("Merge", "RefMerge"):
            live = [i for i in inputs if not i.startswith("^") and not is_dead_input(i)]
            if len(live) == 1 and len(live) != len([i for i in inputs if not i.startswith("^")]):
                _make_identity(node, live[0], [i for i in inputs if i.startswith("^")])
                keep.append(node)
                continue
        if node.name in taken:
            _make_identity(node, inputs[0], [i for i in inputs if i.startswith("^")] + [f"^{_split_input(inputs[1])[0]}"])
            keep.append(node)
            continue
        del node.input[:]
        node.input.extend(inputs)
        keep.append(node)
    for node in keep:  # consumers of a folded Switch's taken port read the Identity
        for i, inp in enumerate(node.input):
            src, port, control = _split_input(inp)
            if not control and src in taken and port != "0":
                node.input[i] = src
    return keep


def _make_identity(node, data: str, controls: list[str]) -> None:
    from tensorflow.core.framework import attr_value_pb2

    dtype = node.attr["T"].type
    node.op = "Identity"
    node.ClearField("attr")
    node.attr["T"].CopyFrom(attr_value_pb2.AttrValue(type=dtype))
    del node.input[:]
    node.input.extend([data] + controls)
