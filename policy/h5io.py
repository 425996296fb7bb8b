"""Base-model weights in Keras's HDF5 weights layout, read and written with h5py.

Weights are keyed ``layer/weight`` (e.g. ``fc_1/kernel``). Files written here load with
``keras_model.load_weights(path)``; files written by Keras's ``save_weights`` (or a whole-model
``.h5``, whose weights sit under ``model_weights``) are read here. Nothing is deserialised but
arrays: no pickles, no model config.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import h5py
import numpy as np

from policy_export.policy.errors import WeightsError
from policy_export.policy.models import weight_key


def read_h5_weights(path: str | Path) -> dict[str, np.ndarray]:
    """All weights in an h5 file, keyed ``layer/weight``, in file order.

    Raises:
        WeightsError: the file is missing, is not HDF5, or is not in Keras's weights layout.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(str(path), ["file not found"])
    try:
        with h5py.File(path, "r") as f:
            root = f["model_weights"] if "model_weights" in f else f
            if "layer_names" not in root.attrs:
                raise WeightsError(str(path), ["not a Keras weights file (no 'layer_names' attribute)"])
            out: dict[str, np.ndarray] = {}
            for layer in _strings(root.attrs["layer_names"]):
                if layer not in root:
                    raise WeightsError(str(path), [f"layer {layer!r} is listed but has no group"])
                group = root[layer]
                for name in _strings(group.attrs.get("weight_names", [])):
                    if name not in group:
                        raise WeightsError(str(path), [f"weight {name!r} of layer {layer!r} is listed but missing"])
                    data = group[name]
                    if not isinstance(data, h5py.Dataset):
                        raise WeightsError(str(path), [f"weight {name!r} of layer {layer!r} is not an array"])
                    out[weight_key(layer, name)] = np.asarray(data[()])
            return out
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


def _strings(values: Iterable) -> list[str]:
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def _bytes(values: Iterable[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype="S")
