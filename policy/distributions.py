"""Action distributions over the base model's outputs, as TF graph ops.

Each distribution has ``deterministic_sample()``, ``sample()``, ``logp(actions)`` and
``num_inputs``; actions are float32 for Box and int64 for discrete spaces.

Box actions: the Gaussian's mean is the deterministic action; every action, deterministic or
sampled, is clipped to the space's finite bounds inside the graph, so every format computes the
same clipped action. ``action_logp`` is the log-density of the unclipped action.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy.errors import UnsupportedSpaceError


class Categorical:
    """One categorical over ``n`` logits; actions are ``start + index``."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Discrete):
        self.logits = inputs
        self.start = int(space.start)

    @staticmethod
    def required_inputs(space: gym.spaces.Discrete) -> int:
        return int(space.n)

    def deterministic_sample(self) -> tf.Tensor:
        return self._shift(tf.argmax(self.logits, axis=-1, output_type=tf.int64))

    def sample(self) -> tf.Tensor:
        draws = tf.random.categorical(self.logits, 1, dtype=tf.int64)
        return self._shift(tf.squeeze(draws, axis=-1))

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        labels = actions - self.start if self.start else actions
        return -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=self.logits)

    def postprocess(self, actions: tf.Tensor) -> tf.Tensor:
        return actions

    def _shift(self, x: tf.Tensor) -> tf.Tensor:
        return x + self.start if self.start else x


class DiagGaussian:
    """A diagonal Gaussian: the inputs are ``[mean, log_std]`` over the flattened action."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Box):
        self.shape = tuple(int(d) for d in space.shape)
        self.size = int(np.prod(self.shape))
        self.mean, self.log_std = tf.split(inputs, 2, axis=-1)
        self.low = np.asarray(space.low, np.float32).reshape(-1)
        self.high = np.asarray(space.high, np.float32).reshape(-1)

    @staticmethod
    def required_inputs(space: gym.spaces.Box) -> int:
        return 2 * int(np.prod(space.shape))

    def deterministic_sample(self) -> tf.Tensor:
        return self.mean

    def sample(self) -> tf.Tensor:
        noise = tf.random.normal(tf.shape(self.mean), dtype=self.mean.dtype)
        return self.mean + tf.exp(self.log_std) * noise

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        z = (actions - self.mean) / tf.exp(self.log_std)
        return tf.reduce_sum(-0.5 * tf.square(z) - self.log_std, axis=-1) - 0.5 * math.log(2.0 * math.pi) * self.size

    def postprocess(self, actions: tf.Tensor) -> tf.Tensor:
        """Clip to the finite bounds and reshape to the space's shape."""
        low = np.where(np.isfinite(self.low), self.low, np.finfo(np.float32).min)
        high = np.where(np.isfinite(self.high), self.high, np.finfo(np.float32).max)
        if np.isfinite(self.low).any() or np.isfinite(self.high).any():
            actions = tf.clip_by_value(actions, low, high)
        return tf.reshape(actions, (-1, *self.shape)) if self.shape != (self.size,) else actions


_DISTRIBUTIONS = {gym.spaces.Discrete: Categorical, gym.spaces.Box: DiagGaussian}
SUPPORTED_ACTION_SPACES = tuple(_DISTRIBUTIONS)


def distribution_class(space: gym.Space, where: str = "action_space"):
    """The distribution class for a leaf action space."""
    for space_type, cls in _DISTRIBUTIONS.items():
        if isinstance(space, space_type):
            if isinstance(space, gym.spaces.Box) and not np.issubdtype(space.dtype, np.floating):
                raise UnsupportedSpaceError(f"Box({space.dtype})", where, ["Box(float)", "Discrete"])
            return cls
    raise UnsupportedSpaceError(type(space).__name__, where, [t.__name__ for t in _DISTRIBUTIONS])
