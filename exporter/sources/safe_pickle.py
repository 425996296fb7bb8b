"""Read pickled and msgpack state without running what the file brings.

A pickle names callables by module and attribute, and the standard unpickler imports and calls
them. :class:`RestrictedUnpickler` resolves every such reference through
:meth:`~pickle.Unpickler.find_class`, before anything is imported or called, to one of three
kinds:

- **data rebuilders** (:data:`REBUILDERS`): numpy's array, dtype and scalar rebuilders, wrapped
  so that no array is allocated beyond what the file's bytes hold, ``collections.OrderedDict``
  and ``defaultdict`` (with a plain factory), and a few builtin number types;
- **inert records** (:data:`INERT_PREFIXES`): references into RLlib (``ray.``), cloudpickle's
  function builders, gymnasium/gym spaces and ``packaging.version``. They become
  :class:`Record` objects that keep the reference, the arguments and the state they were given;
  nothing is imported, a "call" only builds another record, and no function or code object is
  ever made. Spaces are rebuilt from a record's fields by :mod:`exporter.sources.checkpoint`;
- **everything else** is refused with :class:`UnsafeCheckpointError` naming the module, the name and
  the file, before it is resolved.

msgpack state (``checkpoint_format="msgpack"``) is decoded with size limits, and its numpy
extension (``{"nd": ..., "type": ..., "shape": ..., "data": ...}``) is rebuilt here with the
shape checked against the bytes; an object array (which msgpack_numpy pickles) goes through the
same restricted unpickler.
"""

from __future__ import annotations

import collections
import io
import pickle
from typing import Any

import numpy as np

from policy_export.errors import UnsafeCheckpointError

INERT_PREFIXES = ("ray.", "cloudpickle.", "gymnasium.spaces.", "gym.spaces.", "packaging.version")
NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric",
                 "numpy")
DEFAULTDICT_FACTORIES = (int, float, list, dict, set, str)


class Record:
    """An inert stand-in for an object of a referenced class (``ref`` = ``module.name``)."""

    ref = "?"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __call__(self, *args, **kwargs):
        return _record_type(f"{self.ref}()")(*args, **kwargs)

    def fields(self) -> dict[str, Any]:
        """The record's state as a dict (a ``(dict, slots)`` pair merged), or {}."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, (dict, type(None))) for s in state):
            return {**(state[0] or {}), **(state[1] or {})}
        return dict(state) if isinstance(state, dict) else {}

    def __repr__(self) -> str:
        return f"<record {self.ref}>"


_RECORD_TYPES: dict[str, type] = {}


def _record_type(ref: str) -> type:
    if ref not in _RECORD_TYPES:
        _RECORD_TYPES[ref] = type("Record", (Record,), {"ref": ref, "__slots__": ()})
    return _RECORD_TYPES[ref]


class _NdarrayType:
    """What ``numpy.ndarray`` resolves to: accepted by :func:`_reconstruct` only, never called."""

    def __new__(cls, *args, **kwargs):
        raise UnsafeCheckpointError("a pickle constructs numpy.ndarray directly; only numpy's own rebuilders may")


def _reconstruct(subtype, shape, dtype):
    """numpy's ``_reconstruct`` for the empty array a pickled ndarray starts from; its data comes
    from ``__setstate__``, which numpy checks against the shape. A non-empty start (which would
    allocate what the file never held) or another subtype is refused."""
    if subtype is not _NdarrayType or tuple(shape) != (0,):
        raise UnsafeCheckpointError(f"a pickle rebuilds an array of {subtype!r} with shape {shape!r}; only an "
                               "empty numpy.ndarray filled from the file's bytes is read")
    return np.ndarray((0,), np.dtype(dtype))


def _frombuffer(buf, dtype, shape, order):
    array = np.frombuffer(buf, dtype=np.dtype(dtype))
    return array.reshape(shape, order=order)  # numpy refuses a shape the bytes do not hold


def _dtype(obj, align=False, copy=False):
    if isinstance(obj, Record):
        raise UnsafeCheckpointError(f"a pickle builds a numpy dtype from {obj!r}")
    return np.dtype(obj, align=align, copy=copy)


def _scalar(dtype, data=None):
    try:
        from numpy._core.multiarray import scalar  # noqa: PLC0415 - numpy 2 (and 1.26's alias)
    except ImportError:  # pragma: no cover - numpy < 1.26
        from numpy.core.multiarray import scalar  # noqa: PLC0415

    return scalar(dtype, data) if data is not None else scalar(dtype)


def _defaultdict(factory=None, *args):
    return collections.defaultdict(factory if factory in DEFAULTDICT_FACTORIES else None, *args)


REBUILDERS = {
    **{(m, "_reconstruct"): _reconstruct for m in NUMPY_MODULES[:2]},
    **{(m, "scalar"): _scalar for m in NUMPY_MODULES[:2]},
    **{(m, "_frombuffer"): _frombuffer for m in NUMPY_MODULES[2:4]},
    ("numpy", "ndarray"): _NdarrayType,
    ("numpy", "dtype"): _dtype,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): _defaultdict,
    ("builtins", "int"): int,
    ("builtins", "float"): float,
    ("builtins", "complex"): complex,
    ("builtins", "bool"): bool,
    ("builtins", "str"): str,
}


class RestrictedUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` whose every global is a rebuilder, a record, or refused."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in REBUILDERS:
            return REBUILDERS[(module, name)]
        if module.startswith(INERT_PREFIXES) or module in {p.rstrip(".") for p in INERT_PREFIXES}:
            return _record_type(f"{module}.{name}")
        raise UnsafeCheckpointError(
            f"{self.where} references {module}.{name}, which is not on the allowlist of what a checkpoint "
            "may rebuild (numpy arrays and dtypes, collections, builtin numbers; RLlib, cloudpickle, spaces "
            "and packaging.version only as inert records); nothing was run")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where} uses a persistent id ({pid!r}); a checkpoint never does")


def loads(data: bytes, where: str) -> Any:
    """Unpickle ``data`` (read from ``where``) with :class:`RestrictedUnpickler`."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, RecursionError, OverflowError) as e:
        raise UnsafeCheckpointError(f"{where} is not a readable pickle: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------------- msgpack

def _msgpack_array(obj: dict, where: str):
    """msgpack_numpy's encoding of an ndarray (``nd`` True) or a numpy scalar (``nd`` False)."""
    kind, data, type_ = obj.get(b"kind", b""), obj.get(b"data"), obj.get(b"type")
    if kind == b"O":
        return loads(data, f"{where} (an object array)")
    if not isinstance(data, bytes) or not isinstance(type_, (str, bytes)):
        raise UnsafeCheckpointError(f"{where} holds a malformed numpy value")
    dtype = np.dtype(type_ if isinstance(type_, str) else type_.decode())
    if dtype.hasobject or dtype.fields is not None and kind != b"V":
        raise UnsafeCheckpointError(f"{where} holds a numpy value of dtype {dtype}")
    if not obj.get(b"nd"):
        return np.frombuffer(data, dtype=dtype)[0] if len(data) == dtype.itemsize else None
    shape = obj.get(b"shape")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise UnsafeCheckpointError(f"{where} holds an array of shape {shape!r}")
    if int(np.prod(shape, dtype=object)) * dtype.itemsize != len(data):
        raise UnsafeCheckpointError(f"{where} declares an array of shape {tuple(shape)} ({dtype}) that its "
                               f"{len(data)} bytes do not hold")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def msgpack_loads(data: bytes, where: str) -> Any:
    """Decode msgpack ``data`` with limits from its own size; numpy values rebuilt and checked."""
    import msgpack  # noqa: PLC0415 - only msgpack checkpoints need it

    def hook(obj):
        if b"nd" in obj and b"data" in obj:
            return _msgpack_array(obj, where)
        return obj

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, object_hook=hook,
                               use_list=True)  # unpackb bounds every declared length by len(data)
    except UnsafeCheckpointError:
        raise
    except (ValueError, TypeError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError, RecursionError, MemoryError) as e:
        raise UnsafeCheckpointError(f"{where} is not readable msgpack: {type(e).__name__}: {e}") from None
