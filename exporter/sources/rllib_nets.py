"""RLlib's TF networks (old API stack, ray 2.1-2.9) rebuilt from a checkpoint's config and weights.

Each builder lays out the same layers RLlib's model builds, as TF ops over constants taken from
the checkpoint's ``weights`` by variable name (``<scope>/fc_1/kernel``...). Every weight is looked
up and its shape checked against what the config implies before it becomes a constant, so a
checkpoint whose config and weights disagree is refused with each variable named, and nothing is
built from it:

- :func:`fcnet`: ``FullyConnectedNetwork`` (``fcnet_hiddens`` + ``post_fcnet_hiddens``,
  ``fcnet_activation``, ``no_final_linear``, ``vf_share_layers``, ``free_log_std``);
- :func:`lstm_step`: ``LSTMWrapper``'s Keras LSTM cell, one step (gates ``i, f, c, o``), then
  its ``logits`` and ``values`` layers;
- :func:`visionnet`: ``VisionNetwork`` (``conv_filters`` or RLlib's default for the image size,
  ``conv_activation``, ``post_fcnet_hiddens``, ``no_final_linear``, ``vf_share_layers``);
- :func:`ddpg_actor`: DDPG's and TD3's deterministic policy head;
- :func:`q_values`: DQN's ``DistributionalQTFModel`` head (``hiddens``, ``dueling``,
  ``num_atoms`` with ``v_min``/``v_max``), and the mean over non-masked actions RLlib centres the
  advantages with.

What is not rebuilt (the complex-input network, noisy or layer-normalised Q heads, a custom model) is
refused by the caller (:mod:`exporter.sources.checkpoint_policy`) before any of this runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError, WeightsError
from policy_export.exporter.sources.safe_pickle import short_repr
from policy_export.policy.exact import exact_cast

# RLlib's get_activation_fn for TF: "linear" or None is linear, else the (lower-cased) tf.nn function
# of that name: the tf.nn activations, each named here (a name from a file never reaches getattr)
TF_NN_ACTIVATIONS = {"relu": tf.nn.relu, "relu6": tf.nn.relu6, "tanh": tf.tanh, "elu": tf.nn.elu, "selu": tf.nn.selu,
                     "sigmoid": tf.sigmoid, "softplus": tf.nn.softplus, "softsign": tf.nn.softsign,
                     "silu": tf.nn.silu, "swish": tf.nn.silu, "gelu": tf.nn.gelu, "leaky_relu": tf.nn.leaky_relu,
                     "crelu": tf.nn.crelu, "softmax": tf.nn.softmax, "log_softmax": tf.nn.log_softmax}
ACTIVATIONS = {**TF_NN_ACTIVATIONS, "linear": None, None: None}
AUTO_DENSE = "dense"  # Keras's name for an unnamed Dense layer: dense, dense_1, dense_2...


class NetWeights:
    """A checkpoint's weights by layer, under the policy's variable scope (``default_policy/``...).

    ``take(name, shape)`` returns one array after checking its shape; :attr:`used` lists what was
    taken, so the caller can record what the rebuilt network holds and what it left out.
    """

    def __init__(self, weights: Mapping[str, np.ndarray], where: str):
        self.where = where
        names = {name[:-2] if name.endswith(":0") else name: name for name in weights}
        scopes = {name.split("/", 1)[0] for name in names if "/" in name}
        self.scope = scopes.pop() if len(scopes) == 1 else ""
        self.arrays = {(n.split("/", 1)[1] if self.scope and n.startswith(self.scope + "/") else n): weights[raw]
                       for n, raw in names.items()}
        self.used: list[str] = []

    def has(self, name: str) -> bool:
        return name in self.arrays

    def layers(self) -> list[str]:
        return sorted({name.rsplit("/", 1)[0] for name in self.arrays if "/" in name})

    def take(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """The weight ``name`` (relative to the scope) as float32, after checking it has ``shape``.

        Raises:
            WeightsError: no such weight, or another shape.
        """
        full = f"{self.scope}/{name}" if self.scope else name
        if name not in self.arrays:
            raise WeightsError(self.where, [f"the config implies a weight {full} {list(shape)}, which the checkpoint "
                                            f"does not hold (it holds {', '.join(self.layers()) or 'no layers'})"])
        value = np.asarray(self.arrays[name])
        if tuple(value.shape) != tuple(shape):
            raise WeightsError(self.where, [f"weight {full} has shape {list(value.shape)}, the config implies "
                                            f"{list(shape)}"])
        if value.dtype.kind != "f":
            raise WeightsError(self.where, [f"weight {full} is {value.dtype}, not a float array"])
        exact, problem = exact_cast(value, np.float32)
        if problem is not None:
            raise WeightsError(self.where, [f"weight {full} {problem}"])
        self.used.append(full)
        return exact

    def dense(self, x: tf.Tensor, layer: str, units: int, activation: Any = None) -> tf.Tensor:
        """``activation(x @ kernel + bias)`` with the weights of Keras ``Dense`` layer ``layer``."""
        width = int(x.shape[-1])
        kernel = self.take(f"{layer}/kernel", (width, units))
        bias = self.take(f"{layer}/bias", (units,))
        with tf.compat.v1.name_scope(layer):
            k = tf.constant(kernel, name="kernel")
            # Keras's Dense on [B, 1, 1, C] (RLlib's vision net) works on the last axis
            y = (tf.matmul(x, k) if x.shape.rank == 2 else tf.tensordot(x, k, axes=1)) + tf.constant(bias, name="bias")
            return activation(y) if activation is not None else y

    def auto_dense(self) -> list[str]:
        """The unnamed Dense layers (``dense``, ``dense_1``...) in the order Keras created them."""
        def number(layer: str) -> int:
            return 0 if layer == AUTO_DENSE else int(layer.rsplit("_", 1)[1])

        found = [layer for layer in self.layers()
                 if layer == AUTO_DENSE or (layer.startswith(AUTO_DENSE + "_") and layer[6:].isdigit())]
        return sorted(found, key=number)


def activation_fn(name: Any, where: str):
    """RLlib's ``get_activation_fn`` for TF: the function for ``name`` (None for linear).

    Raises:
        ExportError: an activation RLlib's TF models do not know.
    """
    key = name.lower() if isinstance(name, str) else name if name is None else False
    if key is False or key not in ACTIVATIONS:
        raise ExportError(f"{where}: activation {short_repr(name)} is not one this package rebuilds "
                          f"({', '.join(k for k in ACTIVATIONS if k)})")
    return ACTIVATIONS[key]


def fcnet(x: tf.Tensor, w: NetWeights, model: Mapping[str, Any], num_outputs: int | None,
          with_value: bool = True, prefix: str = "") -> tuple[tf.Tensor, tf.Tensor | None]:
    """RLlib's ``FullyConnectedNetwork`` on the flat input ``x``: ``(model output, value_out)``.

    ``num_outputs`` None is the wrapped net of an LSTM (its output is the last hidden layer);
    ``with_value`` false leaves the value branch out (None) where the policy does not serve it;
    ``prefix`` is prepended to layer names.
    """
    hiddens = list(model.get("fcnet_hiddens") or []) + list(model.get("post_fcnet_hiddens") or [])
    act_name = model.get("fcnet_activation") if model.get("fcnet_hiddens") else model.get("post_fcnet_activation")
    act = activation_fn(act_name, "model.fcnet_activation")
    free_log_std = bool(model.get("free_log_std"))
    if free_log_std and num_outputs:
        if num_outputs % 2:
            raise ExportError(f"free_log_std needs an even number of outputs, the action distribution has {num_outputs}")
        num_outputs //= 2
    last, i, out = x, 1, None
    for size in hiddens[:-1]:
        last = w.dense(last, f"{prefix}fc_{i}", int(size), act)
        i += 1
    if model.get("no_final_linear") and num_outputs:
        out = w.dense(last, f"{prefix}fc_out", num_outputs, act)
    else:
        if hiddens:
            last = w.dense(last, f"{prefix}fc_{i}", int(hiddens[-1]), act)
        if num_outputs:
            out = w.dense(last, f"{prefix}fc_out", num_outputs)
    if free_log_std and out is not None:
        log_std = tf.constant(w.take("log_std", (num_outputs,)), name="log_std")
        out = tf.concat([out, tf.tile(log_std[None], [tf.shape(out)[0], 1])], axis=1)
    if not with_value:
        return (out if out is not None else last), None
    value_in = x
    if not model.get("vf_share_layers"):
        for j, size in enumerate(hiddens, start=1):
            value_in = w.dense(value_in, f"{prefix}fc_value_{j}", int(size), act)
    else:
        value_in = last
    value = w.dense(value_in, f"{prefix}value_out", 1)
    return (out if out is not None else last), value


def lstm_step(x: tf.Tensor, state: tuple[tf.Tensor, tf.Tensor], w: NetWeights, cell: int,
              num_outputs: int) -> tuple[tf.Tensor, tf.Tensor, tuple[tf.Tensor, tf.Tensor]]:
    """One step of ``LSTMWrapper``: ``(logits, values, (h, c))`` from ``x`` and the state ``(h, c)``."""
    width = int(x.shape[-1])
    kernel = w.take("lstm/lstm_cell/kernel", (width, 4 * cell))
    recurrent = w.take("lstm/lstm_cell/recurrent_kernel", (cell, 4 * cell))
    bias = w.take("lstm/lstm_cell/bias", (4 * cell,))
    h, c = state
    with tf.compat.v1.name_scope("lstm"):
        z = tf.matmul(x, tf.constant(kernel)) + tf.matmul(h, tf.constant(recurrent)) + tf.constant(bias)
        i, f, g, o = tf.split(z, 4, axis=-1)
        c_new = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h_new = tf.sigmoid(o) * tf.tanh(c_new)
    logits = w.dense(h_new, "logits", num_outputs)
    values = w.dense(h_new, "values", 1)
    return logits, values, (h_new, c_new)


def q_values(model_out: tf.Tensor, w: NetWeights, config: Mapping[str, Any], n: int) -> tf.Tensor:
    """DQN's Q-values for ``n`` actions from the base model's output (``compute_q_values``)."""
    hiddens = [int(h) for h in config.get("hiddens") or []]
    atoms = int(config.get("num_atoms") or 1)
    dueling = bool(config.get("dueling"))
    unnamed = w.auto_dense()
    want = (1 if hiddens else 0) + (len(hiddens) + 1 if dueling else 0)
    if len(unnamed) != want:
        raise WeightsError(w.where, [f"the DQN head implies {want} unnamed Dense layer(s) (action scores"
                                     f"{', state-value hiddens and score' if dueling else ''}), "
                                     f"the checkpoint holds {len(unnamed)}: {', '.join(unnamed) or 'none'}"])
    scores = model_out  # without hiddens the base net's output is the action scores
    if hiddens:
        for i, size in enumerate(hiddens):
            scores = w.dense(scores, f"hidden_{i}", size, tf.nn.relu)
        scores = w.dense(scores, unnamed[0], n * atoms)
    if int(scores.shape[-1]) != n * atoms:
        raise WeightsError(w.where, [f"the DQN action scores have width {int(scores.shape[-1])}, {n} actions x "
                                     f"{atoms} atoms need {n * atoms}"])
    state_score = None
    if dueling:
        state = model_out
        for layer, size in zip(unnamed[-len(hiddens) - 1:-1], hiddens):
            state = w.dense(state, layer, size, tf.nn.relu)
        state_score = w.dense(state, unnamed[-1], atoms)
    if atoms == 1:
        if state_score is None:
            return scores
        return state_score + scores - tf.expand_dims(_mean_ignore_inf(scores), 1)
    return _distributional(scores, state_score, n, atoms, config)


def _mean_ignore_inf(x: tf.Tensor) -> tf.Tensor:
    """RLlib's ``reduce_mean_ignore_inf`` over axis 1 (masked actions are -inf)."""
    mask = tf.not_equal(x, tf.float32.min)
    finite = tf.where(mask, x, tf.zeros_like(x))
    return tf.reduce_sum(finite, 1) / tf.reduce_sum(tf.cast(mask, tf.float32), 1)


def _distributional(scores: tf.Tensor, state_score: tf.Tensor | None, n: int, atoms: int,
                    config: Mapping[str, Any]) -> tf.Tensor:
    """The expected value over the ``atoms`` support points (C51), dueling as RLlib centres it."""
    v_min, v_max = float(config.get("v_min", -10.0)), float(config.get("v_max", 10.0))
    z = v_min + np.arange(atoms, dtype=np.float32) * np.float32((v_max - v_min) / float(atoms - 1))
    logits = tf.reshape(scores, (-1, n, atoms))
    if state_score is not None:
        centred = logits - tf.expand_dims(tf.reduce_mean(logits, 1), 1)
        logits = tf.expand_dims(state_score, 1) + centred
    return tf.reduce_sum(tf.constant(z) * tf.nn.softmax(logits), axis=-1)


# RLlib's get_filter_config: the default conv_filters by image size (height, width)
DEFAULT_CONV_FILTERS = {
    (480, 640): [[16, [24, 32], [14, 18]], [32, [6, 6], 4], [256, [9, 9], 1]],
    (240, 320): [[16, [12, 16], [7, 9]], [32, [6, 6], 4], [256, [9, 9], 1]],
    (96, 96): [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 2]],
    (84, 84): [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 1]],
    (64, 64): [[32, [4, 4], 2], [64, [4, 4], 2], [128, [4, 4], 2], [256, [4, 4], 2]],
    (42, 42): [[16, [4, 4], 2], [32, [4, 4], 2], [256, [11, 11], 1]],
    (10, 10): [[16, [5, 5], 2], [32, [5, 5], 2]],
}


def conv_filters(model: Mapping[str, Any], shape: Sequence[int]) -> list:
    """The model's ``conv_filters``, else RLlib's default for the image size.

    Raises:
        ExportError: no filters given and no default for this size (as RLlib itself refuses).
    """
    filters = model.get("conv_filters")
    if filters:
        return [list(f) for f in filters]
    default = DEFAULT_CONV_FILTERS.get(tuple(int(d) for d in shape[:2]))
    if default is None:
        raise ExportError(f"observations of shape {list(shape)} have no default conv_filters in RLlib, and the "
                          f"config gives none")
    return default


def _pair(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value), int(value)]


def conv(x: tf.Tensor, w: NetWeights, layer: str, spec: Sequence[Any], padding: str, activation: Any) -> tf.Tensor:
    """Keras ``Conv2D`` (channels last) with the weights of ``layer``; ``spec`` = (filters, kernel, stride)."""
    filters, kernel, stride = int(spec[0]), _pair(spec[1]), _pair(spec[2])
    k = w.take(f"{layer}/kernel", (*kernel, int(x.shape[-1]), filters))
    b = w.take(f"{layer}/bias", (filters,))
    with tf.compat.v1.name_scope(layer):
        y = tf.nn.conv2d(x, tf.constant(k), strides=[1, *stride, 1], padding=padding.upper()) + tf.constant(b)
        return activation(y) if activation is not None else y


def visionnet(x: tf.Tensor, w: NetWeights, model: Mapping[str, Any], num_outputs: int | None,
              with_value: bool = True) -> tuple[tf.Tensor, tf.Tensor | None]:
    """RLlib's ``VisionNetwork`` on the float image batch ``x`` [B, H, W, C]: ``(model output, value)``."""
    filters = conv_filters(model, x.shape.as_list()[1:])
    act = activation_fn(model.get("conv_activation", "relu"), "model.conv_activation")
    post = [int(h) for h in model.get("post_fcnet_hiddens") or []]
    post_act = activation_fn(model.get("post_fcnet_activation", "relu"), "model.post_fcnet_activation")
    last = x
    for i, spec in enumerate(filters[:-1], 1):
        last = conv(last, w, f"conv{i}", spec, "same", act)
    flattened = False
    if model.get("no_final_linear") and num_outputs:
        last = conv(last, w, "conv_out", [post[0] if post else num_outputs, *filters[-1][1:]], "valid", act)
        feature = last
        for i, size in enumerate(post[:-1] + ([num_outputs] if post else [])):
            feature, last = last, w.dense(last, f"post_fcnet_{i}", size, post_act)
    else:
        last = conv(last, w, f"conv{len(filters)}", filters[-1], "valid", act)
        if num_outputs:
            if post:
                last = conv(last, w, "conv_out", [post[0], 1, 1], "same", post_act)
                sizes = post[1:] + [num_outputs]
                for i, size in enumerate(sizes):
                    feature, last = last, w.dense(last, f"post_fcnet_{i + 1}", size,
                                                  post_act if i < len(sizes) - 1 else None)
            else:
                feature, last = last, conv(last, w, "conv_out", [num_outputs, 1, 1], "same", None)
            if last.shape[1] != 1 or last.shape[2] != 1:
                raise ExportError(f"conv_filters {filters} do not end in a [B, 1, 1, n] output (RLlib refuses them "
                                  f"too): {last.shape.as_list()}")
        else:
            flattened = True
            last = tf.reshape(last, (-1, int(np.prod(last.shape.as_list()[1:]))))
            for i, size in enumerate(post):
                last = w.dense(last, f"post_fcnet_{i}", size, post_act)
            feature = last
    out = last if flattened else tf.squeeze(last, axis=[1, 2])
    if not with_value:
        return out, None
    if model.get("vf_share_layers"):
        feature = feature if flattened else tf.squeeze(feature, axis=[1, 2])
        return out, w.dense(feature, "value_out", 1)
    value = x
    for i, spec in enumerate(filters[:-1], 1):
        value = conv(value, w, f"conv_value_{i}", spec, "same", act)
    value = conv(value, w, f"conv_value_{len(filters)}", filters[-1], "valid", act)
    value = conv(value, w, "conv_value_out", [1, 1, 1], "same", None)
    return out, tf.squeeze(value, axis=[1, 2])



def ddpg_actor(model_out: tf.Tensor, w: NetWeights, config: Mapping[str, Any], low: np.ndarray,
               high: np.ndarray, bounded: bool) -> tf.Tensor:
    """DDPG's and TD3's policy head (``DDPGTFModel.policy_model``): ``actor_hiddens`` with
    ``actor_hidden_activation``, ``actor_out``, and for a bounded Box ``(high - low) *
    sigmoid(2 x) + low``.

    Raises:
        ExportError: an activation name ``tf.nn`` lacks (RLlib itself would quietly use relu).
    """
    hiddens = [int(h) for h in config.get("actor_hiddens", [256, 256]) or []]
    name = config.get("actor_hidden_activation", "relu")
    if not isinstance(name, str) or name not in TF_NN_ACTIVATIONS:  # DDPG's getattr(tf.nn, name, tf.nn.relu)
        raise ExportError(f"actor_hidden_activation {short_repr(name)}: not one of {', '.join(TF_NN_ACTIVATIONS)}")
    last = model_out
    for i, size in enumerate(hiddens):
        last = w.dense(last, f"actor_hidden_{i}", size, TF_NN_ACTIVATIONS[name])
    out = w.dense(last, "actor_out", int(low.size)) if hiddens else last
    if bounded:  # RLlib squashes every component once any is bounded on both sides
        span = (high - low).astype(np.float32)[None]
        out = span * tf.sigmoid(2.0 * out) + low.astype(np.float32)[None]
    return out
