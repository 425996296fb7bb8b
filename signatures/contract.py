"""The I/O contract of an exported policy: every input and output with dtype, shape and default.

A contract is plain data, serialisable to and from JSON, and the same for every format::

    contract.inputs[0]   # TensorSpec(key='observations', dtype='float32', shape=(None, 4), ...)
    Contract.from_json(contract.to_json()) == contract
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policy_export.signatures.keys import SEQ_LENS


@dataclass(frozen=True)
class TensorSpec:
    """One input or output. ``shape[0] is None`` is the batch; ``default`` is set for optional inputs."""

    key: str
    dtype: str
    shape: tuple[int | None, ...]
    required: bool = True
    default: Any = None

    def check_array(self, value: Any) -> bool:
        """Whether ``value`` has this spec's dtype and a compatible shape."""
        arr = np.asarray(value)
        return arr.dtype == np.dtype(self.dtype) and self._shape_ok(arr.shape)

    def assert_array(self, value: Any) -> None:
        """Raise ``ValueError`` saying what differs when :meth:`check_array` is false."""
        arr = np.asarray(value)
        if arr.dtype != np.dtype(self.dtype):
            raise ValueError(f"{self.key}: dtype {arr.dtype}, expected {self.dtype}")
        if not self._shape_ok(arr.shape):
            raise ValueError(f"{self.key}: shape {list(arr.shape)}, expected {self.shape_text()}")

    def is_default(self, value: Any) -> bool:
        """Whether ``value`` holds nothing but this optional input's default: the default itself,
        or an array of it (any number of rows). A required input has no default: always false."""
        if self.required:
            return False
        arr = np.asarray(value)
        try:
            default = np.broadcast_to(np.asarray(self.default, dtype=self.dtype), arr.shape)
        except ValueError:  # a shape the default cannot take
            return False
        return bool(np.array_equal(arr, default))

    def _shape_ok(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(d is None or d == s for d, s in zip(self.shape, shape))

    def shape_text(self) -> str:
        return "[" + ", ".join("batch" if i == 0 and d is None else ("?" if d is None else str(d))
                               for i, d in enumerate(self.shape)) + "]"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape),
                               "required": self.required}
        if not self.required:
            out["default"] = self.default
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "TensorSpec":
        return cls(key=obj["key"], dtype=obj["dtype"], shape=tuple(obj["shape"]),
                   required=bool(obj.get("required", True)), default=obj.get("default"))


@dataclass(frozen=True)
class Contract:
    """Ordered inputs and outputs of a serving signature."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    method: str = "tensorflow/serving/predict"
    signature_key: str = "serving_default"
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    def input(self, key: str) -> TensorSpec:
        return _find(self.inputs, key, "input")

    def output(self, key: str) -> TensorSpec:
        return _find(self.outputs, key, "output")

    @property
    def input_keys(self) -> list[str]:
        return [s.key for s in self.inputs]

    @property
    def output_keys(self) -> list[str]:
        return [s.key for s in self.outputs]

    @property
    def required_inputs(self) -> list[TensorSpec]:
        return [s for s in self.inputs if s.required]

    def non_default_inputs(self, feeds: Mapping[str, Any]) -> list[str]:
        """The optional inputs that ``feeds`` gives a value other than their default, in contract order.

        An optional input left out of ``feeds``, or fed its default (or an array of nothing but
        its default), is at its default; ``seq_lens`` is never counted (it says how rows form
        sequences, not how the policy acts). A served export answers a feed for which this is
        empty with its batched model, and any other with its sampling model (``<name>_explore``),
        or refuses it where it has none.
        """
        return [s.key for s in self.inputs
                if not s.required and s.key != SEQ_LENS and s.key in feeds and not s.is_default(feeds[s.key])]

    def to_json(self) -> dict[str, Any]:
        return {"signature_key": self.signature_key, "method": self.method,
                "inputs": [s.to_json() for s in self.inputs],
                "outputs": [s.to_json() for s in self.outputs]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Contract":
        return cls(inputs=tuple(TensorSpec.from_json(o) for o in obj["inputs"]),
                   outputs=tuple(TensorSpec.from_json(o) for o in obj["outputs"]),
                   method=obj.get("method", "tensorflow/serving/predict"),
                   signature_key=obj.get("signature_key", "serving_default"))


def _find(specs: tuple[TensorSpec, ...], key: str, kind: str) -> TensorSpec:
    for spec in specs:
        if spec.key == key:
            return spec
    raise KeyError(f"no {kind} {key!r}; the contract has {[s.key for s in specs]}")


def json_default(value: np.ndarray) -> Any:
    """A JSON-friendly scalar or list for a default value."""
    arr = np.asarray(value)
    return arr.item() if arr.ndim == 0 else arr.tolist()
