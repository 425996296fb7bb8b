"""Convert an existing TF1 SavedModel (e.g. RLlib's ``export_policy_model``) into a full export.

Such models key their recurrent state by raw tensor names (``default_policy/Placeholder:0``).
``convert`` loads the signature into a session, wraps it as a :class:`policy.TFPolicy` with
stable keys — state inputs and outputs in natural order of their raw names become
``state_in_i``/``state_out_i`` (paired shapes must agree) — and exports it like any policy:
a SavedModel with clean keys, the frozen graph, ONNX, golden files, parity, and a manifest that
records where each key came from. Spaces are not stored in a SavedModel, so they are inferred
from the tensors: a float observation ``[batch, *shape]`` becomes ``Box(-1, 1, shape)`` (what
parity samples from), an int64 ``actions_i`` ``[batch]`` a ``Discrete`` over the width of
``action_dist_inputs``, a float one a ``Box(-1, 1)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from policy_export.exporter.devices import plan_devices
from policy_export.policy.errors import ExportError, InputError
from policy_export.policy.tf_policy import TFPolicy, session_config

tf1 = tf.compat.v1
KNOWN_INPUTS = ("observations", "is_training", "seq_lens", "prev_action", "prev_reward", "timestep", "explore")
KNOWN_OUTPUTS = ("action_dist_inputs", "action_logp", "action_prob")


def natural_key(text: str) -> list:
    """``Placeholder_10`` after ``Placeholder_2``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def clean_key(key: str) -> str:
    """A signature key without a tensor suffix or characters ONNX tools dislike."""
    return re.sub(r"[^A-Za-z0-9_/.-]", "_", key.split(":")[0])


def load_saved_model_policy(path: str | Path, signature_key: str = "serving_default", tag: str = "serve",
                            device: str = "auto",
                            state_pairs: list[tuple[str, str]] | None = None) -> tuple[TFPolicy, dict[str, str]]:
    """Load a TF1 SavedModel signature as a :class:`TFPolicy`; also return new key -> original key.

    ``state_pairs`` gives the state keys as ``(input key, output key)`` pairs in order; without it,
    state inputs and outputs are paired in natural order of their names (right for RLlib's
    ``Placeholder``/``Placeholder_1`` and ``Exit_3``/``Exit_4``; say so explicitly otherwise).

    Raises:
        ExportError: not a loadable SavedModel, a signature without observations/actions, or
            state keys that do not pair up.
    """
    path = Path(path)
    if not (path / "saved_model.pb").is_file():
        raise ExportError(f"{path} is not a SavedModel directory (no saved_model.pb)")
    plan = plan_devices(device)
    graph = tf.Graph()
    session = tf1.Session(graph=graph, config=session_config(plan.tf_device))
    try:
        with graph.as_default():
            meta = tf1.saved_model.loader.load(session, [tag], str(path))
    except (OSError, RuntimeError, ValueError, tf.errors.OpError) as e:
        raise ExportError(f"cannot load SavedModel {path} with tag {tag!r}: {e}") from e
    if signature_key not in meta.signature_def:
        raise ExportError(f"{path} has no signature {signature_key!r}; it has {sorted(meta.signature_def)}")
    sig = meta.signature_def[signature_key]
    inputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.inputs.items()}
    outputs = {k: graph.get_tensor_by_name(v.name) for k, v in sig.outputs.items()}

    obs = {k: t for k, t in inputs.items() if k == "observations" or k.startswith("observations/")}
    if not obs:
        raise ExportError(f"signature {signature_key!r} of {path} has no 'observations' input; inputs are {sorted(inputs)}")
    action_keys = sorted((k for k in outputs if re.fullmatch(r"actions(_\d+)?", k)), key=natural_key)
    if not action_keys:
        raise ExportError(f"signature {signature_key!r} of {path} has no 'actions' output; outputs are {sorted(outputs)}")
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
    if state_in and "seq_lens" not in inputs:
        raise ExportError("the signature has state inputs but no 'seq_lens' input")

    mapping = {f"state_in_{i}": k for i, k in enumerate(state_in)}
    mapping.update({f"state_out_{i}": k for i, k in enumerate(state_out)})
    extras = {}
    for key, tensor in outputs.items():
        if key in action_keys or key in KNOWN_OUTPUTS or key in state_out:
            continue
        extras[clean_key(key)] = tensor
        if clean_key(key) != key:
            mapping[clean_key(key)] = key

    obs_space = _infer_observation_space(obs)
    act_space = _infer_action_space([outputs[k] for k in action_keys], outputs.get("action_dist_inputs"))
    policy = TFPolicy(
        obs_space, act_space, session,
        observations=obs if len(obs) > 1 or "observations" not in obs else obs["observations"],
        sampled_action=[_identity(graph, outputs[k], f"actions_{i}") for i, k in enumerate(action_keys)],
        action_logp=outputs.get("action_logp"), action_prob=outputs.get("action_prob"),
        action_dist_inputs=outputs.get("action_dist_inputs"),
        explore=inputs.get("explore"), is_training=inputs.get("is_training"), timestep=inputs.get("timestep"),
        state_inputs=[inputs[k] for k in state_in], state_outputs=[outputs[k] for k in state_out],
        seq_lens=inputs.get("seq_lens"), prev_action=inputs.get("prev_action"), prev_reward=inputs.get("prev_reward"),
        extra_fetches=extras, name=path.name,
    )
    return policy, mapping


def _identity(graph: tf.Graph, tensor: tf.Tensor, name: str) -> tf.Tensor:
    with graph.as_default():
        return tf.identity(tensor, name=f"converted/{name}")


def _infer_observation_space(obs: dict[str, tf.Tensor]) -> gym.Space:
    def one(key: str, t: tf.Tensor) -> gym.Space:
        shape = t.shape.as_list()[1:]
        if None in shape or t.shape.rank is None:
            raise ExportError(f"input {key!r} has unknown dimensions {t.shape}; cannot sample it for parity")
        dtype = t.dtype.as_numpy_dtype
        if np.issubdtype(dtype, np.floating):
            return gym.spaces.Box(-1.0, 1.0, tuple(shape), dtype)
        return gym.spaces.Box(0, 1, tuple(shape), dtype)

    if set(obs) == {"observations"}:
        return one("observations", obs["observations"])
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


def convert_saved_model(path: str | Path, out: str | Path, *, signature_key: str = "serving_default",
                        tag: str = "serve", device: str = "auto", state_pairs: list[tuple[str, str]] | None = None,
                        **options: Any):
    """Convert the SavedModel at ``path`` into a full export at ``out`` (see the module docstring).

    ``options`` go to :func:`exporter.export_policy` (``opset``, ``samples``, ``overwrite``...).
    Returns the :class:`exporter.ExportResult`.
    """
    from policy_export.exporter.api import export_policy
    from policy_export.exporter.staging import check_target

    check_target(Path(out).absolute(), options.get("overwrite", False))
    policy, mapping = load_saved_model_policy(path, signature_key, tag, device, state_pairs)
    formats = options.pop("formats", None) or ["saved_model", "frozen_graph", "onnx"]
    if "keras" in formats:
        raise InputError("a converted SavedModel has no Keras base model; leave 'keras' out of the formats")
    source = {"converted_from": str(Path(path).absolute()), "signature": signature_key, "tag": tag,
              "key_mapping": mapping}
    try:
        return export_policy(policy, out, formats=formats, device=device, source=source, **options)
    finally:
        policy.close()
