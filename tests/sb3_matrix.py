"""Stable-Baselines3 model zips converted without torch and SB3, against SB3's own outputs.

For each case under ``fixtures/sb3/`` (SB3 and sb3-contrib 2.9.2) and ``fixtures/sb3/sb3_2.0.0/``
(2.0.0), written with ``fixtures/sb3/make_sb3.py`` and its recordings of SB3's own outputs
(``expected.npz``): export it (``saved_model`` and ``onnx``), run ``model.onnx`` in ONNX Runtime on
the raw environment observations (a recurrent policy stepped, the state ONNX Runtime returned fed
back and zeros fed at each episode start, as SB3's ``episode_starts`` resets it), and compare with
what SB3 recorded: ``predict(obs, deterministic=True)``, the values, Q-values and the
distribution's parameters.

``python -m tests.sb3_matrix`` prints the table docs/sb3.md quotes.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

try:  # as a module of the test run, or as python -m tests.sb3_matrix
    from newstack_matrix import onnx_runner
except ImportError:  # pragma: no cover
    from tests.newstack_matrix import onnx_runner

ROOT = Path(__file__).resolve().parent.parent
SB3 = ROOT / "fixtures/sb3"
ROOTS = (SB3, SB3 / "sb3_2.0.0")
ATOL = RTOL = 1e-5  # |error| <= ATOL + RTOL * |SB3's value|, per output


def cases(root: Path = SB3) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "model.zip").is_file() and (p / "expected.npz").is_file())


def all_cases() -> list[tuple[Path, str]]:
    return [(root, case) for root in ROOTS if root.is_dir() for case in cases(root)]


def case_record(root: Path, case: str) -> dict:
    return json.loads((root / case / "case.json").read_text())


def expected_outputs(root: Path, case: str) -> dict[str, np.ndarray]:
    with np.load(root / case / "expected.npz") as data:
        return {k: data[k] for k in data.files}


def source_options(root: Path, case: str) -> dict:
    norm = root / case / "vec_normalize.pkl"
    return {"vec_normalize": str(norm)} if norm.is_file() else {}


def _floats(name: str, got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    got = np.asarray(got, np.float64).reshape(want.shape)
    err = np.abs(got - want)
    return {name: float(np.max(err)), f"{name} tolerance units": float(np.max(err / (ATOL + RTOL * np.abs(want))))}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def errors_against_sb3(got: dict, want: dict, record: dict) -> dict[str, float]:
    """The largest error per output (absolute, and in units of the tolerance: <= 1 passes);
    discrete actions as the share of rows identical (``actions identical``)."""
    out: dict[str, float] = {}
    actions = want["actions"]
    if np.issubdtype(actions.dtype, np.floating) and record["action_space"].startswith("Box"):
        out.update(_floats("actions", got["actions_0"], actions))
    else:
        same = np.asarray(got["actions_0"]).reshape(actions.shape).astype(np.float64) == actions.astype(np.float64)
        rows = same.reshape(len(actions), -1).all(axis=1)
        out["actions identical"] = float(rows.mean())
    if "values" in want and "values" in got:
        out.update(_floats("values", got["values"], want["values"].reshape(-1)))
    if "q_values" in want and "q_values" in got:
        out.update(_floats("q_values", got["q_values"], want["q_values"]))
    inputs = got.get("action_dist_inputs")
    if inputs is not None:
        if "logits" in want and record["action_space"].startswith("Discrete"):  # torch's normalised logits
            kept = want["logits"] > -1e7  # MaskablePPO: the masked ones are -1e8 on both sides
            out.update(_floats("logits", _log_softmax(inputs)[kept], want["logits"][kept]))
        elif "action_net_out" in want and not record["action_space"].startswith("Box"):
            out.update(_floats("logits", inputs, want["action_net_out"]))
        elif "mean_actions" in want:
            dim = want["mean_actions"].shape[-1]
            out.update(_floats("mean", inputs[..., :dim], want["mean_actions"]))
            if "log_std" in want and want["log_std"].shape == inputs[..., dim:].shape:  # gSDE's is a matrix
                out.update(_floats("log_std", inputs[..., dim:], want["log_std"]))
    return out


def passes(errors: dict[str, float]) -> bool:
    return all(v <= 1.0 for k, v in errors.items() if k.endswith("tolerance units")) \
        and errors.get("actions identical", 1.0) == 1.0


def _feeds(want: dict, prefix: str = "obs", step: int | None = None) -> dict[str, np.ndarray]:
    feeds = {}
    for key, value in want.items():
        if key == prefix:
            feeds["observations"] = value if step is None else value[step]
        elif key.startswith(prefix + "/"):
            feeds["observations/" + key[len(prefix) + 1:]] = value if step is None else value[step]
    if "action_masks" in want:
        feeds["action_masks"] = want["action_masks"]
    return feeds


def run_policy(run, want: dict, record: dict, state_names: list[str]) -> dict[str, float]:
    """``run(feeds) -> outputs`` (a runtime of the export) against SB3's recordings; a recurrent
    policy stepped, its state fed back (zeros at each episode start)."""
    if not state_names:
        return errors_against_sb3(run(_feeds(want)), want, record)
    steps, batch = want["episode_starts"].shape
    state: list[np.ndarray] | None = None
    worst: dict[str, float] = {}
    for t in range(steps):
        starts = want["episode_starts"][t]
        if state is None:
            state = [np.zeros((batch, want["state_in_pi_h"].shape[-1]), np.float32) for _ in state_names]
        state = [np.where(starts[:, None], 0.0, s).astype(np.float32) for s in state]
        feeds = {**_feeds(want, step=t), "seq_lens": np.ones(batch, np.int32),
                 **{f"state_in_{i}": s for i, s in enumerate(state)}}
        got = run(feeds)
        step_want = {k: v[t] for k, v in want.items() if k not in ("samples", "samples_obs") and v.shape[:1] == (steps,)}
        found = errors_against_sb3(got, step_want, record)
        for i, name in enumerate(state_names):  # "pi.h0": SB3's state_out_pi_h[t][:, layer 0]
            role, kind = name.split(".")
            key = f"state_out_{role}_{kind[0]}"
            if key in want:
                found.update(_floats(f"state_out_{i}", got[f"state_out_{i}"], want[key][t][:, int(kind[1:]), :]))
        worst = {k: (min(v, worst.get(k, 1.0)) if k == "actions identical" else max(v, worst.get(k, 0.0)))
                 for k, v in found.items()}
        state = [got[f"state_out_{i}"] for i in range(len(state_names))]
    return worst


def export_case(root: Path, case: str, out: Path) -> Path:
    from policy_export import export_source

    export_source(root / case / "model.zip", out, device="cpu", formats=["saved_model", "onnx"], samples=200,
                  explore_samples=1000, **source_options(root, case))
    return out


def onnx_errors(export: Path, root: Path, case: str) -> dict[str, float]:
    run, manifest = onnx_runner(export)
    return run_policy(run, expected_outputs(root, case), case_record(root, case), manifest["source"]["state_names"])


def _row(root: Path, case: str, export: Path, errors: dict[str, float]) -> str:
    record = case_record(root, case)
    source = json.loads((export / "manifest.json").read_text())["source"]
    share = errors.get("actions identical")
    action = f"{share:.0%} identical" if share is not None else f"{errors['actions']:.1e}"
    floats = max([v for k, v in errors.items() if k != "actions identical" and not k.endswith("units")] or [0.0])
    units = max([v for k, v in errors.items() if k.endswith("units")] or [0.0])
    assert passes(errors), (case, errors)
    version = record["versions"]["stable_baselines3"]
    return (f"| {source['algorithm']} | {version} | {case} | {record['policy_class'].rsplit('.', 1)[-1]} | "
            f"{record['action_space'].split('(', 1)[0]} | {action} | {floats:.1e} | {units:.2f} |")


def main(argv: list[str]) -> int:
    from policy_export.errors import ExportError
    from policy_export.exporter.quiet import quiet_libraries

    quiet_libraries(False)
    print("| algorithm | SB3 | case | policy | actions | deterministic action | largest float error "
          "| of the tolerance |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for root, case in all_cases():
            try:
                out = export_case(root, case, Path(tmp) / root.name / case)
            except ExportError as e:  # a policy of the user's own: refused
                record = case_record(root, case)
                print(f"| refused | {record['versions']['stable_baselines3']} | {case} | "
                      f"{str(e).split(';')[0].split(': ', 2)[-1][:90]} |||||", flush=True)
                continue
            print(_row(root, case, out, onnx_errors(out, root, case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
