"""A policy exported elsewhere, checked against what its framework computed: ONNX files from
rsl_rl's own exporter, SB3's documented recipe and plain ``torch.onnx.export``, each with the
recording of its framework's outputs (``fixtures/foreign/``, made by
``fixtures/foreign/make_foreign.py``); ``verify MODEL.onnx --reference REF.npz`` passes on the
true recording and fails, naming the first diverging output, on faults seeded into the real files;
a recording that does not fit the graph is refused before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import ROOT
from helpers import bypass_normaliser, cli, one_line_error

FOREIGN = ROOT / "fixtures/foreign"
CASES = sorted(p.name for p in FOREIGN.iterdir() if (p / "case.json").is_file())


def _model(case: str) -> Path:
    return next((FOREIGN / case).glob("*.onnx"))


def _verify(model: Path, reference: Path, *extra: str):
    return cli("verify", str(model), "--reference", str(reference), *extra)


def test_the_fixtures_cover_every_exporter():
    frameworks = {json.loads((FOREIGN / c / "case.json").read_text()).get("framework", c.split("_")[0]) for c in CASES}
    assert len(CASES) >= 8 and any("rsl" in f for f in frameworks)


@pytest.mark.parametrize("case", CASES)
def test_each_export_matches_its_frameworks_recording(case):
    done = _verify(_model(case), FOREIGN / case / "reference.npz")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every recorded output matches" in done.stdout


def _saved(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _loaded(case: str) -> onnx.ModelProto:
    return onnx.load(str(_model(case)))  # with its external data, saved back as one file



def _scaled(model: onnx.ModelProto, output: str, factor: float = 1.1) -> onnx.ModelProto:
    inner = output + "_unscaled"
    for node in model.graph.node:
        node.output[:] = [inner if o == output else o for o in node.output]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(factor, np.float32), "scale_fault"))
    model.graph.node.append(helper.make_node("Mul", [inner, "scale_fault"], [output]))
    return model


def _row_zero(model: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """``output`` answers every row with row 0's value (a graph that broadcasts its first row)."""
    inner = output + "_rows"
    for node in model.graph.node:
        node.output[:] = [inner if o == output else o for o in node.output]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "row0"))
    model.graph.node.extend([helper.make_node("Gather", [inner, "row0"], [inner + "_0"], axis=0),
                             helper.make_node("Shape", [inner], [inner + "_shape"]),
                             helper.make_node("Expand", [inner + "_0", inner + "_shape"], [output])])
    return model


def _state_not_carried(model: onnx.ModelProto, pairs: dict[str, str]) -> onnx.ModelProto:
    """Every state output gives back the state it was given: nothing is carried."""
    for state_in, state_out in pairs.items():
        for node in model.graph.node:
            node.output[:] = [state_out + "_dropped" if o == state_out else o for o in node.output]
        model.graph.node.append(helper.make_node("Identity", [state_in], [state_out]))
    return model


FAULTS = {
    "the normaliser bypassed": ("rsl_rl_mlp", bypass_normaliser, "actions"),
    "the action scale changed": ("rsl_rl_mlp", lambda m: _scaled(m, "actions"), "actions"),
    "a dynamic batch answering with row 0": ("torch_lstm_script", lambda m: _row_zero(m, "actions"), "actions"),
    "the recurrent state not fed back": ("rsl_rl_lstm", lambda m: _state_not_carried(m, {"h_in": "h_out",
                                                                                           "c_in": "c_out"}),
                                         "actions"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_seeded_fault_fails_naming_the_first_diverging_output(tmp_path, fault):
    case, seed, output = FAULTS[fault]
    model = _saved(seed(_loaded(case)), tmp_path / "model.onnx")
    report = tmp_path / "report.json"
    done = _verify(model, FOREIGN / case / "reference.npz", "--report-json", str(report))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"first diverging: output {output} at row" in done.stdout
    assert "verify failed" in done.stderr and "Traceback" not in done.stderr
    doc = json.loads(report.read_text())
    assert not doc["passed"] and any(r.get("first_divergence") for r in doc["records"])


@pytest.mark.parametrize("case,rows", [("sb3_ppo_box_recipe", 80), ("sb3_sac_recipe", 300)])
def test_the_recipes_missing_post_processing_is_caught_against_predict(case, rows):
    """SB3's recipe leaves out predict's clip (PPO) and unscale (SAC): against what predict
    returned, the export fails on the rows it changes."""
    report = Path(os.environ.get("TMPDIR", "/tmp")) / f"{case}-predict.json"
    done = _verify(_model(case), FOREIGN / case / "reference_predict.npz", "--report-json", str(report))
    assert done.returncode == 1, done.stdout
    (record,) = [r for r in json.loads(report.read_text())["records"] if not r["passed"]]
    assert record["mismatches"] == rows
    report.unlink()


def _recording(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def test_a_recording_that_does_not_fit_the_graph_is_refused_before_anything_runs(tmp_path):
    case = "torch_mlp_static"
    with np.load(FOREIGN / case / "reference.npz") as data:
        good = {k: data[k] for k in data.files}
    model = _model(case)
    stray = _recording(tmp_path / "a.npz", **{**good, "observation": good["obs"]})
    one_line_error(_verify(model, stray), 2, "observation is not an input or output of the graph")
    renamed = {("observation" if k == "obs" else k): v for k, v in good.items()}
    assert _verify(model, _recording(tmp_path / "b.npz", **renamed), "--reference-name",
                   "observation=obs").returncode == 0
    wide = _recording(tmp_path / "c.npz", **{**good, "obs": np.zeros((len(good["obs"]), 5), np.float32)})
    one_line_error(_verify(model, wide), 2, "obs's rows are [5]; the graph's obs is [1, 4]")
    floats = _recording(tmp_path / "d.npz", **{**good, "actions": good["actions"].astype(np.float32)})
    one_line_error(_verify(model, floats), 2, "actions is float32; the graph's actions is int64")
    short = _recording(tmp_path / "e.npz", **{**good, "logits": good["logits"][:-1]})
    one_line_error(_verify(model, short), 2, "its arrays hold different numbers of rows")


def test_a_recurrent_recording_needs_its_episodes_and_pairs_its_state(tmp_path):
    case = "torch_lstm_script"
    with np.load(FOREIGN / case / "reference.npz") as data:
        good = {k: data[k] for k in data.files}
    model = _model(case)
    no_ids = _recording(tmp_path / "a.npz", **{k: v for k, v in good.items() if k != "episode_ids"})
    one_line_error(_verify(model, no_ids), 2, "h_in, c_in are not recorded, so they are its state")
    paired = _verify(model, FOREIGN / case / "reference.npz", "--state-pair", "h_in=h_out", "--state-pair",
                     "c_in=c_out")
    assert paired.returncode == 0, paired.stdout + paired.stderr
    swapped = _verify(model, FOREIGN / case / "reference.npz", "--state-pair", "h_in=c_out", "--state-pair",
                      "c_in=h_out")
    assert swapped.returncode == 1  # the state fed back from the wrong outputs diverges
    one_line_error(_verify(model, FOREIGN / case / "reference.npz", "--state-pair", "h_in=zz"), 2,
                   "--state-pair h_in=zz does not name a graph input and output")


def test_options_of_an_exports_verify_are_refused_for_a_model_file(tmp_path):
    model, reference = _model("torch_mlp_static"), FOREIGN / "torch_mlp_static/reference.npz"
    one_line_error(cli("verify", str(model)), 2, "is a model file, not an export")
    one_line_error(_verify(model, reference, "--samples", "5"), 2, "--samples applies to an export")
    one_line_error(cli("verify", str(FOREIGN), "--reference", str(reference)), 2, "--reference checks a model file")


def test_verify_of_a_model_file_loads_no_tensorflow_and_writes_its_reports(tmp_path):
    model, reference = _model("rsl_rl_lstm"), FOREIGN / "rsl_rl_lstm/reference.npz"
    code = ("import sys\n"
            "from policy_export.exporter.cli import main\n"
            f"rc = main(['verify', {str(model)!r}, '--reference', {str(reference)!r}, '--junit', "
            f"{str(tmp_path / 'j.xml')!r}])\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
            "sys.exit(rc)\n")
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "testcase" in (tmp_path / "j.xml").read_text()
    assert "onnx (episodes)" in (tmp_path / "summary.md").read_text()


def test_the_recording_helper_writes_what_verify_reads(tmp_path):
    """``policy_export.recording`` (numpy only) on the training side, stepping a model as a framework would."""
    import onnxruntime as ort

    from policy_export.recording import Recording, save_reference

    model = _model("torch_lstm_script")
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    rec = Recording()
    for episode in ("a", "b", "c"):
        h = c = np.zeros((1, 1, 16), np.float32)
        for _ in range(5):
            obs = rng.standard_normal((1, 8)).astype(np.float32)
            actions, h, c = session.run(["actions", "h_out", "c_out"], {"obs": obs, "h_in": h, "c_in": c})
            rec.add({"obs": obs[0], "actions": actions[0]}, episode_id=episode)
    path = rec.save(tmp_path / "ref")
    assert path.name == "ref.npz" and list(rec.arrays()["episode_ids"]) == [0] * 5 + [1] * 5 + [2] * 5
    assert _verify(model, path).returncode == 0
    with pytest.raises(ValueError, match="the same number of rows"):
        save_reference(tmp_path / "bad.npz", {"obs": np.zeros((3, 8)), "actions": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="every step holds the same arrays"):
        rec.add({"obs": np.zeros(8, np.float32)})
