"""What the format writers share: the policy, its signature, options, and the frozen graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exporter.devices import DevicePlan

DEFAULT_OPSET = 17


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
    _frozen: Any = None

    def frozen_graph_def(self):
        """The frozen inference GraphDef holding every signature output (cached)."""
        if self._frozen is None:
            from exporter import frozen_graph

            self._frozen = frozen_graph.freeze(self.policy, self.signature)
        return self._frozen
