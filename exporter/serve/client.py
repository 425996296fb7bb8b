"""Triton's own clients (``tritonclient``, HTTP or gRPC) as a runner of the export's contract, so a
live server is checked like any format (``verify OUT --server triton``): :class:`RepositoryClient`
runs the models of the export's ``triton/`` repository as ``serve`` serves them (each tensor as its
config declares it, a ``[batch]`` contract tensor as ``[rows, 1]``); feed-forward: the batched
model, or the sampling model when an optional input is fed a value other than its default;
recurrent: one sequence per row, the server keeping the state. ``seq_lens`` must be ones (the
server takes one step per request). Outputs come back in the contract's shapes.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.formats.runner import Runner, TensorMeta
from policy_export.exporter.serve.models import ServedModel, Wire
from policy_export.exporter.serve.repository import INSTALL_HINT
from policy_export.signatures.contract import Contract, TensorSpec
from policy_export.signatures.keys import SEQ_LENS, is_state_in

PROTOCOLS = ("http", "grpc")
# numpy dtype -> KServe v2 data type
WIRE_TYPES = {"float32": "FP32", "float64": "FP64", "float16": "FP16", "int8": "INT8", "int16": "INT16",
              "int32": "INT32", "int64": "INT64", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
              "uint64": "UINT64", "bool": "BOOL"}


def client_module(protocol: str):
    """``tritonclient.http`` or ``tritonclient.grpc``.

    Raises:
        InputError: an unknown protocol, or tritonclient is not installed.
    """
    if protocol not in PROTOCOLS:
        raise InputError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    try:
        if protocol == "http":
            import tritonclient.http as module
        else:
            import tritonclient.grpc as module
    except ImportError as e:
        raise InputError(f"Triton's client is not installed ({e}); {INSTALL_HINT}") from None
    return module


def to_wire(wire: Wire, batched: bool, value: Any) -> np.ndarray:
    """A contract array as the served model declares the tensor: the same array, ``[rows]`` as
    ``[rows, 1]`` where the config says ``dims: [ 1 ]`` (batched) or ``[ -1, 1 ]``, a scalar as ``[1]``.

    Raises:
        InputError: an array of another rank.
    """
    value = np.asarray(value, dtype=wire.spec.dtype)
    pattern = ([-1] if batched else []) + list(wire.dims)
    if value.ndim == len(pattern):
        return value
    if value.ndim + 1 == len(pattern) and pattern[-1] == 1:
        return value.reshape(*value.shape, 1)
    raise InputError(f"input {wire.key!r} of shape {list(value.shape)} does not fit the served dims {pattern}")


def from_wire(spec: TensorSpec, value: np.ndarray) -> np.ndarray:
    """A served output in the contract's shape (the inverse of :func:`to_wire`)."""
    value = np.asarray(value)
    rank = len(spec.shape)
    if value.ndim == rank + 1 and value.shape[-1] == 1:
        return value.reshape(value.shape[:-1])
    return value


class RepositoryClient(Runner):
    """The contract through a repository's models on a live server (``serve``), over one protocol.

    Feed-forward: the batched model, or the sampling model when an optional input is fed a value
    other than its default. Recurrent: one sequence per row, the server keeping the state; a call
    whose state inputs are all zero starts new sequences, any other continues them, and the state
    outputs returned are step counters that only this client reads back (the server does not send
    state)."""

    _ids = itertools.count(1)

    def __init__(self, url: str, protocol: str, models: list[ServedModel], contract: Contract,
                 timeout_s: float = 60.0):
        self.protocol, self.contract = protocol, contract
        self.label = f"Triton server {url} ({protocol}), the triton/ repository"
        self._module = client_module(protocol)
        self._client = self._module.InferenceServerClient(url=url, **({"network_timeout": timeout_s,
                                                                        "connection_timeout": timeout_s}
                                                                       if protocol == "http" else {}))
        self._extra = {"client_timeout": timeout_s} if protocol == "grpc" else {}
        self.batched = next(m for m in models if not m.samples)  # the serving model
        self.sampling = next((m for m in models if m.samples), None)
        self.recurrent = self.batched.sequence
        # the state the server keeps: as its config pairs it, else by the contract's names
        self.states = list(self.batched.states) or [(k, "state_out_" + k[len("state_in_"):])
                                                    for k in contract.input_keys if is_state_in(k)]
        # a recurrent model that does not batch takes one sequence a request: its open dims are 1
        one = self.recurrent and not self.batched.batched
        self.inputs = {s.key: TensorMeta(s.key, s.dtype, tuple(1 if one and d is None else d for d in s.shape))
                       for s in contract.inputs}
        served = {w.key for w in self.batched.outputs} | ({b for _, b in self.states} if self.recurrent else set())
        self.outputs = {s.key: TensorMeta(s.key, s.dtype, s.shape) for s in contract.outputs if s.key in served}
        self._sequences: list[int] = []

    def _choose(self, feeds: Mapping[str, np.ndarray]) -> ServedModel:
        switched = self.contract.non_default_inputs(feeds)
        if switched and self.sampling is None:
            raise InputError(f"{self.label}: input {switched[0]!r} can only be its default here")
        return self.sampling if switched else self.batched

    def infer(self, model: ServedModel, feeds: Mapping[str, Any], **sequence) -> dict[str, np.ndarray]:
        """One request of contract ``feeds`` (those ``model`` takes) to ``model``; its outputs in the
        contract's shapes. ``sequence``: ``sequence_id``, ``sequence_start``, ``sequence_end``."""
        inputs = []
        for wire in model.inputs:
            if wire.key not in feeds:
                continue
            value = np.ascontiguousarray(to_wire(wire, model.batched, feeds[wire.key]))
            item = self._module.InferInput(wire.key, list(value.shape), WIRE_TYPES[value.dtype.name])
            item.set_data_from_numpy(value)
            inputs.append(item)
        outputs = [self._module.InferRequestedOutput(w.key) for w in model.outputs]
        result = self._client.infer(model.name, inputs, outputs=outputs, **sequence, **self._extra)
        return {w.key: from_wire(self.contract.output(w.key), result.as_numpy(w.key)) for w in model.outputs}

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if SEQ_LENS in feeds and not np.all(np.asarray(feeds[SEQ_LENS]) == 1):
            raise InputError(f"{self.label}: the server takes one step per request (seq_lens 1)")
        if self.recurrent:
            return self._step(feeds)
        return self.infer(self._choose(feeds), feeds)

    def _step(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        states = [a for a, _ in self.states if a in feeds]
        if not states:
            raise InputError(f"{self.label}: a step of a recurrent model needs its state inputs "
                             f"({', '.join(a for a, _ in self.states)})")
        per_step = {k: v for k, v in feeds.items() if k not in states and k != SEQ_LENS}
        rows = len(np.asarray(next(iter(per_step.values())))) if per_step else len(np.asarray(feeds[states[0]]))
        start = all(not np.any(feeds[k]) for k in states)
        if start:
            if self._sequences and not self.batched.batched:
                self._end(per_step)
            self._sequences = [next(self._ids) for _ in range(rows)]
        elif len(self._sequences) != rows:
            raise InputError(f"{self.label}: a call continues {len(self._sequences)} sequences, not {rows}")
        step = 0 if start else int(np.asarray(feeds[states[0]]).flat[0])
        collected: dict[str, list[np.ndarray]] = {}
        for row, sequence_id in enumerate(self._sequences):
            out = self.infer(self.batched, {k: np.asarray(v)[row:row + 1] for k, v in per_step.items()},
                             sequence_id=sequence_id, sequence_start=start)
            for key, value in out.items():
                collected.setdefault(key, []).append(value)
        result = {k: np.concatenate(v) for k, v in collected.items()}
        for state_in, state_out in self.states:  # step counters the server never sees
            if state_in in feeds:
                result[state_out] = np.full_like(np.asarray(feeds[state_in]), step + 1)
        return result

    def _end(self, per_step: Mapping[str, Any]) -> None:
        """End the sequences this client continued (a request flagged END, its answer dropped): a
        model that does not batch has one sequence slot an instance, which a sequence never ended
        holds until the server's idle timeout."""
        first = {k: np.asarray(v)[:1] for k, v in per_step.items()}
        for sequence_id in self._sequences:
            self.infer(self.batched, first, sequence_id=sequence_id, sequence_end=True)
        self._sequences = []

    def device_info(self) -> dict[str, Any]:
        return {"triton_protocol": self.protocol}

    def _close(self) -> None:
        self._client.close()
