"""``python -m benchmarks.serve``: ``serve`` against its transport floor and ONNX Runtime in-process, and
the PyTriton route it replaced, in one run.

    python -m benchmarks.serve                           # cartpole_mlp, 3 s per measurement
    python -m benchmarks.serve --fixture pendulum_mlp --seconds 2 --json out.json

The fixture is exported (``saved_model``, ``onnx``, ``triton``; 200 parity samples) to a temp dir and
served twice, each server a process of its own on free ports of 127.0.0.1, as a user runs it:

- ``serve``: ``policy-export serve OUT``, the export's ``triton/`` repository on tritonserver with the
  package's stand-in for the ONNX Runtime backend (in the Python backend's stub), behind the
  package's HTTP and gRPC fronts;
- ``pytriton``: the PyTriton route (`benchmarks/pytriton_route.py`): tritonserver's Python
  backend handing each request through PyTriton's proxy to the serving process, where ONNX Runtime runs.

Every Triton client is ``tritonclient`` (``http`` and ``grpc``) with the same code for both servers and
both protocols, the way a user writes it: requests of the export's golden observations in turn (an
``InferInput`` built per request, binary data), every output returned. Measured, each a warm-up then
requests until its time budget (or a cap) is spent, latency p50/p99 and requests/s over the window:

- ``metadata``: the model's metadata round trip (``get_model_metadata``) through the same endpoint,
  the transport floor (client, front, server, back; no inference);
- ``batch1``, ``batch{B}``: one client, 1 and B (default 64) rows a request;
- ``batch1_concurrent{C}``: C clients (threads, default 8) at once, each a client of its own;
- ONNX Runtime in-process on the same ``model.onnx`` (``session.run`` of every output; one intra-op
  thread, and its default), the same scenarios (its clients share one session).

The verdict lines compare ``serve``'s inference p50 at batch 1 with its own metadata round trip over
the same protocol (targets: within 3x over gRPC, 4x over HTTP), and print the PyTriton route's same
ratios beside them. Everything goes to ``benchmarks/serve_results.json`` with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
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

from tests.helpers import descendants

ROOT = Path(__file__).resolve().parent.parent
ROUTES = ("serve", "pytriton")
PROTOCOLS = ("grpc", "http")
BASELINES = ("ort_1thread", "ort_default")
TARGETS = {"grpc": 3.0, "http": 4.0}  # serve's inference p50 at batch 1 over its metadata round trip, at most
MAX_REQUESTS = 500_000  # per client, phase and measurement, beside the time budget
READY_TIMEOUT_S = 300.0
Call = Callable[[int], Any]
PYTRITON_SCRIPT = """
import sys
from benchmarks.pytriton_route import PyTritonServer, serve_forever
server = PyTritonServer.start(sys.argv[1], http_port=int(sys.argv[2]), grpc_port=int(sys.argv[3]), device="cpu")
serve_forever(server, lambda: print("ready:", flush=True))
"""


def _batches(obs: np.ndarray, batch: int, count: int = 64) -> list[np.ndarray]:
    """``count`` requests of ``batch`` consecutive golden rows (wrapping around)."""
    return [np.ascontiguousarray(np.take(obs, range(k * batch, (k + 1) * batch), axis=0, mode="wrap"))
            for k in range(count)]


def measure(open_client: Callable[[], tuple[Call, Callable[[], None]]], clients: int, seconds: float,
            warmup: float) -> dict[str, float]:
    """Requests/s and latency p50/p99 of ``clients`` threads, each with its own ``open_client()`` (a
    call of the request number and its close) warmed up for ``warmup`` s; the window starts once
    every thread is warm."""
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
                    call(i + k)
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


def triton_client(protocol: str, url: str, model: str, requests: list[np.ndarray] | None):
    """A ``tritonclient`` of ``model`` over ``protocol`` (the same code for every server): a call of
    the request number (an inference of ``requests[k % n]``, or the model's metadata when
    ``requests`` is None) and its close."""
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module
    client = module.InferenceServerClient(url)
    if requests is None:
        return (lambda k: client.get_model_metadata(model)), client.close

    def call(k: int):
        value = requests[k % len(requests)]
        item = module.InferInput("observations", list(value.shape), "FP32")
        item.set_data_from_numpy(value)
        return client.infer(model, [item])

    return call, client.close


class ServerProcess:
    """A server started as a command of its own, ready once it prints a line starting ``ready:``."""

    def __init__(self, args: list[str], env: dict[str, str]):
        start = time.perf_counter()
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise SystemExit(f"{args[:3]} stopped before it was ready (exit {self.process.wait()})")
            if line.startswith("ready:"):
                break
        else:
            self.stop()
            raise SystemExit(f"{args[:3]} was not ready in {READY_TIMEOUT_S:.0f} s")
        self.start_s = time.perf_counter() - start
        self.pids = descendants(self.process.pid)

    def stop(self) -> float:
        """SIGTERM, then wait for it and every process it started; the seconds that took."""
        start = time.perf_counter()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.1)
        return time.perf_counter() - start

    def left(self) -> int:
        return sum(Path(f"/proc/{pid}").exists() for pid in self.pids)


def run(fixture: str, work: Path, seconds: float, warmup: float, clients: int, batch: int) -> dict:
    """Export ``fixture`` into ``work``, start both servers and measure every scenario and variant."""
    from policy_export.exporter import export_spec
    from policy_export.exporter.serve.server import free_port

    out = work / fixture
    start = time.perf_counter()
    export_spec(ROOT / "fixtures" / fixture, out, device="cpu", formats=["saved_model", "onnx", "triton"], samples=200)
    figures: dict[str, Any] = {"fixture": fixture, "export_s": time.perf_counter() - start,
                               "load_average_1min_before": os.getloadavg()[0]}
    with np.load(out / "parity" / "inputs.npz") as inputs:
        obs = inputs["observations"]
    model = next(p.name for p in sorted((out / "triton").iterdir()) if not p.name.endswith("_explore"))
    sessions = {"ort_1thread": _ort_session(out / "model.onnx", 1), "ort_default": _ort_session(out / "model.onnx", 0)}
    env = dict(os.environ, TMPDIR=tempfile.gettempdir())
    script = Path(sys.executable).parent / "policy-export"
    ports = {route: {p: free_port() for p in PROTOCOLS} for route in ROUTES}
    commands = {"serve": [str(script), "serve", str(out), "--port", str(ports["serve"]["http"]),
                          "--grpc-port", str(ports["serve"]["grpc"])],
                "pytriton": [sys.executable, "-c", PYTRITON_SCRIPT, str(out), str(ports["pytriton"]["http"]),
                             str(ports["pytriton"]["grpc"])]}
    names = {"serve": model, "pytriton": "policy"}
    scenarios = {"metadata": (None, 1), "batch1": (1, 1)}
    if batch:
        scenarios[f"batch{batch}"] = (batch, 1)
    scenarios[f"batch1_concurrent{clients}"] = (1, clients)
    results: dict[str, dict] = {name: {} for name in scenarios}
    servers: dict[str, ServerProcess] = {}
    try:
        for route in ROUTES:
            servers[route] = ServerProcess(commands[route], env)
            figures[f"{route}_start_s"] = servers[route].start_s
            figures[f"{route}_processes"] = len(servers[route].pids) + 1
        check = _batches(obs, max(batch, 1), 1)[0]  # each server answers as ONNX Runtime does
        want = sessions["ort_default"].run(["action_dist_inputs"], {"observations": check})[0]
        for route in ROUTES:
            for protocol in PROTOCOLS:
                call, close = triton_client(protocol, f"127.0.0.1:{ports[route][protocol]}", names[route], [check])
                figures[f"max_abs_diff_{route}_{protocol}"] = float(np.max(np.abs(
                    call(0).as_numpy("action_dist_inputs") - want)))
                close()
        for name, (rows, n) in scenarios.items():
            requests = _batches(obs, rows) if rows else None
            for route in ROUTES:
                for protocol in PROTOCOLS:
                    url = f"127.0.0.1:{ports[route][protocol]}"
                    opener = (lambda url=url, protocol=protocol, route=route, requests=requests:
                              triton_client(protocol, url, names[route], requests))
                    variant = f"{route}_{protocol}"
                    results[name][variant] = measure(opener, n, seconds, warmup)
                    print(f"{name:22s} {variant:14s} p50 {results[name][variant]['p50_ms']:7.3f} ms", flush=True)
            if requests is None:
                continue
            for variant, session in sessions.items():
                opener = (lambda session=session, requests=requests:
                          ((lambda k: session.run(None, {"observations": requests[k % len(requests)]})), lambda: None))
                results[name][variant] = measure(opener, n, seconds, warmup)
                print(f"{name:22s} {variant:14s} p50 {results[name][variant]['p50_ms']:7.3f} ms", flush=True)
    finally:
        for route, server in servers.items():
            figures[f"{route}_stop_s"] = server.stop()
            figures[f"{route}_processes_left"] = server.left()
    figures["load_average_1min_after"] = os.getloadavg()[0]
    return {"figures": figures, "results": results, "floor": floor_ratios(results), "ratios": ratios(results)}


def floor_ratios(results: dict) -> dict:
    """Per route and protocol: inference p50 at batch 1 over the metadata round trip's p50 (the
    transport floor), with ``serve``'s target."""
    doc = {}
    for route in ROUTES:
        for protocol in PROTOCOLS:
            variant = f"{route}_{protocol}"
            ratio = results["batch1"][variant]["p50_ms"] / results["metadata"][variant]["p50_ms"]
            entry = {"infer_p50_ms": results["batch1"][variant]["p50_ms"],
                     "metadata_p50_ms": results["metadata"][variant]["p50_ms"], "ratio": ratio}
            if route == "serve":
                entry.update(target=TARGETS[protocol], within=ratio <= TARGETS[protocol])
            doc[variant] = entry
    return doc


def ratios(results: dict) -> dict:
    """Per inference scenario and server: requests/s and p50 over each ONNX Runtime baseline's."""
    return {name: {f"{v}_vs_{base}": {"rps": row[v]["rps"] / row[base]["rps"], "p50": row[v]["p50_ms"] / row[base]["p50_ms"]}
                   for v in row if v not in BASELINES for base in BASELINES}
            for name, row in results.items() if name != "metadata"}


def machine() -> dict[str, Any]:
    """Cores, CPU, Python and the versions of the runtimes measured."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")), platform.processor())
    versions = {}
    for dist in ("onnxruntime", "nvidia-pytriton", "tritonclient", "grpcio", "numpy", "tensorflow", "policy-export"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)), "cpu": cpu,
            "platform": platform.platform(), "python": platform.python_version(), "versions": versions}


def table(doc: dict) -> str:
    """The measurements as a Markdown table, with each inference's p50 over ONNX Runtime's (one thread)."""
    lines = ["| scenario | variant | requests | req/s | p50 ms | p99 ms | p50 vs ORT 1t |", "|---|---|---|---|---|---|---|"]
    for name, row in doc["results"].items():
        for variant, m in row.items():
            r = doc["ratios"].get(name, {}).get(f"{variant}_vs_ort_1thread")
            tail = f"{r['p50']:.3g}x" if r else "-"
            lines.append(f"| {name} | {variant} | {m['requests']} | {m['rps']:.0f} | {m['p50_ms']:.3f} | "
                         f"{m['p99_ms']:.3f} | {tail} |")
    return "\n".join(lines)


def verdict(doc: dict) -> list[str]:
    """One line per route and protocol: inference p50 at batch 1 against the metadata round trip."""
    lines = []
    for variant, entry in doc["floor"].items():
        line = (f"{variant:14s} inference p50 {entry['infer_p50_ms']:.3f} ms at batch 1 = {entry['ratio']:.2f}x its "
                f"metadata round trip ({entry['metadata_p50_ms']:.3f} ms)")
        if "target" in entry:
            line += f"; target <= {entry['target']:.0f}x: {'met' if entry['within'] else 'NOT MET'}"
        lines.append(line)
    return lines


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
    print("\n".join(verdict(doc)))
    for key, value in doc["figures"].items():
        print(f"{key:36s} {value:.3f}" if isinstance(value, float) else f"{key:36s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
