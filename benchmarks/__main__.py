"""Latency, graph size, export stage times and memory, measured in one run.

    python -m benchmarks                       # fixtures + scaling at 1M, 10M, 50M and 200M parameters
    python -m benchmarks --quick               # fixtures only
    python -m benchmarks --sizes 1M,10M        # fixtures + the chosen scaling sizes
    python -m benchmarks --json out.json

For each MLP policy: latency per call (median after warm-up) at batch 1, 32 and 1,024 of the TF
session, ONNX Runtime on ``model.onnx`` and on ``model_deterministic.onnx`` (both fetching
``actions_0``, explore off), and ONNX Runtime on a hand-built minimal graph with the same weights;
the ratios ours/TF and ours/minimal; node counts; each export stage's wall time. Then MLPs of
about 1M, 10M, 50M and 200M parameters (obs Box(64), three tanh layers, Discrete(8)) are exported
and then verified, each in a fresh process, with every stage's time, the process's peak resident
memory after each stage, and the goals: peak memory at most 1 GiB + 6x the weight bytes, a 10M
export within 15 s and a 50M export within 60 s. The machine is noisy: the ratios are the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 32, 1024)
SCALES = {"1M": [690] * 3, "10M": [2200] * 3, "50M": [5000] * 3, "200M": [10000] * 3}
OBS_DIM = 64
ACTIONS = 8
TIME_GOALS_S = {"10M": 15.0, "50M": 60.0}  # export wall time
MEMORY_BASE_MB, MEMORY_PER_WEIGHT = 1024.0, 6.0  # peak RSS goal: 1 GiB + 6x the weight bytes


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
    from policy_export.exporter.formats.onnx.model import inference_session
    from policy_export.exporter import export_spec
    from policy_export.exporter.parity.compare import sample_observations
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
                           "action_space": {"type": "Discrete", "n": ACTIONS},
                           "model": {"hiddens": hiddens, "activation": "tanh"}, "seed": 0})
    write_spec(spec, directory / name)
    return directory / name


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scale_run(mode: str, spec_dir: str, out: str) -> dict:
    """Export (``mode="export"``) or verify one policy in this process; stage times and peak memory."""
    from policy_export.exporter import export_spec, verify_export

    start = time.perf_counter()
    if mode == "export":
        result = export_spec(spec_dir, out, device="cpu", overwrite=True)
        from policy_export.policy import load_spec

        spec = load_spec(spec_dir)
        hiddens = [OBS_DIM, *spec.model.hiddens, ACTIONS]
        params = sum(a * b + b for a, b in zip(hiddens, hiddens[1:]))
        return {"parameters": params, "weights_mb": params * 4 / 2**20, "export_s": time.perf_counter() - start,
                "parity_passed": result.parity.passed, "export_stages_s": result.timings,
                "stage_peak_rss_mb": result.peak_rss_mb, "peak_rss_mb": _peak_mb(),
                "export_dir_mb": sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file()) / 2**20}
    verified = verify_export(out, device="cpu")
    return {"verify_s": time.perf_counter() - start, "verified": verified.passed, "verify_peak_rss_mb": _peak_mb()}


def goals(run: dict) -> dict:
    """Which goals a scaling run meets: memory budget (export and verify) and export time."""
    budget = MEMORY_BASE_MB + MEMORY_PER_WEIGHT * run["weights_mb"]
    out = {"memory_budget_mb": budget,
           "memory_ok": run["peak_rss_mb"] <= budget and run.get("verify_peak_rss_mb", 0) <= budget}
    if run["name"] in TIME_GOALS_S:
        out["time_goal_s"] = TIME_GOALS_S[run["name"]]
        out["time_ok"] = run["export_s"] <= TIME_GOALS_S[run["name"]]
    return out


def _subprocess(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--scale-run", *args], capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"scaling run {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fixtures only, no scaling runs")
    parser.add_argument("--sizes", default=",".join(SCALES), metavar="LIST",
                        help=f"scaling sizes to run, from {','.join(SCALES)} (default all)")
    parser.add_argument("--json", default=None, metavar="F",
                        help="where the results go (default benchmarks/results.json; with --quick, nowhere unless "
                             "given: a quick run does not replace the full run's figures the docs quote)")
    parser.add_argument("--scale-run", nargs=3, metavar=("MODE", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if any(s not in SCALES for s in sizes):
        parser.error(f"--sizes: choose from {','.join(SCALES)}")
    from policy_export.exporter.quiet import quiet_libraries

    quiet_libraries()
    if args.scale_run:
        print(json.dumps(scale_run(*args.scale_run)))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    results: dict = {"machine": {"cpus": os.cpu_count()}, "policies": [], "scaling": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        specs = [ROOT / "fixtures" / "cartpole_mlp", ROOT / "fixtures" / "pendulum_mlp",
                 scale_spec("256x256", [256, 256], work)]
        for spec in specs:
            results["policies"].append(bench_policy(spec, work / "exports"))
        if not args.quick:
            for name in sizes:
                spec = scale_spec(name, SCALES[name], work)
                out = work / f"x{name}"
                run = {"name": name, **_subprocess("export", str(spec), str(out)),
                       **_subprocess("verify", str(spec), str(out))}
                run.update(goals(run))
                results["scaling"].append(run)
                shutil.rmtree(out, ignore_errors=True)
                console.print(f"{name}: export {run['export_s']:.1f} s, peak {run['peak_rss_mb']:.0f} MB; "
                              f"verify {run['verify_s']:.1f} s, peak {run['verify_peak_rss_mb']:.0f} MB "
                              f"(budget {run['memory_budget_mb']:.0f} MB)")

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
    if results["scaling"]:
        scale = Table(title="scaling: time and peak memory per size, against the goals", title_justify="left")
        for col in ("size", "parameters", "weights", "export", "time goal", "export peak RSS", "verify",
                    "verify peak RSS", "memory budget", "goals met"):
            scale.add_column(col, justify="right")
        for s in results["scaling"]:
            met = s["memory_ok"] and s.get("time_ok", True) and s["verified"] and s["parity_passed"]
            scale.add_row(s["name"], f"{s['parameters']:,}", f"{s['weights_mb']:.0f} MB", f"{s['export_s']:.1f} s",
                          f"{s['time_goal_s']:.0f} s" if "time_goal_s" in s else "-", f"{s['peak_rss_mb']:.0f} MB",
                          f"{s['verify_s']:.1f} s", f"{s['verify_peak_rss_mb']:.0f} MB",
                          f"{s['memory_budget_mb']:.0f} MB", "yes" if met else "NO")
        console.print(scale)
        peaks = Table(title="scaling: peak RSS (MB) of the export process at the end of each stage", title_justify="left")
        stage_names = list(dict.fromkeys(k for s in results["scaling"] for k in s.get("stage_peak_rss_mb", {})))
        for col in ("size", *stage_names):
            peaks.add_column(col, justify="right")
        for s in results["scaling"]:
            peaks.add_row(s["name"], *[f"{s.get('stage_peak_rss_mb', {}).get(n, 0):.0f}" for n in stage_names])
        if stage_names:
            console.print(peaks)
    target = args.json or (None if args.quick else str(ROOT / "benchmarks" / "results.json"))
    if target is None:
        console.print("a --quick run: benchmarks/results.json left as the full run wrote it (--json F to keep this one)")
        return 0
    Path(target).write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
