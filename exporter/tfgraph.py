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
    converters get wrong or do not know (:func:`converter_rewrites`)."""
    return freeze_tensors(policy, [t.name for t in signature.outputs.values()])


def freeze_tensors(policy, tensor_names: list[str]) -> tf1.GraphDef:
    """:func:`freeze` for the tensors named ``tensor_names``."""
    output_nodes = sorted({n.split(":")[0] for n in tensor_names})
    graph_def, _ = drop_write_only_updates(policy.graph.as_graph_def(), output_nodes)
    return converter_rewrites(freeze_session(policy.session, output_nodes, graph_def))


def freeze_session(session, output_nodes: list[str], graph_def: tf1.GraphDef | None = None,
                   what: str = "the policy graph") -> tf1.GraphDef:
    """``graph_def`` (default: the session's whole graph) pruned to what ``output_nodes`` need,
    with the session's variable values folded into constants: the one freezing step of every
    route (a policy built here, a live RLlib policy, a loaded SavedModel).

    Raises:
        ExportError: a variable cannot be read, or the graph cannot be frozen.
    """
    graph_def = session.graph.as_graph_def() if graph_def is None else graph_def
    try:
        with session.graph.as_default():
            return tf1.graph_util.convert_variables_to_constants(session, graph_def, sorted(output_nodes))
    except (tf.errors.OpError, ValueError, AssertionError) as e:
        raise ExportError(f"freezing {what} failed: {e}") from e


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
    return _replace_nodes(graph_def, {name: (lambda node, t=t: (_xent_nodes(*t), {"logits": node.input[0],
                                                                                 "labels": node.input[1]}))
                                      for name, t in targets.items()})


def _replace_nodes(graph_def: tf1.GraphDef, makers: dict) -> tf1.GraphDef:
    """A copy of ``graph_def`` where each node named in ``makers`` is replaced by the nodes
    ``makers[name](node)`` returns: ``(nodes, inputs)``, the replacement's NodeDefs (its output
    node named ``out``) over placeholders named by ``inputs`` (placeholder name -> the tensor of
    ``graph_def`` it stands for). The output node takes the replaced node's name, so its
    consumers are unchanged; the others are put under ``<name>/onnx_safe/``."""
    out = tf1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name not in makers:
            out.node.add().CopyFrom(node)
            continue
        nodes, mapping = makers[node.name](node)
        for new in nodes:
            added = out.node.add()
            added.CopyFrom(new)
            added.name = node.name if new.name in ("loss", "out") else f"{node.name}/onnx_safe/{new.name}"
            added.device = node.device
            del added.input[:]
            for inp in new.input:
                ctrl, name = ("^", inp[1:]) if inp.startswith("^") else ("", inp)
                base = name.split(":")[0]
                mapped = mapping.get(base)
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


def converter_rewrites(graph_def: tf1.GraphDef) -> tf1.GraphDef:
    """The rewrites ONNX converters need, each computing exactly what it replaces: the
    cross-entropy (:func:`replace_sparse_softmax_cross_entropy`), ``BroadcastArgs``
    (:func:`replace_broadcast_args`) and RLlib's schedule loops (:func:`replace_schedule_loops`)."""
    return replace_schedule_loops(replace_broadcast_args(replace_sparse_softmax_cross_entropy(graph_def)))


def replace_broadcast_args(graph_def: tf1.GraphDef) -> tf1.GraphDef:
    """Each ``BroadcastArgs(s0, s1)`` (TF Probability's samplers use it; no ONNX converter knows it)
    as ``Shape(Fill(s0, 0) + Fill(s1, 0))``: the broadcast shape, by broadcasting two zero tensors
    of those shapes (a policy's are batch x action size)."""
    targets = {n.name: n.attr["T"].type for n in graph_def.node if n.op == "BroadcastArgs"}
    if not targets:
        return graph_def
    return _replace_nodes(graph_def, {name: (lambda node, t=t: (_broadcast_args_nodes(tf.as_dtype(t)),
                                                                {"s0": node.input[0], "s1": node.input[1]}))
                                      for name, t in targets.items()})


def _broadcast_args_nodes(dtype: tf.DType) -> list:
    scratch = tf.Graph()
    with scratch.as_default():
        s0 = tf1.placeholder(dtype, (None,), name="s0")
        s1 = tf1.placeholder(dtype, (None,), name="s1")
        zero = tf.constant(0, tf.int8)
        tf.shape(tf.fill(s0, zero) + tf.fill(s1, zero), out_type=dtype, name="out")
    return [n for n in scratch.as_graph_def().node if n.name not in ("s0", "s1")]


_PASS_THROUGH = {"Identity", "ReadVariableOp", "Enter", "Cast"}
_WHILE_OPS = ("While", "StatelessWhile")
EVALUATE_TIMEOUT_MS = 10_000  # one probe of a loop at conversion


def replace_schedule_loops(graph_def: tf1.GraphDef) -> tf1.GraphDef:
    """Each TF1 while loop that finds a schedule's segment, as the closed form of the same index.

    RLlib's ``PiecewiseSchedule`` (epsilon-greedy's epsilon, Gaussian noise's scale) looks its
    segment up with a ``tf.while_loop`` over ``(i, t)``: ``i`` from 0 while ``not (E[i+1] == -1 or
    E[i] <= t < E[i+1])``, ``E`` its constant endpoints closed by -1; tf2onnx cannot convert such
    loops. A loop qualifies when it has two variables, a counter from 0 stepping by 1 and a ``t``
    that every iteration reads from the same source, when its only loop-invariant input beside
    those is a constant 1-D integer ``E`` ending in -1, and when only the counter's exit is read.
    The closed form ``where(t < E[0], n-1, sum(E[1:n] <= t))`` (``n = len(E) - 1``) replaces
    that exit only after it gives the loop's own index for ``t`` at and around every endpoint,
    run by TensorFlow; any other loop is left as it is.
    """
    frames: dict[str, list] = {}
    for node in graph_def.node:
        if node.op == "Enter":
            frames.setdefault(node.attr["frame_name"].s.decode(), []).append(node)
    if not frames and not any(n.op in _WHILE_OPS for n in graph_def.node):
        return graph_def
    nodes = {n.name: n for n in graph_def.node}
    consumers: dict[str, list] = {}
    for node in graph_def.node:
        for inp in node.input:
            consumers.setdefault(inp.lstrip("^").split(":")[0], []).append(node)
    makers, outputs, dead = {}, {}, set()
    for enters in frames.values():
        found = _schedule_loop(enters, nodes, consumers, graph_def)
        if found is not None:
            exit_name, endpoints, t_name = found
            makers[exit_name] = (lambda node, e=endpoints, t=t_name, d=nodes[exit_name].attr["T"].type:
                                 (_segment_index_nodes(e, tf.as_dtype(d)), {"t": t}))
    for node in graph_def.node:
        found = _functional_schedule_loop(node, nodes, consumers, graph_def) if node.op in _WHILE_OPS else None
        if found is not None:
            endpoints, t_name, k = found
            outputs[f"{node.name}:{k}"] = node.name
            dead.update(c.name for c in consumers.get(node.name, []) if c.op == "Identity"
                        and not consumers.get(c.name) and c.input[0] != f"{node.name}:{k}")
            makers[node.name] = (lambda _, e=endpoints, t=t_name, d=node.attr["T"].list.type[k]:
                                 (_segment_index_nodes(e, tf.as_dtype(d)), {"t": t}))
    if not makers:
        return graph_def
    out = _replace_nodes(graph_def, makers)
    kept = [n for n in out.node if n.name not in dead]  # the loop's other outputs, read by nothing
    del out.node[:]
    out.node.extend(kept)
    for node in out.node:  # a functional loop's index output is now the replacement's only output
        node.input[:] = [outputs.get(i, i) for i in node.input]
    return out


def _source(name: str, nodes: dict) -> str:
    """The node a tensor is read from, through identities, variable reads, casts and Enters."""
    base = name.lstrip("^").split(":")[0]
    while base in nodes and nodes[base].op in _PASS_THROUGH and nodes[base].input:
        base = nodes[base].input[0].split(":")[0]
    return base


def _schedule_loop(enters: list, nodes: dict, consumers: dict, graph_def) -> tuple[str, list[int], str] | None:
    merges = [m for e in enters for m in consumers.get(e.name, []) if m.op == "Merge"]
    if len(merges) != 2:
        return None
    counter = t_merge = None
    for merge in merges:
        init = nodes.get(merge.input[0].split(":")[0])
        outer = nodes.get(init.input[0].split(":")[0]) if init is not None else None
        if outer is not None and outer.op == "Const" and outer.attr["value"].tensor.dtype in (3, 9) \
                and tf.make_ndarray(outer.attr["value"].tensor).shape == () \
                and int(tf.make_ndarray(outer.attr["value"].tensor)) == 0:
            counter = merge
        else:
            t_merge = merge
    if counter is None or t_merge is None:
        return None
    nxt = {m.name: nodes.get(m.input[1].split(":")[0]) for m in merges}
    t_init = nodes[t_merge.input[0].split(":")[0]].input[0]
    if nxt[t_merge.name] is None or _source(nxt[t_merge.name].input[0], nodes) != _source(t_init, nodes):
        return None
    exits = {m.name: [x for sw in consumers.get(m.name, []) if sw.op == "Switch"
                      for x in consumers.get(sw.name, []) if x.op == "Exit"] for m in merges}
    if len(exits[counter.name]) != 1 or any(consumers.get(x.name) for x in exits[t_merge.name]):
        return None
    source = _source(t_init, nodes)
    invariant = [e for e in enters if e.attr["is_constant"].b and _source(e.input[0], nodes) != source
                 and _constant(e.input[0], nodes)]
    if len(invariant) != 1:
        return None
    points = _endpoints(_evaluate(graph_def, [invariant[0].input[0]])[0])
    exit_node = exits[counter.name][0]
    if points is None or not _probes_agree(graph_def, exit_node.name + ":0", source, points):
        return None
    return exit_node.name, points, t_init


def _functional_schedule_loop(node, nodes: dict, consumers: dict, graph_def) -> tuple[list[int], str, int] | None:
    """The same schedule loop as a functional ``While`` (TF2 control flow, as RLlib >= 2.1 builds
    it under TF 2.x): loop variables ``(counter, max_iterations, i, t..., E)``, only ``i`` read."""
    import numpy as np

    # read by a consumer that is not a bare Identity nothing reads (while_v2 adds one per output)
    live = [c for c in consumers.get(node.name, []) if c.op != "Identity" or consumers.get(c.name)]
    read = {i.split(":")[1] if ":" in i else "0" for c in live for i in c.input
            if not i.startswith("^") and i.split(":")[0] == node.name}
    if len(read) != 1 or len(node.input) < 4:
        return None
    k = int(read.pop())
    loop_vars = [i for i in node.input if not i.startswith("^")]
    if k < 2 or k >= len(loop_vars) or not _constant(loop_vars[k], nodes):
        return None
    start = _evaluate(graph_def, [loop_vars[k]])[0]
    if np.ndim(start) != 0 or not np.issubdtype(np.asarray(start).dtype, np.integer) or int(start) != 0:
        return None
    rest = [v for j, v in enumerate(loop_vars) if j >= 2 and j != k]
    sources = {_source(v, nodes) for v in rest if not _constant(v, nodes)}
    invariant = [v for v in rest if _constant(v, nodes)]
    if len(sources) != 1 or len(invariant) != 1:
        return None
    source = sources.pop()
    points = _endpoints(_evaluate(graph_def, [invariant[0]])[0])
    if points is None or not _probes_agree(graph_def, f"{node.name}:{k}", source, points):
        return None
    return points, next(v for v in rest if not _constant(v, nodes)), k


def _endpoints(value) -> list[int] | None:
    """A schedule's endpoints from its constant ``E`` (1-D integers closed by -1), or ``None``."""
    import numpy as np

    if value.ndim != 1 or value.size < 2 or value[-1] != -1 or not np.issubdtype(value.dtype, np.integer):
        return None
    return [int(v) for v in value[:-1]]


def _probes_agree(graph_def, index: str, source: str, points: list[int]) -> bool:
    """Whether the loop's index tensor equals the closed form for ``t`` at and around every endpoint."""
    probes = sorted({0, *(p + d for p in points for d in (-1, 0, 1)), points[-1] + 10**6})
    try:
        loop = [_evaluate(graph_def, [index], {source: p})[0] for p in probes]
    except Exception:  # noqa: BLE001  (a loop TensorFlow cannot run so is not this one)
        return False
    return [int(v) for v in loop] == [_segment_index(points, p) for p in probes]


def _segment_index(points: list[int], t: int) -> int:
    n = len(points)
    return n - 1 if t < points[0] else sum(1 for p in points[1:] if p <= t)


def _segment_index_nodes(points: list[int], dtype: tf.DType) -> list:
    scratch = tf.Graph()
    with scratch.as_default():
        t = tf1.placeholder(tf.int64, (), name="t")
        e = tf.constant(points, tf.int64)
        n = len(points)
        found = tf.reduce_sum(tf.cast(e[1:] <= t, tf.int64))
        tf.identity(tf.cast(tf.where(t < e[0], tf.constant(n - 1, tf.int64), found), dtype), name="out")
    return [x for x in scratch.as_graph_def().node if x.name != "t"]


def _constant(name: str, nodes: dict) -> bool:
    """Whether tensor ``name`` is computed from constants alone."""
    todo, seen = [name.lstrip("^").split(":")[0]], set()
    while todo:
        base = todo.pop()
        if base in seen:
            continue
        seen.add(base)
        node = nodes.get(base)
        if node is None or node.op in ("Placeholder", "PlaceholderWithDefault", "VarHandleOp", "VariableV2",
                                       "Variable", "Enter", "Merge") or "Random" in node.op:
            return False
        todo.extend(i.lstrip("^").split(":")[0] for i in node.input)
    return True


def _evaluate(graph_def, tensors: list[str], feeds: dict | None = None) -> list:
    """Run ``tensors`` of ``graph_def`` in a scratch session (``feeds``: tensor name -> value)."""
    import numpy as np

    names = sorted({t.split(":")[0] for t in tensors})
    sub = tf1.graph_util.extract_sub_graph(graph_def, names)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(sub, name="")
    from policy_export.exporter.watchdog import stoppable_session

    with stoppable_session(graph, None, "a constant part of the graph") as sess:  # a signal stops it too
        fed = {}
        for k, v in (feeds or {}).items():
            tensor = graph.get_tensor_by_name(k if ":" in k else k + ":0")
            fed[tensor] = np.asarray(v, tensor.dtype.as_numpy_dtype)
        # bounded: a loop in a hostile file that never ends must not hang the conversion
        options = tf1.RunOptions(timeout_in_ms=EVALUATE_TIMEOUT_MS)
        return sess.run([t if ":" in t else t + ":0" for t in tensors], fed, options=options)


VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable"})  # ops that hold a variable
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
    variables = {n.name: n for n in graph_def.node if n.op in VARIABLE_OPS}
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
    return converter_rewrites(graph_def), weights


# ---------------------------------------------------------------------------- state updates, dead branches

ASSIGN_OPS = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "Assign", "AssignAdd", "AssignSub"}
_READ_OPS = {"ReadVariableOp", "Identity", "ResourceGather"}


def exploration_state(tensors: list) -> list[str]:
    """The variables that computing ``tensors`` (of a ``tf.Graph``) both writes and reads: state
    kept between calls, such as DDPG's Ornstein-Uhlenbeck noise. A variable only written (the
    timestep RLlib's exploration records) is not state the outputs depend on."""
    seen: set[str] = set()
    todo = [t.op for t in tensors]
    written: set[str] = set()
    read: set[str] = set()
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in ASSIGN_OPS:
            written.add(op.inputs[0].op.name)
        elif op.type in _READ_OPS and op.inputs and op.inputs[0].op.type in VARIABLE_OPS:
            read.add(op.inputs[0].op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return sorted(written & read)


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
    """Remove the branches of ``tf.cond`` whose predicate is a constant, in place: TF2's functional
    ``If``/``StatelessIf`` (a graph built with TensorFlow's v2 control flow, as RLlib's is when
    TensorFlow was imported before RLlib) become the taken branch's body
    (:func:`inline_constant_ifs`); of TF1's ``Switch``/``Merge``, the untaken side's nodes go, each
    such ``Switch`` becomes an ``Identity`` of its data and each ``Merge`` left with one live input
    an ``Identity`` of it. Returns how many conditionals were folded (0: nothing changed)."""
    inlined = inline_constant_ifs(graph_def)
    nodes = {n.name: n for n in graph_def.node}
    const_of = _bool_constants(graph_def)
    taken = {n.name: const_of(n.input[1]) for n in graph_def.node
             if n.op in ("Switch", "RefSwitch") and const_of(n.input[1]) is not None}
    if not taken:
        return inlined
    dead_outputs = {f"{name}:{0 if value else 1}" for name, value in taken.items()}
    dead: set[str] = set()

    def is_dead_input(inp: str) -> bool:
        src, port, control = _split_input(inp)
        return src in dead or (not control and f"{src}:{port}" in dead_outputs)

    _mark_dead(graph_def, nodes, dead, is_dead_input)
    keep = _rewrite_live(graph_def, dead, taken, is_dead_input)
    del graph_def.node[:]
    graph_def.node.extend(keep)
    return inlined + len(taken)


def _bool_constants(graph_def: tf1.GraphDef):
    """A function of a node input: the bool it is when it is a scalar bool ``Const`` (through
    ``Identity`` nodes), else ``None``."""
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

    return const_of


FUNCTIONAL_IFS = ("If", "StatelessIf")


def inline_constant_ifs(graph_def: tf1.GraphDef) -> int:
    """Replace every ``If``/``StatelessIf`` whose predicate is a constant by the body of the branch
    it takes, in place, until none is left (a branch may hold another): the body's nodes are added
    under ``<if>/<branch function>/``, reading the ``If``'s inputs where the function read its
    arguments, and the ``If`` node becomes an ``IdentityN`` of the branch's results under its own
    name, so every consumer still reads ``<if>:i``. Returns how many were inlined.

    Raises:
        ExportError: a branch function the graph's library does not hold.
    """
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph_def

    count = 0
    while True:
        const_of = _bool_constants(graph_def)
        node = next((n for n in graph_def.node if n.op in FUNCTIONAL_IFS and n.input
                     and const_of(n.input[0]) is not None), None)
        if node is None:
            return count
        branch = node.attr["then_branch" if const_of(node.input[0]) else "else_branch"].func.name
        functions = {f.signature.name: f for f in graph_def.library.function}
        if branch not in functions:
            raise ExportError(f"{node.name}: its branch function {branch!r} is not in the graph's library")
        fdef = functions[branch]
        body, flat = function_def_to_graph_def(fdef)
        data = [i for i in node.input[1:] if not i.startswith("^")]
        controls = [i for i in node.input if i.startswith("^")]
        args = {arg.name: data[i] for i, arg in enumerate(fdef.signature.input_arg)}
        prefix = f"{node.name}/{branch}/"

        def outer(inp: str) -> str:
            src, port, control = _split_input(inp)
            if src in args:
                return f"^{_split_input(args[src])[0]}" if control else args[src]
            return f"^{prefix}{src}" if control else f"{prefix}{src}:{port}"

        added = []
        for inner in body.node:
            if inner.name in args:  # an argument: the If's input stands in for it
                continue
            copy = tf1.NodeDef()
            copy.CopyFrom(inner)
            copy.name = prefix + inner.name
            del copy.input[:]
            copy.input.extend([outer(i) for i in inner.input] or controls)
            added.append(copy)
        results = [outer(flat[fdef.ret[arg.name]]) for arg in fdef.signature.output_arg]
        results += [f"^{prefix}{fdef.control_ret[name]}" for name in fdef.signature.control_output]
        types = [t for t in node.attr["Tout"].list.type]
        node.op = "IdentityN"
        del node.input[:]
        node.input.extend(results + controls)
        node.ClearField("attr")
        node.attr["T"].list.type.extend(types)
        graph_def.node.extend(added)
        count += 1


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
