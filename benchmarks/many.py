"""``python -m benchmarks.many``: many small policies exported and verified at once, timed in one run.

N copies of the CartPole spec (each its own policy directory) are exported

- serially, one ``policy-export export`` process after another (what a loop in a shell does);
- by ``export-many --jobs 1`` (one policy at a time, each in a fresh process forked from a
  process that imported the runtimes once), to give the per-policy overhead of the driver;
- by ``export-many --jobs J`` (J = the number of cores) on the local pool;
- by ``export-many --ray ADDRESS`` on a Ray cluster this benchmark starts on 127.0.0.1 (skipped
  with the reason when ray is not installed);

and verified serially (``policy-export verify`` per export) and by ``verify-many --jobs 1``. Every
variant uses the same parity options. Ratios are of wall times measured in this one run; the
figures go to ``benchmarks/many_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "cartpole_mlp"
OPTIONS = ["--samples", "200", "--explore-samples", "2000"]


def _cli() -> list[str]:
    return [sys.executable, "-m", "policy_export"]


def _timed(command: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])}... failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return seconds


def _sources(base: Path, n: int) -> list[str]:
    out = []
    for i in range(n):
        target = base / "sources" / f"policy{i:02d}"
        shutil.copytree(FIXTURE, target)
        out.append(str(target))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cluster(cpus: int):
    """Start a Ray head of ``cpus`` CPUs (advertised on 127.0.0.1, its own temp dir and process
    group, so that stopping it touches no other Ray on the machine); returns its address and a
    stop function, or ``None`` and the reason it cannot."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return None, f"ray is not installed ({e}): pip install 'policy-export[ray]'"
    port, temp = _free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")
    log = open(Path(temp) / "start.log", "w+")
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--port={port}", f"--ray-client-server-port={_free_port()}", f"--num-cpus={cpus}",
               "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in (Path(temp) / "start.log").read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("ray start failed:\n" + (Path(temp) / "start.log").read_text()[-2000:])
        time.sleep(0.2)

    def stop() -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)

    return f"127.0.0.1:{port}", stop


def _serial_export(sources: list[str], root: Path) -> float:
    start = time.perf_counter()
    for src in sources:
        _timed([*_cli(), "export", src, "--out", str(root / Path(src).name), "-q", *OPTIONS])
    return time.perf_counter() - start


def _serial_verify(root: Path, names: list[str]) -> float:
    start = time.perf_counter()
    for name in names:
        _timed([*_cli(), "verify", str(root / name), "-q"])
    return time.perf_counter() - start


def run(n: int, jobs: int, work: Path) -> dict:
    sources = _sources(work, n)
    names = [Path(s).name for s in sources]
    many = [*_cli(), "export-many", *sources, "-q", *OPTIONS]
    figures = {"policies": n, "cores": os.cpu_count(), "jobs": jobs, "options": OPTIONS}
    figures["serial_export_s"] = _serial_export(sources, work / "serial")
    figures["many_jobs1_s"] = _timed([*many, "--out", str(work / "j1"), "--jobs", "1"])
    figures["many_pool_s"] = _timed([*many, "--out", str(work / "pool"), "--jobs", str(jobs)])
    address, stop = _ray_cluster(jobs)
    if address is None:
        figures["ray"] = f"not run: {stop}"
    else:
        try:
            figures["many_ray_s"] = _timed([*many, "--out", str(work / "ray"), "--ray", address])
        finally:
            stop()
    figures["serial_verify_s"] = _serial_verify(work / "serial", names)
    figures["verify_many_jobs1_s"] = _timed([*_cli(), "verify-many", str(work / "serial"), "--jobs", "1", "-q"])
    return figures


def ratios(f: dict) -> dict:
    n = f["policies"]
    out = {
        "pool_speedup_vs_serial": f["serial_export_s"] / f["many_pool_s"],
        "per_policy_serial_export_s": f["serial_export_s"] / n,
        "per_policy_many_jobs1_s": f["many_jobs1_s"] / n,
        "overhead_per_policy_vs_single_export": f["many_jobs1_s"] / f["serial_export_s"] - 1,
        "per_policy_serial_verify_s": f["serial_verify_s"] / n,
        "per_policy_verify_many_jobs1_s": f["verify_many_jobs1_s"] / n,
        "verify_many_jobs1_vs_serial_verify": f["verify_many_jobs1_s"] / f["serial_verify_s"],
    }
    if "many_ray_s" in f:
        out["ray_speedup_vs_serial"] = f["serial_export_s"] / f["many_ray_s"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.many", description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "many_results.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="policy-export-many-bench-") as tmp:
        figures = run(args.policies, args.jobs, Path(tmp))
    result = {"figures": figures, "ratios": ratios(figures)}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    for key, value in {**figures, **result["ratios"]}.items():
        print(f"{key:40s} {value:.3f}" if isinstance(value, float) else f"{key:40s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
