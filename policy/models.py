"""Keras (tf-keras, Keras 2) base models, and the in-graph preprocessing that feeds them.

Each observation leaf becomes one model input (see :func:`preprocess`): Box leaves as float32
(uint8 scaled by 1/255), Discrete as one-hot, MultiDiscrete as concatenated one-hots,
MultiBinary as float32. Rank-3 Box leaves (HxWxC images) go through ``conv_filters`` when the
spec has them; everything is flattened, concatenated, and passed through ``hiddens``.
Layers are named so that weights match by name: ``fc_1..fc_N``, ``fc_out``, ``<leaf>_conv_<i>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import tensorflow as tf
import tf_keras as keras

from policy_export.policy.layout import ModelInput, input_name, model_inputs, weight_key  # noqa: F401 (re-exported)
from policy_export.policy.spaces import Leaf
from policy_export.policy.spec import ModelConfig

BASE_MODEL_NAME = "base_model"


def preprocess(leaf: Leaf, tensor: tf.Tensor, spec: ModelInput) -> tf.Tensor:
    """Graph ops turning one raw observation leaf into its float32 model input."""
    s = leaf.space
    if isinstance(s, gym.spaces.Box):
        x = tf.cast(tensor, tf.float32)
        if s.dtype == np.uint8:
            x = x * (1.0 / 255.0)
        return x if spec.image else tf.reshape(x, (-1, spec.shape[0]))
    if isinstance(s, gym.spaces.Discrete):
        return tf.one_hot(tensor - int(s.start), int(s.n), dtype=tf.float32)
    if isinstance(s, gym.spaces.MultiDiscrete):
        parts = [tf.one_hot(tensor[:, i], int(n), dtype=tf.float32) for i, n in enumerate(s.nvec)]
        return tf.concat(parts, axis=-1)
    return tf.reshape(tf.cast(tensor, tf.float32), (-1, spec.shape[0]))


class _Seeds:
    """Initializer seeds derived from the spec's seed, one per layer: weights initialised from a
    seed are the same in every process (unseeded Keras initializers draw their own seeds)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.count = 0

    def __call__(self, kind: str = "glorot_uniform"):
        self.count += 1
        value = (self.seed * 7919 + self.count) % (2**31 - 1)
        return {"glorot_uniform": keras.initializers.GlorotUniform,
                "orthogonal": keras.initializers.Orthogonal}[kind](seed=value)


def build_model(inputs: Sequence[ModelInput], config: ModelConfig, num_outputs: int, seed: int = 0) -> keras.Model:
    """Functional model: conv stacks for image inputs, concat, ``fc_1..fc_N``, linear ``fc_out``."""
    seeds = _Seeds(seed)
    encoder = build_encoder(inputs, config, name=BASE_MODEL_NAME, seeds=seeds)
    out = keras.layers.Dense(num_outputs, activation=None, name="fc_out",
                             kernel_initializer=seeds())(encoder.outputs[0])
    return keras.Model(encoder.inputs, out, name=BASE_MODEL_NAME)


def build_encoder(inputs: Sequence[ModelInput], config: ModelConfig, name: str = "encoder",
                  seeds: _Seeds | None = None) -> keras.Model:
    """Conv stacks for image inputs, concat, ``fc_1..fc_N``: per-step features."""
    seeds = seeds or _Seeds(0)
    k_inputs, features = [], []
    for spec in inputs:
        x = keras.Input(shape=spec.shape, name=spec.name, dtype="float32")
        k_inputs.append(x)
        if spec.image:
            for i, (filters, kernel, stride) in enumerate(config.conv_filters, start=1):
                x = keras.layers.Conv2D(filters, kernel, strides=stride, padding="same", activation=config.activation,
                                        name=f"{spec.name}_conv_{i}", kernel_initializer=seeds())(x)
            x = keras.layers.Flatten(name=f"{spec.name}_flatten")(x)
        features.append(x)
    x = features[0] if len(features) == 1 else keras.layers.Concatenate(name="concat_inputs")(features)
    for i, size in enumerate(config.hiddens, start=1):
        x = keras.layers.Dense(size, activation=config.activation, name=f"fc_{i}", kernel_initializer=seeds())(x)
    return keras.Model(k_inputs, x, name=name)


@dataclass
class RecurrentModel:
    """An LSTM policy model: a per-step ``encoder``, the ``lstm`` layer and the ``fc_out`` head.

    ``sequence_model`` is the Keras model over padded sequences (the training-time graph and
    the Keras export): inputs are the obs leaves as ``[T, *shape]``, ``prev_features`` ``[T, P]``
    (when prev action/reward are used), ``mask`` ``[T]`` and the two initial states; outputs are
    the distribution inputs ``[T, num_outputs]`` and the final ``h`` and ``c``.
    """

    encoder: keras.Model
    lstm: keras.layers.LSTM
    head: keras.layers.Dense
    sequence_model: keras.Model
    prev_size: int

    def step(self, step_inputs: list[tf.Tensor], prev_features: tf.Tensor | None,
             state: tuple[tf.Tensor, tf.Tensor]) -> tuple[tf.Tensor, tuple[tf.Tensor, tf.Tensor]]:
        """One step with the LSTM's own cell (no loop): the serving graph. Same weights."""
        x = self.encoder(step_inputs if len(step_inputs) > 1 else step_inputs[0])
        if prev_features is not None:
            x = tf.concat([x, prev_features], axis=-1)
        out, (h, c) = self.lstm.cell(x, list(state))
        return self.head(out), (h, c)


def build_recurrent_model(inputs: Sequence[ModelInput], config: ModelConfig, num_outputs: int,
                          prev_size: int, seed: int = 0) -> RecurrentModel:
    """Encoder, LSTM(``config.lstm.cell_size``) and ``fc_out``, wired as a sequence model."""
    cell = config.lstm.cell_size
    seeds = _Seeds(seed)
    encoder = build_encoder(inputs, config, seeds=seeds)
    lstm = keras.layers.LSTM(cell, return_sequences=True, return_state=True, name="lstm",
                             kernel_initializer=seeds(), recurrent_initializer=seeds("orthogonal"))
    head = keras.layers.Dense(num_outputs, activation=None, name="fc_out", kernel_initializer=seeds())
    seq_inputs = [keras.Input(shape=(None, *spec.shape), name=f"{spec.name}_seq", dtype="float32") for spec in inputs]
    x = keras.layers.TimeDistributed(encoder, name="encoder_steps")(seq_inputs[0] if len(seq_inputs) == 1 else seq_inputs)
    extra = []
    if prev_size:
        prev = keras.Input(shape=(None, prev_size), name="prev_features", dtype="float32")
        extra.append(prev)
        x = keras.layers.Concatenate(name="concat_prev")([x, prev])
    mask = keras.Input(shape=(None,), name="mask", dtype="bool")
    h0 = keras.Input(shape=(cell,), name="state_in_h", dtype="float32")
    c0 = keras.Input(shape=(cell,), name="state_in_c", dtype="float32")
    seq, h, c = lstm(x, mask=mask, initial_state=[h0, c0])
    out = head(seq)
    model = keras.Model([*seq_inputs, *extra, mask, h0, c0], [out, h, c], name=BASE_MODEL_NAME)
    return RecurrentModel(encoder, lstm, head, model, prev_size)


def named_weights(model: keras.Model) -> list[tuple[str, object]]:
    """``(key, variable)`` for every weight of ``model`` in layer order, keyed by :func:`weight_key`."""
    out = []
    for layer in _all_layers(model.layers):
        for w in layer.weights:
            out.append((weight_key(layer.name, w.name), w))
    return out


def _all_layers(layers: Sequence) -> list:
    """Leaf layers, unwrapping nested models and wrappers (TimeDistributed), each once."""
    out, seen = [], set()

    def visit(layer):
        if isinstance(layer, keras.layers.Wrapper):
            visit(layer.layer)
        elif isinstance(layer, keras.Model):
            for sub in layer.layers:
                visit(sub)
        elif id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)

    for layer in layers:
        visit(layer)
    return out
