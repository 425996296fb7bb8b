"""Latency, graph size, export stage times and memory, measured in one run.

    python -m benchmarks                 # fixtures + scaling to 50M parameters
    python -m benchmarks --quick         # fixtures only
    python -m benchmarks --json out.json

For each MLP policy: latency per call (median after warm-up) at batch 1, 32 and 1,024 of the TF
session, ONNX Runtime on ``model.onnx`` and on ``model_deterministic.onnx`` (both fetching
``actions_0``, explore off), and ONNX Runtime on a hand-built minimal graph with the same weights;
the ratios ours/TF and ours/minimal; node counts; each export stage's wall time. Then policies of
about 1M, 10M and 50M parameters are exported and verified, each in a fresh process, with stage
times and peak memory. The machine is noisy: the ratios are the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 32, 1024)
SCALES = {"1M": [1024, 896], "10M": [3136, 3136], "50M": [7040, 7040]}
OBS_DIM = 64


def median_latencies(fns: dict, batch: int) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds after warm-up
    (so that a slow moment of the machine hits every candidate alike)."""
    calls = {1: 50, 32: 20, 1024: 2}.get(batch, 5)
    rounds = {1: 60, 32: 40, 1024: 30}.get(batch, 30)
    for fn in fns.values():
        for _ in range(calls * 3):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: float(np.median(v)) for name, v in samples.items()}


def bench_policy(spec_path: Path, work: Path) -> dict:
    import onnx

    from benchmarks.minimal import minimal_mlp
    from policy_export.exporter.onnx_model import inference_session
    from policy_export.exporter import export_spec
    from policy_export.exporter.parity import sample_observations
    from policy_export.policy import TFPolicy, load_spec

    spec = load_spec(spec_path)
    out = work / spec.name
    result = export_spec(spec_path, out, device="cpu", overwrite=True)
    policy = TFPolicy.from_spec(spec, device="/CPU:0")
    obs_dim = int(np.prod(spec.observation_space.shape))
    minimal = minimal_mlp(policy.get_weights(), spec.model.hiddens, spec.model.activation, obs_dim, spec.action_space)
    minimal_path = out / "minimal.onnx"
    onnx.save(minimal, minimal_path)
    # the same options for every ONNX Runtime session: one thread (lowest latency at these sizes)
    sessions = {name: inference_session(out / file, threads=1) for name, file in (
        ("onnx", "model.onnx"), ("onnx_deterministic", "model_deterministic.onnx"), ("minimal", "minimal.onnx"))}
    obs_all = sample_observations(spec.observation_space, max(BATCHES), 0)["observations"].astype(np.float32)
    action = policy.outputs["actions_0"]
    obs_ph = policy.inputs["observations"]
    latency: dict[str, dict[int, float]] = {k: {} for k in ("tf_session", *sessions)}
    for batch in BATCHES:
        obs = obs_all[:batch]
        feed = {obs_ph: obs}
        fns = {"tf_session": lambda f=feed: policy.session.run(action, f)}
        fns.update({name: (lambda s=sess, o=obs: s.run(["actions_0"], {"observations": o}))
                    for name, sess in sessions.items()})
        for name, value in median_latencies(fns, batch).items():
            latency[name][batch] = value
        ours = sessions["onnx_deterministic"].run(["actions_0"], {"observations": obs})[0]
        np.testing.assert_allclose(ours, sessions["minimal"].run(["actions_0"], {"observations": obs})[0], atol=1e-5)
    policy.close()
    nodes = {"onnx": len(onnx.load(out / "model.onnx").graph.node),
             "onnx_deterministic": len(onnx.load(out / "model_deterministic.onnx").graph.node),
             "minimal": len(minimal.graph.node)}
    return {"policy": spec.name, "parameters": int(sum(v.size for v in TFPolicy.from_spec(spec).get_weights().values())),
            "latency_s": latency, "nodes": nodes, "export_stages_s": result.timings}


def scale_spec(name: str, hiddens: list[int], directory: Path) -> Path:
    from policy_export.policy.spec import spec_from_json, write_spec

    spec = spec_from_json({"format_version": 1, "name": f"mlp_{name}",
                           "observation_space": {"type": "Box", "low": -1.0, "high": 1.0, "shape": [OBS_DIM]},
                           "action_space": {"type": "Discrete", "n": 4},
                           "model": {"hiddens": hiddens, "activation": "tanh"}, "seed": 0})
    write_spec(spec, directory / name)
    return directory / name


def scale_run(spec_dir: str, out: str) -> dict:
    """Export and verify one policy in this process; report stage times and peak memory."""
    from policy_export.exporter import export_spec, verify_export

    start = time.perf_counter()
    result = export_spec(spec_dir, out, device="cpu", overwrite=True)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    verified = verify_export(out, device="cpu")
    verify_s = time.perf_counter() - start
    from policy_export.policy import TFPolicy, load_spec

    params = int(sum(v.size for v in TFPolicy.from_spec(load_spec(spec_dir)).get_weights().values()))
    return {"parameters": params, "export_s": export_s, "verify_s": verify_s, "verified": verified.passed,
            "parity_passed": result.parity.passed, "export_stages_s": result.timings,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "export_dir_mb": sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file()) / 2**20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fixtures only, no 1M/10M/50M scaling runs")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results.json"), metavar="F")
    parser.add_argument("--scale-run", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from policy_export.exporter.quiet import quiet_libraries

    quiet_libraries()
    if args.scale_run:
        print(json.dumps(scale_run(*args.scale_run)))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    results: dict = {"machine": {"cpus": os.cpu_count()}, "policies": [], "scaling": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        specs = [ROOT / "fixtures" / "cartpole_mlp", ROOT / "fixtures" / "pendulum_mlp",
                 scale_spec("256x256", [256, 256], work)]
        for spec in specs:
            results["policies"].append(bench_policy(spec, work / "exports"))
        if not args.quick:
            for name, hiddens in SCALES.items():
                spec = scale_spec(name, hiddens, work)
                proc = subprocess.run([sys.executable, "-m", "benchmarks", "--scale-run", str(spec), str(work / f"x{name}")],
                                      capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    raise SystemExit(f"scaling run {name} failed:\n{proc.stderr[-3000:]}")
                results["scaling"].append({"name": name, **json.loads(proc.stdout.strip().splitlines()[-1])})

    table = Table(title="latency per call (median), ratios", title_justify="left")
    for col in ("policy", "batch", "TF session", "model.onnx", "deterministic", "minimal",
                "det/TF", "det/minimal", "onnx/minimal", "nodes (onnx/det/min)"):
        table.add_column(col, justify="right")
    for p in results["policies"]:
        lat = p["latency_s"]
        for batch in BATCHES:
            det, mini, tf_, ours = (lat["onnx_deterministic"][batch], lat["minimal"][batch],
                                    lat["tf_session"][batch], lat["onnx"][batch])
            table.add_row(p["policy"], str(batch), f"{tf_ * 1e6:.1f} us", f"{ours * 1e6:.1f} us", f"{det * 1e6:.1f} us",
                          f"{mini * 1e6:.1f} us", f"{det / tf_:.3f}", f"{det / mini:.2f}", f"{ours / mini:.2f}",
                          f"{p['nodes']['onnx']}/{p['nodes']['onnx_deterministic']}/{p['nodes']['minimal']}")
    console.print(table)
    stages = Table(title="export stages (s)", title_justify="left")
    names = sorted({k for p in results["policies"] + results["scaling"] for k in p["export_stages_s"]})
    for col in ("policy", "parameters", *names, "verify", "peak RSS", "export size"):
        stages.add_column(col, justify="right")
    for p in results["policies"]:
        stages.add_row(p["policy"], f"{p['parameters']:,}", *[f"{p['export_stages_s'].get(n, 0):.2f}" for n in names],
                       "", "", "")
    for s in results["scaling"]:
        stages.add_row(f"mlp_{s['name']}", f"{s['parameters']:,}", *[f"{s['export_stages_s'].get(n, 0):.2f}" for n in names],
                       f"{s['verify_s']:.1f}", f"{s['peak_rss_mb']:.0f} MB", f"{s['export_dir_mb']:.0f} MB")
    console.print(stages)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
