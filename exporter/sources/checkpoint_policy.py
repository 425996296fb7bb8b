"""A served policy rebuilt from one policy of an RLlib checkpoint (read by :mod:`exporter.sources.checkpoint`).

:func:`load_checkpoint_policy` builds a :class:`policy.TFPolicy` whose graph takes what the
environment emits and computes what RLlib computes for it, from the checkpoint's config and
weights alone:

1. **observations**: one input per leaf of the environment's space (``observations/<nest
   path>``), flattened as RLlib's preprocessor does (Discrete and MultiDiscrete one-hot, Box
   flattened, leaves in gymnasium's order);
2. **the observation filter** (``MeanStdFilter``/``ConcurrentMeanStdFilter``) with the
   checkpoint's running statistics: ``(x - mean) / (std + 1e-6)`` in float32, then its clip
   (``use_filter=False`` leaves it out, for a caller who applies it);
3. **the network** (:mod:`exporter.sources.rllib_nets`): RLlib's fully connected or vision net, its LSTM
   wrapper (one step, the state ``state_in_0``/``state_in_1`` = ``h``/``c`` carried by the
   caller), its attention wrapper (:mod:`exporter.sources.rllib_attention`: one step, the state
   ``state_in_i`` each transformer unit's memory window), DQN's Q head, SAC's and CQL's actor net,
   DDPG's and TD3's deterministic actor; every size and number the graph takes from the config,
   the spaces and the filter is checked first (:mod:`exporter.sources.rllib_checks`);
4. **the action head** with RLlib's meanings: with ``explore`` false the distribution's
   deterministic sample (argmax, the Gaussian mean, SAC's squashed mean) with ``action_logp`` 0;
   with ``explore`` true a sample and its log-probability. DQN explores epsilon-greedily on a
   schedule of the training step and DDPG/TD3 with noise, which a served model does not have:
   their exports have no ``explore`` input and serve the greedy action (:data:`SERVES_GREEDY`);
5. **the actions**: ``actions="environment"`` (the default) gives what
   ``Algorithm.compute_single_action`` hands the environment: with ``normalize_actions`` each
   bounded float Box leaf unsquashed from [-1, 1] to its bounds and clipped to them, else with
   ``clip_actions`` clipped; ``actions="policy"`` gives what ``policy.compute_actions`` returns.

Extra outputs are RLlib's own: ``vf_preds`` (the value function) for the policy-gradient
family, ``q_values`` for DQN.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError
from policy_export.exporter.sources.checkpoint import CheckpointPolicy, FilterState
from policy_export.exporter.sources.safe_pickle import short_repr
from policy_export.exporter.sources.rllib import flatten_like_preprocessor, preprocessor_width
from policy_export.exporter.sources import rllib_layout as layout
from policy_export.exporter.sources.rllib_attention import ATTENTION_DEFAULTS, AttentionConfig, attention_step
from policy_export.exporter.sources.rllib_checks import MAX_INT, check_policy, filter_record, json_value, recorded
from policy_export.exporter.sources.rllib_checks import safe_value as _safe
from policy_export.exporter.sources.rllib_layout import Layout, named_weights
from policy_export.exporter.sources.rllib_nets import (
    NetWeights, conv_filters, ddpg_actor, fcnet, lstm_step, q_values, visionnet,
)
from policy_export.policy.distributions import ActionDistribution, Deterministic, OneLeaf, SquashedGaussian
from policy_export.policy.head import ActionHead, action_head
from policy_export.policy.recurrent import SequenceGraph
from policy_export.policy.spaces import leaf_dtype, leaf_shape, leaves, space_to_json
from policy_export.policy.tf_policy import TFPolicy, session_config
from policy_export.signatures.keys import (
    ACTION_DIST_INPUTS, EXPLORE, IS_TRAINING, OBSERVATIONS, PREV_ACTION, PREV_REWARD, SEQ_LENS, TIMESTEP,
    state_in_key, state_out_key,
)

tf1 = tf.compat.v1
log = logging.getLogger(__name__)

ACTIONS = ("environment", "policy")
# policy classes by the network and head the package rebuilds for them (class names of ray 2.1-2.9)
ACTOR_CRITIC = ("PPOTF1Policy", "PPOTF2Policy", "PPOTFPolicy", "APPOTF1Policy", "APPOTF2Policy", "ImpalaTF1Policy",
                "ImpalaTF2Policy", "A3CTFPolicy", "A3CTF1Policy", "A3CTF2Policy", "PGTF1Policy", "PGTF2Policy",
                "MARWILTF1Policy", "MARWILTF2Policy", "BCTF1Policy", "BCTF2Policy")
Q_LEARNING = ("DQNTFPolicy", "DQNTF1Policy", "DQNTF2Policy")
DETERMINISTIC_ACTOR = ("DDPGTFPolicy", "DDPGTF1Policy", "DDPGTF2Policy", "TD3TFPolicy", "TD3TF1Policy", "TD3TF2Policy")
SOFT_ACTOR = ("SACTFPolicy", "SACTF1Policy", "SACTF2Policy", "CQLTFPolicy", "CQLTF1Policy", "CQLTF2Policy")
# RLlib's MODEL_DEFAULTS for the keys the rebuilt networks read
MODEL_DEFAULTS = {"fcnet_hiddens": [256, 256], "fcnet_activation": "tanh", "post_fcnet_hiddens": [],
                  "post_fcnet_activation": "relu", "free_log_std": False, "no_final_linear": False,
                  "vf_share_layers": True, "use_lstm": False, "lstm_cell_size": 256, "lstm_use_prev_action": False,
                  "lstm_use_prev_reward": False, "max_seq_len": 20, "conv_filters": None, "conv_activation": "relu",
                  "use_attention": False, **ATTENTION_DEFAULTS}
# the families whose exploration depends on the training step or on noise state the served model
# does not have: their exports serve the greedy action, with no explore input
SERVES_GREEDY = {
    "q_learning": "DQN explores epsilon-greedily on a schedule of the training step; the export serves the "
                  "greedy action",
    "deterministic_actor": "DDPG and TD3 explore with noise (Ornstein-Uhlenbeck state, or Gaussian on a schedule "
                           "of the training step); the export serves the actor's action",
}
FROM_RLLIB = ("load the checkpoint with RLlib (the ray version that wrote it) in your own process and pass the "
              "policy to policy_export.from_rllib")


@dataclass
class _Net:
    """The rebuilt network's tensors inside the policy graph."""

    dist_inputs: tf.Tensor
    extras: dict[str, tf.Tensor]
    state_in: list[tf.Tensor] = field(default_factory=list)
    state_out: list[tf.Tensor] = field(default_factory=list)
    seq_lens: tf.Tensor | None = None
    prev_action: tf.Tensor | None = None
    prev_reward: tf.Tensor | None = None


def describe(policy: CheckpointPolicy) -> str:
    """``policy '<id>' (<class>)`` for messages, the class name cut to 120 characters."""
    name = policy.policy_class if len(policy.policy_class) <= 120 else policy.policy_class[:117] + "..."
    return f"policy {policy.policy_id!r} ({name})"


def model_config(policy: CheckpointPolicy) -> dict[str, Any]:
    """The policy's ``model`` config over RLlib's defaults."""
    given = policy.config.get("model") if isinstance(policy.config.get("model"), dict) else {}
    return {**MODEL_DEFAULTS, **given}  # an explicit None stays None (a None activation is linear in RLlib)


def network_kind(policy: CheckpointPolicy) -> str:
    """``actor_critic``, ``q_learning`` or ``soft_actor``: which network the package rebuilds.

    Raises:
        ExportError: a policy class, custom model or network the package does not rebuild,
            naming it and pointing to ``from_rllib``.
    """
    where = describe(policy)
    model = model_config(policy)
    custom = model.get("custom_model")
    if custom:
        name = getattr(custom, "ref", custom)
        raise ExportError(f"{where} uses the custom model {short_repr(name, 120)}, which cannot be rebuilt from a "
                          f"checkpoint; {FROM_RLLIB}")
    if model.get("use_attention") and model.get("use_lstm"):
        raise ExportError(f"{where}: model use_lstm and use_attention are both set (RLlib refuses that too)")
    base_network(policy)
    name = policy.policy_class.rsplit(".", 1)[-1]
    for kind, classes in (("actor_critic", ACTOR_CRITIC), ("q_learning", Q_LEARNING), ("soft_actor", SOFT_ACTOR),
                          ("deterministic_actor", DETERMINISTIC_ACTOR)):
        if name in classes:
            for key in ("use_lstm", "use_attention"):
                if model.get(key) and kind != "actor_critic":
                    raise ExportError(f"{where}: {key} with {name} is not rebuilt from checkpoints; {FROM_RLLIB}")
            return kind
    raise ExportError(f"{where}: the policy class {name[:120]} is not one the package rebuilds from a checkpoint "
                      f"(it rebuilds {', '.join(ACTOR_CRITIC[:1] + Q_LEARNING[:1] + SOFT_ACTOR[:1] + DETERMINISTIC_ACTOR[:1])} "
                      f"and their "
                      f"family); {FROM_RLLIB}")


def base_network(policy: CheckpointPolicy) -> str:
    """``fcnet`` or ``vision``: the net RLlib's catalog picks for the policy's observations
    (``_get_v2_model_class``): the vision net for a 3-D Box, the fully connected net for a 1-D Box
    whose original space holds no image.

    Raises:
        ExportError: the complex-input net (a Dict or Tuple with images, a 2-D Box), or
            observations RLlib's preprocessor changed in shape (Atari frames), neither rebuilt.
    """
    where = describe(policy)
    space, original = policy.observation_space, policy.original_observation_space
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 3:
        if original is not None and getattr(original, "shape", None) != space.shape:
            raise ExportError(f"{where}: RLlib's preprocessor turned {original} into {space} (an Atari frame "
                              f"preprocessor), which is not rebuilt from checkpoints; {FROM_RLLIB}")
        return "vision"
    images = [leaf for leaf in leaves(original or space)
              if isinstance(leaf.space, gym.spaces.Box) and len(leaf.space.shape) >= 2]
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1 or images:
        raise ExportError(f"{where}: observations {original or space} make RLlib build its ComplexInputNetwork, "
                          f"which is not rebuilt from checkpoints yet; {FROM_RLLIB}")
    return "fcnet"


def observation_space(policy: CheckpointPolicy) -> tuple[gym.Space, bool]:
    """The space the export takes (the environment's) and whether the graph flattens it."""
    original = policy.original_observation_space
    if base_network(policy) == "vision":
        return policy.observation_space, False  # images stay [B, H, W, C], cast to float32 (no scaling)
    if original is None:
        return policy.observation_space, not _is_float_box(policy.observation_space)
    width = preprocessor_width(original)
    if width != int(np.prod(policy.observation_space.shape)):
        raise ExportError(f"policy {policy.policy_id!r}: the original observation space {original} flattens to "
                          f"{width} values, the policy's input has {policy.observation_space.shape}")
    return original, True


def _is_float_box(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Box) and np.issubdtype(space.dtype, np.floating)


def _observations(space: gym.Space, flatten: bool):
    """``(placeholders, flat float32 model input)``."""
    obs = {leaf.key(OBSERVATIONS): tf1.placeholder(tf.as_dtype(leaf_dtype(leaf.space)), (None, *leaf_shape(leaf.space)),
                                                   name=leaf.key(OBSERVATIONS))
           for leaf in leaves(space)}
    with tf1.name_scope("rllib_preprocessor"):
        flat = flatten_like_preprocessor(space, obs, tf.float32) if flatten else tf.cast(obs[OBSERVATIONS], tf.float32)
    return (obs[OBSERVATIONS] if set(obs) == {OBSERVATIONS} else obs), flat


def filtered(x: tf.Tensor, state: FilterState | None) -> tf.Tensor:
    """RLlib's ``MeanStdFilter`` (not updated) on the flat observations ``x``, in float32."""
    if state is None:
        return x
    if tuple(state.mean.shape) != tuple(x.shape.as_list()[1:]):
        raise ExportError(f"the observation filter's statistics have shape {list(state.mean.shape)}, the "
                          f"preprocessed observations {x.shape.as_list()[1:]}")
    with tf1.name_scope("observation_filter"):
        if state.demean:
            x = x - tf.constant(state.mean.astype(np.float32), name="mean")
        if state.destd:
            x = x / tf.constant((state.std + 1e-6).astype(np.float32), name="std_plus_eps")
        if state.clip:
            x = tf.clip_by_value(x, -float(state.clip), float(state.clip))
    return x


def _base(policy: CheckpointPolicy, x: tf.Tensor, w: NetWeights, model: dict[str, Any], num_outputs: int | None,
          with_value: bool = True):
    """RLlib's catalog net for the observations: ``(model output, value or None)``."""
    build = visionnet if base_network(policy) == "vision" else fcnet
    return build(x, w, model, num_outputs, with_value=with_value)


def _actor_critic(policy: CheckpointPolicy, x: tf.Tensor, w: NetWeights, model: dict[str, Any]) -> _Net:
    num_outputs = ActionDistribution.required_inputs(policy.action_space)
    if model.get("use_attention"):
        return _attention_net(policy, x, w, model, num_outputs)
    if not model.get("use_lstm"):
        out, value = _base(policy, x, w, model, num_outputs)
        return _Net(out, {"vf_preds": tf.reshape(value, [-1])})
    features, _ = _base(policy, x, w, model, None, with_value=False)
    cell = int(model["lstm_cell_size"])
    net = _recurrent_inputs(policy, model, features, cell)
    logits, values, (h, c) = lstm_step(net.dist_inputs, (net.state_in[0], net.state_in[1]), w, cell, num_outputs)
    active = tf.expand_dims(net.seq_lens > 0, -1)  # a zero-length sequence keeps its state, as Keras's mask does
    net.state_out = [tf.where(active, h, net.state_in[0]), tf.where(active, c, net.state_in[1])]
    net.dist_inputs, net.extras = logits, {"vf_preds": tf.reshape(values, [-1])}
    return net


def _attention_net(policy: CheckpointPolicy, x: tf.Tensor, w: NetWeights, model: dict[str, Any],
                   num_outputs: int) -> _Net:
    """``AttentionWrapper`` (:mod:`exporter.sources.rllib_attention`), one step: the state is each
    unit's memory window ``[B, M, dim]``, ``state_out_i`` the window shifted by the step's row
    (kept as it was for a sequence of length 0)."""
    cfg = AttentionConfig.of(model)
    features, _ = _base(policy, x, w, model, None, with_value=False)
    net = _Net(features, {})
    net.state_in = [tf1.placeholder(tf.float32, (None, cfg.memory, cfg.dim), name=state_in_key(i))
                    for i in range(cfg.units)]
    net.seq_lens = tf1.placeholder(tf.int32, (None,), name=SEQ_LENS)
    logits, values, rows = attention_step(features, net.state_in, w, cfg, num_outputs)
    active = tf.reshape(net.seq_lens > 0, (-1, 1, 1))
    net.state_out = [tf.where(active, tf.concat([state[:, 1:], row[:, None]], axis=1), state)
                     for state, row in zip(net.state_in, rows)]
    net.dist_inputs, net.extras = logits, {"vf_preds": tf.reshape(values, [-1])}
    return net


def _recurrent_inputs(policy: CheckpointPolicy, model: dict[str, Any], features: tf.Tensor, cell: int) -> _Net:
    """The state, ``seq_lens``, previous action and reward placeholders, and in ``dist_inputs``
    (for now) the LSTM's input: the features with the previous action and reward as RLlib
    concatenates them."""
    net = _Net(features, {})
    net.state_in = [tf1.placeholder(tf.float32, (None, cell), name=state_in_key(i)) for i in range(2)]
    net.seq_lens = tf1.placeholder(tf.int32, (None,), name=SEQ_LENS)
    parts = [features]
    if model.get("lstm_use_prev_action"):
        net.prev_action, prev = _prev_action(policy.action_space)
        parts.append(prev)
    if model.get("lstm_use_prev_reward"):
        net.prev_reward = tf1.placeholder(tf.float32, (None,), name=PREV_REWARD)
        parts.append(tf.reshape(net.prev_reward, (-1, 1)))
    net.dist_inputs = parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
    return net


def _prev_action(space: gym.Space) -> tuple[tf.Tensor, tf.Tensor]:
    """The previous action's placeholder and its features as ``LSTMWrapper`` concatenates them."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        raise ExportError("lstm_use_prev_action with a Dict or Tuple action space is not rebuilt from checkpoints")
    ph = tf1.placeholder(tf.as_dtype(leaf_dtype(space)), (None, *leaf_shape(space)), name=PREV_ACTION)
    if isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        return ph, flatten_like_preprocessor(space, {PREV_ACTION: ph}, tf.float32)
    return ph, tf.reshape(tf.cast(ph, tf.float32), (-1, int(np.prod(space.shape))))


def _q_learning(policy: CheckpointPolicy, x: tf.Tensor, w: NetWeights, model: dict[str, Any]) -> _Net:
    config = policy.config
    if not isinstance(policy.action_space, gym.spaces.Discrete):
        raise ExportError(f"DQN needs a Discrete action space, the checkpoint has {policy.action_space}")
    for key in ("noisy", "add_layer_norm"):
        if config.get(key):
            raise ExportError(f"DQN with {key} is not rebuilt from checkpoints; {FROM_RLLIB}")
    n = int(policy.action_space.n)
    if config.get("hiddens"):
        base = dict(model, no_final_linear=True)
        num_outputs = ([256] + list(model.get("fcnet_hiddens") or []))[-1]
    else:
        base, num_outputs = model, n
    out, _ = _base(policy, x, w, base, int(num_outputs), with_value=False)
    q = q_values(out, w, config, n)
    return _Net(q, {"q_values": q})


def _soft_actor(policy: CheckpointPolicy, x: tf.Tensor, w: NetWeights) -> _Net:
    actor = {**MODEL_DEFAULTS, **(policy.config.get("policy_model_config") or {})}
    if actor.get("custom_model"):
        raise ExportError(f"SAC's policy_model_config names the custom model {short_repr(actor['custom_model'])}; "
                          f"{FROM_RLLIB}")
    num_outputs = ActionDistribution.required_inputs(policy.action_space)
    out, _ = _base(policy, x, w, actor, num_outputs, with_value=False)
    return _Net(out, {})


def _squashed(kind: str, policy: CheckpointPolicy) -> bool:
    """SAC's (and CQL's) Box actions: RLlib's ``SquashedGaussian`` when ``normalize_actions``."""
    if kind != "soft_actor" or not isinstance(policy.action_space, gym.spaces.Box):
        return False
    if policy.config.get("_use_beta_distribution"):
        raise ExportError("SAC with _use_beta_distribution is not rebuilt from checkpoints")
    return bool(policy.config.get("normalize_actions", True))


def _deterministic_actor(policy: CheckpointPolicy, x: tf.Tensor, w: NetWeights, model: dict[str, Any]) -> _Net:
    """DDPG/TD3: the observations (or, with ``use_state_preprocessor``, the catalog net's 256
    features) through the actor head; its output is the action."""
    space, config = policy.action_space, policy.config
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
        raise ExportError(f"DDPG and TD3 need a 1-D Box action space, the checkpoint has {space}")
    if (config.get("exploration_config") or {}).get("type") == "ParameterNoise":
        raise ExportError(f"DDPG with ParameterNoise (layer-normalised heads) is not rebuilt; {FROM_RLLIB}")
    if config.get("use_state_preprocessor"):
        x, _ = _base(policy, x, w, dict(model, no_final_linear=True), 256, with_value=False)
    bounded = bool(np.logical_and(space.bounded_above, space.bounded_below).any())
    out = ddpg_actor(x, w, config, np.asarray(space.low, np.float32), np.asarray(space.high, np.float32), bounded)
    return _Net(out, {})


def _distribution(kind: str, policy: CheckpointPolicy, dist_inputs: tf.Tensor):
    """RLlib's action distribution for the policy: DDPG's and TD3's ``Deterministic`` (the inputs
    are the action), SAC's ``SquashedGaussian``, else the space's own."""
    if kind == "deterministic_actor":
        return OneLeaf(Deterministic(dist_inputs, policy.action_space))
    if _squashed(kind, policy):
        return OneLeaf(SquashedGaussian(dist_inputs, policy.action_space))
    return ActionDistribution(dist_inputs, policy.action_space)


def _transforms(space: gym.Space, config: Mapping[str, Any]) -> bool:
    """Whether :func:`environment_actions` changes actions of the leaf ``space``."""
    if not (isinstance(space, gym.spaces.Box) and np.issubdtype(space.dtype, np.floating)):
        return False
    if config.get("normalize_actions", True):
        return bool(np.all(space.bounded_below)) and bool(np.all(space.bounded_above))
    return bool(config.get("clip_actions"))


def environment_actions(actions: list[tf.Tensor], space: gym.Space, config: Mapping[str, Any]) -> list[tf.Tensor]:
    """What ``compute_single_action`` hands the environment: ``unsquash_action`` with
    ``normalize_actions``, else ``clip_action`` with ``clip_actions``; per leaf, in leaf order."""
    normalize, clip = bool(config.get("normalize_actions", True)), bool(config.get("clip_actions"))
    out = []
    for leaf, a in zip(leaves(space), actions):
        s = leaf.space
        if _transforms(s, config):
            low, high = np.asarray(s.low, s.dtype), np.asarray(s.high, s.dtype)
            if normalize:
                a = tf.clip_by_value(low + (a + 1.0) * (high - low) / 2.0, low, high)
            elif clip:
                a = tf.clip_by_value(a, low, high)
        out.append(a)
    return out


def _head(kind: str, policy: CheckpointPolicy, dist_inputs: tf.Tensor, explore: tf.Tensor | None, actions: str,
          **options) -> ActionHead:
    """The action head with RLlib's meanings (unclipped actions; ``action_logp`` the sample's, 0
    for the deterministic action), serving the policy's own actions or the environment's."""
    def environment(done: list[tf.Tensor]) -> list[tf.Tensor]:
        return environment_actions(done, policy.action_space, policy.config)

    return action_head(_distribution(kind, policy, dist_inputs), dist_inputs, explore, clip=False, logp="sampled",
                       transform=environment if actions == "environment" else None, **options)


def _sequence_graph(policy: CheckpointPolicy, w: NetWeights, actions: str, explore: tf.Tensor,
                    use_filter: bool) -> SequenceGraph:
    """The LSTM policy over ``B`` padded sequences of ``T`` steps (``B*T`` rows, ``seq_lens``),
    looped with ``tf.scan``: what :meth:`TFPolicy.compute_actions` and stepped parity run."""
    model, space, flatten = model_config(policy), *observation_space(policy)
    cell, n = int(model["lstm_cell_size"]), ActionDistribution.required_inputs(policy.action_space)
    with tf1.name_scope("sequences"):
        obs, flat = _observations(space, flatten)
        features, _ = _base(policy, filtered(flat, policy.filter if use_filter else None), w, model, None,
                            with_value=False)
        net = _recurrent_inputs(policy, model, features, cell)
        batch = tf.shape(net.seq_lens)[0]
        time = tf.shape(net.dist_inputs)[0] // batch
        width = int(net.dist_inputs.shape[-1])
        seq = tf.transpose(tf.reshape(net.dist_inputs, (batch, time, width)), (1, 0, 2))
        mask = tf.transpose(tf.sequence_mask(net.seq_lens, time))

        def step(carry, elems):
            h, c = carry[0], carry[1]
            logits, values, (h2, c2) = lstm_step(elems[0], (h, c), w, cell, n)
            keep = tf.expand_dims(elems[1], -1)
            return tf.where(keep, h2, h), tf.where(keep, c2, c), logits, tf.reshape(values, [-1])

        zeros = (tf.zeros((batch, n)), tf.zeros((batch,)))
        h, c, logits, values = tf.scan(step, (seq, mask), initializer=(net.state_in[0], net.state_in[1], *zeros))
        rows = tf.reshape(tf.transpose(logits, (1, 0, 2)), (-1, n))
        head = _head("actor_critic", policy, rows, explore, actions, deterministic=False)
        outputs = {**head.outputs([h[-1], c[-1]]), "vf_preds": tf.reshape(tf.transpose(values), [-1])}
    inputs = {**(obs if isinstance(obs, dict) else {OBSERVATIONS: obs}), state_in_key(0): net.state_in[0],
              state_in_key(1): net.state_in[1], SEQ_LENS: net.seq_lens, EXPLORE: explore}
    inputs.update({k: t for k, t in ((PREV_ACTION, net.prev_action), (PREV_REWARD, net.prev_reward)) if t is not None})
    return SequenceGraph(inputs, outputs, int(model["max_seq_len"]))


def _heads(kind: str, policy: CheckpointPolicy, net: _Net, actions: str) -> ActionHead:
    """The served head on the rebuilt network; the families of :data:`SERVES_GREEDY` get no
    explore input and serve the deterministic path."""
    dist_inputs = tf.identity(net.dist_inputs, name=ACTION_DIST_INPUTS)
    extras = {k: tf.identity(t, name=f"extra/{k}") for k, t in net.extras.items()}
    states = {state_out_key(i): tf.identity(t, name=state_out_key(i)) for i, t in enumerate(net.state_out)}
    explore = None if kind in SERVES_GREEDY else tf1.placeholder_with_default(False, (), name=EXPLORE)
    return _head(kind, policy, dist_inputs, explore, actions, extra={**extras, **states})


def load_checkpoint_policy(policy: CheckpointPolicy, *, use_filter: bool = True, actions: str = "environment",
                           device: str | None = None) -> tuple[TFPolicy, dict[str, Any]]:
    """The :class:`TFPolicy` for one checkpoint policy, and the record of what it holds.

    Raises:
        ExportError: a policy, network or space the package does not rebuild (see
            :func:`network_kind`); ``actions`` not one of :data:`ACTIONS`.
        WeightsError: the weights do not fit the network the config describes (each named).
    """
    if actions not in ACTIONS:
        raise ExportError(f"actions {actions!r}: expected one of {', '.join(ACTIONS)}")
    try:
        return _load(policy, use_filter, actions, device)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
        # a config value of the wrong kind (a size that is not a number, a list that is a string...)
        raise ExportError(f"{describe(policy)}: its config cannot be rebuilt: "
                          f"{type(e).__name__}: {str(e)[:300]}") from e


def _load(policy: CheckpointPolicy, use_filter: bool, actions: str, device: str | None):
    kind = network_kind(policy)
    model = model_config(policy)
    check_policy(policy, kind, base_network(policy), model, describe(policy), use_filter)
    space, flatten = observation_space(policy)
    where = f"checkpoint policy {policy.policy_id!r}"
    named = policy.weights if policy.weight_list is None else \
        named_weights(policy.weight_list, eager_layout(policy, kind), policy.policy_id, where)
    weights = NetWeights(named, where)
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        tf1.set_random_seed(0)  # sampled actions: the same export verdict on every run
        obs, flat = _observations(space, flatten)
        x = filtered(flat, policy.filter if use_filter else None)
        with tf1.name_scope("network"):
            if kind == "actor_critic":
                net = _actor_critic(policy, x, weights, model)
            elif kind == "q_learning":
                net = _q_learning(policy, x, weights, model)
            elif kind == "deterministic_actor":
                net = _deterministic_actor(policy, x, weights, model)
            else:
                net = _soft_actor(policy, x, weights)
        head = _heads(kind, policy, net, actions)
        explore, deterministic = head.explore, head.deterministic
        is_training = tf1.placeholder_with_default(False, (), name=IS_TRAINING)
        timestep = tf1.placeholder_with_default(np.int64(0), (), name=TIMESTEP)
        # the attention net is served one step at a time, its memory window the state: no sequence graph
        looped = net.state_in and not model.get("use_attention")
        sequences = _sequence_graph(policy, weights, actions, explore, use_filter) if looped else None
        if sequences is not None:
            sequences.inputs[TIMESTEP] = timestep
    session = tf1.Session(graph=graph, config=session_config(device))
    # the parity check of sampled log-probabilities feeds a format's actions back as the raw
    # sample: only possible while the served actions are the distribution's own, and not for a
    # tanh-squashed sample (atanh near the bounds turns float32 rounding into large logp errors)
    transformed = (actions == "environment" and any(_transforms(leaf.space, policy.config)
                                                    for leaf in leaves(policy.action_space))) \
        or _squashed(kind, policy)
    tf_policy = TFPolicy(
        space, policy.action_space, session, observations=obs, sampled_action=head.actions,
        action_logp=head.action_logp, action_dist_inputs=deterministic[ACTION_DIST_INPUTS],
        explore=explore, is_training=is_training, timestep=timestep, extra_fetches=_extras(deterministic, net),
        raw_actions=None if transformed else head.raw_actions, state_inputs=net.state_in,
        state_outputs=[deterministic[state_out_key(i)] for i in range(len(net.state_out))],
        seq_lens=net.seq_lens, prev_action=net.prev_action, prev_reward=net.prev_reward,
        deterministic_outputs=deterministic, sequence_graph=sequences, name=policy.policy_id,
    )
    if explore is None:
        tf_policy.explore_refused = SERVES_GREEDY[kind]
    return tf_policy, _record(policy, kind, model, weights, use_filter, actions)


def _refuse_eager_attention(model: dict[str, Any], where: str) -> None:
    """RLlib's eager ``model.variables()`` keys the variables by name, and the attention net's unnamed
    weights share names (a GRU gate's seven, the position biases): its list keeps one of each."""
    if model.get("use_attention"):
        raise ExportError(f"{where}: a framework('tf2') attention net is not rebuilt: RLlib's eager checkpoint keeps "
                          f"one of the variables that share a name (each GRU gate's seven weights, the position "
                          f"biases), so it does not hold the whole net; {FROM_RLLIB}")


def eager_layout(policy: CheckpointPolicy, kind: str) -> Layout:
    """``(name, shape)`` of every variable of the policy's RLlib model, in the order a
    ``framework("tf2")`` policy's ``get_weights()`` lists them (``TFModelV2.variables()``: its
    sub-models in the order RLlib's constructor sets them, Keras's order inside each).

    Raises:
        ExportError: a network whose eager variable order is not laid out (named).
    """
    where = describe(policy)
    model = model_config(policy)
    obs = policy.observation_space
    n = ActionDistribution.required_inputs(policy.action_space)

    def base(config: dict[str, Any], num_outputs: int | None, name: str = "") -> tuple[Layout, int]:
        if base_network(policy) == "vision":
            return layout.visionnet(obs.shape, config, num_outputs, conv_filters(config, obs.shape), name)
        return layout.fcnet(int(np.prod(obs.shape)), config, num_outputs, name)

    _refuse_eager_attention(model, where)
    with tf.Graph().as_default():
        if kind == "actor_critic" and not model.get("use_lstm"):
            return base(model, n)[0]
        if kind == "actor_critic":
            found, width = base(model, None)
            width += (preprocessor_width(policy.action_space) if model.get("lstm_use_prev_action") else 0) + \
                (1 if model.get("lstm_use_prev_reward") else 0)
            return found + layout.lstm_wrapper(width, int(model["lstm_cell_size"]), n)
        if kind == "q_learning":
            config, actions = policy.config, int(policy.action_space.n)
            hiddens = [int(h) for h in config.get("hiddens") or []]
            if hiddens:
                found, width = base(dict(model, no_final_linear=True), ([256] + list(model["fcnet_hiddens"] or []))[-1])
            else:
                found, width = base(model, actions)
            return found + layout.q_heads(width, actions, hiddens, bool(config.get("dueling")),
                                          int(config.get("num_atoms") or 1))
        if kind == "soft_actor":
            actor = {**MODEL_DEFAULTS, **(policy.config.get("policy_model_config") or {})}
            q = {**MODEL_DEFAULTS, **(policy.config.get("q_model_config") or {})}
            found = base(actor, n)[0]
            discrete = isinstance(policy.action_space, gym.spaces.Discrete)
            for name in ("q_net/", "twin_q_net/")[:2 if policy.config.get("twin_q", True) else 1]:
                if discrete:
                    found += base(q, int(policy.action_space.n), name)[0]
                else:
                    found += layout.fcnet(layout.q_model_width(obs, policy.action_space, where), q, 1, name)[0]
            return found + [("log_alpha", ())]
        if kind == "deterministic_actor":  # DDPG, TD3: the catalog net only with use_state_preprocessor
            config, found = policy.config, []
            width = int(np.prod(obs.shape))
            if config.get("use_state_preprocessor"):
                found, width = base(dict(model, no_final_linear=True), 256)
            return found + layout.ddpg_heads(width, int(np.prod(policy.action_space.shape)),
                                             config.get("actor_hiddens", [256, 256]) or [],
                                             config.get("critic_hiddens", [256, 256]) or [], bool(config.get("twin_q")))
    raise ExportError(f"{where}: a framework('tf2') {kind} policy's weights are not laid out; {FROM_RLLIB}")


def _extras(deterministic: dict[str, tf.Tensor], net: _Net) -> dict[str, tf.Tensor]:
    return {k: deterministic[k] for k in net.extras}


def _record(policy: CheckpointPolicy, kind: str, model: dict[str, Any], weights: NetWeights, use_filter: bool,
            actions: str) -> dict[str, Any]:
    used = set(weights.used)
    scope = f"{weights.scope}/" if weights.scope else ""
    unused = sorted(f"{scope}{n}" for n in weights.arrays if f"{scope}{n}" not in used)
    listed = [name for name in unused if isinstance(json_value(name), str)]  # names of JSON-safe text
    filt = filter_record(policy.filter)
    model_record, not_recorded = recorded({k: model.get(k) for k in MODEL_DEFAULTS})
    timestep = policy.global_timestep if isinstance(policy.global_timestep, int) and \
        0 <= policy.global_timestep <= MAX_INT else None
    return {
        "policy_id": policy.policy_id, "policy_class": _safe(policy.policy_class), "framework": policy.framework,
        "network": kind,
        "base_network": base_network(policy),
        "model": model_record,
        "model_not_recorded": not_recorded,
        "weights_used": sorted(used), "weights_not_in_the_served_graph": listed,
        "weights_not_recorded": len(unused) - len(listed),
        "observation_space": space_to_json(observation_space(policy)[0]),
        "observation_filter": filt if use_filter else None,
        "observation_filter_left_out": filt if not use_filter else None,
        "observation_filter_note": policy.filter_note,
        "actions": actions,
        "normalize_actions": bool(policy.config.get("normalize_actions", True)),
        "clip_actions": bool(policy.config.get("clip_actions")),
        "global_timestep": timestep,
    }
