"""ONNX Runtime sessions: :func:`inference_session` makes every one the package runs (threads,
providers and their options, optimisation level, prepacking)."""

from __future__ import annotations

from pathlib import Path

from policy_export.errors import ExportError


def inference_session(path: str | Path | bytes, providers: list[str] | None = None, threads: int | None = None,
                      optimization: str = "all", provider_options: list[dict[str, str]] | None = None,
                      prepack: bool = True):
    """An ``onnxruntime.InferenceSession`` for a model (a path, or the bytes of one already checked
    and held in memory), with the options that matter. Every session the package runs is made
    here (the one exception, ``serve/standin_model.py``, runs inside Triton's stub process and
    imports nothing of the package).

    ``threads``: intra- and inter-op threads (``1`` gives the lowest latency for small policies
    at small batches; ``None`` keeps ONNX Runtime's default, one per core). ``optimization``:
    ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"`` (graph optimisation level).
    ``provider_options``: one dict per provider (e.g. ``DevicePlan.ort_provider_options()``, which
    pins the CUDA provider's ``use_tf32``). ``prepack=False`` keeps ONNX Runtime from holding a
    prepacked second copy of the weights.

    Raises:
        ExportError: an unknown optimisation level, or a file ONNX Runtime cannot load.
    """
    import onnxruntime as ort

    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    if optimization not in levels:
        raise ExportError(f"unknown optimisation level {optimization!r}; choose {', '.join(levels)}")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = levels[optimization]
    if not prepack:  # prepacked weights are a second copy of them: parity trades a little speed for memory
        options.add_session_config_entry("session.disable_prepacking", "1")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = threads
    model = path if isinstance(path, bytes) else str(path)
    try:
        providers = providers or ["CPUExecutionProvider"]
        if provider_options is not None:
            return ort.InferenceSession(model, options, providers=providers, provider_options=provider_options)
        return ort.InferenceSession(model, options, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types
        where = "a model held in memory" if isinstance(path, bytes) else path
        raise ExportError(f"ONNX Runtime cannot load {where}: {e}") from e
