"""The golden group: observations sampled from the policy's spaces and the reference's outputs on
them (``parity/inputs.npz``, ``parity/outputs.npz``), every format's deterministic outputs
compared with those (a lossy format's judged by its behavioural thresholds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policy_export.errors import ExportError
from policy_export.exporter.parity.compare import compare, run_batched, sample_inputs
from policy_export.exporter.parity.groups.base import ParityGroup, Stored

GOLDEN_INPUTS = "parity/inputs.npz"
GOLDEN_OUTPUTS = "parity/outputs.npz"


@dataclass
class GoldenGroup(ParityGroup):
    """The golden inputs and the reference's outputs on them."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]

    name = "golden"
    files = (GOLDEN_INPUTS, GOLDEN_OUTPUTS)
    order, lossy_order = 0, 0

    @classmethod
    def make(cls, reference, samples: int, seed: int) -> "GoldenGroup":
        """``samples`` rows drawn from the reference's spaces (``seed``) and its outputs on them."""
        inputs = sample_inputs(reference.observation_space, reference.action_space, reference.contract, samples, seed)
        return cls(inputs, reference.golden_outputs(inputs))

    @property
    def samples(self) -> int:
        return len(next(iter(self.inputs.values()))) if self.inputs else 0

    def write(self, root: Path) -> None:
        from policy_export.exporter import manifest

        manifest.save_npz(root / GOLDEN_INPUTS, self.inputs)
        manifest.save_npz(root / GOLDEN_OUTPUTS, self.outputs)

    @classmethod
    def load(cls, root: Path, stored: Stored) -> "GoldenGroup":
        from policy_export.exporter import manifest

        inputs, outputs = manifest.load_npz(root / GOLDEN_INPUTS), manifest.load_npz(root / GOLDEN_OUTPUTS)
        if not inputs or not outputs:
            raise ExportError(f"{GOLDEN_INPUTS} and {GOLDEN_OUTPUTS} must hold arrays")
        return cls(inputs, outputs)

    def manifest_entry(self) -> list[str]:
        return [GOLDEN_INPUTS, GOLDEN_OUTPUTS]

    def rows(self, fmt) -> int:
        return self.samples

    def check(self, label: str, fmt, runner, replay, report) -> None:
        keys = replay.output_keys(fmt)
        got = run_batched(runner, self.inputs, replay.batch_size)
        if fmt.capabilities.lossy:
            from policy_export.exporter.parity.behaviour import compare_behaviour

            if replay.action_space is None:
                raise ExportError(f"{label}: behavioural parity needs the export's action space")
            report.behaviour.extend(compare_behaviour(label, self.outputs, got, keys, replay.action_space,
                                                      replay.thresholds(fmt)))
            return
        report.records.extend(compare(label, self.outputs, got, replay.tolerances, keys, replay.contract))

    def describe(self) -> list[str]:
        return [f"golden: {self.samples} samples, deterministic outputs"]


def golden(groups: Mapping[str, ParityGroup]) -> GoldenGroup | None:
    group = groups.get(GoldenGroup.name)
    return group if isinstance(group, GoldenGroup) else None
