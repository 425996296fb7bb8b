"""Choose where TensorFlow and ONNX Runtime run: the GPU where one is visible, else the CPU."""

from __future__ import annotations

from dataclasses import dataclass

from policy_export.policy.errors import DeviceError

DEVICE_CHOICES = ("auto", "cpu", "gpu")
CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


@dataclass(frozen=True)
class DevicePlan:
    """TF device string and ONNX Runtime providers (in preference order) for one run."""

    requested: str
    tf_device: str
    ort_providers: tuple[str, ...]

    @property
    def tf_uses_gpu(self) -> bool:
        return "GPU" in self.tf_device.upper()

    @property
    def ort_uses_gpu(self) -> bool:
        return self.ort_providers[0] == CUDA_PROVIDER

    def to_json(self) -> dict:
        return {"requested": self.requested, "tf_device": self.tf_device,
                "onnxruntime_providers": list(self.ort_providers)}


def gpu_availability() -> tuple[bool, bool]:
    """``(tf_has_gpu, onnxruntime_has_cuda)`` on this machine, right now."""
    import onnxruntime as ort
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU")), CUDA_PROVIDER in ort.get_available_providers()


def plan_devices(requested: str = "auto") -> DevicePlan:
    """A :class:`DevicePlan` for ``auto`` (GPU where each runtime has one), ``cpu`` or ``gpu``.

    Raises:
        DeviceError: an unknown choice, or ``gpu`` where TF or ONNX Runtime has no GPU.
    """
    if requested not in DEVICE_CHOICES:
        raise DeviceError(f"unknown device {requested!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    if requested == "cpu":
        return DevicePlan("cpu", "/CPU:0", (CPU_PROVIDER,))
    tf_gpu, ort_gpu = gpu_availability()
    if requested == "gpu" and not (tf_gpu and ort_gpu):
        missing = [name for name, ok in (("TensorFlow", tf_gpu), ("ONNX Runtime (CUDAExecutionProvider)", ort_gpu)) if not ok]
        raise DeviceError(f"device 'gpu' requested but no GPU is visible to {' and '.join(missing)}")
    return DevicePlan(
        requested,
        "/GPU:0" if tf_gpu else "/CPU:0",
        (CUDA_PROVIDER, CPU_PROVIDER) if ort_gpu else (CPU_PROVIDER,),
    )
