"""The base model's inputs and the names and shapes of its weights, from the spec alone: no
TensorFlow, so that a weights file that does not fit is refused before TensorFlow loads.

:func:`expected_weights` follows what :mod:`policy.models` builds (``<input>_conv_<i>`` Conv2D
layers with ``same`` padding, ``fc_1..fc_N``, the ``lstm`` layer and ``fc_out``), in the order
the built model lists its weights; tests/test_early_refusals.py checks it against the built
model of every spec fixture. :func:`policy.spec.check_weights_file` compares a weights file's names and shapes
with it (read with h5py, no value read), each problem worded by :func:`weights_problems` as
:meth:`TFPolicy.import_model_from_h5` words it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import UnsupportedSpaceError
from policy_export.policy.spaces import Leaf, leaves

_MISSING, _UNEXPECTED = "missing weight ", "unexpected weight "  # how TFPolicy words these problems


@dataclass(frozen=True)
class ModelInput:
    """One base-model input: its Keras name, per-sample shape, and whether it is an image."""

    name: str
    shape: tuple[int, ...]
    image: bool


def input_name(leaf: Leaf) -> str:
    """Keras input name of an observation leaf: ``obs`` for a flat space, else ``obs_<path>``."""
    return "obs" if not leaf.path else "obs_" + "_".join(re.sub(r"\W", "_", p) for p in leaf.path)


def model_inputs(space: gym.Space, config: Any) -> list[ModelInput]:
    """The base model's inputs for an observation space (a :class:`policy.spec.ModelConfig`'s
    ``conv_filters`` make rank-3 Box leaves images), in leaf order."""
    return _inputs(space, bool(config.conv_filters))


def _inputs(space: gym.Space, conv: bool) -> list[ModelInput]:
    out = []
    for leaf in leaves(space):
        s = leaf.space
        if isinstance(s, gym.spaces.Box):
            image = len(s.shape) == 3 and conv
            shape = tuple(s.shape) if image else (int(np.prod(s.shape)),)
        elif isinstance(s, gym.spaces.Discrete):
            shape = (int(s.n),)
            image = False
        elif isinstance(s, gym.spaces.MultiDiscrete):
            shape = (int(np.sum(s.nvec)),)
            image = False
        elif isinstance(s, gym.spaces.MultiBinary):
            shape = (int(np.prod(s.shape)),)
            image = False
        else:  # pragma: no cover - check_supported runs first
            raise TypeError(type(s).__name__)
        out.append(ModelInput(input_name(leaf), shape, image))
    return out


def weight_key(layer_name: str, weight_name: str) -> str:
    """``fc_1`` + ``base_model/fc_1/kernel:0`` -> ``fc_1/kernel``: the name weights are matched by."""
    short = weight_name.split("/")[-1].split(":")[0]
    return f"{layer_name}/{short}"


def action_width(space: gym.Space) -> int:
    """The width of the distribution inputs (``fc_out``'s units) of an action space, as
    ``ActionDistribution.required_inputs`` counts them.

    Raises:
        UnsupportedSpaceError: a leaf no distribution takes.
    """
    width = 0
    for leaf in leaves(space):
        s = leaf.space
        if isinstance(s, gym.spaces.Discrete):
            width += int(s.n)
        elif isinstance(s, gym.spaces.MultiDiscrete):
            width += int(np.sum(s.nvec))
        elif isinstance(s, gym.spaces.MultiBinary):
            width += int(np.prod(s.shape))
        elif isinstance(s, gym.spaces.Box) and np.issubdtype(s.dtype, np.floating):
            width += 2 * int(np.prod(s.shape))
        else:
            raise UnsupportedSpaceError(type(s).__name__, "action_space", ["Box (float)", "Discrete", "MultiDiscrete",
                                                                          "MultiBinary", "Dict", "Tuple"])
    return width


def _prev_width(spec: Any) -> int:
    """The width of the previous action and reward fed to the LSTM beside the encoder's features."""
    lstm = spec.model.lstm
    width = 1 if lstm.use_prev_reward else 0
    if lstm.use_prev_action:
        act = list(leaves(spec.action_space))
        if len(act) != 1:
            raise UnsupportedSpaceError(type(spec.action_space).__name__, "$.model.lstm.use_prev_action",
                                        ["a single (non-Dict, non-Tuple) action space"])
        width += _inputs(act[0].space, conv=False)[0].shape[0]
    return width


def expected_weights(spec: Any) -> dict[str, tuple[int, ...]]:
    """``layer/weight`` -> shape of every weight the model of ``spec`` (a :class:`policy.spec.PolicySpec`)
    holds, in the model's order.

    Raises:
        UnsupportedSpaceError: an action space no distribution takes.
    """
    model = spec.model
    inputs = model_inputs(spec.observation_space, model)
    out: dict[str, tuple[int, ...]] = {}
    # the image inputs' conv stacks, layer by layer across the inputs (Keras lists a functional
    # model's layers by depth, and the stacks are equally deep), then the dense layers
    images = {i.name: i.shape for i in inputs if i.image}
    for number, (filters, (kh, kw), stride) in enumerate(model.conv_filters, start=1):
        for name, (h, w, c) in images.items():
            out[f"{name}_conv_{number}/kernel"] = (kh, kw, c, filters)
            out[f"{name}_conv_{number}/bias"] = (filters,)
            images[name] = (math.ceil(h / stride), math.ceil(w / stride), filters)  # padding="same"
    width = sum(math.prod(images[i.name]) if i.image else i.shape[0] for i in inputs)
    for number, size in enumerate(model.hiddens, start=1):
        out[f"fc_{number}/kernel"], out[f"fc_{number}/bias"] = (width, size), (size,)
        width = size
    if model.lstm is not None:
        cell, width = model.lstm.cell_size, width + _prev_width(spec)
        out.update({"lstm/kernel": (width, 4 * cell), "lstm/recurrent_kernel": (cell, 4 * cell),
                    "lstm/bias": (4 * cell,)})
        width = cell
    units = action_width(spec.action_space)
    out["fc_out/kernel"], out["fc_out/bias"] = (width, units), (units,)
    return out


def weights_problems(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> list[str]:
    """Every missing, unexpected and misshapen weight, worded and ordered as
    :meth:`TFPolicy.import_model_from_h5` reports them."""
    problems = [f"{_MISSING}{key!r}" for key in expected if key not in found]
    for key, shape in found.items():
        if key not in expected:
            problems.append(f"{_UNEXPECTED}{key!r} (the policy has no such layer weight)")
        elif tuple(shape) != tuple(expected[key]):
            problems.append(f"weight {key!r} has shape {list(shape)}, the policy expects {list(expected[key])}")
    return problems
