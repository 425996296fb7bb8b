"""Names for the weights of a ``framework("tf2")`` (eager) RLlib checkpoint, which stores them as a list.

An eager policy's ``get_weights()`` is ``[v.numpy() for v in policy.model.variables()]``: no names,
in the order of ``TFModelV2.variables()``, which walks the model's attributes in the order its
constructor set them (``base_model``, then ``_rnn_model``; ``q_value_head``, ``state_value_head``;
``action_model``, ``q_net``, ``twin_q_net``, ``log_alpha``...) and, inside each Keras model, takes
Keras's own order of its layers (by depth from the outputs, then by the order they are reached).

:func:`variable_layout` builds the same Keras models RLlib's catalog builds for the policy's
config (the layer graph only: names, sizes and connections, in a scratch graph, no weights set),
so that Keras itself gives the order; :func:`named_weights` then lays the checkpoint's list onto
those names, checking the count and every shape first, and returns the names a ``framework("tf")``
checkpoint of the same policy would hold (``<policy id>/fc_1/kernel``...), which the network
builders of :mod:`exporter.sources.rllib_nets` take. Weights the served network does not use
(the value and Q nets of SAC, DQN's value branch...) get names of their own, under the sub-model
that holds them (``<policy id>/q_net/fc_1/kernel``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError, WeightsError

Layout = list[tuple[str, tuple[int, ...]]]


def _keras():
    import tf_keras

    return tf_keras


def _weights_of(model, prefix: str = "") -> Layout:
    """``(name, shape)`` of a Keras model's weights in Keras's order, ``:0`` dropped, ``prefix`` prepended."""
    out = []
    for w in model.weights:
        name = w.name[:-2] if w.name.endswith(":0") else w.name
        out.append((prefix + name, tuple(int(d) for d in w.shape)))
    return out


def fcnet(width: int, model: Mapping[str, Any], num_outputs: int | None, name: str = "") -> tuple[Layout, int]:
    """RLlib's ``FullyConnectedNetwork`` on ``width`` inputs: ``(layout, width of its output)``;
    ``log_std`` (a variable set before ``base_model``) with ``free_log_std``, then ``base_model``'s."""
    keras = _keras()
    layers = keras.layers
    hiddens = list(model.get("fcnet_hiddens") or []) + list(model.get("post_fcnet_hiddens") or [])
    first: Layout = []
    if model.get("free_log_std") and num_outputs:
        num_outputs //= 2
        first = [(f"{name}log_std", (num_outputs,))]
    inputs = layers.Input(shape=(width,), name="observations")
    last, logits, i = inputs, None, 1
    for size in hiddens[:-1]:
        last = layers.Dense(int(size), name=f"fc_{i}")(last)
        i += 1
    if model.get("no_final_linear") and num_outputs:
        logits = layers.Dense(num_outputs, name="fc_out")(last)
    else:
        if hiddens:
            last = layers.Dense(int(hiddens[-1]), name=f"fc_{i}")(last)
        if num_outputs:
            logits = layers.Dense(num_outputs, name="fc_out")(last)
    if first and logits is not None:  # the tiled log_std concatenated to the means, as RLlib's layers do
        log_std = layers.Lambda(lambda x: tf.zeros((tf.shape(x)[0], num_outputs)))(inputs)
        logits = layers.Concatenate(axis=1)([logits, log_std])
    value_in = last
    if not model.get("vf_share_layers"):
        value_in = inputs
        for j, size in enumerate(hiddens, 1):
            value_in = layers.Dense(int(size), name=f"fc_value_{j}")(value_in)
    value = layers.Dense(1, name="value_out")(value_in)
    return _with_width(keras.Model(inputs, [logits if logits is not None else last, value]), name, first)


def _with_width(model, name: str, first: Layout = ()) -> tuple[Layout, int]:
    return [*first, *_weights_of(model, name)], int(model.outputs[0].shape[-1])


def _conv(keras, filters: int, kernel: Any, stride: Any, padding: str, name: str):
    stride = stride if isinstance(stride, (list, tuple)) else (stride, stride)
    return keras.layers.Conv2D(int(filters), kernel, strides=stride, padding=padding, name=name)


def visionnet(shape: Sequence[int], model: Mapping[str, Any], num_outputs: int | None, filters: list,
              name: str = "") -> tuple[Layout, int]:
    """RLlib's ``VisionNetwork`` (``base_model``) for images of ``shape`` and the given ``filters``:
    ``(layout, width of its output)``."""
    keras = _keras()
    layers = keras.layers
    post = [int(h) for h in model.get("post_fcnet_hiddens") or []]
    inputs = layers.Input(shape=tuple(int(d) for d in shape), name="observations")
    last, flattened = inputs, False
    for i, (size, kernel, stride) in enumerate(filters[:-1], 1):
        last = _conv(keras, size, kernel, stride, "same", f"conv{i}")(last)
    size, kernel, stride = filters[-1]
    if model.get("no_final_linear") and num_outputs:
        last = _conv(keras, post[0] if post else num_outputs, kernel, stride, "valid", "conv_out")(last)
        feature = last
        for i, out in enumerate(post[:-1] + ([num_outputs] if post else [])):
            feature, last = last, layers.Dense(out, name=f"post_fcnet_{i}")(last)
    else:
        last = _conv(keras, size, kernel, stride, "valid", f"conv{len(filters)}")(last)
        if num_outputs:
            if post:
                last = _conv(keras, post[0], [1, 1], 1, "same", "conv_out")(last)
                for i, out in enumerate(post[1:] + [num_outputs]):
                    feature, last = last, layers.Dense(out, name=f"post_fcnet_{i + 1}")(last)
            else:
                feature = last
                last = _conv(keras, num_outputs, [1, 1], 1, "same", "conv_out")(last)
        else:
            flattened = True
            last = layers.Flatten()(last)
            for i, out in enumerate(post):
                last = layers.Dense(out, name=f"post_fcnet_{i}")(last)
            feature = last
    if model.get("vf_share_layers"):
        if not flattened:
            feature = layers.Lambda(lambda x: tf.squeeze(x, axis=[1, 2]))(feature)
        value = layers.Dense(1, name="value_out")(feature)
    else:
        value = inputs
        for i, (size, kernel, stride) in enumerate(filters[:-1], 1):
            value = _conv(keras, size, kernel, stride, "same", f"conv_value_{i}")(value)
        size, kernel, stride = filters[-1]
        value = _conv(keras, size, kernel, stride, "valid", f"conv_value_{len(filters)}")(value)
        value = _conv(keras, 1, [1, 1], 1, "same", "conv_value_out")(value)
        value = layers.Lambda(lambda x: tf.squeeze(x, axis=[1, 2]))(value)
    return _with_width(keras.Model(inputs, [last, value]), name)


def lstm_wrapper(width: int, cell: int, num_outputs: int) -> Layout:
    """``LSTMWrapper``'s ``_rnn_model`` over inputs of ``width`` (features, previous action and reward)."""
    keras = _keras()
    layers = keras.layers
    inputs = layers.Input(shape=(None, width), name="inputs")
    h, c = layers.Input(shape=(cell,), name="h"), layers.Input(shape=(cell,), name="c")
    seq_in = layers.Input(shape=(), name="seq_in", dtype=tf.int32)
    # (RLlib masks the steps with tf.sequence_mask(seq_in), a layer without weights upstream of the
    # LSTM: it moves no weight in Keras's order, and is left out)
    out, state_h, state_c = layers.LSTM(cell, return_sequences=True, return_state=True, name="lstm")(
        inputs=inputs, initial_state=[h, c])
    logits = layers.Dense(num_outputs, name="logits")(out)
    values = layers.Dense(1, name="values")(out)
    return _weights_of(keras.Model([inputs, seq_in, h, c], [logits, values, state_h, state_c]))


def q_heads(width: int, n: int, hiddens: Sequence[int], dueling: bool, atoms: int) -> Layout:
    """``DistributionalQTFModel``'s ``q_value_head`` and (dueling) ``state_value_head``: RLlib's
    unnamed Dense layers get Keras's names in the order they are made (``dense``, ``dense_1``...)."""
    keras = _keras()
    layers = keras.layers
    auto = iter(["dense"] + [f"dense_{i}" for i in range(1, 2 * len(hiddens) + 3)])
    model_out = layers.Input(shape=(width,), name="model_out")
    out = model_out
    for i, size in enumerate(hiddens):
        out = layers.Dense(int(size), name=f"hidden_{i}")(out)
    scores = layers.Dense(n * atoms, name=next(auto))(out) if hiddens else model_out
    found = _weights_of(keras.Model(model_out, scores)) if hiddens else []
    if dueling:
        state = model_out
        for size in hiddens:
            state = layers.Dense(int(size), name=next(auto))(state)
        state = layers.Dense(atoms, name=next(auto))(state)
        found += _weights_of(keras.Model(model_out, state))
    return found


def ddpg_heads(width: int, action_dim: int, actor_hiddens: Sequence[int], critic_hiddens: Sequence[int],
               twin_q: bool) -> Layout:
    """``DDPGTFModel``'s ``policy_model`` (``actor_hidden_i``, ``actor_out``), ``q_model`` and
    (``twin_q``) ``twin_q_model``: a Sequential of ``<q>_hidden_i`` and ``<q>_out`` on the model
    output concatenated with the action."""
    keras = _keras()
    layers = keras.layers
    model_out = layers.Input(shape=(width,), name="model_out")
    out = model_out
    for i, size in enumerate(actor_hiddens):
        out = layers.Dense(int(size), name=f"actor_hidden_{i}")(out)
    found = _weights_of(keras.Model(model_out, layers.Dense(action_dim, name="actor_out")(out))) \
        if actor_hiddens else []
    actions = layers.Input(shape=(action_dim,), name="actions")
    for name in ("q", "twin_q")[:2 if twin_q else 1]:
        net = keras.Sequential([layers.Concatenate(axis=1)]
                               + [layers.Dense(int(u), name=f"{name}_hidden_{i}") for i, u in enumerate(critic_hiddens)]
                               + [layers.Dense(1, name=f"{name}_out")])
        found += _weights_of(keras.Model([model_out, actions], net([model_out, actions])), f"{name}_model/")
    return found


def named_weights(values: Sequence[np.ndarray], layout: Layout, scope: str, where: str) -> dict[str, np.ndarray]:
    """The list ``values`` under the names of ``layout`` (``<scope>/<name>``), in order.

    Raises:
        WeightsError: another number of weights, or any shape that differs from the layout's at
            its place (every mismatch named, with the layout's neighbours when the count differs).
    """
    problems = []
    if len(values) != len(layout):
        shapes = ", ".join(str(list(np.shape(v))) for v in values[:24])
        problems.append(f"the checkpoint holds {len(values)} weights, the network its config describes has "
                        f"{len(layout)} ({', '.join(f'{n} {list(s)}' for n, s in layout[:24])}"
                        f"{', ...' if len(layout) > 24 else ''}); the checkpoint's shapes: {shapes}"
                        f"{', ...' if len(values) > 24 else ''}")
    else:
        for i, ((name, shape), value) in enumerate(zip(layout, values)):
            if tuple(np.shape(value)) != shape:
                problems.append(f"weight {i} is {list(np.shape(value))}, where the network its config describes "
                                f"has {name} {list(shape)}")
    if problems:
        raise WeightsError(where, problems + ["the list of a framework('tf2') checkpoint is read in the order of "
                                              "RLlib's model.variables(); a config that does not describe the "
                                              "network it was trained with cannot be laid onto it"])
    return {f"{scope}/{name}": np.asarray(value) for (name, _), value in zip(layout, values)}


def q_model_width(observation_space: gym.Space, action_space: gym.Space, where: str) -> int:
    """The width of SAC's Q-net input: the observations, with the action concatenated for a Box."""
    obs = int(np.prod(observation_space.shape))
    if isinstance(action_space, gym.spaces.Discrete):
        return obs
    if not (isinstance(observation_space, gym.spaces.Box) and len(observation_space.shape) == 1):
        raise ExportError(f"{where}: SAC's Q-nets on {observation_space} are RLlib's ComplexInputNetwork, whose "
                          f"framework('tf2') weight order is not laid out")
    return obs + int(np.prod(action_space.shape))
