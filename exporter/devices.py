"""Choose where TensorFlow and ONNX Runtime run: the GPU where one is visible, else the CPU.

Precision on the GPU is pinned, not left to defaults. On Ampere and later GPUs TensorFlow runs
float32 matmuls and convolutions in TF32 (10 mantissa bits) unless told otherwise, and ONNX
Runtime's CUDA provider has its own ``use_tf32`` option; parity between the two at 1e-5 would then
fail, or pass by luck. A :class:`DevicePlan` turns TF32 off on both sides unless ``allow_tf32``
is set, and records the setting and the GPU's name in every report.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy_export.errors import DeviceError

DEVICE_CHOICES = ("auto", "cpu", "gpu")
CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


TF32_TOLERANCE = 1e-2  # default atol and rtol when TF32 runs on a GPU: 10 mantissa bits, accumulated


@dataclass(frozen=True)
class DevicePlan:
    """TF device string, ONNX Runtime providers (in preference order) and the TF32 setting for one run."""

    requested: str
    tf_device: str
    ort_providers: tuple[str, ...]
    allow_tf32: bool = False
    gpu_name: str | None = None

    @property
    def tf_uses_gpu(self) -> bool:
        return "GPU" in self.tf_device.upper()

    @property
    def ort_uses_gpu(self) -> bool:
        return self.ort_providers[0] == CUDA_PROVIDER

    @property
    def tf32_active(self) -> bool:
        """TF32 can change results only where it is allowed and a GPU computes."""
        return self.allow_tf32 and (self.tf_uses_gpu or self.ort_uses_gpu)

    def ort_provider_options(self) -> list[dict[str, str]]:
        """``provider_options`` for ``onnxruntime.InferenceSession``, one dict per provider."""
        return [{"use_tf32": "1" if self.allow_tf32 else "0"} if p == CUDA_PROVIDER else {}
                for p in self.ort_providers]

    def apply_tf(self) -> None:
        """Set TensorFlow's process-wide TF32 switch to this plan's setting (a plan for ONNX Runtime
        alone, :func:`plan_ort_devices`, leaves TensorFlow unloaded)."""
        if not self.tf_device:
            return
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(self.allow_tf32)

    def to_json(self) -> dict:
        return {"requested": self.requested, "tf_device": self.tf_device,
                "onnxruntime_providers": list(self.ort_providers), "allow_tf32": self.allow_tf32,
                "gpu_name": self.gpu_name}


def gpu_availability() -> tuple[bool, bool]:
    """``(tf_has_gpu, onnxruntime_has_cuda)`` on this machine, right now."""
    import onnxruntime as ort
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU")), CUDA_PROVIDER in ort.get_available_providers()


def gpu_name() -> str | None:
    """The first GPU's name as TensorFlow reports it, or None."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    try:
        return tf.config.experimental.get_device_details(gpus[0]).get("device_name", gpus[0].name)
    except (ValueError, RuntimeError):
        return gpus[0].name


def plan_devices(requested: "str | DevicePlan" = "auto", allow_tf32: bool = False) -> DevicePlan:
    """A :class:`DevicePlan` for ``auto`` (GPU where each runtime has one), ``cpu`` or ``gpu``, with
    TF32 off unless ``allow_tf32``; TensorFlow's switch is set to match. A plan given as
    ``requested`` is applied and returned as it is.

    Raises:
        DeviceError: an unknown choice, or ``gpu`` where TF or ONNX Runtime has no GPU.
    """
    if isinstance(requested, DevicePlan):
        plan = requested
    elif requested not in DEVICE_CHOICES:
        raise DeviceError(f"unknown device {requested!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    elif requested == "cpu":
        plan = DevicePlan("cpu", "/CPU:0", (CPU_PROVIDER,), allow_tf32)
    else:
        tf_gpu, ort_gpu = gpu_availability()
        if requested == "gpu" and not (tf_gpu and ort_gpu):
            missing = [name for name, ok in (("TensorFlow", tf_gpu), ("ONNX Runtime (CUDAExecutionProvider)", ort_gpu))
                       if not ok]
            raise DeviceError(f"device 'gpu' requested but no GPU is visible to {' and '.join(missing)}")
        plan = DevicePlan(
            requested,
            "/GPU:0" if tf_gpu else "/CPU:0",
            (CUDA_PROVIDER, CPU_PROVIDER) if ort_gpu else (CPU_PROVIDER,),
            allow_tf32,
            gpu_name() if tf_gpu else None,
        )
    plan.apply_tf()
    return plan


def plan_ort_devices(requested: str = "auto", allow_tf32: bool = False) -> DevicePlan:
    """A :class:`DevicePlan` for ONNX Runtime alone (a model file checked against a recording):
    its CUDA provider where ``auto`` finds one or ``gpu`` asks for it; TensorFlow is not loaded.

    Raises:
        DeviceError: an unknown choice, or ``gpu`` where ONNX Runtime has no CUDA provider.
    """
    import onnxruntime as ort

    if requested not in DEVICE_CHOICES:
        raise DeviceError(f"unknown device {requested!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    cuda = requested != "cpu" and CUDA_PROVIDER in ort.get_available_providers()
    if requested == "gpu" and not cuda:
        raise DeviceError("device 'gpu' requested but no GPU is visible to ONNX Runtime (CUDAExecutionProvider)")
    return DevicePlan(requested, "", (CUDA_PROVIDER, CPU_PROVIDER) if cuda else (CPU_PROVIDER,), allow_tf32)

