"""Signing an export reads each of its files once (model-signing hashes every file to sign it).

    python -m benchmarks.signing                   # a 5 GiB export; results in benchmarks/signing_results.json
    python -m benchmarks.signing --gib 0.5 --json out.json

Makes an export of ``--gib`` GiB (the bundled CartPole export, plus a ``weights.data`` file of
random bytes listed in its manifest with its sha256, as an ONNX model's external weights would
be), then signs it in a fresh process with a key made for the run, and reports the bytes that
process read from files (``/proc/self/io``'s ``rchar``) against the export's size, and the time.
A ratio of 1 is one read of every file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, sys, time
def rchar():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
from policy_export.exporter.signing import sign_export
import model_signing  # the library's imports are not the signing's reads
before, start = rchar(), time.perf_counter()
signed = sign_export(sys.argv[1], private_key=sys.argv[2])
print(json.dumps({"read_bytes": rchar() - before, "seconds": time.perf_counter() - start, "files": signed.files}))
"""


def make_export(work: Path, gib: float) -> tuple[Path, int]:
    from policy_export import export_spec

    out = work / "export"
    export_spec(ROOT / "fixtures" / "cartpole_mlp", out, formats=["onnx"], samples=20, explore_samples=0,
                device="cpu")
    data, digest, block = out / "weights.data", hashlib.sha256(), bytes(range(256)) * 4096  # 1 MiB
    with open(data, "wb") as f:
        for i in range(int(gib * 1024)):
            chunk = hashlib.sha256(i.to_bytes(8, "little")).digest() * 32 + block[1024:]
            f.write(chunk)
            digest.update(chunk)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"].append({"path": "weights.data", "sha256": digest.hexdigest(), "bytes": data.stat().st_size})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out, sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def make_key(work: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = work / "key.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.signing")
    parser.add_argument("--gib", type=float, default=5.0, help="size of the export (default 5)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "signing_results.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out, size = make_export(work, args.gib)
        done = subprocess.run([sys.executable, "-c", CHILD, str(out), str(make_key(work))], capture_output=True,
                              text=True, check=True, cwd=ROOT)
        run = json.loads(done.stdout.strip().splitlines()[-1])
    result = {"export_bytes": size, **run, "reads_per_byte": run["read_bytes"] / size}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"export {size / (1 << 30):.2f} GiB, {run['files']} files signed in {run['seconds']:.1f} s; "
          f"bytes read {run['read_bytes'] / (1 << 30):.2f} GiB = {result['reads_per_byte']:.3f} reads of the export")
    return 0


if __name__ == "__main__":
    sys.exit(main())
