"""What the format writers share: the policy, its signature, options, and the frozen graph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from policy_export.exporter import formats as registry
from policy_export.exporter.devices import DevicePlan
from policy_export.policy.errors import InputError

from policy_export.exporter.defaults import DEFAULT_EXTERNAL_DATA_THRESHOLD, DEFAULT_OPSET  # noqa: F401 (re-exported)
SUPPORTED_OPSETS = range(13, 22)
ALL_FORMATS = registry.names()  # every registered format, in export order


def resolve_formats(formats: Sequence[str] | None) -> tuple[str, ...]:
    """Validate a format list (``None`` means the default formats) and put it in export order.

    Raises:
        InputError: an empty list or an unknown format.
    """
    if formats is None:
        return registry.default_names()
    unknown = [f for f in formats if f not in ALL_FORMATS]
    if unknown or not formats:
        raise InputError(f"unknown format(s) {unknown}; choose from {', '.join(ALL_FORMATS)}")
    return tuple(f for f in ALL_FORMATS if f in formats)


def check_opset(opset: int) -> None:
    """Raises InputError for an opset outside :data:`SUPPORTED_OPSETS`."""
    if opset not in SUPPORTED_OPSETS:
        raise InputError(f"opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}")


@dataclass(frozen=True)
class FormatRecord:
    """What one format writer wrote: paths relative to the export root, and format details."""

    format: str
    files: tuple[str, ...]
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExportContext:
    """Inputs to every format writer. The frozen graph is made once, on first use."""

    policy: Any  # policy.TFPolicy
    signature: Any  # signatures.Signature
    device: DevicePlan
    opset: int = DEFAULT_OPSET
    inputs_as_nchw: bool = False
    external_data_threshold: int = DEFAULT_EXTERNAL_DATA_THRESHOLD
    _frozen: Any = None
    _onnx: Any = None

    def frozen_graph_def(self):
        """The frozen inference GraphDef holding every signature output (cached)."""
        if self._frozen is None:
            from policy_export.exporter import frozen_graph

            self._frozen = frozen_graph.freeze(self.policy, self.signature)
        return self._frozen

    def release(self) -> None:
        """Drop the cached frozen graph and converted models (their weights) once written."""
        self._frozen = None
        self._onnx = None

    def onnx_models(self):
        """Both ONNX models from one conversion (:func:`exporter.onnx_convert.convert_both`, cached)."""
        if self._onnx is None:
            from policy_export.exporter.onnx_convert import convert_both

            self._onnx = convert_both(self)
        return self._onnx
