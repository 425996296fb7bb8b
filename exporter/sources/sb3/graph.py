"""A Stable-Baselines3 policy rebuilt as a TF policy graph from its weights (read by :mod:`.reader`):
what ``model.predict(obs, deterministic=True)`` computes, from the observations the environment
gives to the action it takes.

In order, as SB3 computes it:

- ``VecNormalize.normalize_obs`` (when a ``vec_normalize.pkl`` is given): per normalised key,
  ``clip((obs - mean) / sqrt(var + epsilon), -clip_obs, clip_obs)`` (in float32, the statistics
  rounded once; SB3 computes it in float64 and returns float32);
- ``preprocess_obs``: a Box as float32 (an image divided by 255 when ``normalize_images``), a
  Discrete or MultiDiscrete one-hot, a MultiBinary as float32;
- the features extractor: ``FlattenExtractor``, ``NatureCNN`` (three convolutions on the
  channel-first image and a ReLU linear layer) or ``CombinedExtractor`` (NatureCNN per image key,
  flatten otherwise, concatenated in the Dict's key order); one shared by actor and critic, or one
  each (``share_features_extractor``);
- the policy's network, layer for layer (sizes read from the weights): an actor-critic
  ``MlpExtractor`` and ``action_net``/``value_net`` (RecurrentPPO: ``torch.nn.LSTM`` layers in front,
  the critic's own LSTM or a linear critic, or the actor's shared), DQN's Q-network, QR-DQN's
  quantiles (their mean is the Q-value), SAC's and TQC's actor (``log_std`` clamped to [-20, 2]),
  TD3's and DDPG's actor (tanh);
- the distribution and ``predict``'s post-processing: argmax per categorical, ``logit > 0`` per
  Bernoulli, the Gaussian's mean clipped to the Box's bounds, a squashed mean (SAC, TQC, TD3, DDPG,
  gSDE with ``squash_output``) unscaled from [-1, 1] to the bounds; MaskablePPO's logits where its
  ``action_masks`` input is false set to -1e8, as ``MaskableCategorical`` does.

Exploration (``explore`` true) samples the distribution SB3 samples: categorical, Bernoulli,
Gaussian (gSDE's as the Gaussian of the same variance, ``latent^2 @ std^2 + 1e-6``, which is what a
fresh exploration matrix per step draws from), squashed by tanh where SB3 squashes. DQN and QR-DQN
explore epsilon-greedily outside the network, TD3 and DDPG by noise the algorithm adds: their
exports serve the greedy action alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError, WeightsError
from policy_export.exporter.sources.sb3.inspect import postprocess_text
from policy_export.exporter.sources.sb3.reader import SB3Model
from policy_export.exporter.sources.torch_layers import (
    TorchWeights, conv2d, flatten, linear, lstm_step, sequential_mlp,
)
from policy_export.policy.distributions import ActionDistribution, DiagGaussian, OneLeaf
from policy_export.policy.head import action_head
from policy_export.policy.spaces import leaf_dtype, leaf_shape, leaves
from policy_export.policy.tf_policy import TFPolicy, session_config
from policy_export.signatures.keys import (
    ACTION_DIST_INPUTS, EXPLORE, IS_TRAINING, OBSERVATIONS, SEQ_LENS, TIMESTEP, state_in_key, state_out_key,
)

tf1 = tf.compat.v1

ACTION_MASKS = "action_masks"  # MaskablePPO's input: the actions allowed, one flag per logit
MASKED_LOGIT = -1e8  # what MaskableCategorical puts in place of a masked logit
LOG_STD_RANGE = (-20.0, 2.0)  # SAC's and TQC's actor clamps log_std to it
SDE_EPSILON = 1e-6  # StateDependentNoiseDistribution's epsilon on the variance
STOCHASTIC = ("actor_critic", "maskable", "recurrent", "sac")
GREEDY = {
    "dqn": "DQN explores epsilon-greedily outside the network; the export serves the greedy action (SB3's "
           "predict with deterministic=True)",
    "qrdqn": "QR-DQN explores epsilon-greedily outside the network; the export serves the greedy action (SB3's "
             "predict with deterministic=True)",
    "td3": "TD3 and DDPG act deterministically; their exploration noise is added by the algorithm, not the policy",
}


class SquashedGaussian(DiagGaussian):
    """SB3's ``SquashedDiagGaussianDistribution`` (and gSDE with ``squash_output``), with
    ``predict``'s ``unscale_action``: the Gaussian's sample (or mean) through tanh, then from
    [-1, 1] to the Box's bounds. ``log_std`` is used as given (the actor clamps it)."""

    EPS = 1e-6

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Box):
        super().__init__(inputs, space)

    def _unscale(self, raw: tf.Tensor) -> tf.Tensor:
        return self.low + 0.5 * (tf.tanh(raw) + 1.0) * (self.high - self.low)

    def deterministic_sample(self) -> tf.Tensor:
        return self._unscale(self.mean)

    def sample(self) -> tf.Tensor:
        return self._unscale(super().sample())

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        scaled = tf.clip_by_value(2.0 * (actions - self.low) / (self.high - self.low) - 1.0,
                                  -1.0 + self.EPS, 1.0 - self.EPS)
        raw = tf.math.atanh(scaled)
        return super().logp(raw) - tf.reduce_sum(tf.math.log(1.0 - tf.square(scaled) + self.EPS), axis=-1)


@dataclass
class _Net:
    dist_inputs: tf.Tensor
    distribution: Any = None
    extras: dict[str, tf.Tensor] = field(default_factory=dict)
    extra_inputs: dict[str, tf.Tensor] = field(default_factory=dict)
    state_in: list[tf.Tensor] = field(default_factory=list)
    state_out: list[tf.Tensor] = field(default_factory=list)
    state_names: list[str] = field(default_factory=list)
    seq_lens: tf.Tensor | None = None


# ----------------------------------------------------------------------------- observations

def is_image_space(space: gym.Space, normalized_image: bool = False) -> bool:
    """SB3's ``is_image_space`` (no channel check): a 3-D Box, uint8 in [0, 255] unless ``normalized_image``."""
    if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 3):
        return False
    if normalized_image:
        return True
    return space.dtype == np.uint8 and bool(np.all(space.low == 0)) and bool(np.all(space.high == 255))


def _placeholders(space: gym.Space) -> dict[str, tf.Tensor]:
    return {leaf.key(OBSERVATIONS): tf1.placeholder(tf.as_dtype(leaf_dtype(leaf.space)), (None, *leaf_shape(leaf.space)),
                                                    name=leaf.key(OBSERVATIONS))
            for leaf in leaves(space)}


def _normalized(x: tf.Tensor, stats: tuple[np.ndarray, np.ndarray], clip: float, epsilon: float) -> tf.Tensor:
    """``VecNormalize._normalize_obs``, in float32 (SB3 computes it in float64 and returns float32;
    every runtime, TFLite's included, computes float32): the mean and ``sqrt(var + epsilon)`` each
    rounded once from float64."""
    mean, var = stats
    with tf1.name_scope("vec_normalize"):
        std = np.sqrt(var.astype(np.float64) + epsilon).astype(np.float32)
        y = (tf.cast(x, tf.float32) - mean.astype(np.float32)) / std
        return tf.clip_by_value(y, -np.float32(clip), np.float32(clip))


def _preprocessed(x: tf.Tensor, space: gym.Space, normalize_images: bool) -> tf.Tensor:
    """``preprocess_obs`` of one observation (not a Dict)."""
    if isinstance(space, gym.spaces.Box):
        y = tf.cast(x, tf.float32)
        return y / 255.0 if normalize_images and is_image_space(space) else y
    if isinstance(space, gym.spaces.Discrete):
        return tf.one_hot(tf.cast(x, tf.int64), int(space.n), dtype=tf.float32)
    if isinstance(space, gym.spaces.MultiDiscrete):
        parts = tf.unstack(tf.cast(x, tf.int64), axis=1)
        return tf.concat([tf.one_hot(p, int(n), dtype=tf.float32) for p, n in zip(parts, space.nvec)], axis=-1)
    return tf.cast(x, tf.float32)  # MultiBinary


def observations(model: SB3Model) -> tuple[dict[str, tf.Tensor], dict[str | None, tf.Tensor]]:
    """The placeholders (keyed like the contract) and the preprocessed observation per Dict key
    (None: the whole observation)."""
    space, norm = model.observation_space, model.vec_normalize
    placeholders = _placeholders(space)
    normalize_images = bool(model.kwargs.get("normalize_images", True))
    parts = dict(space.spaces) if isinstance(space, gym.spaces.Dict) else {None: space}
    out = {}
    with tf1.name_scope("preprocess_obs"):
        for key, sub in parts.items():
            x = placeholders[OBSERVATIONS if key is None else f"{OBSERVATIONS}/{key}"]
            if norm is not None and key in norm.stats:
                x = _normalized(x, norm.stats[key], norm.clip_obs, norm.epsilon)
            out[key] = _preprocessed(x, sub, normalize_images)
    return placeholders, out


# ----------------------------------------------------------------------------- features

def _nature_cnn(x: tf.Tensor, w: TorchWeights, prefix: str) -> tf.Tensor:
    """``NatureCNN``: Conv(32, 8, 4), Conv(64, 4, 2), Conv(64, 3, 1), each with ReLU, flatten,
    Linear(features_dim) with ReLU; on the channel-first image."""
    if x.shape.rank != 4:
        raise ExportError(f"NatureCNN takes images of rank 3; these observations are {x.shape.as_list()[1:]}")
    for index, (filters, kernel, stride) in zip((0, 2, 4), ((32, 8, 4), (64, 4, 2), (64, 3, 1))):
        x = tf.nn.relu(conv2d(x, w, f"{prefix}.cnn.{index}", filters, kernel, stride))
    x = flatten(x)
    shape = w.shape(f"{prefix}.linear.0.weight")
    if shape is None or len(shape) != 2:
        raise WeightsError(w.where, [f"NatureCNN's linear layer {prefix}.linear.0 is not in the weights"])
    return tf.nn.relu(linear(x, w, f"{prefix}.linear.0", shape[0]))


def features(model: SB3Model, obs: dict[str | None, tf.Tensor], w: TorchWeights, prefix: str) -> tf.Tensor:
    """The features extractor under ``prefix`` on the preprocessed observations."""
    if model.extractor == "FlattenExtractor":
        return flatten(obs[None])
    if model.extractor == "NatureCNN":
        return _nature_cnn(obs[None], w, prefix)
    normalized = bool(model.extractor_kwargs.get("normalized_image", False))
    encoded = []
    for key, sub in model.observation_space.spaces.items():
        if is_image_space(sub, normalized):
            encoded.append(_nature_cnn(obs[key], w, f"{prefix}.extractors.{key}"))
        else:
            encoded.append(flatten(obs[key]))
    return tf.concat(encoded, axis=1)


def _sizes(w: TorchWeights, prefix: str, output: bool = False) -> list[int]:
    """The widths of a ``Sequential`` of Linear layers and activations under ``prefix``, from its
    weights (``<prefix>.<i>.weight``, i = 0, 2, 4... between activations); the last one is the
    output layer's when ``output``."""
    sizes, index = [], 0
    while w.has(f"{prefix}.{index}.weight"):
        shape = w.shape(f"{prefix}.{index}.weight")
        if shape is None or len(shape) != 2:
            raise WeightsError(w.where, [f"{prefix}.{index}.weight is not a linear layer's weight"])
        sizes.append(shape[0])
        index += 2
    if output and not sizes:
        raise WeightsError(w.where, [f"the network implies linear layers under {prefix}, which the weights do not hold"])
    return sizes


def _mlp(x: tf.Tensor, w: TorchWeights, prefix: str, activation, output: bool = False, output_activation=None):
    """A ``create_mlp`` network under ``prefix``: hidden layers each with ``activation``, and a
    linear output layer when ``output``."""
    sizes = _sizes(w, prefix, output)
    hidden = sizes[:-1] if output else sizes
    return sequential_mlp(x, w, prefix, hidden, activation, None, sizes[-1] if output else None, output_activation)


# ----------------------------------------------------------------------------- the networks

def _action_dim(space: gym.Space) -> int:
    if isinstance(space, gym.spaces.Box):
        return int(np.prod(space.shape))
    return ActionDistribution.required_inputs(space)


def _gaussian_inputs(model: SB3Model, w: TorchWeights, mean: tf.Tensor, latent_sde: tf.Tensor | None,
                     prefix: str) -> tf.Tensor:
    """``[mean, log_std]``: the diagonal Gaussian's, or gSDE's (the log of ``sqrt(latent^2 @ std^2 + eps)``)."""
    dim = int(mean.shape[-1])
    if latent_sde is None:
        log_std = w.take(f"{prefix}log_std", (dim,))
        return tf.concat([mean, tf.zeros_like(mean) + log_std], axis=-1)
    full = bool(model.kwargs.get("full_std", True))
    width = int(latent_sde.shape[-1])
    log_std = w.take(f"{prefix}log_std", (width, dim if full else 1))
    if model.kwargs.get("use_expln", False):  # expln: exp below 0, log1p + 1 above
        std = np.where(log_std <= 0, np.exp(np.minimum(log_std, 0)), np.log1p(np.maximum(log_std, 0) + 1e-6) + 1.0)
    else:
        std = np.exp(log_std.astype(np.float64))
    std = np.broadcast_to(std, (width, dim)).astype(np.float32)
    variance = tf.matmul(tf.square(latent_sde), np.square(std))
    return tf.concat([mean, 0.5 * tf.math.log(variance + SDE_EPSILON)], axis=-1)


def _distribution(model: SB3Model, dist_inputs: tf.Tensor, squash: bool):
    space = model.action_space
    if isinstance(space, gym.spaces.Box):
        return OneLeaf(SquashedGaussian(dist_inputs, space) if squash else DiagGaussian(dist_inputs, space))
    return ActionDistribution(dist_inputs, space)


def _masked(logits: tf.Tensor, space: gym.Space) -> tuple[tf.Tensor, tf.Tensor]:
    if not isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        raise ExportError(f"MaskablePPO acting in {space}: masks are rebuilt for Discrete and MultiDiscrete actions")
    masks = tf1.placeholder(tf.bool, (None, int(logits.shape[-1])), name=ACTION_MASKS)
    return tf.where(masks, logits, tf.fill(tf.shape(logits), MASKED_LOGIT)), masks


def _actor_critic(model: SB3Model, obs, w: TorchWeights) -> _Net:
    """ActorCriticPolicy (PPO, A2C, TRPO) and MaskableActorCriticPolicy."""
    act, space = model.activation, model.action_space
    shared = model.kwargs.get("share_features_extractor", True)
    pi_features = features(model, obs, w, "features_extractor" if shared else "pi_features_extractor")
    vf_features = pi_features if shared else features(model, obs, w, "vf_features_extractor")
    latent_pi = _mlp(pi_features, w, "mlp_extractor.policy_net", act)
    latent_vf = _mlp(vf_features, w, "mlp_extractor.value_net", act)
    net = _Net(_pi(model, w, latent_pi, space))
    if model.family == "maskable":
        net.dist_inputs, masks = _masked(net.dist_inputs, space)
        net.extra_inputs[ACTION_MASKS] = masks
    net.distribution = _distribution(model, net.dist_inputs, model.use_sde and model.kwargs.get("squash_output", False))
    net.extras["values"] = tf.reshape(linear(latent_vf, w, "value_net", 1), [-1])
    return net


def _pi(model: SB3Model, w: TorchWeights, latent_pi: tf.Tensor, space: gym.Space) -> tf.Tensor:
    out = linear(latent_pi, w, "action_net", _action_dim(space))
    if not isinstance(space, gym.spaces.Box):
        return out
    return _gaussian_inputs(model, w, out, latent_pi if model.use_sde else None, "")


def _recurrent(model: SB3Model, obs, w: TorchWeights) -> _Net:
    """RecurrentActorCriticPolicy: ``torch.nn.LSTM`` layers one step at a time, the state kept per
    layer as ``h`` and ``c`` (actor, then the critic's own LSTM when it has one), ``[batch, hidden]``
    each; a state fed as zeros starts an episode, as SB3's ``episode_starts`` does."""
    act, space, k = model.activation, model.action_space, model.kwargs
    hidden, layers = int(k["lstm_hidden_size"]), int(k["n_lstm_layers"])
    shared = k.get("share_features_extractor", True)
    pi_features = features(model, obs, w, "features_extractor" if shared else "pi_features_extractor")
    vf_features = pi_features if shared else features(model, obs, w, "vf_features_extractor")
    seq_lens = tf1.placeholder(tf.int32, (None,), name=SEQ_LENS)
    active = tf.expand_dims(seq_lens > 0, -1)  # a sequence of length 0 keeps its state
    net = _Net(pi_features, seq_lens=seq_lens)

    def lstm(x: tf.Tensor, prefix: str, role: str) -> tf.Tensor:
        for layer in range(layers):
            h_in = tf1.placeholder(tf.float32, (None, hidden), name=state_in_key(len(net.state_in)))
            c_in = tf1.placeholder(tf.float32, (None, hidden), name=state_in_key(len(net.state_in) + 1))
            h, c = lstm_step(x, h_in, c_in, w, prefix, hidden, layer)
            net.state_in += [h_in, c_in]
            net.state_out += [tf.where(active, h, h_in), tf.where(active, c, c_in)]
            net.state_names += [f"{role}.h{layer}", f"{role}.c{layer}"]
            x = h
        return x

    latent_pi = lstm(pi_features, "lstm_actor", "pi")
    if w.prefixes("lstm_critic"):
        latent_vf = lstm(vf_features, "lstm_critic", "vf")
    elif k.get("shared_lstm"):
        latent_vf = latent_pi
    else:
        latent_vf = linear(vf_features, w, "critic", hidden)
    latent_pi = _mlp(latent_pi, w, "mlp_extractor.policy_net", act)
    latent_vf = _mlp(latent_vf, w, "mlp_extractor.value_net", act)
    net.dist_inputs = _pi(model, w, latent_pi, space)
    net.distribution = _distribution(model, net.dist_inputs, model.use_sde and k.get("squash_output", False))
    net.extras["values"] = tf.reshape(linear(latent_vf, w, "value_net", 1), [-1])
    return net


def _q(model: SB3Model, obs, w: TorchWeights) -> _Net:
    """DQN's Q-network, or QR-DQN's quantiles averaged into Q-values."""
    n = int(model.action_space.n)
    if model.family == "dqn":
        q = _mlp(features(model, obs, w, "q_net.features_extractor"), w, "q_net.q_net", model.activation, output=True)
    else:
        quantiles = _mlp(features(model, obs, w, "quantile_net.features_extractor"), w,
                         "quantile_net.quantile_net", model.activation, output=True)
        width = int(quantiles.shape[-1])
        if width % n:
            raise WeightsError(w.where, [f"the quantile network's {width} outputs are not a multiple of the {n} actions"])
        q = tf.reduce_mean(tf.reshape(quantiles, (-1, width // n, n)), axis=1)
    if int(q.shape[-1]) != n:
        raise WeightsError(w.where, [f"the Q-network gives {int(q.shape[-1])} values for {n} actions"])
    return _Net(q, extras={"q_values": q})


def _sac(model: SB3Model, obs, w: TorchWeights) -> _Net:
    """SAC's and TQC's actor: ``latent_pi``, ``mu`` (under gSDE a Hardtanh of ``clip_mean`` after
    it), ``log_std`` clamped to [-20, 2] (under gSDE the state-dependent noise's)."""
    dim = _action_dim(model.action_space)
    latent = _mlp(features(model, obs, w, "actor.features_extractor"), w, "actor.latent_pi", model.activation)
    if model.use_sde:
        clip = float(model.kwargs.get("clip_mean", 2.0))
        if clip > 0:  # mu is Sequential(Linear, Hardtanh(-clip_mean, clip_mean))
            mean = tf.clip_by_value(linear(latent, w, "actor.mu.0", dim), -clip, clip)
        else:
            mean = linear(latent, w, "actor.mu", dim)
        inputs = _gaussian_inputs(model, w, mean, latent, "actor.")
    else:
        mean = linear(latent, w, "actor.mu", dim)
        log_std = tf.clip_by_value(linear(latent, w, "actor.log_std", dim), *LOG_STD_RANGE)
        inputs = tf.concat([mean, log_std], axis=-1)
    return _Net(inputs, OneLeaf(SquashedGaussian(inputs, model.action_space)))


class _Squashed:
    """TD3's and DDPG's actor output (tanh, in [-1, 1]) unscaled to the Box's bounds."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Box):
        self.inputs, self.space = inputs, space
        self.low = np.asarray(space.low, np.float32).reshape(-1)
        self.high = np.asarray(space.high, np.float32).reshape(-1)

    def deterministic_sample(self) -> tf.Tensor:
        return self.low + 0.5 * (self.inputs + 1.0) * (self.high - self.low)

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        return tf.zeros_like(self.inputs[:, 0])

    def postprocess(self, actions: tf.Tensor, clip: bool = True) -> tf.Tensor:
        shape = tuple(int(d) for d in self.space.shape)
        return tf.reshape(actions, (-1, *shape)) if len(shape) != 1 else actions


def _td3(model: SB3Model, obs, w: TorchWeights) -> _Net:
    """TD3's (and DDPG's) actor: ``create_mlp(..., squash_output=True)``, a tanh after its output layer."""
    out = _mlp(features(model, obs, w, "actor.features_extractor"), w, "actor.mu", model.activation, output=True,
               output_activation=tf.tanh)
    if int(out.shape[-1]) != _action_dim(model.action_space):
        raise WeightsError(w.where, [f"the actor gives {int(out.shape[-1])} values for {model.action_space}"])
    return _Net(out, OneLeaf(_Squashed(out, model.action_space)))


NETWORKS = {"actor_critic": _actor_critic, "maskable": _actor_critic, "recurrent": _recurrent, "dqn": _q,
            "qrdqn": _q, "sac": _sac, "td3": _td3}


# ----------------------------------------------------------------------------- the policy

def load_sb3_policy(model: SB3Model, device: str | None = None) -> tuple[TFPolicy, dict[str, Any]]:
    """The :class:`TFPolicy` of ``model``, and the record of what it holds.

    Raises:
        ExportError: a setting not rebuilt (named). WeightsError: a weight missing or of another
            shape than the network implies (named).
    """
    weights = TorchWeights(model.weights, f"{model.path}:policy.pth")
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        tf1.set_random_seed(0)
        placeholders, obs = observations(model)
        with tf1.name_scope("policy"):
            net = NETWORKS[model.family](model, obs, weights)
        dist_inputs = tf.identity(net.dist_inputs, name=ACTION_DIST_INPUTS)
        extras = {k: tf.identity(t, name=f"extra/{k}") for k, t in net.extras.items()}
        states = {state_out_key(i): tf.identity(t, name=state_out_key(i)) for i, t in enumerate(net.state_out)}
        explore = tf1.placeholder_with_default(False, (), name=EXPLORE) if model.family in STOCHASTIC else None
        distribution = net.distribution or ActionDistribution(dist_inputs, model.action_space)
        head = action_head(distribution, dist_inputs, explore, clip=True, logp="action" if explore is not None
                           else "sampled", extra={**extras, **states})
        is_training = tf1.placeholder_with_default(False, (), name=IS_TRAINING)
        timestep = tf1.placeholder_with_default(np.int64(0), (), name=TIMESTEP)
    det = head.deterministic
    policy = TFPolicy(model.observation_space, model.action_space, tf1.Session(graph=graph, config=session_config(device)),
                      observations=placeholders[OBSERVATIONS] if set(placeholders) == {OBSERVATIONS} else placeholders,
                      sampled_action=head.actions, action_logp=head.action_logp,
                      action_dist_inputs=det[ACTION_DIST_INPUTS], explore=head.explore, is_training=is_training,
                      timestep=timestep, extra_inputs=net.extra_inputs, extra_fetches={k: det[k] for k in net.extras},
                      raw_actions=head.raw_actions if explore is not None else None, image_inputs=[],
                      state_inputs=net.state_in, state_outputs=[det[state_out_key(i)] for i in range(len(net.state_out))],
                      seq_lens=net.seq_lens, deterministic_outputs=det, name=model.path.stem)
    if explore is None:
        policy.explore_refused = GREEDY[model.family]
    record = {"kind": "sb3_zip", "algorithm": model.algorithm, "policy_class": model.policy_class,
              "sb3_version": model.sb3_version, "extractor": model.extractor, "activation": model.kwargs["activation_fn"],
              "use_sde": model.use_sde, "vec_normalize": model.vec_normalize.record() if model.vec_normalize else None,
              "postprocess": postprocess_text(model), "weights_used": list(dict.fromkeys(weights.used)),
              "weights_unused": sorted(set(model.weights) - set(weights.used))[:64], "state_names": net.state_names}
    return policy, record
