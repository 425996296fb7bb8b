"""The signature-key vocabulary: every input and output key an exported policy can have.

Clients feed and fetch by these keys in every format (SavedModel signature, frozen-graph tensor
names in the manifest, ONNX input and output names), so they are defined once, here.

Inputs: ``observations`` (or ``observations/<nest path>`` per leaf of a Dict/Tuple space),
``state_in_<i>``, ``seq_lens``, ``prev_action``, ``prev_reward``, and the optional switches
``explore``, ``is_training``, ``timestep``. Outputs: ``actions_<i>`` (one per action leaf, in
gymnasium's flatten order), ``state_out_<i>``, ``action_dist_inputs``, ``action_logp``,
``action_prob``, and any extra outputs the policy declares.
"""

from __future__ import annotations

import re

OBSERVATIONS = "observations"
EXPLORE = "explore"
IS_TRAINING = "is_training"
TIMESTEP = "timestep"
SEQ_LENS = "seq_lens"
PREV_ACTION = "prev_action"
PREV_REWARD = "prev_reward"
PREV_PREFIX = "prev_"

ACTIONS_PREFIX = "actions_"
STATE_IN_PREFIX = "state_in_"
STATE_OUT_PREFIX = "state_out_"
ACTION_DIST_INPUTS = "action_dist_inputs"
ACTION_LOGP = "action_logp"
ACTION_PROB = "action_prob"

# inputs RLlib-style graphs may carry besides observations and state (what ``convert`` recognises)
KNOWN_INPUTS = (OBSERVATIONS, IS_TRAINING, SEQ_LENS, PREV_ACTION, PREV_REWARD, TIMESTEP, EXPLORE)
KNOWN_OUTPUTS = (ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB)


def action_key(i: int) -> str:
    """The key of the ``i``-th action leaf: ``actions_<i>``."""
    return f"{ACTIONS_PREFIX}{i}"


def state_in_key(i: int) -> str:
    return f"{STATE_IN_PREFIX}{i}"


def state_out_key(i: int) -> str:
    return f"{STATE_OUT_PREFIX}{i}"


def is_action(key: str) -> bool:
    return key.startswith(ACTIONS_PREFIX)


def is_state_in(key: str) -> bool:
    return key.startswith(STATE_IN_PREFIX)


def is_state_out(key: str) -> bool:
    return key.startswith(STATE_OUT_PREFIX)


def is_observation(key: str) -> bool:
    """``observations`` itself or one of its leaves (``observations/<path>``)."""
    return key == OBSERVATIONS or key.startswith(OBSERVATIONS + "/")


def is_per_step(key: str) -> bool:
    """An input with one row per step: observations and the previous action and reward."""
    return is_observation(key) or key.startswith(PREV_PREFIX)


def state_index(key: str) -> int:
    """The index ``i`` of ``state_in_<i>`` or ``state_out_<i>``."""
    return int(key.rsplit("_", 1)[1])


def state_out_for(state_in: str) -> str:
    """``state_out_<i>`` for ``state_in_<i>``."""
    return state_out_key(state_index(state_in))


def clean_key(key: str) -> str:
    """A source's output or tensor name as a signature key: the tensor suffix dropped
    (``fc_out:0`` -> ``fc_out``), every character but letters, digits and ``_/.-`` (which ONNX
    tools dislike) replaced by ``_``. Every source names extra outputs and inputs with it."""
    return re.sub(r"[^A-Za-z0-9_/.-]", "_", key.split(":")[0])
