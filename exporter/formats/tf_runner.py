"""One runner for both TensorFlow formats: a graph in its own session, run by signature key.

The SavedModel and the frozen graph differ only in how the graph gets into the session and where
the key -> tensor mapping comes from (the SavedModel's signature, or the manifest's tensor names);
:class:`TFGraphRunner` is built by :meth:`~TFGraphRunner.from_saved_model` or
:meth:`~TFGraphRunner.from_graph_def` and runs the same way after that. Both check the model's ops
(:mod:`exporter.trust`) before anything of it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tensorflow as tf

from policy_export.exporter.devices import DevicePlan
from policy_export.exporter.formats.runner import HeadUnavailable, Runner, TensorMeta
from policy_export.exporter.trust import (  # noqa: F401 (glob_free_path: re-exported)
    check_graph_def, glob_free_path, open_saved_model, read_graph_def,
)
from policy_export.exporter.watchdog import RunTimeoutError, current_limit, run_stoppable, stoppable_session
from policy_export.errors import ExportError
from policy_export.policy.graph import session_config
from policy_export.signatures.builder import SERVING_KEY, find_signature
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB, EXPLORE, is_action

tf1 = tf.compat.v1
SERVING_TAG = tf1.saved_model.tag_constants.SERVING



LARGE_CONSTANT = 1 << 20  # bytes: constants at least this large are fed rather than built into the session


def _aligned(value: np.ndarray, alignment: int = 64) -> np.ndarray:
    """``value`` in a buffer aligned as TensorFlow wants it, so feeding it copies nothing."""
    raw = np.empty(value.nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    out = raw[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


def _lift_large_constants(graph_def) -> dict[str, np.ndarray]:
    """Turn each ``Const`` node of at least :data:`LARGE_CONSTANT` bytes into a placeholder of its
    dtype and shape, and return its value (name -> array) to be fed on every run.

    A TensorFlow session keeps several copies of every constant it is given (the graph it was
    built from, its own graph, the kernels' tensors); fed, the file's weights are held once. The
    values are the file's own, so the graph computes what it computes with them built in."""
    lifted = {}
    for node in graph_def.node:
        if node.op != "Const" or node.attr["value"].tensor.ByteSize() < LARGE_CONSTANT:
            continue
        value = tf.make_ndarray(node.attr["value"].tensor)
        lifted[node.name] = _aligned(value)
        del value
        dtype = node.attr["dtype"].type
        node.op = "Placeholder"
        node.ClearField("attr")
        node.attr["dtype"].type = dtype
        node.attr["shape"].shape.CopyFrom(tf.TensorShape(lifted[node.name].shape).as_proto())
    return lifted


def _meta(key: str, tensor: tf.Tensor) -> TensorMeta:
    shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else None
    return TensorMeta(key, np.dtype(tensor.dtype.as_numpy_dtype).name, shape)


class TFGraphRunner(Runner):
    """A TF graph in its own session, fed and fetched by signature key.

    ``accepted``: signature inputs the graph no longer holds (freezing prunes inputs no output
    depends on); feeding them is allowed and changes nothing.
    """

    def __init__(self, graph: tf.Graph, session, inputs: Mapping[str, tf.Tensor], outputs: Mapping[str, tf.Tensor],
                 label: str, accepted: frozenset[str] = frozenset(), contract: Contract | None = None):
        self.graph, self.session, self.label, self.contract = graph, session, label, contract
        self.input_tensors = dict(inputs)
        self.output_tensors = dict(outputs)
        self.inputs = {k: _meta(k, t) for k, t in inputs.items()}
        self.outputs = {k: _meta(k, t) for k, t in outputs.items()}
        self.accepted = frozenset(accepted)

    @classmethod
    def from_saved_model(cls, path: Path, device: DevicePlan, signature_key: str = SERVING_KEY,
                         tags=(SERVING_TAG,), contract: Contract | None = None) -> "TFGraphRunner":
        """Load the signature's part of the SavedModel from one read of its file, after its ops are
        checked (:func:`exporter.trust.open_saved_model`: the restore and init ops keep the run
        limit and stop on signals, as every later run does).

        Raises:
            UnsafeModelError: the SavedModel holds an op that may not be loaded (nothing is run).
            RunTimeoutError: the restore or init op did not finish within the run limit.
            ExportError: not a loadable SavedModel, or no such signature.
        """
        # the whole meta graph, as TF's loader would
        loaded = open_saved_model(path, tag=list(tags)[0], device=device.tf_device)
        graph, session = loaded.graph, loaded.session
        try:
            sig = find_signature(loaded.meta, signature_key, str(path))
        except ExportError:
            session.close()
            raise
        inputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.inputs.items()}
        outputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.outputs.items()}
        return cls(graph, session, inputs, outputs, f"SavedModel {path}", contract=contract)

    @classmethod
    def from_graph_def(cls, path: Path, tensor_names: Mapping[str, Mapping[str, str]], device: DevicePlan,
                       contract: Contract | None = None) -> "TFGraphRunner":
        """Parse and check a frozen GraphDef (:func:`exporter.trust.check_graph_def`), then import it;
        ``tensor_names`` (the manifest's) maps signature keys to its tensors.

        Raises:
            UnsafeModelError: the graph holds an op that may not be loaded.
            ExportError: not a serialized GraphDef, or a tensor named in ``tensor_names`` is missing.
        """
        graph_def = read_graph_def(path)  # no link, a regular file, its size capped before parsing
        check_graph_def(graph_def, str(path))  # before any of its ops can run
        constants = _lift_large_constants(graph_def)
        graph = tf.Graph()
        try:
            with graph.as_default(), tf.device(device.tf_device):
                tf.graph_util.import_graph_def(graph_def, name="")
            present = {op.name for op in graph.get_operations()}
            inputs = {k: graph.get_tensor_by_name(n) for k, n in tensor_names["inputs"].items()
                      if n.split(":")[0] in present}
            outputs = {k: graph.get_tensor_by_name(n) for k, n in tensor_names["outputs"].items()}
        except (ValueError, KeyError, tf.errors.OpError) as e:
            raise ExportError(f"{path} does not hold the export's signature tensors: {e}") from e
        del graph_def
        config = session_config(device.tf_device)
        # grappler rewrites the GraphDef pass after pass, each copy holding every folded weight:
        # for a frozen graph that costs many times the weights in memory and computes nothing new
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        session = stoppable_session(graph, config, f"frozen graph {path}")
        pruned = frozenset(tensor_names["inputs"]) - set(inputs)
        runner = cls(graph, session, inputs, outputs, f"frozen graph {path}", accepted=pruned, contract=contract)
        runner._constants = {graph.get_tensor_by_name(f"{name}:0"): value for name, value in constants.items()}
        return runner

    def head(self):
        return tf_head(self.session, self.input_tensors, self.output_tensors)

    _constants: dict = {}

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed_dict = {self.input_tensors[k]: v for k, v in feeds.items() if k in self.input_tensors}
        feed_dict.update(self._constants)
        # the session keeps the deadline itself (timeout_in_ms cancels the step, While loops included);
        # on a signal the session is closed, which cancels the running step
        limit = self.run_timeout or current_limit()
        options = tf1.RunOptions(timeout_in_ms=max(1, int(limit * 1000)))
        try:
            # the file's session watches its own runs; here this runner's limit and watch hold instead
            run = getattr(self.session, "unwatched_run", self.session.run)
            values = self.stoppable(lambda: run(self.output_tensors, feed_dict, options=options),
                                    self.session.close)
        except tf.errors.DeadlineExceededError as e:
            raise RunTimeoutError(self.label, limit) from e
        return {k: np.asarray(v) for k, v in values.items()}

    def _close(self) -> None:
        self.session.close()
        self._constants = {}


def tf_head(session, inputs: Mapping[str, tf.Tensor], outputs: Mapping[str, tf.Tensor]):
    """The action head of a TF graph: feed the ``action_dist_inputs`` tensor itself (a session may
    be fed any tensor) and ``explore``, fetch the actions and ``action_logp``/``action_prob``.
    ``None`` without those tensors; :class:`HeadUnavailable` when the actions need other inputs."""
    dist, explore = outputs.get(ACTION_DIST_INPUTS), inputs.get(EXPLORE)
    fetch = {k: t for k, t in outputs.items() if is_action(k) or k in (ACTION_LOGP, ACTION_PROB)}
    if dist is None or explore is None or not any(is_action(k) for k in fetch):
        return None

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        limit = current_limit()  # the head runs under the same deadline as every runtime call
        options = tf1.RunOptions(timeout_in_ms=max(1, int(limit * 1000)))
        feed_dict = {dist: feeds[ACTION_DIST_INPUTS], explore: feeds[EXPLORE]}
        try:
            run_ = getattr(session, "unwatched_run", session.run)  # watched here, not twice
            values = run_stoppable(lambda: run_(fetch, feed_dict, options=options), "TF action head")
        except tf.errors.DeadlineExceededError as e:
            raise RunTimeoutError("TF action head", limit) from e
        except tf.errors.InvalidArgumentError as e:  # a placeholder the head needs was not fed
            raise HeadUnavailable(str(e).splitlines()[0]) from None
        return {k: np.asarray(v) for k, v in values.items()}

    return run
