"""The protocol every parity group follows: one check of the parity plan, in one module.

A group is what one check draws or reads, what it stores in the export, how each format replays
it and how it reports:

- :meth:`ParityGroup.make` (a classmethod of each group, with the arguments it needs) builds it
  from a **reference**: the part that says what the right outputs are. For an export this package
  builds, the TF session (:class:`~exporter.parity.references.session.SessionReference`: it runs
  the golden inputs, draws the exploration samples, steps the sequences); for a policy exported
  elsewhere, the recording of what its training framework computed
  (:mod:`exporter.parity.references.recording`). A group asks its reference for what it needs and
  never runs anything else;
- :meth:`write` and :meth:`load` keep it in the export's ``parity/`` folder (``files``), every
  file read back with ``allow_pickle=False`` and checked against the contract;
- :meth:`rows` says how many rows a format's replay runs (the progress bar);
- :meth:`check` replays it on one format's runner and adds the records (a lossy format is judged
  by its behavioural thresholds instead, where the group allows it);
- :meth:`describe` says in a line or two what it holds (``verify`` prints it).

The groups of a plan are found by the registry :data:`exporter.parity.groups.GROUPS`; adding one
is a module there and an entry in it (docs/design.md shows it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from policy_export.errors import ExportError
from policy_export.signatures.contract import Contract


@dataclass
class Stored:
    """What loading a stored group is given: the export's action space and contract, the run's
    batch size, the manifest's record of the group (``parity.<name>``, or None) and the
    manifest's whole document."""

    action_space: Any
    contract: Contract
    batch_size: int
    record: Any = None
    doc: Mapping[str, Any] = field(default_factory=dict)


class ParityGroup:
    """One check of the parity plan (see the module's description)."""

    name: ClassVar[str] = ""  # its key in the plan and in the manifest's parity.plan
    files: ClassVar[tuple[str, ...]] = ()  # where an export keeps it, under its root
    order: ClassVar[int] = 100  # when a format replays it (the registry's order)
    lossy_order: ClassVar[int | None] = None  # when a lossy format replays it (None: not on lossy formats)
    listed_when_absent: ClassVar[bool] = True  # the manifest's parity.plan names it (null) when a plan lacks it

    def write(self, root: Path) -> None:
        from policy_export.exporter import manifest

        manifest.save_npz(root / self.files[0], self.to_arrays(), compressed=True)

    def to_arrays(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    @classmethod
    def load(cls, root: Path, stored: Stored) -> "ParityGroup":
        """The group kept under ``root`` (its files trusted: the caller checked their hashes).

        Raises:
            ExportError: the files are not this group for this contract (named).
        """
        from policy_export.exporter import manifest

        return cls.from_arrays(manifest.load_npz(root / cls.files[0]), stored, cls.files[0])

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], stored: Stored, where: str) -> "ParityGroup":
        raise NotImplementedError

    def manifest_entry(self) -> Any:
        """What the manifest's ``parity.plan`` says of the group: its file."""
        return self.files[0]

    def rows(self, fmt) -> int:
        """The rows a replay on ``fmt`` runs."""
        return 0

    def check(self, label: str, fmt, runner, replay, report) -> None:
        """Replay the group on ``runner`` (format ``fmt``, reported as ``label``) and add the records to ``report``."""
        raise NotImplementedError

    def describe(self) -> list[str]:
        return []


def prefixed(arrays: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def check_rows(where: str, name: str, group: Mapping[str, np.ndarray], rows: int) -> None:
    bad = sorted(k for k, v in group.items() if v.ndim == 0 or len(v) != rows)
    if bad:
        raise ExportError(f"{where}: {name} arrays {bad} do not have {rows} rows")


def check_against_contract(where: str, name: str, group: Mapping[str, np.ndarray], contract: Contract,
                           inputs: bool) -> None:
    specs = {s.key: s for s in (contract.inputs if inputs else contract.outputs)}
    for key, value in group.items():
        spec = specs.get(key)
        if spec is None:
            raise ExportError(f"{where}: {name}/{key} is not an {'input' if inputs else 'output'} of the contract")
        if value.dtype != np.dtype(spec.dtype) or value.ndim != len(spec.shape):
            raise ExportError(f"{where}: {name}/{key} is {value.dtype.name} of rank {value.ndim}; the contract says "
                              f"{spec.dtype} {spec.shape_text()}")
