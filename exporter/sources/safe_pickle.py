"""Read pickled and msgpack state without running what the file brings.

A pickle names callables by module and attribute, and the standard unpickler imports and calls
them. :class:`RestrictedUnpickler` resolves every such reference through
:meth:`~pickle.Unpickler.find_class`, before anything is imported or called, to one of three
kinds:

- **data rebuilders** (:data:`REBUILDERS`): numpy's array, dtype and scalar rebuilders, wrapped
  so that no array is allocated beyond what the file's bytes hold and only plain dtypes are made
  (numbers, booleans, fixed-width strings: no fields, whose offsets numpy's ``__setstate__`` does
  not check, no subarrays, no objects), ``collections.OrderedDict`` and ``defaultdict`` (with a
  plain factory), a few builtin number types, and ``_codecs.encode`` for latin1 only (how
  protocols 0-2 store bytes);
- **inert records** (:data:`INERT_PREFIXES`, :data:`INERT_NAMES`): references into RLlib
  (``ray.``), cloudpickle's function builders, gymnasium/gym spaces, ``packaging.version``, Keras
  and TensorFlow (an eager policy's optimizer state) and ``functools.partial``; and every global
  inside the arguments of cloudpickle's builders of a class or function pickled by value
  (:data:`BY_VALUE_BUILDERS`: RLlib writes an eager DQN or SAC policy class so), where the pickle
  holds code and the names it uses, which stay names. They become
  :class:`Record` objects that keep the reference, the arguments and the state they were given;
  nothing is imported, a "call" only builds another record, and no function or code object is
  ever made. Spaces are rebuilt from a record's fields by :mod:`exporter.sources.checkpoint`;
- **everything else** is refused with :class:`UnsafeCheckpointError` naming the module, the name and
  the file, before it is resolved.

The BUILD opcode (``__setstate__``, or attributes set on the object) reaches records, arrays
(with a plain dtype, filled from bytes) and dtypes (byte order only) alone: never a rebuilder,
whose attributes would otherwise change the reader itself for later loads.

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

# the optimizer state of a framework("tf2") policy holds Keras's and TensorFlow's own objects
# (CallableList, ResourceVariable...): records too, never imported
INERT_PREFIXES = ("ray.", "cloudpickle.", "gymnasium.spaces.", "gym.spaces.", "packaging.version", "keras.",
                  "tf_keras.", "tensorflow.")
NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric",
                 "numpy")
DEFAULTDICT_FACTORIES = (int, float, list, dict, set, str)
# single globals read as inert records too (a framework("tf2") optimizer state wraps callables in them)
INERT_NAMES = {("functools", "partial")}
# cloudpickle's builders of a class or function pickled by value (an eager policy class RLlib made
# with build_tf_policy: DQN's, SAC's... ``as_eager().with_tracing()``): inside their arguments the
# pickle holds the class's functions, their code and the globals they use, read as names only
BY_VALUE_BUILDERS = ("_make_skeleton_class", "_class_setstate", "_make_function", "_function_setstate",
                     "_make_skeleton_enum")


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

    # a record of a list or dict subclass is filled by pickle's APPENDS / SETITEMS: kept as data
    def append(self, item):
        self.__dict__.setdefault("items", []).append(item)

    def extend(self, items):
        self.__dict__.setdefault("items", []).extend(items)

    def __setitem__(self, key, value):
        self.__dict__.setdefault("entries", {})[key] = value

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


def plain_dtype(dtype: Any, where: str = "a pickle") -> np.dtype:
    """``dtype`` if it is a plain numeric, boolean or fixed-width string dtype: no fields, no
    subarray, no objects (a structured dtype's field offsets are not checked by numpy's
    ``__setstate__``, so one could point outside its array's memory).

    Raises:
        UnsafeCheckpointError: any other dtype.
    """
    dt = dtype if isinstance(dtype, np.dtype) else None
    if dt is None or dt.fields is not None or dt.subdtype is not None or dt.hasobject or dt.kind not in "biufcSU":
        raise UnsafeCheckpointError(f"{where} holds a numpy dtype {dtype!r}; only plain numbers, booleans and "
                                    "fixed-width strings are read")
    return dt


def _reconstruct(subtype, shape, dtype):
    """numpy's ``_reconstruct`` for the empty array a pickled ndarray starts from; its data comes
    from ``__setstate__``, which numpy checks against the shape. A non-empty start (which would
    allocate what the file never held) or another subtype is refused."""
    if subtype is not _NdarrayType or tuple(shape) != (0,):
        raise UnsafeCheckpointError(f"a pickle rebuilds an array of {subtype!r} with shape {shape!r}; only an "
                               "empty numpy.ndarray filled from the file's bytes is read")
    return np.ndarray((0,), plain_dtype(_named_dtype(dtype)))


def _frombuffer(buf, dtype, shape, order):
    array = np.frombuffer(buf, dtype=plain_dtype(_named_dtype(dtype)))
    return array.reshape(shape, order=order)  # numpy refuses a shape the bytes do not hold


def _named_dtype(value: Any) -> Any:
    """A dtype named by a type string (``"f8"``, ``b"b"``), or ``value`` itself when it already is one."""
    return np.dtype(value) if isinstance(value, (str, bytes)) else value


def _dtype(obj, align=False, copy=False):
    if not isinstance(obj, (str, bytes)):
        raise UnsafeCheckpointError(f"a pickle builds a numpy dtype from {obj!r}; only from a type string")
    return plain_dtype(np.dtype(obj, align=bool(align), copy=bool(copy)))


def _str(value: Any = "") -> str:
    """``builtins.str`` of one string or number (never a decoding, which can import codecs)."""
    if not isinstance(value, (str, int, float, bool)):
        raise UnsafeCheckpointError(f"a pickle calls str on {type(value).__name__}")
    return str(value)


def _latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode(text, "latin1")``: how pickle protocols 0-2 store bytes; no other codec."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafeCheckpointError(f"a pickle encodes {type(text).__name__} with {encoding!r}; only latin1 text "
                                    "(pickle's own encoding of bytes) is read")
    return text.encode("latin1")


def _scalar(dtype, data=None):
    try:
        from numpy._core.multiarray import scalar  # noqa: PLC0415 - numpy 2 (and 1.26's alias)
    except ImportError:  # pragma: no cover - numpy < 1.26
        from numpy.core.multiarray import scalar  # noqa: PLC0415

    return scalar(plain_dtype(dtype), data) if data is not None else scalar(plain_dtype(dtype))


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
    ("builtins", "str"): _str,
    ("_codecs", "encode"): _latin1,
}


def _check_build(inst: Any, state: Any, where: str) -> None:
    """What a pickle's BUILD may set the state of: a record; an array from :func:`_reconstruct`
    (its dtype plain); a dtype (numpy's byte-order state, with no fields or subarray). Anything else,
    the rebuilders themselves included, is refused."""
    if isinstance(inst, Record):
        return
    if isinstance(inst, np.ndarray) and isinstance(state, tuple) and len(state) in (4, 5):
        plain_dtype(state[-3], where)
        if not isinstance(state[-1], (bytes, bytearray)):
            raise UnsafeCheckpointError(f"{where} fills an array from {type(state[-1]).__name__}, not bytes")
        return
    if isinstance(inst, np.dtype) and isinstance(state, tuple) and len(state) >= 5 \
            and state[2] is None and state[3] is None and state[4] is None:
        return
    raise UnsafeCheckpointError(f"{where} sets the state of {type(inst).__name__} {state!r:.80}; only records, "
                                "plain arrays and plain dtypes take a state")


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler whose every global is a rebuilder, a record, or refused, and whose BUILD
    opcode (``__setstate__``) reaches only what :func:`_check_build` allows. It is the standard
    library's pure-Python unpickler, so that BUILD can be checked before it runs."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def load_build(self):
        _check_build(self.stack[-2], self.stack[-1], self.where)
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str):
        if (module, name) in REBUILDERS:
            return REBUILDERS[(module, name)]
        if module.startswith(INERT_PREFIXES) or module in {p.rstrip(".") for p in INERT_PREFIXES} \
                or (module, name) in INERT_NAMES or self._inside_code_by_value():
            return _record_type(f"{module}.{name}")
        raise UnsafeCheckpointError(
            f"{self.where} references {module}.{name}, which is not on the allowlist of what a checkpoint "
            "may rebuild (numpy arrays and dtypes, collections, builtin numbers; RLlib, cloudpickle, spaces "
            "and packaging.version only as inert records); nothing was run")

    def _inside_code_by_value(self) -> bool:
        """True while the pickle builds the arguments of one of cloudpickle's :data:`BY_VALUE_BUILDERS`
        (itself an inert record, pushed before its arguments): what such code refers to is a name."""
        return any(isinstance(item, type) and issubclass(item, Record)
                   and item.ref.rsplit(".", 1)[-1] in BY_VALUE_BUILDERS and item.ref.startswith(INERT_PREFIXES)
                   for frame in (self.stack, *self.metastack) for item in frame)

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where} uses a persistent id ({pid!r}); a checkpoint never does")


def loads(data: bytes, where: str) -> Any:
    """Unpickle ``data`` (read from ``where``) with :class:`RestrictedUnpickler`."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises is "not readable"
        raise UnsafeCheckpointError(f"{where} is not a readable pickle: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------------- msgpack

def _msgpack_array(obj: dict, where: str):
    """msgpack_numpy's encoding of an ndarray (``nd`` True) or a numpy scalar (``nd`` False)."""
    kind, data, type_ = obj.get(b"kind", b""), obj.get(b"data"), obj.get(b"type")
    if kind == b"O":
        return loads(data, f"{where} (an object array)")
    if not isinstance(data, bytes) or not isinstance(type_, (str, bytes)):
        raise UnsafeCheckpointError(f"{where} holds a malformed numpy value")
    try:
        dtype = plain_dtype(np.dtype(type_ if isinstance(type_, str) else type_.decode()), where)
    except (TypeError, ValueError, UnicodeDecodeError) as e:
        raise UnsafeCheckpointError(f"{where} holds a numpy value of type {type_!r}: {e}") from None
    if not obj.get(b"nd"):
        if len(data) != dtype.itemsize:
            raise UnsafeCheckpointError(f"{where} holds a numpy {dtype} scalar of {len(data)} bytes")
        return np.frombuffer(data, dtype=dtype)[0]
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
