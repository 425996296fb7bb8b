"""Wrap a live RLlib TF policy (old API stack, ``framework("tf")``) as a :class:`TFPolicy`.

``from_rllib(policy)`` takes the session and the tensors RLlib's own ``_build_signature_def``
and ``compute_actions`` use — ``_obs_input``, ``_sampled_action``, ``_sampled_action_logp``,
``_dist_inputs``, ``_state_inputs``/``_state_outputs``, ``_seq_lens``, ``_prev_action_input``,
``_prev_reward_input``, ``_is_exploring``, ``_timestep``, the ``is_training`` placeholder and
``extra_compute_action_fetches()`` (``vf_preds``...) — and returns a :class:`TFPolicy` whose
outputs are exactly what ``policy.compute_actions`` returns. Nothing is imported from ray: the
policy is duck-typed.

The policy's graph is frozen (variables folded into constants: the weights as they are when
``from_rllib`` is called) and imported into a new graph in which RLlib's ``is_exploring``
placeholder (default true) becomes the ``explore`` input with default false; ``is_training``
and ``timestep`` stay optional inputs (defaults false and 0). So the wrapped policy is a
snapshot: train further and call ``from_rllib`` again for new weights.

Also in the copy: unseeded random ops get fixed seeds (the same exploration verdict on every
run), and variable assignments the actions wait for (RLlib's exploration timestep bookkeeping)
are dropped. For a recurrent policy (``use_lstm``) the LSTM's while loop is replaced in the
serving signature by a one-step graph (:mod:`exporter.sources.lstm_step`) and kept as the
training-time sequence graph, so the export gets ONNX and stepped parity.

What the outputs mean is RLlib's: with ``explore`` false the action is the distribution's
deterministic sample (argmax, or the Gaussian mean, unclipped; in the normalised space when the
policy was built with ``normalize_actions``) and ``action_logp`` is 0 (``action_prob`` 1), as
RLlib's ``StochasticSampling`` reports them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.errors import ExportError, InputError, PolicyExportError
from policy_export.exporter.sources.legacy import deterministic_copy, refused_reason
from policy_export.signatures.keys import clean_key
from policy_export.exporter.tfgraph import converter_rewrites, exploration_state, freeze_session
from policy_export.policy.head import deterministic_outputs
from policy_export.policy.spaces import leaf_dtype, leaf_shape, leaves
from policy_export.policy.tf_policy import (
    ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB, EXPLORE, IS_TRAINING, OBSERVATIONS, TIMESTEP, TFPolicy,
    session_config,
)
from policy_export.signatures.keys import action_key, is_state_in, state_out_for

tf1 = tf.compat.v1
log = logging.getLogger(__name__)
SCOPE = "rllib"
# RLlib's action distributions whose deterministic sample the package rebuilds for
# model_deterministic.onnx (argmax, argmax per component, the Gaussian mean, the squashed mean,
# DDPG's/TD3's actor output)
DETERMINISTIC_DISTRIBUTIONS = ("Categorical", "MultiCategorical", "DiagGaussian", "SquashedGaussian", "Deterministic")
ATARI_SHAPES = ((210, 160, 3), (128,))  # RLlib's GenericPixelPreprocessor and AtariRamPreprocessor
ASSIGN_OPS = ("Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def from_rllib(policy: Any, *, observation_space: gym.Space | None = None, action_space: gym.Space | None = None,
               name: str | None = None) -> TFPolicy:
    """A :class:`TFPolicy` computing what the RLlib TF policy ``policy`` computes.

    ``observation_space``: default ``policy.observation_space``, the Box the policy graph takes
    (for Dict observations RLlib's flattened Box). Give the environment's own space (e.g.
    ``policy.observation_space.original_space``) and the export takes raw observations, one input
    per leaf, flattened in the graph as RLlib's preprocessor does (:func:`observation_inputs`).
    ``action_space``: the space of the graph's actions (default ``policy.action_space``; with
    ``normalize_actions`` a Box becomes Box(-1, 1) of the same shape, the space the graph works in).

    Returns:
        the wrapped policy: export it with :func:`export_policy`.
    Raises:
        InputError: ``policy`` is not an old-API-stack RLlib TF policy (no session or no
            observation/action tensors), or ``observation_space`` does not fit its input.
        PolicyExportError: freezing or importing the policy graph failed.
    """
    session = _call(policy, "get_session")
    if session is None or not hasattr(session, "graph"):
        raise InputError("from_rllib needs an RLlib TF policy of the old API stack built with framework('tf') "
                         "(policy.get_session() returned no session)")
    t = _tensors(policy)
    obs_space, flatten = observation_space_for(observation_space or _as_plain(policy.observation_space),
                                               t["obs"].shape.as_list(), t["obs"].dtype.as_numpy_dtype)
    act_space = action_space or _graph_action_space(policy)
    fixed, defaults = _fixed_inputs(policy, t)
    outputs = _output_tensors(t)
    keep = [x for x in (*t["state_in"], t["seq_lens"], t["prev_action"], t["prev_reward"]) if x is not None]
    state = exploration_state(outputs)
    graph_def = _freeze(session, outputs + keep + [t["obs"]])

    graph, new_inputs, obs, explore, is_training, timestep, w, extra = _import_frozen(
        policy, t, graph_def, outputs + keep, obs_space, flatten, fixed, defaults)
    with graph.as_default():
        deterministic = _deterministic_outputs(policy, act_space, w, extra)
    refused = None
    if state:  # exploration with state between calls (DDPG's OU noise): serve the deterministic path
        refused = refused_reason(state)
        w["actions"] = _deterministic_actions(graph, explore if t["is_exploring"] is not None else None,
                                              w["actions"], deterministic, refused)
        t = {**t, "is_exploring": None}
        deterministic = None
    sess = tf1.Session(graph=graph, config=session_config(None))
    policy_out = TFPolicy(
        obs_space, act_space, sess, observations=obs, sampled_action=w["actions"],
        action_logp=w["logp"], action_prob=w["prob"], action_dist_inputs=w["dist_inputs"],
        explore=explore if t["is_exploring"] is not None else None,
        is_training=is_training, timestep=timestep, extra_inputs=new_inputs, extra_fetches=extra,
        state_inputs=w["state_in"], state_outputs=w["state_out"], seq_lens=w["seq_lens"],
        prev_action=w["prev_action"], prev_reward=w["prev_reward"], deterministic_outputs=deterministic,
        name=name or type(policy).__name__,
    )
    wrapped = _one_step(policy_out, _max_seq_len(policy)) if w["state_in"] else policy_out
    wrapped.explore_refused = refused
    return wrapped


def _deterministic_actions(graph, explore, actions: list, deterministic, refused: str) -> list:
    """RLlib's actions with its exploration switch pinned false (or the package's deterministic
    sample), for a policy whose exploration cannot be served statelessly."""
    det = deterministic_copy(graph, explore.op.name, {action_key(i): a for i, a in enumerate(actions)}) \
        if explore is not None else None
    det = det or deterministic
    if not det:
        raise PolicyExportError(refused.replace("it serves the deterministic path only",
                                                "and no deterministic path could be separated from it"))
    return [det[action_key(i)] for i in range(len(actions))]


def _import_frozen(policy, t: dict[str, Any], graph_def, fetched: list, obs_space, flatten, fixed, defaults):
    """Import the frozen RLlib graph into a new graph whose inputs are the package's: observations
    (one per leaf when ``flatten``), ``explore``/``is_training``/``timestep`` with defaults, and the
    fixed inputs as placeholders with their defaults. Returns the graph, the new inputs, and the
    translated tensors ``w`` and extra fetches."""
    graph = tf.Graph()
    with graph.as_default():
        explore = tf1.placeholder_with_default(False, (), name=EXPLORE)
        is_training = tf1.placeholder_with_default(False, (), name=IS_TRAINING)
        timestep = tf1.placeholder_with_default(np.int64(0), (), name=TIMESTEP)
        new_inputs = {key: tf1.placeholder_with_default(value, _static_shape(value), name=key)
                      for key, value in defaults.items()}
        obs, model_in = observation_inputs(obs_space, flatten, t["obs"].dtype)
        replaced = ((t["obs"], model_in), (t["is_exploring"], explore), (t["is_training"], is_training),
                    (t["timestep"], timestep))
        input_map = {old.name: new for old, new in replaced if old is not None}
        input_map.update({fixed[key].name: new_inputs[key] for key in new_inputs})
        present = {node.name for node in graph_def.node}  # freezing pruned what no output needs
        input_map = {k: v for k, v in input_map.items() if k.split(":")[0] in present}
        names = [x.name for x in fetched]
        try:
            imported = tf.graph_util.import_graph_def(graph_def, input_map=input_map, return_elements=names,
                                                      name=SCOPE)
        except (ValueError, tf.errors.OpError) as e:
            raise PolicyExportError(f"importing the frozen RLlib graph failed: {e}") from e
        new = dict(zip(names, imported))
        w = {k: _translate(t[k], new) for k in ("actions", "logp", "prob", "dist_inputs", "state_in",
                                                 "state_out", "seq_lens", "prev_action", "prev_reward")}
        extra = _distinct(w, {k: new[v.name] for k, v in t["extra"].items()})
    return graph, new_inputs, obs, explore, is_training, timestep, w, extra


def _one_step(policy: TFPolicy, max_seq_len: int) -> TFPolicy:
    """A recurrent policy whose LSTM is a while loop: serve a one-step graph, keep the loop.

    The loop (RLlib's Keras LSTM over padded sequences) becomes the training-time
    ``sequence_graph`` and the signature outputs a one-step graph built beside it
    (:mod:`exporter.sources.lstm_step`), so that ONNX conversion works and stepped parity compares
    the step with the loop. When the loop cannot be taken apart, the looped graph is kept as the
    serving graph (the SavedModel and frozen graph work; ONNX conversion of the loop may not).
    """
    from policy_export.exporter.sources.lstm_step import one_step_outputs

    state_in = [k for k in policy.inputs if is_state_in(k)]
    state_out = [state_out_for(k) for k in state_in]
    try:
        outputs, sequence = one_step_outputs(policy.session, policy.inputs, policy.outputs, state_in, state_out,
                                             explore=policy.inputs.get(EXPLORE), max_seq_len=max_seq_len)
    except PolicyExportError as e:
        log.warning("keeping the looped LSTM graph as the serving graph: %s", e)
        return policy
    if sequence is None:
        return policy
    policy.outputs = dict(outputs)
    policy.sequence_graph = sequence
    return policy


def _max_seq_len(policy: Any) -> int:
    config = getattr(policy, "config", None) or {}
    return int(getattr(policy, "_max_seq_len", None) or config.get("model", {}).get("max_seq_len", 20))


def _distinct(w: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Extra fetches that are also another output (DQN's ``q_values``) get their own tensor."""
    taken = {x.name for v in w.values() if v is not None for x in (v if isinstance(v, list) else [v])}
    out = {}
    for key, tensor in extra.items():
        out[key] = tf.identity(tensor, name=f"extra/{key}") if tensor.name in taken else tensor
        taken.add(out[key].name)
    return out


def _translate(value: Any, new: Mapping[str, Any]) -> Any:
    """A tensor (or list of them) of the RLlib graph -> its copy in the imported graph."""
    if value is None:
        return None
    if isinstance(value, list):
        return [new[x.name] for x in value]
    return new[value.name]


def _call(policy: Any, method: str) -> Any:
    fn = getattr(policy, method, None)
    return fn() if callable(fn) else None


def _tensors(policy: Any) -> dict[str, Any]:
    """The tensors RLlib's ``_build_signature_def`` uses, by role."""
    obs = getattr(policy, "_obs_input", None)
    if obs is None and callable(getattr(policy, "get_placeholder", None)):
        obs = policy.get_placeholder("obs")
    sampled = getattr(policy, "_sampled_action", None)
    if obs is None or sampled is None:
        raise InputError("from_rllib: the policy has no observation input or sampled-action tensor "
                         "(_obs_input/_sampled_action); is it an RLlib TF policy (old API stack, framework 'tf')?")
    is_training = getattr(policy, "_is_training", None)
    if is_training is None and callable(getattr(policy, "_get_is_training_placeholder", None)):
        is_training = policy._get_is_training_placeholder()
    extra = dict(_call(policy, "extra_compute_action_fetches") or {})
    logp = getattr(policy, "_sampled_action_logp", None)
    prob = extra.pop(ACTION_PROB, None)
    extra.pop(ACTION_LOGP, None)
    dist_inputs = extra.pop(ACTION_DIST_INPUTS, None)
    dist_inputs = getattr(policy, "_dist_inputs", None) if getattr(policy, "_dist_inputs", None) is not None \
        else dist_inputs
    skipped = [k for k, v in extra.items() if not isinstance(v, tf.Tensor)]
    if skipped:
        log.warning("extra fetches that are not single tensors are left out: %s", skipped)
    return {
        "obs": obs, "actions": list(tf.nest.flatten(sampled)), "logp": logp, "prob": prob,
        "dist_inputs": dist_inputs,
        "state_in": list(getattr(policy, "_state_inputs", None) or []),
        "state_out": list(getattr(policy, "_state_outputs", None) or []),
        "seq_lens": getattr(policy, "_seq_lens", None),
        "prev_action": getattr(policy, "_prev_action_input", None),
        "prev_reward": getattr(policy, "_prev_reward_input", None),
        "is_exploring": getattr(policy, "_is_exploring", None),
        "timestep": getattr(policy, "_timestep", None), "is_training": is_training,
        "extra": {clean_key(k): v for k, v in extra.items() if isinstance(v, tf.Tensor)},
    }


def _fixed_inputs(policy: Any, t: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """RLlib's ``extra_compute_action_feed_dict()``: inputs fed on every call, made optional
    inputs whose defaults are the values fed now."""
    feed = _call(policy, "extra_compute_action_feed_dict") or {}
    known = {x.name for x in (t["obs"], t["is_exploring"], t["timestep"], t["is_training"]) if x is not None}
    fixed, defaults = {}, {}
    for tensor, value in feed.items():
        if not isinstance(tensor, tf.Tensor) or tensor.name in known:
            continue
        key = clean_key(tensor.name)
        fixed[key], defaults[key] = tensor, np.asarray(value, tensor.dtype.as_numpy_dtype)
    return fixed, defaults


def _output_tensors(t: Mapping[str, Any]) -> list:
    single = [t["logp"], t["prob"], t["dist_inputs"]]
    return [*t["actions"], *t["state_out"], *[x for x in single if x is not None], *t["extra"].values()]


def _freeze(session: Any, tensors: list) -> Any:
    """The policy graph with variables folded into constants, pruned to what ``tensors`` need, with
    what converters do not know rewritten (:func:`~exporter.tfgraph.converter_rewrites`: RLlib's
    epsilon schedule loop, TF Probability's ``BroadcastArgs``)."""
    frozen = freeze_session(session, [x.op.name for x in tensors], what="the RLlib policy graph")
    return converter_rewrites(_seed_random_ops(_drop_assignments(frozen)))


def _seed_random_ops(graph_def: Any, seed: int = 1) -> Any:
    """Give every unseeded random op (``seed`` and ``seed2`` both 0) a fixed seed.

    RLlib's graphs are usually built without a graph-level seed, so their sampling ops draw
    differently in every process; seeded, an export's exploration verdict is the same on every run
    (as for spec policies, whose graphs are seeded).
    """
    count = 0
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    for node in nodes:
        if "seed" in node.attr and "seed2" in node.attr and node.attr["seed"].i == 0 and node.attr["seed2"].i == 0:
            count += 1
            node.attr["seed"].i, node.attr["seed2"].i = seed, count
    log.debug("seeded %d random op(s)", count)
    return graph_def


def _drop_assignments(graph_def: Any) -> Any:
    """Remove variable assignments that outputs wait for through control dependencies.

    RLlib's exploration components record the timestep in a variable when actions are computed
    (``EpsilonGreedy``, ``StochasticSampling``) and some make the action wait for it. A serving
    graph keeps no such bookkeeping, and a frozen graph cannot hold an assignment to a constant.

    Raises:
        PolicyExportError: an output reads an assignment's value (not only waits for it).
    """
    dropped = {n.name for n in graph_def.node if n.op in ASSIGN_OPS}
    if not dropped:
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    del out.node[:]
    for node in graph_def.node:
        if node.name in dropped:
            continue
        data = [i for i in node.input if not i.startswith("^") and i.split(":")[0] in dropped]
        if data:
            raise PolicyExportError(f"node {node.name!r} reads the result of the assignment(s) {data}")
        kept = out.node.add()
        kept.CopyFrom(node)
        del kept.input[:]
        kept.input.extend(i for i in node.input if not (i.startswith("^") and i[1:] in dropped))
    log.info("dropped %d variable assignment(s) the actions waited for: %s", len(dropped), sorted(dropped))
    return out


def _deterministic_outputs(policy: Any, act_space: gym.Space, w: Mapping[str, Any],
                           extra: Mapping[str, Any]) -> dict[str, Any] | None:
    """The deterministic path as RLlib computes it (no random ops), for model_deterministic.onnx.

    Only for feed-forward policies with one action leaf and one of RLlib's standard distributions;
    ``None`` otherwise (the export then leaves that format out).
    """
    given = getattr(policy, "dist_class", None)
    dist_class = getattr(given, "func", given)  # may be a functools.partial
    names = {c.__name__ for c in getattr(dist_class, "__mro__", ())}  # DQN: a Categorical subclass
    if w["state_in"] or w["dist_inputs"] is None or len(w["actions"]) != 1 or \
            not names & set(DETERMINISTIC_DISTRIBUTIONS):
        return None
    dist = _package_distribution(w["dist_inputs"], act_space, names, getattr(given, "keywords", None) or {})
    if dist is None:
        return None
    # RLlib's meanings: the deterministic sample as its graph returns it (not post-processed),
    # logp 0, prob 1
    out = deterministic_outputs(dist, w["dist_inputs"], {k: tf.identity(v) for k, v in extra.items()},
                                logp="sampled", postprocess=False)
    det, action = out[action_key(0)], w["actions"][0]
    if det.dtype != action.dtype or det.shape.as_list() != action.shape.as_list():
        log.info("no deterministic path: %s %s differs from RLlib's action %s %s",
                 det.dtype.name, det.shape, action.dtype.name, action.shape)
        return None
    return out


def _package_distribution(inputs, act_space: gym.Space, names: set[str], keywords: Mapping[str, Any]):
    """The package's distribution for RLlib's (one action leaf), or ``None``."""
    from policy_export.policy.distributions import ActionDistribution, Deterministic, OneLeaf, SquashedGaussian

    if names & {"SquashedGaussian", "Deterministic"}:
        if not isinstance(act_space, gym.spaces.Box):
            return None
        if "Deterministic" in names:
            return OneLeaf(Deterministic(inputs, act_space))
        return OneLeaf(SquashedGaussian(inputs, act_space, keywords.get("low", -1.0), keywords.get("high", 1.0)))
    try:
        dist = ActionDistribution(inputs, act_space)
    except (PolicyExportError, ValueError) as e:
        log.info("no deterministic path: %s", e)
        return None
    return dist if len(dist.parts) == 1 else None


def _graph_action_space(policy: Any) -> gym.Space:
    space = _as_plain(policy.action_space)
    config = getattr(policy, "config", None) or {}
    if isinstance(space, gym.spaces.Box) and config.get("normalize_actions"):
        return gym.spaces.Box(-1.0, 1.0, space.shape, np.float32)
    return space


def _as_plain(space: gym.Space) -> gym.Space:
    """A gymnasium Box without RLlib's extra attributes (``original_space``)."""
    if isinstance(space, gym.spaces.Box):
        return gym.spaces.Box(space.low, space.high, space.shape, space.dtype)
    return space


def _static_shape(value: np.ndarray) -> tuple:
    return tuple(value.shape)


# ---------------------------------------------------------------------------- RLlib's preprocessor


def observation_space_for(given: gym.Space | None, shape: list | None, dtype: Any) -> tuple[gym.Space, bool]:
    """The observation space and whether it is flattened in the graph as RLlib's preprocessor does.

    Raises:
        ExportError: the model's input has unknown dimensions.
        InputError: ``given`` does not fit the input (neither its shape nor, flattened, its width).
    """
    if shape is None or None in shape[1:]:
        raise ExportError(f"the model's observation input has unknown dimensions {_fmt_shape(shape)}")
    if given is None:
        low, high = (-1.0, 1.0) if np.issubdtype(dtype, np.floating) else (0, 1)
        return gym.spaces.Box(low, high, tuple(shape[1:]), dtype), False
    if isinstance(given, gym.spaces.Box) and tuple(given.shape) == tuple(shape[1:]):
        if np.dtype(given.dtype) != np.dtype(dtype):
            given = gym.spaces.Box(given.low.astype(dtype), given.high.astype(dtype), given.shape, dtype)
        return given, False
    width = preprocessor_width(given)
    if len(shape) != 2 or width != shape[1]:
        raise InputError(f"observation space {given} does not fit the model's input {_fmt_shape(shape)}: as RLlib's "
                         f"preprocessor flattens it (Discrete one-hot, Box flattened) it has width {width}")
    return given, True


def preprocessor_width(space: gym.Space) -> int:
    """The width of ``space`` flattened as RLlib's default preprocessors do (one-hot for Discrete).

    Raises:
        InputError: a leaf RLlib would preprocess otherwise (Atari frames and RAM) or cannot take.
    """
    width = 0
    for leaf in leaves(space):
        sub = leaf.space
        where = "observation_space" + "".join(f"/{p}" for p in leaf.path)
        if isinstance(sub, gym.spaces.Box) and tuple(sub.shape) in ATARI_SHAPES:
            raise InputError(f"{where}: RLlib preprocesses Atari-shaped observations {tuple(sub.shape)} "
                             f"itself; give the Box the model takes instead")
        if isinstance(sub, gym.spaces.Discrete):
            width += int(sub.n)
        elif isinstance(sub, gym.spaces.MultiDiscrete):
            width += int(np.sum(sub.nvec))
        elif isinstance(sub, (gym.spaces.Box, gym.spaces.MultiBinary)):
            width += int(np.prod(sub.shape))
        else:
            raise InputError(f"{where}: {type(sub).__name__} cannot be flattened like RLlib's preprocessor")
    return width


def flatten_like_preprocessor(space: gym.Space, placeholders: dict, dtype: Any):
    """The leaves' placeholders flattened and concatenated in order, as RLlib's preprocessor does."""
    parts = []
    for leaf, x in zip(leaves(space), placeholders.values()):
        sub = leaf.space
        if isinstance(sub, gym.spaces.Discrete):
            parts.append(tf.one_hot(x - int(sub.start), int(sub.n), dtype=dtype))
        elif isinstance(sub, gym.spaces.MultiDiscrete):
            nvec = np.asarray(sub.nvec).ravel()
            flat = tf.reshape(x, (-1, len(nvec)))
            parts.extend(tf.one_hot(flat[:, i], int(n), dtype=dtype) for i, n in enumerate(nvec))
        else:
            parts.append(tf.reshape(tf.cast(x, dtype), (-1, int(np.prod(sub.shape)))))
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=-1)


def observation_inputs(obs_space: gym.Space, flatten: bool, dtype: Any):
    """``(observations, model input)``: one placeholder, or one per leaf flattened as RLlib does."""
    if not flatten:
        obs = tf1.placeholder(dtype, [None, *obs_space.shape], name=OBSERVATIONS)
        return obs, obs
    obs = {leaf.key(OBSERVATIONS): tf1.placeholder(tf.as_dtype(leaf_dtype(leaf.space)), (None, *leaf_shape(leaf.space)),
                                                   name=leaf.key(OBSERVATIONS))
           for leaf in leaves(obs_space)}
    with tf1.name_scope("rllib_preprocessor"):
        model_in = flatten_like_preprocessor(obs_space, obs, dtype)
    return (obs[OBSERVATIONS] if set(obs) == {OBSERVATIONS} else obs), model_in


def _fmt_shape(shape: list | None) -> str:
    if shape is None:
        return "[unknown rank]"
    return "[" + ", ".join("batch" if d is None else str(d) for d in shape) + "]"
