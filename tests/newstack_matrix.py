"""RLlib's new API stack (torch RLModules) converted without ray and torch, against RLlib's own outputs.

For each checkpoint under ``fixtures/rllib/newstack/`` (ray 2.60) and ``fixtures/rllib/newstack/ray240/``
(ray 2.40), written with ``fixtures/rllib/make_newstack.py``, and each of its module ids: export it
(``saved_model`` and ``onnx``), run ``model.onnx`` in ONNX Runtime on the raw environment
observations (an LSTM module stepped with the state ONNX Runtime returned fed back), and compare with
what RLlib recorded (``expected.npz``): the module's ``forward_inference`` outputs on its
connector's observations, ``compute_values``, the deterministic action (``to_deterministic()``)
and, for a Box, the action ``NormalizeAndClipActions`` gives the environment.

``python -m tests.newstack_matrix`` prints the table docs/rllib-new-stack.md quotes
(``--root DIR``: the cases under another directory).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NEWSTACK = ROOT / "fixtures/rllib/newstack"
ROOTS = (NEWSTACK, NEWSTACK / "ray240")
ATOL = RTOL = 1e-5  # |error| <= ATOL + RTOL * |RLlib's value|, per output
FLOATS = ("action_dist_inputs", "vf_preds", "qf_preds")


def cases(root: Path = NEWSTACK) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "case.json").is_file() and (p / "expected.npz").is_file())


def all_cases() -> list[tuple[Path, str]]:
    return [(root, case) for root in ROOTS if root.is_dir() for case in cases(root)]


def case_record(root: Path, case: str) -> dict:
    return json.loads((root / case / "case.json").read_text())


def expected_outputs(root: Path, case: str) -> dict[str, np.ndarray]:
    with np.load(root / case / "expected.npz") as data:
        return {k: data[k] for k in data.files}


def module_ids(root: Path, case: str) -> list[str]:
    return list(case_record(root, case)["module_ids"])


def rllib_state_key(name: str) -> str:
    """The recorded key of one of the export's state names (``actor.h`` -> ``actor_h``)."""
    return name.replace(".", "_")


def _float_errors(name: str, got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    err = np.abs(got.astype(np.float64).reshape(want.shape) - want)
    return {name: float(np.max(err)), f"{name} tolerance units": float(np.max(err / (ATOL + RTOL * np.abs(want))))}


def errors_against_rllib(got: dict, expected: dict, mid: str, step: int | None = None) -> dict[str, float]:
    """The largest error per output (absolute, and in units of the tolerance: <= 1 passes);
    discrete actions 0 when identical, else inf."""
    def want(name):
        value = expected[f"{mid}/{name}"]
        return value if step is None else value[step]

    key = "env_actions" if f"{mid}/env_actions" in expected else "actions"
    action = want(key)
    if np.issubdtype(action.dtype, np.integer):
        errors = {"actions_0": 0.0 if np.array_equal(got["actions_0"].reshape(action.shape), action) else float("inf")}
    else:
        errors = _float_errors("actions_0", got["actions_0"], action)
    for name in FLOATS:
        if f"{mid}/{name}" in expected and name in got:
            errors.update(_float_errors(name, got[name], want(name)))
    return errors


def passes(errors: dict[str, float]) -> bool:
    return all(v <= 1.0 for k, v in errors.items() if k.endswith("tolerance units") or k == "actions_0")


def run_policy(run, expected: dict, mid: str, state_names: list[str]) -> dict[str, float]:
    """``run(feeds) -> outputs`` (a runtime of the export) against RLlib's recorded outputs; a
    recurrent module stepped, its state fed back from what ``run`` returned."""
    obs = expected.get(f"{mid}/obs")
    if obs is None:  # a Dict observation: observations/<key>, as the export names its inputs
        prefix = f"{mid}/obs/"
        return errors_against_rllib(run({"observations/" + k[len(prefix):]: v for k, v in expected.items()
                                         if k.startswith(prefix)}), expected, mid)
    if not state_names:
        return errors_against_rllib(run({"observations": obs}), expected, mid)
    worst: dict[str, float] = {}
    state = [expected[f"{mid}/state_in_{rllib_state_key(n)}"][0][:, 0, :] for n in state_names]
    for step in range(obs.shape[0]):
        feeds = {"observations": obs[step], "seq_lens": np.ones(obs.shape[1], np.int32),
                 **{f"state_in_{i}": s for i, s in enumerate(state)}}
        got = run(feeds)
        found = errors_against_rllib(got, expected, mid, step)
        for i, name in enumerate(state_names):
            found.update(_float_errors(f"state_out_{i}", got[f"state_out_{i}"],
                                       expected[f"{mid}/state_out_{rllib_state_key(name)}"][step][:, 0, :]))
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in found.items()}
        state = [got[f"state_out_{i}"] for i in range(len(state_names))]
    return worst


def onnx_runner(export: Path):
    """``model.onnx`` of ``export`` in ONNX Runtime, fed only the inputs its contract requires."""
    import onnxruntime as ort

    manifest = json.loads((export / "manifest.json").read_text())
    required = [s["key"] for s in manifest["contract"]["inputs"] if s["required"]]
    session = ort.InferenceSession(str(export / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def run(feeds: dict) -> dict:
        assert sorted(feeds) == sorted(required), (sorted(feeds), required)
        return dict(zip(names, session.run(None, feeds)))

    return run, manifest


def source_options(root: Path, case: str, mid: str) -> dict:
    """The source's options a case needs: the module, and where the MeanStdFilter keeps statistics
    per agent, the agent RLlib mapped to it (the script's mapping, ``case.json``)."""
    record, options = case_record(root, case), {"policy_id": mid}
    if record.get("filter_multi_agent"):
        options["filter_agent"] = next(a for a, m in record["agent_to_module"].items() if m == mid)
    elif "module_obs_agent" in record:  # whose observations the recording holds (a multi-agent FlattenObservations)
        options["filter_agent"] = str(record["module_obs_agent"][mid])
    return options


def export_case(root: Path, case: str, mid: str, out: Path) -> Path:
    from policy_export import export_source

    export_source(root / case / "checkpoint", out, device="cpu", formats=["saved_model", "onnx"], samples=200,
                  explore_samples=1000, **source_options(root, case, mid))
    return out


def onnx_errors(export: Path, root: Path, case: str, mid: str) -> dict[str, float]:
    run, manifest = onnx_runner(export)
    return run_policy(run, expected_outputs(root, case), mid, manifest["source"]["state_names"])


def _space_kind(text: str) -> str:
    return text.split("(", 1)[0]


def _row(root: Path, case: str, mid: str, export: Path, errors: dict[str, float]) -> str:
    record = case_record(root, case)
    source = json.loads((export / "manifest.json").read_text())["source"]
    filt = source["observation_filter"]
    discrete = errors["actions_0"] in (0.0, float("inf")) and "actions_0 tolerance units" not in errors
    action = ("identical" if errors["actions_0"] == 0 else "differs") if discrete else f"{errors['actions_0']:.1e}"
    floats = max([v for k, v in errors.items() if k != "actions_0" and not k.endswith("units")] or [0.0])
    units = max([v for k, v in errors.items() if k.endswith("units")] or [0.0])
    assert passes(errors), (case, mid, errors)
    return (f"| {record['algo']} | {record['ray_version']} | {case} | {mid} | "
            f"{_space_kind(record['modules'][mid]['action_space'])} | {source['network']} | "
            f"{filt['class'] if filt else '-'} | {action} | {floats:.1e} | {units:.2f} |")


def main(argv: list[str]) -> int:
    from policy_export.errors import ExportError
    from policy_export.exporter.quiet import quiet_libraries

    roots = [Path(argv[1])] if argv[:1] == ["--root"] else [r for r in ROOTS if r.is_dir()]
    quiet_libraries(False)
    print("| algorithm | ray | checkpoint | module | actions | network | filter | action (environment's) "
          "| largest float error | of the tolerance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for root in roots:
            for case in cases(root):
                for mid in module_ids(root, case):
                    try:
                        out = export_case(root, case, mid, Path(tmp) / root.name / case / mid)
                    except ExportError as e:  # a module that is not RLlib's default one: refused
                        record = case_record(root, case)
                        print(f"| {record['algo']} | {record['ray_version']} | {case} | {mid} | refused: "
                              f"{str(e).split(';')[0]} |||||||", flush=True)
                        continue
                    print(_row(root, case, mid, out, onnx_errors(out, root, case, mid)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
