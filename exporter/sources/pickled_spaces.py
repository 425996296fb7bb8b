"""A gymnasium space from its pickled record: what a pickle of a ``gymnasium.spaces`` object
becomes in the restricted unpickler (an inert record of the class with the instance's
``__dict__`` as its state), rebuilt through the same checks as RLlib's serialised spaces
(:func:`exporter.sources.checkpoint.space_from_dict`: bounds, shapes, sizes). Used by every
reader of pickled spaces (RLlib's new API stack, Stable-Baselines3)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import UnsafeCheckpointError
from policy_export.exporter.sources.checkpoint import space_from_dict
from policy_export.exporter.sources.safe_pickle import Record, short_repr

_SPACES = {"gymnasium.spaces.box.Box": "box", "gymnasium.spaces.discrete.Discrete": "discrete",
           "gymnasium.spaces.multi_discrete.MultiDiscrete": "multi-discrete",
           "gymnasium.spaces.multi_binary.MultiBinary": "multi-binary", "gymnasium.spaces.tuple.Tuple": "tuple",
           "gymnasium.spaces.dict.Dict": "dict"}


def space_of(record: Any, where: str) -> gym.Space:
    """A gymnasium space from its pickled record (the instance's ``__dict__``), rebuilt through the
    same checks as RLlib's serialised spaces (:func:`exporter.sources.checkpoint.space_from_dict`)."""
    return space_from_dict(_space_dict(record, where, 0), where)


def _space_dict(record: Any, where: str, depth: int) -> dict[str, Any]:
    kind = _SPACES.get(record.ref) if isinstance(record, Record) else None
    if kind is None or depth > 16:
        raise UnsafeCheckpointError(f"{where}: {short_repr(getattr(record, 'ref', record))} is not a gymnasium space "
                                    f"this package rebuilds ({', '.join(n.rsplit('.', 1)[-1] for n in _SPACES)})")
    f = record.fields()
    dtype = f.get("dtype")
    dtype_name = dtype.str if isinstance(dtype, np.dtype) else None
    if kind == "box":
        return {"space": "box", "low": f.get("low"), "high": f.get("high"), "shape": f.get("_shape"),
                "dtype": dtype_name}
    if kind == "discrete":
        return {"space": "discrete", "n": f.get("n"), "start": f.get("start", 0)}
    if kind == "multi-discrete":
        return {"space": "multi-discrete", "nvec": f.get("nvec"), "dtype": dtype_name or "int64"}
    if kind == "multi-binary":
        n = f.get("n")
        return {"space": "multi-binary", "n": list(n) if isinstance(n, (tuple, list)) else n}
    spaces = f.get("spaces")
    if isinstance(spaces, Record) and "entries" in spaces.__dict__:  # an OrderedDict subclass, as data
        spaces = spaces.__dict__["entries"]
    if kind == "dict" and isinstance(spaces, dict):
        return {"space": "dict", "spaces": {k: _space_dict(v, where, depth + 1) for k, v in spaces.items()}}
    if kind == "tuple" and isinstance(spaces, (list, tuple)):
        return {"space": "tuple", "spaces": [_space_dict(v, where, depth + 1) for v in spaces]}
    raise UnsafeCheckpointError(f"{where}: a {kind} space without its subspaces")


