"""Triton's own clients (``tritonclient``, HTTP or gRPC) as a runner of the export's contract, so a
live server is checked like any format (``verify OUT --server triton``).

Feeds go to the batched model, or to the sampling model when an optional input is fed a value
other than its default (:func:`exporter.serve.models.choose`); ``seq_lens`` must be ones (the
server takes one step per request). Outputs come back in the contract's shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.formats.runner import Runner, TensorMeta
from policy_export.exporter.serve.models import ServedModel, choose
from policy_export.exporter.serve.server import INSTALL_HINT
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import SEQ_LENS

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


class TritonClientRunner(Runner):
    """Runs the contract through a live server's models over one protocol."""

    def __init__(self, url: str, protocol: str, models: list[ServedModel], contract: Contract, timeout_s: float = 60.0):
        self.protocol, self.models, self.contract = protocol, models, contract
        self.label = f"Triton server {url} ({protocol})"
        self._module = client_module(protocol)
        self._client = self._module.InferenceServerClient(url=url, **({"network_timeout": timeout_s,
                                                                        "connection_timeout": timeout_s}
                                                                       if protocol == "http" else {}))
        self._timeout = timeout_s
        self.inputs = {s.key: TensorMeta(s.key, s.dtype, s.shape) for s in contract.inputs}
        served = {w.key for m in models for w in m.outputs}
        self.outputs = {s.key: TensorMeta(s.key, s.dtype, s.shape) for s in contract.outputs if s.key in served}

    def infer(self, model: ServedModel, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request of ``arrays`` (as the server declares them) to ``model``; the response's arrays."""
        inputs = []
        for key, value in arrays.items():
            value = np.ascontiguousarray(value)
            item = self._module.InferInput(key, list(value.shape), WIRE_TYPES[value.dtype.name])
            item.set_data_from_numpy(value)
            inputs.append(item)
        outputs = [self._module.InferRequestedOutput(w.key) for w in model.outputs]
        extra = {"client_timeout": self._timeout} if self.protocol == "grpc" else {}
        result = self._client.infer(model.name, inputs, outputs=outputs, **extra)
        return {w.key: result.as_numpy(w.key) for w in model.outputs}

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        model = choose(self.models, feeds, self.contract)
        if SEQ_LENS in feeds and not np.all(np.asarray(feeds[SEQ_LENS]) == 1):
            raise InputError(f"{self.label}: the server takes one step per request (seq_lens 1)")
        arrays = model.request_arrays({k: v for k, v in feeds.items() if k != SEQ_LENS})
        # not through a watchdog thread: the HTTP client's gevent sockets belong to the thread
        # that made them; both clients bound each call with their own timeout instead
        return model.contract_outputs(self.infer(model, arrays))

    def device_info(self) -> dict[str, Any]:
        return {"triton_protocol": self.protocol}

    def _close(self) -> None:
        self._client.close()
