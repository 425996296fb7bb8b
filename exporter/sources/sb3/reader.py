"""Read a Stable-Baselines3 (or sb3-contrib) model zip, as ``model.save`` writes it, and a
``VecNormalize.save`` file, without torch, without SB3 and without running a pickle.

The zip (through :class:`policy.zipio.Archive`: plain top-level names only, each within its
limit, nothing inflated past what it declares) holds:

- ``data``: JSON (Python's, so ``NaN`` may appear). A value that is not JSON is
  ``{":type:": ..., ":serialized:": base64 of a cloudpickle, and readable shadows}``. Only the
  entries read here are decoded (``policy_class``, ``observation_space``, ``action_space``,
  ``policy_kwargs`` when pickled), through the package's restricted unpickler
  (:class:`SB3Unpickler`): SB3's, sb3-contrib's and torch's classes, gymnasium's spaces and
  cloudpickle's builders become inert records (names and arguments); numpy arrays are rebuilt;
  anything else is refused before it is resolved, and nothing is imported or run. Every other
  entry (schedules pickled as functions, buffers, the last observation) is never decoded;
- ``policy.pth``: the policy's ``state_dict``, a ``torch.save`` archive read by
  :mod:`exporter.sources.torchfile` (dtypes from the storages' class names, every view checked);
- ``_stable_baselines3_version``; and files not read (the optimizers' ``*.pth``,
  ``pytorch_variables.pth``, ``system_info.txt``).

The zip never names its algorithm: the policy class does (:data:`POLICIES`), and the algorithm
is told from the hyperparameters ``data`` holds (:func:`algorithm_name`; DDPG is TD3 with a
policy delay of 1 and its target noise clipped to 0, and acts exactly as TD3). Policy keywords are taken from
``policy_kwargs`` where given, else the defaults SB3 2.x gives each policy
(:data:`FAMILY_DEFAULTS`); layer sizes are read from the weights' shapes.

``vec_normalize.pkl`` (:func:`read_vec_normalize`) is a pickle of the ``VecNormalize`` wrapper:
its ``obs_rms`` (mean and var, one per normalised key of a Dict observation), ``clip_obs``,
``epsilon``, ``norm_obs`` and ``norm_obs_keys`` are read, checked against the observation space.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import ExportError, UnsafeCheckpointError
from policy_export.exporter.sources.pickled_spaces import space_of
from policy_export.exporter.sources.safe_pickle import (
    INERT_NAMES, ReadBudget, Record, RestrictedUnpickler, loads, reading, short_repr,
)
from policy_export.exporter.sources.torchfile import read_state_dict
from policy_export.exporter.sources.torch_layers import TORCH_ACTIVATIONS
from policy_export.policy import jsonio
from policy_export.policy.files import read_regular
from policy_export.policy.zipio import Archive

MEMBER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")  # a top-level name, as model.save writes them
MAX_MEMBERS = 64
DATA_LIMIT = 64 << 20  # bytes of ``data``
PTH_LIMIT = 1 << 30  # bytes of one .pth member
TEXT_LIMIT = 1 << 20  # bytes of a text member
ZIP_LIMIT = 4 << 30  # bytes of every member together
SERIALIZED_LIMIT = 16 << 20  # bytes of one base64 ``:serialized:`` value
VEC_NORMALIZE_LIMIT = 256 << 20  # bytes of vec_normalize.pkl

# the policy classes rebuilt here (as a zip's ``policy_class`` names them) -> their family
_SB3, _CONTRIB = "stable_baselines3.", "sb3_contrib."
POLICIES = {
    **{f"{_SB3}common.policies.{c}": "actor_critic"
       for c in ("ActorCriticPolicy", "ActorCriticCnnPolicy", "MultiInputActorCriticPolicy")},
    **{f"{_CONTRIB}common.maskable.policies.{c}": "maskable"
       for c in ("MaskableActorCriticPolicy", "MaskableActorCriticCnnPolicy", "MaskableMultiInputActorCriticPolicy")},
    **{f"{_CONTRIB}common.recurrent.policies.{c}": "recurrent"
       for c in ("RecurrentActorCriticPolicy", "RecurrentActorCriticCnnPolicy",
                 "RecurrentMultiInputActorCriticPolicy")},
    **{f"{_SB3}dqn.policies.{c}": "dqn" for c in ("DQNPolicy", "CnnPolicy", "MultiInputPolicy")},
    **{f"{_CONTRIB}qrdqn.policies.{c}": "qrdqn" for c in ("QRDQNPolicy", "CnnPolicy", "MultiInputPolicy")},
    **{f"{_SB3}sac.policies.{c}": "sac" for c in ("SACPolicy", "CnnPolicy", "MultiInputPolicy")},
    **{f"{_CONTRIB}tqc.policies.{c}": "sac" for c in ("TQCPolicy", "CnnPolicy", "MultiInputPolicy")},
    **{f"{_SB3}td3.policies.{c}": "td3" for c in ("TD3Policy", "CnnPolicy", "MultiInputPolicy")},
}
EXTRACTORS = {f"{_SB3}common.torch_layers.{c}": c for c in ("FlattenExtractor", "NatureCNN", "CombinedExtractor")}
# what SB3 2.x gives a policy the user did not configure: activation, sharing of the features
# extractor between actor and critic, log_std's initial value (irrelevant once trained)
FAMILY_DEFAULTS = {
    "actor_critic": {"activation_fn": "Tanh", "share_features_extractor": True},
    "maskable": {"activation_fn": "Tanh", "share_features_extractor": True},
    "recurrent": {"activation_fn": "Tanh", "share_features_extractor": True, "lstm_hidden_size": 256,
                  "n_lstm_layers": 1, "shared_lstm": False, "enable_critic_lstm": True},
    "dqn": {"activation_fn": "ReLU"}, "qrdqn": {"activation_fn": "ReLU", "n_quantiles": 200},
    "sac": {"activation_fn": "ReLU", "share_features_extractor": False, "clip_mean": 2.0},
    "td3": {"activation_fn": "ReLU", "share_features_extractor": False},
}
# policy_kwargs SB3's policies take; another is refused (it would have changed the network in a
# way this package does not know)
KNOWN_KWARGS = {
    "net_arch", "activation_fn", "ortho_init", "use_sde", "log_std_init", "full_std", "use_expln", "squash_output",
    "features_extractor_class", "features_extractor_kwargs", "share_features_extractor", "normalize_images",
    "optimizer_class", "optimizer_kwargs", "n_critics", "n_quantiles", "lstm_hidden_size", "n_lstm_layers",
    "shared_lstm", "enable_critic_lstm", "lstm_kwargs", "clip_mean", "sde_net_arch",
}
NOT_NETWORK = {"ortho_init", "optimizer_class", "optimizer_kwargs", "n_critics", "net_arch", "sde_net_arch"}
SUPPORTED = ("SB3's PPO, A2C, DQN, SAC, TD3 and DDPG, sb3-contrib's RecurrentPPO, MaskablePPO, QR-DQN, TQC and "
             "TRPO, with their MlpPolicy, CnnPolicy (NatureCNN) and MultiInputPolicy (CombinedExtractor)")
OTHERWISE = ("to export another policy, write its forward pass as a policy.json spec with its weights, or export "
             "it with torch.onnx and check that file against SB3's own outputs with "
             "`policy-export verify MODEL.onnx --reference REF.npz`")


class SB3Unpickler(RestrictedUnpickler):
    """The restricted unpickler for a zip's ``:serialized:`` values and ``vec_normalize.pkl``."""

    inert_prefixes = (_SB3, _CONTRIB, "torch.", "gymnasium.spaces.", "gym.spaces.", "cloudpickle.")
    inert_names = frozenset(INERT_NAMES | {("collections", "deque"), ("builtins", "type")})
    allowed_text = ("numpy arrays and dtypes, collections, builtin numbers; Stable-Baselines3's, sb3-contrib's and "
                    "torch's classes, gymnasium's spaces and cloudpickle's builders only as inert records")


@dataclass
class VecNormalizeStats:
    """What ``VecNormalize.normalize_obs`` does: per key (None: the whole observation) the
    running mean and variance, then a clip to ``[-clip_obs, clip_obs]``."""

    stats: dict[str | None, tuple[np.ndarray, np.ndarray]]
    clip_obs: float
    epsilon: float
    path: str = ""

    def record(self) -> dict[str, Any]:
        return {"file": self.path, "keys": [k for k in self.stats if k is not None] or None,
                "clip_obs": self.clip_obs, "epsilon": self.epsilon}


@dataclass
class SB3Model:
    """A model zip read and checked (no TensorFlow, torch or SB3)."""

    path: Path
    sb3_version: str
    policy_class: str
    family: str
    algorithm: str
    observation_space: gym.Space
    action_space: gym.Space
    kwargs: dict[str, Any]  # the policy's keywords that shape what it computes, defaults filled in
    extractor: str  # FlattenExtractor, NatureCNN or CombinedExtractor
    extractor_kwargs: dict[str, Any]
    use_sde: bool
    weights: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    vec_normalize: VecNormalizeStats | None = None

    @property
    def activation(self):
        return TORCH_ACTIVATIONS[self.kwargs["activation_fn"]]


# ----------------------------------------------------------------------------- the zip

def _limit(name: str) -> int:
    if name == "data":
        return DATA_LIMIT
    return PTH_LIMIT if name.endswith(".pth") else TEXT_LIMIT


def open_zip(path: Path) -> Archive:
    """The zip archive at ``path``, checked (:class:`~policy.zipio.Archive`), holding ``data`` and ``policy.pth``.

    Raises:
        UnsafeCheckpointError: not such an archive.
    """
    archive = Archive(path, str(path), allowed=lambda name: MEMBER.fullmatch(name) is not None,
                      max_members=MAX_MEMBERS, limit=_limit, total=ZIP_LIMIT, error=UnsafeCheckpointError)
    missing = [n for n in ("data", "policy.pth") if n not in archive]
    if missing:
        archive.close()
        raise UnsafeCheckpointError(f"{path} is a zip archive without {' and '.join(missing)}: not a model "
                                    "Stable-Baselines3's model.save wrote")
    return archive


def read_sb3(path: str | Path, vec_normalize: str | Path | None = None, *, weights: bool = True,
             budget: ReadBudget | None = None) -> SB3Model:
    """Read a model zip (and ``vec_normalize``) within ``budget``; the weights unless ``weights`` is false.

    Raises:
        UnsafeCheckpointError: anything refused, unreadable or over budget. ExportError: a policy,
            space or setting that is not rebuilt (named, with what is).
    """
    path = Path(path)
    with reading(budget):
        with open_zip(path) as archive:
            where = f"{path}:data"
            try:
                data = jsonio.loads(archive.read("data"), where, DATA_LIMIT, constants=True)
            except jsonio.JSONError as e:
                raise UnsafeCheckpointError(f"{where} is not JSON as model.save writes it: {e.problem[:200]}") from None
            if not isinstance(data, dict):
                raise UnsafeCheckpointError(f"{where} is not a JSON object")
            version = _text(archive, "_stable_baselines3_version") or "?"
            model = _model(path, data, version)
            if weights:
                model.weights = read_state_dict(archive.read("policy.pth"), f"{path}:policy.pth")
        if vec_normalize is not None:
            model.vec_normalize = read_vec_normalize(vec_normalize, model.observation_space)
    return model


def _text(archive: Archive, name: str) -> str | None:
    if name not in archive:
        return None
    raw = archive.read(name)[:64].decode("utf-8", "replace").strip()
    return raw if re.fullmatch(r"[0-9A-Za-z.+\-_]{1,40}", raw) else "?"


def _serialized(data: dict[str, Any], key: str, where: str, required: bool = True) -> Any:
    """The value of ``data[key]``: itself when it is plain JSON, else its ``:serialized:`` pickle
    read by :class:`SB3Unpickler`."""
    if key not in data:
        if required:
            raise UnsafeCheckpointError(f"{where} holds no {key!r}")
        return None
    value = data[key]
    if not (isinstance(value, dict) and ":serialized:" in value):
        return value
    text = value[":serialized:"]
    if not isinstance(text, str) or len(text) > SERIALIZED_LIMIT:
        raise UnsafeCheckpointError(f"{where}: {key} is not a serialized value of at most {SERIALIZED_LIMIT >> 20} MiB")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise UnsafeCheckpointError(f"{where}: {key}'s serialized value is not base64") from None
    return loads(raw, f"{where} ({key})", unpickler=SB3Unpickler)


def _class_ref(value: Any, what: str, where: str) -> str:
    """The dotted name of a pickled class (a record of it); a class pickled by value (a class of
    the user's own, its code in the file, not run) is refused naming it."""
    if isinstance(value, type) and issubclass(value, Record):
        if value.by_value:
            raise ExportError(f"{where}: {what} is a class of your own, pickled with its code (not run); "
                              f"this package rebuilds {SUPPORTED}; {OTHERWISE}")
        return value.ref
    if isinstance(value, Record) and type(value).ref.endswith("._make_skeleton_class"):
        name = value.args[1] if len(value.args) > 1 and isinstance(value.args[1], str) else "?"
        raise ExportError(f"{where}: {what} is {name[:80]}, a class of your own pickled with its code (not run); "
                          f"this package rebuilds {SUPPORTED}; {OTHERWISE}")
    raise UnsafeCheckpointError(f"{where}: {what} is {short_repr(value)}, not a class reference")


def _model(path: Path, data: dict[str, Any], version: str) -> SB3Model:
    where = f"{path}:data"
    try:
        policy_class = _class_ref(_serialized(data, "policy_class", where), "policy_class", where)
    except UnsafeCheckpointError as e:
        if "is not on the allowlist" not in str(e):
            raise
        raise ExportError(f"{where}: its policy class is not one of Stable-Baselines3's or sb3-contrib's ({e}); "
                          f"this package rebuilds {SUPPORTED}; {OTHERWISE}") from None
    family = POLICIES.get(policy_class)
    if family is None:
        raise ExportError(f"{where}: policy class {policy_class[:120]} is not rebuilt; this package rebuilds "
                          f"{SUPPORTED}; {OTHERWISE}")
    observation_space = space_of(_serialized(data, "observation_space", where), f"{where} (observation_space)")
    action_space = space_of(_serialized(data, "action_space", where), f"{where} (action_space)")
    kwargs = _policy_kwargs(_serialized(data, "policy_kwargs", where, required=False), family, where)
    use_sde = _flag(data.get("use_sde", False), "use_sde", where)
    kwargs.setdefault("use_sde", use_sde)
    extractor, extractor_kwargs = _extractor(kwargs, policy_class, observation_space, where)
    _check_spaces(family, observation_space, action_space, where)
    return SB3Model(path=path, sb3_version=version, policy_class=policy_class, family=family,
                    algorithm=algorithm_name(family, data), observation_space=observation_space,
                    action_space=action_space, kwargs=kwargs, extractor=extractor, extractor_kwargs=extractor_kwargs,
                    use_sde=bool(kwargs["use_sde"]))


def algorithm_name(family: str, data: dict[str, Any]) -> str:
    """The algorithm, told from the policy's family and the hyperparameters ``data`` holds."""
    if family == "actor_critic":
        if "cg_max_steps" in data:
            return "TRPO"
        return "PPO" if "n_epochs" in data and "clip_range" in data else "A2C"
    if family == "td3":
        # DDPG is TD3 with the policy updated every step and the target noise clipped to nothing
        delay, clip = data.get("policy_delay"), data.get("target_noise_clip")
        return "DDPG" if delay == 1 and clip in (0, 0.0) else "TD3"
    if family == "sac":
        return "TQC" if "top_quantiles_to_drop_per_net" in data else "SAC"
    return {"maskable": "MaskablePPO", "recurrent": "RecurrentPPO", "dqn": "DQN", "qrdqn": "QR-DQN"}[family]


def _flag(value: Any, what: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise UnsafeCheckpointError(f"{where}: {what} is {short_repr(value, 40)}, not true or false")
    return value


def _whole(value: Any, what: str, where: str, low: int = 1, high: int = 1 << 16) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        raise UnsafeCheckpointError(f"{where}: {what} is {short_repr(value, 40)}, not a whole number from {low} to {high}")
    return value


def _number(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise UnsafeCheckpointError(f"{where}: {what} is {short_repr(value, 40)}, not a finite number")
    return float(value)


def _policy_kwargs(raw: Any, family: str, where: str) -> dict[str, Any]:
    """The keywords that shape what the policy computes: SB3's defaults, then the zip's."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise UnsafeCheckpointError(f"{where}: policy_kwargs is {short_repr(raw)}, not a dict of keywords")
    unknown = sorted(set(raw) - KNOWN_KWARGS)
    if unknown:
        raise ExportError(f"{where}: policy_kwargs {', '.join(k[:40] for k in unknown)} is not a keyword of SB3's "
                          f"policies rebuilt here; this package rebuilds {SUPPORTED}; {OTHERWISE}")
    kwargs: dict[str, Any] = dict(FAMILY_DEFAULTS[family])
    for key, value in raw.items():
        if key in ("optimizer_class", "optimizer_kwargs", "ortho_init", "n_critics", "sde_net_arch"):
            continue  # training only
        if key == "activation_fn":
            ref = _class_ref(value, "policy_kwargs activation_fn", where)
            name = ref.rsplit(".", 1)[-1]
            if not ref.startswith("torch.nn.modules.") or name not in TORCH_ACTIVATIONS:
                raise ExportError(f"{where}: activation_fn {ref[:120]} is not an activation rebuilt here (torch.nn's "
                                  f"{', '.join(k for k in TORCH_ACTIVATIONS if k and k[0].isupper())})")
            kwargs[key] = name
        elif key in ("features_extractor_class",):
            kwargs[key] = _class_ref(value, "policy_kwargs features_extractor_class", where)
        elif key in ("features_extractor_kwargs", "lstm_kwargs"):
            if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                raise UnsafeCheckpointError(f"{where}: policy_kwargs {key} is {short_repr(value)}, not keywords")
            kwargs[key] = dict(value or {})
        elif key in ("use_sde", "full_std", "use_expln", "squash_output", "share_features_extractor",
                     "normalize_images", "shared_lstm", "enable_critic_lstm"):
            kwargs[key] = _flag(value, f"policy_kwargs {key}", where)
        elif key in ("lstm_hidden_size",):
            kwargs[key] = _whole(value, f"policy_kwargs {key}", where)
        elif key in ("n_lstm_layers",):
            kwargs[key] = _whole(value, f"policy_kwargs {key}", where, 1, 64)
        elif key == "n_quantiles":
            kwargs[key] = _whole(value, f"policy_kwargs {key}", where, 1, 4096)
        elif key in ("log_std_init", "clip_mean"):
            kwargs[key] = _number(value, f"policy_kwargs {key}", where)
        elif key == "net_arch":
            kwargs[key] = _net_arch(value, where)
    if kwargs.get("lstm_kwargs") and set(kwargs["lstm_kwargs"]) - {"dropout"}:
        raise ExportError(f"{where}: lstm_kwargs {', '.join(sorted(kwargs['lstm_kwargs']))[:120]} change the LSTM "
                          "this package rebuilds (torch's nn.LSTM with both biases, inputs time first)")
    return kwargs


def _net_arch(value: Any, where: str) -> Any:
    """``net_arch`` as SB3 takes it (a list of sizes, or a dict of lists), checked; the network's
    sizes are then read from the weights, which must agree."""
    def sizes(v: Any, what: str) -> list[int]:
        if not isinstance(v, list) or len(v) > 64:
            raise UnsafeCheckpointError(f"{where}: policy_kwargs {what} is {short_repr(v)}, not a list of layer sizes")
        return [_whole(s, f"policy_kwargs {what}", where) for s in v]

    if isinstance(value, dict):
        if not set(value) <= {"pi", "vf", "qf"}:
            raise UnsafeCheckpointError(f"{where}: policy_kwargs net_arch has keys {short_repr(sorted(value))}; "
                                        "SB3 takes pi, vf and qf")
        return {k: sizes(v, f"net_arch {k}") for k, v in value.items()}
    return sizes(value, "net_arch")


def _extractor(kwargs: dict[str, Any], policy_class: str, space: gym.Space, where: str) -> tuple[str, dict[str, Any]]:
    """The features extractor (SB3's own only) and its keywords."""
    ref = kwargs.get("features_extractor_class")
    if ref is None:
        name = policy_class.rsplit(".", 1)[-1]
        extractor = "CombinedExtractor" if "MultiInput" in name else "NatureCNN" if "Cnn" in name else "FlattenExtractor"
    elif ref in EXTRACTORS:
        extractor = EXTRACTORS[ref]
    else:
        raise ExportError(f"{where}: features_extractor_class {ref[:120]} is not one of SB3's own "
                          f"(FlattenExtractor, NatureCNN, CombinedExtractor); this package rebuilds {SUPPORTED}; "
                          f"{OTHERWISE}")
    options = dict(kwargs.get("features_extractor_kwargs") or {})
    allowed = {"FlattenExtractor": set(), "NatureCNN": {"features_dim", "normalized_image"},
               "CombinedExtractor": {"cnn_output_dim", "normalized_image"}}[extractor]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ExportError(f"{where}: features_extractor_kwargs {', '.join(k[:40] for k in unknown)} is not taken by "
                          f"{extractor}")
    for key in ("features_dim", "cnn_output_dim"):
        if key in options:
            _whole(options[key], f"features_extractor_kwargs {key}", where)
    if "normalized_image" in options:
        _flag(options["normalized_image"], "features_extractor_kwargs normalized_image", where)
    if extractor == "CombinedExtractor" and not isinstance(space, gym.spaces.Dict):
        raise ExportError(f"{where}: CombinedExtractor over {space}, which is not a Dict observation")
    return extractor, options


OBSERVATION_LEAVES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)
ACTION_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)


def _check_spaces(family: str, observation: gym.Space, action: gym.Space, where: str) -> None:
    parts = list(observation.spaces.values()) if isinstance(observation, gym.spaces.Dict) else [observation]
    for part in parts:
        if not isinstance(part, OBSERVATION_LEAVES):
            raise ExportError(f"{where}: observations {part} are not a space SB3's preprocessing takes "
                              "(Box, Discrete, MultiDiscrete, MultiBinary, or a Dict of them)")
        if isinstance(part, gym.spaces.Discrete) and int(part.start) != 0:
            raise ExportError(f"{where}: a Discrete observation starting at {int(part.start)}; SB3 one-hot encodes "
                              "from 0")
    if not isinstance(action, ACTION_SPACES):
        raise ExportError(f"{where}: actions {action} are not a space SB3's policies act in")
    wanted = {"dqn": gym.spaces.Discrete, "qrdqn": gym.spaces.Discrete, "sac": gym.spaces.Box, "td3": gym.spaces.Box}
    if family in wanted and not isinstance(action, wanted[family]):
        raise ExportError(f"{where}: a {family} policy acting in {action}; it acts in {wanted[family].__name__} spaces")
    if isinstance(action, gym.spaces.Box) and not np.issubdtype(action.dtype, np.floating):
        raise ExportError(f"{where}: Box actions of dtype {action.dtype}; float Box actions are rebuilt")
    if isinstance(action, gym.spaces.Discrete) and int(action.start) != 0:
        raise ExportError(f"{where}: Discrete actions starting at {int(action.start)}; SB3 acts from 0")


# ----------------------------------------------------------------------------- VecNormalize

def read_vec_normalize(path: str | Path, space: gym.Space, budget: ReadBudget | None = None) -> VecNormalizeStats:
    """The observation statistics of a ``VecNormalize.save`` file, checked against ``space``.

    Raises:
        UnsafeCheckpointError: not such a file, anything refused. ExportError: statistics that do
            not fit the observations.
    """
    path = Path(path)
    where = str(path)
    try:
        raw = read_regular(path, VEC_NORMALIZE_LIMIT, UnsafeCheckpointError)
    except FileNotFoundError:
        raise UnsafeCheckpointError(f"--vec-normalize {path}: no such file") from None
    except OSError as e:
        raise UnsafeCheckpointError(f"--vec-normalize {path}: cannot be read ({e.strerror}; a symbolic link is never "
                                    "followed)") from None
    with reading(budget):
        wrapper = loads(raw, where, unpickler=SB3Unpickler)
    if not (isinstance(wrapper, Record) and type(wrapper).ref.endswith("vec_normalize.VecNormalize")):
        raise UnsafeCheckpointError(f"{where} holds {short_repr(wrapper)}, not a VecNormalize")
    state = wrapper.fields()
    clip = _number(state.get("clip_obs"), "clip_obs", where)
    epsilon = _number(state.get("epsilon"), "epsilon", where)
    if clip <= 0 or epsilon < 0:
        raise UnsafeCheckpointError(f"{where}: clip_obs {clip} and epsilon {epsilon}; a positive clip and a "
                                    "non-negative epsilon are rebuilt")
    if not _flag(state.get("norm_obs", True), "norm_obs", where):
        return VecNormalizeStats({}, clip, epsilon, where)
    rms = state.get("obs_rms")
    if isinstance(space, gym.spaces.Dict):
        keys = state.get("norm_obs_keys")
        keys = list(space.spaces) if keys is None else keys
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or not isinstance(rms, dict):
            raise UnsafeCheckpointError(f"{where}: norm_obs_keys and obs_rms are not a list of keys and their statistics")
        stats = {}
        for key in keys:
            if key not in space.spaces or key not in rms:
                raise ExportError(f"{where}: normalises observation key {key[:40]!r}, which the model's observations "
                                  f"({', '.join(space.spaces)}) or the statistics do not hold")
            stats[key] = _running(rms[key], space.spaces[key], f"{where} ({key})")
    else:
        stats = {None: _running(rms, space, where)}
    return VecNormalizeStats(stats, clip, epsilon, where)


def _running(record: Any, space: gym.Space, where: str) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(record, Record) and type(record).ref.endswith("running_mean_std.RunningMeanStd")):
        raise UnsafeCheckpointError(f"{where}: obs_rms is {short_repr(record)}, not a RunningMeanStd")
    f = record.fields()
    mean, var = f.get("mean"), f.get("var")
    if not (isinstance(mean, np.ndarray) and isinstance(var, np.ndarray) and mean.dtype.kind == "f"
            and var.dtype.kind == "f"):
        raise UnsafeCheckpointError(f"{where}: the running mean and var are not float arrays")
    if not isinstance(space, gym.spaces.Box) or mean.shape != space.shape or var.shape != space.shape:
        raise ExportError(f"{where}: statistics of shape {list(mean.shape)} for observations {space}; VecNormalize "
                          "normalises Box observations of the statistics' shape")
    if not (np.isfinite(mean).all() and np.isfinite(var).all() and (var >= 0).all()):
        raise UnsafeCheckpointError(f"{where}: the running mean or var holds NaN, Inf or a negative variance")
    return mean.astype(np.float64), var.astype(np.float64)
