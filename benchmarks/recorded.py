"""Reading ``--observations`` files: memory bounded by the rows kept, not by the file.

    python -m benchmarks.recorded                 # a 1 GiB file; results in benchmarks/recorded_results.json
    python -m benchmarks.recorded --gib 0.1 --json out.json

Writes a ``.npy`` of CartPole-shaped float32 observations of ``--gib`` GiB (and the same rows in an
``.npz``, deflated) in a temporary directory, then in a fresh process each: reads it as
``--observations`` does (every row checked, the sha256 taken, 1,000 rows kept) and, for
comparison, loads it whole with ``np.load``. Reports each one's wall time and the process's peak
resident memory (``VmHWM``, reset through ``/proc/self/clear_refs`` once the imports are done)
above what it held then.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, sys, time
import numpy as np
from policy_export.exporter.recorded import read_recorded
from policy_export.policy.spaces import space_from_json
space = space_from_json({"type": "Box", "low": -1e9, "high": 1e9, "shape": [4], "dtype": "float32"}, "$", "bench")
class Contract:
    input_keys = ["observations"]
    required_inputs = []
    @staticmethod
    def input(key):
        return None
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from here
    f.write("5")
base = status("VmRSS")
start = time.perf_counter()
if sys.argv[2] == "stream":
    rows = read_recorded([sys.argv[1]], space, Contract, 1000, 0).rows
else:
    data = np.load(sys.argv[1])
    rows = len(data if isinstance(data, np.ndarray) else data["observations"])
took = time.perf_counter() - start
peak = status("VmHWM")
print(json.dumps({"seconds": took, "peak_mib_above_start": (peak - base) / 1024, "rows": int(rows)}))
"""


def write_files(work: Path, gib: float) -> tuple[Path, Path, int]:
    rows = int(gib * (1 << 30) / 16)
    npy = work / "observations.npy"
    out = np.lib.format.open_memmap(npy, mode="w+", dtype=np.float32, shape=(rows, 4))
    rng = np.random.default_rng(0)
    for start in range(0, rows, 1 << 22):
        n = min(1 << 22, rows - start)
        out[start:start + n] = rng.standard_normal((n, 4), np.float32)
    out.flush()
    del out
    npz = work / "observations.npz"
    with zipfile.ZipFile(npz, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        archive.write(npy, "observations.npy")
    return npy, npz, rows


def measure(path: Path, how: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), how], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recorded")
    parser.add_argument("--gib", type=float, default=1.0, help="size of the .npy file (default 1)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "recorded_results.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        npy, npz, rows = write_files(Path(tmp), args.gib)
        sizes = {"npy": npy.stat().st_size, "npz": npz.stat().st_size}
        result = {"rows": rows, "bytes": sizes,
                  "npy": {"stream": measure(npy, "stream"), "np.load": measure(npy, "load")},
                  "npz": {"stream": measure(npz, "stream"), "np.load": measure(npz, "load")}}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{rows:,} rows; .npy {sizes['npy'] / (1 << 30):.2f} GiB, .npz (deflated) {sizes['npz'] / (1 << 30):.2f} GiB")
    print("| file | read | seconds | peak MiB above start | ratio to np.load |")
    print("|---|---|---|---|---|")
    for kind in ("npy", "npz"):
        stream, whole = result[kind]["stream"], result[kind]["np.load"]
        for name, r in (("--observations (1,000 rows kept)", stream), ("np.load, whole", whole)):
            ratio = r["peak_mib_above_start"] / max(whole["peak_mib_above_start"], 1e-9)
            print(f"| .{kind} | {name} | {r['seconds']:.1f} | {r['peak_mib_above_start']:.0f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
