"""Recurrent (LSTM) policies: a training-time graph over padded sequences and a one-step
serving graph, both in one session and sharing every weight.

The training-time graph keeps the semantics a policy is trained with: ``B`` padded sequences
of ``T`` steps, flattened to ``B*T`` rows, masked by ``seq_lens``, through a Keras LSTM (a while
loop). That loop cannot be frozen and converted on TF 2.21, so the serving signature — what the
SavedModel, the frozen graph and the ONNX model hold — is a separate one-step graph: the LSTM's
own cell called once, the state passed in (``state_in_0`` = h, ``state_in_1`` = c) and out
(``state_out_0``, ``state_out_1``). Rows with ``seq_lens == 0`` are padding: their state passes
through unchanged. Stepped parity proves the two graphs compute the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from policy_export.policy.distributions import ActionDistribution
from policy_export.errors import InputError, UnsupportedSpaceError
from policy_export.policy.graph import ActionResult, session_config, unflatten
from policy_export.policy.head import action_head
from policy_export.policy.models import ModelInput, build_recurrent_model, model_inputs, preprocess
from policy_export.policy.spaces import leaf_dtype, leaf_shape, leaves
from policy_export.policy.spec import ModelConfig, PolicySpec
from policy_export.signatures.keys import (
    ACTION_DIST_INPUTS, EXPLORE, IS_TRAINING, OBSERVATIONS, PREV_ACTION, PREV_REWARD, SEQ_LENS, TIMESTEP, is_action,
    is_per_step, is_state_in, state_in_key, state_out_key,
)

tf1 = tf.compat.v1


@dataclass
class SequenceGraph:
    """Tensors of the training-time graph, keyed like the signature."""

    inputs: dict[str, tf.Tensor]
    outputs: dict[str, tf.Tensor]
    max_seq_len: int


@dataclass
class _Placeholders:
    obs: dict[str, tf.Tensor]
    state: list[tf.Tensor]
    seq_lens: tf.Tensor
    prev_action: tf.Tensor | None
    prev_reward: tf.Tensor | None


def _placeholders(spec: PolicySpec, prefix: str, cell: int, act_leaf) -> _Placeholders:
    def name(key: str) -> str:
        return f"{prefix}{key}"

    obs = {}
    for leaf in leaves(spec.observation_space):
        key = leaf.key(OBSERVATIONS)
        obs[key] = tf1.placeholder(tf.as_dtype(leaf_dtype(leaf.space)), (None, *leaf_shape(leaf.space)), name=name(key))
    state = [tf1.placeholder(tf.float32, (None, cell), name=name(state_in_key(i))) for i in range(2)]
    seq_lens = tf1.placeholder(tf.int32, (None,), name=name(SEQ_LENS))
    lstm = spec.model.lstm
    prev_action = prev_reward = None
    if lstm.use_prev_action:
        prev_action = tf1.placeholder(tf.as_dtype(leaf_dtype(act_leaf.space)), (None, *leaf_shape(act_leaf.space)),
                                      name=name(PREV_ACTION))
    if lstm.use_prev_reward:
        prev_reward = tf1.placeholder(tf.float32, (None,), name=name(PREV_REWARD))
    return _Placeholders(obs, state, seq_lens, prev_action, prev_reward)


def _prev_features(ph: _Placeholders, act_leaf, act_input: ModelInput | None) -> tf.Tensor | None:
    parts = []
    if ph.prev_action is not None:
        parts.append(preprocess(act_leaf, ph.prev_action, act_input))
    if ph.prev_reward is not None:
        parts.append(tf.expand_dims(ph.prev_reward, -1))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=-1)


def build_recurrent_policy(cls, spec: PolicySpec, device: str | None):
    """Build a recurrent :class:`TFPolicy` (see the module docstring)."""
    lstm = spec.model.lstm
    act_leaves = list(leaves(spec.action_space))
    if lstm.use_prev_action and len(act_leaves) != 1:
        raise UnsupportedSpaceError(type(spec.action_space).__name__, "$.model.lstm.use_prev_action",
                                    ["a single (non-Dict, non-Tuple) action space"])
    act_leaf = act_leaves[0]
    act_input = model_inputs(act_leaf.space, ModelConfig(hiddens=()))[0] if lstm.use_prev_action else None
    prev_size = (act_input.shape[0] if act_input else 0) + (1 if lstm.use_prev_reward else 0)
    specs = model_inputs(spec.observation_space, spec.model)
    num_outputs = ActionDistribution.required_inputs(spec.action_space)

    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        tf1.set_random_seed(spec.seed)
        rm = build_recurrent_model(specs, spec.model, num_outputs, prev_size, seed=spec.seed)
        explore = tf1.placeholder_with_default(False, (), name=EXPLORE)
        is_training = tf1.placeholder_with_default(False, (), name=IS_TRAINING)
        timestep = tf1.placeholder_with_default(np.int64(0), (), name=TIMESTEP)

        # serving graph: one step, the cell called directly (no loop)
        ph = _placeholders(spec, "", lstm.cell_size, act_leaf)
        with tf1.name_scope("serve"):
            step_in = [preprocess(leaf, t, s) for leaf, t, s in zip(leaves(spec.observation_space), ph.obs.values(), specs)]
            prev = _prev_features(ph, act_leaf, act_input)
            dist_inputs, (h, c) = rm.step(step_in, prev, (ph.state[0], ph.state[1]))
            active = tf.expand_dims(ph.seq_lens > 0, -1)
            h = tf.where(active, h, ph.state[0])
            c = tf.where(active, c, ph.state[1])
        dist_inputs = tf.identity(dist_inputs, name=ACTION_DIST_INPUTS)
        state_out = [tf.identity(h, name=state_out_key(0)), tf.identity(c, name=state_out_key(1))]
        head = action_head(spec.action_space, dist_inputs, explore,
                           extra={state_out_key(i): t for i, t in enumerate(state_out)})

        model_io = _sequence_model_io(rm, ph, step_in, prev)

        sequence = _training_graph(spec, rm, specs, act_leaf, act_input, explore, timestep)
        init = tf1.global_variables_initializer()

    session = tf1.Session(graph=graph, config=session_config(device))
    session.run(init)
    policy = cls(
        spec.observation_space, spec.action_space, session,
        observations=ph.obs, sampled_action=head.actions, action_logp=head.action_logp,
        action_dist_inputs=dist_inputs, explore=explore, is_training=is_training, timestep=timestep,
        state_inputs=ph.state, state_outputs=state_out, seq_lens=ph.seq_lens,
        prev_action=ph.prev_action, prev_reward=ph.prev_reward,
        model=rm.sequence_model, model_io=model_io, raw_actions=head.raw_actions, sequence_graph=sequence,
        name=spec.name, deterministic_outputs=head.deterministic,
        image_inputs=[k for k, s in zip(ph.obs, specs) if s.image],
    )
    if spec.weights is not None:
        policy.import_model_from_h5(spec.weights)
    return policy


def _sequence_model_io(rm, ph, step_in, prev):
    """The base model's sequence form on the serving inputs (T = 1), as (inputs, outputs): the
    session's reference for the Keras files."""
    seq_in = [tf.expand_dims(x, 1) for x in step_in]
    model_args = [*seq_in] + ([tf.expand_dims(prev, 1)] if prev is not None else [])
    mask = tf.expand_dims(ph.seq_lens > 0, 1)
    model_out = rm.sequence_model([*model_args, mask, ph.state[0], ph.state[1]])
    return [*model_args, mask, ph.state[0], ph.state[1]], list(model_out)


def _training_graph(spec: PolicySpec, rm, specs: Sequence[ModelInput], act_leaf, act_input, explore, timestep) -> SequenceGraph:
    """``B*T`` padded rows, ``seq_lens`` per sequence, the Keras LSTM (training-time semantics)."""
    ph = _placeholders(spec, "sequences/", spec.model.lstm.cell_size, act_leaf)
    with tf1.name_scope("sequences"):
        batch = tf.shape(ph.seq_lens)[0]
        first = next(iter(ph.obs.values()))
        time = tf.shape(first)[0] // batch

        def add_time(x: tf.Tensor) -> tf.Tensor:
            return tf.reshape(x, tf.concat([[batch, time], tf.shape(x)[1:]], axis=0))

        seq_in = [add_time(preprocess(leaf, t, s)) for leaf, t, s in zip(leaves(spec.observation_space), ph.obs.values(), specs)]
        prev = _prev_features(ph, act_leaf, act_input)
        mask = tf.sequence_mask(ph.seq_lens, time)
        args = [*seq_in] + ([add_time(prev)] if prev is not None else [])
        dist_seq, h, c = rm.sequence_model([*args, mask, ph.state[0], ph.state[1]])
        dist_inputs = tf.reshape(dist_seq, (-1, int(dist_seq.shape[-1])))
        head = action_head(spec.action_space, dist_inputs, explore, deterministic=False)
    inputs = {**ph.obs, state_in_key(0): ph.state[0], state_in_key(1): ph.state[1], SEQ_LENS: ph.seq_lens,
              EXPLORE: explore, TIMESTEP: timestep}
    if ph.prev_action is not None:
        inputs[PREV_ACTION] = ph.prev_action
    if ph.prev_reward is not None:
        inputs[PREV_REWARD] = ph.prev_reward
    return SequenceGraph(inputs, head.outputs([h, c]), spec.model.lstm.max_seq_len)


def compute_sequence_actions(policy, obs: Any, state, prev_action, prev_reward, seq_lens, explore: bool,
                             timestep) -> Any:
    """:meth:`TFPolicy.compute_actions` for recurrent policies (the training-time graph)."""

    graph = policy.sequence_graph
    if graph is None:
        raise InputError("this recurrent policy has no sequence graph: step it one observation at a time with "
                         "run(), feeding each state_in_i the state_out_i of the step before")
    feeds = policy.observation_feeds(obs)
    rows = len(np.asarray(next(iter(feeds.values()))))
    seq_lens = np.ones(rows, np.int32) if seq_lens is None else np.asarray(seq_lens)
    if not np.issubdtype(seq_lens.dtype, np.integer):
        raise InputError(f"seq_lens must be integers, got {seq_lens.dtype}")
    if seq_lens.ndim != 1 or len(seq_lens) == 0 or rows % len(seq_lens):
        raise InputError(f"{rows} observation rows do not split into {len(seq_lens)} padded sequences")
    if np.any(seq_lens < 0) or np.any(seq_lens > rows // len(seq_lens)):
        raise InputError(f"seq_lens {seq_lens.tolist()} must lie in [0, {rows // len(seq_lens)}] (the padded length)")
    batch = len(seq_lens)
    initial = policy.get_initial_state()
    state = [np.stack([s] * batch) for s in initial] if state is None else list(state)
    if len(state) != len(initial):
        raise InputError(f"state has {len(state)} arrays, the policy has {len(initial)} (h and c)")
    feeds.update({state_in_key(0): state[0], state_in_key(1): state[1], SEQ_LENS: seq_lens,
                  EXPLORE: np.bool_(explore)})
    for key, value in ((PREV_ACTION, prev_action), (PREV_REWARD, prev_reward)):
        if key in graph.inputs:
            if value is None:
                raise InputError(f"this policy uses {key}; pass it (one row per observation row)")
            feeds[key] = value
    if timestep is not None:
        feeds[TIMESTEP] = np.int64(timestep)
    checked = policy.check_feeds(feeds, graph.inputs, same_batch=False)
    for key, arr in checked.items():
        per_row = is_per_step(key)
        want = rows if per_row else batch if is_state_in(key) else None
        if want is not None and arr.shape[0] != want:
            raise InputError(f"{key} has {arr.shape[0]} rows, expected {want}")
    feed_dict = {graph.inputs[k]: v for k, v in checked.items()}
    fetches = dict(zip(graph.outputs, policy.session.run(list(graph.outputs.values()), feed_dict)))
    actions = [fetches[k] for k in fetches if is_action(k)]
    return ActionResult(actions=unflatten(policy.action_space, actions),
                        state_out=[fetches[state_out_key(0)], fetches[state_out_key(1)]], fetches=fetches)


