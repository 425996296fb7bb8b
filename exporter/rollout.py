"""Roll out an export in a gymnasium environment with TF (the SavedModel) and ONNX Runtime.

Both runtimes play the same seeded episodes in lockstep, each in its own copy of the
environment, with deterministic actions; recurrent state, ``prev_action`` and ``prev_reward``
are carried by each runtime for itself. The report gives each episode's return per runtime and
the first step at which the runtimes chose different actions (``None``: they never did).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.exporter import manifest, onnx_model, saved_model
from policy_export.exporter.devices import plan_devices
from policy_export.policy.errors import InputError
from policy_export.policy.spaces import leaf_values, leaves, nest_from_leaves, space_from_json
from policy_export.signatures.contract import Contract

RUNTIMES = ("tf", "onnx")


@dataclass(frozen=True)
class EpisodeResult:
    seed: int
    returns: dict[str, float]
    steps: dict[str, int]
    first_divergence: int | None


@dataclass(frozen=True)
class RolloutReport:
    env_id: str
    episodes: list[EpisodeResult]

    @property
    def passed(self) -> bool:
        return all(e.first_divergence is None for e in self.episodes)

    def mean_return(self, runtime: str) -> float:
        return float(np.mean([e.returns[runtime] for e in self.episodes]))

    def to_json(self) -> dict[str, Any]:
        return {"env_id": self.env_id, "passed": self.passed,
                "mean_return": {r: self.mean_return(r) for r in RUNTIMES},
                "episodes": [asdict(e) for e in self.episodes]}


class _Agent:
    """One runtime's view of an episode: its runner, its state, its previous action and reward."""

    def __init__(self, runner, contract: Contract, obs_space: gym.Space, act_space: gym.Space):
        self.runner, self.contract = runner, contract
        self.obs_space, self.act_space = obs_space, act_space
        self.keys = set(contract.input_keys)
        self.state = [np.zeros((1, *s.shape[1:]), np.dtype(s.dtype)) for s in contract.inputs if s.key.startswith("state_in_")]
        self.prev_action = None
        self.prev_reward = 0.0

    def act(self, obs: Any):
        feeds = {k: np.asarray(v)[None] for k, v in leaf_values(self.obs_space, obs, "observations").items()}
        feeds = {k: v.astype(np.dtype(self.contract.input(k).dtype)) for k, v in feeds.items()}
        feeds.update({f"state_in_{i}": s for i, s in enumerate(self.state)})
        if "seq_lens" in self.keys:
            feeds["seq_lens"] = np.ones(1, np.dtype(self.contract.input("seq_lens").dtype))
        if "prev_action" in self.keys:
            spec = self.contract.input("prev_action")
            prev = np.zeros(spec.shape[1:], np.dtype(spec.dtype)) if self.prev_action is None else self.prev_action
            feeds["prev_action"] = np.asarray(prev, np.dtype(spec.dtype))[None]
        if "prev_reward" in self.keys:
            feeds["prev_reward"] = np.array([self.prev_reward], np.dtype(self.contract.input("prev_reward").dtype))
        out = self.runner(feeds)
        self.state = [out[f"state_out_{i}"] for i in range(len(self.state))]
        actions = [out[f"actions_{i}"][0] for i in range(len(list(leaves(self.act_space))))]
        self.prev_action = actions[0] if len(actions) == 1 else None
        return nest_from_leaves(self.act_space, actions), actions


def rollout(out: str | Path, env_id: str, episodes: int = 10, seed: int = 0, device: str = "auto",
            max_steps: int | None = None) -> RolloutReport:
    """Play ``episodes`` seeded episodes of ``env_id`` with both runtimes of the export at ``out``.

    Raises:
        ExportError: ``out`` is not an export or lacks a SavedModel or ONNX model.
        InputError: the environment is unknown or its spaces do not match the export's.
    """
    out = Path(out)
    doc = manifest.read_manifest(out)
    if episodes < 1:
        raise InputError(f"episodes must be at least 1, got {episodes}")
    contract = Contract.from_json(doc["contract"])
    obs_space = space_from_json(doc["spaces"]["observation"], "$.spaces.observation", str(out))
    act_space = space_from_json(doc["spaces"]["action"], "$.spaces.action", str(out))
    try:
        envs = {r: gym.make(env_id) for r in RUNTIMES}
    except gym.error.Error as e:
        raise InputError(f"cannot make environment {env_id!r}: {e}") from e
    _check_spaces(envs["tf"], obs_space, act_space, env_id)
    plan = plan_devices(device)
    runners = {"tf": saved_model.load(out, plan), "onnx": onnx_model.load(out, plan)}
    results = []
    for episode in range(episodes):
        results.append(_episode(envs, runners, contract, obs_space, act_space, seed + episode, max_steps))
    for env in envs.values():
        env.close()
    return RolloutReport(env_id, results)


def _episode(envs, runners, contract, obs_space, act_space, seed: int, max_steps: int | None) -> EpisodeResult:
    agents = {r: _Agent(runners[r], contract, obs_space, act_space) for r in RUNTIMES}
    obs = {r: envs[r].reset(seed=seed)[0] for r in RUNTIMES}
    returns = {r: 0.0 for r in RUNTIMES}
    steps = {r: 0 for r in RUNTIMES}
    done = {r: False for r in RUNTIMES}
    divergence = None
    t = 0
    while not all(done.values()) and (max_steps is None or t < max_steps):
        chosen = {}
        for r in RUNTIMES:
            if done[r]:
                continue
            action, flat = agents[r].act(obs[r])
            chosen[r] = flat
            obs[r], reward, terminated, truncated, _ = envs[r].step(action)
            agents[r].prev_reward = float(reward)
            returns[r] += float(reward)
            steps[r] += 1
            done[r] = terminated or truncated
        if divergence is None and (len(chosen) < len(RUNTIMES) or not all(
                np.array_equal(a, b) for a, b in zip(chosen["tf"], chosen["onnx"]))):
            divergence = t
        t += 1
    return EpisodeResult(seed, returns, steps, divergence)


def _check_spaces(env: gym.Env, obs_space: gym.Space, act_space: gym.Space, env_id: str) -> None:
    def shapes(space: gym.Space) -> list:
        return [(type(leaf.space).__name__, tuple(leaf.space.shape)) for leaf in leaves(space)]

    if shapes(env.observation_space) != shapes(obs_space) or shapes(env.action_space) != shapes(act_space):
        raise InputError(f"{env_id}'s spaces ({env.observation_space}, {env.action_space}) do not match the "
                         f"export's ({obs_space}, {act_space})")
