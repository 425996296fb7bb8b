"""What an export run returns and the steps every export pipeline shares (the one that builds a
policy's export from its TF graph, :mod:`exporter.export`, and the one that makes a policy exported
elsewhere an export, :mod:`exporter.foreign.export`), without TensorFlow."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_export.errors import ExportError
from policy_export.exporter.formats.base import FormatRecord
from policy_export.exporter.parity.compare import ParityReport
from policy_export.exporter.progress import SILENT, Progress

PARITY_DIR = "parity"


@dataclass(frozen=True)
class ExportResult:
    """What an export run wrote (:func:`exporter.export_policy`, :func:`exporter.foreign.export.export_model`); ``timings`` holds each stage's wall time in seconds."""

    path: Path
    formats: dict[str, FormatRecord]
    files: list[dict[str, Any]]
    parity: ParityReport
    manifest: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # process peak memory at each stage's end
    missing: dict[str, str] = field(default_factory=dict)  # format -> why it could not be made

    @property
    def complete(self) -> bool:
        """Every format asked for was written (and proven)."""
        return not self.missing


@contextlib.contextmanager
def disk_errors(out: Path):
    """An OS error while the export is written (a full disk, an I/O error, a permission change)
    becomes an :class:`ExportError` naming it; the staging directory is gone by then."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or str(e)
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise ExportError(f"writing the export {out} failed: {reason}{where}; nothing was left behind") from e


@contextlib.contextmanager
def timed_stage(timings: dict[str, float], name: str, progress: Progress = SILENT, total: int | None = None):
    """Time the stage ``name`` into ``timings`` and report it to ``progress`` (yields its task)."""
    start = time.perf_counter()
    try:
        with progress.stage(name, total) as task:
            yield task
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def remove_written(path: Path) -> None:
    """What a format that failed left in the staging directory."""
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
