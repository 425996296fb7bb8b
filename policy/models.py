"""Keras (tf-keras, Keras 2) base models: named layers so that weights match by name."""

from __future__ import annotations

from collections.abc import Sequence

import tf_keras as keras

from policy.spec import ModelConfig

BASE_MODEL_NAME = "base_model"
MODEL_INPUT_NAME = "obs_flat"


def build_mlp(input_dim: int, config: ModelConfig, num_outputs: int) -> keras.Model:
    """A dense network ``fc_1..fc_N`` with ``config.activation``, then a linear ``fc_out``.

    Returns a functional model taking a float32 batch ``(B, input_dim)`` and returning ``(B, num_outputs)``.
    """
    inputs = keras.Input(shape=(input_dim,), name=MODEL_INPUT_NAME, dtype="float32")
    x = inputs
    for i, size in enumerate(config.hiddens, start=1):
        x = keras.layers.Dense(size, activation=config.activation, name=f"fc_{i}")(x)
    out = keras.layers.Dense(num_outputs, activation=None, name="fc_out")(x)
    return keras.Model(inputs, out, name=BASE_MODEL_NAME)


def weight_key(layer_name: str, weight_name: str) -> str:
    """``fc_1`` + ``base_model/fc_1/kernel:0`` -> ``fc_1/kernel``: the name weights are matched by."""
    short = weight_name.split("/")[-1].split(":")[0]
    return f"{layer_name}/{short}"


def named_weights(model: keras.Model) -> list[tuple[str, object]]:
    """``(key, variable)`` for every weight of ``model`` in layer order, keyed by :func:`weight_key`."""
    out = []
    for layer in _all_layers(model.layers):
        for w in layer.weights:
            out.append((weight_key(layer.name, w.name), w))
    return out


def _all_layers(layers: Sequence) -> list:
    out = []
    for layer in layers:
        if isinstance(layer, keras.Model):
            out.extend(_all_layers(layer.layers))
        else:
            out.append(layer)
    return out
