"""``frozen_graph``: the frozen inference GraphDef, variables folded into constants; run by the
manifest's tensor names."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.exporter.protowire import field, header


class FrozenGraphFormat(Format):
    name = "frozen_graph"
    path = "frozen_graph.pb"
    order = 20
    capabilities = Capabilities(reference=True, localises=True)

    def write(self, ctx, target: Path):
        return write_frozen_graph(ctx, target)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.tf_runner import TFGraphRunner
        from policy_export.signatures.contract import Contract

        return TFGraphRunner.from_graph_def(path, manifest["tensor_names"], device,
                                            contract=Contract.from_json(manifest["contract"]))


FORMAT = FrozenGraphFormat()


def write_frozen_graph(ctx, target: Path):
    """Write the frozen GraphDef to ``target``.

    The graph is the weightless skeleton (:func:`exporter.tfgraph.skeleton`) with each variable
    placeholder written as a constant holding the session's value, streamed node by node
    (:func:`stream_graph_def`): one variable's bytes in memory at a time, not a GraphDef holding
    every weight and then its serialisation. A graph the skeleton cannot stand for is frozen by
    TensorFlow's converter instead; the file is the same GraphDef either way.
    """
    from policy_export.exporter.formats.base import FormatRecord
    from policy_export.exporter.tfgraph import NoSkeleton, skeleton

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


def _const_node(name: str, dtype: int, value):
    """The GraphDef ``node`` field of a ``Const`` node holding ``value``, as byte chunks whose last
    is the array's own buffer (nothing copies the weights; protobuf allows fields in any order).

    NodeDef{name, op, attr{"dtype"}, attr{"value": AttrValue{tensor: TensorProto{dtype, shape,
    tensor_content}}}}, with ``tensor_content`` written last at every level."""
    import tensorflow as tf

    head = tf.compat.v1.NodeDef(name=name, op="Const")
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


def stream_graph_def(graph_def, target: Path, constants=None) -> int:
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
