"""Converting a Stable-Baselines3 zip against exporting the bundled CartPole spec, in one run.

    python -m benchmarks.sb3                  # 5 rounds; results in benchmarks/sb3_results.json
    python -m benchmarks.sb3 --rounds 3 --json out.json

Each round runs, in turn, ``policy-export export fixtures/sb3/ppo_cartpole/model.zip --out X`` (an
MLP PPO zip, read without torch and rebuilt) and ``policy-export export fixtures/cartpole_mlp --out
Y`` (the bundled spec), each in a fresh process with the default formats and parity, and takes
its wall time and peak resident memory (``ru_maxrss`` of the child). The goal: the zip takes no
longer than the spec; the figure is the median of the per-round ratios zip / spec (the two run
side by side in every round, so a slow moment of the machine hits both). The zip's read alone
(archive, ``data``, the pickled entries, ``policy.pth``), in this process, is timed too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZIP = ROOT / "fixtures/sb3/ppo_cartpole/model.zip"
SPEC = ROOT / "fixtures/cartpole_mlp"
GOAL_RATIO = 1.0  # the zip's export / the spec's, at most


def _script() -> list[str]:
    script = Path(sys.executable).parent / "policy-export"
    return [str(script)] if script.exists() else [sys.executable, "-m", "policy_export"]


def run_once(source: Path, out: Path) -> dict[str, float]:
    """One export in a fresh process: its wall seconds and peak resident MiB."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run([*_script(), "export", str(source), "--out", str(out), "--overwrite", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"export of {source} failed: {done.stderr.strip()[-500:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"seconds": seconds, "peak_mib": max(peak, before) / 1024}


def read_seconds(repeats: int = 20) -> float:
    """The median time of reading the zip (no TensorFlow), in this process."""
    from policy_export.exporter.sources.sb3.reader import read_sb3

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read_sb3(ZIP)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sb3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/sb3_results.json",
                        help="where the results go (default benchmarks/sb3_results.json)")
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds + 1):  # the first round warms the caches and is not counted
            zip_run, spec_run = run_once(ZIP, Path(tmp) / "zip"), run_once(SPEC, Path(tmp) / "spec")
            if i:
                rounds.append({"zip": zip_run, "spec": spec_run, "ratio": zip_run["seconds"] / spec_run["seconds"]})
                print(f"round {i}: zip {zip_run['seconds']:.2f} s, spec {spec_run['seconds']:.2f} s, "
                      f"ratio {rounds[-1]['ratio']:.2f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "zip": str(ZIP.relative_to(ROOT)), "spec": str(SPEC.relative_to(ROOT)), "rounds": rounds,
        "median_seconds": {k: statistics.median(r[k]["seconds"] for r in rounds) for k in ("zip", "spec")},
        "peak_mib": {k: max(r[k]["peak_mib"] for r in rounds) for k in ("zip", "spec")},
        "median_ratio": ratio, "goal_ratio": GOAL_RATIO, "met": ratio <= GOAL_RATIO,
        "read_seconds": read_seconds(), "cpus": os.cpu_count(),
    }
    print(f"median: zip {result['median_seconds']['zip']:.2f} s, spec {result['median_seconds']['spec']:.2f} s; "
          f"ratio zip/spec {ratio:.2f} (goal <= {GOAL_RATIO:g}: {'met' if result['met'] else 'NOT met'}); "
          f"reading the zip {result['read_seconds'] * 1000:.1f} ms")
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
