"""Graph pieces that the feed-forward and the recurrent policy builders share.

:mod:`policy.tf_policy` and :mod:`policy.recurrent` both import from here, so neither needs the
other at import time: the result record of ``compute_actions``, the deterministic output path,
session options, and un-flattening of action leaves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf
from policy_export.policy.spaces import nest_from_leaves
from policy_export.signatures.keys import action_key

tf1 = tf.compat.v1

from policy_export.signatures.keys import ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB  # noqa: E402,F401 (re-exported)


@dataclass(frozen=True)
class ActionResult:
    """What :meth:`TFPolicy.compute_actions` returns.

    ``actions``: a batch array for a flat action space; for Dict/Tuple spaces the same nest
    (dict/tuple) of batch arrays. ``fetches``: every output of the policy, keyed by signature key
    (``actions_0..`` in gymnasium's flatten order).
    """

    actions: Any
    state_out: list[np.ndarray] = field(default_factory=list)
    fetches: dict[str, np.ndarray] = field(default_factory=dict)


def deterministic_path(dist, dist_inputs: tf.Tensor, extra: Mapping[str, tf.Tensor] | None = None) -> dict[str, tf.Tensor]:
    """Output tensors of the deterministic path alone: no random ops, no explore switch."""
    with tf1.name_scope("deterministic"):
        det = dist.deterministic_sample()
        logp = dist.logp(det)
        out = {action_key(i): tf.identity(a) for i, a in enumerate(dist.postprocess(det))}
        out.update(extra or {})
        out.update({ACTION_DIST_INPUTS: tf.identity(dist_inputs), ACTION_LOGP: tf.identity(logp),
                    ACTION_PROB: tf.exp(logp)})
    return out


def unflatten(space: gym.Space, arrays: Sequence[np.ndarray]) -> Any:
    """Leaf arrays in flatten order -> the space's nest (dict/tuple) of arrays; one leaf stays bare."""
    return nest_from_leaves(space, list(arrays))


def session_config(device: str | None) -> tf1.ConfigProto:
    """Session options: soft placement; no GPU at all when ``device`` is a CPU device."""
    config = tf1.ConfigProto(allow_soft_placement=True)
    if device is not None and "CPU" in device.upper():
        config.device_count["GPU"] = 0
    else:
        config.gpu_options.allow_growth = True
    return config
