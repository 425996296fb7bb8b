"""The frozen inference GraphDef (variables folded into constants) the ONNX model is made from."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tensorflow as tf

from policy_export.exporter.context import ExportContext, FormatRecord
from policy_export.exporter.devices import DevicePlan
from policy_export.exporter.trust import check_graph_def
from policy_export.policy.errors import ExportError, InputError
from policy_export.policy.tf_policy import session_config

tf1 = tf.compat.v1
FILENAME = "frozen_graph.pb"


def freeze(policy, signature) -> tf1.GraphDef:
    """Fold the session's variables into constants, keeping only what the outputs need."""
    output_nodes = sorted({t.op.name for t in signature.outputs.values()})
    try:
        with policy.graph.as_default():
            return tf1.graph_util.convert_variables_to_constants(
                policy.session, policy.graph.as_graph_def(), output_nodes
            )
    except (tf.errors.OpError, ValueError, AssertionError) as e:
        raise ExportError(f"freezing the policy graph failed: {e}") from e


def write(ctx: ExportContext, target: Path) -> FormatRecord:
    """Write the frozen GraphDef to ``target``."""
    graph_def = ctx.frozen_graph_def()
    target.write_bytes(graph_def.SerializeToString())
    present = {n.name for n in graph_def.node}
    kept = [k for k, t in ctx.signature.inputs.items() if t.op.name in present]
    return FormatRecord("frozen_graph", (target.name,), {"nodes": len(graph_def.node), "inputs_kept": kept})


class FrozenGraphRunner:
    """Imports a frozen GraphDef and runs it by signature key (tensor names from the manifest)."""

    def __init__(self, path: Path, tensor_names: Mapping[str, Mapping[str, str]], device: DevicePlan):
        graph_def = tf1.GraphDef()
        try:
            graph_def.ParseFromString(path.read_bytes())
        except Exception as e:  # protobuf raises its own DecodeError
            raise ExportError(f"{path} is not a serialized GraphDef: {e}") from e
        check_graph_def(graph_def, str(path))  # before any of its ops can run
        self.graph = tf.Graph()
        with self.graph.as_default(), tf.device(device.tf_device):
            tf.graph_util.import_graph_def(graph_def, name="")
        self.session = tf1.Session(graph=self.graph, config=session_config(device.tf_device))
        present = {op.name for op in self.graph.get_operations()}
        self.signature_inputs = set(tensor_names["inputs"])
        # inputs that no output depends on were pruned by freezing; feeding them changes nothing
        self.inputs = {k: self.graph.get_tensor_by_name(n) for k, n in tensor_names["inputs"].items()
                       if n.split(":")[0] in present}
        self.outputs = {k: self.graph.get_tensor_by_name(n) for k, n in tensor_names["outputs"].items()}

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        unknown = sorted(set(feeds) - self.signature_inputs)
        if unknown:
            raise InputError(f"frozen graph has no input(s) {unknown}")
        feed_dict = {self.inputs[k]: v for k, v in feeds.items() if k in self.inputs}
        values = self.session.run(self.outputs, feed_dict)
        return {k: np.asarray(v) for k, v in values.items()}

    def close(self) -> None:
        self.session.close()


def load(export_dir: Path, tensor_names: Mapping[str, Mapping[str, str]], device: DevicePlan) -> FrozenGraphRunner:
    """A runner over ``export_dir/frozen_graph.pb``."""
    return FrozenGraphRunner(export_dir / FILENAME, tensor_names, device)
