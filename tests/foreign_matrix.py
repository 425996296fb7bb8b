"""Policies exported elsewhere, made exports: every case of ``fixtures/foreign/`` (rsl_rl's own
exporter, SB3's documented recipe, ``torch.onnx.export`` with TorchScript and dynamo; written by
``fixtures/foreign/make_foreign.py`` with each framework's recording) exported with every format
written from an ONNX model alone, against the recording, on the CPU.

``python -m tests.foreign_matrix`` prints the table docs/foreign.md quotes: per case how the
recording was replayed (by ``verify OUT``, which passes too), the largest error of the float formats (``onnx``, ``openvino``, ``triton``:
ONNX Runtime and OpenVINO at float32) over every recorded output, and the lossy formats' judged
metric on the worst action (Box error as a share of the range, or the share of identical actions).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOREIGN = ROOT / "fixtures/foreign"
FORMATS = ["onnx", "openvino", "triton", "onnx_fp16", "onnx_int8"]
FLOAT = ("onnx", "openvino", "triton")


def cases() -> list[str]:
    return sorted(p.name for p in FOREIGN.iterdir() if (p / "case.json").is_file())


def model(case: str) -> Path:
    return next((FOREIGN / case).glob("*.onnx"))


def run(case: str, out: Path) -> dict:
    """Export ``case`` to ``out`` and summarise its parity (lossy formats judged at 95% agreement)."""
    from policy_export import export_model, verify_export

    result = export_model(model(case), out, reference=FOREIGN / case / "reference.npz", formats=FORMATS,
                          device="cpu", behaviour={"onnx_int8": {"min_agreement": 0.95}})
    records = result.parity.records
    worst = {f: max((r.max_abs_err for r in records if r.format.split(" ")[0] == f), default=None) for f in FLOAT}
    judged = {}
    for fmt in ("onnx_fp16", "onnx_int8"):
        checks = [c for c in result.parity.behaviour if c.format.split(" ")[0] == fmt and c.metric != "error"]
        box = [c.value for c in checks if c.metric == "box_error"]
        agree = [c.value for c in checks if c.metric == "agreement"]
        judged[fmt] = (f"{max(box):.2%} err" if box else "") + (" " if box and agree else "") + \
            (f"{min(agree):.1%} same" if agree else "")
    again = verify_export(out, device="cpu")  # the stored recording, replayed by verify
    replayed = next((n.split("; replayed ", 1)[1] for n in again.notes if "; replayed " in n), "")
    return {"case": case, "passed": result.parity.passed and again.passed, "replay": replayed, "worst": worst,
            "judged": judged, "rows": result.parity.samples, "missing": result.missing}


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases():
            rows.append(run(case, Path(tmp) / case))
    print("| case | rows | replayed | onnx | openvino | triton | onnx_fp16 | onnx_int8 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        worst = [f"{r['worst'][f]:.1e}" if r["worst"][f] is not None else "-" for f in FLOAT]
        print(f"| {r['case']} | {r['rows']} | {r['replay']} | " + " | ".join(worst)
              + f" | {r['judged']['onnx_fp16']} | {r['judged']['onnx_int8']} |")
    failed = [r["case"] for r in rows if not r["passed"] or r["missing"]]
    print(json.dumps({"cases": len(rows), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
