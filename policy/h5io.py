"""Base-model weights in Keras's HDF5 weights layout, read and written with h5py.

Weights are keyed ``layer/weight`` (e.g. ``fc_1/kernel``). Files written here load with
``keras_model.load_weights(path)``; files written by Keras's ``save_weights`` (or a whole-model
``.h5``, whose weights sit under ``model_weights``) are read here. Nothing is deserialised but
arrays: no pickles, no model config.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import h5py
import numpy as np

from policy_export.errors import WeightsError
from policy_export.policy.layout import weight_key

MAX_WEIGHTS_BYTES = 2 << 30  # declared size of all weights read from one file
_REAL_KINDS = "fiu"  # float, signed and unsigned integer: what a weight variable can hold


def read_h5_weights(path: str | Path,
                    expected_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """All weights in an h5 file, keyed ``layer/weight``, in file order.

    With ``expected_shapes``, a weight that is not expected or has another shape is not read: it
    comes back as a zero-strided array of its declared shape (no memory is allocated), so the
    caller can report the mismatch.

    The file is opened without following a symbolic link and must be a regular file. Only data
    inside it is read: external links, external dataset storage and virtual datasets are refused,
    and every dataset's declared shape and dtype are checked (real float or integer numbers: no
    complex, bool, string or compound data; :data:`MAX_WEIGHTS_BYTES` in all) before any is read.

    Raises:
        WeightsError: the file is missing, a symbolic link or not a regular file, is not HDF5,
            is not in Keras's weights layout, holds a dataset that is not real numbers, or refers
            to data outside itself or beyond the size limit.
    """
    return _read_file(Path(path), expected_shapes, values=True)


def read_h5_shapes(path: str | Path, expected_shapes: Mapping[str, tuple[int, ...]] | None = None
                   ) -> dict[str, tuple[int, ...]]:
    """The weights' keys and declared shapes, in file order, without reading any value: the file
    is opened and checked as :func:`read_h5_weights` does (``expected_shapes`` as there: only the
    size of the weights that fit counts towards the limit).

    Raises:
        WeightsError: as :func:`read_h5_weights`.
    """
    return _read_file(Path(path), expected_shapes, values=False)


def _read_file(path: Path, expected_shapes, values: bool):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise WeightsError(str(path), ["file not found"]) from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise WeightsError(str(path), ["the file is a symbolic link; give the weights file itself"]) from e
        raise WeightsError(str(path), [f"cannot be read: {e.strerror}"]) from e
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WeightsError(str(path), ["not a regular file"])
        return _read_weights(handle, path, expected_shapes, values)


def _read_weights(handle, path: Path, expected_shapes: Mapping[str, tuple[int, ...]] | None, values: bool = True):
    try:
        with h5py.File(handle, "r") as f:
            root = _member(f, "model_weights", path) if "model_weights" in f else f
            if "layer_names" not in root.attrs:
                raise WeightsError(str(path), ["not a Keras weights file (no 'layer_names' attribute)"])
            found: list[tuple[str, h5py.Dataset]] = []
            for layer in _strings(root.attrs["layer_names"]):
                group = _member(root, layer, path)
                if group is None:
                    raise WeightsError(str(path), [f"layer {layer!r} is listed but has no group"])
                for name in _strings(group.attrs.get("weight_names", [])):
                    data = _member(group, name, path)
                    if data is None:
                        raise WeightsError(str(path), [f"weight {name!r} of layer {layer!r} is listed but missing"])
                    if not isinstance(data, h5py.Dataset):
                        raise WeightsError(str(path), [f"weight {name!r} of layer {layer!r} is not an array"])
                    found.append((weight_key(layer, name), data))
            _check_datasets(found, path, expected_shapes)
            if not values:
                return {key: tuple(int(d) for d in data.shape) for key, data in found}
            return {key: _read(data, key, expected_shapes) for key, data in found}
    except WeightsError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        raise WeightsError(str(path), [f"not a readable HDF5 weights file ({e})"]) from e


def write_h5_weights(path: str | Path, weights: Mapping[str, np.ndarray]) -> Path:
    """Write ``layer/weight``-keyed arrays in Keras's weights layout, atomically (temp file + rename)."""
    path = Path(path)
    layers: dict[str, list[tuple[str, np.ndarray]]] = {}
    for key, value in weights.items():
        layer, _, short = key.rpartition("/")
        if not layer:
            raise WeightsError(str(path), [f"weight key {key!r} is not of the form layer/weight"])
        layers.setdefault(layer, []).append((short, np.asarray(value)))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["layer_names"] = _bytes(layers)
            f.attrs["backend"] = b"tensorflow"
            f.attrs["keras_version"] = b"2.21.0"
            for layer, items in layers.items():
                group = f.create_group(layer)
                names = [f"{layer}/{short}:0" for short, _ in items]
                group.attrs["weight_names"] = _bytes(names)
                for name, (_, value) in zip(names, items):
                    group.create_dataset(name, data=value)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _member(group, name: str, path: Path):
    """``group[name]`` (``None`` if absent), following only links that stay inside the file."""
    node = group
    for part in [p for p in name.split("/") if p]:
        if part not in node:
            return None
        link = node.get(part, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            raise WeightsError(str(path), [f"{name!r} is an external link to {link.filename}:{link.path}; "
                                           "only data inside the file is read"])
        if isinstance(link, h5py.SoftLink) and not isinstance(node.get(part, default=None), (h5py.Group, h5py.Dataset)):
            raise WeightsError(str(path), [f"{name!r} is a dangling link"])
        node = node[part]
        if node.file.id != group.file.id:
            raise WeightsError(str(path), [f"{name!r} leads outside the file"])
    return node


def _read(data: "h5py.Dataset", key: str, expected_shapes: Mapping[str, tuple[int, ...]] | None) -> np.ndarray:
    if expected_shapes is not None and tuple(expected_shapes.get(key, ())) != tuple(data.shape):
        return np.broadcast_to(np.zeros((), data.dtype), data.shape)  # declared shape only; nothing read
    return np.asarray(data[()])


def _check_datasets(found: list[tuple[str, "h5py.Dataset"]], path: Path,
                    expected_shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Refuse external storage, virtual datasets, non-numeric data and a total size over the limit."""
    total = 0
    for key, data in found:
        if data.external:
            raise WeightsError(str(path), [f"weight {key!r} keeps its data in external file(s) "
                                           f"{[e[0] for e in data.external]}; only data inside the file is read"])
        if data.is_virtual:
            raise WeightsError(str(path), [f"weight {key!r} is a virtual dataset; only data inside the file is read"])
        if data.dtype.kind not in _REAL_KINDS or data.dtype.fields is not None or data.dtype.subdtype is not None:
            raise WeightsError(str(path), [f"weight {key!r} (dataset {data.name}) has dtype {data.dtype}; weights "
                                           "are arrays of real numbers (float or integer), never cast from "
                                           "complex, bool, string or compound data"])
        if data.shape is None:
            raise WeightsError(str(path), [f"weight {key!r} has no shape (an empty dataset)"])
        if expected_shapes is not None and tuple(expected_shapes.get(key, ())) != tuple(data.shape):
            continue  # not read
        total += int(np.prod(data.shape, dtype=object)) * data.dtype.itemsize
        if total > MAX_WEIGHTS_BYTES:
            raise WeightsError(str(path), [f"weights declare more than the limit of {MAX_WEIGHTS_BYTES >> 20} MiB "
                                           f"(at {key!r}, shape {data.shape})"])


def _strings(values: Iterable) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def _bytes(values: Iterable[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype="S")
