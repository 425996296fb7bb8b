"""The models a Triton server serves, as its clients see them: :meth:`ServedModel.from_config`
reads them from a repository's ``config.pbtxt`` (what ``serve`` serves, and what its HTTP front
checks each request against); :func:`plan_models` lays an export's contract out the way the
written ``triton/`` repository does, for the PyTriton route the serving benchmark compares
(``benchmarks/pytriton_route.py``):

- ``NAME``: batched on the first dimension (dynamic batching), deterministic, the contract's
  required inputs alone (``seq_lens`` is made in the server: one step per request) and every
  output; a tensor that is one value per row (``[batch]`` in the contract: a Discrete action,
  ``prev_reward``, ``action_logp``) travels as ``[batch, 1]``, Triton's ``dims: [ 1 ]``;
- ``NAME_explore``, where the export samples: not batched, the required inputs and the optional
  ones (``explore``, ``is_training``, ``timestep``) as optional inputs, each scalar one value
  ``[1]``; every tensor in the contract's own shape otherwise.

On the PyTriton route recurrent policies keep their state in the client: ``state_in_i`` in,
``state_out_i`` out (PyTriton has no sequence batcher).

:class:`ServedModel` turns a request's arrays into contract feeds and the engine's outputs back;
:func:`plan_models` decides the models from the export's contract and engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.signatures.contract import Contract, TensorSpec
from policy_export.signatures.keys import EXPLORE, SEQ_LENS

from policy_export.exporter.defaults import TRITON_MAX_BATCH_SIZE as DEFAULT_MAX_BATCH_SIZE

EXPLORE_SUFFIX = "_explore"
MAX_ROWS_UNBATCHED = 1 << 31  # a model that does not batch: its dims bound a request, not a row count


@dataclass(frozen=True)
class Wire:
    """One tensor of a served model: its contract spec and how it travels."""

    spec: TensorSpec
    dims: tuple[int, ...]  # as the server declares them (without the batch dimension when batched)
    per_row: bool = False  # a [batch] contract tensor sent as [batch, 1]
    scalar: bool = False  # a contract scalar sent as [1]
    optional: bool = False

    @property
    def key(self) -> str:
        return self.spec.key


def _wire(spec: TensorSpec, batched: bool, optional: bool = False) -> Wire:
    shape = tuple(-1 if d is None else int(d) for d in spec.shape)
    if not shape:
        return Wire(spec, (1,), scalar=True, optional=optional)
    if batched:
        rest = shape[1:]
        return Wire(spec, rest or (1,), per_row=not rest, optional=optional)
    return Wire(spec, shape, optional=optional)


@dataclass(frozen=True)
class ServedModel:
    """One model on the server: its name, batching and tensors, in the contract's terms."""

    name: str
    max_batch_size: int  # 0: not batched
    inputs: tuple[Wire, ...]
    outputs: tuple[Wire, ...]
    fills_seq_lens: bool = False
    max_rows: int = DEFAULT_MAX_BATCH_SIZE  # rows one request may hold (a model that does not batch too)
    sequence: bool = False  # sequence batching: the server keeps each sequence's state
    states: tuple[tuple[str, str], ...] = ()  # sequence batching: (state input, the output fed back)

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    @property
    def samples(self) -> bool:
        """The sampling model (``NAME_explore``), not the serving one."""
        return self.name.endswith(EXPLORE_SUFFIX)

    @classmethod
    def from_config(cls, config: Any) -> "ServedModel":
        """The model a Triton ``ModelConfig`` (parsed with Triton's schema) declares: its inputs
        (optional ones marked) and outputs with their data types and ``dims`` (without the batch
        dimension when it batches), as a client sends and receives them; sequence controls and
        implicit state are the server's, not the client's.

        Raises:
            InputError: a data type with no numpy dtype.
        """
        from policy_export.exporter.formats.triton.config import numpy_dtype

        batch = (None,) if config.max_batch_size > 0 else ()

        def wire(io, optional: bool = False) -> Wire:
            dims = tuple(int(d) for d in io.dims)
            spec = TensorSpec(io.name, numpy_dtype(io.data_type), batch + tuple(None if d < 0 else d for d in dims),
                              required=not optional)
            return Wire(spec, dims, optional=optional)

        return cls(config.name, int(config.max_batch_size), tuple(wire(i, i.optional) for i in config.input),
                   tuple(wire(o) for o in config.output), max_rows=int(config.max_batch_size) or MAX_ROWS_UNBATCHED,
                   sequence=config.HasField("sequence_batching"),
                   states=tuple((s.input_name, s.output_name) for s in config.sequence_batching.state))

    def feeds(self, request: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The contract feeds of one request (or of a batch of requests concatenated).

        Raises:
            InputError: a row count above the model's limit, or a wrong per-row shape.
        """
        feeds: dict[str, np.ndarray] = {}
        rows = None
        for wire in self.inputs:
            if wire.key not in request:
                continue  # an optional input not sent: the engine's default
            value = np.asarray(request[wire.key])
            if wire.scalar:
                if value.size != 1:
                    raise InputError(f"{self.name}: input {wire.key!r} is one value, got shape {list(value.shape)}")
                value = value.reshape(())
            elif wire.per_row:
                if value.ndim != 2 or value.shape[1] != 1:
                    raise InputError(f"{self.name}: input {wire.key!r} is [batch, 1], got {list(value.shape)}")
                value = value.reshape(-1)
            if not wire.scalar:
                rows = value.shape[0] if rows is None else rows
            feeds[wire.key] = value
        if rows is not None and rows > self.max_rows:
            raise InputError(f"{self.name}: {rows} rows in one request, more than its {self.max_rows}")
        if self.fills_seq_lens and rows is not None:
            feeds[SEQ_LENS] = np.ones(rows, np.int32)
        return feeds

    def response(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The engine's outputs as the server declares them."""
        out = {}
        for wire in self.outputs:
            # in the contract's dtype: ONNX Runtime's int64 is numpy's longlong, which PyTriton's
            # check of the declared type refuses
            value = _exact_dtype(np.asarray(outputs[wire.key]), np.dtype(wire.spec.dtype))
            out[wire.key] = value.reshape(-1, 1) if wire.per_row else (value.reshape(1) if wire.scalar else value)
        return out


def _exact_dtype(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` with exactly ``dtype``'s type: an equivalent one (``longlong`` for ``int64``) is
    viewed as it, anything else converted."""
    if value.dtype == dtype:
        return value.view(dtype) if value.dtype.type is not dtype.type else value
    return value.astype(dtype)


def plan_models(contract: Contract, engine_inputs: set[str], engine_outputs: list[str], samples: bool,
                name: str = "policy", max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> list[ServedModel]:
    """The models serving ``contract`` with an engine that takes ``engine_inputs`` and gives
    ``engine_outputs``: the batched model, and the sampling one where ``samples``."""
    fills = SEQ_LENS in engine_inputs
    required = [s for s in contract.inputs if s.required and s.key != SEQ_LENS]
    optional = [s for s in contract.inputs if not s.required and s.key in engine_inputs and s.key != SEQ_LENS]
    outputs = [s for s in contract.outputs if s.key in engine_outputs]
    models = [ServedModel(name, max_batch_size, tuple(_wire(s, True) for s in required),
                          tuple(_wire(s, True) for s in outputs), fills, max_batch_size)]
    if samples and any(s.key == EXPLORE for s in optional):
        models.append(ServedModel(name + EXPLORE_SUFFIX, 0,
                                  tuple(_wire(s, False) for s in required)
                                  + tuple(_wire(s, False, optional=True) for s in optional),
                                  tuple(_wire(s, False) for s in outputs), fills, max_batch_size))
    return models
