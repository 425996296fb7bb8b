"""RLlib checkpoints converted without ray, ``model.onnx`` against RLlib's own outputs.

For each checkpoint under ``fixtures/rllib/checkpoints/`` (written by RLlib 2.9.3, and the
``ray25_*`` ones by RLlib 2.5.1, with ``fixtures/rllib/make_checkpoints.py``) and each of its policy ids: ``convert`` it, run
``model.onnx`` in ONNX Runtime fed the raw environment observations and only the inputs its
contract requires (recurrent policies stepped with the state ONNX Runtime returned fed back), and
compare with RLlib's ``policy.compute_actions(explore=False)`` on its own filtered observations
(``expected.npz``; the environment's action is RLlib's ``unsquash_action``/``clip_action`` of it).

``python -m tests.checkpoint_matrix`` prints the table docs/rllib-checkpoints.md quotes.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "fixtures/rllib/checkpoints"
CASES = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "case.json").is_file())
# RLlib's floats against model.onnx, per output: |error| <= ATOL + RTOL * |RLlib's value|
# (np.allclose's criterion: a vision net on raw 0-255 pixels has logits of 10-100)
ATOL = RTOL = 1e-5
EXTRAS = ("action_dist_inputs", "vf_preds", "q_values")


def case_record(name: str, root: Path = CHECKPOINTS) -> dict:
    return json.loads((root / name / "case.json").read_text())


def expected_outputs(name: str, root: Path = CHECKPOINTS) -> dict[str, np.ndarray]:
    with np.load(root / name / "expected.npz") as data:
        return {k: data[k] for k in data.files}


def raw_observations(expected: dict, pid: str, step: int | None = None) -> dict[str, np.ndarray]:
    """The raw observations under the export's keys (``observations``, ``observations/<key>``)."""
    prefix = f"{pid}/obs"
    return {"observations" + key[len(prefix):]: value if step is None else value[step]
            for key, value in expected.items() if key == prefix or key.startswith(prefix + "/")}


class OnnxPolicy:
    """``model.onnx`` of an export, fed only the inputs its contract requires."""

    def __init__(self, export: Path):
        import onnxruntime as ort

        self.manifest = json.loads((export / "manifest.json").read_text())
        self.required = [s["key"] for s in self.manifest["contract"]["inputs"] if s["required"]]
        self.session = ort.InferenceSession(str(export / "model.onnx"), providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert sorted(feeds) == sorted(self.required), (sorted(feeds), self.required)
        assert set(self.required) <= {i.name for i in self.session.get_inputs()}
        return dict(zip(self.outputs, self.session.run(None, feeds)))


def actions_key(expected: dict, pid: str, actions: str) -> str:
    return "env_actions" if actions == "environment" and f"{pid}/env_actions" in expected else "actions"


def errors_against_rllib(got: dict, expected: dict, pid: str, key: str, step: int | None = None) -> dict[str, float]:
    """The largest error per output, in units of the tolerance ``ATOL + RTOL * |value|`` (a value
    <= 1 passes) under ``"<key> tolerance units"``, and as absolute error under the key itself
    (discrete actions: 0 when identical, else inf)."""
    def want(name):
        value = expected[f"{pid}/{name}"]
        return value if step is None else value[step]

    action = want(key).reshape(got["actions_0"].shape)
    if np.issubdtype(action.dtype, np.integer):
        errors = {"actions_0": 0.0 if np.array_equal(got["actions_0"], action) else float("inf")}
    else:
        errors = _float_errors("actions_0", got["actions_0"], action)
    for name in EXTRAS:
        if f"{pid}/{name}" in expected and name in got:
            errors.update(_float_errors(name, got[name], want(name).reshape(got[name].shape)))
    return errors


def _float_errors(name: str, got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    err = np.abs(got.astype(np.float64) - want)
    return {name: float(np.max(err)), f"{name} tolerance units": float(np.max(err / (ATOL + RTOL * np.abs(want))))}


def passes(errors: dict[str, float]) -> bool:
    """Discrete actions identical, every float within its tolerance."""
    return all(v <= 1.0 for k, v in errors.items() if k.endswith("tolerance units") or k == "actions_0")


def observation_feeds(policy: OnnxPolicy, expected: dict, pid: str, step: int | None = None) -> dict[str, np.ndarray]:
    """The raw observations, or RLlib's filtered ones where the export holds no filter although
    RLlib applied one (a Policy checkpoint written with connectors off carries none)."""
    if policy.manifest["contract"].get("observation_filter") is None and f"{pid}/filtered" in expected \
            and not policy.manifest["source"].get("observation_filter_left_out") \
            and policy.manifest["source"].get("observation_filter_note"):
        filtered = expected[f"{pid}/filtered"]
        return {"observations": filtered if step is None else filtered[step]}
    return raw_observations(expected, pid, step)


def stepped_errors(policy: OnnxPolicy, expected: dict, pid: str, key: str) -> dict[str, float]:
    """A recurrent policy stepped as RLlib was, the state ONNX Runtime returns fed back."""
    worst: dict[str, float] = {}
    state = [expected[f"{pid}/state_in_{i}"][0] for i in range(2)]
    for step in range(expected[f"{pid}/actions"].shape[0]):
        feeds = {**observation_feeds(policy, expected, pid, step), "state_in_0": state[0], "state_in_1": state[1],
                 "seq_lens": np.ones(len(state[0]), np.int32)}
        feeds.update({name: expected[f"{pid}/{name}"][step] for name in ("prev_action", "prev_reward")
                      if name in policy.required})
        got = policy.run(feeds)
        found = errors_against_rllib(got, expected, pid, key, step)
        for i in range(2):
            found.update(_float_errors(f"state_out_{i}", got[f"state_out_{i}"], expected[f"{pid}/state_out_{i}"][step]))
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in found.items()}
        state = [got["state_out_0"], got["state_out_1"]]
    return worst


def onnx_errors(export: Path, case: str, pid: str, actions: str = "environment",
                root: Path = CHECKPOINTS) -> dict[str, float]:
    """The largest error per output of ``export``'s ``model.onnx`` against RLlib's for ``case``."""
    expected = expected_outputs(case, root)
    policy = OnnxPolicy(export)
    key = actions_key(expected, pid, actions)
    if "state_in_0" in policy.required:
        return stepped_errors(policy, expected, pid, key)
    return errors_against_rllib(policy.run(observation_feeds(policy, expected, pid)), expected, pid, key)


def _row(case: str, pid: str, export: Path, errors: dict[str, float], root: Path) -> str:
    source = json.loads((export / "manifest.json").read_text())["source"]
    filt = source["observation_filter"]
    if filt is None and source.get("observation_filter_note"):
        filt = {"class": "none in the checkpoint (fed RLlib's filtered observations)", "clip": None}
    discrete = np.issubdtype(expected_outputs(case, root)[f"{pid}/actions"].dtype, np.integer)
    action = ("identical" if errors["actions_0"] == 0 else "differs") if discrete else f"{errors['actions_0']:.1e}"
    units = max(v for k, v in errors.items() if k.endswith("units"))
    floats = max(v for k, v in errors.items() if k != "actions_0" and not k.endswith("units"))
    assert passes(errors), errors
    meta = case_record(case, root)["rllib_checkpoint"]
    return (f"| {case} | {pid} | {meta['ray_version']} | {source['policy_class']} | {source['framework']} | "
            f"{meta['type']}, {meta['format']} | "
            f"{filt['class'] + (' clip ' + str(filt['clip']) if filt['clip'] else '') if filt else '-'} | "
            f"{action} | {floats:.1e} | {units:.2f} |")


def main(argv: list[str]) -> int:
    """``[--root DIR]``: the checkpoints under ``DIR`` (default ``fixtures/rllib/checkpoints``), as
    ``make_checkpoints.py --out DIR`` writes them with any ray version."""
    from policy_export.exporter.convert import convert_checkpoint
    from policy_export.exporter.options import ExportOptions
    from policy_export.exporter.quiet import quiet_libraries

    root = Path(argv[1]) if argv[:1] == ["--root"] else CHECKPOINTS
    quiet_libraries(False)
    print("| checkpoint | policy id | ray | policy class | framework | kind | filter | actions (environment's) "
          "| largest float error | of the tolerance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in sorted(p.name for p in root.iterdir() if (p / "case.json").is_file()):
            for pid in case_record(case, root)["policy_ids"]:
                out = Path(tmp) / case / pid
                convert_checkpoint(root / case / "checkpoint", out, policy_id=pid, device="cpu",
                                   options=ExportOptions(samples=200, explore_samples=1000))
                print(_row(case, pid, out, onnx_errors(out, case, pid, root=root), root), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
