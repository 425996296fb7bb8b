"""What comes in: sources as plugins, found by a registry, as formats are.

Each entry of :data:`PLUGINS` is a module of this package whose ``SOURCE`` is a
:class:`~exporter.sources.base.Source`: how a path is recognised, its options, its policies, what
``inspect`` shows of it and ``load``. ``export``/``convert``, ``inspect``, ``export-many`` and the
Python API ask the registry; none of them imports a source's own module. A new source is one
module here and one entry of :data:`PLUGINS`. Importing this package is light: a source's module
imports TensorFlow only when it loads a policy.

    from policy_export.exporter import sources
    sources.detect("fixtures/cartpole_mlp").name     # "spec"
    sources.get("checkpoint").options                # its options, declared once

The modules the plugins use:

    spec_dir.py         a spec directory (policy.json), built by :class:`policy.TFPolicy`
    rllib_checkpoint.py an RLlib checkpoint (old API stack): checkpoint.py + safe_pickle.py read it
                        without ray or pickle; checkpoint_policy.py + rllib_nets.py rebuild it;
                        rllib_layout.py names a framework("tf2") checkpoint's unnamed weights
    saved_model_dir.py  a SavedModel: legacy.py (a TF1 policy graph, RLlib <= 2.0) or keras.py (a
                        Keras base model, RLlib >= 2.1); lstm_step.py rebuilds a recurrent loop
    rlmodule/           RLlib's new API stack (torch RLModules): reader.py reads a checkpoint without
                        ray, torch or pickle; graph.py rebuilds each default module as a TF graph
    sb3/                a Stable-Baselines3 model zip (and its vec_normalize.pkl): reader.py reads it
                        without torch, SB3 or pickle; graph.py rebuilds what predict computes
    torchfile.py        torch.save's format read without torch (the state dicts of torch sources);
    torch_layers.py     torch's layers as TF ops on such weights; pickled_spaces.py gymnasium spaces
                        from their pickled records
    rllib.py            a live RLlib TF policy (``from_rllib``: a Python object, not a path)
"""

from __future__ import annotations

import importlib
from pathlib import Path

from policy_export.errors import ExportError, InputError
from policy_export.exporter.sources.base import Inspection, Loaded, Opened, Option, Source

__all__ = ["Inspection", "Loaded", "Opened", "Option", "Source", "all_sources", "detect", "get", "names"]

# one entry per source (a module of this package with a SOURCE), in no particular order: detection
# goes by each source's ``order``
PLUGINS = ("spec_dir", "rllib_checkpoint", "saved_model_dir", "export_dir", "rlmodule", "sb3")
_REGISTRY: dict[str, Source] | None = None


def _registry() -> dict[str, Source]:
    global _REGISTRY
    if _REGISTRY is None:
        found = [importlib.import_module(f"{__name__}.{module}").SOURCE for module in PLUGINS]
        found.sort(key=lambda s: (s.order, s.name))
        _REGISTRY = {s.name: s for s in found}
    return _REGISTRY


def all_sources() -> list[Source]:
    """Every registered source, in detection order."""
    return list(_registry().values())


def names() -> tuple[str, ...]:
    return tuple(_registry())


def get(name: str) -> Source:
    """The source called ``name``.

    Raises:
        InputError: no source has that name.
    """
    try:
        return _registry()[name]
    except KeyError:
        raise InputError(f"unknown source kind {name!r}; the kinds: {', '.join(names())}") from None


def detect(path: str | Path, allowed: tuple[str, ...] | None = None, what: str = "source") -> Source:
    """The source that ``path`` is, among ``allowed`` (names; default every source).

    Raises:
        InputError: no such path, or none of the allowed kinds. ExportError: a directory that holds
            RLlib checkpoints one level down (ray <= 2.6 saves into ``checkpoint_000001/``; Tune
            keeps several), naming them.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {path}: no such directory")
    candidates = [s for s in all_sources() if allowed is None or s.name in allowed]
    for source in candidates:
        if source.detect(path):
            return source
    inner = _sources_one_level_down(path, candidates)
    if inner:
        kinds = sorted({source.description for _, source in inner})
        listed = ", ".join(name for name, _ in inner)
        raise ExportError(f"{path} is not a source itself but holds {' and '.join(kinds)} in {listed}: give one "
                          f"of those directories (e.g. {path / inner[-1][0]})")
    kinds = [s.description for s in candidates]
    raise InputError(f"{what} {path} is not {', '.join(kinds[:-1])}{' or ' if len(kinds) > 1 else ''}{kinds[-1]}")


def _sources_one_level_down(path: Path, candidates: list[Source], limit: int = 1000) -> list[tuple[str, Source]]:
    """The directories directly inside ``path`` (not through a link; at most ``limit`` looked at)
    that are a source, with it, by name."""
    if not path.is_dir() or path.is_symlink():
        return []
    found = []
    for i, child in enumerate(sorted(path.iterdir())):
        if i >= limit:
            break
        if child.is_dir() and not child.is_symlink():
            source = next((s for s in candidates if s.detect(child)), None)
            if source is not None:
                found.append((child.name, source))
    return found
