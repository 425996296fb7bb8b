"""``python -m benchmarks.serve``: the package's Triton server against ONNX Runtime in-process, in one run.

    python -m benchmarks.serve                           # cartpole_mlp, 3 s per measurement
    python -m benchmarks.serve --fixture pendulum_mlp --seconds 2 --json out.json

The fixture is exported (``saved_model``, ``onnx``; 200 parity samples) to a temp dir and served by
``TritonServer`` on free ports of 127.0.0.1 (PyTriton's ``tritonserver``; behind its Python backend, in
this process, ONNX Runtime on ``model.onnx``, dynamic batching, 100 us queue delay); the seconds until it
is ready are recorded. Requests are the export's golden observations in turn. Each measurement is a
warm-up, then requests until its time budget (or a cap) is spent: requests/s over the window's wall time
and latency p50/p99, at batch 1 with one client, batch 1 with C clients at once (threads, default 8;
ONNX Runtime's share one session, each Triton client is its own, the dynamic batcher joins them) and
batch B (default 64) with one client; each for ONNX Runtime in-process (``session.run`` of every output,
fed ``observations`` alone; one intra-op thread, and its default) and Triton over gRPC and HTTP
(``TritonClientRunner``: feeds checked against the contract, outputs in its shapes). Ratios (Triton over
ONNX Runtime, one thread; its default too in the JSON) are of this run; they go to
``benchmarks/serve_results.json`` with the server's processes left once it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ort_1thread", "ort_default", "triton_grpc", "triton_http")
BASELINES = ("ort_1thread", "ort_default")
MAX_REQUESTS = 500_000  # per client, phase and measurement, beside the time budget
Call = Callable[[np.ndarray], Any]


def _batches(obs: np.ndarray, batch: int, count: int = 64) -> list[np.ndarray]:
    """``count`` requests of ``batch`` consecutive golden rows (wrapping around)."""
    return [np.ascontiguousarray(np.take(obs, range(k * batch, (k + 1) * batch), axis=0, mode="wrap"))
            for k in range(count)]


def measure(open_client: Callable[[], tuple[Call, Callable[[], None]]], requests: list[np.ndarray], clients: int,
            seconds: float, warmup: float) -> dict[str, float]:
    """Requests/s and latency p50/p99 of ``clients`` threads, each with its own ``open_client()`` (a
    call and its close) warmed up for ``warmup`` s; the window starts once every thread is warm."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    barrier, errors = threading.Barrier(clients + 1), []

    def worker(i: int) -> None:
        close: Callable[[], None] = lambda: None
        try:
            call, close = open_client()
            for measured, budget in ((False, warmup), (True, seconds)):
                if measured:
                    barrier.wait(timeout=120)
                end = time.perf_counter() + budget
                for k in range(MAX_REQUESTS):
                    start = time.perf_counter()
                    call(requests[(i + k) % len(requests)])
                    now = time.perf_counter()
                    if measured:
                        latencies[i].append(now - start)
                    if now >= end:
                        break
        except BaseException as e:
            errors.append(e)
            barrier.abort()
        finally:
            close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=120 + warmup)
    except threading.BrokenBarrierError:
        pass  # a client failed: reported below
    start = time.perf_counter()
    for t in threads:
        t.join(timeout=seconds + 120)
    wall = time.perf_counter() - start
    if errors or any(t.is_alive() for t in threads):
        raise SystemExit(f"measurement failed: {errors[:1] or 'a client did not finish'}")
    ms = np.concatenate([np.asarray(v) for v in latencies]) * 1e3
    return {"requests": int(ms.size), "wall_s": wall, "rps": ms.size / wall,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def _ort_session(path: Path, threads: int):
    """An ONNX Runtime CPU session of ``threads`` intra-op threads (0: its default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level, options.intra_op_num_threads = 3, threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _server_processes(workspace: Path) -> list[int]:
    """The processes whose command line names ``workspace`` (``tritonserver`` and its Python stubs)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, timeout=10)
    return [int(line.split()[0]) for line in ps.stdout.splitlines() if str(workspace) in line]


def run(fixture: str, work: Path, seconds: float, warmup: float, clients: int, batch: int) -> dict:
    """Export ``fixture`` into ``work``, serve it and measure every scenario and variant."""
    from policy_export.exporter import export_spec
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.serve.client import TritonClientRunner
    from policy_export.exporter.serve.server import TritonServer, free_port
    from policy_export.signatures.contract import Contract

    out = work / fixture
    start = time.perf_counter()
    export_spec(ROOT / "fixtures" / fixture, out, device="cpu", formats=["saved_model", "onnx"], samples=200)
    figures: dict[str, Any] = {"fixture": fixture, "export_s": time.perf_counter() - start,
                               "load_average_1min_before": os.getloadavg()[0]}
    contract = Contract.from_json(read_manifest(out)["contract"])
    with np.load(out / "parity" / "inputs.npz") as inputs:
        obs = inputs["observations"]
    sessions = {"ort_1thread": _ort_session(out / "model.onnx", 1), "ort_default": _ort_session(out / "model.onnx", 0)}
    scenarios = {"batch1_sequential": (1, 1), f"batch1_concurrent{clients}": (1, clients)}
    if batch:
        scenarios[f"batch{batch}_sequential"] = (batch, 1)
    results: dict[str, dict] = {name: {} for name in scenarios}
    start = time.perf_counter()
    with TritonServer.start(out, http_port=free_port(), grpc_port=free_port()) as server:
        endpoints, workspace = server.endpoints(), server.workspace
        figures.update(server_start_s=time.perf_counter() - start, max_batch_size=server.models[0].max_batch_size,
                       server_processes=len(_server_processes(workspace)))

        def opener(variant: str) -> Callable[[], tuple[Call, Callable[[], None]]]:
            """Opens one client of ``variant``: ONNX Runtime's shared session, or a Triton client of its own."""
            if variant in sessions:
                return lambda: ((lambda x: sessions[variant].run(None, {"observations": x})), lambda: None)
            protocol = variant.split("_")[1]

            def open_client() -> tuple[Call, Callable[[], None]]:
                runner = TritonClientRunner(endpoints[protocol], protocol, server.models, contract)
                return (lambda x: runner({"observations": x})), runner.close

            return open_client

        check = _batches(obs, max(batch, 1), 1)[0]  # the server answers as ONNX Runtime does
        want = sessions["ort_default"].run(["action_dist_inputs"], {"observations": check})[0]
        for protocol in ("grpc", "http"):
            with TritonClientRunner(endpoints[protocol], protocol, server.models, contract) as runner:
                got = runner({"observations": check})["action_dist_inputs"]
            figures[f"max_abs_diff_{protocol}"] = float(np.max(np.abs(got - want)))
        for name, (rows, n) in scenarios.items():
            requests = _batches(obs, rows)
            for variant in VARIANTS:
                results[name][variant] = measure(opener(variant), requests, n, seconds, warmup)
                print(f"{name:22s} {variant:12s} {results[name][variant]['rps']:10.0f} req/s", flush=True)
    figures["load_average_1min_after"] = os.getloadavg()[0]
    stopped, deadline = time.perf_counter(), time.perf_counter() + 30
    while _server_processes(workspace) and time.perf_counter() < deadline:
        time.sleep(0.1)
    figures["server_exit_after_stop_s"] = time.perf_counter() - stopped
    figures["server_processes_left"] = len(_server_processes(workspace))
    return {"figures": figures, "results": results, "ratios": ratios(results)}


def ratios(results: dict) -> dict:
    """Per scenario and Triton protocol: requests/s and p50 over each ONNX Runtime baseline's."""
    return {name: {f"{v}_vs_{base}": {"rps": row[v]["rps"] / row[base]["rps"],
                                      "p50": row[v]["p50_ms"] / row[base]["p50_ms"]}
                   for v in ("triton_grpc", "triton_http") for base in BASELINES} for name, row in results.items()}


def machine() -> dict[str, Any]:
    """Cores, CPU, Python and the versions of the runtimes measured."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")), platform.processor())
    versions = {}
    for dist in ("onnxruntime", "nvidia-pytriton", "tritonclient", "numpy", "tensorflow", "policy-export"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "cpu": cpu,
            "platform": platform.platform(), "python": platform.python_version(), "versions": versions}


def table(doc: dict) -> str:
    """The measurements as a Markdown table, with Triton's ratios to ONNX Runtime on one thread."""
    lines = ["| scenario | variant | requests | req/s | p50 ms | p99 ms | req/s vs ORT 1t | p50 vs ORT 1t |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in doc["results"].items():
        for variant, m in row.items():
            r = doc["ratios"][name].get(f"{variant}_vs_ort_1thread")
            tail = f"{r['rps']:.3g}x | {r['p50']:.3g}x" if r else "- | -"
            lines.append(f"| {name} | {variant} | {m['requests']} | {m['rps']:.0f} | {m['p50_ms']:.3f} | "
                         f"{m['p99_ms']:.3f} | {tail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", default="cartpole_mlp", metavar="NAME")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per variant and scenario")
    parser.add_argument("--warmup", type=float, default=0.5, help="warm-up seconds per client before each")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (threads)")
    parser.add_argument("--batch", type=int, default=64, help="rows per request of the large-batch scenario (0: skip)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "serve_results.json"), metavar="F")
    args = parser.parse_args(argv)
    if not (0 < args.seconds <= 60 and 0 <= args.warmup <= 30 and 1 <= args.clients <= 64 and 0 <= args.batch <= 256):
        parser.error("--seconds in (0, 60], --warmup in [0, 30], --clients in 1..64, --batch in 0..256")
    from policy_export.exporter.quiet import quiet_libraries

    quiet_libraries(False)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="policy-export-serve-bench-") as tmp:
        doc = run(args.fixture, Path(tmp), args.seconds, args.warmup, args.clients, args.batch)
    doc["figures"]["total_s"] = time.perf_counter() - start
    doc = {"machine": machine(), "options": {k: v for k, v in vars(args).items() if k != "json"}, **doc}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(table(doc))
    for key, value in doc["figures"].items():
        print(f"{key:36s} {value:.3f}" if isinstance(value, float) else f"{key:36s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
