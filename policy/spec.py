"""The policy spec file (``policy.json``): load, validate, and write it back.

Every problem in a file is reported at once, each with its JSON path and what was expected::

    spec = load_spec("fixtures/cartpole_mlp")      # a directory holding policy.json, or the file
    spec.observation_space, spec.action_space, spec.model.hiddens

:data:`SCHEMA_FILE` is the file's JSON Schema (draft 2020-12), for editors and other tools; a
top-level ``"$schema"`` key naming it is accepted and ignored. The loader checks everything the
schema says, and what a schema cannot (``low <= high``, the size limits of a whole space and
model, that the weights file exists).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym

from policy_export.policy import jsonio
from policy_export.errors import SpecError, UnsupportedSpaceError, WeightsError
from policy_export.policy.layout import _MISSING, _UNEXPECTED
from policy_export.policy.spaces import _Problems, _is_int, leaves, parse_space, space_to_json

FORMAT_VERSION = 1
SPEC_FILE = "policy.json"
SCHEMA_FILE = Path(__file__).with_name("policy.schema.json")  # shipped with the package
ACTIVATIONS = ("tanh", "relu", "elu", "swish", "linear")

_TOP_REQUIRED = {"format_version", "name", "observation_space", "action_space", "model"}
_TOP_OPTIONAL = {"weights", "seed", "$schema"}  # "$schema": for editors, ignored
_MODEL_KEYS = {"hiddens", "activation", "conv_filters", "lstm"}
_LSTM_KEYS = {"cell_size", "max_seq_len", "use_prev_action", "use_prev_reward"}
# size limits, checked before TensorFlow builds anything (errors name the limit)
MAX_SPEC_BYTES = 16 << 20
MAX_LAYERS = 64
MAX_WIDTH = 1 << 16  # units of a dense layer, filters of a conv layer
MAX_KERNEL = 64  # conv kernel side and stride
MAX_LSTM_CELL = 4096
MAX_SEQ_LEN = 100_000
MAX_PARAMETERS = 1 << 28  # estimated weights of the dense layers and LSTM (1 GiB as float32)
WEIGHTS_DOCS = 'docs/spec.md, "Layer and weight names"'
_LISTED = 8  # names listed per group when a file's names do not match; the rest are counted


@dataclass(frozen=True)
class LstmConfig:
    """An LSTM after the encoder."""

    cell_size: int = 64
    max_seq_len: int = 20
    use_prev_action: bool = False
    use_prev_reward: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """The base model: conv layers (image inputs), dense layers, optional LSTM."""

    hiddens: tuple[int, ...] = (256, 256)
    activation: str = "tanh"
    conv_filters: tuple[tuple[int, tuple[int, int], int], ...] = ()
    lstm: LstmConfig | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hiddens": list(self.hiddens), "activation": self.activation}
        if self.conv_filters:
            out["conv_filters"] = [[f, list(k), s] for f, k, s in self.conv_filters]
        if self.lstm is not None:
            out["lstm"] = dict(self.lstm.__dict__)
        return out


@dataclass(frozen=True)
class PolicySpec:
    """A validated policy spec. ``weights`` is an absolute path or ``None`` (initialise from ``seed``)."""

    name: str
    observation_space: gym.Space
    action_space: gym.Space
    model: ModelConfig = field(default_factory=ModelConfig)
    weights: Path | None = None
    seed: int = 0
    format_version: int = FORMAT_VERSION

    def to_json(self, relative_to: Path | None = None) -> dict[str, Any]:
        """The spec-file object; ``weights`` is written relative to ``relative_to`` when given."""
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "name": self.name,
            "observation_space": space_to_json(self.observation_space),
            "action_space": space_to_json(self.action_space),
            "model": self.model.to_json(),
            "seed": self.seed,
        }
        if self.weights is not None:
            w = Path(self.weights)
            out["weights"] = str(w.relative_to(relative_to)) if relative_to else str(w)
        return out


def load_spec(path: str | Path) -> PolicySpec:
    """Read and validate a spec: ``path`` is a ``policy.json`` or a directory holding one. The
    weights file's names and shapes are checked against the spec's model here, before TensorFlow
    loads (:func:`check_weights_file`); its values when the policy is built.

    Raises:
        SpecError: the file is missing, is not JSON, or has problems (each with its JSON path).
        UnsupportedSpaceError: a space type the package cannot export.
        WeightsError: the weights file's names or shapes are not the model's, or the file is
            refused by the HDF5 reader.
    """
    obj, file = read_spec_json(path)
    spec = spec_from_json(obj, base_dir=file.parent, source=str(file))
    check_weights_file(spec)
    return spec


def read_spec_json(path: str | Path) -> tuple[Any, Path]:
    """The parsed JSON of a spec file (``path`` a ``policy.json`` or a directory holding one), not
    validated yet, and the file's path.

    Raises:
        SpecError: the file is missing, not a regular file, too large, unreadable or not JSON.
    """
    path = Path(path)
    file = path / SPEC_FILE if path.is_dir() else path
    if not file.is_file():
        found = file.exists() or file.is_symlink()
        raise SpecError(str(file), [("$", "not a regular file" if found else "file not found")])
    try:
        size = file.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise SpecError(str(file), [("$", f"{size} bytes exceed the limit of {MAX_SPEC_BYTES} for a spec file")])
        obj = jsonio.loads(file.read_bytes(), str(file), MAX_SPEC_BYTES)
    except OSError as e:
        raise SpecError(str(file), [("$", f"cannot be read: {e.strerror or e}")]) from e
    except jsonio.JSONError as e:
        raise SpecError(str(file), [("$", e.problem)]) from e
    return obj, file


def spec_from_json(obj: Any, base_dir: Path | None = None, source: str = "<spec>") -> PolicySpec:
    """Validate a parsed spec object; relative ``weights`` paths resolve against ``base_dir``."""
    problems = _Problems()
    if not isinstance(obj, dict):
        raise SpecError(source, [("$", "expected a JSON object at the top level")])
    for key in sorted(_TOP_REQUIRED - obj.keys()):
        problems.add(f"$.{key}", "missing (required)")
    for key in sorted(obj.keys() - _TOP_REQUIRED - _TOP_OPTIONAL):
        problems.add(f"$.{key}", f"unknown key; allowed: {', '.join(sorted(_TOP_REQUIRED | _TOP_OPTIONAL))}")

    version = obj.get("format_version")
    if "format_version" in obj and (isinstance(version, bool) or version != FORMAT_VERSION):
        problems.add("$.format_version", f"expected {FORMAT_VERSION}, got {version!r}")
    if not isinstance(obj.get("$schema", ""), str):
        problems.add("$.$schema", f"expected a string (the JSON Schema the file follows, for editors), "
                                  f"got {obj['$schema']!r}")
    name = obj.get("name")
    if "name" in obj and not (isinstance(name, str) and name.strip()):
        problems.add("$.name", f"expected a non-empty string, got {name!r}")
    seed = obj.get("seed", 0)
    if not (_is_int(seed) and 0 <= seed < 2**31):
        problems.add("$.seed", f"expected an integer in [0, 2**31), got {seed!r}")
    weights = obj.get("weights")
    weights_path = None
    if weights is not None:
        if not (isinstance(weights, str) and weights):
            problems.add("$.weights", f"expected a file path string, got {weights!r}")
        else:
            weights_path, problem = _weights_path(weights, base_dir)
            if problem is not None:
                problems.add("$.weights", problem)

    obs = parse_space(obj["observation_space"], "$.observation_space", problems) if "observation_space" in obj else None
    act = parse_space(obj["action_space"], "$.action_space", problems) if "action_space" in obj else None
    model = _parse_model(obj["model"], problems) if "model" in obj else None

    if not problems.items and model is not None:
        _check_parameters(obs, act, model, problems)
    if problems.items:
        raise SpecError(source, problems.items)
    return PolicySpec(
        name=name, observation_space=obs, action_space=act, model=model,
        weights=weights_path, seed=seed, format_version=FORMAT_VERSION,
    )


def _weights_path(weights: str, base_dir: Path | None) -> tuple[Path | None, str | None]:
    """``base_dir / weights`` if it names a regular file inside ``base_dir``, else the problem.

    The path must be relative without ``..`` parts (``.`` and repeated slashes are ignored), no component of
    it may be a symbolic link, and its real path must lie inside the real ``base_dir``: a spec
    only ever reads weights from its own directory. Without ``base_dir`` (a spec built in
    Python) the path is taken relative to the working directory, under the same rules.
    """
    rule = "must be a relative path to a file inside the spec's directory"
    if "\x00" in weights or "\\" in weights:
        return None, f"{weights!r} {rule} (no NUL or backslash characters)"
    if os.path.isabs(weights):
        return None, f"{weights!r} is an absolute path; it {rule}: copy the file next to policy.json"
    parts = [p for p in weights.split("/") if p not in ("", ".")]
    if ".." in parts:
        return None, f"{weights!r} leaves the spec's directory through '..'; it {rule}: copy the file next to policy.json"
    if not parts:
        return None, f"{weights!r} names the spec's directory itself; it {rule}"
    base = base_dir if base_dir is not None else Path.cwd()
    path = base.joinpath(*parts)
    node = base
    for part in parts:
        node = node / part
        try:
            mode = os.lstat(node).st_mode
        except FileNotFoundError:
            return (path, f"file not found: {path}") if base_dir is not None else (path, None)
        except OSError as e:
            return path, f"{node} cannot be examined: {e.strerror}"
        if stat.S_ISLNK(mode):
            return path, f"{node} is a symbolic link; the weights file {rule}, and links are not followed"
    real_base, real = os.path.realpath(base), os.path.realpath(path)
    if os.path.commonpath([real_base, real]) != real_base:
        return path, f"{weights!r} resolves to {real}, outside the spec's directory; it {rule}"
    if not stat.S_ISREG(mode):
        return path, f"{path} is not a regular file"
    return path, None


def _parse_model(obj: Any, problems: _Problems) -> ModelConfig | None:
    if not isinstance(obj, dict):
        problems.add("$.model", "expected an object")
        return None
    for key in sorted(obj.keys() - _MODEL_KEYS):
        problems.add(f"$.model.{key}", f"unknown key; allowed: {', '.join(sorted(_MODEL_KEYS))}")
    hiddens = obj.get("hiddens", [256, 256])
    if not (isinstance(hiddens, list) and all(_is_int(h) and h > 0 for h in hiddens)):
        problems.add("$.model.hiddens", f"expected a list of positive integers, got {hiddens!r}")
    elif len(hiddens) > MAX_LAYERS or any(h > MAX_WIDTH for h in hiddens):
        problems.add("$.model.hiddens", f"at most {MAX_LAYERS} layers of at most {MAX_WIDTH} units, got {hiddens!r}")
    activation = obj.get("activation", "tanh")
    if activation not in ACTIVATIONS:
        problems.add("$.model.activation", f"expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    conv = _parse_conv(obj.get("conv_filters", []), problems)
    lstm = _parse_lstm(obj["lstm"], problems) if obj.get("lstm") is not None else None
    if problems.items:
        return None
    return ModelConfig(hiddens=tuple(hiddens), activation=activation, conv_filters=conv, lstm=lstm)


def _parse_conv(obj: Any, problems: _Problems) -> tuple:
    if not isinstance(obj, list):
        problems.add("$.model.conv_filters", "expected a list of [filters, [kh, kw], stride]")
        return ()
    out = []
    for i, item in enumerate(obj):
        ok = (
            isinstance(item, list) and len(item) == 3 and _is_int(item[0]) and item[0] > 0
            and isinstance(item[1], list) and len(item[1]) == 2
            and all(_is_int(k) and k > 0 for k in item[1]) and _is_int(item[2]) and item[2] > 0
        )
        if not ok:
            problems.add(f"$.model.conv_filters[{i}]", f"expected [filters, [kh, kw], stride] of positive integers, got {item!r}")
            continue
        if item[0] > MAX_WIDTH or max(*item[1], item[2]) > MAX_KERNEL or i >= MAX_LAYERS:
            problems.add(f"$.model.conv_filters[{i}]", f"at most {MAX_LAYERS} layers of at most {MAX_WIDTH} filters, "
                                                      f"kernel sides and stride at most {MAX_KERNEL}, got {item!r}")
            continue
        out.append((item[0], (item[1][0], item[1][1]), item[2]))
    return tuple(out)


def _parse_lstm(obj: Any, problems: _Problems) -> LstmConfig | None:
    if not isinstance(obj, dict):
        problems.add("$.model.lstm", "expected an object")
        return None
    for key in sorted(obj.keys() - _LSTM_KEYS):
        problems.add(f"$.model.lstm.{key}", f"unknown key; allowed: {', '.join(sorted(_LSTM_KEYS))}")
    cfg = LstmConfig(**{k: v for k, v in obj.items() if k in _LSTM_KEYS})
    for key, limit in (("cell_size", MAX_LSTM_CELL), ("max_seq_len", MAX_SEQ_LEN)):
        v = getattr(cfg, key)
        if not (_is_int(v) and v > 0):
            problems.add(f"$.model.lstm.{key}", f"expected a positive integer, got {v!r}")
        elif v > limit:
            problems.add(f"$.model.lstm.{key}", f"{v} exceeds the limit of {limit}")
    for key in ("use_prev_action", "use_prev_reward"):
        if not isinstance(getattr(cfg, key), bool):
            problems.add(f"$.model.lstm.{key}", f"expected true or false, got {getattr(cfg, key)!r}")
    return cfg


def _input_width(space: gym.Space, conv: bool) -> int:
    """Width of the flattened, one-hot encoded observation fed to the first dense layer (images with conv: 0)."""
    width = 0
    for leaf in leaves(space):
        s = leaf.space
        if isinstance(s, gym.spaces.Discrete):
            width += int(s.n)
        elif isinstance(s, gym.spaces.MultiDiscrete):
            width += int(sum(int(v) for v in s.nvec))
        elif not (conv and len(s.shape) == 3):
            width += math.prod(int(d) for d in s.shape)
    return width


def _check_parameters(obs: gym.Space, act: gym.Space, model: ModelConfig, problems: _Problems) -> None:
    """Refuse a model whose dense and LSTM weights (estimated) exceed :data:`MAX_PARAMETERS`."""
    widths = [max(1, _input_width(obs, bool(model.conv_filters))), *model.hiddens]
    params = sum(a * b for a, b in zip(widths, widths[1:]))
    if model.lstm is not None:
        c = model.lstm.cell_size
        params += 4 * c * (c + widths[-1] + _input_width(act, False) + 1)
        widths.append(c)
    params += widths[-1] * max(1, 2 * _input_width(act, False))
    if params > MAX_PARAMETERS:
        problems.add("$.model", f"about {params} weights exceed the limit of {MAX_PARAMETERS}; use smaller layers "
                                "or a smaller observation")


def write_spec(spec: PolicySpec, directory: str | Path) -> Path:
    """Write ``policy.json`` for ``spec`` into ``directory``; return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / SPEC_FILE
    file.write_text(json.dumps(spec.to_json(relative_to=directory), indent=2) + "\n", encoding="utf-8")
    return file


# --------------------------------------------------------------------------- weights names


def with_names_hint(error: WeightsError, expected: Mapping[str, tuple[int, ...]],
                    found: Mapping[str, tuple[int, ...]]) -> WeightsError:
    """``error`` with one hint line added when the file's weight names are not the policy's.

    More than a few missing and unexpected weights are summarised: one line for each group, each
    name with its shape. Other problems (shapes, values) are kept as they are.
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if not missing and not unexpected:
        return error
    problems = list(error.problems)
    if len(missing) + len(unexpected) > 4:
        problems = [p for p in problems if not p.startswith((_MISSING, _UNEXPECTED))]
        if missing:
            problems.append(f"{len(missing)} missing weight(s), the policy's: {_listed(missing, expected)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected weight(s), the policy has no such layer weight: "
                            f"{_listed(unexpected, found)}")
    problems.append(names_hint(expected, found))
    return WeightsError(error.source, problems)


def check_weights_file(spec: PolicySpec) -> None:
    """Refuse ``spec.weights`` when its weight names or shapes are not those of the spec's model
    (:func:`policy.layout.expected_weights`), reading only the names and declared shapes (h5py,
    no TensorFlow); a file that is not HDF5 is refused here too. The values (NaN, infinities) are
    checked when the policy is built.

    Raises:
        WeightsError: every missing, unexpected and misshapen weight, with the hint of
            :func:`with_names_hint`; or what the HDF5 reader refuses (links leaving the file,
            data that is not real numbers, sizes over its limit).
    """
    from policy_export.policy import h5io
    from policy_export.policy.layout import expected_weights, weights_problems

    if spec.weights is None:
        return
    try:
        expected = expected_weights(spec)
    except (UnsupportedSpaceError, TypeError):  # a space the model cannot take (TypeError: a leaf type)
        return  # refused, as before, when the policy is built
    found = h5io.read_h5_shapes(spec.weights, expected_shapes=expected)
    problems = weights_problems(expected, found)
    if problems:
        raise with_names_hint(WeightsError(str(spec.weights), problems), expected, found)


def names_hint(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> str:
    """One line: the file's layer names against the policy's, and how to get a file with the right names."""
    ours, theirs = _layers(expected), _layers(found)
    same = len(ours) == len(theirs) and [tuple(s) for s in expected.values()] == [tuple(s) for s in found.values()]
    rename = ", ".join(f"{a} -> {b}" for a, b in zip(theirs, ours) if a != b) if same else ""
    how = ""
    if rename:
        how = f"its weights have the policy's shapes in the same order, only the names differ ({rename}): "
    return (f"hint: the file's layers ({', '.join(theirs) or 'none'}) are not the policy's ({', '.join(ours)}); "
            f"{how}name your model's layers like the policy's (Dense(..., name='fc_1')), or write a file with the "
            f"policy's names and shapes with policy_export.write_weights_template(spec, path) and fill in your "
            f"arrays; see {WEIGHTS_DOCS}")


def _layers(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    return list(dict.fromkeys(key.rpartition("/")[0] for key in shapes))


def _listed(keys: list[str], shapes: Mapping[str, tuple[int, ...]]) -> str:
    shown = ", ".join(f"{k!r} {list(shapes[k])}" for k in keys[:_LISTED])
    return shown + (f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else "")
