"""Edge and compressed formats: file size and latency against ``model_deterministic.onnx``.

    python -m benchmarks.edge                  # the fixtures below, results in benchmarks/edge_results.json
    python -m benchmarks.edge --json out.json

Each fixture is exported with ``onnx_deterministic`` and the four edge formats; per format the
file size, the latency per call (median of interleaved rounds after warm-up, one thread, explore
off) at batch 1, 32 and 1,024, each as a ratio to ``model_deterministic.onnx``, and the judged
behavioural metric of each lossy format (agreement or Box error) as export measured it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ("cartpole_mlp", "pendulum_mlp", "cartpole_lstm", "dict_image_vector", "image_uint8")
FORMATS = ("onnx_deterministic", "tflite", "tflite_int8", "onnx_int8", "onnx_fp16")
BASELINE = "onnx_deterministic"


def _runner(fmt, out: Path, doc, device):
    from policy_export.exporter.formats.onnx.model import OnnxRunner
    from policy_export.signatures.contract import Contract

    if fmt.capabilities.onnx or fmt.name.startswith("onnx"):  # one thread for every runtime
        return OnnxRunner(out / fmt.path, device, threads=1, contract=Contract.from_json(doc["contract"]))
    return fmt.open(out / fmt.path, doc, device)


def bench_fixture(name: str, work: Path) -> dict:
    from benchmarks.__main__ import BATCHES, median_latencies
    from policy_export.exporter import export_spec
    from policy_export.exporter import formats as registry
    from policy_export.exporter.devices import plan_devices
    from policy_export.exporter.parity.compare import sample_inputs
    from policy_export.signatures.contract import Contract

    out = work / name
    # the benchmark measures every format; thresholds are reported, not enforced here
    result = export_spec(ROOT / "fixtures" / name, out, device="cpu", formats=list(FORMATS), explore_samples=0,
                         behaviour={"*": {"min_agreement": 0.0, "max_box_error": 1.0}})
    doc = result.manifest
    contract = Contract.from_json(doc["contract"])
    from policy_export.policy.spaces import space_from_json

    obs_space = space_from_json(doc["spaces"]["observation"], "$", name)
    act_space = space_from_json(doc["spaces"]["action"], "$", name)
    required = {s.key for s in contract.required_inputs}
    feeds = {k: v for k, v in sample_inputs(obs_space, act_space, contract, max(BATCHES), 7).items() if k in required}
    device = plan_devices("cpu")
    row: dict = {"sizes": {}, "latency_s": {}, "behaviour": {}}
    runners = {}
    try:
        for fname in FORMATS:
            fmt = registry.get(fname)
            row["sizes"][fname] = (out / fmt.path).stat().st_size
            runners[fname] = _runner(fmt, out, doc, device)
        for batch in BATCHES:
            batch_feeds = {k: v[:batch] for k, v in feeds.items()}
            fns = {f: (lambda r=r: r(batch_feeds)) for f, r in runners.items()}
            row["latency_s"][batch] = median_latencies(fns, batch)
    finally:
        for r in runners.values():
            r.close()
    for c in result.parity.behaviour:
        if c.metric in ("agreement", "box_error"):
            row["behaviour"][f"{c.format}/{c.key}"] = {"metric": c.metric, "value": c.value, **c.extra}
    base = row["sizes"][BASELINE]
    row["size_ratio"] = {f: s / base for f, s in row["sizes"].items()}
    row["latency_ratio"] = {b: {f: t / v[BASELINE] for f, t in v.items()} for b, v in row["latency_s"].items()}
    return row


def table(results: dict) -> str:
    from benchmarks.__main__ import BATCHES

    lines = ["| fixture | format | size (B) | size vs det. ONNX | " + " | ".join(f"batch {b}" for b in BATCHES)
             + " | behaviour |", "|---|---|---|---|" + "---|" * len(BATCHES) + "---|"]
    for name, row in results.items():
        for f in FORMATS:
            lat = " | ".join(f"{row['latency_s'][b][f] * 1e6:.0f} us ({row['latency_ratio'][b][f]:.2f}x)" for b in BATCHES)
            beh = "; ".join(f"{'agree' if v['metric'] == 'agreement' else 'box err'} "
                            f"{v['value']:.2%}" + (" (stepped)" if "stepped" in k else "")
                            for k, v in row["behaviour"].items() if k.split(" ")[0].split("/")[0] == f)
            lines.append(f"| {name} | {f} | {row['sizes'][f]} | {row['size_ratio'][f]:.2f} | {lat} | {beh or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.edge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "edge_results.json"), metavar="F")
    parser.add_argument("--fixtures", default=",".join(FIXTURES), metavar="LIST")
    args = parser.parse_args(argv)
    from policy_export.exporter.quiet import quiet_libraries

    quiet_libraries(False)
    results = {}
    with tempfile.TemporaryDirectory(prefix="policy-export-edge-bench-") as tmp:
        for name in args.fixtures.split(","):
            results[name] = bench_fixture(name, Path(tmp))
            print(f"{name}: done", flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
