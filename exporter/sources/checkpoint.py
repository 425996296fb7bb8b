"""RLlib checkpoints (ray 2.1-2.9, old API stack) read without Ray and without running a pickle.

A checkpoint directory holds ``rllib_checkpoint.json`` (``type`` Algorithm or Policy, ``format``
cloudpickle or msgpack, ``checkpoint_version``, ``policy_ids``, ``state_file``), the state file
(``algorithm_state.pkl`` or ``policy_state.pkl``/``.msgpck``) and, for an Algorithm,
``policies/<id>/`` with one Policy checkpoint per policy id. :func:`read_checkpoint` reads:

- every file from inside the directory only, by its fixed name, opened without following a
  symbolic link and with a size limit checked first (:data:`STATE_LIMIT`); the ``state_file``
  RLlib writes into the JSON (the path the checkpoint was first saved at: relative, absolute, or
  stale after a move) is never opened, as RLlib's own ``get_checkpoint_info`` ignores it too, and
  one that names another file is refused (:func:`_check_state_file`);
- pickles through :mod:`exporter.sources.safe_pickle` (nothing is imported or called), msgpack
  with its numpy extension checked;
- per policy: its weights (variable name -> float array; a ``framework("tf2")`` policy's unnamed
  list as it is, in :attr:`CheckpointPolicy.weight_list`), its spaces (rebuilt with gymnasium from
  RLlib's own space dicts), its config, and its observation filter: the
  ``MeanStdObservationFilterAgentConnector`` state with connectors on, else the worker's filter in
  ``algorithm_state.pkl``; a Policy checkpoint written with connectors off carries no filter, and
  :attr:`CheckpointPolicy.filter_note` says so. The ``StateBufferConnector`` blob (a nested
  cloudpickle holding code) is never decoded.

What is read is checked before it is used: ``rllib_checkpoint.json`` strictly
(:mod:`policy_export.policy.jsonio`); spaces within the spec's limits
(:mod:`policy_export.policy.spaces`); weights and filter statistics finite; counts integers in
``[0, 2**63)``; config switches bools or ints; names matched whole. The whole read runs under one
:class:`~exporter.sources.safe_pickle.ReadBudget` (objects built, bytes decoded, wall time), and
messages quote file content only through :func:`~exporter.sources.safe_pickle.short_repr`.
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import ExportError, InputError, UnsafeCheckpointError
from policy_export.policy import jsonio
from policy_export.policy.files import read_regular
from policy_export.policy.spaces import MAX_CATEGORIES, MAX_DEPTH, MAX_ELEMENTS, MAX_LEAVES
from policy_export.exporter.sources.safe_pickle import (RANK_LIMIT, ReadBudget, Record, check_value_size,
                                                        current_budget, loads, msgpack_loads, plain_dtype, reading,
                                                        short_repr)

STATE_LIMIT = 1 << 30  # bytes of one state file
JSON_LIMIT = 1 << 20
NPY_LIMIT = 64 << 20  # bytes of one decompressed array of a space or filter
VERSIONS = ("0.1", "1.0", "1.1", "1.2")
STATE_FILES = {("Algorithm", "cloudpickle"): "algorithm_state.pkl", ("Algorithm", "msgpack"): "algorithm_state.msgpck",
               ("Policy", "cloudpickle"): "policy_state.pkl", ("Policy", "msgpack"): "policy_state.msgpck"}
POLICY_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")  # matched whole (re.fullmatch)
INT_LIMIT = 1 << 63  # global_timestep, a filter's count: 0 <= x < INT_LIMIT
# config entries that are switches: a bool, an int or None, never another object whose truth is its own
CONFIG_FLAGS = ("normalize_actions", "clip_actions", "twin_q", "dueling", "use_state_preprocessor",
                "_use_beta_distribution", "noisy", "add_layer_norm")
MODEL_FLAGS = ("use_lstm", "use_attention", "lstm_use_prev_action", "lstm_use_prev_reward", "free_log_std",
               "no_final_linear", "vf_share_layers")
MODEL_KEYS = ("model", "policy_model_config", "q_model_config")
FILTER_CONNECTORS = {"MeanStdObservationFilterAgentConnector": "MeanStdFilter",
                     "ConcurrentMeanStdObservationFilterAgentConnector": "ConcurrentMeanStdFilter"}


@dataclass
class FilterState:
    """RLlib's ``MeanStdFilter``: ``(x - mean) / (sqrt(M2 / (n - 1)) + 1e-6)``, then ``clip``."""

    kind: str
    n: int
    mean: np.ndarray
    m2: np.ndarray
    demean: bool = True
    destd: bool = True
    clip: float | None = None
    source: str = "connector"

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else np.sqrt(np.square(self.mean))

    def apply(self, x: np.ndarray) -> np.ndarray:
        """RLlib's filter, not updated: float64 statistics, float32 result as RLlib's graph gets it."""
        y = np.asarray(x, np.float64)
        if self.demean:
            y = y - self.mean
        if self.destd:
            y = y / (self.std + 1e-6)
        if self.clip:
            y = np.clip(y, -self.clip, self.clip)
        return y.astype(np.float32)


@dataclass
class CheckpointPolicy:
    policy_id: str
    policy_class: str
    observation_space: gym.Space
    action_space: gym.Space
    original_observation_space: gym.Space | None
    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    global_timestep: int = 0
    filter: FilterState | None = None
    filter_note: str | None = None
    # a framework("tf2") (eager) policy's weights: a list in the order of RLlib's model.variables(),
    # ``weights`` then empty until the network is known
    weight_list: list[np.ndarray] | None = None

    @property
    def framework(self) -> str:
        """``tf`` (named weights) or ``tf2`` (eager: the weights a list)."""
        return "tf" if self.weight_list is None else "tf2"

    @property
    def weight_count(self) -> int:
        return len(self.weights) if self.weight_list is None else len(self.weight_list)


@dataclass
class Checkpoint:
    path: Path
    type: str
    format: str
    version: str
    ray_version: str
    policies: dict[str, CheckpointPolicy] = field(default_factory=dict)

    def policy(self, policy_id: str | None = None) -> CheckpointPolicy:
        """The policy ``policy_id`` (default: the only one).

        Raises:
            ExportError: no such id, or several policies and none chosen (the ids are named).
        """
        ids = list(self.policies)
        if policy_id is None:
            if len(ids) == 1:
                return self.policies[ids[0]]
            raise ExportError(f"{self.path} holds {len(ids)} policies ({', '.join(ids)}): choose one with "
                              f"--policy-id ID, or export each with --all-policies")
        if policy_id not in self.policies:
            raise ExportError(f"{self.path} holds no policy {policy_id!r}; its policy ids: {', '.join(ids)}")
        return self.policies[policy_id]


def is_rllib_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory holding ``rllib_checkpoint.json`` (an Algorithm or Policy checkpoint)."""
    return (Path(path) / "rllib_checkpoint.json").is_file()


# ---------------------------------------------------------------------------------------- files

def _read_inside(root: Path, parts: tuple[str, ...], limit: int) -> bytes:
    """The bytes of ``root/parts...``: every component a plain name, no directory or file a
    symbolic link, the file regular and at most ``limit`` bytes (checked before reading)."""
    where = root.joinpath(*parts)
    current_budget().check_time(str(where))
    current = root
    for part in parts:
        if part in ("", ".", "..") or "/" in part or "\0" in part:
            raise UnsafeCheckpointError(f"refusing to read {where}: {part!r} is not a plain file name")
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            raise UnsafeCheckpointError(f"{where} is missing from the checkpoint") from None
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeCheckpointError(f"refusing to read {where}: {current} is a symbolic link; a checkpoint's "
                                        "files must be inside its directory")
    # read_regular asks for limit + 1 bytes at once: a buffer of the file's own size is enough
    return read_regular(current, min(limit, info.st_size + 4096), UnsafeCheckpointError)


NEW_STACK = ("{path} is a checkpoint of RLlib's new API stack (torch RLModules); read_checkpoint reads the old "
             "stack's: convert it with convert_checkpoint(path, out) or export_source(path, out)")


def _metadata(root: Path, parts: tuple[str, ...] = ()) -> dict[str, Any]:
    """``rllib_checkpoint.json`` read strictly (:mod:`policy_export.policy.jsonio`: UTF-8 without a
    BOM, no duplicate key, no NaN) and checked: type, format, version, policy ids, state_file."""
    where = root.joinpath(*parts, "rllib_checkpoint.json")
    try:
        meta = jsonio.loads(_read_inside(root, (*parts, "rllib_checkpoint.json"), JSON_LIMIT), str(where), JSON_LIMIT)
    except jsonio.JSONError as e:
        raise UnsafeCheckpointError(f"{where} is not strict JSON: {e.problem[:200]}") from None
    if not isinstance(meta, dict):
        raise UnsafeCheckpointError(f"{where} is not a JSON object")
    kind, fmt, version = meta.get("type"), meta.get("format", "cloudpickle"), meta.get("checkpoint_version", "")
    ids = meta.get("policy_ids", [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise UnsafeCheckpointError(f"{where}: policy_ids {short_repr(ids)} is not a list of names")
    if kind is None and str(version).startswith("2."):  # RLlib's new API stack writes no type, version 2.x
        raise InputError(NEW_STACK.format(path=root))
    if not isinstance(kind, str) or not isinstance(fmt, str) or (kind, fmt) not in STATE_FILES:
        raise UnsafeCheckpointError(f"{where}: type {short_repr(kind)} / format {short_repr(fmt)} is not an RLlib "
                                    "checkpoint this reads (Algorithm or Policy; cloudpickle or msgpack)")
    if not isinstance(version, (str, int, float)) or str(version) not in VERSIONS:
        raise UnsafeCheckpointError(f"{where}: checkpoint_version {short_repr(version)} is not one of "
                                    f"{', '.join(VERSIONS)} (ray 2.1-2.9, old API stack)")
    _check_state_file(root.joinpath(*parts), meta.get("state_file"), STATE_FILES[(kind, fmt)], where)
    return meta


def _check_state_file(directory: Path, named: Any, expected: str, where: Path) -> None:
    """Check the ``state_file`` RLlib recorded; the file read is always ``directory/expected``.

    RLlib writes ``os.path.join(<the directory given to save()>, "algorithm_state.pkl")`` for an
    Algorithm (relative, absolute, or stale once the checkpoint is moved or copied) and the bare
    name for a Policy; its ``get_checkpoint_info`` replaces the field with the directory's own file
    before anything is read, and so does this reader: the path is never opened. Refused: a field
    that is not a path, a path to a file of another name, and a path that names an existing file
    inside the checkpoint other than its own state file (the metadata contradicting the directory).

    Raises:
        UnsafeCheckpointError: one of those, naming the field and the file that is read instead.
    """
    if named is None:
        return
    if not isinstance(named, str) or not named or "\0" in named:
        raise UnsafeCheckpointError(f"{where}: state_file {short_repr(named, 100)} is not a path")
    if PurePath(named).name != expected:
        raise UnsafeCheckpointError(f"{where}: state_file {short_repr(named, 200)} names another file than the "
                                    f"checkpoint's own {expected}; only that file, inside the checkpoint directory, "
                                    "is read")
    # where the path lands read from the checkpoint directory (a relative path may be relative to
    # wherever the writer ran, so only a file that is really there contradicts the directory)
    base = os.path.abspath(directory)
    landed = os.path.normpath(named if os.path.isabs(named) else os.path.join(base, named))
    inside = os.path.commonpath([base, landed]) == base
    if inside and landed != os.path.join(base, expected) and os.path.lexists(landed):
        raise UnsafeCheckpointError(f"{where}: state_file {short_repr(named, 200)} names {landed[:200]}, another file "
                                    f"inside the checkpoint than its own {expected}; only that one is read")


def _state(root: Path, parts: tuple[str, ...], meta: dict[str, Any]) -> dict[str, Any]:
    name = STATE_FILES[(meta["type"], meta.get("format", "cloudpickle"))]
    data = _read_inside(root, (*parts, name), STATE_LIMIT)
    where = str(root.joinpath(*parts, name))
    state = msgpack_loads(data, where) if name.endswith(".msgpck") else loads(data, where)
    if not isinstance(state, dict):
        raise UnsafeCheckpointError(f"{where} does not hold a state dict")
    return state


# ---------------------------------------------------------------------------------------- spaces

def _npy(text: Any, where: str) -> np.ndarray:
    """RLlib's ``_serialize_ndarray``: base64(zlib(npy)); read with ``allow_pickle=False``. The
    text and what it inflates to are charged to the read's decoding budget, the array is at most
    :data:`NPY_LIMIT` bytes and its header is checked before numpy allocates it."""
    if isinstance(text, np.ndarray):
        plain_dtype(text.dtype, where)
        return text
    if not isinstance(text, (str, bytes)):
        raise UnsafeCheckpointError(f"{where}: an array is {type(text).__name__}, not RLlib's base64(zlib(npy)) text")
    budget = current_budget()
    budget.charge_decoded(len(text), where)
    try:
        packed = base64.b64decode(text, validate=True)
        raw = zlib.decompressobj().decompress(packed, min(NPY_LIMIT, budget.remaining_decoded()) + 1)
        budget.charge_decoded(len(raw), where)
        if len(raw) > NPY_LIMIT:
            raise UnsafeCheckpointError(f"{where}: an array inflates to more than {NPY_LIMIT >> 20} MiB")
        _check_npy_header(raw, where)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, TypeError, zlib.error, OSError) as e:
        raise UnsafeCheckpointError(f"{where}: an array is not RLlib's base64(zlib(npy)) encoding: "
                                    f"{str(e)[:120]}") from None
    plain_dtype(array.dtype, where)
    return array


def _check_npy_header(raw: bytes, where: str) -> None:
    """The npy header's declared array (a plain dtype, at most :data:`RANK_LIMIT` dimensions) fits
    the bytes after it (before numpy allocates it)."""
    buf = io.BytesIO(raw)
    major, _ = np.lib.format.read_magic(buf)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(buf)
    dtype = plain_dtype(np.dtype(dtype), where)
    if len(shape) > RANK_LIMIT or any(d > len(raw) for d in shape) \
            or math.prod(shape) * dtype.itemsize > len(raw) - buf.tell():
        raise UnsafeCheckpointError(f"{where}: an npy array declares shape {short_repr(shape)} of {dtype}, more than "
                                    "its bytes")


def space_from_dict(d: Any, where: str) -> gym.Space:
    """A gymnasium space from RLlib's ``gym_space_to_dict`` (the inverse of it), or refused. The
    spec's limits apply (:mod:`policy_export.policy.spaces`): at most ``MAX_LEAVES`` leaves,
    ``MAX_DEPTH`` levels of nesting, ``MAX_ELEMENTS`` elements and ``MAX_CATEGORIES`` categories,
    each checked before the space is built.

    Raises:
        UnsafeCheckpointError: a space of another kind, malformed, or over a limit.
    """
    return _space(d, where, [0, 0], 0)


def _space(d: Any, where: str, used: list[int], depth: int) -> gym.Space:
    """One (sub)space; ``used`` counts the leaves and elements of the whole space so far."""
    if depth > MAX_DEPTH:
        raise UnsafeCheckpointError(f"{where}: a space nests deeper than the limit of {MAX_DEPTH}")
    kind = d.get("space") if isinstance(d, dict) else None
    if kind in ("tuple", "dict"):
        subs = d.get("spaces")
        if not isinstance(subs, dict if kind == "dict" else (list, tuple)) or len(subs) > MAX_LEAVES:
            raise UnsafeCheckpointError(f"{where}: a {kind} space holds {short_repr(type(subs).__name__)} spaces, "
                                        f"not a {'dict' if kind == 'dict' else 'list'} of at most {MAX_LEAVES}")
        if kind == "tuple":
            return gym.spaces.Tuple([_space(sub, where, used, depth + 1) for sub in subs])
        if not all(isinstance(k, str) and len(k) <= 256 for k in subs):
            raise UnsafeCheckpointError(f"{where}: a dict space's keys are not all names")
        return gym.spaces.Dict({k: _space(sub, where, used, depth + 1) for k, sub in subs.items()})
    if not isinstance(kind, str) or kind not in _LEAF_BUILDERS:
        raise UnsafeCheckpointError(f"{where}: space {short_repr(kind)} is not one this package rebuilds "
                                    "(box, discrete, multi-binary, multi-discrete, tuple, dict)")
    used[0] += 1
    if used[0] > MAX_LEAVES:
        raise UnsafeCheckpointError(f"{where}: a space of more than {MAX_LEAVES} leaf spaces exceeds the limit")
    return _LEAF_BUILDERS[kind](d, where, used)


def _count(used: list[int], elements: int, where: str) -> None:
    used[1] += elements
    if used[1] > MAX_ELEMENTS:
        raise UnsafeCheckpointError(f"{where}: a space of more than {MAX_ELEMENTS} elements exceeds the limit")


def _int(value: Any, what: str, where: str, low: int = 0, high: int = INT_LIMIT) -> int:
    """``value`` as an int in ``[low, high)``: a Python or numpy integer, never a bool or another type."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not low <= value < high:
        raise UnsafeCheckpointError(f"{where}: {what} {short_repr(value)} is not an integer in [{low}, {high})")
    return int(value)


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > RANK_LIMIT:
        raise UnsafeCheckpointError(f"{where}: space shape {short_repr(value)} is not a list of at most "
                                    f"{RANK_LIMIT} sizes")
    return tuple(_int(v, "a space dimension", where, 0, MAX_ELEMENTS + 1) for v in value)


def _space_dtype(value: Any, kinds: str, where: str) -> np.dtype:
    if not isinstance(value, str) or len(value) > 16:
        raise UnsafeCheckpointError(f"{where}: space dtype {short_repr(value)} is not a numpy type name")
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in kinds or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsafeCheckpointError(f"{where}: space dtype {short_repr(value)} is not a plain number type")
    return dtype


def _box(d: dict, where: str, used: list[int]) -> gym.Space:
    shape = _shape(d.get("shape"), where)
    _count(used, math.prod(shape), where)
    dtype = _space_dtype(d.get("dtype"), "biuf", where)
    low, high = _npy(d.get("low"), where), _npy(d.get("high"), where)
    for bound in (low, high):
        if bound.dtype.kind not in "biuf" or bound.size not in (1, math.prod(shape)) \
                or (bound.dtype.kind == "f" and np.isnan(bound).any()):
            raise UnsafeCheckpointError(f"{where}: a Box bound of {bound.size} {bound.dtype} values (NaN not "
                                        f"allowed) does not fit shape {shape}")
    return gym.spaces.Box(low=low, high=high, shape=shape, dtype=dtype)


def _discrete(d: dict, where: str, used: list[int]) -> gym.Space:
    _count(used, 1, where)
    n = _int(d.get("n"), "Discrete n", where, 1, MAX_CATEGORIES + 1)
    return gym.spaces.Discrete(n, start=_int(d.get("start", 0), "Discrete start", where, -INT_LIMIT, INT_LIMIT))


def _multi_binary(d: dict, where: str, used: list[int]) -> gym.Space:
    n = d.get("n")
    if isinstance(n, (list, tuple)):
        shape = _shape(n, where)
        _count(used, math.prod(shape), where)
        return gym.spaces.MultiBinary(list(shape))
    _count(used, _int(n, "MultiBinary n", where, 1, MAX_ELEMENTS + 1), where)
    return gym.spaces.MultiBinary(int(n))


def _multi_discrete(d: dict, where: str, used: list[int]) -> gym.Space:
    nvec = _npy(d.get("nvec"), where)
    _count(used, nvec.size, where)
    if nvec.dtype.kind not in "iu" or nvec.size == 0 or (nvec <= 0).any() \
            or int(nvec.astype(object).sum()) > MAX_CATEGORIES:
        raise UnsafeCheckpointError(f"{where}: MultiDiscrete nvec of {nvec.size} {nvec.dtype} values is not positive "
                                    f"integers of at most {MAX_CATEGORIES} categories in all")
    return gym.spaces.MultiDiscrete(nvec, dtype=_space_dtype(d.get("dtype", "int64"), "iu", where))


_LEAF_BUILDERS = {"box": _box, "discrete": _discrete, "multi-binary": _multi_binary, "multi-discrete": _multi_discrete}


def _spaces(spec: dict[str, Any], where: str) -> tuple[gym.Space, gym.Space, gym.Space | None]:
    obs, act = spec.get("observation_space"), spec.get("action_space")
    if not isinstance(obs, dict) or not isinstance(act, dict):
        raise UnsafeCheckpointError(f"{where}: policy_spec holds no serialised spaces (ray >= 2.1 writes them)")
    original = obs.get("original_space")
    return (space_from_dict(obs.get("space"), where), space_from_dict(act.get("space"), where),
            space_from_dict(original.get("space"), where) if isinstance(original, dict) else None)


# ---------------------------------------------------------------------------------------- filters

def _running_stat(rs: Any, where: str) -> tuple[int, np.ndarray, np.ndarray]:
    """``(count, mean, M2)`` of RLlib's ``RunningStat``: a count in ``[0, 2**63)``, finite float arrays."""
    fields = rs.fields() if isinstance(rs, Record) else rs
    if isinstance(fields, list) and fields:
        fields = fields[0]
    if not isinstance(fields, dict) or "num_pushes" not in fields:
        raise UnsafeCheckpointError(f"{where}: the observation filter's running statistics are not readable")
    stats = []
    for key, what in (("mean_array", "mean"), ("std_array", "M2")):
        array = _npy(fields.get(key), where)
        if array.dtype.kind not in "biuf" or not np.isfinite(array).all():
            raise UnsafeCheckpointError(f"{where}: the observation filter's {what} holds non-finite or non-numeric "
                                        "values (NaN, Inf); a filter's statistics must be finite numbers")
        stats.append(np.asarray(array, np.float64))
    return _int(fields["num_pushes"], "the observation filter's count", where), stats[0], stats[1]


def _flag(value: Any, what: str, where: str) -> bool:
    """A switch read from a checkpoint: a bool, an int or None (False), never another object."""
    if value is None:
        return False
    if not isinstance(value, (bool, int, np.bool_, np.integer)):
        raise UnsafeCheckpointError(f"{where}: {what} is {type(value).__name__} {short_repr(value)}, not a bool")
    return bool(value)


def _clip(value: Any, where: str) -> float | None:
    """The filter's clip: None (or 0: no clip), else a positive finite number."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value < 0:
        raise UnsafeCheckpointError(f"{where}: the observation filter's clip {short_repr(value)} is not a positive "
                                    "finite number")
    return float(value) if value else None


def _filter_state(kind: str, params: dict[str, Any], source: str, where: str) -> FilterState:
    if not isinstance(params, dict):
        raise UnsafeCheckpointError(f"{where}: the observation filter's parameters are not readable")
    n, mean, m2 = _running_stat(params.get("running_stats"), where)
    if mean.shape != m2.shape:
        raise UnsafeCheckpointError(f"{where}: filter mean {mean.shape} and M2 {m2.shape} differ in shape")
    return FilterState(kind=kind, n=n, mean=mean, m2=m2,
                       demean=_flag(params.get("demean", True), "filter demean", where),
                       destd=_flag(params.get("destd", True), "filter destd", where),
                       clip=_clip(params.get("clip"), where), source=source)


def connector_filter(state: dict[str, Any], where: str) -> FilterState | None:
    """The filter of the agent connector pipeline, if there is one (connectors on)."""
    configs = state.get("connector_configs")
    agent = configs.get("agent") if isinstance(configs, dict) else None
    if not (isinstance(agent, (list, tuple)) and len(agent) == 2 and isinstance(agent[1], (list, tuple))):
        return None
    for entry in agent[1]:
        if isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str) \
                and entry[0] in FILTER_CONNECTORS:
            return _filter_state(FILTER_CONNECTORS[entry[0]], entry[1] or {}, "connector", where)
    return None


def worker_filter(algorithm_state: dict[str, Any], policy_id: str, where: str) -> FilterState | None:
    """The worker's filter of ``policy_id`` in ``algorithm_state`` (connectors off)."""
    worker = algorithm_state.get("worker")
    filters = worker.get("filters") if isinstance(worker, dict) else None
    record = filters.get(policy_id) if isinstance(filters, dict) else None
    if not isinstance(record, Record) or record.ref.rsplit(".", 1)[-1] == "NoFilter":
        return None
    kind = record.ref.rsplit(".", 1)[-1]
    if kind not in ("MeanStdFilter", "ConcurrentMeanStdFilter"):
        raise UnsafeCheckpointError(f"{where}: policy {policy_id!r} uses observation filter {record.ref[:200]}, "
                                    "which is not one this package rebuilds (MeanStdFilter, ConcurrentMeanStdFilter)")
    return _filter_state(kind, record.fields(), "worker", where)


# ---------------------------------------------------------------------------------------- policies

def _weights(state: dict[str, Any], where: str) -> tuple[dict[str, np.ndarray], list[np.ndarray] | None]:
    """``(named weights, None)`` of a ``framework("tf")`` policy, or ``({}, the list)`` of an eager
    (``framework("tf2")``) one, whose ``get_weights()`` has no names (named by
    :mod:`exporter.sources.rllib_layout` once the network is known)."""
    weights = state.get("weights")
    if isinstance(weights, (list, tuple)):
        if not weights:
            raise UnsafeCheckpointError(f"{where} holds no weights")
        return {}, [_numeric(f"#{i}", value, where) for i, value in enumerate(weights)]
    if not isinstance(weights, dict) or not weights:
        raise UnsafeCheckpointError(f"{where} holds no weights")
    out = {}
    for name, value in weights.items():
        if not isinstance(name, str) or len(name) > 1024:
            raise UnsafeCheckpointError(f"{where}: weight {short_repr(name)} is not a variable name")
        out[name] = _numeric(name, value, where)
    return out, None


def _numeric(name: str, value: Any, where: str) -> np.ndarray:
    """A weight: a numeric array (SAC's ``log_alpha`` is a scalar) whose floats are all finite."""
    value = np.asarray(value) if isinstance(value, np.generic) else value  # SAC's log_alpha is a scalar
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiub":
        raise UnsafeCheckpointError(f"{where}: weight {name[:200]} is not a numeric array")
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise UnsafeCheckpointError(f"{where}: weight {name[:200]} holds non-finite values (NaN or Inf); an export "
                                    "of it would serve them")
    return value


def _config(config: Any, where: str) -> dict[str, Any]:
    """The policy's config as a dict: RLlib writes a dict, or (some algorithms, ray 2.9) its
    ``AlgorithmConfig`` object, read here as the record's fields, whose names are the dict's keys.

    Raises:
        UnsafeCheckpointError: no readable config (rebuilding from defaults could build another net).
    """
    if isinstance(config, Record):
        config = config.fields()
    if not isinstance(config, dict) or not config:
        raise UnsafeCheckpointError(f"{where}: policy_spec holds no readable config ({type(config).__name__}); "
                                    f"the network cannot be rebuilt without it")
    check_value_size(config, f"{where}: the policy's config")
    for key in CONFIG_FLAGS:
        _flag(config.get(key), f"config {key}", where)
    for section in MODEL_KEYS:
        model = config.get(section)
        for key in MODEL_FLAGS if isinstance(model, dict) else ():
            _flag(model.get(key), f"config {section}.{key}", where)
    return config


# the suffixes RLlib's as_eager() and with_tracing() add to the name of an eager policy class
EAGER_SUFFIXES = ("_eager_traced", "_traced", "_eager")
CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")  # matched whole (re.fullmatch)
# a class named by a string: dotted identifiers
CLASS_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}(\.[A-Za-z_][A-Za-z0-9_]{0,127}){0,15}")


def policy_class_name(value: Any, where: str) -> str:
    """The policy class a checkpoint names: a string; a class pickled by reference (a record type,
    ``module.name``); or a class cloudpickle wrote by value (``_make_skeleton_class``, an eager
    policy of ray 2.x: ``DQNTFPolicy_eager_traced``), read as its name without RLlib's eager suffixes.

    Raises:
        UnsafeCheckpointError: a class written by value whose name is not a plain identifier.
    """
    if isinstance(value, Record) and value.ref.rsplit(".", 1)[-1] == "_make_skeleton_class":
        name = value.args[1] if len(value.args) > 1 else None
        if not isinstance(name, str) or not CLASS_NAME.fullmatch(name):
            raise UnsafeCheckpointError(f"{where}: the policy class is pickled by value under the name "
                                        f"{short_repr(name)}, which is not a plain class name")
        for suffix in EAGER_SUFFIXES:
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return name
    # a class pickled by reference is a record type, an instance or a name carries it as ``ref``
    is_record = isinstance(value, Record) or (isinstance(value, type) and issubclass(value, Record))
    name = value.ref if is_record else value
    if not isinstance(name, str) or not CLASS_PATH.fullmatch(name):
        raise UnsafeCheckpointError(f"{where}: the policy class {short_repr(name)} is not a class name")
    return name


def policy_from_state(policy_id: str, state: dict[str, Any], where: str) -> CheckpointPolicy:
    spec = state.get("policy_spec")
    if not isinstance(spec, dict):
        raise UnsafeCheckpointError(f"{where}: no policy_spec (RLlib >= 2.1 writes one)")
    obs, act, original = _spaces(spec, where)
    policy_class = policy_class_name(spec.get("policy_class"), where)
    config = _config(spec.get("config"), where)
    weights, weight_list = _weights(state, where)
    return CheckpointPolicy(policy_id=policy_id, policy_class=policy_class, observation_space=obs,
                            action_space=act, original_observation_space=original, config=config,
                            weights=weights, weight_list=weight_list,
                            global_timestep=_int(state.get("global_timestep") or 0, "global_timestep", where),
                            filter=connector_filter(state, where))


# what malformed checkpoint data can raise while it is interpreted (checked field by field where
# the reader knows the field; anything it did not foresee ends here, never as a traceback)
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError, MemoryError, OverflowError,
             AssertionError, OSError, zlib.error)


def read_checkpoint(path: str | Path, budget: ReadBudget | None = None) -> Checkpoint:
    """Read an RLlib Algorithm or Policy checkpoint directory (see the module docstring), within
    ``budget`` (default :class:`~exporter.sources.safe_pickle.ReadBudget`: objects built, bytes
    decoded and wall time of the whole read)::

        checkpoint = read_checkpoint("ckpt/")
        policy = checkpoint.policy()      # the only policy, or ExportError naming the ids

    A checkpoint of RLlib's new API stack (torch RLModules) is not read here: convert it with
    :func:`exporter.convert_checkpoint` or :func:`exporter.export_source`, which take both stacks.

    Raises:
        InputError: no such path, or a checkpoint of the new API stack (the route for it named).
        UnsafeCheckpointError: anything refused, unreadable or over budget, naming the file and the reason.
    """
    where = Path(path)
    if not where.exists() and not where.is_symlink():
        raise InputError(f"checkpoint {path}: no such directory")
    if not where.is_symlink() and where.is_dir() and (where / "metadata.json").is_file() \
            and (where / "class_and_ctor_args.pkl").is_file():  # an RLModule's own folder: the new stack's
        raise InputError(NEW_STACK.format(path=path))
    try:
        with reading(budget):
            return _read_checkpoint(Path(path))
    except UnsafeCheckpointError:
        raise
    except MALFORMED as e:
        raise UnsafeCheckpointError(f"{path} is not a checkpoint this package reads: {type(e).__name__}: "
                                    f"{str(e)[:300]}") from None


def _plain_policy_id(pid: Any, root: Path) -> None:
    if not isinstance(pid, str) or not POLICY_ID.fullmatch(pid) or pid in (".", ".."):
        raise UnsafeCheckpointError(f"{root}: policy id {short_repr(pid)} is not a plain name")


def _policy_dirs(root: Path) -> list[str] | None:
    """The policy ids of an Algorithm checkpoint as RLlib's ``get_checkpoint_info`` finds them:
    the entries of ``policies/`` (each then read through :func:`_read_inside`, which refuses a
    link), sorted; None without that directory."""
    where = root / "policies"
    try:
        info = os.lstat(where)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCheckpointError(f"{where} is not a directory (a symbolic link is not followed)")
    names = sorted(os.listdir(where))
    if len(names) > 4096:
        raise UnsafeCheckpointError(f"{where} holds {len(names)} entries, more than a checkpoint's policies")
    return names


def _worker_ids(ids: Any, root: Path) -> list[str]:
    """The policy ids the worker's state names (each checked by :func:`_plain_policy_id` after), sorted."""
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple, set)) or len(ids) > 4096 or not all(isinstance(i, str) for i in ids):
        raise UnsafeCheckpointError(f"{root}: the worker's policy_ids {short_repr(ids)} are not a list of names")
    return sorted(ids)


def _ray_version(value: Any) -> str:
    """The ``ray_version`` the metadata names, when it is a short version string, else ``?``."""
    return value if isinstance(value, str) and re.fullmatch(r"[0-9A-Za-z.+\-]{1,32}", value) else "?"


def _read_checkpoint(path: Path) -> Checkpoint:
    root = Path(path)
    if root.is_symlink() or not root.is_dir():
        raise UnsafeCheckpointError(f"{root} is not a checkpoint directory (a real directory, not a link)")
    meta = _metadata(root)
    result = Checkpoint(path=root, type=meta["type"], format=meta.get("format", "cloudpickle"),
                        version=str(meta["checkpoint_version"]), ray_version=_ray_version(meta.get("ray_version")))
    state = _state(root, (), meta)
    if meta["type"] == "Policy":
        policy = policy_from_state("default_policy", state, str(root))
        if policy.filter is None and not state.get("connector_configs"):
            policy.filter_note = ("a Policy checkpoint written with connectors off carries no observation filter: "
                                  "RLlib kept it in the Algorithm checkpoint's algorithm_state.pkl")
        result.policies[policy.policy_id] = policy
        return result
    for pid in meta.get("policy_ids") or []:
        _plain_policy_id(pid, root)
    ids = _policy_dirs(root)
    if ids is None:  # no policies/ directory: the ids the checkpoint names, each of which must then be there
        worker = state.get("worker")
        ids = meta.get("policy_ids") or _worker_ids(worker.get("policy_ids") if isinstance(worker, dict) else None,
                                                     root)
    for pid in ids:
        _plain_policy_id(pid, root)
        parts = ("policies", pid)
        pmeta = _metadata(root, parts)
        policy = policy_from_state(pid, _state(root, parts, pmeta), str(root.joinpath(*parts)))
        if policy.filter is None:
            policy.filter = worker_filter(state, pid, str(root / "algorithm_state.pkl"))
        result.policies[pid] = policy
    return result
