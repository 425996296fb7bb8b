"""When an ONNX model fails parity, the report names the first tensor where it leaves the TF graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from policy_export.exporter import api, export_policy, formats
from helpers import copy_of, resign, verify_cli

FAULTY_WEIGHT = "fc_2/kernel:0"  # the second hidden layer's kernel (initializers are named after the variables)


def inject_fault(path: Path, initializer: str = FAULTY_WEIGHT, delta: float = 0.5) -> None:
    """Change one weight of one node of an ONNX file in place."""
    model = onnx.load(str(path))
    target = next(i for i in model.graph.initializer if i.name == initializer)
    values = numpy_helper.to_array(target).copy()
    values.flat[0] += delta
    target.CopyFrom(numpy_helper.from_array(values, target.name))
    onnx.save(model, str(path))


def test_export_names_the_node_where_onnx_diverges(policies, tmp_path, monkeypatch):
    real = formats.get("onnx").write

    def faulty(ctx, target):
        record = real(ctx, target)
        inject_fault(target)
        return record

    monkeypatch.setattr(formats.get("onnx"), "write", faulty)
    with pytest.raises(api.ParityFailedError) as info:
        export_policy(policies("cartpole_mlp"), tmp_path / "x", formats=["frozen_graph", "onnx"], samples=64,
                      explore_samples=0, device="cpu")
    (entry,) = info.value.report.localization
    assert entry["format"] == "onnx" and entry["compared"] >= 5
    assert entry["first"]["tf_node"] == "base_model/fc_2/MatMul" and entry["first"]["onnx_op"] == "MatMul"
    assert entry["first"]["max_abs_err"] > 1e-3
    assert "first divergence at tensor base_model/fc_2/MatMul:0" in str(info.value)
    assert not (tmp_path / "x").exists()


def test_export_localizes_even_without_a_frozen_graph_format(policies, tmp_path, monkeypatch):
    real = formats.get("onnx").write
    monkeypatch.setattr(formats.get("onnx"), "write", lambda ctx, target: (real(ctx, target), inject_fault(target))[0])
    with pytest.raises(api.ParityFailedError) as info:
        export_policy(policies("cartpole_mlp"), tmp_path / "x", formats=["onnx"], samples=32, explore_samples=0,
                      device="cpu")
    assert info.value.report.localization[0]["first"]["tf_node"] == "base_model/fc_2/MatMul"


def test_verify_localize_names_the_faulty_node_of_a_resigned_export(exports, tmp_path):
    export = copy_of(exports, "pendulum_mlp", tmp_path)
    inject_fault(export / "model.onnx")
    resign(export)
    code, report = verify_cli(str(export), "--localize", tmp_path=tmp_path)
    assert code == 1
    (entry,) = [e for e in report["localization"] if e["format"] == "onnx"]
    assert entry["first"]["tensor"] == "base_model/fc_2/MatMul:0"
    # the deterministic model was not touched: its shared tensors all agree
    (det,) = [e for e in report["localization"] if e["format"] == "onnx_deterministic"]
    assert det["first"] is None and det["compared"] >= 5


def test_verify_localize_on_a_clean_export_finds_nothing(exports, tmp_path):
    _, out = exports("cartpole_mlp")
    code, report = verify_cli(str(out), "--localize", tmp_path=tmp_path)
    assert code == 0
    assert {e["format"] for e in report["localization"]} == {"onnx", "onnx_deterministic"}
    assert all(e["first"] is None and e["compared"] > 0 for e in report["localization"])


def test_localize_compares_in_topological_order(exports, tmp_path):
    """Two faults: the one nearer the inputs is named."""
    from policy_export.exporter.parity.localize import localize
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.parity.compare import Tolerance

    export = copy_of(exports, "cartpole_mlp", tmp_path)
    inject_fault(export / "model.onnx", "fc_out/kernel:0")
    inject_fault(export / "model.onnx", "fc_1/kernel:0", delta=0.25)
    feeds = dict(np.load(export / "parity" / "inputs.npz"))
    result = localize(export / "frozen_graph.pb", export / "model.onnx",
                      read_manifest(export)["tensor_names"]["inputs"], feeds, Tolerance(1e-5, 1e-5))
    assert result.first.tf_node == "base_model/fc_1/MatMul"
