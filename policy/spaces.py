"""gymnasium spaces to and from the spec file's JSON, and their leaves keyed by nest path.

A space's *leaves* are its non-container sub-spaces in gymnasium's flatten order
(``Dict`` in its key order, ``Tuple`` by index). Each leaf has a stable nest path,
e.g. ``("camera",)`` or ``("state", "0")``, from which signature keys are made.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import SpecError, UnsupportedSpaceError

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
# size limits, checked before anything is allocated (a spec or manifest is untrusted input)
MAX_ELEMENTS = 1 << 24  # elements of one Box or MultiBinary leaf, and of a whole space
MAX_CATEGORIES = 1 << 20  # Discrete n, each MultiDiscrete entry, and their sum (the width of the logits)
MAX_DEPTH = 32  # Dict/Tuple nesting
MAX_LEAVES = 1024
MAX_SAMPLE_BYTES = 4 << 30  # samples x bytes of one observation, for parity samples
MAX_SAMPLES = 1_000_000  # parity samples (and exploration draws per observation)
SPACE_TYPES = ("Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple")
BOX_DTYPES = ("float16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64")

_FIELDS = {
    "Box": ({"type", "low", "high"}, {"shape", "dtype"}),
    "Discrete": ({"type", "n"}, {"start"}),
    "MultiDiscrete": ({"type", "nvec"}, set()),
    "MultiBinary": ({"type", "n"}, set()),
    "Dict": ({"type", "spaces"}, set()),
    "Tuple": ({"type", "spaces"}, set()),
}


@dataclass(frozen=True)
class Leaf:
    """One non-container sub-space and its nest path inside the whole space."""

    path: tuple[str, ...]
    space: gym.Space

    def key(self, prefix: str) -> str:
        """The signature key of this leaf: ``prefix`` alone for a flat space, else ``prefix/a/b``."""
        return "/".join((prefix, *self.path))


def leaves(space: gym.Space, path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Yield the leaves of ``space`` in gymnasium's flatten order."""
    if isinstance(space, gym.spaces.Dict):
        for name, sub in space.spaces.items():
            yield from leaves(sub, (*path, str(name)))
    elif isinstance(space, gym.spaces.Tuple):
        for i, sub in enumerate(space.spaces):
            yield from leaves(sub, (*path, str(i)))
    else:
        yield Leaf(path, space)


def check_supported(space: gym.Space, where: str, allowed: tuple[type, ...]) -> None:
    """Raise :class:`UnsupportedSpaceError` for the first leaf whose type is not in ``allowed``."""
    for leaf in leaves(space):
        if not isinstance(leaf.space, allowed):
            sub = where + "".join(f"/{p}" for p in leaf.path)
            raise UnsupportedSpaceError(
                type(leaf.space).__name__, sub, [t.__name__ for t in allowed]
            )


def leaf_shape(space: gym.Space) -> tuple[int, ...]:
    """Shape of one sample of a leaf space (``()`` for Discrete)."""
    return tuple(int(d) for d in space.shape)


def leaf_dtype(space: gym.Space) -> np.dtype:
    """The dtype a leaf is fed with: the space's own, int64 for Discrete and MultiDiscrete."""
    if isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        return np.dtype(np.int64)
    if isinstance(space, gym.spaces.MultiBinary):
        return np.dtype(np.int8)
    return np.dtype(space.dtype)


def leaf_values(space: gym.Space, value: Any, prefix: str) -> dict[str, Any]:
    """Split a nested value (dict/tuple per the space) into its leaves, keyed ``prefix/<path>``.

    Raises:
        KeyError: naming the missing nest path.
    """
    out = {}
    for leaf in leaves(space):
        v = value
        for part in leaf.path:
            try:
                v = v[part] if isinstance(v, dict) or hasattr(v, "keys") else v[int(part)]
            except (KeyError, IndexError, TypeError, ValueError):
                raise KeyError("/".join(leaf.path)) from None
        out[leaf.key(prefix)] = v
    return out


def nest_from_leaves(space: gym.Space, values: dict[str, Any] | list, prefix: str | None = None) -> Any:
    """Leaf values (keyed ``prefix/<path>``, or a list in flatten order) -> the space's nest.

    A space that is not a Dict or Tuple gives its single leaf value back.
    """
    items = iter(values if isinstance(values, list) else [values[leaf.key(prefix)] for leaf in leaves(space)])

    def build(sub: gym.Space) -> Any:
        if isinstance(sub, gym.spaces.Dict):
            return {k: build(v) for k, v in sub.spaces.items()}
        if isinstance(sub, gym.spaces.Tuple):
            return tuple(build(v) for v in sub.spaces)
        return next(items)

    return build(space)


# --------------------------------------------------------------------------- to JSON


def space_text(space: gym.Space, limit: int = 200) -> str:
    """A space as a person reads it, short: ``Box(4,)``, ``Box(84, 84, 3) uint8``, ``Discrete(2)``,
    ``MultiDiscrete([3, 2])``, ``Dict(a: Box(3,), b: Discrete(2))`` (a Box's bounds left out; a
    float32 Box names no dtype); at most ``limit`` characters."""
    if isinstance(space, gym.spaces.Box):
        dtype = "" if np.dtype(space.dtype) == np.float32 else f" {np.dtype(space.dtype).name}"
        text = f"Box{tuple(int(d) for d in space.shape)}{dtype}"
    elif isinstance(space, gym.spaces.Discrete):
        start = int(getattr(space, "start", 0))
        text = f"Discrete({int(space.n)}{f', start={start}' if start else ''})"
    elif isinstance(space, gym.spaces.MultiDiscrete):
        text = f"MultiDiscrete({np.asarray(space.nvec).tolist()})"
    elif isinstance(space, gym.spaces.MultiBinary):
        n = space.n if isinstance(space.n, int) else list(space.n)
        text = f"MultiBinary({n})"
    elif isinstance(space, gym.spaces.Dict):
        text = "Dict(" + ", ".join(f"{k}: {space_text(v, limit)}" for k, v in space.spaces.items()) + ")"
    elif isinstance(space, gym.spaces.Tuple):
        text = "Tuple(" + ", ".join(space_text(v, limit) for v in space.spaces) + ")"
    else:
        text = type(space).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def space_to_json(space: gym.Space) -> dict[str, Any]:
    """The spec-file JSON object of a gymnasium space."""
    if isinstance(space, gym.spaces.Box):
        return {
            "type": "Box",
            "low": _bound_to_json(space.low, space.dtype),
            "high": _bound_to_json(space.high, space.dtype),
            "shape": list(space.shape),
            "dtype": np.dtype(space.dtype).name,
        }
    if isinstance(space, gym.spaces.Discrete):
        out: dict[str, Any] = {"type": "Discrete", "n": int(space.n)}
        if int(space.start) != 0:
            out["start"] = int(space.start)
        return out
    if isinstance(space, gym.spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": np.asarray(space.nvec).tolist()}
    if isinstance(space, gym.spaces.MultiBinary):
        n = space.n
        return {"type": "MultiBinary", "n": int(n) if np.ndim(n) == 0 else list(map(int, n))}
    if isinstance(space, gym.spaces.Dict):
        return {"type": "Dict", "spaces": {k: space_to_json(s) for k, s in space.spaces.items()}}
    if isinstance(space, gym.spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_to_json(s) for s in space.spaces]}
    raise UnsupportedSpaceError(type(space).__name__, "space", SPACE_TYPES)


def _bound_to_json(bound: np.ndarray, dtype: Any) -> Any:
    """A number when every element is equal, else a nested list; infinities as "inf"/"-inf".

    Numbers are written in the shortest form that reads back to the same value in ``dtype``.
    """
    arr = np.asarray(bound)
    flat = arr.ravel()
    if flat.size and np.all(flat == flat[0]):
        return _num_to_json(flat[0], dtype)
    return np.vectorize(lambda x: _num_to_json(x, dtype), otypes=[object])(arr).tolist()


def _num_to_json(x: Any, dtype: Any) -> Any:
    if np.issubdtype(np.dtype(dtype), np.integer):
        return int(x)  # exact, whatever its size
    x = np.asarray(x).astype(dtype)[()] if np.issubdtype(np.dtype(dtype), np.floating) else x
    if math.isinf(float(x)):
        return "inf" if x > 0 else "-inf"
    if float(x).is_integer() and abs(float(x)) < 2**53:
        return int(x)
    return float(str(x)) if isinstance(x, np.floating) else float(x)


# --------------------------------------------------------------------------- from JSON


class _Problems:
    """Collects ``(json_path, message)`` pairs so that every problem is reported at once."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))


def space_from_json(obj: Any, path: str = "$", source: str = "<spec>") -> gym.Space:
    """Build a gymnasium space from its spec-file JSON.

    Raises:
        SpecError: listing every problem with its JSON path.
        UnsupportedSpaceError: for a gymnasium type the package cannot export.
    """
    problems = _Problems()
    space = parse_space(obj, path, problems)
    if problems.items or space is None:
        raise SpecError(source, problems.items or [(path, "not a space")])
    return space


def parse_space(obj: Any, path: str, problems: _Problems) -> gym.Space | None:
    """Like :func:`space_from_json` but adds problems to ``problems`` instead of raising.

    Sizes are capped (:data:`MAX_ELEMENTS`, :data:`MAX_CATEGORIES`, :data:`MAX_DEPTH`,
    :data:`MAX_LEAVES`) before anything is allocated; a problem names the limit.
    """
    space = _parse_space(obj, path, problems, 0)
    if space is None:
        return None
    found = list(leaves(space))
    if len(found) > MAX_LEAVES:
        problems.add(path, f"{len(found)} leaf spaces exceed the limit of {MAX_LEAVES}")
        return None
    total = sum(leaf_elements(leaf.space) for leaf in found)
    if total > MAX_ELEMENTS:
        problems.add(path, f"{total} elements in one sample exceed the limit of {MAX_ELEMENTS}")
        return None
    return space


def leaf_elements(space: gym.Space) -> int:
    """Elements of one sample of a leaf space (Discrete: 1)."""
    return math.prod(int(d) for d in space.shape)


def check_sample_budget(samples: int, space: gym.Space, what: str = "samples") -> None:
    """Refuse more than :data:`MAX_SAMPLES` samples, or samples of ``space`` beyond :data:`MAX_SAMPLE_BYTES`.

    Raises:
        InputError: naming the limit and the largest sample count that fits.
    """
    from policy_export.errors import InputError

    if samples > MAX_SAMPLES:
        raise InputError(f"{what} {samples} exceeds the limit of {MAX_SAMPLES}")
    per_sample = max(1, sum(leaf_elements(leaf.space) * leaf_dtype(leaf.space).itemsize for leaf in leaves(space)))
    if samples * per_sample > MAX_SAMPLE_BYTES:
        raise InputError(f"{what} {samples} x {per_sample} bytes per observation exceed the limit of "
                         f"{MAX_SAMPLE_BYTES >> 20} MiB; use at most {MAX_SAMPLE_BYTES // per_sample}")


def _parse_space(obj: Any, path: str, problems: _Problems, depth: int = 0) -> gym.Space | None:
    if depth > MAX_DEPTH:
        problems.add(path, f"spaces nested deeper than the limit of {MAX_DEPTH}")
        return None
    if not isinstance(obj, dict):
        problems.add(path, f"expected an object describing a space, got {_kind(obj)}")
        return None
    kind = obj.get("type")
    if kind not in _FIELDS:
        if isinstance(kind, str) and kind in ("Text", "Graph", "Sequence", "OneOf"):
            raise UnsupportedSpaceError(kind, path, SPACE_TYPES)
        problems.add(f"{path}.type", f"expected one of {', '.join(SPACE_TYPES)}, got {kind!r}")
        return None
    required, optional = _FIELDS[kind]
    for key in sorted(required - obj.keys()):
        problems.add(f"{path}.{key}", f"missing (required for {kind})")
    for key in sorted(obj.keys() - required - optional):
        problems.add(f"{path}.{key}", f"unknown key for {kind}; allowed: {', '.join(sorted(required | optional))}")
    if required - obj.keys():
        return None
    before = len(problems.items)
    builder = {
        "Box": _parse_box,
        "Discrete": _parse_discrete,
        "MultiDiscrete": _parse_multidiscrete,
        "MultiBinary": _parse_multibinary,
        "Dict": _parse_dict,
        "Tuple": _parse_tuple,
    }[kind]
    space = builder(obj, path, problems, depth) if kind in ("Dict", "Tuple") else builder(obj, path, problems)
    return space if len(problems.items) == before else None


def _parse_box(obj: dict, path: str, problems: _Problems) -> gym.Space | None:
    dtype = obj.get("dtype", "float32")
    if dtype not in BOX_DTYPES:
        problems.add(f"{path}.dtype", f"expected one of {', '.join(BOX_DTYPES)}, got {dtype!r}")
        return None
    dt = np.dtype(dtype)
    shape = obj.get("shape")
    if shape is not None and not (
        isinstance(shape, list) and all(_is_int(d) and d > 0 for d in shape)
    ):
        problems.add(f"{path}.shape", f"expected a list of positive integers, got {shape!r}")
        return None
    if shape is not None and (len(shape) > MAX_DEPTH or math.prod(shape) > MAX_ELEMENTS):
        problems.add(f"{path}.shape", f"{shape} exceeds the limit of {MAX_ELEMENTS} elements (rank {MAX_DEPTH})")
        return None
    parse = _parse_int_bound if np.issubdtype(dt, np.integer) else _parse_bound
    low = parse(obj["low"], f"{path}.low", problems, dt)
    high = parse(obj["high"], f"{path}.high", problems, dt)
    if low is None or high is None:
        return None
    if shape is None:
        if low.ndim == 0 and high.ndim == 0:
            problems.add(f"{path}.shape", "missing: required when low and high are both numbers")
            return None
        shape = list((low if low.ndim else high).shape)
    try:
        low_b = np.broadcast_to(low, shape)
        high_b = np.broadcast_to(high, shape)
    except ValueError:
        problems.add(path, f"low {list(low.shape)} and high {list(high.shape)} do not fit shape {shape}")
        return None
    if np.any(low_b > high_b):
        idx = tuple(int(i) for i in np.argwhere(low_b > high_b)[0])
        problems.add(path, f"low > high at index {list(idx)} ({low_b[idx]} > {high_b[idx]})")
        return None
    return gym.spaces.Box(low=low_b.astype(dt), high=high_b.astype(dt), shape=tuple(shape), dtype=dt)


def _bound_array(value: Any, path: str, problems: _Problems) -> np.ndarray | None:
    """A number or nested list as an object array of its elements (not converted yet)."""
    if not isinstance(value, list):
        return np.array(value, dtype=object)
    try:
        arr = np.array(value, dtype=object)
    except ValueError:
        arr = None
    if arr is None or arr.ndim == 0 or arr.size == 0 or any(isinstance(v, list) for v in arr.flat):
        problems.add(path, f"expected a number, 'inf', '-inf' or a nested list of them, got {_kind(value)}")
        return None
    if arr.size > MAX_ELEMENTS:
        problems.add(path, f"{arr.size} bound values exceed the limit of {MAX_ELEMENTS}")
        return None
    return arr


def _parse_bound(value: Any, path: str, problems: _Problems, dtype: np.dtype = np.dtype(np.float64)) -> np.ndarray | None:
    """Float bounds; a finite value the dtype cannot hold (it would become inf) is refused."""
    def conv(v: Any) -> float:
        if isinstance(v, str) and v in ("inf", "+inf", "-inf", "Infinity", "-Infinity"):
            return -math.inf if v.startswith("-") else math.inf
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(v)
        if isinstance(v, float) and math.isnan(v):
            raise ValueError(v)
        return float(v)

    arr = _bound_array(value, path, problems)
    if arr is None:
        return None
    try:
        out = np.array([conv(v) for v in arr.flat], dtype=np.float64).reshape(arr.shape)
    except ValueError:
        problems.add(path, "NaN is not a valid bound")
        return None
    except (TypeError, OverflowError):
        problems.add(path, f"expected a number, 'inf', '-inf' or a nested list of them, got {_shorten(value)}")
        return None
    limit = float(np.finfo(dtype).max) if np.issubdtype(dtype, np.floating) else math.inf
    with np.errstate(over="ignore"):  # a value that rounds to the dtype's largest (what _num_to_json writes) fits
        bad = np.isfinite(out) & ~np.isfinite(out.astype(dtype))
    if bad.any():
        problems.add(path, f"bound {out[bad].flat[0]:g} does not fit {dtype.name} (largest finite value {limit:g}); "
                           "use 'inf' or '-inf' for an unbounded side")
        return None
    return out


def _parse_int_bound(value: Any, path: str, problems: _Problems, dtype: np.dtype) -> np.ndarray | None:
    """Integer bounds, kept exact (no float round trip) and checked against the dtype's range."""
    arr = _bound_array(value, path, problems)
    if arr is None:
        return None
    info = np.iinfo(dtype)
    values = []
    for v in arr.flat:
        if isinstance(v, str) and v.lstrip("+-") in ("inf", "Infinity"):
            problems.add(path, f"an integer Box ({dtype.name}) needs finite bounds")
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and math.isnan(v)):
            problems.add(path, f"expected whole numbers for an integer Box ({dtype.name}), got {_shorten(value)}")
            return None
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            problems.add(path, f"an integer Box ({dtype.name}) needs whole-number bounds, got {v!r}")
            return None
        n = int(v)
        if not info.min <= n <= info.max:
            problems.add(path, f"bounds do not fit {dtype.name} [{info.min}, {info.max}]: {n}")
            return None
        values.append(n)
    return np.array(values, dtype=dtype).reshape(arr.shape)


def _shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse_discrete(obj: dict, path: str, problems: _Problems) -> gym.Space | None:
    n, start = obj["n"], obj.get("start", 0)
    ok = True
    if not (_is_int(n) and n > 0):
        problems.add(f"{path}.n", f"expected a positive integer, got {n!r}")
        ok = False
    elif n > MAX_CATEGORIES:
        problems.add(f"{path}.n", f"{n} exceeds the limit of {MAX_CATEGORIES} categories")
        ok = False
    if not _is_int(start):
        problems.add(f"{path}.start", f"expected an integer, got {start!r}")
        ok = False
    elif ok and not (_INT64.min <= start and start + n - 1 <= _INT64.max):
        problems.add(f"{path}.start", f"actions {start}..{start + n - 1} do not fit int64 [{_INT64.min}, {_INT64.max}]")
        ok = False
    return gym.spaces.Discrete(n, start=start) if ok else None


def _parse_multidiscrete(obj: dict, path: str, problems: _Problems) -> gym.Space | None:
    nvec = obj["nvec"]
    if not (isinstance(nvec, list) and nvec and all(_is_int(v) and v > 0 for v in nvec)):
        problems.add(f"{path}.nvec", f"expected a non-empty list of positive integers, got {_shorten(nvec)}")
        return None
    if sum(nvec) > MAX_CATEGORIES:
        problems.add(f"{path}.nvec", f"{sum(nvec)} categories in all exceed the limit of {MAX_CATEGORIES}")
        return None
    return gym.spaces.MultiDiscrete(nvec)


def _parse_multibinary(obj: dict, path: str, problems: _Problems) -> gym.Space | None:
    n = obj["n"]
    ok = (_is_int(n) and n > 0) or (isinstance(n, list) and n and all(_is_int(v) and v > 0 for v in n))
    if ok and (math.prod(n) if isinstance(n, list) else n) > MAX_ELEMENTS:
        problems.add(f"{path}.n", f"{n} exceeds the limit of {MAX_ELEMENTS} elements")
        return None
    if ok:
        return gym.spaces.MultiBinary(n)
    problems.add(f"{path}.n", f"expected a positive integer or list of them, got {n!r}")
    return None


def _parse_dict(obj: dict, path: str, problems: _Problems, depth: int = 0) -> gym.Space | None:
    subs = obj["spaces"]
    if not (isinstance(subs, dict) and subs):
        problems.add(f"{path}.spaces", f"expected a non-empty object of spaces, got {_kind(subs)}")
        return None
    if len(subs) > MAX_LEAVES:
        problems.add(f"{path}.spaces", f"{len(subs)} spaces exceed the limit of {MAX_LEAVES}")
        return None
    parsed = {}
    for name, sub in subs.items():
        if not _KEY.fullmatch(name):
            problems.add(f"{path}.spaces", f"key {name!r} must be letters, digits, '_', '.' or '-' "
                                          "(it becomes part of a tensor name)")
            continue
        parsed[name] = _parse_space(sub, f"{path}.spaces.{name}", problems, depth + 1)
    if any(v is None for v in parsed.values()) or len(parsed) != len(subs):
        return None
    space = gym.spaces.Dict(parsed)
    return space if _names_distinct(space, path, problems) else None


def _parse_tuple(obj: dict, path: str, problems: _Problems, depth: int = 0) -> gym.Space | None:
    subs = obj["spaces"]
    if not (isinstance(subs, list) and subs):
        problems.add(f"{path}.spaces", f"expected a non-empty list of spaces, got {_kind(subs)}")
        return None
    if len(subs) > MAX_LEAVES:
        problems.add(f"{path}.spaces", f"{len(subs)} spaces exceed the limit of {MAX_LEAVES}")
        return None
    parsed = [_parse_space(s, f"{path}.spaces[{i}]", problems, depth + 1) for i, s in enumerate(subs)]
    if any(p is None for p in parsed):
        return None
    space = gym.spaces.Tuple(parsed)
    return space if _names_distinct(space, path, problems) else None


def leaf_name(leaf: Leaf) -> str:
    """The tensor-name-safe form of a leaf's nest path (``a.b`` and ``a_b`` both give ``a_b``)."""
    return "_".join(re.sub(r"\W", "_", p) for p in leaf.path)


def _names_distinct(space: gym.Space, path: str, problems: _Problems) -> bool:
    """Leaves whose names collide once made tensor-name safe (e.g. ``a.b`` and ``a_b``) are refused."""
    seen: dict[str, str] = {}
    for leaf in leaves(space):
        name, where = leaf_name(leaf), "/".join(leaf.path)
        if name in seen and seen[name] != where:
            problems.add(path, f"keys {seen[name]!r} and {where!r} both become {name!r} in tensor names; rename one")
            return False
        seen[name] = where
    return True


_INT64 = np.iinfo(np.int64)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(v), f"a {type(v).__name__}") + (f" ({v!r})" if isinstance(v, (str, int, float)) else "")
