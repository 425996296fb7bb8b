"""Reading what ``torch.save`` writes, without torch: a state dict (or any nest of tensors, dicts
and numbers) as numpy arrays, with nothing of the file run.

The format (torch >= 1.6, ``_use_new_zipfile_serialization``): a zip archive of one folder,
``<name>/data.pkl`` (a pickle), ``<name>/data/<key>`` (one raw storage per key: a flat array of
one dtype, little-endian) and small records (``version``, ``byteorder``, ``.format_version``,
``.storage_alignment``, ``.data/serialization_id``). In the pickle each tensor is a call of
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`` whose
storage is a persistent id ``("storage", torch.<Type>Storage, key, location, numel)``.

Read here (:func:`read_torch`):

- the archive through :class:`policy.zipio.Archive`: only those members, each within its limit;
- the pickle through the package's restricted unpickler (:mod:`.safe_pickle`): numpy and
  ``collections.OrderedDict`` rebuilt; ``_rebuild_tensor_v2`` and ``_rebuild_parameter`` are this
  module's own functions; the storage types are markers naming a dtype (:data:`STORAGE_DTYPES`,
  from the class name alone); every other global is refused, and so is every persistent id that
  is not a storage of this archive;
- each storage's bytes must be exactly ``numel`` x its item size; each tensor's ``(offset, size,
  stride)`` is checked to stay inside its storage before a view is made, and its bytes are charged
  to the read's tensor budget (:class:`.safe_pickle.ReadBudget`) before they are copied out, so a
  huge declared tensor over a one-element storage (stride 0) costs nothing;
- a state dict's ``_metadata`` (torch's per-module versions, set by ``BUILD``) is dropped.

bfloat16 storages become float32 (exactly: bfloat16 is float32's upper half). The old format
(torch < 1.6: pickles back to back) is refused with a clear message.

Used by the Stable-Baselines3 source (``policy.pth``, ``pytorch_variables.pth``); rsl_rl's
``model_*.pt`` and CleanRL's state dicts are the same format.

    from policy_export.exporter.sources.torchfile import read_state_dict
    weights = read_state_dict(zip_bytes, "model.zip:policy.pth")   # name -> np.ndarray
"""

from __future__ import annotations

import collections
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import UnsafeCheckpointError
from policy_export.exporter.sources.safe_pickle import (
    RANK_LIMIT, ReadBudget, RestrictedUnpickler, _tracked, current_budget, loads, reading, short_repr,
)
from policy_export.policy.zipio import Archive

# a storage type's class name -> the dtype of its bytes (torch writes them little-endian)
STORAGE_DTYPES = {
    "FloatStorage": "<f4", "DoubleStorage": "<f8", "HalfStorage": "<f2", "BFloat16Storage": "bfloat16",
    "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1", "ByteStorage": "u1",
    "BoolStorage": "?",
}
PICKLE_LIMIT = 64 << 20  # bytes of data.pkl
STORAGE_LIMIT = 1 << 30  # bytes of one storage
ARCHIVE_LIMIT = 2 << 30  # bytes of every member together
MAX_MEMBERS = 1 << 16
_FOLDER = r"[A-Za-z0-9_.\-]{1,128}"
MEMBER = re.compile(_FOLDER + r"/(data\.pkl|version|byteorder|\.format_version|\.storage_alignment"
                    r"|\.data/serialization_id|\.data/version|data/[0-9]{1,9})")
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # torch < 1.6: the magic number first


class _StorageType:
    """What ``torch.<Type>Storage`` resolves to: a marker naming the storage's dtype."""

    def __init__(self, name: str):
        self.name, self.dtype = name, STORAGE_DTYPES[name]

    def __call__(self, *args, **kwargs):
        raise UnsafeCheckpointError(f"a pickle constructs torch.{self.name}; only a persistent id may name one")

    def __repr__(self) -> str:
        return f"torch.{self.name}"


_STORAGE_TYPES = {name: _StorageType(name) for name in STORAGE_DTYPES}


class _Storage:
    """One storage of the archive: its flat array (read once, however many tensors view it)."""

    def __init__(self, array: np.ndarray, kind: _StorageType):
        self.array, self.kind = array, kind


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None, *rest):
    """``torch._utils._rebuild_tensor_v2``: a copy of the checked view of ``storage``."""
    if not isinstance(storage, _Storage):
        raise UnsafeCheckpointError(f"a tensor is rebuilt from {type(storage).__name__}, not a storage of the archive")
    if not (_is_int(offset) and isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
            and len(size) <= RANK_LIMIT and all(_is_int(d) and d >= 0 for d in (*size, *stride)) and offset >= 0):
        raise UnsafeCheckpointError(f"a tensor declares offset {short_repr(offset)}, size {short_repr(size)} and "
                                    f"stride {short_repr(stride)}; not a tensor's layout")
    if hooks not in (None, {}) and not (isinstance(hooks, dict) and not hooks):
        raise UnsafeCheckpointError("a tensor carries backward hooks; a saved state never does")
    if metadata not in (None, {}) or rest:
        raise UnsafeCheckpointError("a tensor carries Python attributes (a tensor subclass); not read")
    array = storage.array
    count = int(np.prod(size, dtype=object))
    if count:
        last = offset + sum((d - 1) * s for d, s in zip(size, stride))
        if last >= len(array):
            raise UnsafeCheckpointError(f"a tensor of size {list(size)}, stride {list(stride)} at offset {offset} "
                                        f"reads past its storage of {len(array)} values")
    itemsize = 4 if storage.kind.dtype == "bfloat16" else array.dtype.itemsize
    current_budget().charge_tensors(count * itemsize, "a torch file")
    if not count:
        view = np.zeros(size, array.dtype)
    else:
        view = np.lib.stride_tricks.as_strided(array[offset:], shape=size,
                                               strides=[s * array.dtype.itemsize for s in stride], writeable=False)
    out = np.array(view, copy=True, order="C")
    if storage.kind.dtype == "bfloat16":  # the upper half of a float32
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out


def _rebuild_parameter(data, requires_grad=False, hooks=None, *rest):
    """``torch._utils._rebuild_parameter``: the parameter's tensor."""
    if not isinstance(data, np.ndarray) or rest:
        raise UnsafeCheckpointError("a parameter is rebuilt from something other than a tensor")
    return data


TORCH_REBUILDERS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): kind for name, kind in _STORAGE_TYPES.items()},
}


def _load_build(self) -> None:
    """BUILD: a state dict's ``_metadata`` (torch's module versions) is dropped; anything else as
    the restricted unpickler allows it."""
    state, inst = self.stack[-1], self.stack[-2]
    if isinstance(inst, collections.OrderedDict) and isinstance(state, dict) and set(state) <= {"_metadata"}:
        self.stack.pop()
        return
    RestrictedUnpickler.load_build(self)


class TorchUnpickler(RestrictedUnpickler):
    """The restricted unpickler for a ``data.pkl``: tensors and storages as described in the
    module's docstring; no inert records (a state dict holds none)."""

    inert_prefixes = ()
    inert_names = frozenset()
    allowed_text = "tensors, their storages, numpy, OrderedDict and builtin numbers"
    archive: "_TorchArchive | None" = None

    def find_class(self, module: str, name: str):
        found = TORCH_REBUILDERS.get((module, name))
        if found is not None:
            return found
        return super().find_class(module, name)

    def persistent_load(self, pid):
        if self.archive is None:
            raise UnsafeCheckpointError(f"{self.where} uses a persistent id outside a torch archive")
        return self.archive.storage(pid)

    dispatch = dict(RestrictedUnpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _tracked(_load_build)


class _TorchArchive:
    """The storages of one archive, read when a persistent id first names them."""

    def __init__(self, archive: Archive, prefix: str, where: str):
        self.archive, self.prefix, self.where = archive, prefix, where
        self.storages: dict[str, _Storage] = {}

    def storage(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and pid[2].isdigit()
                and len(pid[2]) <= 9 and isinstance(pid[3], str) and len(pid[3]) <= 64 and _is_int(pid[4])
                and pid[4] >= 0):
            raise UnsafeCheckpointError(f"{self.where} uses a persistent id {short_repr(pid)}, not a storage of "
                                        "this archive; nothing was run")
        kind, key, numel = pid[1], pid[2], pid[4]
        known = self.storages.get(key)
        if known is not None:
            if known.kind is not kind or len(known.array) != numel:
                raise UnsafeCheckpointError(f"{self.where}: storage {key} is named as two different storages")
            return known
        member = f"{self.prefix}/data/{key}"
        if member not in self.archive:
            raise UnsafeCheckpointError(f"{self.where}: storage {key} is not in the archive")
        dtype = np.dtype("<u2") if kind.dtype == "bfloat16" else np.dtype(kind.dtype)
        if self.archive.size(member) != numel * dtype.itemsize:
            raise UnsafeCheckpointError(f"{self.where}: storage {key} holds {self.archive.size(member)} bytes, not the "
                                        f"{numel} values of {kind.name} it is named with")
        array = np.frombuffer(self.archive.read(member), dtype)
        stored = _Storage(array, kind)
        self.storages[key] = stored
        return stored


def read_torch(source: bytes | Path, where: str, budget: ReadBudget | None = None) -> Any:
    """What ``torch.save`` wrote to ``source`` (the file's bytes, or its path), as numpy arrays in
    the nest it was saved in; charged to ``budget`` (default: the read in progress).

    Raises:
        UnsafeCheckpointError: not a torch archive this reads, anything refused or over budget.
    """
    head = source[:len(LEGACY_MAGIC)] if isinstance(source, (bytes, bytearray)) else _head(Path(source))
    if head.startswith(LEGACY_MAGIC) or head[:1] == b"\x80" and not head.startswith(b"PK"):
        raise UnsafeCheckpointError(f"{where} is a torch file in the format before torch 1.6 (pickles back to back), "
                                    "which is not read; save it again with a newer torch")
    with reading(budget):
        archive = Archive(source, where, allowed=lambda name: MEMBER.fullmatch(name) is not None,
                          max_members=MAX_MEMBERS, total=ARCHIVE_LIMIT, error=UnsafeCheckpointError,
                          limit=lambda name: PICKLE_LIMIT if name.endswith("data.pkl") else STORAGE_LIMIT)
        with archive:
            prefixes = {name.split("/", 1)[0] for name in archive.names}
            pickles = [name for name in archive.names if name.endswith("/data.pkl")]
            if len(prefixes) != 1 or len(pickles) != 1:
                raise UnsafeCheckpointError(f"{where} is not one torch archive (its members are under "
                                            f"{len(prefixes)} folders, with {len(pickles)} data.pkl)")
            prefix = prefixes.pop()
            if f"{prefix}/byteorder" in archive and archive.read(f"{prefix}/byteorder").strip() != b"little":
                raise UnsafeCheckpointError(f"{where} was saved big-endian, which is not read")
            storages = _TorchArchive(archive, prefix, where)
            unpickler = type("ArchiveUnpickler", (TorchUnpickler,), {"archive": storages})
            return loads(archive.read(pickles[0]), where, unpickler=unpickler)


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(len(LEGACY_MAGIC))
    except OSError:
        return b""


def read_state_dict(source: bytes | Path, where: str, budget: ReadBudget | None = None) -> dict[str, np.ndarray]:
    """A state dict saved with ``torch.save``: every key a name, every value an array.

    Raises:
        UnsafeCheckpointError: not such a file (see :func:`read_torch`).
    """
    value = read_torch(source, where, budget)
    if not isinstance(value, dict):
        raise UnsafeCheckpointError(f"{where} holds {type(value).__name__}, not a state dict")
    out = {}
    for key, array in value.items():
        if not isinstance(key, str) or len(key) > 512:
            raise UnsafeCheckpointError(f"{where}: key {short_repr(key)} is not a parameter's name")
        if not isinstance(array, np.ndarray):
            raise UnsafeCheckpointError(f"{where}: {key[:200]} holds {type(array).__name__}, not a tensor")
        out[key] = array
    return out
