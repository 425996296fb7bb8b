"""Checks that the installed libraries work together, made before the first of them is imported.

The supported range spans TensorFlow 2.15-2.21. TensorFlow 2.15 pins ``ml_dtypes`` 0.3, while
onnx 1.19 and newer need ``ml_dtypes`` 0.5 (float4 types) and fail at import with an
``AttributeError`` deep inside onnx. pip cannot see that conflict (onnx does not state the bound),
so it is caught here and reported with the fix.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from importlib import metadata

from policy_export.errors import EnvironmentMismatchError, InputError


def _version(dist: str) -> tuple[int, ...] | None:
    try:
        text = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_onnx_environment() -> None:
    """Raise :class:`EnvironmentMismatchError` when onnx cannot import beside this ``ml_dtypes``.

    Returns None when the pair works (or either is absent, which the import itself reports).
    """
    onnx_v, ml_v = _version("onnx"), _version("ml_dtypes") or _version("ml-dtypes")
    if onnx_v and ml_v and onnx_v >= (1, 19) and ml_v < (0, 5):
        raise EnvironmentMismatchError(
            f"onnx {'.'.join(map(str, onnx_v))} needs ml_dtypes >= 0.5 but ml_dtypes "
            f"{'.'.join(map(str, ml_v))} is installed (older TensorFlow releases pin it); "
            "install an onnx that works beside it: pip install \"onnx>=1.17,<1.19\"")


def import_onnx():
    """``import onnx`` after :func:`check_onnx_environment`; returns the module."""
    check_onnx_environment()
    import onnx

    return onnx


def missing_modules(modules: Sequence[str]) -> list[str]:
    """Which of ``modules`` (top-level import names) cannot be imported here, found without
    importing them."""
    missing = []
    for name in modules:
        if name in sys.modules:
            if sys.modules[name] is None:  # an import blocked on purpose
                missing.append(name)
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def require(modules: Sequence[str], extra: str, what: str) -> None:
    """Raises InputError naming the extra to install when one of ``modules`` is missing for ``what``.

    Example: ``require(("openvino",), "openvino", "format 'openvino'")``.
    """
    missing = missing_modules(modules)
    if missing:
        names = " and ".join([", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing)
        which = "which is" if len(missing) == 1 else "which are"
        raise InputError(f"{what} needs the module{'s' if len(missing) > 1 else ''} {names}, {which} not installed; "
                         f"install the {extra} extra: pip install \"policy-export[{extra}]\"")
