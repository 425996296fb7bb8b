"""Device plans: TF32 is pinned off on both runtimes unless asked for, and every report says so."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES_DIR

from policy_export.exporter.formats.onnx import model as onnx_model
from policy_export.exporter.api import tf32_tolerances
from policy_export.exporter.devices import CPU_PROVIDER, CUDA_PROVIDER, TF32_TOLERANCE, DevicePlan, plan_devices
from policy_export.exporter.parity.compare import Tolerance, Tolerances


@pytest.fixture
def tf32_switch():
    import tensorflow as tf

    before = tf.config.experimental.tensor_float_32_execution_enabled()
    yield tf.config.experimental.tensor_float_32_execution_enabled
    tf.config.experimental.enable_tensor_float_32_execution(before)


def test_tensorflow_tf32_switch_follows_the_plan(tf32_switch):
    assert plan_devices("cpu").allow_tf32 is False and tf32_switch() is False
    assert plan_devices("cpu", allow_tf32=True).allow_tf32 is True and tf32_switch() is True
    assert plan_devices("auto").allow_tf32 is False and tf32_switch() is False


GPU_PLAN = DevicePlan("gpu", "/GPU:0", (CUDA_PROVIDER, CPU_PROVIDER), False, "NVIDIA H100")


@pytest.mark.parametrize("allow, value", [(False, "0"), (True, "1")])
def test_onnxruntime_cuda_provider_gets_use_tf32(allow, value, exports, monkeypatch):
    import onnxruntime as ort

    plan = DevicePlan("gpu", "/GPU:0", (CUDA_PROVIDER, CPU_PROVIDER), allow, "NVIDIA H100")
    assert plan.ort_provider_options() == [{"use_tf32": value}, {}]
    seen = {}
    real = ort.InferenceSession

    def spy(path, options, providers=None, provider_options=None):
        seen.update(providers=providers, provider_options=provider_options)
        return real(path, options, providers=[CPU_PROVIDER])  # no CUDA on this machine

    monkeypatch.setattr(ort, "InferenceSession", spy)
    _, out = exports("cartpole_mlp")
    onnx_model.OnnxRunner(out / "model.onnx", plan)
    assert seen == {"providers": [CUDA_PROVIDER, CPU_PROVIDER], "provider_options": [{"use_tf32": value}, {}]}


def test_cpu_plan_gives_no_cuda_options_and_tf32_is_inactive():
    plan = plan_devices("cpu", allow_tf32=True)
    assert plan.ort_provider_options() == [{}]
    assert not plan.tf32_active  # nothing computes in TF32 on a CPU


def test_tolerances_are_raised_only_where_tf32_computes():
    given = Tolerances(Tolerance(1e-5, 1e-5), {"action_logp": Tolerance(1e-4, 0.0)})
    assert tf32_tolerances(given, plan_devices("cpu", allow_tf32=True)) == given
    assert tf32_tolerances(given, GPU_PLAN) == given  # TF32 off on the GPU
    raised = tf32_tolerances(given, DevicePlan("gpu", "/GPU:0", (CUDA_PROVIDER, CPU_PROVIDER), True, "x"))
    assert raised.default == Tolerance(TF32_TOLERANCE, TF32_TOLERANCE)
    assert raised.per_output == given.per_output


def test_reports_record_the_setting_and_the_gpu(tmp_path):
    from policy_export.exporter import cli

    out = tmp_path / "out"
    assert cli.main(["export", str(FIXTURES_DIR / "cartpole_mlp"), "--out", str(out), "--samples", "32",
                     "--explore-samples", "0", "--device", "cpu", "--report-json", str(tmp_path / "r.json")]) == 0
    devices = json.loads((tmp_path / "r.json").read_text())["devices"]
    assert devices["allow_tf32"] is False and devices["gpu_name"] is None
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["parity"]["devices"]["allow_tf32"] is False
    assert cli.main(["verify", str(out), "--device", "cpu", "--allow-tf32",
                     "--report-json", str(tmp_path / "v.json")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())["devices"]["allow_tf32"] is True


def test_plan_passes_through():
    plan = plan_devices("cpu")
    assert plan_devices(plan) is plan


@pytest.mark.gpu
def test_gpu_parity_with_tf32_pinned_off(tmp_path):
    from policy_export.exporter import export_spec

    result = export_spec(FIXTURES_DIR / "pendulum_mlp", tmp_path / "g", device="gpu", samples=500)
    assert result.parity.passed
    assert result.parity.devices["allow_tf32"] is False and result.parity.devices["gpu_name"]
