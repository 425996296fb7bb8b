"""RLlib's attention net (``model: {use_attention: True}``: ``AttentionWrapper`` around a ``GTrXLNet``,
ray 2.1-2.9, TF) rebuilt as one step of a served policy from a checkpoint's config and weights.

RLlib serves the attention net one step at a time: per transformer unit ``i`` the caller feeds
``state_in_i``, the last ``attention_memory_inference`` rows (``M``) of that unit's input
``[B, M, attention_dim]`` (zeros at the start of an episode), and RLlib returns one new row per
unit, ``state_out_i`` ``[B, attention_dim]``, which the caller appends to the window (its
attention example: ``state = concat(state[1:], [state_out])``). The export keeps that window as
its state: ``state_out_i`` is the next window ``[B, M, attention_dim]`` (the old one shifted by
the new row), fed back as ``state_in_i`` like an LSTM's ``h``/``c``; RLlib's row is its last row.

One step of the net, for ``T = 1`` (what RLlib computes for a batch of one-step sequences):

1. the wrapped catalog net's features (``fcnet`` with no output layer), then ``GTrXLNet``'s input
   ``Dense(attention_dim)``: ``e``, the row ``state_out_0`` adds;
2. per unit: ``RelativeMultiHeadAttention`` over ``concat(memory, e)`` (``M + 1`` rows): its input
   ``LayerNormalization``, a bias-free ``qkv`` Dense, the query of the last row only, scores
   ``(q + u) . k + (q + v) . R`` over the ``M + 1`` rows with ``R`` the sinusoidal position embedding of
   the offsets ``M .. 0`` through a bias-free ``Dense`` (with one query row RLlib's ``rel_shift``
   is the identity and its causal mask keeps every row), divided by ``sqrt(head_dim)``, softmax,
   the weighted values through a bias-free ``Dense`` with relu; then a ``GRUGate(e, that)``; then
   ``LayerNormalization``, the position-wise MLP (relu, relu) and a second ``GRUGate``: the unit's
   output, the input (and state row) of the next unit;
3. ``AttentionWrapper``'s logits and value ``Dense`` layers on the last unit's output.

Weights are found by the structure of RLlib's Keras names (``mha_<i>/...``,
``pos_wise_mlp_<i>/...``, the unnamed ``dense``/``Variable`` of each layer in the order Keras made
them), each shape checked against the config (:class:`exporter.sources.rllib_nets.NetWeights`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError, WeightsError
from policy_export.exporter.sources.rllib_nets import NetWeights

tf1 = tf.compat.v1
LAYER_NORM_EPSILON = 1e-3  # Keras's LayerNormalization default, which RLlib's layers keep
ATTENTION_DEFAULTS = {"attention_num_transformer_units": 1, "attention_dim": 64, "attention_num_heads": 1,
                      "attention_head_dim": 32, "attention_memory_inference": 50, "attention_position_wise_mlp_dim": 32,
                      "attention_use_n_prev_actions": 0, "attention_use_n_prev_rewards": 0}


@dataclass(frozen=True)
class AttentionConfig:
    """The sizes of RLlib's GTrXL, from the ``model`` config."""

    units: int
    dim: int
    heads: int
    head_dim: int
    memory: int
    mlp: int

    @classmethod
    def of(cls, model: Mapping[str, Any]) -> "AttentionConfig":
        """The config's sizes (checked as integers by :func:`exporter.sources.rllib_checks.check_policy`).

        Raises:
            ExportError: previous actions or rewards fed to the attention net (not rebuilt).
        """
        get = {**ATTENTION_DEFAULTS, **{k: v for k, v in model.items() if k in ATTENTION_DEFAULTS}}
        for key in ("attention_use_n_prev_actions", "attention_use_n_prev_rewards"):
            if get[key]:
                raise ExportError(f"model {key} {int(get[key])}: the attention net fed previous actions or rewards "
                                  f"is not rebuilt from checkpoints")
        return cls(int(get["attention_num_transformer_units"]), int(get["attention_dim"]),
                   int(get["attention_num_heads"]), int(get["attention_head_dim"]),
                   int(get["attention_memory_inference"]), int(get["attention_position_wise_mlp_dim"]))


def _numbered(names: list[str], stem: str) -> list[str]:
    """``names`` of the form ``stem`` or ``stem_<n>``, in Keras's creation order (by ``n``)."""
    pattern = re.compile(rf"{re.escape(stem)}(?:_(\d+))?")
    found = [(int(m.group(1) or 0), name) for name in names if (m := pattern.fullmatch(name))]
    return [name for _, name in sorted(found)]


def _children(w: NetWeights, prefix: str) -> list[str]:
    """The names one level below ``prefix/`` (``prefix`` empty: the top level)."""
    head = f"{prefix}/" if prefix else ""
    return sorted({n[len(head):].split("/", 1)[0] for n in w.arrays if n.startswith(head) and "/" in n[len(head):]}
                  | {n[len(head):] for n in w.arrays if n.startswith(head) and "/" not in n[len(head):]})


def _one(w: NetWeights, prefix: str, stem: str) -> str:
    """The single child of ``prefix`` named ``stem`` or ``stem_<n>``.

    Raises:
        WeightsError: none, or several.
    """
    found = _numbered(_children(w, prefix), stem)
    if len(found) != 1:
        raise WeightsError(w.where, [f"the attention net implies one {prefix}/{stem}* layer, the checkpoint holds "
                                     f"{len(found)}: {', '.join(found[:6]) or 'none'}"])
    return f"{prefix}/{found[0]}"


def _layer_norm(x: tf.Tensor, w: NetWeights, layer: str, dim: int) -> tf.Tensor:
    gamma = tf.constant(w.take(f"{layer}/gamma", (dim,)))
    beta = tf.constant(w.take(f"{layer}/beta", (dim,)))
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + LAYER_NORM_EPSILON) * gamma + beta


def _gru_gate(h: tf.Tensor, x: tf.Tensor, w: NetWeights, layer: str, dim: int) -> tf.Tensor:
    """RLlib's ``GRUGate((h, x))``; its weights ``Variable``, ``Variable_1``... are ``w_r, w_z, w_h,
    u_r, u_z, u_h, bias_z`` in the order its ``build`` adds them."""
    names = _numbered(_children(w, layer), "Variable")
    if len(names) != 7:
        raise WeightsError(w.where, [f"the GRU gate {layer} implies 7 weights, the checkpoint holds {len(names)}"])
    w_r, w_z, w_h, u_r, u_z, u_h = (tf.constant(w.take(f"{layer}/{n}", (dim, dim))) for n in names[:6])
    bias_z = tf.constant(w.take(f"{layer}/{names[6]}", (dim,)))
    r = tf.sigmoid(tf.matmul(x, w_r) + tf.matmul(h, u_r))
    z = tf.sigmoid(tf.matmul(x, w_z) + tf.matmul(h, u_z) - bias_z)
    h_next = tf.tanh(tf.matmul(x, w_h) + tf.matmul(h * r, u_h))
    return (1 - z) * h + z * h_next


def _position_embedding(length: int, dim: int) -> tf.Tensor:
    """RLlib's ``PositionalEmbedding(dim)(length)``: the offsets ``length - 1 .. 0``, sin then cos."""
    inverse_freq = 1 / (10000 ** (tf.range(0, dim, 2.0) / dim))
    offsets = tf.cast(tf.range(length - 1, -1, -1), tf.float32)
    inputs = offsets[:, None] * inverse_freq[None, :]
    return tf.concat((tf.sin(inputs), tf.cos(inputs)), axis=-1)


def _attention(e: tf.Tensor, memory: tf.Tensor, u: np.ndarray, v: np.ndarray, w: NetWeights, layer: str,
               cfg: AttentionConfig) -> tf.Tensor:
    """``RelativeMultiHeadAttention`` (input layer norm, relu output) for the one query row ``e``."""
    h, d, rows = cfg.heads, cfg.head_dim, cfg.memory + 1
    dense = _numbered(_children(w, layer), "dense")
    if len(dense) != 2:
        raise WeightsError(w.where, [f"{layer} implies 2 unnamed Dense layers (qkv, position projection), the "
                                     f"checkpoint holds {len(dense)}"])
    seq = _layer_norm(tf.concat([memory, e[:, None]], axis=1), w, _one(w, layer, "layer_normalization"), cfg.dim)
    qkv = tf.tensordot(seq, tf.constant(w.take(f"{layer}/{dense[0]}/kernel", (cfg.dim, 3 * h * d))), axes=1)
    queries, keys, values = tf.split(qkv, 3, -1)
    query = tf.reshape(queries[:, -1], (-1, 1, h, d))
    keys, values = tf.reshape(keys, (-1, rows, h, d)), tf.reshape(values, (-1, rows, h, d))
    position = _position_embedding(rows, cfg.dim)
    pos_kernel = w.take(f"{layer}/{dense[1]}/kernel", (int(position.shape[-1]), h * d))
    r = tf.reshape(tf.matmul(position, tf.constant(pos_kernel)), (1, rows, h, d))
    score = tf.reduce_sum((query + u) * keys, -1) + tf.reduce_sum((query + v) * r, -1)  # [B, rows, H]
    weights = tf.nn.softmax(score / d ** 0.5, axis=1)
    out = tf.reshape(tf.reduce_sum(weights[..., None] * values, axis=1), (-1, h * d))
    linear = _one(w, layer, "time_distributed")
    return tf.nn.relu(tf.matmul(out, tf.constant(w.take(f"{linear}/kernel", (h * d, cfg.dim)))))


def _unit(e: tf.Tensor, memory: tf.Tensor, uv: tuple[np.ndarray, np.ndarray], w: NetWeights, i: int,
          cfg: AttentionConfig) -> tf.Tensor:
    """Transformer unit ``i`` (1-based) of ``GTrXLNet`` for the current row ``e`` and its memory."""
    mha = f"mha_{i}"
    with tf1.name_scope(mha):
        attended = _attention(e, memory, *uv, w, _one(w, mha, "relative_multi_head_attention"), cfg)
        gated = _gru_gate(e, attended, w, _one(w, mha, "gru_gate"), cfg.dim)
    mlp = f"pos_wise_mlp_{i}"
    with tf1.name_scope(mlp):
        sequential = _one(w, mlp, "sequential")
        x = _layer_norm(gated, w, _one(w, sequential, "layer_normalization"), cfg.dim)
        ff = _one(w, sequential, "positionwise_feedforward")
        dense = _numbered(_children(w, ff), "dense")
        if len(dense) != 2:
            raise WeightsError(w.where, [f"{ff} implies 2 Dense layers, the checkpoint holds {len(dense)}"])
        x = w.dense(x, f"{ff}/{dense[0]}", cfg.mlp, tf.nn.relu)
        x = w.dense(x, f"{ff}/{dense[1]}", cfg.dim, tf.nn.relu)
        return _gru_gate(gated, x, w, _one(w, mlp, "gru_gate"), cfg.dim)


def attention_step(features: tf.Tensor, state_in: list[tf.Tensor], w: NetWeights, cfg: AttentionConfig,
                   num_outputs: int) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
    """One step of ``AttentionWrapper``: ``(logits, values, rows)`` from the wrapped net's
    ``features`` [B, F] and each unit's memory window ``state_in[i]`` [B, M, dim]; ``rows[i]`` is
    RLlib's ``state_out_i`` (the input row of unit ``i``).

    Raises:
        WeightsError: a layer the config implies that the checkpoint lacks or holds in another shape.
    """
    top = _children(w, "")
    dense = _numbered(top, "dense")
    uv = _numbered(top, "Variable")
    if len(dense) != 3 or len(uv) != 2 * cfg.units:
        raise WeightsError(w.where, [f"the attention net of {cfg.units} unit(s) implies 3 unnamed Dense layers "
                                     f"(input, logits, values) and {2 * cfg.units} position biases at the top, the "
                                     f"checkpoint holds {len(dense)} and {len(uv)}"])
    with tf1.name_scope("gtrxl"):
        e = w.dense(features, dense[0], cfg.dim)
        rows = []
        for i in range(cfg.units):
            rows.append(e)
            u, v = (w.take(name, (cfg.heads, cfg.head_dim)) for name in uv[2 * i:2 * i + 2])
            e = _unit(e, state_in[i], (u[None, None], v[None, None]), w, i + 1, cfg)
    logits = w.dense(e, dense[1], num_outputs)
    values = w.dense(e, dense[2], 1)
    return logits, values, rows
