"""One-step serving graphs for legacy (TF1) recurrent SavedModels whose LSTM is a while loop.

RLlib's TF1 LSTM policies (``use_lstm=True``) export their whole training graph: the model
reshapes the ``[B*T, ...]`` rows into ``[B, T, ...]`` with ``seq_lens`` and runs a Keras LSTM as a
``tf.while_loop`` over time. Such a loop cannot be frozen and converted to ONNX, so the
serving signature of a converted model is a one-step graph built beside it in the same session:

- the loop is found from the signature's state outputs (each is the final value of a loop
  variable), and its parts are identified from the ops and how they connect, never from names: the time-major
  input ``[T, B, F]`` the loop reads, the optional ``[T, B, ...]`` mask, the initial ``h`` and
  ``c``, the cell's ``kernel [F, 4n]``, ``recurrent_kernel [n, 4n]`` and ``bias [4n]``, its
  activations (the ops applied to the four gate slices, Keras order i, f, c, o), and the
  ``[T, B, n]`` output sequence the rest of the model reads;
- the step takes the loop's input at ``t = 0`` (with ``B`` rows and ``B`` one-step sequences the
  original graph makes ``T = 1``), applies the cell once and passes the state through where the
  mask is false (``seq_lens == 0``: padding rows);
- everything after the loop (heads, action distribution, value function) is copied unchanged,
  its loop outputs replaced by the step's; everything before the loop is shared as it is.

The original looped graph stays as the policy's training-time ``sequence_graph``, so stepped
parity compares the exported step with the SavedModel's own loop over padded sequences. A
numeric self-check against the loop (one step, random inputs) refuses cells that are not a
standard Keras LSTM cell. Both loop forms are read: TF1 control flow (``Enter``/``Exit`` frames,
``TensorArrayV3``; what RLlib's tf1 graphs hold by default) and control flow v2 (a ``While`` op
whose body is in the function library, ``TensorList`` ops). Anything else this module cannot
take apart is refused with an :class:`ExportError` naming what was found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError
from policy_export.policy.recurrent import SequenceGraph
from policy_export.signatures.keys import EXPLORE, SEQ_LENS, is_state_in, state_in_key, state_out_for, state_out_key

tf1 = tf.compat.v1
log = logging.getLogger(__name__)

STEP_SCOPE = "legacy_step"
DEFAULT_MAX_SEQ_LEN = 20  # RLlib's default ``max_seq_len``: the chunk the sequence graph is run with
SELF_CHECK_ATOL = 1e-5
ACTIVATIONS = {"Sigmoid": tf.sigmoid, "Tanh": tf.tanh, "Relu": tf.nn.relu}
V2_LOOPS = ("While", "StatelessWhile")


@dataclass
class RecurrentServing:
    """The recurrent serving tensors of a converted policy, keyed like the contract.

    ``inputs`` holds ``observations`` (or its leaf keys), ``state_in_i``, ``seq_lens`` and, when
    present, ``prev_action``/``prev_reward``/``is_training``/``timestep``/``explore``;
    ``outputs`` holds ``actions_i``, ``state_out_i`` and the remaining outputs
    (``action_dist_inputs``, ``action_logp``, ``action_prob``, extras such as ``vf_preds``).
    """

    graph: tf.Graph
    session: tf1.Session
    inputs: dict[str, tf.Tensor]
    outputs: dict[str, tf.Tensor]
    sequence_graph: Any = None  # the training-time graph, when the outputs are a rewritten step


@dataclass
class LoopLSTM:
    """The parts of a while loop (v1 or v2) running a Keras LSTM cell, as outer-graph tensors."""

    loop: str  # the v1 frame or the v2 While op
    inputs_tm: tf.Tensor  # [T, B, F] what the loop reads at each step
    mask_tm: tf.Tensor | None  # [T, B, ...] bool
    h0: tf.Tensor
    c0: tf.Tensor
    h_final: tf.Tensor  # the loop's final values (Exit tensors or While outputs)
    c_final: tf.Tensor
    sequence_out: tf.Tensor  # [T, B, n] the stacked outputs
    kernel: tf.Tensor
    recurrent_kernel: tf.Tensor
    bias: tf.Tensor
    activation: str
    recurrent_activation: str


def is_looped(state_outputs: Sequence[tf.Tensor]) -> bool:
    """Whether any state output is the result of a while loop (v1 ``Exit`` or v2 ``While``)."""
    return any(_through_identity(t).op.type in ("Exit", *V2_LOOPS) for t in state_outputs)


def one_step_outputs(session: tf1.Session, inputs: Mapping[str, tf.Tensor], outputs: Mapping[str, tf.Tensor],
                     state_in: Sequence[str], state_out: Sequence[str], explore: tf.Tensor | None = None,
                     max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> tuple[dict[str, tf.Tensor], SequenceGraph | None]:
    """Replace a looped LSTM's signature outputs by a one-step graph (see the module docstring).

    ``inputs``/``outputs`` are the signature tensors keyed by signature key; ``state_in``/``state_out``
    the state keys, paired in order. ``explore`` is the switch between sampled and deterministic
    actions, if known (default: found in the graph). Returns the new outputs (same keys) and the
    original graph as the training-time :class:`SequenceGraph` (keys ``state_in_i``/``state_out_i``);
    outputs that come from no loop are returned unchanged with ``None``.

    Raises:
        ExportError: a loop that is not a single Keras LSTM cell this module can take apart, or a
            step that does not reproduce the loop.
    """
    finals = [outputs[k] for k in state_out]
    if not is_looped(finals):
        return dict(outputs), None
    graph = session.graph
    lstm = find_loop_lstm(graph, finals)
    seq_lens = inputs.get(SEQ_LENS)
    explore = explore if explore is not None else find_explore(graph, list(outputs.values()), inputs)
    with graph.as_default():
        new_seq, h, c = _step(lstm, seq_lens)
        boundary = {lstm.sequence_out: new_seq, lstm.h_final: h, lstm.c_final: c}
        step = copy_downstream(graph, boundary, outputs, STEP_SCOPE)
    sequence = _sequence_graph(graph, inputs, outputs, state_in, state_out, explore, max_seq_len)
    _self_check(session, inputs, outputs, step, explore, lstm)
    log.info("replaced LSTM loop %s (recurrent %s, activation %s) by a one-step graph", lstm.loop,
             lstm.recurrent_activation, lstm.activation)
    return step, sequence


# ---------------------------------------------------------------------------- finding the loop


def _through_identity(t: tf.Tensor) -> tf.Tensor:
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    return t


def _same(a: tf.Tensor, b: tf.Tensor) -> bool:
    return a.graph is b.graph and a.name == b.name


@dataclass
class _Loop:
    """A while loop seen uniformly for v1 (Enter/Exit frames) and v2 (``While`` + body function).

    ``body``: the body's ops; ``outer``: maps a body tensor that brings in a loop input to that
    outer tensor (else returns it); ``states``: per requested final value, (initial outer tensor,
    body-side value at the start of an iteration, final outer tensor); ``sequence_out``: the
    ``[T, B, n]`` stacked outputs read after the loop.
    """

    name: str
    body: list[tf.Operation]
    outer: Callable[[tf.Tensor], tf.Tensor]
    states: list[tuple[tf.Tensor, tf.Tensor, tf.Tensor]]
    sequence_out: tf.Tensor


def _v1_loop(graph: tf.Graph, finals: Sequence[tf.Tensor]) -> _Loop:
    states, frames = [], set()
    for final in finals:
        switch = final.op.inputs[0].op
        merge = switch.inputs[0].op
        if switch.type != "Switch" or merge.type != "Merge":
            raise ExportError(f"{final.op.name} is not the exit of a while loop variable (Exit <- Switch <- Merge)")
        enter = next((i.op for i in merge.inputs if i.op.type == "Enter"), None)
        if enter is None:
            raise ExportError(f"loop variable {merge.name} has no Enter")
        frames.add(_frame(enter))
        states.append((enter.inputs[0], switch.outputs[1], final))
    if len(frames) != 1:
        raise ExportError(f"the state outputs come from different loops {sorted(frames)}")
    frame = frames.pop()
    body = _v1_body_ops(graph, frame)

    def outer(t: tf.Tensor) -> tf.Tensor:
        t = _through_identity(t)
        return t.op.inputs[0] if t.op.type == "Enter" else t

    written = [outer(op.inputs[0]) for op in body if op.type == "TensorArrayWriteV3"]
    gathers = [op for op in graph.get_operations()
               if op.type == "TensorArrayGatherV3" and op.inputs[2].op.type == "Exit"
               and any(_same(op.inputs[0], w) for w in written)]
    if len(gathers) != 1:
        raise ExportError(f"loop {frame!r} has {len(gathers)} stacked output sequences; exactly one is supported")
    return _Loop(frame, body, outer, states, gathers[0].outputs[0])


def _frame(op: tf.Operation) -> str:
    name = op.get_attr("frame_name")
    return name.decode() if isinstance(name, bytes) else name


def _v1_body_ops(graph: tf.Graph, frame: str) -> list[tf.Operation]:
    """Ops inside the v1 loop ``frame``: forward from its Enter ops up to (not past) its Exits."""
    seen: dict[str, tf.Operation] = {}
    todo = [op for op in graph.get_operations() if op.type == "Enter" and _frame(op) == frame]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen[op.name] = op
        if op.type != "Exit":
            todo.extend(c for t in op.outputs for c in t.consumers())
    return [op for op in seen.values() if op.type != "Exit"]


def _v2_loop(graph: tf.Graph, finals: Sequence[tf.Tensor]) -> _Loop:
    from tensorflow.python.framework import function_def_to_graph

    loops = {t.op.name for t in finals}
    if len(loops) != 1:
        raise ExportError(f"the state outputs come from different loops {sorted(loops)}")
    loop = finals[0].op
    name = loop.get_attr("body").name
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    if name not in library:
        raise ExportError(f"the body {name!r} of loop {loop.name!r} is not in the graph's function library")
    try:
        body_graph = function_def_to_graph.function_def_to_graph(library[name])
    except (ValueError, KeyError, tf.errors.OpError) as e:
        raise ExportError(f"cannot read the body {name!r} of loop {loop.name!r}: {e}") from e
    args = list(body_graph.inputs)
    if len(args) != len(loop.inputs):
        raise ExportError(f"loop {loop.name!r} has {len(loop.inputs)} inputs but its body takes {len(args)}")
    index = {t.name: i for i, t in enumerate(args)}

    def outer(t: tf.Tensor) -> tf.Tensor:
        t = _through_identity(t)
        return loop.inputs[index[t.name]] if t.name in index else t

    states = [(loop.inputs[t.value_index], args[t.value_index], t) for t in finals]
    body = body_graph.get_operations()
    written = {index.get(_through_identity(op.inputs[0]).name) for op in body if op.type == "TensorListSetItem"}
    stacks = []
    for i in sorted(w for w in written if w is not None):
        todo = list(loop.outputs[i].consumers())
        while todo:
            op = todo.pop()
            if op.type == "Identity":
                todo.extend(op.outputs[0].consumers())
            elif op.type == "TensorListStack":
                stacks.append(op.outputs[0])
    if len(stacks) != 1:
        raise ExportError(f"loop {loop.name!r} has {len(stacks)} stacked output sequences; exactly one is supported")
    return _Loop(loop.name, body, outer, states, stacks[0])


def find_loop_lstm(graph: tf.Graph, finals: Sequence[tf.Tensor]) -> LoopLSTM:
    """Identify the LSTM loop whose final values are ``finals`` (h and c, in either order).

    Raises:
        ExportError: the finals are not two values of one while loop whose body is one LSTM cell.
    """
    finals = [_through_identity(t) for t in finals]
    kinds = sorted({t.op.type for t in finals})
    if len(finals) != 2 or kinds not in (["Exit"], ["While"], ["StatelessWhile"]):
        raise ExportError(f"expected two state outputs (h, c) from one while loop, got "
                          f"{[f'{t.op.name} ({t.op.type})' for t in finals]}")
    loop = _v1_loop(graph, finals) if kinds == ["Exit"] else _v2_loop(graph, finals)
    cell = _find_cell(loop)
    recurrent_in = _through_identity(cell["recurrent_matmul"].inputs[0])
    h_index = next((i for i, (_, v, _) in enumerate(loop.states) if _same(_through_identity(v), recurrent_in)), None)
    if h_index is None:
        raise ExportError(f"the cell in loop {loop.name!r} does not multiply a state output with its recurrent kernel")
    (h0, _, h_final), (c0, _, c_final) = loop.states[h_index], loop.states[1 - h_index]
    return LoopLSTM(
        loop=loop.name, inputs_tm=cell["inputs_tm"], mask_tm=cell["mask_tm"], h0=h0, c0=c0,
        h_final=h_final, c_final=c_final, sequence_out=loop.sequence_out,
        kernel=cell["kernel"], recurrent_kernel=cell["recurrent_kernel"], bias=cell["bias"],
        activation=cell["activation"], recurrent_activation=cell["recurrent_activation"],
    )


READS = ("TensorArrayReadV3", "TensorListGetItem")


def _find_cell(loop: _Loop) -> dict:
    """The LSTM cell's ops in the loop body: two MatMuls into one bias add, split in four gates."""
    splits = [op for op in loop.body if op.type == "Split" and len(op.outputs) == 4]
    if len(splits) != 1:
        raise ExportError(f"loop {loop.name!r} holds {len(splits)} four-way gate splits; exactly one (a Keras LSTM "
                          "cell, implementation 2) is supported")
    split = splits[0]
    z = split.inputs[1].op
    if z.type not in ("BiasAdd", "AddV2", "Add"):
        raise ExportError(f"the gates in loop {loop.name!r} come from {z.type} {z.name}, not a bias add")
    summed, bias = z.inputs[0].op, z.inputs[1]
    matmuls = [i.op for i in summed.inputs if i.op.type == "MatMul"] if summed.type in ("AddV2", "Add") else []
    if len(matmuls) != 2:
        raise ExportError(f"the gates in loop {loop.name!r} are not x @ kernel + h @ recurrent_kernel + bias")
    reads = {}
    for mm in matmuls:
        source = _through_identity(mm.inputs[0])
        reads["input" if source.op.type in READS else "state"] = (mm, source)
    if set(reads) != {"input", "state"}:
        raise ExportError(f"the cell in loop {loop.name!r} does not read one input and one state")
    return {
        "inputs_tm": _unstacked(reads["input"][1].op, loop),
        "mask_tm": _mask(split, loop),
        "kernel": _weight(reads["input"][0].inputs[1], loop),
        "recurrent_kernel": _weight(reads["state"][0].inputs[1], loop),
        "recurrent_matmul": reads["state"][0],
        "bias": _weight(bias, loop),
        **_activations(split, loop.name),
    }


def _weight(t: tf.Tensor, loop: _Loop) -> tf.Tensor:
    """The outer variable handle (or value) a weight inside the loop is read from."""
    t = _through_identity(t)
    if t.op.type == "ReadVariableOp":
        t = t.op.inputs[0]
    value = loop.outer(t)
    if value.graph is not loop.states[0][0].graph:
        raise ExportError(f"weight {t.name} of loop {loop.name!r} is not an input of the loop")
    return value


def _unstacked(read_op: tf.Operation, loop: _Loop) -> tf.Tensor:
    """The ``[T, ...]`` outer tensor a read in the loop body takes step ``t`` of (its unstack)."""
    if read_op.type == "TensorArrayReadV3":
        source, want, arg = loop.outer(read_op.inputs[2]), "TensorArrayScatterV3", 2
    else:
        source, want, arg = loop.outer(read_op.inputs[0]), "TensorListFromTensor", 0
    if source.op.type != want:
        raise ExportError(f"{read_op.name} in loop {loop.name!r} reads a list not filled by an unstack "
                          f"({source.op.type})")
    return source.op.inputs[arg]


def _mask(split: tf.Operation, loop: _Loop) -> tf.Tensor | None:
    """The mask the loop selects new/old state with: the bool sequence read for the selects' condition."""
    reads: dict[str, tf.Operation] = {}
    todo, seen = [split], set()
    while todo:
        op = todo.pop()
        if op.name in seen or op.type in ("Exit", "NextIteration", "TensorArrayWriteV3", "TensorListSetItem"):
            continue
        seen.add(op.name)
        if op.type in ("Select", "SelectV2"):
            reads.update({r.name: r for r in _ancestors_of_type(op.inputs[0].op, READS)})
            continue
        todo.extend(c for t in op.outputs for c in t.consumers())
    if len(reads) > 1:
        raise ExportError(f"loop {loop.name!r} selects its state with {len(reads)} different masks")
    return _unstacked(next(iter(reads.values())), loop) if reads else None


def _ancestors_of_type(op: tf.Operation, types: tuple[str, ...], limit: int = 20) -> list[tf.Operation]:
    found, todo, seen = [], [op], set()
    while todo and len(seen) < limit:
        cur = todo.pop()
        if cur.name in seen or cur.type in ("Enter", "Merge", "Placeholder"):
            continue
        seen.add(cur.name)
        if cur.type in types:
            found.append(cur)
            continue
        todo.extend(i.op for i in cur.inputs)
    return found


def _activations(split: tf.Operation, name: str) -> dict[str, str]:
    """Keras gate order i, f, c, o: recurrent_activation on i, f, o; activation on c (and on the new cell)."""
    def act(gate: str, t: tf.Tensor) -> str:
        kinds = {c.type for c in t.consumers()}
        known = kinds & set(ACTIVATIONS)
        if len(known) != 1:
            raise ExportError(f"the LSTM cell in loop {name!r} cannot be rebuilt as one step: its gate {gate} "
                              f"({t.name}) goes into {sorted(kinds)}; supported activations are {sorted(ACTIVATIONS)}")
        return known.pop()

    gates = [act(gate, t) for gate, t in zip("ifco", split.outputs)]
    if not gates[0] == gates[1] == gates[3]:
        raise ExportError(f"the cell in loop {name!r} has gate activations {gates}; i, f and o must agree (Keras LSTM)")
    return {"recurrent_activation": gates[0], "activation": gates[2]}


def find_explore(graph: tf.Graph, outputs: Sequence[tf.Tensor], inputs: Mapping[str, tf.Tensor]) -> tf.Tensor | None:
    """The bool scalar ``PlaceholderWithDefault`` the outputs depend on that is not a signature input
    (RLlib's hidden ``is_exploring``); ``None`` if there is not exactly one."""
    known = {t.op.name for t in inputs.values()}
    found = {op.name: op for op in _ancestors(outputs)
             if op.type == "PlaceholderWithDefault" and op.name not in known
             and op.outputs[0].dtype == tf.bool and op.outputs[0].shape.rank == 0}
    return next(iter(found.values())).outputs[0] if len(found) == 1 else None


# ---------------------------------------------------------------------------- building the step


def _read(t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """A weight's value: read from its variable handle, or the tensor itself."""
    if t.dtype == tf.resource:
        return tf.raw_ops.ReadVariableOp(resource=t, dtype=dtype)
    return t


def _step(lstm: LoopLSTM, seq_lens: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The cell applied once at ``t = 0``; returns (output sequence [1, B, n], h, c)."""
    act, rec = ACTIVATIONS[lstm.activation], ACTIVATIONS[lstm.recurrent_activation]
    with tf1.name_scope(f"{STEP_SCOPE}_cell"):
        x = lstm.inputs_tm[0]
        dtype = lstm.h0.dtype
        z = tf.matmul(x, _read(lstm.kernel, dtype)) + tf.matmul(lstm.h0, _read(lstm.recurrent_kernel, dtype))
        z = tf.nn.bias_add(z, _read(lstm.bias, dtype))
        i, f, g, o = tf.split(z, 4, axis=1)
        c = rec(f) * lstm.c0 + rec(i) * act(g)
        h = rec(o) * act(c)
        if lstm.mask_tm is not None:
            active = tf.reshape(lstm.mask_tm[0], [-1, 1])
        elif seq_lens is not None:
            active = tf.expand_dims(seq_lens > 0, -1)
        else:
            active = tf.ones_like(h[:, :1], tf.bool)
        out = tf.where(active, h, tf.zeros_like(h))
        h = tf.where(active, h, lstm.h0)
        c = tf.where(active, c, lstm.c0)
    return tf.expand_dims(out, 0), h, c


def _ancestors(tensors: Sequence[tf.Tensor]) -> list[tf.Operation]:
    seen: dict[str, tf.Operation] = {}
    todo = [t.op for t in tensors]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen[op.name] = op
        todo.extend(i.op for i in op.inputs)
        todo.extend(op.control_inputs)
    return list(seen.values())


def copy_downstream(graph: tf.Graph, boundary: Mapping[tf.Tensor, tf.Tensor], outputs: Mapping[str, tf.Tensor],
                    scope: str) -> dict[str, tf.Tensor]:
    """Copy the ops between ``boundary`` tensors and ``outputs`` with each boundary tensor replaced.

    Ops not downstream of the boundary are shared, not copied. Returns the outputs keyed as given
    (an output that is a boundary tensor becomes its replacement).

    Raises:
        ExportError: the copy cannot be imported into ``graph``.
    """
    replace = {t.ref(): new for t, new in boundary.items()}
    downstream = _downstream_names(boundary)
    keys = [k for k, t in outputs.items() if t.ref() not in replace]
    copy = [op for op in _ancestors([outputs[k] for k in keys]) if op.name in downstream]
    result = {k: replace[t.ref()] for k, t in outputs.items() if t.ref() in replace}
    if copy:
        graph_def, input_map = _subgraph_def(graph, copy, replace)
        try:
            copied = tf.graph_util.import_graph_def(graph_def, input_map=input_map, name=scope,
                                                    return_elements=[outputs[k].name for k in keys])
        except (ValueError, tf.errors.OpError) as e:
            raise ExportError(f"copying the graph after the loop failed: {e}") from e
        result.update(zip(keys, copied))
    else:
        result.update({k: outputs[k] for k in keys})
    return {k: result[k] for k in outputs}


def _downstream_names(boundary: Mapping[tf.Tensor, tf.Tensor]) -> set[str]:
    """Names of every op that (through data or control edges) depends on a boundary tensor."""
    downstream: set[str] = set()
    todo = [c for t in boundary for c in t.consumers()]
    while todo:
        op = todo.pop()
        if op.name in downstream:
            continue
        downstream.add(op.name)
        todo.extend(c for t in op.outputs for c in t.consumers())
        todo.extend(op._control_outputs)  # noqa: SLF001 - no public accessor
    return downstream


def _subgraph_def(graph: tf.Graph, copy: list[tf.Operation], replace: Mapping) -> tuple[tf1.GraphDef, dict]:
    """A GraphDef of the ``copy`` ops and the input map binding their other inputs to ``graph``'s
    tensors (boundary tensors to their replacements). Control inputs from outside the copy keep
    pointing at the original op; those on ops without outputs (which cannot be mapped) are dropped."""
    names = {op.name for op in copy}
    graph_def = tf1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    input_map: dict[str, tf.Tensor] = {}
    for op in sorted(copy, key=lambda o: o._id):  # noqa: SLF001 - creation order keeps the copy readable
        node = graph_def.node.add()
        node.CopyFrom(op.node_def)
        if "_class" in node.attr:  # colocation with ops that are not copied
            del node.attr["_class"]
        kept = []
        for name in node.input:
            src = name.lstrip("^").split(":")[0]
            if src not in names and name.startswith("^"):
                target = graph.get_operation_by_name(src)
                if not target.outputs:
                    continue
                input_map[name] = target.outputs[0]
            elif src not in names:
                tensor = graph.get_tensor_by_name(name if ":" in name else f"{name}:0")
                input_map[name] = replace.get(tensor.ref(), tensor)
            kept.append(name)
        del node.input[:]
        node.input.extend(kept)
    library = graph.as_graph_def().library
    if any(n.op in {f.signature.name for f in library.function} for n in graph_def.node):
        graph_def.library.CopyFrom(library)
    return graph_def, input_map


# ---------------------------------------------------------------------------- sequence graph, self-check


def _sequence_graph(graph: tf.Graph, inputs: Mapping[str, tf.Tensor], outputs: Mapping[str, tf.Tensor],
                    state_in: Sequence[str], state_out: Sequence[str], explore: tf.Tensor | None,
                    max_seq_len: int) -> SequenceGraph:
    """The original looped graph keyed like the serving signature (``state_in_i``/``state_out_i``)."""
    renamed_in = {k: state_in_key(i) for i, k in enumerate(state_in)}
    renamed_out = {k: state_out_key(i) for i, k in enumerate(state_out)}
    seq_in = {renamed_in.get(k, k): t for k, t in inputs.items()}
    if explore is None:
        with graph.as_default():
            explore = tf1.placeholder_with_default(False, (), name="sequence_explore_unused")
    seq_in[EXPLORE] = explore
    seq_out = {renamed_out.get(k, k): t for k, t in outputs.items()}
    return SequenceGraph(seq_in, seq_out, max_seq_len)


def _self_check(session: tf1.Session, inputs: Mapping[str, tf.Tensor], outputs: Mapping[str, tf.Tensor],
                step: Mapping[str, tf.Tensor], explore: tf.Tensor | None, lstm: LoopLSTM, rows: int = 3) -> None:
    """One step through the loop and through the step graph on random inputs must agree."""
    rng = np.random.default_rng(0)
    feeds = {}
    for key, t in inputs.items():
        if t.op.type == "PlaceholderWithDefault":
            continue
        shape = [rows if d is None else d for d in t.shape.as_list()] if t.shape.rank is not None else [rows]
        dtype = t.dtype.as_numpy_dtype
        if key == SEQ_LENS:
            feeds[t] = np.ones(shape, dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[t] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[t] = np.zeros(shape, dtype)
    if explore is not None:
        feeds[explore] = False
    keys = [k for k in outputs if outputs[k].dtype.is_floating or outputs[k].dtype.is_integer]
    try:
        ref = session.run([outputs[k] for k in keys], feeds)
        got = session.run([step[k] for k in keys], feeds)
    except tf.errors.OpError as e:
        raise ExportError(f"running the one-step graph for loop {lstm.loop!r} failed: {e.message}") from e
    bad = [(k, _max_error(a, b)) for k, a, b in zip(keys, ref, got) if _max_error(a, b) > SELF_CHECK_ATOL]
    if bad:
        raise ExportError(f"the one-step graph does not reproduce loop {lstm.loop!r} (max errors {bad}); its cell "
                          f"is not a standard Keras LSTM cell ({lstm.recurrent_activation}/{lstm.activation})")


def _max_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0)) if a.shape == b.shape else float("inf")


def rewrite_serving(serving: RecurrentServing) -> RecurrentServing:
    """:func:`one_step_outputs` on convert's recurrent serving tensors (keys ``state_in_i``/``state_out_i``).

    ``serving`` has ``session``, ``inputs`` and ``outputs`` (and a ``sequence_graph`` field);
    returns a copy with the one-step outputs and the looped graph as ``sequence_graph``, or
    ``serving`` itself when its state comes from no loop.

    Raises:
        ExportError: see :func:`one_step_outputs`.
    """
    state_in = sorted((k for k in serving.inputs if is_state_in(k)), key=lambda k: int(k.rsplit("_", 1)[1]))
    state_out = [state_out_for(k) for k in state_in]
    outputs, sequence = one_step_outputs(serving.session, serving.inputs, serving.outputs, state_in, state_out,
                                         explore=serving.inputs.get(EXPLORE))
    if sequence is None:
        return serving
    return replace(serving, outputs=outputs, sequence_graph=sequence)
