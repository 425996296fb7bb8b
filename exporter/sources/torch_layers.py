"""torch's layers as TF graph ops, on weights read from a ``state_dict`` without torch: the kit of
every source that rebuilds a torch network (RLlib's new API stack, Stable-Baselines3).

- :class:`TorchWeights`: a state dict taken by name with the shape the network implies, each
  float weight used only where float32 holds it exactly; what was used is kept for the record;
- :data:`TORCH_ACTIVATIONS`: torch's activation modules by class name (with torch's defaults:
  LeakyReLU's slope 0.01, exact GELU), and RLlib's lower-case names for them;
- :func:`linear`, :func:`sequential_mlp` (a ``Sequential`` of Linear, optional LayerNorm and
  activation modules, numbered as torch numbers them), :func:`lstm_step` (``torch.nn.LSTM``, one
  step of one layer: gates i, f, g, o, both biases), :func:`conv2d` (``torch.nn.Conv2d`` on NCHW
  input, computed in NHWC as TensorFlow's CPU kernels need, and given back in NCHW so that a
  ``Flatten`` after it keeps torch's order).

Importing it does not load TensorFlow (``inspect`` reads :data:`TORCH_ACTIVATIONS`' names): a
function imports it when it builds an op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from policy_export.errors import WeightsError
from policy_export.policy.exact import exact_cast

if TYPE_CHECKING:
    import tensorflow as tf

def _tf():
    import tensorflow as tf  # noqa: PLC0415 - the names below are read without TensorFlow (inspect)

    return tf


def _gelu(x):
    """torch's exact GELU, ``x * (1 + erf(x / sqrt(2))) / 2``, with ``Erf`` (TF's own exact gelu
    uses ``Erfc``, which ONNX Runtime has no kernel for)."""
    tf = _tf()
    return 0.5 * x * (1.0 + tf.math.erf(x * 0.7071067811865476))


# torch.nn's activation modules by class name, as torch computes them with their defaults, and the
# lower-case names RLlib's get_activation_fn(framework="torch") takes; None is linear. Its keys are
# read without TensorFlow (inspect); a function imports it when it builds the op
TORCH_ACTIVATIONS = {
    None: None, "linear": None, "Identity": None,
    "swish": lambda x: _tf().nn.silu(x), "silu": lambda x: _tf().nn.silu(x), "SiLU": lambda x: _tf().nn.silu(x),
    "relu": lambda x: _tf().nn.relu(x), "ReLU": lambda x: _tf().nn.relu(x),
    "tanh": lambda x: _tf().tanh(x), "Tanh": lambda x: _tf().tanh(x),
    "elu": lambda x: _tf().nn.elu(x), "ELU": lambda x: _tf().nn.elu(x), "CELU": lambda x: _tf().nn.elu(x),
    "Sigmoid": lambda x: _tf().sigmoid(x), "SELU": lambda x: _tf().nn.selu(x),
    "Softplus": lambda x: _tf().nn.softplus(x), "Softsign": lambda x: _tf().nn.softsign(x),
    "ReLU6": lambda x: _tf().nn.relu6(x), "GELU": lambda x: _gelu(x),
    "LeakyReLU": lambda x: _tf().nn.leaky_relu(x, alpha=0.01),
    "Mish": lambda x: x * _tf().tanh(_tf().nn.softplus(x)),
    "Hardtanh": lambda x: _tf().clip_by_value(x, -1.0, 1.0),
    "Hardswish": lambda x: x * _tf().nn.relu6(x + 3.0) / 6.0,
    "Hardsigmoid": lambda x: _tf().nn.relu6(x + 3.0) / 6.0,
    "LogSigmoid": lambda x: _tf().math.log_sigmoid(x), "Tanhshrink": lambda x: x - _tf().tanh(x),
}


class TorchWeights:
    """A ``state_dict`` taken by name with the shape the network gives; which were used is kept."""

    def __init__(self, weights: dict[str, np.ndarray], where: str):
        self.weights, self.where, self.used = weights, where, []

    def has(self, name: str) -> bool:
        return name in self.weights

    def take(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """The weight ``name`` as float32, after checking its shape (and that float32 holds it exactly).

        Raises:
            WeightsError: no such weight, another shape, not float, or not exact in float32.
        """
        if name not in self.weights:
            raise WeightsError(self.where, [f"the network implies a weight {name} {list(shape)}, which the state "
                                            f"does not hold (it holds {', '.join(sorted(self.weights))[:600]})"])
        value = self.weights[name]
        if tuple(value.shape) != tuple(shape):
            raise WeightsError(self.where, [f"weight {name} has shape {list(value.shape)}, the network implies "
                                            f"{list(shape)}"])
        exact, problem = exact_cast(value, np.float32) if value.dtype.kind == "f" else (None, f"is {value.dtype}, not "
                                                                                             "a float array")
        if problem is not None:
            raise WeightsError(self.where, [f"weight {name} {problem}"])
        self.used.append(name)
        return exact

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of weight ``name``, or None (the network's sizes read from its weights)."""
        value = self.weights.get(name)
        return None if value is None else tuple(int(d) for d in value.shape)

    def prefixes(self, *candidates: str) -> list[str]:
        return [p for p in candidates if any(k.startswith(p + ".") for k in self.weights)]


def linear(x: tf.Tensor, w: TorchWeights, prefix: str, units: int) -> tf.Tensor:
    """``torch.nn.Linear`` under ``prefix`` (its weight is ``[out, in]``)."""
    tf = _tf()
    kernel = w.take(f"{prefix}.weight", (units, int(x.shape[-1])))
    return tf.matmul(x, kernel.T) + w.take(f"{prefix}.bias", (units,))


def layer_norm(x: tf.Tensor, gamma: np.ndarray, beta: np.ndarray, eps: float) -> tf.Tensor:
    tf = _tf()
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) / tf.sqrt(var + eps) * gamma + beta


def sequential_mlp(x: tf.Tensor, w: TorchWeights, prefix: str, sizes: Sequence[int], activation: Any,
                   layernorm_eps: float | None = None, output: int | None = None, output_activation: Any = None
                   ) -> tf.Tensor:
    """A ``Sequential`` under ``prefix`` (``<prefix>.<i>.weight``): each of ``sizes`` a Linear, an
    optional LayerNorm (``layernorm_eps`` given) and ``activation``; then, when ``output`` is given,
    a Linear of that width and ``output_activation`` (a ``Tanh`` after it, say). The indices count
    every module, activations too."""
    index = 0
    layers = [(n, True) for n in sizes] + ([(output, False)] if output is not None else [])
    for units, hidden in layers:
        x = linear(x, w, f"{prefix}.{index}", units)
        index += 1
        if hidden and layernorm_eps is not None:
            x = layer_norm(x, w.take(f"{prefix}.{index}.weight", (units,)), w.take(f"{prefix}.{index}.bias", (units,)),
                           layernorm_eps)
            index += 1
        act = activation if hidden else output_activation
        if act is not None:
            x = act(x)
            index += 1
    return x


def lstm_step(x: tf.Tensor, h: tf.Tensor, c: tf.Tensor, w: TorchWeights, prefix: str, cell: int, layer: int = 0):
    """One step of one layer of ``torch.nn.LSTM``: gates ``i, f, g, o``; returns ``(h, c)``."""
    tf = _tf()
    width = int(x.shape[-1])
    gates = (tf.matmul(x, w.take(f"{prefix}.weight_ih_l{layer}", (4 * cell, width)).T)
             + w.take(f"{prefix}.bias_ih_l{layer}", (4 * cell,))
             + tf.matmul(h, w.take(f"{prefix}.weight_hh_l{layer}", (4 * cell, cell)).T)
             + w.take(f"{prefix}.bias_hh_l{layer}", (4 * cell,)))
    i, f, g, o = tf.split(gates, 4, axis=-1)
    c2 = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
    return tf.sigmoid(o) * tf.tanh(c2), c2


def conv2d(x: tf.Tensor, w: TorchWeights, prefix: str, filters: int, kernel: int, stride: int) -> tf.Tensor:
    """``torch.nn.Conv2d(in, filters, kernel, stride, padding=0)`` on NCHW ``x``; NCHW out."""
    tf = _tf()
    channels = int(x.shape[1])
    weight = w.take(f"{prefix}.weight", (filters, channels, kernel, kernel))  # [out, in, kh, kw]
    nhwc = tf.transpose(x, [0, 2, 3, 1])
    y = tf.nn.conv2d(nhwc, np.transpose(weight, (2, 3, 1, 0)), strides=stride, padding="VALID")
    y = y + w.take(f"{prefix}.bias", (filters,))
    return tf.transpose(y, [0, 3, 1, 2])


def flatten(x: tf.Tensor) -> tf.Tensor:
    """``torch.nn.Flatten``: every axis after the batch, in row-major order."""
    tf = _tf()
    width = int(np.prod(x.shape.as_list()[1:]))
    return tf.reshape(x, (-1, width))
