"""Runtime op coverage before writing: a model holding an op its runtime lacks is refused with the
op named and where it sits (ONNX Runtime's CPU kernel registry, the LiteRT interpreter's op resolver)."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES_DIR


def test_every_bundled_onnx_model_is_covered_by_onnx_runtime(tmp_path):
    from policy_export.exporter import export_spec
    from policy_export.exporter.compat import import_onnx
    from policy_export.exporter.formats import coverage

    onnx = import_onnx()
    for name in ("cartpole_lstm", "dict_image_vector"):
        out = tmp_path / name
        export_spec(FIXTURES_DIR / name, out, device="cpu", samples=50, explore_samples=0,
                    formats=["onnx", "onnx_deterministic"])
        for model in ("model.onnx", "model_deterministic.onnx"):
            assert coverage.onnx_runtime_gaps(onnx.load(str(out / model))) == []


def test_an_op_missing_from_onnx_runtime_is_named_with_its_node_and_branch(monkeypatch, tmp_path):
    from policy_export.exporter.cli import main
    from policy_export.exporter.formats import coverage

    kernels = dict(coverage._ort_cpu_kernels())
    kernels.pop(("ai.onnx", "Multinomial"))  # only inside the explore branch of model.onnx
    monkeypatch.setattr(coverage, "_ort_cpu_kernels", lambda: kernels)
    out = tmp_path / "out"
    code = main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--formats", "onnx,onnx_deterministic",
                 "--samples", "50", "--explore-samples", "0", "-q"])
    assert code == 4  # the deterministic model, which holds no Multinomial, is still written and proven
    doc = json.loads((out / "manifest.json").read_text())
    why = doc["missing"]["onnx"]
    assert "ai.onnx::Multinomial (opset 17, since version 7)" in why
    assert "> If 'select_action/" in why and "then_branch" in why
    assert set(doc["formats"]) == {"onnx_deterministic"} and not (out / "model.onnx").exists()


def test_litert_refuses_a_model_with_an_op_version_its_interpreter_lacks(tmp_path):
    pytest.importorskip("flatbuffers")
    from tensorflow.lite.python import schema_py_generated as schema

    import flatbuffers
    from policy_export.errors import ConversionError
    from policy_export.exporter import export_spec
    from policy_export.exporter.formats.tflite.convert import check_litert_runs

    out = tmp_path / "out"
    result = export_spec(FIXTURES_DIR / "cartpole_mlp", out, device="cpu", samples=50, explore_samples=0,
                         formats=["tflite"])
    assert "resolved by the LiteRT interpreter" in result.manifest["formats"]["tflite"]["op_coverage"]
    data = (out / "model.tflite").read_bytes()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(data, 0))
    for code in model.operatorCodes:
        if max(code.builtinCode, code.deprecatedBuiltinCode) == schema.BuiltinOperator.FULLY_CONNECTED:
            code.version = 99
    builder = flatbuffers.Builder(0)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    with pytest.raises(ConversionError, match="no kernel for FULLY_CONNECTED version 99"):
        check_litert_runs(bytes(builder.Output()), "model.tflite")


def test_the_converters_unlowered_ops_are_named():
    from policy_export.exporter.formats.tflite.convert import _converter_problem

    message = ("Some ops are not supported by the native TFLite runtime\nerror: 'tf.StringToHashBucketFast' op is "
               'neither a custom op nor a flex op\nloc(fused["StringToHashBucketFast:", "policy/hash"]): called from')
    assert _converter_problem(RuntimeError(message)) == (
        "Some ops are not supported by the native TFLite runtime (ops LiteRT's builtins lack: StringToHashBucketFast; "
        "at StringToHashBucketFast:)")
