"""A policy exported elsewhere made an export: ``export MODEL.onnx --reference REF.npz --out OUT``
on the real files of ``fixtures/foreign/`` (rsl_rl's exporter, SB3's recipe, ``torch.onnx`` with
TorchScript and dynamo), every format written from the ONNX alone proven against the framework's
recording, the recording stored so that ``verify OUT`` replays it, and ``sign``,
``verify --public-key``, ``verify-many`` and ``diff`` taking the result; the formats that need the
TF graph, bad options, contract files and hostile models refused before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import ROOT
from helpers import bypass_normaliser, cli, one_line_error, resign

FOREIGN = ROOT / "fixtures/foreign"
CASES = sorted(p.name for p in FOREIGN.iterdir() if (p / "case.json").is_file())
WRITTEN = ["onnx", "onnx_int8", "onnx_fp16", "openvino", "triton"]


def _model(case: str) -> Path:
    return next((FOREIGN / case).glob("*.onnx"))


def _reference(case: str) -> Path:
    return FOREIGN / case / "reference.npz"


# int8 changes a few argmax actions of torch_mlp_static (CartPole logits near a tie): measured 98.3%
LENIENT = {"onnx_int8": {"min_agreement": 0.95}}


def _export(case: str, out: Path, formats=WRITTEN, **keywords):
    from policy_export import export_model

    if "onnx_int8" in formats:
        keywords.setdefault("behaviour", LENIENT)
    return export_model(_model(case), out, reference=_reference(case), formats=list(formats), device="cpu",
                        **keywords)


@pytest.mark.parametrize("case", CASES)
def test_every_fixture_exports_and_verifies_from_its_recording(tmp_path, case):
    from policy_export import verify_export

    out = tmp_path / case
    result = _export(case, out)
    assert result.parity.passed and not result.missing
    assert set(result.formats) == set(WRITTEN)
    doc = json.loads((out / "manifest.json").read_text())
    source = doc["source"]
    assert source["kind"] == "onnx_model" and source["file"] == _model(case).name
    assert source["sha256"] == hashlib.sha256(_model(case).read_bytes()).hexdigest()
    assert source["producer"].startswith("pytorch")
    assert source["reference"]["sha256"] == hashlib.sha256(_reference(case).read_bytes()).hexdigest()
    assert doc["parity"]["plan"] == {"golden": None, "exploration": None, "stepped": None, "recorded": None,
                                     "reference": "parity/reference.npz"}
    assert "spaces" not in doc and not (out / "parity/inputs.npz").exists()
    graph = onnx.load(str(_model(case)), load_external_data=False).graph
    assert [s["key"] for s in doc["contract"]["inputs"]] == [i.name for i in graph.input]
    assert [s["key"] for s in doc["contract"]["outputs"]] == [o.name for o in graph.output]
    # every recorded output of every float format within the default tolerance, on every row
    with np.load(_reference(case)) as rec:
        recorded = [k for k in rec.files if k in {o.name for o in graph.output}]
    exact = [r for r in result.parity.records if r.format.split(" ")[0] in ("onnx", "openvino")]
    assert {r.key for r in exact} == set(recorded)
    assert all(r.passed for r in exact), [(r.format, r.key, r.max_abs_err) for r in exact]
    assert {c.format.split(" ")[0] for c in result.parity.behaviour} == {"onnx_int8", "onnx_fp16"}
    again = verify_export(out, device="cpu")
    assert again.passed, again.parity.failures()
    assert {r.key for r in again.parity.records} == set(recorded)
    assert max(r.max_abs_err for r in again.parity.records) == pytest.approx(max(r.max_abs_err for r in exact))


def test_the_command_line_exports_verifies_and_checks_a_league(tmp_path):
    """What a deployment pipeline runs on policies rsl_rl and SB3's recipe exported: export with
    triton, openvino and int8, verify, verify-many over the exports, diff two of them."""
    league = tmp_path / "league"
    for case in ("rsl_rl_lstm", "sb3_ppo_recipe"):
        done = cli("export", str(_model(case)), "--reference", str(_reference(case)), "--out", str(league / case),
                   "--formats", "triton,openvino,onnx_int8,onnx", "--device", "cpu", "-q")
        assert done.returncode == 0, done.stdout + done.stderr
        printed = " ".join(done.stdout.split())
        assert "300 recorded rows vs the recording reference.npz" in printed
        assert f"exported {league / case}: onnx, onnx_int8, openvino, triton" in printed
    out = league / "rsl_rl_lstm"
    done = cli("verify", str(out), "--device", "cpu", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    printed = " ".join(done.stdout.split())
    assert "the stored recording (300 rows" in printed and "onnx (episodes)" in printed
    assert "state h_in <- h_out, c_in <- c_out fed back from zeros" in printed
    many = cli("verify-many", str(league), "-q")
    assert many.returncode == 0, many.stdout + many.stderr
    assert "2 policies: 2 passed" in " ".join(many.stdout.split())
    diff = cli("diff", str(league / "rsl_rl_lstm"), str(league / "sb3_ppo_recipe"))
    assert diff.returncode == 1 and "breaking input obs: was removed" in diff.stdout


def test_an_export_of_a_model_file_is_signed_and_its_signature_checked(tmp_path):
    pytest.importorskip("model_signing", reason="the signing extra is not installed")
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "k.pem").write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                                       ser.NoEncryption()))
    (tmp_path / "k.pub").write_bytes(key.public_key().public_bytes(ser.Encoding.PEM,
                                                                   ser.PublicFormat.SubjectPublicKeyInfo))
    out = tmp_path / "out"
    done = cli("export", str(_model("rsl_rl_mlp")), "--reference", str(_reference("rsl_rl_mlp")), "--out", str(out),
               "--sign-key", str(tmp_path / "k.pem"), "-q")
    assert done.returncode == 0 and (tmp_path / "out.sig").is_file(), done.stdout + done.stderr
    checked = cli("verify", str(out), "--public-key", str(tmp_path / "k.pub"), "--device", "cpu", "-q")
    assert checked.returncode == 0 and "signed by public key" in checked.stdout, checked.stdout + checked.stderr
    (tmp_path / "out.sig").unlink()
    signed = cli("sign", str(out), "--sign-key", str(tmp_path / "k.pem"))
    assert signed.returncode == 0, signed.stdout + signed.stderr
    (out / "parity/reference.npz").write_bytes(b"changed")
    refused = cli("verify", str(out), "--public-key", str(tmp_path / "k.pub"), "--device", "cpu", "-q")
    assert refused.returncode == 1


def test_exporting_and_verifying_load_no_tensorflow(tmp_path):
    out = tmp_path / "out"
    code = ("import sys\n"
            "from policy_export.exporter.cli import main\n"
            f"rc = main(['export', {str(_model('rsl_rl_mlp'))!r}, '--reference', {str(_reference('rsl_rl_mlp'))!r}, "
            f"'--out', {str(out)!r}, '--formats', 'onnx,onnx_int8', '-q'])\n"
            f"rc = rc or main(['verify', {str(out)!r}, '-q'])\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
            "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_formats_that_need_the_tf_graph_are_refused_by_name(tmp_path):
    model, reference = _model("torch_mlp_static"), _reference("torch_mlp_static")
    for name in ("saved_model", "tflite", "onnx_deterministic", "frozen_graph"):
        one_line_error(cli("export", str(model), "--reference", str(reference), "--out", str(tmp_path / "o"),
                           "--formats", f"onnx,{name}"), 2,
                       f"format {name!r} is made from the TensorFlow graph, which a model exported elsewhere does not have")
    assert not (tmp_path / "o").exists()


def test_options_that_do_not_apply_are_refused(tmp_path):
    model, reference, out = _model("torch_mlp_static"), _reference("torch_mlp_static"), str(tmp_path / "o")
    one_line_error(cli("export", str(model), "--out", out), 2, "--reference REF.npz")
    one_line_error(cli("export", str(model), "--reference", str(reference), "--out", out, "--samples", "50"), 2,
                   "--samples applies to a policy exported from its TF graph")
    one_line_error(cli("export", str(model), "--reference", str(reference), "--out", out, "--policy-id", "x"), 2,
                   "--policy-id applies to a source this package reads")
    one_line_error(cli("export", str(ROOT / "fixtures/cartpole_mlp"), "--out", out, "--reference", str(reference)),
                   2, "--reference applies to a model file exported elsewhere")
    one_line_error(cli("export", str(model), "--reference", str(reference), "--out", out, "--tolerance",
                       "nope=1e-3"), 2, "tolerance given for unknown output(s) ['nope']")
    from policy_export import InputError, export_source

    with pytest.raises(InputError, match="export MODEL.onnx --reference REF.npz"):
        export_source(model, tmp_path / "api")
    assert not any(tmp_path.iterdir())


def test_a_recording_that_does_not_fit_is_refused_and_nothing_is_written(tmp_path):
    with np.load(_reference("torch_mlp_static")) as data:
        good = {k: data[k] for k in data.files}
    bad = tmp_path / "bad.npz"
    np.savez(bad, **{**good, "obs": np.zeros((len(good["obs"]), 5), np.float32)})
    one_line_error(cli("export", str(_model("torch_mlp_static")), "--reference", str(bad), "--out",
                       str(tmp_path / "o")), 2, "obs's rows are [5]; the graph's obs is [1, 4]")
    assert not (tmp_path / "o").exists()


def test_a_model_that_differs_from_its_recording_is_not_exported(tmp_path):
    broken = tmp_path / "policy.onnx"
    onnx.save(bypass_normaliser(onnx.load(str(_model("rsl_rl_mlp")))), str(broken))
    report = tmp_path / "report.json"
    done = cli("export", str(broken), "--reference", str(_reference("rsl_rl_mlp")), "--out", str(tmp_path / "o"),
               "--report-json", str(report), "-q")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "parity failed, nothing was written" in done.stderr and "actions" in done.stderr
    assert not (tmp_path / "o").exists()
    doc = json.loads(report.read_text())
    assert not doc["passed"] and any(r.get("first_divergence", "").startswith("row ") for r in doc["records"])


def test_verify_replays_the_stored_recording_and_catches_a_swapped_model(tmp_path):
    """An attacker replaces model.onnx and rewrites the manifest's hashes: the stored recording
    still says what the policy computes, and the swapped model fails on it."""
    from policy_export import verify_export

    out = tmp_path / "out"
    _export("rsl_rl_mlp", out, formats=["onnx"])
    onnx.save(bypass_normaliser(onnx.load(str(out / "model.onnx"))), str(out / "model.onnx"))
    result = verify_export(out, device="cpu")
    assert not result.passed and result.file_problems  # the hash check first
    resign(out)
    result = verify_export(out, device="cpu")
    assert not result.file_problems and not result.passed
    (failed,) = result.parity.failures()
    assert failed.key == "actions" and failed.first_divergence.startswith("row ")
    (out / "parity/reference.npz").write_bytes(b"not a recording")
    result = verify_export(out, device="cpu")
    assert not result.passed and "parity" in result.parity.errors


def test_a_hostile_model_is_refused_before_onnx_runtime_opens_it(tmp_path):
    model = onnx.load(str(_model("torch_mlp_static")))
    weight = model.graph.initializer[0]
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.zeros(weight.ByteSize(), np.uint8).tobytes())
    folder = tmp_path / "m"
    folder.mkdir()
    os.symlink(outside, folder / "weights.bin")
    weight.ClearField("raw_data")
    del weight.float_data[:]
    weight.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(4 * int(np.prod(weight.dims))))):
        weight.external_data.add(key=key, value=value)
    onnx.save(model, str(folder / "policy.onnx"))
    done = cli("export", str(folder / "policy.onnx"), "--reference", str(_reference("torch_mlp_static")), "--out",
               str(tmp_path / "o"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "weights.bin" in done.stderr and "link" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "o").exists()


def test_a_contract_file_gives_the_spaces_lossy_formats_are_judged_by(tmp_path):
    contract = tmp_path / "contract.json"
    contract.write_text(json.dumps({
        "spaces": {"obs": {"type": "Box", "low": -5.0, "high": 5.0, "shape": [4], "dtype": "float32"},
                   "actions": {"type": "Discrete", "n": 2}},
        "actions": ["actions"]}))
    out = tmp_path / "out"
    result = _export("torch_mlp_static", out, formats=["onnx", "onnx_int8"], contract_file=contract)
    assert result.parity.passed
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["contract"]["spaces"]["actions"]["type"] == "Discrete" and doc["contract"]["actions"] == ["actions"]
    judged = {c.key: c for c in result.parity.behaviour if c.metric != "error"}
    assert set(judged) == {"actions"} and judged["actions"].metric == "agreement"
    assert judged["actions"].value >= 0.95 and "identical to the recording's" in judged["actions"].describe()
    # without a contract file every recorded output is judged: the logits on the range they span
    plain = _export("torch_mlp_static", tmp_path / "plain", formats=["onnx", "onnx_int8"])
    metrics = {c.key: c.metric for c in plain.parity.behaviour}
    assert metrics == {"logits": "box_error", "actions": "agreement"}


@pytest.mark.parametrize("content,fragment", [
    ({"spaces": {"obs": {"type": "Box", "low": -1.0, "high": 1.0, "shape": [5], "dtype": "float32"}}},
     "spaces.obs has shape [5]; the graph's obs has rows of [4]"),
    ({"spaces": {"nope": {"type": "Discrete", "n": 2}}}, "spaces names 'nope', which is not an input or output"),
    ({"spaces": {"actions": {"type": "Box", "low": 0.0, "high": 1.0, "shape": [], "dtype": "float32"}}},
     None),
    ({"actions": ["obs"]}, "actions names 'obs', which is not an output of the graph"),
    ({"outputs": {}}, "unknown key(s) outputs"),
    ([1, 2], "expected a JSON object"),
])
def test_a_contract_file_that_does_not_fit_the_graph_is_refused(tmp_path, content, fragment):
    contract = tmp_path / "c.json"
    contract.write_text(json.dumps(content))
    done = cli("export", str(_model("torch_mlp_static")), "--reference", str(_reference("torch_mlp_static")),
               "--out", str(tmp_path / "o"), "--contract", str(contract), "--formats", "onnx", "-q")
    if fragment is None:  # a Box for an integer output: allowed (an integer Box)
        assert done.returncode == 0, done.stderr
        return
    one_line_error(done, 2, fragment)
    assert not (tmp_path / "o").exists()


def test_a_recurrent_export_with_named_state_pairs_is_replayed_with_them(tmp_path):
    from policy_export import verify_export

    out = tmp_path / "out"
    result = _export("torch_lstm_script", out, formats=["onnx"],
                     reference_state_pairs={"h_in": "h_out", "c_in": "c_out"})
    assert result.parity.passed
    with np.load(out / "parity/reference.npz") as stored:
        assert [str(x) for x in stored["state_pairs/0"]] == ["h_in", "h_out"]
        assert stored["episode_ids"].shape == (248,)
    shutil.copy(_model("torch_lstm_script"), tmp_path / "copy.onnx")
    assert verify_export(out, device="cpu").passed


def test_a_dynamic_batch_model_is_batched_on_triton_and_replayed_at_every_batch(tmp_path):
    """torch_mlp_static with its batch opened (what ``dynamic_axes`` writes): Triton's repository
    batches it, and the recording is replayed at batches 1, 3 and 64 on every format."""
    model = onnx.load(str(_model("torch_mlp_static")))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save(model, str(folder / "policy.onnx"))
    from policy_export import export_model, verify_export

    out = tmp_path / "out"
    result = export_model(folder / "policy.onnx", out, reference=_reference("torch_mlp_static"),
                          formats=["onnx", "triton"], device="cpu")
    assert result.parity.passed
    config = (out / "triton/policy/config.pbtxt").read_text()
    assert "max_batch_size: 0" not in config and "max_batch_size:" in config
    labels = {r.format for r in result.parity.records}
    assert {"onnx (batch 1)", "onnx (batch 3)", "onnx (batch 64)", "triton (batch 64)"} <= labels
    assert verify_export(out, device="cpu").passed


@pytest.mark.serve
def test_the_triton_repository_serves_the_recording_on_a_real_server(tmp_path, case="rsl_rl_lstm"):
    """``verify OUT --server triton``: the repository written from the ONNX loaded by tritonserver
    as written, the recording replayed through Triton's HTTP and gRPC clients (a recurrent policy
    one sequence a request, the server keeping its state)."""
    pytest.importorskip("pytriton", reason="PyTriton is not installed (the serve extra: pip install '.[serve]')")
    from policy_export import verify_export

    out = tmp_path / "out"
    _export(case, out, formats=["onnx", "triton"])
    result = verify_export(out, device="cpu", server="triton")
    assert result.passed, (result.parity.errors, result.parity.failures())
    served = {r.format for r in result.parity.records if r.format.startswith("triton-server/")}
    assert served == {"triton-server/http (episodes)", "triton-server/grpc (episodes)"}
    assert all(r.max_abs_err < 1e-5 for r in result.parity.records if r.format in served)
