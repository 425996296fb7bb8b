"""What a checkpoint policy's config, spaces and filter statistics may hold before a graph is built from them.

A checkpoint's config and spaces decide the size of every layer the package rebuilds. Each value
the rebuilt graph uses is checked here against what RLlib itself would build, before TensorFlow
sees it (an allowlist: a kind and a range per field):

- every layer width (``fcnet_hiddens``, ``post_fcnet_hiddens``, ``lstm_cell_size``, DQN's
  ``hiddens``, DDPG's ``actor_hiddens``, ``conv_filters``' filters, kernels and strides, the
  attention net's sizes) is an integer from 1 to :data:`MAX_UNITS` (a zero-width layer would run
  a zero-sized matrix product, which oneDNN aborts on);
- ``max_seq_len`` and the attention memory are integers from 1 to :data:`MAX_SEQ_LEN`;
- every leaf of the observation and action spaces holds at least one value (a Box of shape
  ``(0,)``, ``Discrete(0)`` and an empty Dict are refused) and flattens to at most
  :data:`MAX_VALUES` values, with bounds that are not NaN;
- the switches the graph reads (``free_log_std``, ``vf_share_layers``, ``normalize_actions``...)
  are booleans (or None);
- the numbers the graph holds as constants (DQN's ``v_min``/``v_max``, the attention net's GRU
  bias, the observation filter's mean, standard deviation, count and clip) are finite.

Everything else the manifest records of the checkpoint is informational: :func:`json_value`
keeps a value only when it is JSON that the package's own strict reader reads back (finite
numbers, integers of at most 18 digits, short strings and short lists and dicts of these); other
values are left out and their keys listed (:func:`recorded`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import ExportError
from policy_export.exporter.sources.safe_pickle import short_repr
from policy_export.policy.jsonio import is_utf8
from policy_export.policy.spaces import leaves

MAX_UNITS = 1 << 16  # the widest layer, cell, filter count, kernel or stride accepted
MAX_SEQ_LEN = 1 << 16  # the longest max_seq_len or attention memory accepted
MAX_LAYERS = 256  # the most transformer units accepted
MAX_VALUES = 1 << 24  # the most values one leaf of a space may flatten to
MAX_INT = 10**18 - 1  # integers the manifest records (the strict JSON reader takes up to 30 digits)
MAX_TEXT = 1000  # characters of a recorded string
MAX_ITEMS = 256  # entries of a recorded list or dict
MAX_DEPTH = 6  # nesting of a recorded list or dict
FLOAT32_MAX = float(np.finfo(np.float32).max)
MODEL_FLAGS = ("free_log_std", "no_final_linear", "vf_share_layers", "use_lstm", "lstm_use_prev_action",
               "lstm_use_prev_reward", "use_attention")
# the config's switches each network family reads
CONFIG_FLAGS = {"actor_critic": (), "q_learning": ("dueling", "noisy", "add_layer_norm"),
                "soft_actor": ("twin_q", "_use_beta_distribution"),
                "deterministic_actor": ("twin_q", "use_state_preprocessor")}


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _short(value: Any) -> str:
    return short_repr(value, 60)  # never the whole repr (or str) of what a file holds


class _Problems(list):
    """Problems found, each naming its field."""

    def units(self, field: str, value: Any, low: int = 1, high: int = MAX_UNITS) -> None:
        if not _is_int(value) or not low <= int(value) <= high:
            self.append(f"{field} is {_short(value)}, not an integer from {low} to {high}")

    def sizes(self, field: str, value: Any) -> None:
        """A list of layer widths (None or empty: no layers)."""
        if value is None:
            return
        if not isinstance(value, (list, tuple)) or len(value) > MAX_ITEMS:
            self.append(f"{field} is {_short(value)}, not a list of layer widths")
            return
        for i, size in enumerate(value):
            self.units(f"{field}[{i}]", size)

    def flag(self, field: str, value: Any) -> None:
        if value is not None and not isinstance(value, (bool, np.bool_)):
            self.append(f"{field} is {_short(value)}, not true or false")

    def finite(self, field: str, value: Any) -> None:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(value)) or abs(float(value)) > FLOAT32_MAX:
            self.append(f"{field} is {_short(value)}, not a finite number")

    def raise_any(self, where: str) -> None:
        if self:
            more = f" (and {len(self) - 6} more)" if len(self) > 6 else ""
            raise ExportError(f"{where}: its config cannot be rebuilt: {'; '.join(self[:6])}{more}")


def space_problems(space: gym.Space | None, field: str) -> list[str]:
    """What makes ``space`` unusable for a rebuilt graph: a leaf with no values, NaN bounds."""
    if space is None:
        return []
    found = list(leaves(space))
    if not found:
        return [f"{field} {_short(space)} has no leaves"]
    problems = []
    for leaf in found:
        name = field + "".join(f"/{p}" for p in leaf.path)
        s = leaf.space
        if isinstance(s, gym.spaces.Discrete) and int(s.n) < 1:
            problems.append(f"{name} is Discrete({int(s.n)}): it has no actions or values")
        elif isinstance(s, gym.spaces.MultiDiscrete) and (np.size(s.nvec) == 0 or np.any(np.asarray(s.nvec) < 1)):
            problems.append(f"{name} is MultiDiscrete({_short(np.asarray(s.nvec).tolist())}): a zero-width part")
        elif s.shape is not None and int(np.prod(s.shape)) == 0:
            problems.append(f"{name} has shape {list(s.shape)}: it holds no values")
        elif isinstance(s, gym.spaces.Box) and (np.isnan(s.low).any() or np.isnan(s.high).any()):
            problems.append(f"{name} has NaN bounds")
        elif _width(s) > MAX_VALUES:
            problems.append(f"{name} flattens to {_width(s)} values, more than {MAX_VALUES}")
    return problems


def _width(space: gym.Space) -> int:
    """How many values RLlib's preprocessor makes of the leaf ``space`` (one-hot for Discrete)."""
    if isinstance(space, gym.spaces.Discrete):
        return int(space.n)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return int(np.sum(np.asarray(space.nvec, dtype=object)))
    return int(np.prod(space.shape, dtype=object)) if space.shape is not None else 0


def _conv_filters(p: _Problems, filters: Any, field: str) -> None:
    if filters is None:
        return
    if not isinstance(filters, (list, tuple)) or not filters or len(filters) > MAX_ITEMS:
        p.append(f"{field} is {_short(filters)}, not a list of [filters, kernel, stride]")
        return
    for i, spec in enumerate(filters):
        if not isinstance(spec, (list, tuple)) or len(spec) != 3:
            p.append(f"{field}[{i}] is {_short(spec)}, not [filters, kernel, stride]")
            continue
        p.units(f"{field}[{i}] filters", spec[0])
        for part, value in (("kernel", spec[1]), ("stride", spec[2])):
            pair = value if isinstance(value, (list, tuple)) else [value, value]
            if len(pair) != 2:
                p.append(f"{field}[{i}] {part} is {_short(value)}, not a size or a pair of sizes")
            for v in pair[:2]:
                p.units(f"{field}[{i}] {part}", v)


def _model_problems(p: _Problems, model: Mapping[str, Any], base: str, field: str = "model") -> None:
    """The keys of a catalog net's ``model`` config that the rebuilt ``base`` net (``fcnet`` or
    ``vision``) and its wrappers read."""
    for key in MODEL_FLAGS:
        p.flag(f"{field}.{key}", model.get(key))
    if base == "vision":
        _conv_filters(p, model.get("conv_filters"), f"{field}.conv_filters")
    else:
        p.sizes(f"{field}.fcnet_hiddens", model.get("fcnet_hiddens"))
    p.sizes(f"{field}.post_fcnet_hiddens", model.get("post_fcnet_hiddens"))
    if model.get("use_attention"):
        p.units(f"{field}.attention_num_transformer_units", model.get("attention_num_transformer_units"), 1, MAX_LAYERS)
        for key in ("attention_dim", "attention_num_heads", "attention_head_dim", "attention_position_wise_mlp_dim"):
            p.units(f"{field}.{key}", model.get(key))
        p.units(f"{field}.attention_memory_inference", model.get("attention_memory_inference"), 1, MAX_SEQ_LEN)
        for key in ("attention_use_n_prev_actions", "attention_use_n_prev_rewards"):
            p.units(f"{field}.{key}", model.get(key), 0, MAX_SEQ_LEN)
    if model.get("use_lstm"):
        p.units(f"{field}.lstm_cell_size", model.get("lstm_cell_size"))
        p.units(f"{field}.max_seq_len", model.get("max_seq_len"), 1, MAX_SEQ_LEN)


def check_policy(policy: Any, kind: str, base: str, model: Mapping[str, Any], where: str,
                 use_filter: bool = True) -> None:
    """Refuse a checkpoint policy whose spaces, config or filter statistics the graph cannot be
    built from (see the module docstring), every problem named by its field.

    ``policy`` is a :class:`~exporter.sources.checkpoint.CheckpointPolicy`, ``kind`` its
    network family, ``base`` its catalog net (``fcnet`` or ``vision``), ``model`` its ``model``
    config over RLlib's defaults; the observation filter is checked when the graph applies it
    (``use_filter``).

    Raises:
        ExportError: each field that is out of its allowed kind or range.
    """
    p = _Problems()
    p.extend(space_problems(policy.original_observation_space or policy.observation_space, "observation_space"))
    if policy.original_observation_space is not None:
        p.extend(space_problems(policy.observation_space, "observation_space (preprocessed)"))
    p.extend(space_problems(policy.action_space, "action_space"))
    config = policy.config
    for key in ("normalize_actions", "clip_actions", *CONFIG_FLAGS.get(kind, ())):
        p.flag(key, config.get(key))
    _model_problems(p, model, base)
    if kind == "q_learning":
        p.sizes("hiddens", config.get("hiddens"))
        atoms = config.get("num_atoms")
        if atoms is not None:
            p.units("num_atoms", atoms)
        if _is_int(atoms) and atoms > 1:
            p.finite("v_min", config.get("v_min", -10.0))
            p.finite("v_max", config.get("v_max", 10.0))
    elif kind == "soft_actor":
        for key in ("policy_model_config", "q_model_config"):
            sub = config.get(key) or {}
            if not isinstance(sub, Mapping):
                p.append(f"{key} is {_short(sub)}, not a model config")
            else:
                _model_problems(p, sub, base, key)
    elif kind == "deterministic_actor":
        p.sizes("actor_hiddens", config.get("actor_hiddens", [256, 256]))
        p.sizes("critic_hiddens", config.get("critic_hiddens", [256, 256]))
    if policy.filter is not None and use_filter:
        p.extend(filter_problems(policy.filter))
    p.raise_any(where)


def filter_problems(state: Any) -> list[str]:
    """What makes a ``MeanStdFilter``'s statistics unusable as constants: a count that is not a
    bounded integer, a mean or standard deviation that is not finite in float32, a clip that is
    not a finite positive number."""
    problems = _Problems()
    problems.units("observation filter count", state.n, 0, MAX_INT)
    if problems:
        return problems
    for name, values in (("mean", state.mean), ("standard deviation", state.std)):
        arr = np.asarray(values, np.float64)
        if not np.all(np.isfinite(arr)) or (arr.size and np.abs(arr).max() > FLOAT32_MAX):
            problems.append(f"the observation filter's {name} holds values that are not finite float32 numbers")
    if state.clip is not None:
        problems.finite("observation filter clip", state.clip)
        if not problems and state.clip <= 0:
            problems.append(f"observation filter clip is {_short(state.clip)}, not positive")
    return problems


_UNSAFE = object()


def json_value(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON the package's strict reader reads back, or :data:`_UNSAFE`: None, a
    bool, an integer of at most 18 digits, a finite float, a string of at most
    :data:`MAX_TEXT` characters, or a list or string-keyed dict of at most :data:`MAX_ITEMS`
    such values, :data:`MAX_DEPTH` deep."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if _is_int(value):
        return int(value) if abs(int(value)) <= MAX_INT else _UNSAFE
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(float(value)) else _UNSAFE
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT and is_utf8(value) else _UNSAFE
    if depth >= MAX_DEPTH or not isinstance(value, (list, tuple, dict)) or len(value) > MAX_ITEMS:
        return _UNSAFE
    if isinstance(value, dict):
        if not all(isinstance(k, str) and len(k) <= MAX_TEXT and is_utf8(k) for k in value):
            return _UNSAFE
        out = {k: json_value(v, depth + 1) for k, v in value.items()}
        return _UNSAFE if any(v is _UNSAFE for v in out.values()) else out
    items = [json_value(v, depth + 1) for v in value]
    return _UNSAFE if any(v is _UNSAFE for v in items) else items


def recorded(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(the JSON-safe entries of values, the keys of the others)``: what the manifest records."""
    kept, left = {}, []
    for key, value in values.items():
        safe = json_value(value)
        if safe is _UNSAFE:
            left.append(key)
        else:
            kept[key] = safe
    return kept, sorted(left)


def filter_record(state: Any) -> dict[str, Any] | None:
    """The filter's statistics as the manifest records them: each value only as JSON the strict
    reader reads back (a count of more than 18 digits, a non-finite clip, a mean or standard
    deviation with a non-finite value are written as null; a served filter is checked finite
    before any of this, :func:`~exporter.sources.rllib_checks.check_policy`)."""
    if state is None:
        return None
    count = safe_value(state.n)
    with np.errstate(all="ignore"):  # the standard deviation of a count out of range is not computed
        mean = np.asarray(state.mean, np.float64)
        std = np.asarray(state.std if isinstance(count, int) else np.nan, np.float64)
    return {"class": state.kind, "source": state.source, "demean": bool(state.demean), "destd": bool(state.destd),
            "count": count, "clip": safe_value(state.clip),
            "mean": mean.tolist() if np.all(np.isfinite(mean)) else None,
            "std": std.tolist() if np.all(np.isfinite(std)) else None,
            "formula": "(x - mean) / (std + 1e-6), then clip to [-clip, clip] when clip is set"}


def safe_value(value: Any) -> Any:
    """``value`` as the strict JSON reader reads it back, else None."""
    found = json_value(value)
    return found if isinstance(found, (bool, int, float, str)) else None
