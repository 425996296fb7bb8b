"""Runtime op coverage, checked before a model is written for a runtime: every op of the model
against what the runtime itself registers, so that an explicitly requested format is refused
with the op named and where it sits instead of failing at load or computing something else.

- ONNX Runtime (``onnx`` formats, Triton's ONNX Runtime backend, onnxruntime-web's WebAssembly
  build, which compiles the same CPU kernels): each node's op, domain and opset version against
  the CPU execution provider's kernel registry of the installed ``onnxruntime``
  (``get_all_opkernel_def``).
"""

from __future__ import annotations

from functools import lru_cache

from policy_export.errors import ConversionError


@lru_cache(maxsize=1)
def _ort_cpu_kernels() -> dict[tuple[str, str], list[tuple[int, int]]]:
    from onnxruntime.capi import _pybind_state as ort_c

    kernels: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for k in ort_c.get_all_opkernel_def():
        if k.provider == "CPUExecutionProvider":
            kernels.setdefault((k.domain or "ai.onnx", k.op_name), []).append(tuple(k.version_range))
    return kernels


def _since_version(op_type: str, domain: str, opset: int) -> int | None:
    from onnx import defs

    try:
        return defs.get_schema(op_type, opset, "" if domain == "ai.onnx" else domain).since_version
    except Exception:  # noqa: BLE001 - onnx raises SchemaError for ops it does not define
        return None


def _nodes(graph, where: str):
    """``(node, where)`` for every node, subgraphs included (``where``: the path of If/Loop branches)."""
    for node in graph.node:
        yield node, where
        for attr in node.attribute:
            subs = [attr.g] if attr.HasField("g") else list(attr.graphs)
            for sub in subs:
                yield from _nodes(sub, f"{where} > {node.op_type} {node.name!r} {attr.name}")


# ops ONNX Runtime resolves as it loads the graph, with no kernel: a Constant node becomes an initializer
LOAD_TIME_OPS = {("ai.onnx", "Constant")}


def onnx_runtime_gaps(model) -> list[str]:
    """Each node of ``model`` (subgraphs included) that ONNX Runtime's CPU kernels do not run, described."""
    kernels = _ort_cpu_kernels()
    opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    gaps = []
    for node, where in _nodes(model.graph, "graph"):
        domain = node.domain or "ai.onnx"
        if (domain, node.op_type) in LOAD_TIME_OPS:
            continue
        ranges = kernels.get((domain, node.op_type))
        since = _since_version(node.op_type, domain, opsets.get(domain, 1)) if domain == "ai.onnx" else None
        if ranges and (since is None or any(lo <= since <= hi for lo, hi in ranges)):
            continue
        version = f" (opset {opsets.get(domain)}, since version {since})" if since is not None else ""
        outputs = ", ".join(node.output) or "no outputs"
        gaps.append(f"{domain}::{node.op_type}{version} in node {node.name!r} at {where}, computing {outputs}")
    return gaps


def check_onnx_runtime(model, what: str) -> None:
    """Raises ConversionError naming every op of ``model`` that ONNX Runtime's CPU kernels lack."""
    import onnxruntime

    gaps = onnx_runtime_gaps(model)
    if gaps:
        raise ConversionError(f"{what}: ONNX Runtime {onnxruntime.__version__} has no CPU kernel for "
                              + "; ".join(gaps[:5]) + (f"; and {len(gaps) - 5} more" if len(gaps) > 5 else ""))
