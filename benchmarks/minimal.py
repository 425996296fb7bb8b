"""The smallest ONNX graph that computes an MLP policy's deterministic action with given weights.

Gemm and the activation per layer, then ArgMax (Discrete) or the clipped mean (Box): the yardstick
for how lean an exported model is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gymnasium as gym
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_ACTIVATION = {"tanh": "Tanh", "relu": "Relu", "elu": "Elu"}


def minimal_mlp(weights: Mapping[str, np.ndarray], hiddens: Sequence[int], activation: str,
                obs_dim: int, action_space: gym.Space, opset: int = 17) -> onnx.ModelProto:
    """Input ``observations`` [batch, obs_dim] float32; output ``actions_0``."""
    nodes, inits = [], []
    x = "observations"
    layers = [f"fc_{i}" for i in range(1, len(hiddens) + 1)] + ["fc_out"]
    for name in layers:
        inits += [numpy_helper.from_array(np.asarray(weights[f"{name}/kernel"], np.float32), f"{name}_w"),
                  numpy_helper.from_array(np.asarray(weights[f"{name}/bias"], np.float32), f"{name}_b")]
        nodes.append(helper.make_node("Gemm", [x, f"{name}_w", f"{name}_b"], [f"{name}_z"]))
        x = f"{name}_z"
        if name != "fc_out" and activation != "linear":
            if activation == "swish":
                nodes += [helper.make_node("Sigmoid", [x], [f"{name}_s"]),
                          helper.make_node("Mul", [x, f"{name}_s"], [f"{name}_a"])]
            else:
                nodes.append(helper.make_node(_ACTIVATION[activation], [x], [f"{name}_a"]))
            x = f"{name}_a"
    if isinstance(action_space, gym.spaces.Discrete):
        nodes.append(helper.make_node("ArgMax", [x], ["actions_0"], axis=1, keepdims=0))
        out = helper.make_tensor_value_info("actions_0", TensorProto.INT64, ["batch"])
    elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
        d = action_space.shape[0]
        inits += [numpy_helper.from_array(np.array([0], np.int64), "s0"),
                  numpy_helper.from_array(np.array([d], np.int64), "s1"),
                  numpy_helper.from_array(np.array([1], np.int64), "ax"),
                  numpy_helper.from_array(np.asarray(action_space.low, np.float32), "low"),
                  numpy_helper.from_array(np.asarray(action_space.high, np.float32), "high")]
        nodes += [helper.make_node("Slice", [x, "s0", "s1", "ax"], ["mean"]),
                  helper.make_node("Max", ["mean", "low"], ["lo"]),
                  helper.make_node("Min", ["lo", "high"], ["actions_0"])]
        out = helper.make_tensor_value_info("actions_0", TensorProto.FLOAT, ["batch", d])
    else:
        raise ValueError(f"no minimal graph for action space {action_space}")
    graph = helper.make_graph(nodes, "minimal", [helper.make_tensor_value_info(
        "observations", TensorProto.FLOAT, ["batch", obs_dim])], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model
