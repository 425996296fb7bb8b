"""The action head: what a policy serves on top of its action distribution's inputs.

Every policy the package builds, or rebuilds from an RLlib checkpoint or a Keras base model, ends
in :func:`action_head`; a wrapped RLlib graph keeps its own head and gets its deterministic path
from :func:`deterministic_outputs`. On the distribution inputs and the ``explore`` placeholder
:func:`action_head` builds:

- the raw actions: ``tf.cond(explore, sample, deterministic_sample)``, named ``select_action``;
- ``action_logp``, with one of two meanings (``logp``):

  | ``logp`` | explore false | explore true | used by |
  |---|---|---|---|
  | ``"action"`` | log-probability of the deterministic action | of the sample | spec policies |
  | ``"sampled"`` | 0 (``action_prob`` 1) | of the sample | RLlib's ``StochasticSampling`` |

- the served actions ``actions_0..``: each leaf in its space's shape and dtype, Box actions
  clipped to the space's finite bounds unless ``clip`` is false (RLlib's policies return them
  unclipped), then ``transform`` if one is given (an RLlib checkpoint's actions as the
  environment gets them);
- the deterministic path (:func:`deterministic_outputs`): the same outputs without random ops or
  explore switch, under the name scope ``deterministic``; what ``model_deterministic.onnx`` holds.

``action_prob`` is ``exp(action_logp)``: :class:`~policy.tf_policy.TFPolicy` adds it to the
signature; :meth:`ActionHead.outputs` adds it for a graph of its own (the training-time sequence
graph of a recurrent policy).

The distribution is an :class:`~policy.distributions.ActionDistribution` (made from the action
space when a space is given) or any object with its list interface, such as
:class:`~policy.distributions.OneLeaf`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import tensorflow as tf

from policy_export.policy.distributions import ActionDistribution
from policy_export.signatures.keys import ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB, action_key, state_out_key

tf1 = tf.compat.v1

LOGP_MEANINGS = ("action", "sampled")
Transform = Callable[[list[tf.Tensor]], list[tf.Tensor]]


@dataclass
class ActionHead:
    """The tensors :func:`action_head` built.

    ``explore`` is None for a head that serves the deterministic path alone; ``actions``,
    ``action_logp`` and ``raw_actions`` are then the deterministic path's. ``raw_actions`` are the
    distribution's samples before post-processing, one per action leaf (fed with given actions,
    the session scores them).
    """

    distribution: Any
    dist_inputs: tf.Tensor
    explore: tf.Tensor | None
    raw_actions: list[tf.Tensor]
    actions: list[tf.Tensor]
    action_logp: tf.Tensor
    deterministic: dict[str, tf.Tensor] | None

    def outputs(self, state_outputs: Sequence[tf.Tensor] = ()) -> dict[str, tf.Tensor]:
        """The actions, ``state_outputs``, distribution inputs, ``action_logp`` and
        ``action_prob``, keyed and ordered like a policy's signature outputs."""
        out = {action_key(i): a for i, a in enumerate(self.actions)}
        out.update({state_out_key(i): t for i, t in enumerate(state_outputs)})
        out.update({ACTION_DIST_INPUTS: self.dist_inputs, ACTION_LOGP: self.action_logp,
                    ACTION_PROB: tf.exp(self.action_logp)})
        return out


def action_head(distribution: Any, dist_inputs: tf.Tensor, explore: tf.Tensor | None, *, clip: bool = True,
                logp: str = "action", transform: Transform | None = None, deterministic: bool = True,
                extra: Mapping[str, tf.Tensor] | None = None) -> ActionHead:
    """Build the action head on ``dist_inputs`` (see the module docstring).

    Args:
        distribution: the action space (its :class:`ActionDistribution` is made on
            ``dist_inputs``) or a distribution with that class's list interface.
        dist_inputs: the distribution inputs, ``[batch, width]``.
        explore: the bool placeholder choosing sample or deterministic sample; None builds the
            deterministic path alone and serves it (a policy whose exploration cannot be served).
        clip: clip Box actions to the space's finite bounds.
        logp: ``"action"`` or ``"sampled"`` (the table in the module docstring).
        transform: applied to the post-processed actions of both paths.
        deterministic: build the deterministic path (always built when ``explore`` is None).
        extra: further outputs of the deterministic path (extra fetches, state outputs).
    Raises:
        ValueError: ``logp`` is not one of :data:`LOGP_MEANINGS`.
    """
    dist = _distribution(distribution, dist_inputs, logp)
    if explore is None:
        raw, det = _deterministic(dist, dist_inputs, extra, clip, logp, transform)
        return ActionHead(dist, dist_inputs, None, raw, [det[action_key(i)] for i in range(len(raw))],
                          det[ACTION_LOGP], det)
    raw = tf.cond(explore, dist.sample, dist.deterministic_sample, name="select_action")
    raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if logp == "action":
        action_logp = tf.identity(dist.logp(raw), name=ACTION_LOGP)
    else:
        sampled_logp = dist.logp(raw)
        action_logp = tf.cond(explore, lambda: sampled_logp, lambda: tf.zeros_like(sampled_logp), name=ACTION_LOGP)
    actions = [tf.identity(a, name=action_key(i)) for i, a in enumerate(_served(dist, raw, clip, transform))]
    det = _deterministic(dist, dist_inputs, extra, clip, logp, transform)[1] if deterministic else None
    return ActionHead(dist, dist_inputs, explore, raw, actions, action_logp, det)


def deterministic_outputs(distribution: Any, dist_inputs: tf.Tensor, extra: Mapping[str, tf.Tensor] | None = None, *,
                          clip: bool = True, logp: str = "action", transform: Transform | None = None,
                          postprocess: bool = True) -> dict[str, tf.Tensor]:
    """The deterministic path alone, keyed like the signature: no random ops, no explore switch.

    The arguments mean what they mean for :func:`action_head`; ``postprocess`` false serves the
    deterministic sample as the distribution gives it (no reshape, cast or clip), as RLlib's own
    graph does.
    """
    dist = _distribution(distribution, dist_inputs, logp)
    return _deterministic(dist, dist_inputs, extra, clip, logp, transform, postprocess)[1]


def _distribution(distribution: Any, dist_inputs: tf.Tensor, logp: str):
    if logp not in LOGP_MEANINGS:
        raise ValueError(f"logp {logp!r}: expected one of {', '.join(LOGP_MEANINGS)}")
    return ActionDistribution(dist_inputs, distribution) if isinstance(distribution, gym.Space) else distribution


def _deterministic(dist, dist_inputs: tf.Tensor, extra: Mapping[str, tf.Tensor] | None, clip: bool, logp: str,
                   transform: Transform | None, postprocess: bool = True
                   ) -> tuple[list[tf.Tensor], dict[str, tf.Tensor]]:
    """``(raw deterministic actions, deterministic outputs)``."""
    with tf1.name_scope("deterministic"):
        raw = dist.deterministic_sample()
        raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
        action_logp = dist.logp(raw) if logp == "action" else tf.zeros_like(dist_inputs[:, 0])
        out = {action_key(i): tf.identity(a) for i, a in enumerate(_served(dist, raw, clip, transform, postprocess))}
        out.update(extra or {})
        out.update({ACTION_DIST_INPUTS: tf.identity(dist_inputs), ACTION_LOGP: tf.identity(action_logp),
                    ACTION_PROB: tf.exp(action_logp)})
    return raw, out


def _served(dist, raw: list[tf.Tensor], clip: bool, transform: Transform | None,
            postprocess: bool = True) -> list[tf.Tensor]:
    """The raw actions as served: post-processed per leaf (clipped when ``clip``), then transformed."""
    actions = dist.postprocess(raw, clip) if postprocess else list(raw)
    return transform(actions) if transform is not None else actions
