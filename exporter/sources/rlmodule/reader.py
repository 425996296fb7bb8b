"""Read what RLlib's new API stack writes (ray >= 2.40: torch RLModules), without ray, without torch
and without running a pickle.

Three layouts are read, each as RLlib's ``Checkpointable.save_to_path`` writes it:

- an **Algorithm** checkpoint (``algo.save_to_path(...)``): ``rllib_checkpoint.json``, the
  modules under ``learner_group/learner/rl_module/<module id>/``, and the env runner's connector
  pipelines under ``env_runner/env_to_module_connector/`` and ``env_runner/module_to_env_connector/``;
- a **MultiRLModule** directory (``MultiRLModule.save_to_path``): ``metadata.json``,
  ``class_and_ctor_args.pkl`` and one folder per module id;
- one **RLModule** directory (``RLModule.save_to_path``): ``metadata.json``,
  ``class_and_ctor_args.pkl`` and the weights.

Per module: ``class_and_ctor_args.pkl`` (the module class, its spaces, its ``model_config`` as
given, its catalog class) and ``module_state.pkl`` (``module_state.pt`` in ray 2.40, a
cloudpickle file too: a torch ``state_dict`` as numpy arrays). Every pickle goes through
:mod:`exporter.sources.safe_pickle`: numpy arrays and dtypes, ``OrderedDict`` and builtin numbers
are rebuilt; RLlib's classes, gymnasium's spaces, numpy's random generators and ``torch.device``
are kept as inert records (names and arguments); anything else is refused before it is resolved.
Only the files named here are opened, each a regular file inside the checkpoint (no link), at
most :data:`STATE_LIMIT` bytes, within one :class:`~exporter.sources.safe_pickle.ReadBudget`.

From the connector pipelines (an Algorithm checkpoint only): the connectors in order (each must be
one this package knows, see :data:`ENV_TO_MODULE` and :data:`MODULE_TO_ENV`), the
``MeanStdFilter``'s statistics (``MeanStdFilter/state.pkl``), the observation space the
environment gives (the pipeline's input space), and ``normalize_actions``/``clip_actions`` of
``NormalizeAndClipActions``.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import ExportError, UnsafeCheckpointError
from policy_export.exporter.sources.checkpoint import (
    MALFORMED, FilterState, _filter_state, _numeric, _read_inside,
)
from policy_export.exporter.sources.pickled_spaces import space_of
from policy_export.exporter.sources.safe_pickle import ReadBudget, Record, loads, reading, short_repr
from policy_export.policy import jsonio

JSON_LIMIT = 1 << 20
STATE_LIMIT = 1 << 30  # bytes of one weights file
ARGS_LIMIT = 64 << 20  # bytes of one class_and_ctor_args.pkl
MAX_MODULES = 4096
AGENT_ID_CHARS = 128  # an agent id that names a filter's statistics
MODULE_ID = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.\-]{1,128}")
CHECKPOINT_VERSIONS = ("2.0", "2.1")  # ray 2.40 writes 2.0, ray 2.60 2.1
MODULE_ROOT = ("learner_group", "learner", "rl_module")

# the default modules this package rebuilds: class -> family (ray 2.40's names, then 2.4x-2.60's)
MODULES = {
    "ray.rllib.algorithms.ppo.torch.ppo_torch_rl_module.PPOTorchRLModule": "ppo",
    "ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module.DefaultPPOTorchRLModule": "ppo",
    "ray.rllib.algorithms.appo.torch.appo_torch_rl_module.APPOTorchRLModule": "ppo",
    "ray.rllib.algorithms.appo.torch.default_appo_torch_rl_module.DefaultAPPOTorchRLModule": "ppo",
    "ray.rllib.algorithms.dqn.torch.dqn_rainbow_torch_rl_module.DQNRainbowTorchRLModule": "dqn",
    "ray.rllib.algorithms.dqn.torch.default_dqn_torch_rl_module.DefaultDQNTorchRLModule": "dqn",
    "ray.rllib.algorithms.sac.torch.sac_torch_rl_module.SACTorchRLModule": "sac",
    "ray.rllib.algorithms.sac.torch.default_sac_torch_rl_module.DefaultSACTorchRLModule": "sac",
}
# the catalogs that build those modules (a catalog of the user's own may build another network)
CATALOGS = {
    "ray.rllib.algorithms.ppo.ppo_catalog.PPOCatalog", "ray.rllib.algorithms.appo.appo_catalog.APPOCatalog",
    "ray.rllib.algorithms.impala.impala_catalog.IMPALACatalog", "ray.rllib.algorithms.dqn.dqn_catalog.DQNCatalog",
    "ray.rllib.algorithms.dqn.dqn_rainbow_catalog.DQNRainbowCatalog", "ray.rllib.algorithms.sac.sac_catalog.SACCatalog",
}
MULTI_MODULE = "ray.rllib.core.rl_module.multi_rl_module.MultiRLModule"
# RLlib's DefaultModelConfig (ray.rllib.core.rl_module.default_model_config), the keys read here; a
# checkpoint stores only what differs from it (and its algorithm's own keys)
DEFAULT_MODEL_CONFIG = {
    "fcnet_hiddens": [256, 256], "fcnet_activation": "tanh", "fcnet_use_layernorm": False,
    "head_fcnet_hiddens": [], "head_fcnet_activation": "relu", "head_fcnet_use_layernorm": False,
    "free_log_std": False, "log_std_clip_param": 20.0, "vf_share_layers": True, "use_lstm": False,
    "max_seq_len": 20, "lstm_cell_size": 256, "lstm_use_prev_action": False, "lstm_use_prev_reward": False,
    "dueling": True, "double_q": True, "num_atoms": 1, "v_min": -10.0, "v_max": 10.0, "noisy": False,
}
# what each of those keys must hold, checked when the module is read (a file's value of another
# type is refused there, naming the key, before anything formats or uses it): layer sizes, an
# activation's name, a switch, a whole number in a range, a finite number
SIZE_LIMIT, LAYERS_LIMIT = 1 << 16, 64  # units of one layer; layers of one MLP
MODEL_CONFIG_KINDS = {
    "fcnet_hiddens": "sizes", "head_fcnet_hiddens": "sizes", "fcnet_activation": "name",
    "head_fcnet_activation": "name", "fcnet_use_layernorm": "flag", "head_fcnet_use_layernorm": "flag",
    "free_log_std": "flag", "vf_share_layers": "flag", "use_lstm": "flag", "lstm_use_prev_action": "flag",
    "lstm_use_prev_reward": "flag", "dueling": "flag", "double_q": "flag", "noisy": "flag",
    "max_seq_len": (1, 1 << 20), "lstm_cell_size": (1, SIZE_LIMIT), "num_atoms": (1, 4096),
    "log_std_clip_param": "number", "v_min": "number", "v_max": "number",
}


def check_model_config(config: dict[str, Any], where: str) -> None:
    """Refuse a ``model_config`` value of a key this package reads (:data:`MODEL_CONFIG_KINDS`)
    that is not of its kind; other keys are not read (they are shown by ``inspect``, within the
    size every pickled value is held to).

    Raises:
        UnsafeCheckpointError: naming the key and what it must be.
    """
    for key, kind in MODEL_CONFIG_KINDS.items():
        if key not in config:
            continue
        value = config[key]
        integer = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        if kind == "sizes":
            ok = isinstance(value, (list, tuple)) and len(value) <= LAYERS_LIMIT and all(
                isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and 0 < v <= SIZE_LIMIT
                for v in value)
            what = f"a list of at most {LAYERS_LIMIT} layer sizes (whole numbers from 1 to {SIZE_LIMIT})"
        elif kind == "name":
            ok = value is None or (isinstance(value, str) and 0 < len(value) <= 64)
            what = "an activation's name"
        elif kind == "flag":
            ok = isinstance(value, (bool, np.bool_))
            what = "true or false"
        elif kind == "number":
            ok = (integer and abs(int(value)) < 1 << 53) or (isinstance(value, (float, np.floating))
                                                              and np.isfinite(value))
            what = "a finite number"
        else:
            low, high = kind
            ok = integer and low <= value <= high
            what = f"a whole number from {low} to {high}"
        if not ok:
            raise UnsafeCheckpointError(f"{where}: model_config {key} is {short_repr(value, 40)}, not {what}")


# env-to-module connectors that leave the observation as it is (batching, time axis, state,
# tensors, agent-to-module routing), and the one that changes it and is rebuilt in the graph
_COMMON = "ray.rllib.connectors.common."
ENV_TO_MODULE = {
    _COMMON + "add_observations_from_episodes_to_batch.AddObservationsFromEpisodesToBatch": None,
    _COMMON + "add_time_dim_to_batch_and_zero_pad.AddTimeDimToBatchAndZeroPad": None,
    _COMMON + "add_states_from_episodes_to_batch.AddStatesFromEpisodesToBatch": None,
    _COMMON + "batch_individual_items.BatchIndividualItems": None,
    _COMMON + "numpy_to_tensor.NumpyToTensor": None,
    _COMMON + "agent_to_module_mapping.AgentToModuleMapping": None,
    "ray.rllib.connectors.env_to_module.mean_std_filter.MeanStdFilter": "MeanStdFilter",
    _COMMON + "flatten_observations.FlattenObservations": "FlattenObservations",
    "ray.rllib.connectors.env_to_module.flatten_observations.FlattenObservations": "FlattenObservations",
}
MODULE_TO_ENV = {
    "ray.rllib.connectors.module_to_env.get_actions.GetActions",
    _COMMON + "tensor_to_numpy.TensorToNumpy",
    "ray.rllib.connectors.module_to_env.unbatch_to_individual_items.UnBatchToIndividualItems",
    _COMMON + "module_to_agent_unmapping.ModuleToAgentUnmapping",
    "ray.rllib.connectors.module_to_env.remove_single_ts_time_rank_from_batch.RemoveSingleTsTimeRankFromBatch",
    "ray.rllib.connectors.module_to_env.normalize_and_clip_actions.NormalizeAndClipActions",
    "ray.rllib.connectors.module_to_env.listify_data_for_vector_env.ListifyDataForVectorEnv",
}
SUPPORTED = ("RLlib's default modules of PPO, APPO, IMPALA (an MLP or LSTM encoder, separate or shared "
             "value branch), DQN (dueling, double-Q, distributional) and SAC, built by their own catalogs")
OTHERWISE = ("to export another module, write its forward pass as a policy.json spec (or a TF graph) with the "
             "checkpoint's weights, or export it with torch.onnx and check that model with "
             "`policy-export verify --candidate onnx=model.onnx` against an export of the same policy")


@dataclass
class ModuleSpec:
    """One module of a checkpoint: read and checked, its weights read only when asked."""

    module_id: str
    module_class: str
    family: str | None  # "ppo", "dqn", "sac"; None: not a module this package rebuilds
    catalog_class: str | None
    observation_space: gym.Space  # the module's input space (after the env-to-module connectors)
    action_space: gym.Space
    model_config: dict[str, Any]  # as stored: only what the user gave (and the algorithm's own keys)
    inference_only: bool
    directory: tuple[str, ...]  # the module's folder, inside the checkpoint
    state_file: str
    root: Path = field(repr=False, default=Path("."))

    def weights(self, budget: ReadBudget | None = None) -> dict[str, np.ndarray]:
        """The module's ``state_dict`` (torch key -> numpy array), read now."""
        where = self.root.joinpath(*self.directory, self.state_file)
        try:
            with reading(budget):
                state = loads(_read_inside(self.root, (*self.directory, self.state_file), STATE_LIMIT), str(where))
        except UnsafeCheckpointError:
            raise
        except MALFORMED as e:
            raise UnsafeCheckpointError(f"{where} is not readable: {type(e).__name__}: {str(e)[:200]}") from None
        if isinstance(state, Record) and "entries" in state.__dict__:
            state = state.__dict__["entries"]
        if not isinstance(state, dict) or not state:
            raise UnsafeCheckpointError(f"{where} does not hold a module's weights (a state dict of arrays)")
        out = {}
        for key, value in state.items():
            if not isinstance(key, str) or len(key) > 256:
                raise UnsafeCheckpointError(f"{where}: weight name {short_repr(key)} is not a state-dict key")
            out[key] = _numeric(key, value, str(where))
        return out

    def refusal(self) -> str | None:
        """Why this module is not rebuilt, or None."""
        if self.family is None:
            return (f"module {self.module_id!r} is a {self.module_class}, not one of RLlib's default modules; "
                    f"this package rebuilds {SUPPORTED}; {OTHERWISE}")
        if self.catalog_class is not None and self.catalog_class not in CATALOGS:
            return (f"module {self.module_id!r} is built by the catalog {self.catalog_class}, not RLlib's own, so "
                    f"its network may be another; this package rebuilds {SUPPORTED}; {OTHERWISE}")
        space = self.observation_space
        if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 1
                and np.issubdtype(space.dtype, np.floating)):
            return (f"module {self.module_id!r} takes observations {space}; the encoder rebuilt here is the MLP "
                    "over a 1-D float Box (image encoders and other spaces are not rebuilt yet)")
        action = self.action_space
        if not (isinstance(action, gym.spaces.Discrete) or (isinstance(action, gym.spaces.Box)
                                                             and len(action.shape) == 1
                                                             and np.issubdtype(action.dtype, np.floating))):
            return (f"module {self.module_id!r} acts in {action}; Discrete and 1-D float Box actions are rebuilt "
                    "(their distributions measured against RLlib's)")
        return None


@dataclass
class ModuleCheckpoint:
    """A new-API-stack checkpoint read and checked (no TensorFlow, torch or ray)."""

    path: Path
    layout: str  # "algorithm", "multi_rl_module" or "rl_module"
    ray_version: str
    checkpoint_version: str
    modules: dict[str, ModuleSpec]
    env_to_module: list[str] | None = None  # the connectors' class names, in order; None: not in the checkpoint
    module_to_env: list[str] | None = None
    filters: dict[Any, FilterState] = field(default_factory=dict)  # agent id (None: single agent) -> filter
    normalize_actions: bool = True  # RLlib's defaults where the checkpoint holds no pipeline
    clip_actions: bool = False
    env_observation_space: gym.Space | None = None  # what the environment gives (single agent)
    flatten: bool = False  # FlattenObservations: the environment's observations flattened (one-hot, sorted keys)
    # FlattenObservations(multi_agent=True): what each agent observes (the pipeline's input space,
    # keyed by agent id), and the agents it flattens (None: every agent)
    agent_spaces: dict[Any, gym.Space] = field(default_factory=dict)
    flatten_agents: frozenset | None = None

    def module(self, module_id: str | None = None) -> ModuleSpec:
        ids = list(self.modules)
        if module_id is None:
            if len(ids) != 1:
                raise ExportError(f"{self.path} holds {len(ids)} modules ({', '.join(ids)}); choose one with "
                                  "--policy-id, or --all-policies for one export each")
            return self.modules[ids[0]]
        if module_id not in self.modules:
            raise ExportError(f"{self.path} holds no module {module_id!r}; its module ids: {', '.join(ids)}")
        return self.modules[module_id]

    def input_space(self, spec: ModuleSpec, use_filter: bool, agent: str | None = None) -> tuple[gym.Space, bool]:
        """The observation space an export of ``spec`` takes, and whether FlattenObservations
        flattens it: the environment's in front of FlattenObservations or the filter, else the
        module's own. Behind a multi-agent FlattenObservations, the space of the agent named (an
        agent id, compared as text), or of the agents whose observations fit the module, which must
        agree: which agent maps to which module is code in the checkpoint, which is not run.

        Raises:
            ExportError: no agent's observations fit the module, or several that differ (name one).
        """
        if not self.agent_spaces:
            if self.env_observation_space is not None and (self.flatten or (use_filter and self.filters)):
                return self.env_observation_space, self.flatten
            return spec.observation_space, False
        width = int(np.prod(spec.observation_space.shape))

        def takes(a: Any) -> tuple[gym.Space, bool] | None:
            raw = self.agent_spaces[a]
            if self.flatten_agents is None or a in self.flatten_agents:
                return (raw, True) if gym.spaces.flatdim(raw) == width else None
            return (spec.observation_space, False) if raw == spec.observation_space else None

        if agent is not None:
            found = [a for a in self.agent_spaces if str(a) == agent]
            if len(found) != 1:
                what = "holds no agent" if not found else "holds more than one agent named"
                raise ExportError(f"{self.path}: FlattenObservations {what} {agent!r}; its agents: "
                                  f"{_agents(self.agent_spaces)}")
            fit = takes(found[0])
            if fit is None:
                raise ExportError(f"{self.path}: agent {agent} observes {self.agent_spaces[found[0]]}, which module "
                                  f"{spec.module_id!r} does not take ({spec.observation_space})")
            return fit
        fits = {a: f for a in self.agent_spaces if (f := takes(a)) is not None}
        distinct = {(str(f[0]), f[1]): f for f in fits.values()}
        if len(distinct) == 1:
            return next(iter(distinct.values()))
        if not fits:
            raise ExportError(f"{self.path}: no agent's observations ({_agents(self.agent_spaces)}) fit module "
                              f"{spec.module_id!r}, which takes {spec.observation_space}")
        raise ExportError(f"{self.path}: the observations of agents {_agents(fits)} all fit module "
                          f"{spec.module_id!r}, as different spaces, and which agent maps to it is code in the "
                          "checkpoint, which is not run; name the agent with --filter-agent ID")

    def filter_for(self, module_id: str, agent: str | None = None) -> FilterState | None:
        """The observation filter in front of ``module_id``: the single-agent filter; for a
        multi-agent filter (one per agent, and which agent maps to which module is code in the
        checkpoint) the filter of ``agent`` (an agent id, compared as text), or the one all agents
        share; an ExportError otherwise."""
        if not self.filters:
            return None
        if list(self.filters) == [None]:
            return self.filters[None]
        if agent is not None:
            found = [a for a in self.filters if str(a) == agent]
            if not found:
                raise ExportError(f"{self.path}: the MeanStdFilter holds no agent {agent!r}; its agents: "
                                  f"{_agents(self.filters)}")
            if len(found) > 1:
                raise ExportError(f"{self.path}: --filter-agent {agent} is ambiguous: the MeanStdFilter holds agents "
                                  f"{' and '.join(repr(a) for a in found)} (a name and a number); which agent "
                                  "maps to the module is code in the checkpoint, which is not run")
            return self.filters[found[0]]
        states = list(self.filters.values())
        first = states[0]
        if all(s.n == first.n and np.array_equal(s.mean, first.mean) and np.array_equal(s.m2, first.m2)
               for s in states[1:]):
            return first
        raise ExportError(f"{self.path}: the MeanStdFilter keeps statistics per agent "
                          f"({_agents(self.filters)}), and which agent maps to module {module_id!r} "
                          "is code in the checkpoint, which is not run; name the agent whose statistics to use with --filter-agent "
                          "ID, or export with --no-filter (the export then takes filtered observations)")


def _agents(filters: dict[Any, Any], shown: int = 8) -> str:
    """The agent ids of a filter, as they are written (a name quoted, a number bare), the first few."""
    ids = [repr(a) if isinstance(a, str) else str(a) for a in list(filters)[:shown]]
    return ", ".join(ids) + (f" and {len(filters) - shown} more" if len(filters) > shown else "")


# ----------------------------------------------------------------------------- detection

def _json(root: Path, parts: tuple[str, ...]) -> dict[str, Any]:
    where = root.joinpath(*parts)
    try:
        meta = jsonio.loads(_read_inside(root, parts, JSON_LIMIT), str(where), JSON_LIMIT)
    except jsonio.JSONError as e:
        raise UnsafeCheckpointError(f"{where} is not strict JSON: {e.problem[:200]}") from None
    if not isinstance(meta, dict):
        raise UnsafeCheckpointError(f"{where} is not a JSON object")
    version = meta.get("checkpoint_version")
    if not isinstance(version, str) or version not in CHECKPOINT_VERSIONS:
        raise UnsafeCheckpointError(f"{where}: checkpoint_version {short_repr(version)} is not one of "
                                    f"{', '.join(CHECKPOINT_VERSIONS)} (RLlib's new API stack, ray 2.40-2.60)")
    if meta.get("class_and_ctor_args_file", "class_and_ctor_args.pkl") != "class_and_ctor_args.pkl":
        raise UnsafeCheckpointError(f"{where}: class_and_ctor_args_file {short_repr(meta['class_and_ctor_args_file'])}"
                                    " is not class_and_ctor_args.pkl, the only file of that kind read")
    return meta


def _small_json(path: Path) -> Any:
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > JSON_LIMIT:
            return None
        return jsonio.loads(path.read_bytes(), str(path), JSON_LIMIT)
    except (OSError, jsonio.JSONError):
        return None


def detect_layout(path: Path) -> str | None:
    """``"algorithm"``, ``"multi_rl_module"``, ``"rl_module"`` or None, from the metadata JSON alone
    (no pickle is opened): RLlib's new API stack writes ``checkpoint_version`` 2.x and no ``type``."""
    if not path.is_dir() or path.is_symlink():
        return None
    meta = _small_json(path / "rllib_checkpoint.json")
    if isinstance(meta, dict):
        new = "type" not in meta and str(meta.get("checkpoint_version", "")).startswith("2.")
        return "algorithm" if new else None
    meta = _small_json(path / "metadata.json")
    if not (isinstance(meta, dict) and str(meta.get("checkpoint_version", "")).startswith("2.")
            and (path / "class_and_ctor_args.pkl").is_file()):
        return None
    state = str(meta.get("state_file", ""))
    return "rl_module" if state.startswith("module_state") and _state_name(path, state) is not None \
        and not _module_dirs_quiet(path) else "multi_rl_module"


def _module_dirs_quiet(path: Path) -> bool:
    try:
        return any((e / "metadata.json").is_file() and not e.is_symlink() for e in path.iterdir() if e.is_dir())
    except OSError:
        return False


def _state_name(directory: Path, state_file: str) -> str | None:
    """The weights file RLlib reads for ``state_file``: the name itself (ray 2.40 records
    ``module_state.pt``/``.pkl``) or ``<name>.pkl`` (ray 2.60 records no extension); None when absent."""
    for name in (state_file, state_file + ".pkl"):
        if name.endswith((".pkl", ".pt")) and (directory / name).is_file():
            return name
    return None


# ----------------------------------------------------------------------------- reading

def read_module_checkpoint(path: str | Path, budget: ReadBudget | None = None) -> ModuleCheckpoint:
    """Read a new-API-stack checkpoint (any of the three layouts) within ``budget``; the weights
    are read later, per module (:meth:`ModuleSpec.weights`).

    Raises:
        UnsafeCheckpointError: anything refused, unreadable or over budget, naming the file and the reason.
    """
    root = Path(path)
    try:
        with reading(budget):
            return _read(root)
    except UnsafeCheckpointError:
        raise
    except MALFORMED as e:
        raise UnsafeCheckpointError(f"{root} is not a checkpoint this package reads: {type(e).__name__}: "
                                    f"{str(e)[:300]}") from None


def _read(root: Path) -> ModuleCheckpoint:
    if root.is_symlink() or not root.is_dir():
        raise UnsafeCheckpointError(f"{root} is not a checkpoint directory (a real directory, not a link)")
    layout = detect_layout(root)
    if layout is None:
        raise UnsafeCheckpointError(f"{root} is not a checkpoint of RLlib's new API stack (no rllib_checkpoint.json "
                                    "or metadata.json of checkpoint_version 2.x)")
    meta = _json(root, ("rllib_checkpoint.json",) if layout == "algorithm" else ("metadata.json",))
    modules_at = MODULE_ROOT if layout == "algorithm" else ()
    if layout == "rl_module":
        spec = _module(root, (), _module_id_of(root), meta)
        modules = {spec.module_id: spec}
    else:
        if layout == "algorithm":
            _json(root, (*modules_at, "metadata.json"))
        modules = {mid: _module(root, (*modules_at, mid), mid, _json(root, (*modules_at, mid, "metadata.json")))
                   for mid in _module_ids(root, modules_at)}
    checkpoint = ModuleCheckpoint(path=root, layout=layout, ray_version=str(meta.get("ray_version", "?"))[:40],
                                  checkpoint_version=meta["checkpoint_version"], modules=modules)
    if layout == "algorithm":
        _pipelines(root, checkpoint)
    return checkpoint


def _module_id_of(root: Path) -> str:
    """A lone RLModule's id: its folder's name inside a MultiRLModule directory, else RLlib's
    ``default_policy`` (``RLModule.save_to_path`` records no id)."""
    parent, name = root.absolute().parent, root.absolute().name
    inside = (parent / "metadata.json").is_file() and (parent / "class_and_ctor_args.pkl").is_file()
    return name if inside and MODULE_ID.fullmatch(name) else "default_policy"


def _module_ids(root: Path, parts: tuple[str, ...]) -> list[str]:
    """The module folders of a MultiRLModule directory (each a plain name, a real directory holding
    ``metadata.json``), sorted."""
    where = root.joinpath(*parts)
    try:
        info = os.lstat(where)
    except FileNotFoundError:
        raise UnsafeCheckpointError(f"{where} is missing: the checkpoint holds no RLModule") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCheckpointError(f"{where} is not a directory (a symbolic link is not followed)")
    ids = []
    with os.scandir(where) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if len(ids) >= MAX_MODULES:
                raise UnsafeCheckpointError(f"{where} holds more than {MAX_MODULES} module folders")
            if not MODULE_ID.fullmatch(entry.name):
                raise UnsafeCheckpointError(f"{where}: folder {entry.name[:80]!r} is not a plain module id")
            ids.append(entry.name)
    if not ids:
        raise UnsafeCheckpointError(f"{where} holds no module folder")
    return sorted(ids)


def _pickle(root: Path, parts: tuple[str, ...], limit: int = ARGS_LIMIT) -> Any:
    return loads(_read_inside(root, parts, limit), str(root.joinpath(*parts)))


def _class_and_args(root: Path, parts: tuple[str, ...]) -> tuple[str, tuple, dict[str, Any]]:
    """``class_and_ctor_args.pkl`` of ``parts``: (the class's dotted name, args, kwargs)."""
    where = root.joinpath(*parts, "class_and_ctor_args.pkl")
    data = _pickle(root, (*parts, "class_and_ctor_args.pkl"))
    cls = data.get("class") if isinstance(data, dict) else None
    args = data.get("ctor_args_and_kwargs") if isinstance(data, dict) else None
    if isinstance(cls, Record) and type(cls).ref.endswith("._make_skeleton_class"):
        # a class of the user's own, pickled by value (its code is in the file, and is not run)
        name = cls.args[1] if len(cls.args) > 1 and isinstance(cls.args[1], str) else "?"
        cls = type("Record", (Record,), {"ref": f"{name[:100]} (a class of your own, pickled with its code)"})
    if not (isinstance(cls, type) and issubclass(cls, Record)) or not (isinstance(args, tuple) and len(args) == 2
                                                                       and isinstance(args[0], tuple)
                                                                       and isinstance(args[1], dict)):
        raise UnsafeCheckpointError(f"{where} does not hold a class and its arguments as RLlib writes them")
    return cls.ref, args[0], args[1]


def _module(root: Path, parts: tuple[str, ...], module_id: str, meta: dict[str, Any]) -> ModuleSpec:
    where = str(root.joinpath(*parts, "class_and_ctor_args.pkl"))
    ref, args, kwargs = _class_and_args(root, parts)
    if args:
        raise UnsafeCheckpointError(f"{where}: the module takes positional arguments; RLlib's modules take keywords")
    state = _state_name(root.joinpath(*parts), str(meta.get("state_file", "module_state")))
    if state is None:
        raise UnsafeCheckpointError(f"{root.joinpath(*parts)} holds no module_state.pkl or module_state.pt (the "
                                    "weights); a msgpack checkpoint (use_msgpack=True) is not read")
    config = kwargs.get("model_config") or {}
    if isinstance(config, Record):
        config = config.fields()
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise UnsafeCheckpointError(f"{where}: model_config {short_repr(config)} is not a dict of settings")
    check_model_config(config, where)
    catalog = kwargs.get("catalog_class")
    catalog_ref = catalog.ref if isinstance(catalog, type) and issubclass(catalog, Record) else None
    if catalog is not None and catalog_ref is None:
        raise UnsafeCheckpointError(f"{where}: catalog_class {short_repr(catalog)} is not a class reference")
    return ModuleSpec(module_id=module_id, module_class=ref, family=MODULES.get(ref), catalog_class=catalog_ref,
                      observation_space=space_of(kwargs.get("observation_space"), where + " (observation_space)"),
                      action_space=space_of(kwargs.get("action_space"), where + " (action_space)"),
                      model_config=dict(config), inference_only=bool(kwargs.get("inference_only", False)),
                      directory=parts, state_file=state, root=root)


# ----------------------------------------------------------------------------- connectors

ENV_RUNNER = ("env_runner",)


def _pipeline(root: Path, name: str) -> tuple[list[str], tuple, dict[str, Any]] | None:
    """The connectors of ``env_runner/<name>/`` in order (class names) and the pipeline's
    arguments; None when the checkpoint holds no such pipeline."""
    parts = (*ENV_RUNNER, name)
    if not root.joinpath(*parts, "class_and_ctor_args.pkl").is_file():
        return None
    where = str(root.joinpath(*parts, "class_and_ctor_args.pkl"))
    _, args, kwargs = _class_and_args(root, parts)
    entries = kwargs.get("connectors", [])
    if not isinstance(entries, list):
        raise UnsafeCheckpointError(f"{where}: connectors {short_repr(entries)} is not a list")
    names = []
    for entry in entries:
        cls = entry[0] if isinstance(entry, tuple) and entry else entry
        if isinstance(cls, Record):
            cls = type(cls)
        if not (isinstance(cls, type) and issubclass(cls, Record)):
            raise UnsafeCheckpointError(f"{where}: a connector {short_repr(entry)} is not a class reference")
        names.append(cls.ref)
    return names, args, {"entries": entries}


def _connector_kwargs(entry: Any) -> dict[str, Any]:
    """A pipeline entry's keyword arguments: ``(cls, args, kwargs)`` as RLlib 2.60 writes it, or a
    record whose state holds them."""
    if isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[2], dict):
        return entry[2]
    if isinstance(entry, Record):
        return {**entry.kwargs, **entry.fields()}
    return {}


def _known(names: list[str], allowed: Any, what: str, root: Path) -> list[str]:
    """The connectors' short names, each one this package rebuilds, or an ExportError naming the others."""
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ExportError(f"{root}: the {what} connector pipeline holds {', '.join(unknown)}, which this package does "
                          "not rebuild (it rebuilds RLlib's default connectors, FlattenObservations and MeanStdFilter); "
                          f"{OTHERWISE}")
    return [n.rsplit(".", 1)[-1] for n in names]


def _pipelines(root: Path, checkpoint: ModuleCheckpoint) -> None:
    """The env runner's connector pipelines of an Algorithm checkpoint: their connectors checked
    against what this package rebuilds, the filter, the environment's space, the action settings."""
    env = _pipeline(root, "env_to_module_connector")
    if env is not None:
        names, args, extra = env
        checkpoint.env_to_module = _known(names, ENV_TO_MODULE, "env-to-module", root)
        if args and len(checkpoint.modules) == 1:  # a multi-agent pipeline takes a Dict of every agent's
            checkpoint.env_observation_space = _optional_space(args[0], str(root / "env_runner"))
        kinds = [ENV_TO_MODULE[n] for n in names if ENV_TO_MODULE[n]]
        if kinds not in ([], ["MeanStdFilter"], ["FlattenObservations"], ["FlattenObservations", "MeanStdFilter"]):
            raise ExportError(f"{root}: the env-to-module connectors {', '.join(kinds)} in this order are not "
                              "rebuilt (FlattenObservations, then MeanStdFilter, are)")
        for entry, name in zip(extra["entries"], names):
            if ENV_TO_MODULE[name] == "MeanStdFilter":
                checkpoint.filters = _mean_std_filter(root, _connector_kwargs(entry))
            elif ENV_TO_MODULE[name] == "FlattenObservations":
                _check_flatten(_connector_kwargs(entry), args, checkpoint, root)
    m2e = _pipeline(root, "module_to_env_connector")
    if m2e is not None:
        names, _, extra = m2e
        checkpoint.module_to_env = _known(names, MODULE_TO_ENV, "module-to-env", root)
        for entry, name in zip(extra["entries"], names):
            if name.endswith(".NormalizeAndClipActions"):
                kwargs = _connector_kwargs(entry)
                checkpoint.normalize_actions = _switch(kwargs.get("normalize_actions", True), "normalize_actions", root)
                checkpoint.clip_actions = _switch(kwargs.get("clip_actions", False), "clip_actions", root)


def _check_flatten(kwargs: dict[str, Any], args: tuple, checkpoint: ModuleCheckpoint, root: Path) -> None:
    """``FlattenObservations`` as it is rebuilt: every key, the environment's space known; with
    ``multi_agent``, the space of every agent (the pipeline's input, keyed by agent id) and the
    agents it flattens (``agent_ids``, None: all)."""
    if kwargs.get("keys_to_remove"):
        raise ExportError(f"{root}: FlattenObservations with keys_to_remove is not rebuilt")
    multi = _switch(kwargs.get("multi_agent", False), "FlattenObservations multi_agent", root)
    if not multi:
        if kwargs.get("agent_ids") is not None:
            raise ExportError(f"{root}: FlattenObservations with agent_ids but not multi_agent is not rebuilt")
        if checkpoint.env_observation_space is None:
            raise ExportError(f"{root}: FlattenObservations, but the environment's observation space is not in the "
                              "connector pipeline")
        checkpoint.flatten = True
        return
    where = str(root / "env_runner" / "env_to_module_connector")
    spaces = args[0].fields().get("spaces") if args and isinstance(args[0], Record) else None
    if isinstance(spaces, Record) and "entries" in spaces.__dict__:
        spaces = spaces.__dict__["entries"]
    if not isinstance(spaces, dict) or not spaces or len(spaces) > MAX_MODULES:
        raise ExportError(f"{root}: a multi-agent FlattenObservations, but the agents' observation spaces are not in "
                          "the connector pipeline")
    for agent in spaces:
        _check_agent_id(agent, where)
    checkpoint.agent_spaces = {a: space_of(v, f"{where} (agent {short_repr(a, 40)})") for a, v in spaces.items()}
    ids = kwargs.get("agent_ids")
    if ids is not None:
        if not isinstance(ids, (list, tuple, set, frozenset)) or len(ids) > MAX_MODULES:
            raise UnsafeCheckpointError(f"{where}: agent_ids {short_repr(ids)} is not a collection of agent ids")
        for agent in ids:
            _check_agent_id(agent, where)
        ids = frozenset(ids)
    checkpoint.flatten_agents = ids
    checkpoint.flatten = True


def _check_agent_id(agent: Any, where: str) -> None:
    if not ((isinstance(agent, str) and len(agent) <= AGENT_ID_CHARS)
            or (isinstance(agent, int) and not isinstance(agent, bool) and abs(agent) < 1 << 63)):
        raise UnsafeCheckpointError(f"{where}: agent id {short_repr(agent, 40)} is not a name (at most "
                                    f"{AGENT_ID_CHARS} characters) or a 64-bit number")


def _optional_space(record: Any, where: str) -> gym.Space | None:
    try:
        return space_of(record, where)
    except UnsafeCheckpointError:
        return None


def _switch(value: Any, what: str, where: Path) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise UnsafeCheckpointError(f"{where}: {what} {short_repr(value)} is not true or false")
    return bool(value)


FILTER_DIR = (*ENV_RUNNER, "env_to_module_connector", "MeanStdFilter")


def _mean_std_filter(root: Path, kwargs: dict[str, Any]) -> dict[Any, FilterState]:
    """The ``MeanStdFilter``'s statistics per agent id (None: single agent), as RLlib's
    ``MeanStdFilter.set_state`` reads them; ray 2.40 stores the sum of squared differences as
    ``std_array``, 2.60 as ``sum_sq_diff_array``."""
    where = str(root.joinpath(*FILTER_DIR, "state.pkl"))
    state = _pickle(root, (*FILTER_DIR, "state.pkl"), 64 << 20)
    if not isinstance(state, dict) or not state or len(state) > MAX_MODULES:
        raise UnsafeCheckpointError(f"{where} does not hold the filter's statistics per agent")
    filters = {}
    for agent, params in state.items():
        if agent is not None:
            _check_agent_id(agent, where)
        if not isinstance(params, dict):
            raise UnsafeCheckpointError(f"{where}: the statistics of agent {short_repr(agent)} are not readable")
        stats = params.get("running_stats")
        if not isinstance(stats, list) or len(stats) != 1 or not isinstance(stats[0], dict):
            raise ExportError(f"{where}: the filter of agent {short_repr(agent)} keeps {short_repr(stats)} running "
                              "statistics; one (a Box observation) is rebuilt")
        one = dict(stats[0])
        if "sum_sq_diff_array" in one:
            one["std_array"] = one["sum_sq_diff_array"]
        clip = params.get("clip_by_value", kwargs.get("clip_by_value"))
        filters[agent] = _filter_state("MeanStdFilter", {
            "running_stats": one, "demean": params.get("de_mean_to_zero", kwargs.get("de_mean_to_zero", True)),
            "destd": params.get("de_std_to_one", kwargs.get("de_std_to_one", True)),
            "clip": clip}, "connector", where)
    return filters


# ----------------------------------------------------------------------------- inspect

def describe_network(spec: ModuleSpec) -> str:
    """One line on the network a module is rebuilt as, from its class and config (no weights read).

    Raises:
        ExportError: the module is not one this package rebuilds (:meth:`ModuleSpec.refusal`).
    """
    refusal = spec.refusal()
    if refusal:
        raise ExportError(refusal)
    cfg = {**DEFAULT_MODEL_CONFIG, **spec.model_config}
    mlp = f"MLP {list(cfg['fcnet_hiddens'])} {cfg['fcnet_activation']}"
    if cfg.get("fcnet_use_layernorm"):
        mlp += " layernorm"
    heads = f"heads {list(cfg['head_fcnet_hiddens'])} {cfg['head_fcnet_activation']}" \
        if cfg["head_fcnet_hiddens"] else "linear heads"
    if spec.family == "ppo":
        body = f"LSTM {cfg['lstm_cell_size']} over {mlp}" if cfg["use_lstm"] else mlp
        value = "shared" if cfg["vf_share_layers"] else "separate"
        return f"actor-critic: {body}, {value} value branch, {heads}"
    if spec.family == "dqn":
        kind = "dueling" if cfg["dueling"] else "plain"
        atoms = f", {cfg['num_atoms']} atoms" if int(cfg["num_atoms"]) > 1 else ""
        return f"Q: {mlp}, {kind} {heads}{atoms}"
    return f"soft actor: {mlp}, pi {heads}, squashed Gaussian"
