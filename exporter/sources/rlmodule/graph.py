"""A default RLModule of RLlib's new API stack rebuilt as a TF policy graph from its stored config
and torch ``state_dict`` (read by :mod:`.reader`): the same network, layer for layer, with the
MeanStdFilter in front and the actions the environment takes (``NormalizeAndClipActions``) behind.

The layout is RLlib's catalog's (``ray.rllib.core.models``): an encoder ``TorchMLP`` (every
``fcnet_hiddens`` layer a Linear, an optional LayerNorm and ``fcnet_activation``; torch's
``Sequential`` numbers them, so ``net.mlp.0`` and ``net.mlp.2`` around a ``Tanh``), heads of
``head_fcnet_hiddens`` with ``head_fcnet_activation`` and a linear output, an LSTM encoder of a
tokenizer MLP and ``torch.nn.LSTM`` (gates i, f, g, o; both biases). A torch Linear's weight is
``[out, in]``; every weight is taken by its name with the shape the config gives, and a missing
or misshapen one is named (:class:`WeightsError`). The module's outputs keep RLlib's meanings:
``action_dist_inputs`` (PPO: logits, or Box ``[mean, log_std]`` with ``log_std`` clamped to
``log_std_clip_param``; SAC: the same), ``vf_preds`` (the critic), ``qf_preds`` (DQN); the
deterministic action is RLlib's ``to_deterministic()`` (argmax, the Gaussian's mean; SAC's mean
before ``tanh``), the exploring one the distribution's sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError, WeightsError
from policy_export.exporter.sources.checkpoint import FilterState
from policy_export.exporter.sources.checkpoint_policy import _observations, environment_actions, filtered
from policy_export.exporter.sources.rlmodule.reader import DEFAULT_MODEL_CONFIG, ModuleCheckpoint, ModuleSpec
from policy_export.exporter.sources.safe_pickle import short_repr
from policy_export.exporter.sources.torch_layers import (
    TORCH_ACTIVATIONS, TorchWeights, lstm_step, sequential_mlp,
)
from policy_export.policy.distributions import ActionDistribution, OneLeaf, SquashedGaussian
from policy_export.policy.head import action_head
from policy_export.policy.tf_policy import TFPolicy, session_config
from policy_export.signatures.keys import (
    ACTION_DIST_INPUTS, EXPLORE, IS_TRAINING, SEQ_LENS, TIMESTEP, state_in_key, state_out_key,
)

tf1 = tf.compat.v1

LAYERNORM_EPS = 1e-3  # TorchMLP's LayerNorm (ray.rllib.core.models.torch.primitives)
ACTIONS = ("environment", "policy")
GREEDY = {"dqn": "DQN explores epsilon-greedily on a schedule of the training step; the export serves the greedy "
                 "action (RLlib's forward_inference)"}


@dataclass
class ModuleConfig:
    """The effective model config: RLlib's defaults, then what the checkpoint stores."""

    values: dict[str, Any]
    where: str

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def sizes(self, key: str) -> list[int]:
        value = self.values[key]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                                          and 0 < v <= 1 << 16 for v in value):
            raise ExportError(f"{self.where}: {key} {short_repr(value)} is not a list of layer sizes")
        return [int(v) for v in value]

    def activation(self, key: str):
        name = self.values[key]
        if name in TORCH_ACTIVATIONS:
            return TORCH_ACTIVATIONS[name]
        if isinstance(name, str) and name.lower() in ("linear",):
            return None
        raise ExportError(f"{self.where}: {key} {short_repr(name, 40)} is not an activation rebuilt here "
                          f"({', '.join(k for k in TORCH_ACTIVATIONS if k)})")

    def flag(self, key: str) -> bool:
        value = self.values[key]
        if not isinstance(value, (bool, np.bool_)):
            raise ExportError(f"{self.where}: {key} {short_repr(value, 40)} is not true or false")
        return bool(value)

    def number(self, key: str) -> float:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not np.isfinite(value):
            raise ExportError(f"{self.where}: {key} {short_repr(value, 40)} is not a finite number")
        return float(value)


def effective_config(spec: ModuleSpec) -> ModuleConfig:
    return ModuleConfig({**DEFAULT_MODEL_CONFIG, **spec.model_config}, f"module {spec.module_id!r}")


# ----------------------------------------------------------------------------- layers

def mlp(x: tf.Tensor, w: TorchWeights, prefix: str, sizes: Sequence[int], activation, layernorm: bool,
        output: int | None = None) -> tf.Tensor:
    """RLlib's ``TorchMLP`` under ``prefix`` (``<prefix>.<i>.weight``): each of ``sizes`` a Linear,
    an optional LayerNorm and ``activation``; then, when ``output`` is given, a linear output
    layer of that width. The ``Sequential``'s indices count the activation modules too."""
    return sequential_mlp(x, w, prefix, sizes, activation, LAYERNORM_EPS if layernorm else None, output)


def encoder_mlp(x: tf.Tensor, w: TorchWeights, prefix: str, cfg: ModuleConfig) -> tf.Tensor:
    """The MLP encoder (and an LSTM encoder's tokenizer): every ``fcnet_hiddens`` layer with
    ``fcnet_activation``, the last one too (``MLPEncoderConfig``'s output layer)."""
    return mlp(x, w, f"{prefix}.net.mlp", cfg.sizes("fcnet_hiddens"), cfg.activation("fcnet_activation"),
               cfg.flag("fcnet_use_layernorm"))


def head(x: tf.Tensor, w: TorchWeights, prefix: str, cfg: ModuleConfig, output: int) -> tf.Tensor:
    return mlp(x, w, f"{prefix}.net.mlp", cfg.sizes("head_fcnet_hiddens"), cfg.activation("head_fcnet_activation"),
               cfg.flag("head_fcnet_use_layernorm"), output)


# ----------------------------------------------------------------------------- modules

@dataclass
class _Net:
    dist_inputs: tf.Tensor
    extras: dict[str, tf.Tensor] = field(default_factory=dict)
    state_in: list[tf.Tensor] = field(default_factory=list)
    state_out: list[tf.Tensor] = field(default_factory=list)
    state_names: list[str] = field(default_factory=list)
    seq_lens: tf.Tensor | None = None
    distribution: Any = None


def _pi_width(space: gym.Space, cfg: ModuleConfig) -> int:
    if isinstance(space, gym.spaces.Box) and cfg.flag("free_log_std"):
        return int(np.prod(space.shape))
    return ActionDistribution.required_inputs(space)


def _pi(x: tf.Tensor, w: TorchWeights, spec: ModuleSpec, cfg: ModuleConfig, prefix: str = "pi") -> tf.Tensor:
    """The pi head: logits, or a Box's ``[mean, log_std]`` with ``log_std`` clamped to
    ``log_std_clip_param`` (``TorchMLPHead``'s ``clip_log_std``), or a free ``log_std`` parameter."""
    space = spec.action_space
    out = head(x, w, prefix, cfg, _pi_width(space, cfg))
    if not isinstance(space, gym.spaces.Box):
        return out
    clip = cfg.number("log_std_clip_param")
    if cfg.flag("free_log_std"):
        size = int(np.prod(space.shape))
        log_std = tf.clip_by_value(w.take(f"{prefix}.log_std", (size,)), -clip, clip)
        return tf.concat([out, tf.zeros_like(out) + log_std], axis=-1)
    mean, log_std = tf.split(out, 2, axis=-1)
    return tf.concat([mean, tf.clip_by_value(log_std, -clip, clip)], axis=-1)


def _actor_critic_prefixes(w: TorchWeights, cfg: ModuleConfig, where: str) -> tuple[str, str]:
    shared = cfg.flag("vf_share_layers")
    found = w.prefixes("encoder.encoder", "encoder.actor_encoder")
    expected = "encoder.encoder" if shared else "encoder.actor_encoder"
    if expected not in found:
        raise WeightsError(where, [f"vf_share_layers is {shared}, so the weights should hold {expected}.*; they hold "
                                   f"{', '.join(p + '.*' for p in found) or 'neither encoder'}"])
    return (expected, expected) if shared else ("encoder.actor_encoder", "encoder.critic_encoder")


def _ppo(x: tf.Tensor, w: TorchWeights, spec: ModuleSpec, cfg: ModuleConfig) -> _Net:
    """PPO/APPO/IMPALA's default module: ``ActorCriticEncoder`` (shared or not), pi and vf heads."""
    actor, critic = _actor_critic_prefixes(w, cfg, cfg.where)
    if cfg.flag("use_lstm"):
        return _ppo_lstm(x, w, spec, cfg, actor, critic)
    features = encoder_mlp(x, w, actor, cfg)
    if spec.inference_only:  # RLlib's env runner copy: no critic (ray 2.40 keeps its vf untrained)
        return _Net(_pi(features, w, spec, cfg))
    values = features if critic == actor else encoder_mlp(x, w, critic, cfg)
    return _Net(_pi(features, w, spec, cfg), {"vf_preds": tf.reshape(head(values, w, "vf", cfg, 1), [-1])})


def _ppo_lstm(x: tf.Tensor, w: TorchWeights, spec: ModuleSpec, cfg: ModuleConfig, actor: str, critic: str) -> _Net:
    """The LSTM encoder one step at a time (RLlib's env runner steps it so: ``[B, 1, obs]``): the
    state is ``h`` and ``c`` per encoder (actor, then critic unless shared), ``[B, cell]`` each
    (RLlib's ``[B, num_layers=1, cell]`` without its layer axis)."""
    for key in ("lstm_use_prev_action", "lstm_use_prev_reward"):
        if cfg.flag(key):
            raise ExportError(f"{cfg.where}: {key} is rebuilt only for RLlib's old API stack")
    cell = int(cfg.number("lstm_cell_size"))
    seq_lens = tf1.placeholder(tf.int32, (None,), name=SEQ_LENS)
    active = tf.expand_dims(seq_lens > 0, -1)  # a sequence of length 0 keeps its state
    net = _Net(x, seq_lens=seq_lens)
    outs = {}
    roles = (("actor", actor),) if spec.inference_only else (("actor", actor), ("critic", critic))
    for role, prefix in roles if critic != actor else (("", actor),):
        h_in = tf1.placeholder(tf.float32, (None, cell), name=state_in_key(len(net.state_in)))
        c_in = tf1.placeholder(tf.float32, (None, cell), name=state_in_key(len(net.state_in) + 1))
        tokens = encoder_mlp(x, w, f"{prefix}.tokenizer", cfg)
        h, c = lstm_step(tokens, h_in, c_in, w, f"{prefix}.lstm", cell)
        net.state_in += [h_in, c_in]
        net.state_out += [tf.where(active, h, h_in), tf.where(active, c, c_in)]
        net.state_names += [f"{role}.h" if role else "h", f"{role}.c" if role else "c"]
        outs[role or "actor"] = h
    net.dist_inputs = _pi(outs["actor"], w, spec, cfg)
    if not spec.inference_only:
        net.extras = {"vf_preds": tf.reshape(head(outs.get("critic", outs["actor"]), w, "vf", cfg, 1), [-1])}
    return net


def _dqn(x: tf.Tensor, w: TorchWeights, spec: ModuleSpec, cfg: ModuleConfig, ray_version: str) -> _Net:
    """DQN's default module (``compute_q_values``, the online nets): dueling or not, expected Q
    values over ``num_atoms`` atoms (distributional) or plain ones; ``qf_preds`` are the
    distribution inputs (the greedy action is their argmax)."""
    space = spec.action_space
    if not isinstance(space, gym.spaces.Discrete):
        raise ExportError(f"{cfg.where}: DQN's action space {space} is not Discrete")
    if cfg.values.get("noisy"):
        raise ExportError(f"{cfg.where}: noisy networks (noisy=True) are not rebuilt")
    n, atoms = int(space.n), int(cfg.number("num_atoms"))
    z = encoder_mlp(x, w, "encoder", cfg)
    advantages = head(z, w, "af", cfg, n * atoms)
    dueling = cfg.flag("dueling")
    value = head(z, w, "vf", cfg, 1) if dueling else None
    if atoms == 1:
        if dueling:
            q = advantages - tf.reduce_mean(advantages, axis=-1, keepdims=True) + value
        else:
            q = advantages
        return _Net(q, {"qf_preds": q})
    support = np.linspace(cfg.number("v_min"), cfg.number("v_max"), atoms).astype(np.float32)
    logits = tf.reshape(advantages, (-1, n, atoms))
    if dueling:
        # ray 2.40 centres the logits over the actions, later releases over the atoms (where the
        # centring and the value cancel in the softmax)
        axis = 1 if _version(ray_version) < (2, 41) else 2
        logits = logits - tf.reduce_mean(logits, axis=axis, keepdims=True) + tf.reshape(value, (-1, 1, 1))
    q = tf.reduce_sum(support * tf.nn.softmax(logits, axis=-1), axis=-1)
    return _Net(q, {"qf_preds": q})


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class NewStackSquashedGaussian(SquashedGaussian):
    """SAC's ``TorchSquashedGaussian`` as the new API stack uses it: samples squashed by ``tanh``
    into ``[-1, 1]`` (``NormalizeAndClipActions`` then unsquashes them), but the deterministic
    action is the mean *before* ``tanh`` (its ``to_deterministic()`` is ``TorchDeterministic(loc)``)."""

    def deterministic_sample(self) -> tf.Tensor:
        return self.mean


def _sac(x: tf.Tensor, w: TorchWeights, spec: ModuleSpec, cfg: ModuleConfig) -> _Net:
    space = spec.action_space
    if not isinstance(space, gym.spaces.Box):
        raise ExportError(f"{cfg.where}: SAC's action space {space} is not a Box (a Discrete SAC is not rebuilt)")
    inputs = _pi(encoder_mlp(x, w, "pi_encoder", cfg), w, spec, cfg)
    return _Net(inputs, distribution=OneLeaf(NewStackSquashedGaussian(inputs, space)))


# ----------------------------------------------------------------------------- the policy

def load_module_policy(checkpoint: ModuleCheckpoint, spec: ModuleSpec, *, use_filter: bool = True,
                       actions: str = "environment", device: str | None = None,
                       filter_agent: str | None = None) -> tuple[TFPolicy, dict[str, Any]]:
    """The :class:`TFPolicy` of one module of ``checkpoint``, and the record of what it holds.

    Raises:
        ExportError: a module, space or setting not rebuilt (named). WeightsError: a weight missing or
            of another shape than the config gives (named).
    """
    if actions not in ACTIONS:
        raise ExportError(f"actions {actions!r}: expected one of {', '.join(ACTIONS)}")
    refusal = spec.refusal()
    if refusal:
        raise ExportError(refusal)
    try:
        filt = checkpoint.filter_for(spec.module_id, filter_agent) if use_filter else None
        return _load(checkpoint, spec, filt, actions, device, filter_agent)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as e:
        raise ExportError(f"module {spec.module_id!r}: its config cannot be rebuilt: {type(e).__name__}: "
                          f"{str(e)[:300]}") from e


def _load(checkpoint: ModuleCheckpoint, spec: ModuleSpec, filt: FilterState | None, actions: str,
          device: str | None, agent: str | None = None):
    cfg = effective_config(spec)
    space, flatten = checkpoint.input_space(spec, filt is not None, agent)
    weights = TorchWeights(spec.weights(), f"module {spec.module_id!r}")
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        tf1.set_random_seed(0)
        obs, flat = _observations(space, flatten)  # FlattenObservations: one-hot, sorted keys
        width = int(np.prod(spec.observation_space.shape))
        if int(flat.shape[-1]) != width:
            raise ExportError(f"module {spec.module_id!r} takes {width} observation values; the environment's "
                              f"{space} gives {int(flat.shape[-1])} through the connectors")
        x = filtered(flat, filt)
        with tf1.name_scope("module"):
            if spec.family == "ppo":
                net = _ppo(x, weights, spec, cfg)
            elif spec.family == "dqn":
                net = _dqn(x, weights, spec, cfg, checkpoint.ray_version)
            else:
                net = _sac(x, weights, spec, cfg)
        head_ = _action_head(spec, net, checkpoint, actions)
        is_training = tf1.placeholder_with_default(False, (), name=IS_TRAINING)
        timestep = tf1.placeholder_with_default(np.int64(0), (), name=TIMESTEP)
    session = tf1.Session(graph=graph, config=session_config(device))
    transformed = (actions == "environment" and _transforms(spec.action_space, checkpoint)) or spec.family == "sac"
    det = head_.deterministic
    policy = TFPolicy(space, spec.action_space, session, observations=obs, sampled_action=head_.actions,
                      action_logp=head_.action_logp, action_dist_inputs=det[ACTION_DIST_INPUTS],
                      explore=head_.explore, is_training=is_training, timestep=timestep,
                      extra_fetches={k: det[k] for k in net.extras},
                      raw_actions=None if transformed else head_.raw_actions, state_inputs=net.state_in,
                      state_outputs=[det[state_out_key(i)] for i in range(len(net.state_out))],
                      seq_lens=net.seq_lens, deterministic_outputs=det, name=spec.module_id)
    if head_.explore is None:
        policy.explore_refused = GREEDY[spec.family]
    return policy, _record(checkpoint, spec, cfg, weights, filt, actions, net)


def _transforms(space: gym.Space, checkpoint: ModuleCheckpoint) -> bool:
    return isinstance(space, gym.spaces.Box) and np.issubdtype(space.dtype, np.floating) and (
        (checkpoint.normalize_actions and bool(np.all(space.bounded_below)) and bool(np.all(space.bounded_above)))
        or (not checkpoint.normalize_actions and checkpoint.clip_actions))


def _action_head(spec: ModuleSpec, net: _Net, checkpoint: ModuleCheckpoint, actions: str):
    """The served head: RLlib's ``GetActions`` (the deterministic action, or a sample with
    ``explore``), then ``NormalizeAndClipActions`` when serving the environment's actions."""
    settings = {"normalize_actions": checkpoint.normalize_actions, "clip_actions": checkpoint.clip_actions}

    def environment(done: list[tf.Tensor]) -> list[tf.Tensor]:
        return environment_actions(done, spec.action_space, settings)

    dist_inputs = tf.identity(net.dist_inputs, name=ACTION_DIST_INPUTS)
    extras = {k: tf.identity(t, name=f"extra/{k}") for k, t in net.extras.items()}
    states = {state_out_key(i): tf.identity(t, name=state_out_key(i)) for i, t in enumerate(net.state_out)}
    explore = None if spec.family in GREEDY else tf1.placeholder_with_default(False, (), name=EXPLORE)
    distribution = net.distribution or ActionDistribution(dist_inputs, spec.action_space)
    return action_head(distribution, dist_inputs, explore, clip=False, logp="sampled",
                       transform=environment if actions == "environment" else None,
                       extra={**extras, **states})


def _record(checkpoint: ModuleCheckpoint, spec: ModuleSpec, cfg: ModuleConfig, weights: TorchWeights,
            filt: FilterState | None, actions: str, net: _Net) -> dict[str, Any]:
    from policy_export.exporter.sources.rllib_checks import filter_record

    network = "lstm" if spec.family == "ppo" and cfg.flag("use_lstm") else "mlp"
    return {"module_id": spec.module_id, "module_class": spec.module_class, "family": spec.family,
            "catalog_class": spec.catalog_class, "network": network,
            "model_config": {k: v for k, v in cfg.values.items() if isinstance(v, (bool, int, float, str, list))},
            "weights_used": list(weights.used),
            "weights_unused": sorted(set(weights.weights) - set(weights.used))[:64],
            "observation_filter": filter_record(filt), "actions": actions,
            "normalize_actions": checkpoint.normalize_actions, "clip_actions": checkpoint.clip_actions,
            "env_to_module": checkpoint.env_to_module, "module_to_env": checkpoint.module_to_env,
            "state_names": net.state_names}
