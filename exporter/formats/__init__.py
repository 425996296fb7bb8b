"""Export formats as plugins: one module (or sub-package) per format in this package, found by the registry.

Each defines ``FORMAT``, an instance of :class:`~exporter.formats.base.Format`: its name, the
path it writes inside an export, its capabilities, ``write(ctx, target)`` and
``open(path, manifest, device) -> Runner``. Export, verify, candidates, rollouts and localisation
ask the registry and the capabilities; none of them names a format. A new format is a new module
here; a format with more than one file is a sub-package (``onnx/``: writer, conversion, runner
and compressed models; ``tflite/``; ``keras/``). A family is one folder: its variants are modules
of the family's package, each with a ``FORMAT`` of its own, listed in the package's ``VARIANTS``
(``onnx/int8.py``, ``onnx/fp16.py``, ``onnx/explore.py``, ``onnx/deterministic.py``,
``tflite/int8.py``, ``openvino/bf16.py``). Importing this package is light: the modules import
TensorFlow or ONNX only when they write or open a model.

    from policy_export.exporter import formats
    formats.names()            # every format, in export order
    formats.get("onnx").path   # "model.onnx"
"""

from __future__ import annotations

import importlib
import pkgutil

from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.errors import InputError

__all__ = ["Capabilities", "Format", "all_formats", "get", "names", "default_names", "with_capability", "paths"]

_REGISTRY: dict[str, Format] | None = None
# what the formats share, not formats: the plugin protocol and export context, the runner base
# class, and the TensorFlow runner of the SavedModel and frozen graph
_SHARED = {"base", "runner", "tf_runner"}


def _registry() -> dict[str, Format]:
    global _REGISTRY
    if _REGISTRY is None:
        found = []
        for info in pkgutil.iter_modules(__path__):
            if info.name in _SHARED:
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            members = [module] + [importlib.import_module(f"{module.__name__}.{variant}")
                                  for variant in getattr(module, "VARIANTS", ())]
            found += [m.FORMAT for m in members if isinstance(getattr(m, "FORMAT", None), Format)]
        found.sort(key=lambda f: (f.order, f.name))
        _REGISTRY = {f.name: f for f in found}
    return _REGISTRY


def all_formats() -> list[Format]:
    """Every registered format, in export order."""
    return list(_registry().values())


def names() -> tuple[str, ...]:
    return tuple(_registry())


def default_names() -> tuple[str, ...]:
    """The formats written when none are chosen."""
    return tuple(f.name for f in all_formats() if f.capabilities.default)


def get(name: str) -> Format:
    """The format called ``name``.

    Raises:
        InputError: no format has that name.
    """
    try:
        return _registry()[name]
    except KeyError:
        raise InputError(f"unknown format {name!r}; choose from {', '.join(names())}") from None


def with_capability(capability: str, among=None) -> list[Format]:
    """The formats (of ``among``, names in any order; default all) with ``capability`` true, in export order."""
    chosen = set(among) if among is not None else None
    return [f for f in all_formats() if getattr(f.capabilities, capability)
            and (chosen is None or f.name in chosen)]


def localisation_graph() -> Format:
    """The format whose TF graph failing ONNX models are localised against (capability ``localises``)."""
    (graph,) = with_capability("localises")
    return graph


def paths() -> dict[str, str]:
    """Format name -> the path it writes inside an export."""
    return {f.name: f.path for f in all_formats()}
