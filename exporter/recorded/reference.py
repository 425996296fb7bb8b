"""A reference recording (``--reference FILE``): what a training framework computed, as rows.

An ``.npz`` (``policy_export.recording`` writes it; ``np.savez`` of the same arrays does too):
arrays named as the graph's inputs and outputs, one row per step, and for a recurrent policy
``episode_ids``. It is read as ``--observations`` files are (:mod:`.arrays`: a regular file, not
a link; numpy's format without pickles; sizes declared by the headers checked against the
reading budget before anything is inflated), every row kept: the recording is the proof, not a
sample. At most :data:`REFERENCE_BYTES` of arrays and :data:`MAX_ROWS` rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded import _regular
from policy_export.exporter.recorded.arrays import columns

REFERENCE_BYTES = 1 << 30  # bytes of every recorded array together
MAX_ROWS = 1 << 22  # rows of a recording (each replayed through the model)
FLAG = "--reference"


@dataclass
class Reference:
    """The recording read: its arrays by name, and what the export records of it."""

    path: Path
    arrays: dict[str, np.ndarray]
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(next(iter(self.arrays.values())))


def check_reference(path: str | Path) -> Path:
    """The recording's path, checked before anything loads: a regular ``.npz`` file, not a link.

    Raises:
        InputError: missing, a link, not a regular file, or not an ``.npz``.
    """
    path = Path(path)
    if path.suffix.lower() != ".npz":
        raise InputError(f"{FLAG} {path}: a recording is an .npz of arrays named as the graph's inputs and outputs "
                         "(policy_export.recording writes one)")
    _regular(path, flag=FLAG)
    return path


def read_reference(path: str | Path) -> Reference:
    """Every row of the recording at ``path`` (checked with :func:`check_reference`).

    Raises:
        InputError: not a readable recording, or over its limits (named).
    """
    path = check_reference(path)
    found = columns(path, "npz", flag=FLAG)
    if not found:
        raise InputError(f"{FLAG} {path}: holds no arrays")
    rows = {c.rows for c in found.values()}
    total = sum(c.rows * int(np.prod(c.shape, dtype=np.int64)) * c.dtype.itemsize for c in found.values())
    if total > REFERENCE_BYTES:
        raise InputError(f"{FLAG} {path}: its arrays hold {total} bytes, more than a recording may "
                         f"({REFERENCE_BYTES >> 20} MiB)")
    if len(rows) != 1:
        raise InputError(f"{FLAG} {path}: its arrays hold different numbers of rows "
                         f"({', '.join(f'{k} {c.rows}' for k, c in list(found.items())[:8])})")
    n = rows.pop()
    if not 0 < n <= MAX_ROWS:
        raise InputError(f"{FLAG} {path}: {n} rows; a recording holds 1 to {MAX_ROWS}")
    arrays = {key: np.concatenate(list(column.chunks())) for key, column in found.items()}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return Reference(path, arrays, {"path": str(path), "sha256": digest.hexdigest(), "rows": n,
                                    "arrays": sorted(arrays)})
