"""Every RLlib algorithm fixture x route x format, against RLlib's own ``compute_actions(explore=False)``.

Each fixture under ``fixtures/rllib/legacy_algos`` (ray 2.0.1 ``export_model`` SavedModels) and
``fixtures/rllib/keras_algos`` (ray 2.9.3 Keras base models) is converted with ``convert``; then
every written format that runs the signature is fed only what a client has (RLlib's own inputs
in the fixture's ``expected.npz``: the observations, and for a recurrent policy its state and
``seq_lens``) and compared with RLlib's outputs: discrete actions identical, floats within 1e-5.
``model.onnx`` is also run straight in ONNX Runtime with exactly the inputs it lists.

``python -m tests.rllib_matrix`` prints the table docs/rllib-algorithms.md quotes (``--json`` the raw rows).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "rllib"
ROUTES = {"legacy_algos": ("convert (ray 2.0.1 SavedModel)", "saved_model"),
          "keras_algos": ("convert --action-space (ray 2.9.3 Keras model)", "model")}
ATOL = 1e-5
COMPARED = ("actions", "action_dist_inputs", "q_values")


def cases() -> list[tuple[str, str]]:
    """(route folder, case name) of every fixture."""
    return [(route, d.name) for route in ROUTES for d in sorted((FIXTURES / route).iterdir())
            if (d / "case.json").is_file()]


def load_case(route: str, name: str) -> tuple[dict, dict[str, np.ndarray]]:
    folder = FIXTURES / route / name
    info = json.loads((folder / "case.json").read_text())
    with np.load(folder / "expected.npz") as data:
        expected = {("observations" if k == "obs" else k): data[k] for k in data.files}
    return info, expected


def convert_case(route: str, name: str, out: Path):
    """Convert one fixture with its case.json spaces; returns the ExportResult."""
    from policy_export.exporter.convert import convert_saved_model
    from policy_export.policy.spaces import space_from_json

    info, _ = load_case(route, name)
    source = FIXTURES / route / name / ROUTES[route][1]
    spaces = {"observation_space": space_from_json(info["observation_space"]),
              "action_space": space_from_json(info["action_space"])}
    # the comparison with RLlib is on the fixture's own batch; the export's parity with its session
    # needs no more than these samples here
    return convert_saved_model(source, out, device="cpu", samples=200, explore_samples=2000, **spaces)


def _feeds(expected: dict[str, np.ndarray], step: int | None) -> dict[str, np.ndarray]:
    """What a client feeds: RLlib's inputs in the fixture (one step of a recorded episode batch)."""
    keys = [k for k in expected if k.startswith("observations") or k.startswith("state_in_")
            or k in ("prev_action", "prev_reward")]
    feeds = {k: expected[k] if step is None else expected[k][step] for k in keys}
    if step is not None:
        feeds["seq_lens"] = np.ones(len(feeds["observations"]), np.int32)
    return feeds


def _references(expected: dict[str, np.ndarray], step: int | None) -> dict[str, np.ndarray]:
    keys = [k for k in COMPARED if k in expected] + [k for k in expected if k.startswith("state_out_")]
    return {k: expected[k] if step is None else expected[k][step] for k in keys}


def largest_errors(run, expected: dict[str, np.ndarray], output_key=lambda k: "actions_0" if k == "actions" else k
                   ) -> dict[str, float]:
    """Largest absolute error per compared output over the fixture's batch (every step of a
    recurrent episode); an integer output that differs anywhere counts as ``inf``."""
    recurrent = any(k.startswith("state_in_") for k in expected)
    steps = range(len(expected["observations"])) if recurrent else [None]
    worst: dict[str, float] = {}
    for step in steps:
        got = run(_feeds(expected, step))
        for key, want in _references(expected, step).items():
            name = output_key(key)
            if name not in got:
                continue
            have = np.asarray(got[name])
            if np.issubdtype(want.dtype, np.integer):
                err = 0.0 if np.array_equal(have.astype(want.dtype), want) else float("inf")
            else:
                err = float(np.max(np.abs(have.astype(np.float64) - want))) if want.size else 0.0
            worst[key] = max(worst.get(key, 0.0), err)
    return worst


def check_formats(out: Path, expected: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Per written format: the largest errors, or what stopped it."""
    from policy_export.exporter.devices import plan_devices
    from policy_export.exporter import formats as registry
    from policy_export.exporter.manifest import read_manifest
    from policy_export.exporter.verify import load_runner

    doc = read_manifest(out)
    rows: dict[str, dict[str, Any]] = {}
    for name in doc["formats"]:
        if not registry.get(name).capabilities.signature:
            continue
        try:
            with load_runner(name, out, doc, plan_devices("cpu")) as runner:
                rows[name] = {"errors": largest_errors(runner, expected)}
        except Exception as e:  # noqa: BLE001  (the table reports it)
            rows[name] = {"failed": f"{type(e).__name__}: {e}"}
    if (out / "model.onnx").is_file():
        rows["model.onnx (onnxruntime, listed inputs only)"] = check_onnx_listed(out / "model.onnx", expected)
    return rows


def check_onnx_listed(path: Path, expected: dict[str, np.ndarray]) -> dict[str, Any]:
    """``model.onnx`` in ONNX Runtime fed exactly the inputs it lists: each must be one a client has."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    listed = [i.name for i in session.get_inputs()]
    have = set(_feeds(expected, 0 if any(k.startswith("state_in_") for k in expected) else None))
    missing = [k for k in listed if k not in have]
    if missing:
        return {"failed": f"model.onnx requires {missing}, which a client of this policy does not have"}
    names = [o.name for o in session.get_outputs()]

    def run(feeds):
        arrays = {k: np.asarray(v).astype(_ort_dtype(i.type)) for i in session.get_inputs()
                  for k, v in feeds.items() if k == i.name}
        return dict(zip(names, session.run(None, arrays)))

    return {"errors": largest_errors(run, expected)}


def _ort_dtype(text: str):
    return {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(int64)": np.int64,
            "tensor(int32)": np.int32, "tensor(bool)": np.bool_}.get(text, np.float32)


def run_case(route: str, name: str, work: Path) -> dict[str, Any]:
    """One fixture: converted, every format checked; the row of the table."""
    from policy_export.errors import PolicyExportError

    info, expected = load_case(route, name)
    row: dict[str, Any] = {"route": ROUTES[route][0], "case": name, "algorithm": info.get("algorithm")}
    source = FIXTURES / route / name / ROUTES[route][1]
    if not source.exists():
        row["failed"] = (info.get("export_model", {}).get("warnings") or ["RLlib's export_model wrote nothing"])[0]
        return row
    out = work / f"{route}-{name}"
    try:
        result = convert_case(route, name, out)
    except PolicyExportError as e:
        row["failed"] = re.sub(r"\S*\.partial/", "", str(e))  # the staging folder's name says nothing
        return row
    row["missing"] = result.manifest.get("missing", {})
    row["unused_inputs"] = result.manifest.get("unused_inputs", [])
    row["explore_refused"] = result.manifest.get("source", {}).get("explore", {}).get("refused")
    row["inputs"] = [i["key"] for i in result.manifest["contract"]["inputs"]]
    row["formats"] = check_formats(out, expected)
    return row


def _cell(record: dict[str, Any]) -> str:
    if "failed" in record:
        return "fails"
    errors = record["errors"]
    if not errors:
        return "-"
    if any(v == float("inf") for v in errors.values()):
        return "differs"
    return f"{max(errors.values()):.1e}"


def markdown(rows: list[dict[str, Any]]) -> str:
    formats = sorted({f for r in rows for f in r.get("formats", {})}, key=lambda f: (f.startswith("model.onnx"), f))
    head = "| route | case | algorithm | " + " | ".join(formats) + " |"
    lines = [head, "|" + "---|" * (3 + len(formats))]
    for r in rows:
        cells = [r.get("formats", {}).get(f) for f in formats]
        text = [("not written" if "failed" not in r else "") if c is None else _cell(c) for c in cells]
        if "failed" in r:
            text = ["not converted: " + r["failed"].split(";")[0][:80]] + [""] * (len(formats) - 1)
        lines.append(f"| {r['route']} | {r['case']} | {r['algorithm']} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("cases", nargs="*", help="route/case names (default: every fixture)")
    args = parser.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    chosen = [tuple(c.split("/", 1)) for c in args.cases] or cases()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(route, name, Path(tmp)) for route, name in chosen]
    print(json.dumps(rows, indent=1, default=str) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
