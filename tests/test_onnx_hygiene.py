"""ONNX files hold no dead weight, and the deterministic model loads in ONNX Runtime without a warning."""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest

from conftest import FIXTURES

FILES = ["model.onnx", "model_deterministic.onnx"]


def _consumed(graph: onnx.GraphProto) -> set[str]:
    """Every name a node reads, in the graph and in its subgraphs (If/Loop bodies)."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                names |= _consumed(sub)
    return names


@pytest.mark.parametrize("filename", FILES)
@pytest.mark.parametrize("name", FIXTURES)
def test_no_unused_initializers(name, filename, exports):
    _, out = exports(name)
    model = onnx.load(out / filename)
    graph_inputs = {i.name for i in model.graph.input}
    used = _consumed(model.graph) | {o.name for o in model.graph.output}
    # an initializer is either read by a node or backs an optional graph input (its default)
    dead = [i.name for i in model.graph.initializer if i.name not in used and i.name not in graph_inputs]
    assert dead == [], f"{filename} holds initializers nothing reads: {dead}"
    if filename == "model_deterministic.onnx":
        assert not {i.name for i in model.graph.initializer} & graph_inputs, "no optional inputs in it"


_LOAD = """
import sys, onnxruntime as ort
so = ort.SessionOptions()
so.log_severity_level = {level}
ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
print("loaded")
"""


def _load_log(path, level: int) -> str:
    run = subprocess.run([sys.executable, "-c", _LOAD.format(level=level), str(path)],
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "loaded"
    return run.stderr


@pytest.mark.parametrize("name", ["cartpole_mlp", "pendulum_mlp", "cartpole_lstm", "image_uint8"])
def test_deterministic_model_loads_without_warnings(name, exports):
    _, out = exports(name)
    assert "[W:onnxruntime" not in _load_log(out / "model_deterministic.onnx", level=1)


def test_model_onnx_warns_about_its_optional_inputs_unless_silenced(exports):
    _, out = exports("cartpole_mlp")
    log = _load_log(out / "model.onnx", level=1)
    # the optional inputs are initializer-backed graph inputs, which ONNX Runtime points out
    assert "[W:onnxruntime" in log and "Initializer explore appears in graph inputs" in log
    assert "[W:onnxruntime" not in _load_log(out / "model.onnx", level=3)
