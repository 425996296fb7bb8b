"""Convert a Keras base-model SavedModel (RLlib >= 2.1 ``policy.export_model``) into a full export.

Such a SavedModel holds the policy's base network alone: ``observations -> fc_out, value_out``
(names vary), no actions. The action head is not stored, so the action space must be given; the
package then puts the spec policies' distributions on the model's distribution inputs
(:class:`policy.distributions.ActionDistribution`), with the meanings of RLlib's own policy, so
that the export computes what RLlib's ``compute_actions`` returns: argmax or the Gaussian mean
(unclipped, in the space the graph sees) with ``action_logp`` 0 and ``action_prob`` 1 when
``explore`` is false; a sample and its log-probability when it is true. The deterministic path
(``model_deterministic.onnx``) has the same meaning.

The SavedModel is read as a TF1 graph in a session, its variables folded into constants, Keras's
function calls inlined (grappler), and that frozen graph imported under the name scope
``base_model`` with the observation input mapped to fresh placeholders. The resulting graph holds
no variables and runs the same way on every TensorFlow the package supports.

The observation space (for parity sampling) is inferred from the input as ``Box(-1, 1)`` unless
given. A given Box of the input's shape is used as it is; any other space (the environment's
Dict, Tuple, Discrete...) is flattened in the graph as RLlib's default preprocessor does
(Discrete and MultiDiscrete one-hot, Box and MultiBinary flattened, leaves in gymnasium's order),
so the export takes raw environment observations, one input per leaf (``observations/<key>``).

Which output holds the distribution inputs: the one named with ``dist_inputs``, else the single
output whose width is what the action distribution needs (2 for Discrete(2), ``2 * size`` for a
Box); every other output stays an extra output under the model's own key (``value_out``).
Recurrent base models are refused: RLlib's Keras export of an LSTM policy holds only the network
before the LSTM.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import ExportError
from policy_export.signatures.builder import find_signature
from policy_export.signatures.keys import ACTION_DIST_INPUTS, OBSERVATIONS

log = logging.getLogger(__name__)
ACTION_KEY = re.compile(r"actions(_\d+)?")
RECURRENT_HINT = re.compile(r"state|seq_lens|seq_in|prev_action|prev_reward", re.IGNORECASE)


def signature_outputs(path: str | Path, signature_key: str = "serving_default", tag: str = "serve",
                      proto: Any = None) -> list[str] | None:
    """The output keys of ``signature_key`` read from ``saved_model.pb`` (no variables loaded) with
    :func:`exporter.trust.read_saved_model`, or from its already-read ``proto``.

    Returns None when the file holds no meta graph with ``tag`` or no such signature.

    Raises:
        ExportError: ``saved_model.pb`` is missing or not a SavedModel proto.
    """
    from policy_export.exporter.trust import read_saved_model

    proto = read_saved_model(path) if proto is None else proto
    for meta in proto.meta_graphs:
        if tag in meta.meta_info_def.tags and signature_key in meta.signature_def:
            return list(meta.signature_def[signature_key].outputs)
    return None


def is_keras_base_model(path: str | Path, signature_key: str = "serving_default", tag: str = "serve",
                        proto: Any = None) -> bool:
    """True when the signature has outputs but none named ``actions``/``actions_i``: a base model.

    False when ``path`` holds no ``saved_model.pb`` (the caller reports that). ``proto``: the
    SavedModel already read.
    """
    if proto is None and not (Path(path) / "saved_model.pb").is_file():
        return False
    outputs = signature_outputs(path, signature_key, tag, proto)
    return bool(outputs) and not any(ACTION_KEY.fullmatch(k) for k in outputs)


def select_dist_inputs(outputs: dict[str, Any], width: int, key: str | None, action_space: gym.Space) -> str:
    """The output key that holds the distribution inputs (``outputs`` maps key -> static shape list).

    Raises:
        ExportError: ``key`` is not an output or has the wrong width; no output, or several, of
            the width the action distribution needs.
    """
    def describe() -> str:
        return ", ".join(f"{k} {_fmt(s)}" for k, s in sorted(outputs.items()))

    def fits(shape) -> bool:
        return shape is not None and len(shape) >= 2 and shape[-1] == width and all(d == 1 for d in shape[1:-1])

    if key is not None:
        if key not in outputs:
            raise ExportError(f"--dist-inputs {key!r} is not an output of the model; outputs: {describe()}")
        shape = outputs[key]
        if not fits(shape):
            raise ExportError(f"output {key!r} {_fmt(shape)} cannot hold the distribution inputs of {action_space}: "
                              f"they need shape [batch, {width}] (or [batch, 1, 1, {width}] from a conv net)")
        return key
    candidates = sorted(k for k, s in outputs.items() if fits(s))
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ExportError(
            f"no output of the model has the width {width} that the distribution of {action_space} needs; "
            f"outputs: {describe()}. Check --action-space (a Box of k values needs 2k: mean and log_std); "
            f"note that RLlib's Keras model of an LSTM policy holds only the network before the LSTM and "
            f"cannot be served")
    raise ExportError(f"several outputs have the distribution width {width}: {', '.join(candidates)}; "
                      f"name the one holding the distribution inputs with --dist-inputs KEY")


def _fmt(shape: list | None) -> str:
    if shape is None:
        return "[unknown rank]"
    return "[" + ", ".join("batch" if d is None else str(d) for d in shape) + "]"


def load_keras_policy(path: str | Path, action_space: gym.Space, *, observation_space: gym.Space | None = None,
                      dist_inputs: str | None = None, signature_key: str = "serving_default", tag: str = "serve",
                      device: str = "auto", proto: Any = None) -> tuple[Any, dict[str, str]]:
    """Load a Keras base-model SavedModel and put the package's action head on it.

    Only what the signature, the restore op and the init op need is checked and handed to
    TensorFlow (see :func:`_frozen_base_model`); ``proto`` is the SavedModel already read.

    Returns:
        ``(policy, key_mapping)``: a :class:`policy.TFPolicy` and, for the manifest, new key ->
        the model's own key (``action_dist_inputs`` -> ``fc_out``...).
    Raises:
        ExportError: not a loadable SavedModel, a recurrent or multi-input model, no (or an
            ambiguous) distribution-input output.
        InputError: an observation space that does not fit the model's input.
        UnsupportedSpaceError: an action space the package cannot serve.
    """
    import tensorflow as tf

    from policy_export.exporter.devices import plan_devices
    from policy_export.policy.distributions import SUPPORTED_ACTION_SPACES, ActionDistribution
    from policy_export.signatures.keys import clean_key
    from policy_export.exporter.sources.rllib import observation_space_for
    from policy_export.policy.spaces import check_supported

    check_supported(action_space, "action_space", SUPPORTED_ACTION_SPACES)
    path = Path(path)
    plan = plan_devices(device)
    graph_def, sig = _frozen_base_model(path, signature_key, tag, plan.tf_device, proto)
    (in_key, in_info), = _single_input(sig, path)
    out_shapes = {k: _shape_of(v) for k, v in sig.outputs.items()}
    width = ActionDistribution.required_inputs(action_space)
    dist_key = select_dist_inputs(out_shapes, width, dist_inputs, action_space)
    in_shape, in_dtype = _shape_of(in_info), tf.dtypes.as_dtype(in_info.dtype)
    obs_space, flatten = observation_space_for(observation_space, in_shape, in_dtype.as_numpy_dtype)
    policy = _build_policy(path, graph_def, sig, in_info, dist_key, (obs_space, flatten), action_space,
                           plan.tf_device)
    mapping = {OBSERVATIONS: in_key, ACTION_DIST_INPUTS: dist_key}
    mapping.update({clean_key(k): k for k in sig.outputs if k != dist_key})
    mapping = {new: old for new, old in mapping.items() if new != old}
    log.info("converted Keras base model %s: distribution inputs %r, extra outputs %s", path, dist_key,
             [k for k in sig.outputs if k != dist_key])
    return policy, mapping


def _frozen_base_model(path: Path, signature_key: str, tag: str, device: str | None, proto: Any = None):
    """The SavedModel's signature and its graph with variables folded into constants.

    The meta graph is pruned to what the signature, the saver's restore op and the init op need
    (:func:`exporter.trust.prune_to_serving`), checked, and only that is imported; the variables
    are restored by the saver's own restore op from ``path/variables/variables``, then the init
    op runs: what ``tf1.saved_model.loader.load`` does, on the pruned graph.
    """
    from policy_export.exporter.tfgraph import freeze_session
    from policy_export.exporter.trust import open_saved_model

    if proto is None and not (path / "saved_model.pb").is_file():
        raise ExportError(f"{path} is not a SavedModel directory (no saved_model.pb); note that RLlib's "
                          f"export_model writes an empty folder for LSTM policies")
    loaded = open_saved_model(path, tag=tag, signature_key=signature_key, device=device, proto=proto)
    with loaded.session as session:
        sig = find_signature(loaded.meta, signature_key, str(path))
        names = sorted({v.name.split(":")[0] for v in sig.outputs.values()})
        frozen = freeze_session(session, names, what=f"the variables of {path}")
    inputs = [v.name.split(":")[0] for v in sig.inputs.values()]
    return _inline_functions(frozen, inputs + names), sig


def _inline_functions(graph_def, keep: list[str]):
    """``graph_def`` with its function calls (Keras's ``StatefulPartitionedCall``) inlined by grappler.

    ONNX converters and the frozen-graph format need plain ops; the call nodes' names survive as
    ``IdentityN`` nodes, so ``name:i`` still names each output.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    if not graph_def.library.function:
        return graph_def
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.optimizers[:] = ["function"]
    config.graph_options.rewrite_options.min_graph_nodes = -1
    with tf.Graph().as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph_def=graph_def)
    fetch = meta_graph_pb2.CollectionDef()
    fetch.node_list.value.extend(keep)
    meta.collection_def["train_op"].CopyFrom(fetch)
    try:
        inlined = tf_optimizer.OptimizeGraph(config, meta)
    except Exception as e:  # grappler raises plain errors from C++
        raise ExportError(f"inlining the Keras model's functions failed: {e}") from e
    calls = [n.name for n in inlined.node if n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    if calls:
        raise ExportError(f"the Keras model's function calls {calls} could not be inlined")
    return inlined


def _single_input(sig, path: Path):
    inputs = dict(sig.inputs)
    recurrent = sorted(k for k in list(inputs) + list(sig.outputs) if RECURRENT_HINT.search(k))
    if recurrent:
        raise ExportError(f"{path} looks recurrent ({', '.join(recurrent)}): the Keras route serves feed-forward "
                          f"base models only; export a recurrent RLlib policy with from_rllib(policy) instead")
    if len(inputs) != 1:
        raise ExportError(f"{path} has {len(inputs)} inputs {sorted(inputs)}; the Keras route takes base models "
                          f"with one observation input (RLlib flattens Dict observations into one)")
    return list(inputs.items())


def _shape_of(info) -> list | None:
    if info.tensor_shape.unknown_rank:
        return None
    return [None if d.size < 0 else int(d.size) for d in info.tensor_shape.dim]


def _build_policy(path: Path, graph_def, sig, in_info, dist_key: str, observation: tuple[gym.Space, bool],
                  action_space: gym.Space, device: str | None):
    """The policy around the frozen base model: ``observation`` is the space the export takes and
    whether it is flattened into the model's one input; the action head is the package's own."""
    import tensorflow as tf

    from policy_export.signatures.keys import clean_key
    from policy_export.exporter.sources.rllib import observation_inputs
    from policy_export.policy.head import action_head
    from policy_export.policy.tf_policy import (
        ACTION_DIST_INPUTS, EXPLORE, IS_TRAINING, TIMESTEP, TFPolicy,
        session_config,
    )

    tf1 = tf.compat.v1
    obs_space, flatten = observation
    out_keys = list(sig.outputs)
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        tf1.set_random_seed(0)  # sampled actions: the same export verdict on every run
        obs, model_in = observation_inputs(obs_space, flatten, tf.dtypes.as_dtype(in_info.dtype))
        explore = tf1.placeholder_with_default(False, (), name=EXPLORE)
        is_training = tf1.placeholder_with_default(False, (), name=IS_TRAINING)
        timestep = tf1.placeholder_with_default(np.int64(0), (), name=TIMESTEP)
        try:
            values = tf.graph_util.import_graph_def(
                graph_def, input_map={in_info.name: model_in}, name="base_model",
                return_elements=[sig.outputs[k].name for k in out_keys])
        except (ValueError, tf.errors.OpError) as e:
            raise ExportError(f"cannot import the frozen graph of {path}: {e}") from e
        outputs = dict(zip(out_keys, values))
        # RLlib's vision nets end in a 1x1 conv: [batch, 1, 1, n], squeezed by the model's forward()
        width = outputs[dist_key].shape[-1]
        dist_inputs = tf.reshape(outputs[dist_key], (-1, width), name=ACTION_DIST_INPUTS)
        extras = {clean_key(k): tf.identity(t, name=f"extra/{clean_key(k)}") for k, t in outputs.items()
                  if k != dist_key}
        # RLlib's meanings: unclipped actions; the log-probability of a sample, 0 for the
        # deterministic action
        head = action_head(action_space, dist_inputs, explore, clip=False, logp="sampled", extra=extras)
    session = tf1.Session(graph=graph, config=session_config(device))
    return TFPolicy(
        obs_space, action_space, session, observations=obs, sampled_action=head.actions,
        action_logp=head.action_logp, action_dist_inputs=dist_inputs, explore=explore, is_training=is_training,
        timestep=timestep, extra_fetches=extras, raw_actions=head.raw_actions,
        deterministic_outputs=head.deterministic, name=path.name,
    )
