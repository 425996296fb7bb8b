"""The golden requests of the ``tf_serving`` format: what to send TF Serving and what it must answer.

A small batch of inputs, drawn from the policy's observation space with a fixed seed, is run
through the written SavedModel's signature; request and response are written twice:

- ``predict_request.json`` / ``predict_response.json``: the REST predict API's columnar form,
  ``{"signature_name": ..., "inputs": {key: nested lists}}`` answered by ``{"outputs": {key: ...}}``
  (the bare value when the signature has a single output, as the REST API answers);
- ``predict_request.pb`` / ``predict_response.pb``: serialised ``tensorflow.serving.PredictRequest``
  and ``PredictResponse`` (model spec: name, version, signature name; tensors as ``TensorProto``).

TF Serving refuses a predict request that leaves out a signature input unless the SignatureDef
carries default values; the layout's SavedModel carries them for the optional inputs
(:func:`.layout.add_signature_defaults`), so the request feeds what a client must, the required
inputs alone (``explore`` left at false: the deterministic action): the observations, a recurrent
policy's state at its initial (zero) value with ``seq_lens`` 1 (each row one step of a new
sequence), and ``prev_action``/``prev_reward`` zero. Floats are written at full precision
(float32 -> Python float is exact, and JSON keeps it), so the JSON values are the tensors' own.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter import protowire
from policy_export.policy.spaces import leaf_dtype, leaves
from policy_export.signatures.keys import OBSERVATIONS, SEQ_LENS, is_state_in, state_index

ROWS = 4
SEED = 0
LARGE_BOUND = 1e6  # float Box bounds beyond this are sampled as unbounded (standard normal, then clipped)
REQUEST_JSON = "predict_request.json"
RESPONSE_JSON = "predict_response.json"
REQUEST_PB = "predict_request.pb"
RESPONSE_PB = "predict_response.pb"


def _sample_leaf(space, rows: int, rng: np.random.Generator) -> np.ndarray:
    import gymnasium as gym

    dtype = leaf_dtype(space)
    if isinstance(space, gym.spaces.Box) and np.issubdtype(space.dtype, np.floating):
        shape = (rows, *space.shape)
        low = np.broadcast_to(space.low, space.shape).astype(np.float64)
        high = np.broadcast_to(space.high, space.shape).astype(np.float64)
        bounded = np.isfinite(low) & np.isfinite(high) & (low >= -LARGE_BOUND) & (high <= LARGE_BOUND)
        uniform = rng.uniform(np.where(bounded, low, 0.0), np.where(bounded, high, 1.0), shape)
        normal = np.clip(rng.standard_normal(shape), low, high)
        return np.where(bounded, uniform, normal).astype(dtype)
    space = copy.deepcopy(space)  # seeding must leave the policy's own space alone
    space.seed(int(rng.integers(2**31 - 1)))
    return np.stack([np.asarray(space.sample()) for _ in range(rows)]).astype(dtype)


def golden_inputs(policy, contract, rows: int = ROWS, seed: int = SEED) -> dict[str, np.ndarray]:
    """One value for every required signature input (see the module docstring), ``rows`` rows of
    each; the optional ones are left to the SignatureDef's defaults, as a client leaves them."""
    rng = np.random.default_rng(seed)
    feeds = {leaf.key(OBSERVATIONS): _sample_leaf(leaf.space, rows, rng) for leaf in leaves(policy.observation_space)}
    feeds = {k: v for k, v in feeds.items() if k in contract.input_keys}
    initial = policy.get_initial_state() if policy.is_recurrent else []
    for spec in contract.inputs:
        dtype = np.dtype(spec.dtype)
        if spec.key in feeds:
            continue
        if not spec.required:
            continue  # the SignatureDef's defaults hold them (explore false: the deterministic action)
        if is_state_in(spec.key) and state_index(spec.key) < len(initial):
            feeds[spec.key] = np.repeat(np.asarray(initial[state_index(spec.key)], dtype)[None], rows, axis=0)
        elif spec.key == SEQ_LENS:
            feeds[spec.key] = np.ones(rows, dtype)
        else:  # prev_action, prev_reward, a state without an initial value, any other input: zero
            feeds[spec.key] = np.zeros((rows, *(1 if d is None else d for d in spec.shape[1:])), dtype)
    return feeds


def _listed(value: np.ndarray) -> Any:
    """``value`` as JSON: nested lists of Python numbers (float32 and float64 values kept exactly)."""
    return np.asarray(value).tolist()


def rest_request(signature_key: str, inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The REST predict body (columnar ``inputs``) feeding ``inputs`` to ``signature_key``."""
    return {"signature_name": signature_key, "inputs": {k: _listed(v) for k, v in inputs.items()}}


def rest_response(outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The REST predict answer to a columnar request: ``{"outputs": {key: value}}``, the bare value
    for a single output."""
    values = {k: _listed(v) for k, v in outputs.items()}
    return {"outputs": next(iter(values.values())) if len(values) == 1 else values}


def _model_spec(name: str, version: int, signature_key: str) -> bytes:
    """A serialised ``tensorflow.serving.ModelSpec`` (``version``: a ``google.protobuf.Int64Value``)."""
    version_value = protowire.varint(1 << 3) + protowire.varint(version)  # Int64Value.value, a varint field
    return (protowire.field(1, name.encode()) + protowire.field(2, version_value)
            + protowire.field(3, signature_key.encode()))


def _tensor_map(number: int, tensors: Mapping[str, np.ndarray]) -> bytes:
    """Field ``number``, a ``map<string, TensorProto>``, entries in key order (as protobuf's
    deterministic serialisation writes them)."""
    import tensorflow as tf

    out = b""
    for key in sorted(tensors):
        tensor = tf.make_tensor_proto(tensors[key]).SerializeToString()
        entry = protowire.field(1, key.encode()) + protowire.field(2, tensor)
        out += protowire.field(number, entry)
    return out


def predict_request_bytes(name: str, version: int, signature_key: str, inputs: Mapping[str, np.ndarray]) -> bytes:
    """A serialised ``PredictRequest``: ``model_spec`` (field 1), ``inputs`` (field 2)."""
    return protowire.field(1, _model_spec(name, version, signature_key)) + _tensor_map(2, inputs)


def predict_response_bytes(name: str, version: int, signature_key: str, outputs: Mapping[str, np.ndarray]) -> bytes:
    """A serialised ``PredictResponse``: ``outputs`` (field 1), ``model_spec`` (field 2)."""
    return _tensor_map(1, outputs) + protowire.field(2, _model_spec(name, version, signature_key))


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj) + "\n", encoding="utf-8")


def check_round_trip(path: Path, arrays: Mapping[str, np.ndarray], section: str) -> None:
    """Raises ExportError unless the JSON file at ``path`` gives back ``arrays`` value for value."""
    from policy_export.errors import ExportError

    written = json.loads(path.read_text(encoding="utf-8"))[section]
    if len(arrays) == 1 and section == "outputs":
        written = {next(iter(arrays)): written}
    for key, value in arrays.items():
        back = np.asarray(written.get(key), dtype=np.asarray(value).dtype)
        if back.shape != np.shape(value) or not np.array_equal(back, value, equal_nan=back.dtype.kind == "f"):
            raise ExportError(f"tf_serving: {path} does not hold {section} {key!r} exactly")


def write_golden(directory: Path, spec: tuple[str, int, str], inputs: Mapping[str, np.ndarray],
                 outputs: Mapping[str, np.ndarray]) -> list[Path]:
    """Write the four golden files into ``directory``; ``spec`` is (model name, version, signature key).
    Returns their paths."""
    name, version, key = spec
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / n for n in (REQUEST_JSON, RESPONSE_JSON, REQUEST_PB, RESPONSE_PB)]
    _write_json(paths[0], rest_request(key, inputs))
    _write_json(paths[1], rest_response(outputs))
    paths[2].write_bytes(predict_request_bytes(name, version, key, inputs))
    paths[3].write_bytes(predict_response_bytes(name, version, key, outputs))
    check_round_trip(paths[0], inputs, "inputs")
    check_round_trip(paths[1], outputs, "outputs")
    return paths
