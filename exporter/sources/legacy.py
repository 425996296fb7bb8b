"""Convert an existing TF1 SavedModel (e.g. RLlib's ``export_policy_model``) into a full export.

RLlib's TF1 exports hold the whole training graph (loss, gradients, optimizer slots), key their
recurrent state by raw tensor names (``default_policy/state_in_0:0``) and sample actions by
default through an exploration switch that is in no signature. ``convert``:

- loads only the **serving subgraph**: the nodes the signature's outputs need (plus each kept
  variable's initializer), so the exported SavedModel and frozen graph hold no loss, gradient or
  optimizer nodes; the manifest's ``source.pruned`` records the node counts before and after;
- turns a hidden exploration switch (a bool ``PlaceholderWithDefault`` named ``.../is_exploring``
  that no signature lists) into the contract's optional ``explore`` input with default
  ``false``, so the converted policy is deterministic unless asked to sample; the manifest's
  ``source.explore`` records the original default;
- wraps the result as a :class:`policy.TFPolicy` with stable keys: state inputs and outputs in
  natural order of their raw names become ``state_in_i``/``state_out_i`` (paired shapes must
  agree), ``seq_lens``/``prev_action``/``prev_reward`` keep RLlib's keys and dtypes;
- exports it like any policy: SavedModel with clean keys, frozen graph, ONNX, golden files,
  parity (exploration parity included) and a manifest recording where each key came from.

Spaces are not stored in a SavedModel. Pass them (policy.json space format) to sample the real
domain; otherwise they are inferred from the tensors: a float observation ``[batch, *shape]``
becomes ``Box(-1, 1, shape)``, an int64 ``actions_i`` ``[batch]`` a ``Discrete`` over the width of
``action_dist_inputs``, a float one a ``Box(-1, 1)``. Box actions are what the graph computes:
with RLlib's ``normalize_actions=True`` that is the normalised space, mapped to the env's bounds
outside the graph.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.exporter.devices import plan_devices
from policy_export.exporter.sources.lstm_step import RecurrentServing, rewrite_serving
from policy_export.exporter.tfgraph import VARIABLE_OPS
from policy_export.exporter.trust import VARIABLE_COLLECTIONS
from policy_export.errors import ExportError, InputError, WeightsError
from policy_export.policy.bundleio import checkpoint_prefix
from policy_export.policy.spaces import leaf_dtype, leaf_shape, leaves
from policy_export.policy.tf_policy import TFPolicy, session_config
from policy_export.signatures.builder import find_signature
from policy_export.signatures.keys import (
    ACTION_DIST_INPUTS, ACTION_LOGP, ACTION_PROB, EXPLORE, IS_TRAINING, OBSERVATIONS, PREV_ACTION, PREV_REWARD, SEQ_LENS, TIMESTEP, action_key, is_action, is_observation, state_in_key, state_out_key,
)

tf1 = tf.compat.v1
log = logging.getLogger(__name__)
from policy_export.signatures.keys import KNOWN_INPUTS, KNOWN_OUTPUTS, clean_key  # noqa: E402,F401 (re-exported)
EXPLORE_SWITCH = "is_exploring"


def natural_key(text: str) -> list:
    """``Placeholder_10`` after ``Placeholder_2``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _node(name: str) -> str:
    """``^a/b:0`` -> ``a/b``."""
    return name.lstrip("^").split(":")[0]


# ---------------------------------------------------------------------------- reading and pruning


def read_meta_graph(path: str | Path, tag: str = "serve", proto: Any = None) -> tf1.MetaGraphDef:
    """The MetaGraphDef of the SavedModel at ``path`` whose tags include ``tag``, read with
    :func:`exporter.trust.read_saved_model` (or taken from its already-read ``proto``).

    Raises:
        ExportError: no ``saved_model.pb``, an unreadable file, or no meta graph with that tag.
    """
    from policy_export.exporter.trust import read_saved_model, select_meta_graph

    path = Path(path)
    return select_meta_graph(read_saved_model(path) if proto is None else proto, tag, str(path))


def find_explore_switches(graph_def: tf1.GraphDef, signature: Any) -> list[str]:
    """Node names of hidden exploration switches: bool ``PlaceholderWithDefault`` nodes named
    ``.../is_exploring`` (or ``is_exploring``) that the signature does not list as an input."""
    listed = {_node(t.name) for t in signature.inputs.values()}
    return sorted(n.name for n in graph_def.node
                  if n.op == "PlaceholderWithDefault" and n.name.split("/")[-1] == EXPLORE_SWITCH
                  and n.attr["dtype"].type == tf.bool.as_datatype_enum and n.name not in listed)


@dataclass
class PrunedGraph:
    """The serving subgraph of a SavedModel: a MetaGraphDef to import, and what changed."""

    meta_graph: tf1.MetaGraphDef
    nodes_before: int
    nodes_after: int
    explore_switch: str | None = None
    explore_original_default: bool | None = None
    dropped_collections: list[str] = field(default_factory=list)


def prune_meta_graph(meta: tf1.MetaGraphDef, signature_key: str = "serving_default") -> PrunedGraph:
    """Keep only the nodes the signature needs, and set a hidden exploration switch to ``False``.

    Kept: every node a signature input or output depends on, each hidden exploration switch
    (see :func:`find_explore_switches`) and, for every kept variable, its initializer and
    snapshot nodes (what :func:`tf1.train.import_meta_graph` rebuilds the variable from), and
    the library functions those nodes reach. Variable collections are filtered to the kept
    variables; other collections (optimizer, control-flow contexts, summaries) and the saver
    are dropped.

    Raises:
        ExportError: the signature is missing, or several hidden exploration switches feed it.
    """
    from policy_export.exporter.trust import prune_to_serving

    sig = find_signature(meta, signature_key)
    out = prune_to_serving(meta, signature_key, restore="initializers")
    switches = find_explore_switches(out.graph_def, sig)
    if len(switches) > 1:
        raise ExportError(f"the signature's outputs depend on several exploration switches {switches}; "
                          "convert maps one to the 'explore' input")
    listed = {_node(v.variable_name) for v in _variable_defs(meta).values()}
    unknown = sorted(n.name for n in out.graph_def.node if n.op in VARIABLE_OPS and n.name not in listed)
    if unknown:
        raise ExportError(f"variables {unknown} are used by the signature but listed in no variable collection; "
                          "their values cannot be restored")
    dropped = [name for name in meta.collection_def if name not in VARIABLE_COLLECTIONS]
    pruned = PrunedGraph(out, len(meta.graph_def.node), len(out.graph_def.node), dropped_collections=sorted(dropped))
    if switches:
        pruned.explore_switch = switches[0]
        pruned.explore_original_default = _set_bool_default(out.graph_def, switches[0], False)
    return pruned


def _parse_variable_def(data: bytes):
    from tensorflow.core.framework import variable_pb2

    var = variable_pb2.VariableDef()
    var.ParseFromString(data)
    return var


def _variable_defs(meta: tf1.MetaGraphDef) -> dict[str, Any]:
    out = {}
    for name in VARIABLE_COLLECTIONS:
        if name in meta.collection_def:
            for data in meta.collection_def[name].bytes_list.value:
                var = _parse_variable_def(data)
                out[var.variable_name] = var
    return out


def _set_bool_default(graph_def: tf1.GraphDef, name: str, value: bool) -> bool | None:
    """Give the ``PlaceholderWithDefault`` ``name`` a new constant default; return the old one
    (``None`` when it was not a constant)."""
    nodes = {n.name: n for n in graph_def.node}
    switch = nodes[name]
    old_input = nodes.get(_node(switch.input[0]))
    original = None
    if old_input is not None and old_input.op == "Const":
        original = bool(tf.make_ndarray(old_input.attr["value"].tensor))
    const = graph_def.node.add()
    const.name = f"{name}/converted_default"
    const.op = "Const"
    const.attr["dtype"].type = tf.bool.as_datatype_enum
    const.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.bool))
    switch.input[0] = const.name
    return original


def _restore_variables(session: tf1.Session, graph: tf.Graph, path: Path, weights: Path | None = None) -> dict:
    """Assign every global variable its value from ``path/variables/variables``, or, with
    ``weights`` (a TF1 ``Saver`` checkpoint prefix), from that checkpoint by variable name.

    Both are read by :mod:`policy.bundleio` (never by TensorFlow's reader). With
    ``weights`` every variable the serving graph holds must be in the checkpoint with the same
    shape and dtype, or nothing is assigned. Values are fed into the variables' initializers, so no
    save/restore ops are added. Returns the record for the manifest.

    Raises:
        UnsafeCheckpointError: a variables file or checkpoint that is not read (see :mod:`policy.bundleio`).
        WeightsError: every variable missing from ``weights`` or of another shape or dtype.
    """
    from policy_export.policy.bundleio import read_bundle

    with graph.as_default():
        variables = tf1.global_variables() + tf1.local_variables()
    if not variables:
        return {"variables": 0}
    names = [v.op.name for v in variables]
    values = read_bundle(path / "variables" / "variables", names)
    record: dict = {"variables": len(variables)}
    if weights is not None:
        values = _checkpoint_values(weights, values)
        record.update(weights=str(weights), variables_from_weights=len(values))
    session.run([v.initializer for v in variables],
                {v.initializer.inputs[1]: values[v.op.name] for v in variables})
    return record


def _checkpoint_values(weights: Path, current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The values of ``current``'s variables from the TF1 checkpoint ``weights``, every one checked."""
    from policy_export.policy.bundleio import bundle_entries, read_bundle

    _, entries = bundle_entries(weights)
    problems = []
    for name, value in current.items():
        entry = entries.get(name)
        if entry is None:
            problems.append(f"no variable {name!r} {list(value.shape)}")
        elif entry.dtype is None or tuple(entry.shape) != value.shape or entry.dtype != value.dtype:
            problems.append(f"variable {name!r} is {entry.dtype} {list(entry.shape)}, the SavedModel's "
                            f"{value.dtype} {list(value.shape)}")
    if problems:
        raise WeightsError(str(weights), problems)
    return read_bundle(weights, list(current))


# ---------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class SavedModelFiles:
    """What :func:`load_saved_model_policy` reads besides the SavedModel's own files: ``proto``,
    the SavedModel already read with :func:`exporter.trust.read_saved_model`; ``weights``, a TF1
    ``Saver`` checkpoint (RLlib <= 2.0's ``export_checkpoint``: its prefix, its ``.index`` or its
    directory) whose values replace the SavedModel's variables by name, all checked before any is
    assigned."""

    proto: Any = None
    weights: str | Path | None = None


def load_saved_model_policy(path: str | Path, signature_key: str = "serving_default", tag: str = "serve",
                            device: str = "auto", state_pairs: list[tuple[str, str]] | None = None,
                            observation_space: gym.Space | None = None, action_space: gym.Space | None = None,
                            *, files: "SavedModelFiles | None" = None) -> tuple[TFPolicy, dict[str, Any]]:
    """Load the serving subgraph of a TF1 SavedModel signature as a :class:`TFPolicy`.

    ``state_pairs`` gives the state keys as ``(input key, output key)`` pairs in order; without it,
    state inputs and outputs are paired in natural order of their names (right for RLlib's
    ``state_in_0``/``state_in_1`` with ``Exit_3``/``Exit_4`` or ``Identity_5``/``Identity_6``).
    ``observation_space``/``action_space`` replace the inferred spaces (checked against the tensors).
    ``files``: the SavedModel already read, and a TF1 checkpoint for its variables
    (:class:`SavedModelFiles`).

    Only the pruned serving subgraph (:func:`prune_meta_graph`) is checked
    (:func:`exporter.trust.check_meta_graph`) and handed to TensorFlow; the rest of the file (a
    training graph) is never loaded.

    Returns:
        The policy and the source record for the manifest: ``key_mapping`` (new key -> original
        key), ``pruned`` (node counts), ``explore`` (the hidden switch and its original default,
        if any), ``spaces`` (given or inferred; what the action space means).
    Raises:
        ExportError: not a loadable SavedModel, a signature without observations/actions, state
            keys that do not pair up, or variables that cannot be restored.
        UnsafeModelError: an op the model must not run (see :mod:`exporter.trust`).
        InputError: a given space that does not fit the signature's tensors.
    """
    from policy_export.exporter.trust import open_saved_model

    path = Path(path)
    files = files or SavedModelFiles()
    pruned = prune_meta_graph(read_meta_graph(path, tag, files.proto), signature_key)
    plan = plan_devices(device)
    prefix = None if files.weights is None else checkpoint_prefix(files.weights)
    # checked, then imported into a session whose every run keeps the run limit and stops on
    # signals; the variables get values read by policy.bundleio, not TensorFlow's restore op
    loaded = open_saved_model(path, tag=tag, meta=pruned.meta_graph, config=session_config(plan.tf_device),
                              restore=lambda session: _restore_variables(session, session.graph, path, prefix))
    session = loaded.session
    try:
        inputs, outputs = _signature_tensors(session.graph, pruned, signature_key)
        policy, mapping = _build_policy(path, session.graph, session, inputs, outputs, state_pairs,
                                        observation_space, action_space)
    except (ExportError, InputError, WeightsError):
        session.close()
        raise
    except (OSError, RuntimeError, ValueError, KeyError, tf.errors.OpError) as e:
        session.close()
        raise ExportError(f"cannot load SavedModel {path} with tag {tag!r}: {e}") from e
    restored = loaded.restored
    source = _source_record(pruned, policy, mapping, observation_space is not None, action_space is not None)
    source["variables"] = restored
    return policy, source


def _signature_tensors(graph: tf.Graph, pruned: "PrunedGraph", signature_key: str):
    """The signature's input and output tensors in the imported graph (the hidden exploration
    switch as ``explore``)."""
    sig = find_signature(pruned.meta_graph, signature_key)
    inputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.inputs.items()}
    outputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.outputs.items()}
    if pruned.explore_switch is not None:
        if EXPLORE in inputs:
            raise ExportError(f"the signature has an 'explore' input and a hidden switch {pruned.explore_switch!r}")
        inputs[EXPLORE] = graph.get_tensor_by_name(f"{pruned.explore_switch}:0")
    return inputs, outputs


def _source_record(pruned: "PrunedGraph", policy, mapping: dict[str, str], obs_given: bool,
                   act_given: bool) -> dict[str, Any]:
    """The manifest's ``source`` record of a converted SavedModel (``mapping`` gains ``explore``)."""
    source = {"key_mapping": mapping,
              "pruned": {"nodes_before": pruned.nodes_before, "nodes_after": pruned.nodes_after,
                         "dropped_collections": pruned.dropped_collections},
              "spaces": _spaces_record(policy, obs_given, act_given)}
    if getattr(policy, "explore_refused", None):
        source[EXPLORE] = {"from": pruned.explore_switch, "refused": policy.explore_refused}
    elif pruned.explore_switch is not None:
        source[EXPLORE] = {"from": pruned.explore_switch, "in_source_signature": False,
                             "original_default": pruned.explore_original_default, "default": False}
        mapping[EXPLORE] = f"{pruned.explore_switch}:0"
    return source


def _split_keys(inputs: dict[str, tf.Tensor], outputs: dict[str, tf.Tensor],
                state_pairs: list[tuple[str, str]] | None) -> tuple[dict, list[str], list[str], list[str]]:
    """Observation inputs, action keys, state input keys and state output keys, checked."""
    obs = {k: t for k, t in inputs.items() if is_observation(k)}
    if not obs:
        raise ExportError(f"the signature has no 'observations' input; inputs are {sorted(inputs)}")
    action_keys = sorted((k for k in outputs if re.fullmatch(r"actions(_\d+)?", k)), key=natural_key)
    if not action_keys:
        raise ExportError(f"the signature has no 'actions' output; outputs are {sorted(outputs)}")
    state_in = sorted((k for k in inputs if k not in KNOWN_INPUTS and k not in obs), key=natural_key)
    state_out = sorted((k for k in outputs if ":" in k or k.startswith("state_out")), key=natural_key)
    if state_pairs:
        given_in, given_out = [a for a, _ in state_pairs], [b for _, b in state_pairs]
        if sorted(given_in) != sorted(state_in) or not set(given_out) <= set(outputs):
            raise ExportError(f"state pairs {state_pairs} must name every state input {state_in} once and "
                              f"outputs of the signature ({sorted(outputs)})")
        state_in, state_out = given_in, given_out
    if len(state_in) != len(state_out):
        raise ExportError(f"{len(state_in)} state inputs {state_in} but {len(state_out)} state outputs {state_out}")
    for a, b in zip(state_in, state_out):
        if inputs[a].shape.as_list() != outputs[b].shape.as_list() and None not in outputs[b].shape.as_list()[1:]:
            raise ExportError(f"state input {a!r} {inputs[a].shape} and output {b!r} {outputs[b].shape} do not pair up")
    if state_in and SEQ_LENS not in inputs:
        raise ExportError("the signature has state inputs but no 'seq_lens' input")
    return obs, action_keys, state_in, state_out


def _build_policy(path: Path, graph: tf.Graph, session: tf1.Session, inputs: dict[str, tf.Tensor],
                  outputs: dict[str, tf.Tensor], state_pairs, observation_space, action_space
                  ) -> tuple[TFPolicy, dict[str, str]]:
    obs, action_keys, state_in, state_out = _split_keys(inputs, outputs, state_pairs)
    mapping = {state_in_key(i): k for i, k in enumerate(state_in)}
    mapping.update({state_out_key(i): k for i, k in enumerate(state_out)})
    extras = {}
    for key, tensor in outputs.items():
        if key in action_keys or key in KNOWN_OUTPUTS or key in state_out:
            continue
        extras[clean_key(key)] = tensor
        if clean_key(key) != key:
            mapping[clean_key(key)] = key

    serving_in = {k: t for k, t in inputs.items() if k not in state_in}
    serving_in.update({state_in_key(i): inputs[k] for i, k in enumerate(state_in)})
    serving_out = {action_key(i): _identity(graph, outputs[k], action_key(i)) for i, k in enumerate(action_keys)}
    serving_out.update({state_out_key(i): outputs[k] for i, k in enumerate(state_out)})
    serving_out.update({k: outputs[k] for k in KNOWN_OUTPUTS if k in outputs})
    serving_out.update(extras)
    sequence_graph = None
    if state_in:
        serving = rewrite_serving(RecurrentServing(graph, session, serving_in, serving_out))
        serving_in, serving_out, sequence_graph = serving.inputs, serving.outputs, serving.sequence_graph

    deterministic = None
    if EXPLORE in inputs and not state_in:
        deterministic = deterministic_copy(graph, inputs[EXPLORE].op.name,
                                           {action_key(i): outputs[k] for i, k in enumerate(action_keys)})
    explore_refused = _refuse_stateful_exploration(serving_in, serving_out, deterministic)
    if explore_refused:
        deterministic = None
    obs_t = {k: serving_in[k] for k in obs}
    obs_space = _observation_space(obs_t, observation_space)
    actions = [serving_out[action_key(i)] for i in range(len(action_keys))]
    act_space = _action_space(actions, serving_out.get(ACTION_DIST_INPUTS), action_space)
    n_state = len(state_in)
    policy = TFPolicy(
        obs_space, act_space, session,
        observations=obs_t if len(obs_t) > 1 or OBSERVATIONS not in obs_t else obs_t[OBSERVATIONS],
        sampled_action=actions,
        action_logp=serving_out.get(ACTION_LOGP), action_prob=serving_out.get(ACTION_PROB),
        action_dist_inputs=serving_out.get(ACTION_DIST_INPUTS),
        explore=serving_in.get(EXPLORE), is_training=serving_in.get(IS_TRAINING),
        timestep=serving_in.get(TIMESTEP),
        state_inputs=[serving_in[state_in_key(i)] for i in range(n_state)],
        state_outputs=[serving_out[state_out_key(i)] for i in range(n_state)],
        seq_lens=serving_in.get(SEQ_LENS), prev_action=serving_in.get(PREV_ACTION),
        prev_reward=serving_in.get(PREV_REWARD),
        extra_fetches={k: serving_out[k] for k in extras if k in serving_out}, name=path.name,
        sequence_graph=sequence_graph, deterministic_outputs=deterministic,
    )
    policy.explore_refused = explore_refused
    return policy, mapping


def _refuse_stateful_exploration(serving_in: dict, serving_out: dict, deterministic) -> str | None:
    """Exploration that keeps state between calls (DDPG's Ornstein-Uhlenbeck noise) cannot be
    served statelessly: the actions become RLlib's deterministic path, the ``explore`` input and
    the outputs that read the state go (``serving_in``/``serving_out`` are changed in place).
    Returns the reason, or ``None`` when the serving path keeps no state."""
    from policy_export.exporter.tfgraph import exploration_state

    stateful = exploration_state(list(serving_out.values()))
    if not stateful or deterministic is None:
        return None
    for key in [k for k in serving_out if is_action(k)]:
        serving_out[key] = deterministic[key]
    for key in [k for k, t in serving_out.items() if not is_action(k) and exploration_state([t])]:
        del serving_out[key]
    serving_in.pop(EXPLORE, None)
    return refused_reason(stateful)


def refused_reason(state: list[str]) -> str:
    return (f"exploration keeps state between calls (the serving path reads and writes {', '.join(state)}: "
            "Ornstein-Uhlenbeck noise, say), which a stateless export cannot carry; it serves the "
            "deterministic path only")


def deterministic_copy(graph: tf.Graph, switch: str, fetch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor] | None:
    """``fetch`` (key -> tensor) recomputed with the exploration switch ``switch`` fixed to false:
    a copy of the nodes they need, imported under ``deterministic/``, with the untaken side of
    every ``tf.cond`` on the switch removed (:func:`exporter.tfgraph.fold_constant_switches`) and
    the variable updates the outputs do not read left out. The copy reads the original graph's
    variables and inputs, so it always computes what the session computes with ``explore``
    false; it is what ``model_deterministic.onnx`` holds when RLlib's sampling branch does not
    convert. ``None`` when no ``tf.cond`` depends on the switch."""
    from policy_export.exporter.tfgraph import drop_write_only_updates, fold_constant_switches, pin_bool

    graph_def = graph.as_graph_def()
    nodes = sorted({t.op.name for t in fetch.values()})
    graph_def = tf1.graph_util.extract_sub_graph(graph_def, nodes)
    pin_bool(graph_def, switch, False)
    if not fold_constant_switches(graph_def):
        return None
    graph_def, _ = drop_write_only_updates(graph_def, nodes)
    shared = {n.name for n in graph_def.node if n.op in VARIABLE_OPS or n.op in ("Placeholder", "PlaceholderWithDefault")}
    copy = tf1.GraphDef()
    copy.versions.CopyFrom(graph_def.versions)
    copy.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name in shared:
            continue
        added = copy.node.add()
        added.CopyFrom(node)
        if node.op in ("Enter", "RefEnter"):  # loops of the copy are frames of their own
            added.attr["frame_name"].s = b"deterministic/" + node.attr["frame_name"].s
    input_map = {}
    for node in copy.node:
        for inp in node.input:
            src = inp.lstrip("^").split(":")[0]
            if src in shared:
                key = inp if inp.startswith("^") else (inp if ":" in inp else f"{inp}:0")
                input_map[key] = graph.get_operation_by_name(src) if inp.startswith("^") else \
                    graph.get_tensor_by_name(key)
    controls = {k: v for k, v in input_map.items() if k.startswith("^")}
    for node in copy.node:  # control edges to shared nodes are dropped: they only order reads
        keep = [i for i in node.input if i not in controls]
        del node.input[:]
        node.input.extend(keep)
    names = [t.name for t in fetch.values()]
    with graph.as_default():
        tensors = tf.graph_util.import_graph_def(copy, input_map={k: v for k, v in input_map.items()
                                                                  if not k.startswith("^")},
                                                 return_elements=names, name="deterministic")
    return dict(zip(fetch, tensors))


def _identity(graph: tf.Graph, tensor: tf.Tensor, name: str) -> tf.Tensor:
    with graph.as_default():
        return tf.identity(tensor, name=f"converted/{name}")


# ---------------------------------------------------------------------------- spaces


def _observation_space(obs: dict[str, tf.Tensor], given: gym.Space | None) -> gym.Space:
    """``given`` checked against the observation tensors, or a space inferred from them."""
    if given is None:
        return _infer_observation_space(obs)
    got = {leaf.key(OBSERVATIONS): leaf.space for leaf in leaves(given)}
    if sorted(got) != sorted(obs):
        raise InputError(f"the observation space has leaves {sorted(got)} but the SavedModel takes {sorted(obs)}"
                         + ("; give the space the graph sees (RLlib flattens Dict/Tuple observations into one Box)"
                            if len(obs) == 1 else ""))
    for key, space in got.items():
        _check_leaf("observation", key, space, obs[key])
    return given


def _action_space(actions: list[tf.Tensor], dist_inputs: tf.Tensor | None, given: gym.Space | None) -> gym.Space:
    """``given`` checked against the action tensors, or a space inferred from them."""
    if given is None:
        return _infer_action_space(actions, dist_inputs)
    got = list(leaves(given))
    if len(got) != len(actions):
        raise InputError(f"the action space has {len(got)} leaves but the SavedModel computes {len(actions)} actions")
    for i, (leaf, tensor) in enumerate(zip(got, actions)):
        _check_leaf("action", action_key(i), leaf.space, tensor)
    return given


def _check_leaf(what: str, key: str, space: gym.Space, tensor: tf.Tensor) -> None:
    want_shape = list(leaf_shape(space))
    shape = tensor.shape.as_list()[1:] if tensor.shape.rank is not None else None
    if shape is not None and (len(shape) != len(want_shape)
                              or any(d is not None and d != w for d, w in zip(shape, want_shape))):
        raise InputError(f"the {what} space gives {key!r} shape {want_shape} but the SavedModel's tensor has {shape}")
    dtype = np.dtype(leaf_dtype(space))
    tensor_dtype = np.dtype(tensor.dtype.as_numpy_dtype)
    if np.issubdtype(dtype, np.floating) != np.issubdtype(tensor_dtype, np.floating):
        raise InputError(f"the {what} space gives {key!r} dtype {dtype.name} but the SavedModel's tensor is "
                         f"{tensor_dtype.name}")


def _spaces_record(policy: TFPolicy, obs_given: bool, act_given: bool) -> dict[str, Any]:
    record = {"observation": "given" if obs_given else "inferred from the tensors",
              "action": "given" if act_given else "inferred from the tensors"}
    if any(isinstance(leaf.space, gym.spaces.Box) for leaf in leaves(policy.action_space)):
        record["action_note"] = ("Box actions are what the graph computes; for RLlib with normalize_actions=True "
                                 "that is the normalised space [-1, 1], mapped to the env's bounds outside the graph")
    return record


def _infer_observation_space(obs: dict[str, tf.Tensor]) -> gym.Space:
    def one(key: str, t: tf.Tensor) -> gym.Space:
        shape = t.shape.as_list()[1:]
        if None in shape or t.shape.rank is None:
            raise ExportError(f"input {key!r} has unknown dimensions {t.shape}; cannot sample it for parity")
        dtype = t.dtype.as_numpy_dtype
        if np.issubdtype(dtype, np.floating):
            return gym.spaces.Box(-1.0, 1.0, tuple(shape), dtype)
        return gym.spaces.Box(0, 1, tuple(shape), dtype)

    if set(obs) == {OBSERVATIONS}:
        return one(OBSERVATIONS, obs[OBSERVATIONS])
    spaces = {k.split("/", 1)[1]: one(k, t) for k, t in obs.items()}
    return gym.spaces.Dict(spaces)


def _infer_action_space(actions: list[tf.Tensor], dist_inputs: tf.Tensor | None) -> gym.Space:
    def one(t: tf.Tensor) -> gym.Space:
        shape = t.shape.as_list()[1:]
        if t.dtype.is_integer and not shape:
            width = dist_inputs.shape.as_list()[-1] if dist_inputs is not None and len(actions) == 1 else None
            return gym.spaces.Discrete(int(width) if width else 2)
        if t.dtype.is_integer:
            return gym.spaces.MultiDiscrete(np.full(shape, 2))
        return gym.spaces.Box(-1.0, 1.0, tuple(shape), t.dtype.as_numpy_dtype)

    spaces = [one(t) for t in actions]
    return spaces[0] if len(spaces) == 1 else gym.spaces.Tuple(spaces)


# ---------------------------------------------------------------------------- entry point
