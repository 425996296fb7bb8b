"""``saved_model``: a TF SavedModel (tag ``serve``, signature ``serving_default``) of the policy session."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from policy_export.exporter.formats.base import Capabilities, ExportContext, Format, FormatRecord
from policy_export.errors import ExportError, InputError

if TYPE_CHECKING:
    from policy_export.signatures.contract import Contract

TAG = "serve"  # tf.saved_model.SERVING


class SavedModelFormat(Format):
    name = "saved_model"
    path = "saved_model"
    order = 10
    is_directory = True
    capabilities = Capabilities(reference=True)

    def write(self, ctx, target: Path):
        return write_saved_model(ctx, target)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.tf_runner import TFGraphRunner
        from policy_export.signatures.contract import Contract

        return TFGraphRunner.from_saved_model(path, device, contract=Contract.from_json(manifest["contract"]))

    inspect_order = 40
    inspect_description = "a SavedModel directory"
    inspect_needs_tensorflow = True

    def find_model(self, path: Path) -> Path | None:
        return path if path.is_dir() and (path / "saved_model.pb").is_file() else None

    def read_contract(self, found: Path, signature_key: str = "serving_default", tag: str = TAG):
        return saved_model_contract(found, signature_key, tag)

    def check_candidate(self, path: Path) -> None:
        if not (path / "saved_model.pb").is_file():
            raise InputError(f"candidate {self.name}={path}: not a SavedModel directory (no saved_model.pb)")
        from policy_export.exporter.formats.base import refuse_links

        refuse_links(self.name, path)  # a linked variables/ would be restored from outside the candidate


FORMAT = SavedModelFormat()


def write_saved_model(ctx: ExportContext, target: Path) -> FormatRecord:
    """Write the policy's graph and variables with the ``serving_default`` signature to ``target``
    (tag ``serve``); it is run by :class:`exporter.formats.tf_runner.TFGraphRunner`."""
    import tensorflow as tf

    from policy_export.signatures.builder import SERVING_KEY

    tf1 = tf.compat.v1
    policy = ctx.policy
    try:
        with policy.graph.as_default():
            signatures = ctx.signature.signature_def_map()
            if policy.is_recurrent:
                signatures[INITIAL_STATE_KEY] = _initial_state_signature(policy)
            builder = tf1.saved_model.Builder(str(target))
            builder.add_meta_graph_and_variables(policy.session, [TAG], signature_def_map=signatures,
                                                 strip_default_attrs=True)
            builder.save()
    except (tf.errors.OpError, OSError, ValueError) as e:
        raise ExportError(f"writing the SavedModel to {target} failed: {e}") from e
    return FormatRecord("saved_model", (target.name,), {"tags": [TAG], "signature": SERVING_KEY})


INITIAL_STATE_KEY = "get_initial_state"  # the recurrent policy's start state, as TF-Agents' PolicySaver names it


def _initial_state_signature(policy):
    """``get_initial_state``: ``batch_size`` (int32 scalar) in, each ``state_in_<i>`` as an episode
    starts (the policy's initial state, one row per batch entry) out; added to the policy's graph
    (the serving signature and the formats made from it do not reach it)."""
    import tensorflow as tf

    from policy_export.signatures.keys import state_in_key

    tf1 = tf.compat.v1
    build = tf1.saved_model.utils.build_tensor_info
    with tf1.name_scope(INITIAL_STATE_KEY):
        batch = tf1.placeholder(tf.int32, (), name="batch_size")
        outputs = {}
        for i, start in enumerate(policy.get_initial_state()):
            row = tf.constant(start[None])
            outputs[state_in_key(i)] = build(tf.tile(row, tf.concat([[batch], tf.ones([start.ndim], tf.int32)], 0)))
    return tf1.saved_model.signature_def_utils.build_signature_def(
        inputs={"batch_size": build(batch)}, outputs=outputs,
        method_name=tf1.saved_model.signature_constants.PREDICT_METHOD_NAME)


def saved_model_meta_graph(path: Path, tag: str, signature_key: str = "serving_default"):
    """The meta graph of the SavedModel at ``path`` tagged ``tag``, pruned to what
    ``signature_key``, the restore op and the init op need, and checked
    (:func:`exporter.trust.check_meta_graph`); ``saved_model.pb`` is read once, with
    :func:`exporter.trust.read_saved_model`.

    Raises:
        ExportError: unreadable, no meta graph tagged ``tag``, or no such signature.
        UnsafeModelError: the pruned graph holds an op that may not be loaded.
    """
    from policy_export.exporter.trust import (
        check_meta_graph, prune_to_serving, read_saved_model, saved_model_budget, select_meta_graph,
    )

    proto = read_saved_model(path)
    meta = prune_to_serving(select_meta_graph(proto, tag, str(path)), signature_key, str(path))
    check_meta_graph(meta, str(path), budget=saved_model_budget(path))
    return meta


def saved_model_contract(path: Path, signature_key: str = "serving_default", tag: str = "serve") -> Contract:
    """A SavedModel signature's contract, read from the proto (no variables are loaded).

    Inputs fed through ``PlaceholderWithDefault`` are optional, with their constant default.
    """
    import numpy as np
    import tensorflow as tf

    from policy_export.signatures.builder import find_signature
    from policy_export.signatures.contract import Contract, TensorSpec, json_default

    meta = saved_model_meta_graph(path, tag, signature_key)

    sig = find_signature(meta, signature_key, str(path))
    nodes = {n.name: n for n in meta.graph_def.node}

    def spec(key: str, info, is_input: bool) -> TensorSpec:
        try:
            tf_dtype = tf.dtypes.as_dtype(info.dtype)
            if tf_dtype in (tf.resource, tf.variant):
                raise TypeError(f"{tf_dtype.name} is a handle, not a tensor of values")
            dtype = np.dtype(tf_dtype.as_numpy_dtype).name
        except (TypeError, ValueError) as e:
            raise ExportError(f"{path}: signature {signature_key!r} {key!r} has dtype {info.dtype}: {e}") from e
        shape = () if info.tensor_shape.unknown_rank else tuple(
            None if d.size < 0 else int(d.size) for d in info.tensor_shape.dim)
        node = nodes.get(info.name.split(":")[0])
        if is_input and node is not None and node.op == "PlaceholderWithDefault":
            const = nodes.get(node.input[0].split(":")[0])
            if const is not None and const.op == "Const":
                value = tf.make_ndarray(const.attr["value"].tensor)
                return TensorSpec(key, dtype, shape, required=False, default=json_default(value))
        return TensorSpec(key, dtype, shape)

    return Contract(inputs=tuple(spec(k, v, True) for k, v in sorted(sig.inputs.items())),
                    outputs=tuple(spec(k, v, False) for k, v in sorted(sig.outputs.items())),
                    method=sig.method_name, signature_key=signature_key)
