"""What kind of source a path is, decided once for ``convert``, ``inspect``, ``export-many`` and the
Python API: a new source is one module and one entry of :data:`DETECTORS`.

    detect("fixtures/cartpole_mlp").kind      # "spec"
    detect("ckpt/").kind                      # "checkpoint"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policy_export.errors import ExportError, InputError


def _is_spec(path: Path) -> bool:
    return (path.is_file() and path.name == "policy.json") or (path / "policy.json").is_file()


def _is_checkpoint(path: Path) -> bool:
    from policy_export.exporter.sources.checkpoint import is_rllib_checkpoint

    return is_rllib_checkpoint(path)


def _is_saved_model(path: Path) -> bool:
    return (path / "saved_model.pb").is_file()


# (kind, test, what it is), in order: a directory that is several (a spec beside a SavedModel) is the first
DETECTORS: tuple[tuple[str, Callable[[Path], bool], str], ...] = (
    ("spec", _is_spec, "a spec directory (policy.json)"),
    ("checkpoint", _is_checkpoint, "an RLlib checkpoint (rllib_checkpoint.json)"),
    ("saved_model", _is_saved_model, "a SavedModel directory (saved_model.pb)"),
)
KINDS = tuple(kind for kind, _, _ in DETECTORS)


@dataclass(frozen=True)
class Source:
    """A source path and what it is (one of :data:`KINDS`)."""

    kind: str
    path: Path


def detect(path: str | Path, allowed: tuple[str, ...] = KINDS, what: str = "source") -> Source:
    """The kind of ``path`` among ``allowed``.

    Raises:
        InputError: no such path, or none of the allowed kinds. ExportError: a directory that holds
            RLlib checkpoints one level down (ray <= 2.6 saves into ``checkpoint_000001/``; Tune
            keeps several), naming them.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {path}: no such directory")
    for kind, test, _ in DETECTORS:
        if kind in allowed and test(path):
            return Source(kind, path)
    if path.is_dir() and "checkpoint" in allowed:
        inner = sorted(p.parent.name for p in path.glob("*/rllib_checkpoint.json"))
        if inner:
            raise ExportError(f"{path} is not a checkpoint itself but holds RLlib checkpoints in {', '.join(inner)}: "
                              f"give one of those directories (e.g. {path / inner[-1]})")
    kinds = [text for kind, _, text in DETECTORS if kind in allowed]
    raise InputError(f"{what} {path} is not {', '.join(kinds[:-1])}{' or ' if len(kinds) > 1 else ''}{kinds[-1]}")
