"""Build a policy's serving signature: keyed tensors, the contract, and the SignatureDef map."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from policy_export.signatures.contract import Contract, TensorSpec, json_default
from policy_export.signatures.keys import is_action, is_state_out

tf1 = tf.compat.v1
SERVING_KEY = tf1.saved_model.signature_constants.DEFAULT_SERVING_SIGNATURE_DEF_KEY
PREDICT_METHOD = tf1.saved_model.signature_constants.PREDICT_METHOD_NAME


def find_signature(meta_graph, key: str = SERVING_KEY, where: str = "the SavedModel"):
    """The SignatureDef ``key`` of a MetaGraphDef.

    Raises:
        ExportError: it has no such signature (the message lists the ones it has).
    """
    from policy_export.errors import ExportError

    if key not in meta_graph.signature_def:
        raise ExportError(f"{where} has no signature {key!r}; it has {sorted(meta_graph.signature_def)}")
    return meta_graph.signature_def[key]


@dataclass(frozen=True)
class Signature:
    """The policy's serving signature: keyed graph tensors and the contract describing them."""

    inputs: dict[str, tf.Tensor]
    outputs: dict[str, tf.Tensor]
    contract: Contract

    def signature_def_map(self) -> dict[str, Any]:
        """``{"serving_default": SignatureDef}`` (method Predict) with the contract's keys."""
        build = tf1.saved_model.utils.build_tensor_info
        sig = tf1.saved_model.signature_def_utils.build_signature_def(
            inputs={k: build(t) for k, t in self.inputs.items()},
            outputs={k: build(t) for k, t in self.outputs.items()},
            method_name=PREDICT_METHOD,
        )
        return {SERVING_KEY: sig}

    def tensor_names(self) -> dict[str, dict[str, str]]:
        """Graph tensor name of every key, ``{"inputs": {...}, "outputs": {...}}``."""
        return {"inputs": {k: t.name for k, t in self.inputs.items()},
                "outputs": {k: t.name for k, t in self.outputs.items()}}


def build_signature(policy) -> Signature:
    """The ``serving_default`` signature of a :class:`policy.TFPolicy`.

    Inputs: observation leaves, then ``explore``/``is_training``/``timestep`` and extra inputs;
    an input fed through ``placeholder_with_default`` is optional with that default.
    Outputs: ``actions_0..``, ``action_dist_inputs``, ``action_logp``, ``action_prob``, extras.
    """
    inputs = tuple(
        _spec(key, tensor, policy.defaults.get(key)) for key, tensor in policy.inputs.items()
    )
    outputs = tuple(_spec(key, tensor, None) for key, tensor in policy.outputs.items())
    return Signature(dict(policy.inputs), dict(policy.outputs), Contract(inputs=inputs, outputs=outputs))


def build_deterministic_signature(policy) -> Signature | None:
    """The deterministic action path alone: the required inputs, and the ``actions_i`` and
    ``state_out_i`` outputs, under the same keys; ``None`` when the policy does not expose
    deterministic outputs. No explore switch, no random ops, nothing a controller does not need."""
    if not policy.deterministic_outputs:
        return None
    full = build_signature(policy)
    inputs = {k: t for k, t in policy.inputs.items() if k not in policy.defaults}
    outputs = {k: policy.deterministic_outputs[k] for k in full.outputs
               if k in policy.deterministic_outputs and (is_action(k) or is_state_out(k))}
    contract = Contract(inputs=tuple(s for s in full.contract.inputs if s.key in inputs),
                        outputs=tuple(s for s in full.contract.outputs if s.key in outputs))
    return Signature(inputs, outputs, contract)


def _spec(key: str, tensor: tf.Tensor, default: np.ndarray | None) -> TensorSpec:
    shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else ()
    return TensorSpec(
        key=key,
        dtype=np.dtype(tensor.dtype.as_numpy_dtype).name,
        shape=shape,
        required=default is None,
        default=None if default is None else json_default(default),
    )
