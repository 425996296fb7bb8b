"""The OpenVINO IR formats (openvino, openvino_bf16): export, parity, verify, candidates, file checks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

ov = pytest.importorskip("openvino", reason="OpenVINO is not installed in this environment")

from conftest import FIXTURES_DIR, spec_exports  # noqa: E402

FIXTURES = ["cartpole_mlp", "pendulum_mlp", "cartpole_lstm", "dict_image_vector", "tuple_action"]


@pytest.fixture(scope="module")
def ov_exports(tmp_path_factory):
    """Each fixture exported once with the SavedModel and both IR formats."""
    return spec_exports(tmp_path_factory, "openvino", {"samples": 300, "explore_samples": 2000,
                                                       "formats": ["saved_model", "openvino", "openvino_bf16"]})


def _max_err(records, fmt: str, key: str) -> float:
    return max(r.max_abs_err for r in records if r.format == fmt and r.key == key)


@pytest.mark.parametrize("name", FIXTURES)
def test_openvino_export_parity_and_precision(name, ov_exports):
    result, out = ov_exports(name)
    doc = json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in (out / "openvino").iterdir()) == ["model.bin", "model.xml"]
    record = doc["formats"]["openvino"]
    assert record["inference_precision"] == "f32" and record["openvino"] == ov.__version__
    assert doc["formats"]["openvino_bf16"]["inference_precision"] == "bf16"
    assert record["inputs"] == [s["key"] for s in doc["contract"]["inputs"]]
    assert record["explores"] is False and "deterministic path" in record["explores_reason"]
    devices = result.parity.devices
    assert devices["openvino_inference_precision"] == "f32"
    ours = [r for r in result.parity.records if r.format.startswith("openvino") and not r.format.startswith("openvino_")]
    assert ours and all(r.passed for r in ours)
    f32 = _max_err(ours, "openvino", "action_dist_inputs")
    assert f32 <= 1e-5
    if "state_out_0" in record["outputs"]:
        assert any("stepped" in r.format for r in ours)
    bf16 = [b for b in result.parity.behaviour if b.format.startswith("openvino_bf16")]
    assert bf16 and all(b.passed for b in bf16)
    if devices["openvino_bf16_inference_precision"] == "bf16":  # really computed in bfloat16
        dist = max(b.max_abs_err for b in bf16 if b.key == "action_dist_inputs")
        assert dist > 10 * max(f32, 1e-7), (dist, f32)
    else:
        assert "openvino_bf16_precision_fallback" in devices


def test_runner_feeds_by_key_and_reports_precision(ov_exports):
    from policy_export.exporter.formats import get
    from policy_export.exporter.devices import plan_devices

    _, out = ov_exports("cartpole_lstm")
    doc = json.loads((out / "manifest.json").read_text())
    with get("openvino").open(out / "openvino", doc, plan_devices("cpu")) as runner:
        assert runner.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
        feeds = {"observations": np.zeros((2, 4), np.float32), "state_in_0": np.zeros((2, 32), np.float32),
                 "state_in_1": np.zeros((2, 32), np.float32), "seq_lens": np.ones(2, np.int32),
                 "prev_action": np.zeros(2, np.int64), "prev_reward": np.zeros(2, np.float32)}
        got = runner({**feeds, "explore": np.array(False)})  # an optional input, fed its default
        assert got["state_out_0"].shape == (2, 32) and got["actions_0"].dtype == np.int64
        from policy_export.errors import InputError

        with pytest.raises(InputError, match="only its default"):
            runner({**feeds, "explore": np.array(True)})


def test_verify_detects_tampered_bin(ov_exports, tmp_path):
    from policy_export.exporter.cli import main

    _, out = ov_exports("cartpole_mlp")
    assert main(["verify", str(out)]) == 0
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with open(copy / "openvino" / "model.bin", "r+b") as f:
        f.seek(8)
        f.write(b"\x7f\x7f\x7f\x7f")
    assert main(["verify", str(copy)]) == 1


def test_candidate_ir_checked_from_contract(ov_exports, tmp_path):
    """A user's own IR directory is checked against an export that does not hold the format."""
    from policy_export.exporter import export_spec
    from policy_export.exporter.cli import main

    _, with_ir = ov_exports("pendulum_mlp")
    plain = tmp_path / "plain"
    export_spec(FIXTURES_DIR / "pendulum_mlp", plain, device="cpu", samples=100, explore_samples=500,
                formats=["saved_model"])
    ir = tmp_path / "ir"
    shutil.copytree(with_ir / "openvino", ir)
    assert main(["verify", str(plain), "--candidate", f"openvino={ir}"]) == 0
    assert main(["verify", str(plain), "--candidate", f"openvino_bf16={ir}"]) == 0
    _, cartpole = ov_exports("cartpole_mlp")
    assert main(["verify", str(plain), "--candidate", f"openvino={cartpole / 'openvino'}"]) == 1  # another policy's
    data = bytearray((ir / "model.bin").read_bytes())
    weights = np.frombuffer(bytes(data[: len(data) // 4 * 4]), np.float32).copy()
    weights *= 1.5
    (ir / "model.bin").write_bytes(weights.tobytes() + bytes(data[len(weights) * 4:]))
    assert main(["verify", str(plain), "--candidate", f"openvino={ir}"]) == 1  # perturbed
    assert main(["verify", str(plain), "--candidate", f"onnx={ir}"]) == 2  # other formats: still refused


def test_ir_directory_checks(ov_exports, tmp_path):
    from policy_export.errors import ExportError
    from policy_export.exporter.formats.openvino.runner import read_ir

    _, out = ov_exports("cartpole_mlp")
    xml, weights = read_ir(out / "openvino")
    assert xml.lstrip().startswith(b"<?xml") and weights
    extra = tmp_path / "extra"
    shutil.copytree(out / "openvino", extra)
    (extra / "notes.txt").write_text("x")
    with pytest.raises(ExportError, match="notes.txt"):
        read_ir(extra)
    doctype = tmp_path / "doctype"
    shutil.copytree(out / "openvino", doctype)
    (doctype / "model.xml").write_bytes(b'<?xml version="1.0"?><!DOCTYPE net [<!ENTITY a "b">]><net/>')
    with pytest.raises(ExportError, match="DOCTYPE or ENTITY"):
        read_ir(doctype)
    linked = tmp_path / "linked"
    linked.mkdir()
    shutil.copy(out / "openvino" / "model.xml", linked / "model.xml")
    (linked / "model.bin").symlink_to(out / "openvino" / "model.bin")
    with pytest.raises(ExportError, match="link|regular"):
        read_ir(linked)


def test_unsupported_op_is_refused_naming_it(ov_exports):
    from policy_export.errors import ConversionError
    from policy_export.exporter.formats.openvino.convert import check_ops

    _, out = ov_exports("cartpole_mlp")
    core = ov.Core()
    model = core.read_model(str(out / "openvino" / "model.xml"))
    victim = next(op for op in model.get_ops() if op.get_type_name() == "MatMul")

    class Core:
        def query_model(self, m, device):
            supported = core.query_model(m, device)
            supported.pop(victim.get_friendly_name())
            return supported

    with pytest.raises(ConversionError) as e:
        check_ops(Core(), model)
    text = str(e.value)
    assert "MatMul" in text and victim.get_friendly_name() in text and "action_dist_inputs" in text


def test_default_precision_and_what_pinning_avoids(ov_exports):
    """OpenVINO's CPU default precision on this machine; where it is bfloat16, pinning f32 is what
    keeps the IR within float tolerances."""
    _, out = ov_exports("pendulum_mlp")
    core = ov.Core()
    model = core.read_model(str(out / "openvino" / "model.xml"))
    obs = np.random.default_rng(0).uniform(-1, 1, (256, 3)).astype(np.float32)

    def run(config):
        compiled = core.compile_model(model, "CPU", config)
        res = compiled.create_infer_request().infer({"observations": obs})
        port = next(p for p in compiled.outputs if p.get_any_name() == "action_dist_inputs")
        return str(compiled.get_property("INFERENCE_PRECISION_HINT")), np.asarray(res[port]).copy()

    default_precision, default = run({})
    pinned_precision, pinned = run({"INFERENCE_PRECISION_HINT": "f32"})
    bf16_precision, bf16 = run({"INFERENCE_PRECISION_HINT": "bf16"})
    assert "float32" in pinned_precision
    if "bfloat16" in default_precision:
        assert np.abs(default - pinned).max() > 1e-3  # what the pinned hint avoids
    else:
        assert "float32" in default_precision and np.abs(default - pinned).max() <= 1e-6
    if "bfloat16" in bf16_precision:
        assert np.abs(bf16 - pinned).max() > 1e-3
