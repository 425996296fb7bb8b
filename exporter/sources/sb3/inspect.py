"""What ``inspect`` shows of a Stable-Baselines3 zip, from what was read (no TensorFlow): the
network layer by layer (sizes from the weights' shapes) and what ``predict`` does after it."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from policy_export.exporter.sources.sb3.reader import SB3Model


def _widths(model: SB3Model, prefix: str) -> list[int]:
    """The output widths of the Linear layers of a ``Sequential`` under ``prefix`` (indices 0, 2, 4...)."""
    widths, index = [], 0
    while f"{prefix}.{index}.weight" in model.weights:
        widths.append(int(model.weights[f"{prefix}.{index}.weight"].shape[0]))
        index += 2
    return widths


def network_text(model: SB3Model) -> str:
    """One line on the network: the extractor, the layers and the activation."""
    act = model.kwargs["activation_fn"]
    extractor = {"FlattenExtractor": "flatten", "NatureCNN": "NatureCNN",
                 "CombinedExtractor": "CombinedExtractor"}[model.extractor]
    family = model.family
    if family in ("actor_critic", "maskable", "recurrent"):
        pi, vf = _widths(model, "mlp_extractor.policy_net"), _widths(model, "mlp_extractor.value_net")
        shared = "shared" if model.kwargs.get("share_features_extractor", True) else "separate"
        lstm = ""
        if family == "recurrent":
            k = model.kwargs
            critic = ("own LSTM" if any(n.startswith("lstm_critic.") for n in model.weights)
                      else "shared LSTM" if k.get("shared_lstm") else "linear critic")
            lstm = f"LSTM {k['lstm_hidden_size']}x{k['n_lstm_layers']} ({critic}), "
        sde = ", gSDE" if model.use_sde else ""
        return f"{extractor} ({shared}), {lstm}pi {pi} vf {vf} {act}{sde}"
    if family in ("dqn", "qrdqn"):
        prefix = "q_net.q_net" if family == "dqn" else "quantile_net.quantile_net"
        widths = _widths(model, prefix)
        quantiles = ""
        if family == "qrdqn" and widths and isinstance(model.action_space, gym.spaces.Discrete):
            quantiles = f", {widths[-1] // int(model.action_space.n)} quantiles"
        return f"{extractor}, Q {widths[:-1]} {act}{quantiles}"
    if family == "sac":
        sde = ", gSDE" if model.use_sde else ""
        return f"{extractor}, actor {_widths(model, 'actor.latent_pi')} {act}, squashed Gaussian{sde}"
    return f"{extractor}, actor {_widths(model, 'actor.mu')[:-1]} {act}, tanh"


def postprocess_text(model: SB3Model) -> str:
    """What ``predict`` does after the network, in a few words."""
    space = model.action_space
    if model.family in ("dqn", "qrdqn"):
        return "argmax of the Q-values"
    if model.family in ("sac", "td3") or (model.use_sde and model.kwargs.get("squash_output")):
        return f"tanh, unscaled to [{_bounds(space)}]"
    if isinstance(space, gym.spaces.Box):
        return f"mean clipped to [{_bounds(space)}]"
    kind = {gym.spaces.Discrete: "argmax", gym.spaces.MultiDiscrete: "argmax per part",
            gym.spaces.MultiBinary: "logit > 0 per bit"}[type(space)]
    return kind + (" of the masked logits" if model.family == "maskable" else "")


def _bounds(space: gym.spaces.Box) -> str:
    low, high = np.asarray(space.low).reshape(-1), np.asarray(space.high).reshape(-1)
    if np.all(low == low[0]) and np.all(high == high[0]):
        return f"{low[0]:g}, {high[0]:g}"
    return "the bounds"
