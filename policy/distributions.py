"""Action distributions over the base model's outputs, as TF graph ops.

:class:`ActionDistribution` splits ``action_dist_inputs`` over the action space's leaves
(gymnasium's flatten order) and gives each leaf its distribution:

| leaf | distribution | deterministic action | dtype |
|---|---|---|---|
| Discrete | categorical over ``n`` logits | argmax (+ start) | int64 |
| MultiDiscrete | one categorical per component | argmax per component | int64 |
| MultiBinary | independent Bernoulli per element | ``logit > 0`` | int8 |
| Box (float) | diagonal Gaussian ``[mean, log_std]`` | mean | float32 |

:class:`SquashedGaussian` (RLlib's SAC and CQL head: a Gaussian squashed by ``tanh`` into
``[low, high]``) and :class:`Deterministic` (DDPG's and TD3's actor: the inputs are the action)
are not chosen by the space; a source that knows its policy uses one asks for it (wrapped in
:class:`OneLeaf` for the list interface of :class:`ActionDistribution`).

Box actions, deterministic or sampled, are clipped to the space's finite bounds inside the graph,
so every format computes the same clipped action; ``action_logp`` is the log-density of the
unclipped action.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.errors import UnsupportedSpaceError
from policy_export.policy.spaces import leaves


class Categorical:
    """One categorical over ``n`` logits; actions are ``start + index``."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Discrete):
        self.logits = inputs
        self.start = int(space.start)
        self.n = int(space.n)

    @staticmethod
    def required_inputs(space: gym.spaces.Discrete) -> int:
        return int(space.n)

    def deterministic_sample(self) -> tf.Tensor:
        return self._shift(tf.argmax(self.logits, axis=-1, output_type=tf.int64))

    def sample(self) -> tf.Tensor:
        draws = tf.random.categorical(self.logits, 1, dtype=tf.int64)
        return self._shift(tf.squeeze(draws, axis=-1))

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        # one_hot * log_softmax rather than sparse_softmax_cross_entropy_with_logits: tf2onnx's
        # conversion of the latter mixes up depths when a graph holds several of them
        labels = actions - self.start if self.start else actions
        picked = tf.one_hot(labels, self.n, dtype=self.logits.dtype) * tf.nn.log_softmax(self.logits)
        return tf.reduce_sum(picked, axis=-1)

    def postprocess(self, actions: tf.Tensor) -> tf.Tensor:
        return actions

    def _shift(self, x: tf.Tensor) -> tf.Tensor:
        return x + self.start if self.start else x


class MultiCategorical:
    """One categorical per MultiDiscrete component; actions ``[batch, k]`` int64."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.MultiDiscrete):
        sizes = [int(n) for n in np.asarray(space.nvec).ravel()]
        self.shape = tuple(space.shape)
        self.parts = [Categorical(x, gym.spaces.Discrete(n)) for x, n in zip(tf.split(inputs, sizes, axis=-1), sizes)]

    @staticmethod
    def required_inputs(space: gym.spaces.MultiDiscrete) -> int:
        return int(np.sum(space.nvec))

    def deterministic_sample(self) -> tf.Tensor:
        return tf.stack([p.deterministic_sample() for p in self.parts], axis=-1)

    def sample(self) -> tf.Tensor:
        return tf.stack([p.sample() for p in self.parts], axis=-1)

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        return tf.add_n([p.logp(a) for p, a in zip(self.parts, tf.unstack(actions, axis=-1))])

    def postprocess(self, actions: tf.Tensor) -> tf.Tensor:
        return tf.reshape(actions, (-1, *self.shape)) if len(self.shape) != 1 else actions


class Bernoulli:
    """Independent Bernoulli per MultiBinary element; actions int8 in the space's shape."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.MultiBinary):
        self.logits = inputs
        self.shape = tuple(int(d) for d in space.shape)

    @staticmethod
    def required_inputs(space: gym.spaces.MultiBinary) -> int:
        return int(np.prod(space.shape))

    def deterministic_sample(self) -> tf.Tensor:
        return tf.cast(self.logits > 0.0, tf.int8)

    def sample(self) -> tf.Tensor:
        u = tf.random.uniform(tf.shape(self.logits), dtype=self.logits.dtype)
        return tf.cast(u < tf.sigmoid(self.logits), tf.int8)

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        x = tf.cast(actions, self.logits.dtype)
        return tf.reduce_sum(x * tf.math.log_sigmoid(self.logits) + (1.0 - x) * tf.math.log_sigmoid(-self.logits), axis=-1)

    def postprocess(self, actions: tf.Tensor) -> tf.Tensor:
        return tf.reshape(actions, (-1, *self.shape)) if len(self.shape) != 1 else actions


class DiagGaussian:
    """A diagonal Gaussian: the inputs are ``[mean, log_std]`` over the flattened action."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Box):
        self.shape = tuple(int(d) for d in space.shape)
        self.size = int(np.prod(self.shape))
        self.mean, self.log_std = tf.split(inputs, 2, axis=-1)
        self.low = np.asarray(space.low, np.float32).reshape(-1)
        self.high = np.asarray(space.high, np.float32).reshape(-1)
        self.dtype = tf.as_dtype(space.dtype)

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

    def postprocess(self, actions: tf.Tensor, clip: bool = True) -> tf.Tensor:
        """Clip to the finite bounds (unless ``clip`` is false), reshape to the space's shape, cast
        to its dtype."""
        if clip and (np.isfinite(self.low).any() or np.isfinite(self.high).any()):
            low = np.where(np.isfinite(self.low), self.low, np.finfo(np.float32).min)
            high = np.where(np.isfinite(self.high), self.high, np.finfo(np.float32).max)
            actions = tf.clip_by_value(actions, low, high)
        if self.shape != (self.size,):
            actions = tf.reshape(actions, (-1, *self.shape))
        return tf.cast(actions, self.dtype) if self.dtype != actions.dtype else actions


class SquashedGaussian(DiagGaussian):
    """RLlib's ``SquashedGaussian``: ``[mean, log_std]`` with ``log_std`` clipped to
    ``[-5, 2]``, samples squashed by ``tanh`` into ``[low, high]`` (default the normalised
    ``[-1, 1]``); the deterministic action is the squashed mean."""

    LOG_STD_RANGE = (-5.0, 2.0)
    SMALL_NUMBER = 1e-6

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Box, low: float = -1.0, high: float = 1.0):
        super().__init__(inputs, space)
        self.log_std = tf.clip_by_value(self.log_std, *self.LOG_STD_RANGE)
        self.squash_low, self.squash_high = float(low), float(high)

    def deterministic_sample(self) -> tf.Tensor:
        return self._squash(self.mean)

    def sample(self) -> tf.Tensor:
        return self._squash(super().sample())

    def logp(self, actions: tf.Tensor) -> tf.Tensor:
        span = self.squash_high - self.squash_low
        normed = tf.clip_by_value((actions - self.squash_low) / span * 2.0 - 1.0,
                                  -1.0 + self.SMALL_NUMBER, 1.0 - self.SMALL_NUMBER)
        raw = tf.math.atanh(normed)
        z = (raw - self.mean) / tf.exp(self.log_std)
        gaussian = tf.clip_by_value(-0.5 * tf.square(z) - self.log_std - 0.5 * math.log(2.0 * math.pi), -100.0, 100.0)
        return tf.reduce_sum(gaussian, -1) - tf.reduce_sum(tf.math.log(1 - tf.square(tf.tanh(raw)) + self.SMALL_NUMBER), -1)

    def _squash(self, raw: tf.Tensor) -> tf.Tensor:
        squashed = (tf.tanh(raw) + 1.0) / 2.0 * (self.squash_high - self.squash_low) + self.squash_low
        return tf.clip_by_value(squashed, self.squash_low, self.squash_high)


class Deterministic:
    """RLlib's ``Deterministic``: the inputs are the action (DDPG's and TD3's actor output)."""

    def __init__(self, inputs: tf.Tensor, space: gym.spaces.Box):
        self.inputs = inputs

    def deterministic_sample(self) -> tf.Tensor:
        return tf.identity(self.inputs)

    def postprocess(self, actions: tf.Tensor, clip: bool = True) -> tf.Tensor:
        """The actor's output, served as it is."""
        return actions


class OneLeaf:
    """A single-leaf distribution (:class:`SquashedGaussian`, :class:`Deterministic`) with
    :class:`ActionDistribution`'s list interface, for a source that chooses the distribution."""

    def __init__(self, part):
        self.part = part

    def deterministic_sample(self) -> list[tf.Tensor]:
        return [self.part.deterministic_sample()]

    def sample(self) -> list[tf.Tensor]:
        return [self.part.sample()]

    def logp(self, actions: list[tf.Tensor]) -> tf.Tensor:
        return self.part.logp(actions[0])

    def postprocess(self, actions: list[tf.Tensor], clip: bool = True) -> list[tf.Tensor]:
        return [self.part.postprocess(actions[0], clip)]


_DISTRIBUTIONS = {
    gym.spaces.Discrete: Categorical,
    gym.spaces.MultiDiscrete: MultiCategorical,
    gym.spaces.MultiBinary: Bernoulli,
    gym.spaces.Box: DiagGaussian,
}
SUPPORTED_ACTION_SPACES = tuple(_DISTRIBUTIONS)


def distribution_class(space: gym.Space, where: str = "action_space"):
    """The distribution class for a leaf action space."""
    for space_type, cls in _DISTRIBUTIONS.items():
        if isinstance(space, space_type):
            if isinstance(space, gym.spaces.Box) and not np.issubdtype(space.dtype, np.floating):
                raise UnsupportedSpaceError(f"Box({np.dtype(space.dtype).name})", where,
                                            ["Box (float)", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple"])
            return cls
    raise UnsupportedSpaceError(type(space).__name__, where,
                                ["Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple"])


def _where(leaf) -> str:
    return "action_space" + "".join(f"/{p}" for p in leaf.path)


class ActionDistribution:
    """The joint distribution over every leaf of an action space (lists are in leaf order)."""

    def __init__(self, inputs: tf.Tensor, space: gym.Space):
        self.leaves = list(leaves(space))
        classes = [distribution_class(leaf.space, _where(leaf)) for leaf in self.leaves]
        sizes = [cls.required_inputs(leaf.space) for cls, leaf in zip(classes, self.leaves)]
        chunks = tf.split(inputs, sizes, axis=-1) if len(sizes) > 1 else [inputs]
        self.parts = [cls(x, leaf.space) for cls, x, leaf in zip(classes, chunks, self.leaves)]

    @staticmethod
    def required_inputs(space: gym.Space) -> int:
        return sum(distribution_class(leaf.space, _where(leaf)).required_inputs(leaf.space) for leaf in leaves(space))

    def deterministic_sample(self) -> list[tf.Tensor]:
        return [p.deterministic_sample() for p in self.parts]

    def sample(self) -> list[tf.Tensor]:
        return [p.sample() for p in self.parts]

    def logp(self, actions: list[tf.Tensor]) -> tf.Tensor:
        terms = [p.logp(a) for p, a in zip(self.parts, actions)]
        return terms[0] if len(terms) == 1 else tf.add_n(terms)

    def postprocess(self, actions: list[tf.Tensor], clip: bool = True) -> list[tf.Tensor]:
        """Each leaf's actions in its space's shape and dtype; Box actions clipped to the space's
        finite bounds unless ``clip`` is false (RLlib's policies return them unclipped)."""
        return [p.postprocess(a, clip) if isinstance(p, DiagGaussian) else p.postprocess(a)
                for p, a in zip(self.parts, actions)]
