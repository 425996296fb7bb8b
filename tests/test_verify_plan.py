"""verify replays the stored parity plan: strict records, exploration, stepped parity, candidates.

Tampered exports are re-signed (the manifest's file list recomputed with the package's own
helpers), as an attacker or a careless downstream pass would leave them, so only the parity
checks can catch them.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import copy_of, verify_cli
from conftest import FIXTURES, FIXTURES_DIR

onnx = pytest.importorskip("onnx")
from onnx import helper, numpy_helper  # noqa: E402

from policy_export.exporter import manifest  # noqa: E402
from policy_export.exporter.parity.compare import Tolerance, Tolerances, compare, compare_arrays  # noqa: E402


def resign(export: Path) -> None:
    doc = manifest.read_manifest(export)
    doc["files"] = manifest.file_records(export)
    manifest.write_manifest(export, doc)


def records(report: dict, fmt: str) -> list[dict]:
    return [r for r in report["records"] if r["format"] == fmt]


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def rename_output(graph, name: str) -> str:
    """Make the node producing graph output ``name`` write ``name__raw`` instead; returns that name."""
    raw = f"{name}__raw"
    for node in graph.node:
        for i, out in enumerate(node.output):
            if out == name:
                node.output[i] = raw
        for i, inp in enumerate(node.input):
            if inp == name:
                node.input[i] = raw
    return raw


# ---------------------------------------------------------------------------- records


def test_records_fail_on_dtype_shape_and_non_finite_values():
    tol = Tolerance(1e-5, 1e-5)
    ref = np.array([0, 1, 1, 0], np.int64)
    assert compare_arrays("f", "actions_0", ref, ref.copy(), tol).passed
    wrong_dtype = compare_arrays("f", "actions_0", ref, ref.astype(np.int32), tol)
    assert not wrong_dtype.passed and "int32" in wrong_dtype.problem and "int64" in wrong_dtype.problem
    wrong_shape = compare_arrays("f", "actions_0", ref, ref[:, None], tol)
    assert not wrong_shape.passed and "shape" in wrong_shape.problem
    one_differs = ref.copy()
    one_differs[2] = 0
    record = compare_arrays("f", "actions_0", ref, one_differs, tol)
    assert not record.passed and record.mismatches == 1 and record.max_abs_err == 1.0
    # integer outputs are compared exactly whatever their values, even where float64 cannot tell them apart
    big = np.array([2**62, -(2**62)], np.int64)
    assert compare_arrays("f", "k", big, big.copy(), tol).passed
    off_by_one = compare_arrays("f", "k", big, big + 1, tol)
    assert not off_by_one.passed and off_by_one.mismatches == 2 and off_by_one.max_abs_err >= 1
    flags = np.array([True, False])
    assert not compare_arrays("f", "b", flags, ~flags, tol).passed

    x = np.linspace(0, 1, 200)
    y = x.copy()
    y[-1] += 4e-6
    y[-2] += 2e-6
    record = compare_arrays("f", "x", x, y, tol)
    assert record.passed
    assert record.max_abs_err == pytest.approx(4e-6, rel=1e-6)
    assert record.mean_abs_err == pytest.approx(6e-6 / 200, rel=1e-2)
    assert record.p99_abs_err == pytest.approx(2e-6, rel=1e-2)
    with_nan = x.copy()
    with_nan[3] = np.nan
    assert not compare_arrays("f", "x", x, with_nan, tol).passed
    nan_both = compare_arrays("f", "x", with_nan, with_nan.copy(), tol)
    assert not nan_both.passed and "NaN" in nan_both.problem and nan_both.non_finite == 2
    assert compare_arrays("f", "x", with_nan, with_nan.copy(), tol, allow_non_finite=True).passed
    assert not compare_arrays("f", "x", with_nan, x, tol, allow_non_finite=True).passed  # only one side is NaN

    tolerances = Tolerances(allow_non_finite=frozenset({"x"}))
    assert Tolerances.from_json(tolerances.to_json()) == tolerances
    assert compare("f", {"x": with_nan}, {"x": with_nan.copy()}, tolerances)[0].passed
    assert not compare("f", {"y": with_nan}, {"y": with_nan.copy()}, tolerances)[0].passed


def test_a_record_checks_the_contract_dtype_too():
    from policy_export.signatures.contract import Contract, TensorSpec

    contract = Contract(inputs=(), outputs=(TensorSpec("actions_0", "int64", (None,)),))
    ref = np.array([1, 0], np.int32)  # a reference (golden file) that itself left the contract
    [record] = compare("f", {"actions_0": ref}, {"actions_0": ref.copy()}, Tolerances(), contract=contract)
    assert not record.passed and "the contract says int64" in record.problem


# ---------------------------------------------------------------------------- one differing action, each path


def test_one_differing_action_fails_the_golden_comparison(exports, tmp_path):
    export = copy_of(exports, "cartpole_mlp", tmp_path)
    golden = manifest.load_npz(export / "parity" / "outputs.npz")
    golden["actions_0"][17] = 1 - golden["actions_0"][17]
    manifest.save_npz(export / "parity" / "outputs.npz", golden)
    resign(export)
    code, report = verify_cli(str(export), tmp_path=tmp_path)
    assert code == 1
    for fmt in ("saved_model", "frozen_graph", "onnx", "onnx_deterministic"):
        [action] = [r for r in records(report, fmt) if r["key"] == "actions_0"]
        assert not action["passed"] and action["mismatches"] == 1, action
        assert all(r["passed"] for r in records(report, fmt) if r["key"] != "actions_0")


def test_one_differing_action_fails_the_fresh_samples(exports, tmp_path):
    """model.onnx flips its action for exactly one of the fresh observations verify draws."""
    from policy_export.exporter.parity.replay import fresh_feeds
    from policy_export.signatures.contract import Contract

    export = copy_of(exports, "cartpole_mlp", tmp_path)
    doc = manifest.read_manifest(export)
    feeds = fresh_feeds(doc, Contract.from_json(doc["contract"]), 300, 5, "test")
    target = feeds["observations"][123, 0]
    model = onnx.load(str(export / "model.onnx"))
    graph = model.graph
    raw = rename_output(graph, "actions_0")
    graph.initializer.extend([numpy_helper.from_array(np.array(0, np.int64), "t_col"),
                              numpy_helper.from_array(np.array([target], np.float32), "t_value"),
                              numpy_helper.from_array(np.array(1, np.int64), "t_one")])
    graph.node.extend([
        helper.make_node("Gather", ["observations", "t_col"], ["t_x"], axis=1),
        helper.make_node("Equal", ["t_x", "t_value"], ["t_hit"]),
        helper.make_node("Sub", ["t_one", raw], ["t_flipped"]),
        helper.make_node("Where", ["t_hit", "t_flipped", raw], ["actions_0"]),
    ])
    onnx.save(model, str(export / "model.onnx"))
    resign(export)
    code, report = verify_cli(str(export), "--samples", "300", "--seed", "5", tmp_path=tmp_path)
    assert code == 1
    assert all(r["passed"] for r in records(report, "onnx"))  # golden inputs never hit that value
    [fresh] = [r for r in records(report, "onnx vs saved_model") if r["key"] == "actions_0"]
    assert not fresh["passed"] and fresh["mismatches"] == 1
    assert all(r["passed"] for r in records(report, "frozen_graph vs saved_model"))


def test_one_differing_action_fails_the_stepped_comparison(exports, tmp_path):
    export = copy_of(exports, "cartpole_lstm", tmp_path)
    stepped = manifest.load_npz(export / "parity" / "stepped.npz")
    stepped["serving/actions_0"][150, 2] = 1 - stepped["serving/actions_0"][150, 2]
    manifest.save_npz(export / "parity" / "stepped.npz", stepped, compressed=True)
    resign(export)
    code, report = verify_cli(str(export), tmp_path=tmp_path)
    assert code == 1
    for fmt in ("saved_model", "frozen_graph", "onnx", "onnx_deterministic"):
        assert all(r["passed"] for r in records(report, fmt))
        [action] = [r for r in records(report, f"{fmt} (stepped 200)") if r["key"] == "actions_0"]
        assert not action["passed"] and action["mismatches"] == 1 and action["worst_step"] == 150


# ---------------------------------------------------------------------------- done-when tampering


def shift_sampled_logits(path: Path, shift: list[float]) -> None:
    """Add ``shift`` to the logits the explore branch samples from (the Multinomial's input)."""
    model = onnx.load(str(path))
    found = 0
    for node in model.graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else []:
                for inner in list(sub.node):
                    if inner.op_type != "Multinomial":
                        continue
                    logits = inner.input[0]
                    sub.node.insert(0, helper.make_node("Constant", [], ["shift_c"], value=numpy_helper.from_array(
                        np.array(shift, np.float32), "shift_v")))
                    sub.node.insert(1, helper.make_node("Add", [logits, "shift_c"], ["shifted_logits"]))
                    inner.input[0] = "shifted_logits"
                    found += 1
    assert found == 1, "expected one Multinomial in the explore branch"
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def test_verify_fails_an_onnx_model_whose_sampled_actions_were_shifted(exports, tmp_path):
    export = copy_of(exports, "cartpole_mlp", tmp_path)
    shift_sampled_logits(export / "model.onnx", [0.0, 0.4])
    resign(export)
    code, report = verify_cli(str(export), tmp_path=tmp_path)
    assert code == 1
    golden = records(report, "onnx")
    assert golden and all(r["passed"] for r in golden)  # deterministic outputs untouched
    explore = [c for c in report["exploration"] if c["format"] == "onnx"]
    assert explore and not all(c["passed"] for c in explore)
    assert all(c["passed"] for c in report["exploration"] if c["format"] != "onnx")
    assert report["file_problems"] == []


def shift_gaussian_noise(path: Path, shift: float) -> None:
    """Add ``shift`` to the standard normal noise the explore branch draws (RandomNormalLike's output)."""
    model = onnx.load(str(path))
    found = 0
    for node in model.graph.node:
        for sub in [a.g for a in node.attribute if a.HasField("g")]:
            for index, inner in enumerate(list(sub.node)):
                if inner.op_type != "RandomNormalLike":
                    continue
                noise = inner.output[0]
                inner.output[0] = "noise_raw"
                sub.node.insert(index + 1, helper.make_node("Add", ["noise_raw", "noise_shift"], [noise]))
                sub.node.insert(index + 1, helper.make_node("Constant", [], ["noise_shift"], value=numpy_helper.from_array(
                    np.array(shift, np.float32), "noise_shift_v")))
                found += 1
    assert found == 1, "expected one RandomNormalLike in the explore branch"
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def test_verify_fails_an_onnx_model_whose_gaussian_noise_was_shifted(exports, tmp_path):
    export = copy_of(exports, "pendulum_mlp", tmp_path)
    shift_gaussian_noise(export / "model.onnx", 0.5)  # half a standard deviation
    resign(export)
    code, report = verify_cli(str(export), tmp_path=tmp_path)
    assert code == 1
    assert all(r["passed"] for r in records(report, "onnx"))  # deterministic outputs untouched
    explore = [c for c in report["exploration"] if c["format"] == "onnx"]
    assert explore and not all(c["passed"] for c in explore)
    assert all(c["test"] == "two-sample Kolmogorov-Smirnov" for c in explore)
    assert all(c["passed"] for c in report["exploration"] if c["format"] != "onnx")


def test_verify_fails_a_deterministic_model_returning_int32_actions(exports, tmp_path):
    export = copy_of(exports, "cartpole_mlp", tmp_path)
    path = export / "model_deterministic.onnx"
    model = onnx.load(str(path))
    raw = rename_output(model.graph, "actions_0")
    model.graph.node.append(helper.make_node("Cast", [raw], ["actions_0"], to=onnx.TensorProto.INT32))
    model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.INT32
    onnx.save(model, str(path))
    resign(export)
    code, report = verify_cli(str(export), "--samples", "50", tmp_path=tmp_path)
    assert code == 1
    [golden] = records(report, "onnx_deterministic")
    assert not golden["passed"] and "dtype int32" in golden["problem"]
    [fresh] = records(report, "onnx_deterministic vs saved_model")
    assert not fresh["passed"] and "int32" in fresh["problem"]
    assert all(r["passed"] for r in records(report, "onnx"))


def test_verify_fails_a_recurrent_model_whose_state_drifts_over_many_steps(exports, tmp_path):
    """The state is scaled by 1 + 9e-6: within tolerance for one step (so the golden comparison
    passes), but the error compounds through the recurrence until it leaves the tolerance.
    (A factor of 1 + 1e-4 is already caught by the golden outputs of one step.)"""
    export = copy_of(exports, "cartpole_lstm", tmp_path)
    model = onnx.load(str(export / "model.onnx"))
    model.graph.initializer.append(numpy_helper.from_array(np.array(1 + 9e-6, np.float32), "drift_k"))
    for key in ("state_out_0", "state_out_1"):
        raw = rename_output(model.graph, key)
        model.graph.node.append(helper.make_node("Mul", [raw, "drift_k"], [key]))
    onnx.save(model, str(export / "model.onnx"))
    resign(export)
    code, report = verify_cli(str(export), tmp_path=tmp_path)
    assert code == 1
    golden = records(report, "onnx")
    assert golden and all(r["passed"] for r in golden)
    stepped = [r for r in records(report, "onnx (stepped 200)") if r["key"].startswith("state_out_")]
    assert stepped and not any(r["passed"] for r in stepped)
    assert all(r["worst_step"] > 20 for r in stepped)  # the error grows with the steps
    others = [r for r in report["records"] if not r["format"].startswith("onnx ")]
    assert all(r["passed"] for r in others if r["format"] != "onnx")


# ---------------------------------------------------------------------------- clean exports


@pytest.mark.parametrize("name", FIXTURES)
def test_verify_passes_every_clean_export_replaying_its_plan(exports, name, tmp_path):
    from policy_export.exporter.api import verify_export

    _, out = exports(name)
    result = verify_export(out, device="cpu", samples=64)
    assert result.passed, [r.describe() for r in result.parity.failures()] + list(result.parity.errors.items())
    doc = manifest.read_manifest(out)
    plan = doc["parity"]["plan"]
    assert plan["exploration"] == "parity/exploration.npz"  # every fixture policy can explore
    assert result.parity.exploration
    recurrent = name == "cartpole_lstm"
    assert (plan["stepped"] == "parity/stepped.npz") is recurrent
    assert any("(stepped 200)" in r.format for r in result.parity.records) is recurrent
    assert any(" vs saved_model" in r.format for r in result.parity.records)


def test_verify_passes_a_converted_rllib_export(tmp_path):
    from policy_export.exporter.api import verify_export
    from policy_export.exporter.cli import main

    out = tmp_path / "converted"
    assert main(["convert", str(FIXTURES_DIR / "rllib" / "legacy" / "cartpole_ff" / "saved_model"),
                 "--out", str(out), "--device", "cpu", "--samples", "200"]) == 0
    result = verify_export(out, device="cpu", samples=50)
    assert result.passed, [r.describe() for r in result.parity.failures()]
    assert result.parity.exploration and all(c.passed for c in result.parity.exploration)


def test_an_export_without_a_stored_plan_verifies_with_the_golden_part(exports, tmp_path):
    export = copy_of(exports, "cartpole_lstm", tmp_path)
    (export / "parity" / "exploration.npz").unlink()
    (export / "parity" / "stepped.npz").unlink()
    doc = manifest.read_manifest(export)
    del doc["parity"]["plan"]
    manifest.write_manifest(export, doc)
    resign(export)
    from policy_export.exporter.api import verify_export

    result = verify_export(export, device="cpu")
    assert result.passed
    assert "exploration: none in the plan" in result.notes and "stepped: none in the plan" in result.notes
    assert not result.parity.exploration and not any("stepped" in r.format for r in result.parity.records)


def test_a_plan_file_the_manifest_names_must_be_there(exports, tmp_path):
    export = copy_of(exports, "cartpole_mlp", tmp_path)
    (export / "parity" / "exploration.npz").unlink()
    resign(export)  # the file list no longer has it, but the plan still names it
    code, report = verify_cli(str(export), tmp_path=tmp_path)
    assert code == 1 and "parity/exploration.npz" in report["errors"]["parity"]


# ---------------------------------------------------------------------------- candidates


def test_candidates_are_checked_against_the_stored_plan_without_touching_the_export(exports, tmp_path):
    import onnxruntime as ort

    _, export = exports("cartpole_mlp")
    before = tree_digest(export)
    resaved = tmp_path / "model.resaved.onnx"
    onnx.save(onnx.load(str(export / "model.onnx")), str(resaved))
    optimised = tmp_path / "model.opt.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(optimised)
    ort.InferenceSession(str(export / "model.onnx"), options, providers=["CPUExecutionProvider"])
    shifted = tmp_path / "model.shifted.onnx"
    shutil.copy(export / "model.onnx", shifted)
    shift_sampled_logits(shifted, [0.0, 0.4])

    code, report = verify_cli(str(export), "--candidate", f"onnx={resaved}", "--candidate",
                              f"onnx_deterministic={export / 'model_deterministic.onnx'}", tmp_path=tmp_path)
    assert code == 0, report
    assert {r["format"] for r in report["records"]} >= {"onnx candidate", "onnx candidate (explore)",
                                                          "onnx_deterministic candidate"}
    assert not records(report, "saved_model")  # the export's own formats are not run
    code, report = verify_cli(str(export), "--candidate", f"onnx={optimised}", "--samples", "50", tmp_path=tmp_path)
    assert code == 0, report
    assert records(report, "onnx candidate vs saved_model")
    code, report = verify_cli(str(export), "--candidate", f"onnx={shifted}", tmp_path=tmp_path)
    assert code == 1
    assert all(r["passed"] for r in records(report, "onnx candidate"))
    assert not all(c["passed"] for c in report["exploration"] if c["format"] == "onnx candidate")
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    code, report = verify_cli(str(export), "--candidate", f"onnx={broken}", tmp_path=tmp_path)
    assert code == 1 and "not a valid ONNX model" in report["errors"]["onnx candidate"]
    assert tree_digest(export) == before


def test_a_saved_model_candidate_goes_through_the_op_checks(exports, tmp_path):
    _, export = exports("cartpole_mlp")
    candidate = tmp_path / "sm"
    shutil.copytree(export / "saved_model", candidate)
    code, report = verify_cli(str(export), "--candidate", f"saved_model={candidate}", tmp_path=tmp_path)
    assert code == 0 and records(report, "saved_model candidate")
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((candidate / "saved_model.pb").read_bytes())
    node = proto.meta_graphs[0].graph_def.node.add()
    node.name, node.op = "leak", "WriteFile"
    (candidate / "saved_model.pb").write_bytes(proto.SerializeToString())
    code, report = verify_cli(str(export), "--candidate", f"saved_model={candidate}", tmp_path=tmp_path)
    assert code == 1 and "WriteFile" in report["errors"]["saved_model candidate"]


@pytest.mark.parametrize("flag, fragment", [
    ("onnx", "expected FORMAT=PATH"),
    ("coreml=x.mlmodel", "cannot be a candidate"),
    ("keras=x", "cannot be a candidate"),
    ("onnx=/no/such/model.onnx", "no such file"),
    ("saved_model=/tmp", "not a SavedModel directory"),
])
def test_a_bad_candidate_flag_is_exit_2(exports, tmp_path, capsys, flag, fragment):
    _, export = exports("cartpole_mlp")
    code, _ = verify_cli(str(export), "--candidate", flag, tmp_path=tmp_path)
    assert code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_outputs_allowed_to_be_non_finite_are_recorded_and_checked(tmp_path, capsys):
    from policy_export.exporter import export_spec
    from policy_export.exporter.api import verify_export
    from policy_export.errors import InputError

    allowed = Tolerances(allow_non_finite=frozenset({"action_logp"}))
    with pytest.raises(InputError, match="unknown output"):
        export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "bad", device="cpu", formats=["onnx"],
                    tolerances=Tolerances(allow_non_finite=frozenset({"no_such_output"})))
    out = tmp_path / "e"
    export_spec(FIXTURES_DIR / "cartpole_mlp", out, device="cpu", formats=["saved_model", "onnx"], samples=100,
                explore_samples=400, tolerances=allowed)
    assert manifest.read_manifest(out)["tolerances"]["allow_non_finite"] == ["action_logp"]
    assert verify_export(out, device="cpu").passed
    code, _ = verify_cli(str(out), "--allow-non-finite", "nope", tmp_path=tmp_path)
    assert code == 2 and "unknown output(s) ['nope']" in capsys.readouterr().err
