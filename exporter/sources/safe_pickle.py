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
  nothing is imported, a "call" only builds another record (at most :data:`CALL_DEPTH` calls
  deep), and no function or code object is ever made. Spaces are rebuilt from a record's fields
  by :mod:`exporter.sources.checkpoint`;
- **everything else** is refused with :class:`UnsafeCheckpointError` naming the module, the name and
  the file, before it is resolved.

The BUILD opcode (``__setstate__``, or attributes set on the object) reaches three things only:

- a record;
- an array the same pickle just started with numpy's ``_reconstruct`` (empty), once: numpy
  fills it from the state's bytes, checked against its shape and plain dtype. An array already
  filled, or one made another way, is never filled again (that would free memory another array
  still views);
- a dtype the same pickle made, once, and **numpy's own ``__setstate__`` never runs on it**: the
  state may only name a byte order (its item size, alignment and flags must be the dtype's own),
  and a *new* dtype with that byte order replaces the old one on the stack and in the memo. A
  dtype is never changed after it is made, so no array can come to read past its buffer.

Every read runs under a :class:`ReadBudget` (see :func:`reading`): pickle opcodes and msgpack
values built, bytes decoded from base64/zlib, and wall time, checked as the file is read. What a
pickle or msgpack document holds is then held to :func:`check_value_size` (values and characters
as ``repr`` would visit them, shared references counted as often as they are used, and nesting
depth) before any caller walks it. Messages quote file content through :func:`short_repr`, never
a full ``repr`` or ``str``.

msgpack state (``checkpoint_format="msgpack"``) is decoded with size limits, and its numpy
extension (``{"nd": ..., "type": ..., "shape": ..., "data": ...}``) is rebuilt here with the
shape checked against the bytes; an object array (which msgpack_numpy pickles) goes through the
same restricted unpickler.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import io
import pickle
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from policy_export.errors import UnsafeCheckpointError

# the optimizer state of a framework("tf2") policy holds Keras's and TensorFlow's own objects
# (CallableList, ResourceVariable...): records too, never imported
INERT_PREFIXES = ("ray.", "cloudpickle.", "gymnasium.spaces.", "gym.spaces.", "packaging.version", "keras.",
                  "tf_keras.", "tensorflow.")
NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric",
                 "numpy")
DEFAULTDICT_FACTORIES = (int, float, list, dict, set, str)
# single globals read as inert records too: a framework("tf2") optimizer state wraps callables in
# functools.partial; a pickled gymnasium space (RLlib's new API stack keeps its spaces so) holds
# its random generator, numpy's bit generator and seed sequence; RLlib's NumpyToTensor connector
# keeps a torch.device. Names only: nothing is imported or called
INERT_NAMES = {("functools", "partial"), ("torch", "device"),
               ("numpy.random._pickle", "__generator_ctor"), ("numpy.random._pickle", "__bit_generator_ctor"),
               ("numpy.random._pickle", "__randomstate_ctor"), ("numpy.random.bit_generator", "SeedSequence"),
               ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"), ("numpy.random._pcg64", "PCG64"),
               ("numpy.random._pcg64", "PCG64DXSM"), ("numpy.random._mt19937", "MT19937"),
               ("numpy.random._philox", "Philox"), ("numpy.random._sfc64", "SFC64")}
# cloudpickle's builders of a class or function pickled by value (an eager policy class RLlib made
# with build_tf_policy: DQN's, SAC's... ``as_eager().with_tracing()``): inside their arguments the
# pickle holds the class's functions, their code and the globals they use, read as names only
BY_VALUE_BUILDERS = ("_make_skeleton_class", "_class_setstate", "_make_function", "_function_setstate",
                     "_make_skeleton_enum")
NAME_LIMIT = 256  # characters of a pickled global's module, and of its name
CALL_DEPTH = 8  # calls of a record on the result of a call of a record
RECORD_TYPES_KEPT = 4096  # record types cached for the process; more are made per read and dropped

# ---------------------------------------------------------------------------------------- budget

OBJECTS_LIMIT = 1 << 21  # pickle opcodes run (each builds at most one object) + msgpack values, per read
DECODED_LIMIT = 256 << 20  # bytes base64- and zlib-decoded from a checkpoint's arrays, per read
SECONDS_LIMIT = 30.0  # wall time of one read
TENSOR_LIMIT = 1 << 30  # bytes of arrays made from a torch file's storages, per read
RANK_LIMIT = 32  # dimensions of an array's declared shape


@dataclass
class ReadBudget:
    """What reading one checkpoint may spend; exceeding any part is :class:`UnsafeCheckpointError`.

    ``objects``: pickle opcodes and msgpack values (each builds at most one object); ``decoded``:
    bytes decoded from base64 and zlib; ``tensors``: bytes of arrays made from torch storages;
    ``seconds``: wall time from the budget's creation.
    ``used_objects`` and ``used_decoded`` say what a read took::

        budget = ReadBudget()
        read_checkpoint(path, budget)   # budget.used_objects == opcodes + values read
    """

    objects: int = OBJECTS_LIMIT
    decoded: int = DECODED_LIMIT
    seconds: float = SECONDS_LIMIT
    tensors: int = TENSOR_LIMIT
    used_objects: int = 0
    used_decoded: int = 0
    used_tensors: int = 0
    deadline: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def charge_objects(self, count: int, where: str) -> None:
        """Count ``count`` objects built; raises past :attr:`objects` or past the deadline."""
        self.used_objects += count
        if self.used_objects > self.objects:
            raise UnsafeCheckpointError(f"{where} builds more than {self.objects} objects, the object budget of "
                                        "one checkpoint read; nothing was run")
        self.check_time(where)

    def charge_decoded(self, count: int, where: str) -> None:
        """Count ``count`` bytes decoded; raises past :attr:`decoded`."""
        self.used_decoded += count
        if self.used_decoded > self.decoded:
            raise UnsafeCheckpointError(f"{where} decodes more than {self.decoded >> 20} MiB of arrays, the decoding "
                                        "budget of one checkpoint read")
        self.check_time(where)

    def charge_tensors(self, count: int, where: str) -> None:
        """Count ``count`` bytes of arrays about to be made from a torch file's storages; raises
        past :attr:`tensors` (before anything is allocated)."""
        self.used_tensors += count
        if self.used_tensors > self.tensors:
            raise UnsafeCheckpointError(f"{where} makes more than {self.tensors >> 20} MiB of arrays, the tensor "
                                        "budget of one read; nothing was allocated")
        self.check_time(where)

    def remaining_decoded(self) -> int:
        return max(0, self.decoded - self.used_decoded)

    def check_time(self, where: str) -> None:
        """Raise once the read has taken longer than :attr:`seconds`."""
        if time.monotonic() > self.deadline:
            raise UnsafeCheckpointError(f"{where} takes longer than {self.seconds:g} s to read, the time budget of "
                                        "one checkpoint read")


_BUDGET: contextvars.ContextVar[ReadBudget | None] = contextvars.ContextVar("checkpoint_read_budget", default=None)


@contextlib.contextmanager
def reading(budget: ReadBudget | None = None) -> Iterator[ReadBudget]:
    """Charge every :func:`loads` / :func:`msgpack_loads` inside the block to one budget (a new
    default one unless given); yields it."""
    budget = budget if budget is not None else ReadBudget()
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def current_budget() -> ReadBudget:
    """The budget of the read in progress (see :func:`reading`), or a new default one."""
    budget = _BUDGET.get()
    return budget if budget is not None else ReadBudget()


# ---------------------------------------------------------------------------------------- size

# What a value read from a file may expand to, wherever it is later walked, formatted or copied
# (``repr``, ``json.dumps``, ``deepcopy``, a recursive walk): values counted once per reference,
# so a shared list stands for everything it holds each time it is used (a kilobyte of ``[L] * 16``
# nested seven times is 268 million values), characters of strings, bytes and digits counted so
# too, and nesting depth. Every pickle and msgpack document is held to it as soon as it is read.
VALUE_NODES = 1 << 18  # values, counted as repr() would visit them (shared ones again)
VALUE_CHARS = 16 << 20  # characters of the strings, bytes and integers among them, counted so too
VALUE_DEPTH = 100  # containers nested in containers (records included)


def _children(value: Any) -> Any:
    """The values ``value`` holds (a container's items, a record's arguments and state), or None."""
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if isinstance(value, Record) or (isinstance(value, type) and issubclass(value, Record)):
        return [v for v in vars(value).values()] if isinstance(value, Record) else None
    return None


def _chars(value: Any) -> int:
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3 + 1  # about its decimal digits, without forming them
    return 0


def check_value_size(value: Any, where: str, nodes: int = VALUE_NODES, chars: int = VALUE_CHARS,
                     depth: int = VALUE_DEPTH) -> None:
    """Refuse ``value`` (read from ``where``) when it expands to more than ``nodes`` values or
    ``chars`` characters, or nests deeper than ``depth``. Each container is sized once (a shared
    one is then charged as often as it is referenced), so the check costs what the value really
    holds, not what it expands to; a container that holds itself counts once, as ``repr`` prints it.

    Raises:
        UnsafeCheckpointError: over a limit, naming it.
    """
    sizes: dict[int, tuple[int, int, int]] = {}  # id -> (values, characters, depth) of its expansion
    entered: set[int] = set()
    stack: list[tuple[Any, bool, int]] = [(value, False, 1)]
    while stack:
        item, done, level = stack.pop()
        key = id(item)
        if not done:
            if key in sizes or key in entered:
                continue
            held = _children(item)
            if held is None:
                continue
            if level > depth:
                raise UnsafeCheckpointError(f"{where} nests values more than {depth} deep; nothing this package "
                                            "reads is nested so deep")
            entered.add(key)
            stack.append((item, True, level))
            stack.extend((child, False, level + 1) for child in held if _children(child) is not None)
            continue
        total_nodes, total_chars, deepest = 1, 0, 0
        for child in _children(item):
            known = sizes.get(id(child))
            if known is None:  # a leaf, or a container that holds this one (a cycle): once
                known = (1, _chars(child), 0)
            total_nodes += known[0]
            total_chars += known[1]
            deepest = max(deepest, known[2])
        if total_nodes > nodes or total_chars > chars:
            raise UnsafeCheckpointError(f"{where} holds values that expand to more than {nodes} values or "
                                        f"{chars >> 20} MiB of text (shared references counted as often as they "
                                        "are used); nothing this package reads is so large")
        sizes[key] = (total_nodes, total_chars, deepest + 1)
        entered.discard(key)


# ---------------------------------------------------------------------------------------- repr

def short_repr(value: Any, limit: int = 80) -> str:
    """A ``repr`` of file content cut to ``limit`` characters, built without ever forming the
    full ``repr``: containers are walked to at most a few levels and items, big integers and
    arrays are described, so shared references (a list holding itself many times) cost nothing."""
    out: list[str] = []
    _short(value, out, [limit + 1], 3)
    text = "".join(out)
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def _short(value: Any, out: list[str], left: list[int], depth: int) -> None:
    if left[0] <= 0:
        return
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        _short_container(value, out, left, depth)
        return
    if isinstance(value, bool) or value is None or isinstance(value, (float, complex)):
        text = repr(value)
    elif isinstance(value, np.generic) and value.dtype.kind in "biufc":
        text = repr(value.item())
    elif isinstance(value, int):
        text = repr(value) if value.bit_length() <= 128 else f"<int of {value.bit_length()} bits>"
    elif isinstance(value, (str, bytes, bytearray)):
        text = repr(value[: left[0]]) + ("..." if len(value) > left[0] else "")
    elif isinstance(value, np.ndarray):
        text = f"<array {value.shape} {value.dtype.str}>"
    elif isinstance(value, np.dtype):
        text = f"dtype({value.str!r})" if value.fields is None else "dtype(<structured>)"
    elif isinstance(value, Record) or (isinstance(value, type) and issubclass(value, Record)):
        text = f"<record {value.ref}>"
    else:
        text = f"<{type(value).__name__}>"
    out.append(text[: left[0]])
    left[0] -= len(text)


def _short_container(value: Any, out: list[str], left: list[int], depth: int) -> None:
    opening, closing = "[]" if isinstance(value, list) else "()" if isinstance(value, tuple) else "{}"
    if type(value) not in (dict, list, tuple):
        opening = f"{type(value).__name__}({opening}"
        closing += ")"
    out.append(opening)
    left[0] -= len(opening)
    items = value.items() if isinstance(value, dict) else value
    for i, item in enumerate(items):
        if left[0] <= 0 or depth <= 0 or i >= 16:
            out.append("...")
            left[0] -= 3
            break
        if i:
            out.append(", ")
            left[0] -= 2
        if isinstance(value, dict):
            _short(item[0], out, left, depth - 1)
            out.append(": ")
            left[0] -= 2
            item = item[1]
        _short(item, out, left, depth - 1)
    out.append(closing)
    left[0] -= len(closing)


# ---------------------------------------------------------------------------------------- records

class Record:
    """An inert stand-in for an object of a referenced class (``ref`` = ``module.name``)."""

    ref = "?"
    by_value = False  # the record of one of cloudpickle's BY_VALUE_BUILDERS
    calls = 0  # how many record calls made this record's type

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __call__(self, *args, **kwargs):
        if self.calls >= CALL_DEPTH:
            raise UnsafeCheckpointError(f"a pickle calls the record {self.ref[:NAME_LIMIT]} more than {CALL_DEPTH} "
                                        "calls deep; a checkpoint never does")
        return _record_type(f"{self.ref}()", self.calls + 1)(*args, **kwargs)

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


_RECORD_TYPES: dict[tuple[str, int], type] = {}


def _record_type(ref: str, calls: int = 0) -> type:
    """The record type of ``ref`` made by ``calls`` record calls (a global that only looks like a
    call's result is another type, so it cannot reset the count)."""
    known = _RECORD_TYPES.get((ref, calls))
    if known is not None:
        return known
    by_value = calls == 0 and ref.rsplit(".", 1)[-1] in BY_VALUE_BUILDERS and ref.startswith(INERT_PREFIXES)
    made = type("Record", (Record,), {"ref": ref, "by_value": by_value, "calls": calls, "__slots__": ()})
    if len(_RECORD_TYPES) < RECORD_TYPES_KEPT:
        _RECORD_TYPES[(ref, calls)] = made
    return made


def _is_builder(item: Any) -> bool:
    return isinstance(item, type) and issubclass(item, Record) and item.by_value


# ---------------------------------------------------------------------------------------- rebuilders

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
    if dt is None or dt.fields is not None or dt.subdtype is not None or dt.hasobject or dt.kind not in "biufcSU" \
            or dt.itemsize == 0:  # a string of no bytes: any shape would fit no data
        raise UnsafeCheckpointError(f"{where} holds a numpy dtype {short_repr(dtype)}; only plain numbers, booleans "
                                    "and fixed-width strings are read")
    return dt


def _reconstruct(subtype, shape, dtype):
    """numpy's ``_reconstruct`` for the empty array a pickled ndarray starts from; its data comes
    from ``__setstate__``, which numpy checks against the shape. A non-empty start (which would
    allocate what the file never held) or another subtype is refused."""
    if subtype is not _NdarrayType or not isinstance(shape, tuple) or shape != (0,):
        raise UnsafeCheckpointError(f"a pickle rebuilds an array of {short_repr(subtype)} with shape "
                                    f"{short_repr(shape)}; only an empty numpy.ndarray filled from the file's bytes "
                                    "is read")
    return np.ndarray((0,), plain_dtype(_named_dtype(dtype)))


def _frombuffer(buf, dtype, shape, order):
    if not isinstance(buf, (bytes, bytearray)):  # never another array's memory, which a BUILD could free
        raise UnsafeCheckpointError(f"a pickle makes an array from {type(buf).__name__}; only from bytes")
    array = np.frombuffer(buf, dtype=plain_dtype(_named_dtype(dtype)))
    return array.reshape(shape, order=order)  # numpy refuses a shape the bytes do not hold


def _named_dtype(value: Any) -> Any:
    """A dtype named by a type string (``"f8"``, ``b"b"``), or ``value`` itself when it already is one."""
    if isinstance(value, (str, bytes)) and len(value) > 64:
        raise UnsafeCheckpointError(f"a pickle names a numpy dtype {short_repr(value)}")
    return np.dtype(value) if isinstance(value, (str, bytes)) else value


def _dtype(obj, align=False, copy=False):
    """numpy's dtype rebuilder for a type string; always a new dtype object (never numpy's shared one)."""
    if not isinstance(obj, (str, bytes)) or len(obj) > 64:
        raise UnsafeCheckpointError(f"a pickle builds a numpy dtype from {short_repr(obj)}; only from a type string")
    return plain_dtype(np.dtype(obj, align=bool(align), copy=True))


def _str(value: Any = "") -> str:
    """``builtins.str`` of one string or number (never a decoding, which can import codecs)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (int, float)) or (isinstance(value, int) and value.bit_length() > 1024):
        raise UnsafeCheckpointError(f"a pickle calls str on {type(value).__name__}")
    return str(value)


def _latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode(text, "latin1")``: how pickle protocols 0-2 store bytes; no other codec."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafeCheckpointError(f"a pickle encodes {type(text).__name__} with {short_repr(encoding)}; only "
                                    "latin1 text (pickle's own encoding of bytes) is read")
    return text.encode("latin1")


def _scalar(dtype, data=None):
    try:
        from numpy._core.multiarray import scalar  # noqa: PLC0415 - numpy 2 (and 1.26's alias)
    except ImportError:  # pragma: no cover - numpy < 1.26
        from numpy.core.multiarray import scalar  # noqa: PLC0415

    dtype = plain_dtype(dtype)
    if data is not None and (not isinstance(data, bytes) or len(data) != dtype.itemsize):
        raise UnsafeCheckpointError(f"a pickle makes a numpy {dtype.str} scalar from {type(data).__name__} that is "
                                    f"not {dtype.itemsize} bytes")
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
    ("builtins", "str"): _str,
    ("_codecs", "encode"): _latin1,
}


def _array_state(state: Any, where: str) -> None:
    """numpy's array state ``(version, shape, dtype, is_fortran, bytes)``: a plain dtype, bytes, a bounded rank."""
    if not (isinstance(state, tuple) and len(state) in (4, 5)):
        raise UnsafeCheckpointError(f"{where} fills an array from {short_repr(state)}, not numpy's array state")
    plain_dtype(state[-3], where)
    if not isinstance(state[-1], (bytes, bytearray)):
        raise UnsafeCheckpointError(f"{where} fills an array from {type(state[-1]).__name__}, not bytes")
    if not isinstance(state[-4], tuple) or len(state[-4]) > RANK_LIMIT:
        raise UnsafeCheckpointError(f"{where} fills an array of shape {short_repr(state[-4])}")


def dtype_with_state(dtype: np.dtype, state: Any, where: str) -> np.dtype:
    """A NEW dtype: ``dtype`` with the byte order numpy's dtype state names. The state's item
    size, alignment and flags must be ``dtype``'s own (``-1`` for "the type's"), and no fields
    or subarray; ``dtype`` itself is never changed (numpy's ``__setstate__`` is never called).

    Raises:
        UnsafeCheckpointError: any other state.
    """
    ok = isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4) \
        and state[1] in ("<", ">", "|", "=") and state[2] is None and state[3] is None and state[4] is None \
        and all(isinstance(v, int) and not isinstance(v, bool) for v in state[5:8]) \
        and state[5] in (-1, dtype.itemsize) and state[6] in (-1, dtype.alignment) and state[7] == dtype.flags
    if not ok:
        raise UnsafeCheckpointError(f"{where} sets the state of a numpy dtype {dtype.str} to {short_repr(state)}; only "
                                    "its byte order may be set (item size, alignment and flags as the type has them)")
    new = dtype.newbyteorder(state[1]) if state[1] != "|" else np.dtype(dtype, copy=True)
    if new.kind != dtype.kind or new.itemsize != dtype.itemsize:  # pragma: no cover - numpy keeps both
        raise UnsafeCheckpointError(f"{where} changes a numpy dtype {dtype.str} to {new.str}")
    return plain_dtype(new, where)


class _Memo(dict):
    """The unpickler's memo: a dtype replaced by its BUILD is read back as the new dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced: dict[int, tuple[np.dtype, np.dtype]] = {}  # id(old) -> (old, new): old kept alive

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        if isinstance(value, np.dtype) and id(value) in self.replaced:
            return self.replaced[id(value)][1]
        return value


def _tracked(op):
    """``op`` (one opcode's handler) wrapped: it charges the read's object budget (checking the
    deadline every 256 opcodes) and, once the pickle has resolved a by-value builder, keeps
    :attr:`RestrictedUnpickler.open_builders` (the number of by-value builder records on the stack
    and the metastack) up to date in O(1) amortised: an opcode changes at most the top three items
    of the current frame, or pushes or pops a frame (whose items are then counted once)."""

    def run(self):
        if not self.watching:
            op(self)
            if self.watching:  # this opcode resolved the pickle's first by-value builder
                self.open_builders = sum(_count_builders(frame) for frame in (self.stack, *self.metastack))
        else:
            stack, depth = self.stack, len(self.metastack)
            size, top = len(stack), stack[-3:]
            below = len(self.metastack[-1]) if depth else 0
            op(self)
            if len(self.metastack) < depth:  # the frame was popped: its items are consumed
                self.open_builders += _count_builders(self.stack[below:]) - _count_builders(stack)
            elif len(self.metastack) == depth:
                self.open_builders += _count_builders(stack[max(0, size - 3):]) - _count_builders(top)
        self.pending += 1
        if self.pending >= 256:
            self.budget.charge_objects(self.pending, self.where)
            self.pending = 0

    return run


def _count_builders(items: list) -> int:
    return sum(1 for item in items if _is_builder(item))


def _refuse_extension(self):
    raise UnsafeCheckpointError(f"{self.where} uses pickle's extension registry; a checkpoint never does")


def _load_bytearray8(self):
    """Pickle's BYTEARRAY8, which allocates the declared size before reading: at most the file's own size."""
    size, = struct.unpack("<Q", self.read(8))
    if size > self.size:
        raise UnsafeCheckpointError(f"{self.where} declares a bytearray of {size} bytes in a pickle of {self.size}")
    data = bytearray(size)
    if self.readinto(data) != size:
        raise UnsafeCheckpointError(f"{self.where} ends inside a bytearray")
    self.append(data)


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler whose every global is a rebuilder, a record, or refused, and whose BUILD
    opcode (``__setstate__``) reaches only what :meth:`load_build` allows. It is the standard
    library's pure-Python unpickler, so that every opcode can be checked and charged to the
    read's :class:`ReadBudget`."""

    dispatch = dict(pickle._Unpickler.dispatch)
    # what resolves to an inert record: a reader of another tool's files names its own (the
    # globals its files reference), so that no reader allows what only another needs
    inert_prefixes: tuple[str, ...] = INERT_PREFIXES
    inert_names: frozenset[tuple[str, str]] = frozenset(INERT_NAMES)
    allowed_text = ("numpy arrays and dtypes, collections, builtin numbers; RLlib, cloudpickle, spaces and "
                    "packaging.version only as inert records")

    def __init__(self, file, where: str, budget: ReadBudget | None = None):
        super().__init__(file)
        self.where = where
        start = file.tell()
        self.size = file.seek(0, io.SEEK_END) - start  # bytes of the pickle: no value is larger
        file.seek(start)
        self.budget = budget if budget is not None else current_budget()
        self.memo = _Memo()
        self.open_builders = 0  # by-value builder records on the stack and metastack
        self.watching = False  # a by-value builder was resolved: open_builders is kept from then on
        self.pending = 0  # opcodes not yet charged to the budget
        self.fresh: dict[int, Any] = {}  # id -> empty array from _reconstruct, not yet filled
        self.made: dict[int, np.dtype] = {}  # id -> dtype made by this pickle, its state not yet set

        def reconstruct(subtype, shape, dtype):
            array = _reconstruct(subtype, shape, dtype)
            self.fresh[id(array)] = array
            return array

        def dtype(obj, align=False, copy=False):
            made = _dtype(obj, align, copy)
            self.made[id(made)] = made
            return made

        self.own = {_reconstruct: reconstruct, _dtype: dtype}

    def load(self):
        try:
            value = super().load()
            self.budget.charge_objects(self.pending, self.where)
            self.pending = 0
            return value
        finally:  # the closures in own refer to self: drop what the memo keeps alive now, not at the next GC
            self.own, self.fresh, self.made = {}, {}, {}
            self.memo = _Memo()
            self.stack, self.metastack = [], []

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, Record):
            pickle._Unpickler.load_build(self)
        elif isinstance(inst, np.ndarray) and self.fresh.pop(id(inst), None) is inst:
            _array_state(state, self.where)
            pickle._Unpickler.load_build(self)
        elif isinstance(inst, np.dtype) and self.made.pop(id(inst), None) is inst:
            new = dtype_with_state(inst, state, self.where)  # numpy's __setstate__ never runs
            self.stack.pop()
            self.stack[-1] = new
            self.memo.replaced[id(inst)] = (inst, new)
        else:
            raise UnsafeCheckpointError(
                f"{self.where} sets the state of {type(inst).__name__} {short_repr(state)}; only records, and "
                "arrays and dtypes this pickle just made (once), take a state")

    dispatch[pickle.BUILD[0]] = load_build
    for _code in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_code[0]] = _refuse_extension
    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8
    dispatch = {code: _tracked(op) for code, op in dispatch.items()}
    del _code

    def find_class(self, module: str, name: str):
        if len(module) > NAME_LIMIT or len(name) > NAME_LIMIT:
            raise UnsafeCheckpointError(f"{self.where} references a global of {len(module)}+{len(name)} characters "
                                        f"({short_repr(module + '.' + name)}), longer than any a checkpoint holds")
        rebuilder = REBUILDERS.get((module, name))
        if rebuilder is not None:
            return self.own.get(rebuilder, rebuilder)
        prefixes = self.inert_prefixes
        if (prefixes and (module.startswith(prefixes) or module in {p.rstrip(".") for p in prefixes})) \
                or (module, name) in self.inert_names or self.open_builders > 0:
            record = _record_type(f"{module}.{name}")
            self.watching = self.watching or record.by_value
            return record
        raise UnsafeCheckpointError(
            f"{self.where} references {module[:NAME_LIMIT]}.{name[:NAME_LIMIT]}, which is not on the allowlist of "
            f"what it may rebuild ({self.allowed_text}); nothing was run")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where} uses a persistent id ({short_repr(pid)}); a checkpoint never does")


def loads(data: bytes, where: str, budget: ReadBudget | None = None,
          unpickler: type[RestrictedUnpickler] = RestrictedUnpickler) -> Any:
    """Unpickle ``data`` (read from ``where``) with ``unpickler`` (:class:`RestrictedUnpickler` or
    a reader's subclass naming its own inert records), charged to ``budget`` (default: the read in
    progress, see :func:`reading`).

    Raises:
        UnsafeCheckpointError: anything refused, over budget, or not a readable pickle.
    """
    try:
        value = unpickler(io.BytesIO(data), where, budget).load()
        check_value_size(value, where)
        return value
    except UnsafeCheckpointError as e:
        if str(e).startswith(where):
            raise
        raise UnsafeCheckpointError(f"{where}: {e}") from None  # a rebuilder's or a record's refusal
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises is "not readable"
        raise UnsafeCheckpointError(f"{where} is not a readable pickle: {type(e).__name__}: {str(e)[:200]}") from None


# ---------------------------------------------------------------------------------------- msgpack

def _msgpack_array(obj: dict, where: str, budget: ReadBudget):
    """msgpack_numpy's encoding of an ndarray (``nd`` True) or a numpy scalar (``nd`` False)."""
    kind, data, type_ = obj.get(b"kind", b""), obj.get(b"data"), obj.get(b"type")
    if kind == b"O":
        return loads(data, f"{where} (an object array)", budget)
    if not isinstance(data, bytes) or not isinstance(type_, (str, bytes)) or len(type_) > 64:
        raise UnsafeCheckpointError(f"{where} holds a malformed numpy value")
    try:
        dtype = plain_dtype(np.dtype(type_ if isinstance(type_, str) else type_.decode()), where)
    except (TypeError, ValueError, UnicodeDecodeError) as e:
        raise UnsafeCheckpointError(f"{where} holds a numpy value of type {short_repr(type_)}: "
                                    f"{str(e)[:100]}") from None
    if not obj.get(b"nd"):
        if len(data) != dtype.itemsize:
            raise UnsafeCheckpointError(f"{where} holds a numpy {dtype} scalar of {len(data)} bytes")
        return np.frombuffer(data, dtype=dtype)[0]
    shape = _msgpack_shape(obj.get(b"shape"), len(data), where)
    if shape is None or _elements(shape) * dtype.itemsize != len(data):
        raise UnsafeCheckpointError(f"{where} declares an array of shape {short_repr(obj.get(b'shape'))} ({dtype}) "
                                    f"that its {len(data)} bytes do not hold")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _msgpack_shape(shape: Any, nbytes: int, where: str) -> tuple[int, ...] | None:
    """The declared shape, at most :data:`RANK_LIMIT` dimensions of plain ints each at most
    ``nbytes`` (so the product is small); None when a dimension exceeds that."""
    if not isinstance(shape, (list, tuple)) or len(shape) > RANK_LIMIT \
            or not all(type(d) is int and d >= 0 for d in shape):
        raise UnsafeCheckpointError(f"{where} holds an array of shape {short_repr(shape)} (at most {RANK_LIMIT} "
                                    "non-negative dimensions)")
    return None if any(d > max(nbytes, 1) for d in shape) else tuple(shape)


def _elements(shape: tuple[int, ...]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def msgpack_loads(data: bytes, where: str, budget: ReadBudget | None = None) -> Any:
    """Decode msgpack ``data`` with limits from its own size and from ``budget`` (default: the
    read in progress); numpy values rebuilt and checked.

    Raises:
        UnsafeCheckpointError: not readable msgpack, a malformed numpy value, or over budget.
    """
    import msgpack  # noqa: PLC0415 - only msgpack checkpoints need it

    budget = budget if budget is not None else current_budget()
    cap = max(0, min(len(data), budget.objects - budget.used_objects))

    def hook(obj):
        budget.charge_objects(len(obj) + 1, where)
        if b"nd" in obj and b"data" in obj:
            return _msgpack_array(obj, where, budget)
        return obj

    def list_hook(items):
        budget.charge_objects(len(items) + 1, where)
        return items

    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False, object_hook=hook, list_hook=list_hook,
                                use_list=True, max_array_len=cap, max_map_len=cap)
        check_value_size(value, where)
        return value
    except UnsafeCheckpointError:
        raise
    except (ValueError, TypeError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError, RecursionError, MemoryError) as e:
        raise UnsafeCheckpointError(f"{where} is not readable msgpack: {type(e).__name__}: {str(e)[:200]}") from None
