"""Roll out an export in a gymnasium environment with several of its formats side by side.

Every chosen format (default: the SavedModel, run by TensorFlow, and ``model.onnx``, run by ONNX
Runtime) plays the same seeded episodes in lockstep, each in its own copy of the environment, with
deterministic actions; recurrent state, ``prev_action`` and ``prev_reward`` are carried by each
format for itself. The first format is the reference. Integer and bool actions must be identical to
the reference's; float actions must agree within the export's parity tolerance for that
``actions_i`` output (``|a - ref| <= atol + rtol * |ref|``), since runtimes differ in the last bits
of a float. The report gives each episode's return per format, the first step at which a format's
action left that bound (``None``: it never did) and the largest deviation seen.

Lossy formats (quantised, float16: capability ``lossy``) are not expected to choose the same
action at every step. They are judged by return instead: each one's mean return over the episodes
must lie within ``return_tolerance`` (default 5%) of the reference's, relative to the magnitude
of the reference's mean return. When the first format named is lossy, the reference is the float
model: the export's SavedModel (else its first float format that plays) is put first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.exporter import manifest
from policy_export.exporter.devices import plan_devices
from policy_export.exporter.parity.compare import Tolerances
from policy_export.errors import CheckFailedError, ExportError, InputError
from policy_export.policy.spaces import leaf_values, leaves, nest_from_leaves, space_from_json
from policy_export.exporter.parity.replay import runnable_names
from policy_export.exporter.options import RolloutOptions
from policy_export.exporter.watchdog import run_limit
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import (
    OBSERVATIONS, PREV_ACTION, PREV_REWARD, SEQ_LENS, action_key, is_state_in, state_in_key, state_out_key,
)

from policy_export.exporter.defaults import DEFAULT_RETURN_TOLERANCE  # noqa: E402
from policy_export.exporter.defaults import DEFAULT_ROLLOUT_FORMATS as DEFAULT_FORMATS  # noqa: E402


@dataclass(frozen=True)
class EpisodeResult:
    """One seeded episode: per format its return, its steps, the first step its action left the
    tolerance of the reference's (``None``: never) and the largest absolute action deviation."""

    seed: int
    returns: dict[str, float]
    steps: dict[str, int]
    first_divergence: dict[str, int | None]
    max_deviation: dict[str, float]


@dataclass(frozen=True)
class RolloutReport:
    env_id: str
    formats: list[str]
    episodes: list[EpisodeResult]
    lossy: tuple[str, ...] = ()  # judged by mean return, not by step-by-step actions
    return_tolerance: float = DEFAULT_RETURN_TOLERANCE

    @property
    def reference(self) -> str:
        return self.formats[0]

    @property
    def passed(self) -> bool:
        return not self.failed_formats()

    def failed_formats(self) -> list[str]:
        """Float formats whose actions left the tolerance, lossy ones whose mean return is off."""
        out = []
        for f in self.formats[1:]:
            if f in self.lossy:
                if abs(self.relative_return_difference(f)) > self.return_tolerance:
                    out.append(f)
            elif any(e.first_divergence.get(f) is not None for e in self.episodes):
                out.append(f)
        return out

    def mean_return(self, fmt: str) -> float:
        return float(np.mean([e.returns[fmt] for e in self.episodes]))

    def return_difference(self, fmt: str) -> float:
        """``fmt``'s mean return minus the reference's."""
        return self.mean_return(fmt) - self.mean_return(self.reference)

    def relative_return_difference(self, fmt: str) -> float:
        """:meth:`return_difference` over the magnitude of the reference's mean return (the
        difference itself where that is 0)."""
        scale = abs(self.mean_return(self.reference))
        diff = self.return_difference(fmt)
        return diff / scale if scale > 0 else diff

    def max_deviation(self, fmt: str) -> float:
        return float(max(e.max_deviation.get(fmt, 0.0) for e in self.episodes))

    def to_json(self) -> dict[str, Any]:
        return {"env_id": self.env_id, "passed": self.passed, "reference": self.reference, "formats": self.formats,
                "mean_return": {f: self.mean_return(f) for f in self.formats},
                "max_deviation": {f: self.max_deviation(f) for f in self.formats[1:]},
                "return_difference": {f: self.return_difference(f) for f in self.formats[1:]},
                "relative_return_difference": {f: self.relative_return_difference(f) for f in self.formats[1:]},
                "lossy": list(self.lossy), "return_tolerance": self.return_tolerance,
                "failed": self.failed_formats(),
                "episodes": [asdict(e) for e in self.episodes]}


class _Agent:
    """One runtime's view of an episode: its runner, its state, its previous action and reward."""

    def __init__(self, runner, contract: Contract, obs_space: gym.Space, act_space: gym.Space):
        self.runner, self.contract = runner, contract
        self.obs_space, self.act_space = obs_space, act_space
        self.keys = set(contract.input_keys)
        self.state = [np.zeros((1, *s.shape[1:]), np.dtype(s.dtype)) for s in contract.inputs if is_state_in(s.key)]
        self.prev_action = None
        self.prev_reward = 0.0

    def act(self, obs: Any):
        feeds = {k: np.asarray(v)[None] for k, v in leaf_values(self.obs_space, obs, OBSERVATIONS).items()}
        feeds = {k: v.astype(np.dtype(self.contract.input(k).dtype)) for k, v in feeds.items()}
        feeds.update({state_in_key(i): s for i, s in enumerate(self.state)})
        if SEQ_LENS in self.keys:
            feeds[SEQ_LENS] = np.ones(1, np.dtype(self.contract.input(SEQ_LENS).dtype))
        if PREV_ACTION in self.keys:
            spec = self.contract.input(PREV_ACTION)
            prev = np.zeros(spec.shape[1:], np.dtype(spec.dtype)) if self.prev_action is None else self.prev_action
            feeds[PREV_ACTION] = np.asarray(prev, np.dtype(spec.dtype))[None]
        if PREV_REWARD in self.keys:
            feeds[PREV_REWARD] = np.array([self.prev_reward], np.dtype(self.contract.input(PREV_REWARD).dtype))
        out = self.runner(feeds)
        self.state = [out[state_out_key(i)] for i in range(len(self.state))]
        actions = [out[action_key(i)][0] for i in range(len(list(leaves(self.act_space))))]
        self.prev_action = actions[0] if len(actions) == 1 else None
        return nest_from_leaves(self.act_space, actions), actions


def rollout(out: str | Path, env_id: str, options: RolloutOptions | None = None, *,
            manifest_doc: dict | None = None, **keywords: Any) -> RolloutReport:
    """Play ``episodes`` seeded episodes of ``env_id`` with ``formats`` of the export at ``out``.

    The options are a :class:`~exporter.options.RolloutOptions` or its fields as keywords:
    ``episodes`` (default 10), ``seed`` of the first episode, ``device``, ``max_steps`` per
    episode, ``formats``, ``return_tolerance`` and ``run_timeout``. ``manifest_doc`` is the export's
    manifest already read with :func:`exporter.manifest.read_manifest` (it is not read again).

    ``formats`` (default ``["saved_model", "onnx"]``): two or more of the export's formats that run
    the policy's signature (every format but ``keras``); the first is the reference, unless it is
    lossy: the float model (the SavedModel, else the export's first float format) is then put
    first. Lossy formats pass when their mean return is within ``return_tolerance`` (relative)
    of the reference's. ``run_timeout``: seconds one step's call into a runtime may take (default 600).

    Raises:
        CheckFailedError: a file of the export is changed, missing, extra or not a regular file
            (nothing is loaded then).
        ExportError: ``out`` is not an export, or lacks one of the formats.
        InputError: the environment is unknown, its spaces do not match the export's, or
            ``formats`` names fewer than two formats or one that cannot play.
    """
    opts = RolloutOptions.make(options, keywords)
    with run_limit(opts.run_timeout):
        return _rollout(Path(out), env_id, opts, manifest_doc)


def _rollout(out: Path, env_id: str, opts: RolloutOptions, doc: dict | None) -> RolloutReport:
    from policy_export.exporter import formats as registry
    from policy_export.exporter.verify import load_runner

    doc = manifest.read_manifest(out) if doc is None else doc
    problems = manifest.check_files(out, doc, registry.paths()).problems
    if problems:  # never load a model whose files failed their hash check
        raise CheckFailedError(f"{out} failed its file check, nothing was loaded: " + "; ".join(problems))
    formats = _with_float_reference(list(opts.formats or DEFAULT_FORMATS), doc)
    _check_formats(formats, doc)
    lossy = tuple(f for f in formats[1:] if _is_lossy(f))
    contract = Contract.from_json(doc["contract"])
    tolerances = Tolerances.from_json(doc["tolerances"])
    _check_has_spaces(doc, str(out))
    obs_space = space_from_json(doc["spaces"]["observation"], "$.spaces.observation", str(out))
    act_space = space_from_json(doc["spaces"]["action"], "$.spaces.action", str(out))
    try:
        envs = {f: gym.make(env_id) for f in formats}
    except (gym.error.Error, ImportError, AttributeError, TypeError, ValueError) as e:  # module:Env ids import
        raise InputError(f"cannot make environment {env_id!r}: {e}") from e
    runners = {}
    try:
        _check_spaces(envs[formats[0]], obs_space, act_space, env_id)
        plan = plan_devices(opts.device)
        for fmt in formats:
            runners[fmt] = load_runner(fmt, out, doc, plan)
        results = [_episode(envs, runners, contract, tolerances, obs_space, act_space, opts.seed + i, opts.max_steps)
                   for i in range(opts.episodes)]
    finally:
        for env in envs.values():
            env.close()
        for runner in runners.values():
            runner.close()
    return RolloutReport(env_id, formats, results, lossy, float(opts.return_tolerance))


def _check_has_spaces(doc: dict, where: str) -> None:
    """Raises InputError when the manifest records no policy spaces (the export of a policy
    exported elsewhere: its graph's tensors, not an environment's spaces)."""
    if not isinstance(doc.get("spaces"), dict):
        raise InputError(f"{where} records no observation and action spaces (a policy exported elsewhere is "
                         "checked against its recording); a rollout needs them: export the policy from its "
                         "source instead, or check it with verify")


def check_environment(doc: dict, env_id: str, where: str) -> None:
    """``env_id`` made once and its spaces checked against the export's (before any runtime loads).

    Raises:
        InputError: the environment cannot be made, or its spaces are not the export's.
    """
    _check_has_spaces(doc, where)
    obs_space = space_from_json(doc["spaces"]["observation"], "$.spaces.observation", where)
    act_space = space_from_json(doc["spaces"]["action"], "$.spaces.action", where)
    try:
        env = gym.make(env_id)
    except (gym.error.Error, ImportError, AttributeError, TypeError, ValueError) as e:  # module:Env ids import
        raise InputError(f"cannot make environment {env_id!r}: {e}") from e
    try:
        _check_spaces(env, obs_space, act_space, env_id)
    finally:
        env.close()


def _is_lossy(name: str) -> bool:
    from policy_export.exporter import formats as registry

    return name in registry.names() and registry.get(name).capabilities.lossy


def _with_float_reference(formats: list[str], doc: dict) -> list[str]:
    """``formats``, with the float model put first when the first one named is lossy."""
    if not formats or not _is_lossy(formats[0]):
        return formats
    playable = [f for f in runnable_names() if f in doc["formats"] and not _is_lossy(f)]
    if not playable:
        raise ExportError(f"the export has no float format to play as the reference of {formats[0]}")
    from policy_export.exporter import formats as registry

    references = [f.name for f in registry.with_capability("reference") if f.name in playable]  # TF itself
    reference = references[0] if references else playable[0]
    return [reference, *(f for f in formats if f != reference)]


def _check_formats(formats: list[str], doc: dict) -> None:
    playable = runnable_names()
    unknown = [f for f in formats if f not in playable]
    if unknown:
        raise InputError(f"formats {unknown} cannot play a rollout; choose from {playable}")
    if len(formats) < 2 or len(set(formats)) != len(formats):
        raise InputError(f"a rollout needs two or more different formats, got {formats}")
    missing = [f for f in formats if f not in doc["formats"]]
    if missing:
        raise ExportError(f"the export has no {', '.join(missing)}; it has {sorted(doc['formats'])}")


def _deviation(got: np.ndarray, ref: np.ndarray, key: str, tolerances: Tolerances) -> tuple[bool, float]:
    """Whether ``got`` agrees with ``ref`` (exact for integers and bools), and the max abs deviation."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return False, float("inf")
    if not np.issubdtype(ref.dtype, np.floating):
        return bool(np.array_equal(got, ref)), float(np.max(np.abs(got.astype(np.float64) - ref), initial=0.0))
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    tol = tolerances.for_output(key)
    ok = bool(np.all(diff <= tol.atol + tol.rtol * np.abs(ref.astype(np.float64))))
    return ok, float(np.max(diff, initial=0.0))


def _episode(envs, runners, contract, tolerances, obs_space, act_space, seed: int,
             max_steps: int | None) -> EpisodeResult:
    formats = list(runners)
    reference = formats[0]
    agents = {f: _Agent(runners[f], contract, obs_space, act_space) for f in formats}
    obs = {f: envs[f].reset(seed=seed)[0] for f in formats}
    returns = {f: 0.0 for f in formats}
    steps = {f: 0 for f in formats}
    done = {f: False for f in formats}
    divergence: dict[str, int | None] = {f: None for f in formats[1:]}
    deviation = {f: 0.0 for f in formats[1:]}
    t = 0
    while not all(done.values()) and (max_steps is None or t < max_steps):
        chosen = {}
        for f in formats:
            if done[f]:
                continue
            action, flat = agents[f].act(obs[f])
            chosen[f] = flat
            obs[f], reward, terminated, truncated, _ = envs[f].step(action)
            agents[f].prev_reward = float(reward)
            returns[f] += float(reward)
            steps[f] += 1
            done[f] = terminated or truncated
        for f in formats[1:]:
            if f not in chosen or reference not in chosen:
                agree = f not in chosen and reference not in chosen
            else:
                agree = True
                for i, (a, b) in enumerate(zip(chosen[f], chosen[reference])):
                    ok, dev = _deviation(a, b, action_key(i), tolerances)
                    deviation[f] = max(deviation[f], dev)
                    agree = agree and ok
            if not agree and divergence[f] is None:
                divergence[f] = t
        t += 1
    return EpisodeResult(seed, returns, steps, divergence, deviation)


def _check_spaces(env: gym.Env, obs_space: gym.Space, act_space: gym.Space, env_id: str) -> None:
    def shapes(space: gym.Space) -> list:
        return [(type(leaf.space).__name__, tuple(leaf.space.shape)) for leaf in leaves(space)]

    if shapes(env.observation_space) != shapes(obs_space) or shapes(env.action_space) != shapes(act_space):
        raise InputError(f"{env_id}'s spaces ({env.observation_space}, {env.action_space}) do not match the "
                         f"export's ({obs_space}, {act_space})")
