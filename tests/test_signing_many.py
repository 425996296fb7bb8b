"""Signed exports over many policies (the signing extra): export-many --sign-key signs each export
beside it (ROOT/<name>.sig), verify-many --public-key checks each signature per policy; an
encrypted key's password from an environment variable or a terminal, never from the command
line; reports naming who signed and with what; JUnit test cases with measured times."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("model_signing")

from cryptography.hazmat.primitives import serialization  # noqa: E402  (model-signing brings it)
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from conftest import ROOT  # noqa: E402
from helpers import cli  # noqa: E402

SPEC = ROOT / "fixtures" / "cartpole_mlp"
MODEL_SIGNING = Path(sys.executable).parent / "model_signing"
FAST = ("--formats", "onnx", "--samples", "50", "--explore-samples", "0", "--jobs", "2", "-q")
PASSWORD = "correct horse battery staple"  # the encrypted key's: never printed, never in a report
ENV = "POLICY_SIGNING_PASSWORD"


def _keys(folder: Path, name: str, password: str | None = None) -> tuple[Path, Path]:
    """A fresh P-256 key pair as PEM files (the private one encrypted with ``password``): (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    crypt = serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    private, public = folder / f"{name}.pem", folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, crypt))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``policy-export ARGS`` in a process of its own, stdin not a terminal (nothing can be asked)."""
    base = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GITHUB_STEP_SUMMARY", ENV)}
    return subprocess.run([sys.executable, "-m", "policy_export", *args], capture_output=True, text=True,
                          timeout=600, env={**base, **(env or {})}, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """Two policies exported by export-many and signed with an encrypted key (its password from
    the environment), with the JSON, JUnit and step-summary reports; keys "enc" and "other"."""
    tmp = tmp_path_factory.mktemp("signing-many")
    keys = {"enc": _keys(tmp, "enc", PASSWORD), "other": _keys(tmp, "other")}
    sources = []
    for name in ("p0", "p1"):
        shutil.copytree(SPEC, tmp / "sources" / name)
        sources.append(str(tmp / "sources" / name))
    done = _run("export-many", *sources, "--out", str(tmp / "root"), *FAST, "--sign-key", str(keys["enc"][0]),
                "--sign-key-password-env", ENV, "--report-json", str(tmp / "export.json"),
                "--junit", str(tmp / "export.xml"),
                env={ENV: PASSWORD, "GITHUB_STEP_SUMMARY": str(tmp / "summary.md")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    return tmp, keys


def _hint(public: Path) -> str:
    """model-signing's key hint: the sha256 of the public key's PEM (what `sha256sum key.pub` prints)."""
    return hashlib.sha256(public.read_bytes()).hexdigest()


def test_export_many_signs_each_export_and_model_signing_verifies_each(many):
    tmp, keys = many
    root = tmp / "root"
    assert sorted(p.name for p in root.iterdir() if p.suffix == ".sig") == ["p0.sig", "p1.sig"]
    for name in ("p0", "p1"):
        assert not list((root / name).glob("*.sig"))  # export-many signs beside each export
        done = subprocess.run([str(MODEL_SIGNING), "verify", "key", str(root / name), "--signature",
                               str(root / f"{name}.sig"), "--public_key", str(keys["enc"][1])],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp / "export.json").read_text())
    for policy in doc["policies"]:
        entry = policy["signature"]
        manifest = json.loads((root / policy["name"] / "manifest.json").read_text())
        assert entry["passed"] and entry["method"] == "key" and entry["key_sha256"] == _hint(keys["enc"][1])
        assert entry["path"] == str(root / f"{policy['name']}.sig") and entry["problems"] == []
        assert entry["files"] == len(manifest["files"]) + 1 and entry["seconds"] > 0  # + manifest.json
        assert entry["signer"] == f"public key sha256:{_hint(keys['enc'][1])}"
    text = json.dumps(doc) + "".join(p.read_text() for p in (root / ".policy-export-many").glob("*.json"))
    assert PASSWORD not in text and ENV not in text  # neither the password nor the key's way in reaches a job


def _cases(path: Path) -> dict[str, ET.Element]:
    return {s.get("name"): s for s in ET.parse(path).getroot().findall("testsuite")}


def test_junit_has_a_signature_case_per_policy_and_every_case_is_timed(many):
    tmp, keys = many
    tree = ET.parse(tmp / "export.xml").getroot()
    assert float(tree.get("time")) > 0
    suites = _cases(tmp / "export.xml")
    assert sorted(suites) == ["p0", "p1"]
    for suite in suites.values():
        cases = suite.findall("testcase")
        times = [float(c.get("time")) for c in cases]
        assert all(t > 0 for t in times), [(c.get("classname"), c.get("name"), c.get("time")) for c in cases]
        assert float(suite.get("time")) > 0 and int(suite.get("tests")) == len(cases)
        (sig,) = [c for c in cases if c.get("name") == "signature"]
        props = {p.get("name"): p.get("value") for p in sig.findall("properties/property")}
        assert props["signature.method"] == "key" and props["signature.key_sha256"] == _hint(keys["enc"][1])
        assert props["signature.path"].endswith(f"{suite.get('name')}.sig") and sig.find("failure") is None
        # the onnx cases share what loading and checking the model took: one measured figure
        onnx = {c.get("time") for c in cases if c.get("classname") == f"{suite.get('name')}.onnx"}
        assert len(onnx) == 1
    summary = (tmp / "summary.md").read_text()
    for name in ("p0", "p1"):
        assert f"- {name}: signed by key sha256:{_hint(keys['enc'][1])} (key; " in summary


def _copy_root(many, tmp_path: Path) -> Path:
    tmp, _ = many
    shutil.copytree(tmp / "root", tmp_path / "root", ignore=shutil.ignore_patterns(".policy-export-many"))
    return tmp_path / "root"


def test_verify_many_checks_each_signature_and_names_the_tampered_policy(many, tmp_path):
    _, keys = many
    root = _copy_root(many, tmp_path)
    data = bytearray((root / "p1" / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (root / "p1" / "model.onnx").write_bytes(bytes(data))
    report, junit, summary = tmp_path / "v.json", tmp_path / "v.xml", tmp_path / "v.md"
    done = _run("verify-many", str(root), "--public-key", str(keys["enc"][1]), "--jobs", "2", "-q",
                "--report-json", str(report), "--junit", str(junit), env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 of 2 policies failed: p1" in done.stdout
    doc = {p["name"]: p for p in json.loads(report.read_text())["policies"]}
    assert doc["p0"]["status"] == "passed" and doc["p0"]["signature"]["passed"]
    assert doc["p0"]["signature"]["key_sha256"] == _hint(keys["enc"][1])
    reason = ("signature p1.sig does not match the export: changed file model.onnx (its sha256 is not the "
              "signed one)")
    assert doc["p1"]["status"] == "failed" and doc["p1"]["signature"]["problems"] == [reason]
    assert reason in doc["p1"]["failures"]
    suites = _cases(junit)
    (bad,) = [c for c in suites["p1"].findall("testcase") if c.get("name") == "signature"]
    assert bad.find("failure").get("type") == "SignatureMismatch" and reason in bad.find("failure").get("message")
    (good,) = [c for c in suites["p0"].findall("testcase") if c.get("name") == "signature"]
    assert good.find("failure") is None and float(good.get("time")) > 0
    assert all(float(c.get("time")) > 0 for c in suites["p0"].findall("testcase"))
    text = summary.read_text()
    assert "- p1: signature FAILED: " + reason in text and f"- p0: signed by key sha256:{_hint(keys['enc'][1])}" in text


def test_verify_many_refuses_another_key_and_a_missing_signature_per_policy(many, tmp_path):
    _, keys = many
    root = _copy_root(many, tmp_path)
    (root / "p0.sig").unlink()
    report = tmp_path / "v.json"
    done = _run("verify-many", str(root), "--public-key", str(keys["other"][1]), "-q", "--report-json", str(report))
    assert done.returncode == 1, done.stdout + done.stderr
    doc = {p["name"]: p for p in json.loads(report.read_text())["policies"]}
    assert "no such file" in doc["p0"]["signature"]["problems"][0] and "p0.sig" in doc["p0"]["signature"]["problems"][0]
    assert "Key mismatch" in doc["p1"]["signature"]["problems"][0]
    assert doc["p0"]["status"] == doc["p1"]["status"] == "failed"
    done = _run("verify-many", str(root), "--public-key", str(tmp_path / "none.pub"), "-q")
    assert done.returncode == 2 and "--public-key" in done.stderr and "no such file" in done.stderr


def test_verify_many_refuses_a_linked_or_huge_signature_in_that_policy_alone(many, tmp_path):
    """Each policy's signature is read in its own process as ``verify`` reads it: never through a
    link, never more than a signature may hold (a sparse 8 GiB file is refused unread)."""
    _, keys = many
    root = _copy_root(many, tmp_path)
    (root / "p0.sig").rename(tmp_path / "real.sig")
    (root / "p0.sig").symlink_to(tmp_path / "real.sig")
    (root / "p1.sig").unlink()
    (root / "p1.sig").touch()
    os.truncate(root / "p1.sig", 8 << 30)
    report = tmp_path / "v.json"
    done = _run("verify-many", str(root), "--public-key", str(keys["enc"][1]), "-q", "--report-json", str(report))
    assert done.returncode == 1, done.stdout + done.stderr
    doc = {p["name"]: p for p in json.loads(report.read_text())["policies"]}
    assert doc["p0"]["signature"]["problems"] == [f"signature: signature {root / 'p0.sig'}: is a symbolic link, "
                                                  "which is never followed: give the file itself"]
    assert doc["p1"]["signature"]["problems"] == [f"signature: signature {root / 'p1.sig'}: is 8,589,934,592 "
                                                  "bytes, more than a signature may hold (16,777,216)"]
    assert doc["p0"]["status"] == doc["p1"]["status"] == "failed" and doc["p1"]["peak_rss_mb"] < 4000


def test_verify_many_takes_a_signature_inside_an_export_and_no_other_added_file(many, tmp_path):
    """``OUT/model.sig`` (where model_signing keeps a signature) is checked, and is the one file of
    the export the manifest need not list; any other added file still fails that policy."""
    _, keys = many
    root = _copy_root(many, tmp_path)
    (root / "p0.sig").rename(root / "p0" / "model.sig")
    (root / "p1.sig").rename(root / "p1" / "model.sig")
    (root / "p1" / "extra.txt").write_text("not signed")
    report = tmp_path / "v.json"
    done = _run("verify-many", str(root), "--public-key", str(keys["enc"][1]), "-q", "--report-json", str(report))
    assert done.returncode == 1, done.stdout + done.stderr
    doc = {p["name"]: p for p in json.loads(report.read_text())["policies"]}
    assert doc["p0"]["status"] == "passed" and doc["p0"]["signature"]["passed"], doc["p0"]
    assert doc["p1"]["status"] == "failed"
    assert any("extra file extra.txt" in f for f in doc["p1"]["failures"]), doc["p1"]["failures"]
    assert not any("extra file model.sig" in f for f in doc["p1"]["failures"]), doc["p1"]["failures"]


def test_verify_many_without_signature_flags_checks_no_signature(many, tmp_path):
    root = _copy_root(many, tmp_path)
    (root / "p0.sig").unlink()
    report = tmp_path / "v.json"
    done = _run("verify-many", str(root), "-q", "--report-json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    assert all("signature" not in p for p in json.loads(report.read_text())["policies"])


def test_an_encrypted_key_without_its_password_is_refused_before_any_work(many, tmp_path):
    tmp, keys = many
    out = tmp_path / "root"
    cases = [
        ({}, (), "is encrypted: name an environment variable holding its password with --sign-key-password-env VAR"),
        ({ENV: "wrong"}, ("--sign-key-password-env", ENV), f"wrong password (the environment variable {ENV})"),
        ({}, ("--sign-key-password-env", ENV), f"the environment variable {ENV} is not set"),
    ]
    for env, flags, message in cases:
        done = _run("export-many", str(SPEC), "--out", str(out), *FAST, "--sign-key", str(keys["enc"][0]), *flags,
                    env=env)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)
        assert PASSWORD not in done.stdout + done.stderr and "wrong" not in done.stdout
        assert not out.exists()  # refused before anything ran
    done = _run("export-many", str(SPEC), "--out", str(out), "--sign-key-password-env", ENV)
    assert done.returncode == 2 and "give --sign-key KEY" in done.stderr


def test_the_sign_command_takes_the_password_from_the_environment_or_a_terminal(many, tmp_path):
    tmp, keys = many
    shutil.copytree(tmp / "root" / "p0", tmp_path / "p0")
    done = _run("sign", str(tmp_path / "p0"), "--sign-key", str(keys["enc"][0]), "--sign-key-password-env", ENV,
                env={ENV: PASSWORD})
    assert done.returncode == 0 and "verified and signed" in done.stdout, done.stdout + done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    (tmp_path / "p0.sig").unlink()
    output = _on_a_terminal(["sign", str(tmp_path / "p0"), "--sign-key", str(keys["enc"][0])], PASSWORD)
    assert f"password of {keys['enc'][0]}" in output and "verified and signed" in output, output
    assert PASSWORD not in output  # typed without echo
    done = _run("verify", str(tmp_path / "p0"), "--public-key", str(keys["enc"][1]))
    assert done.returncode == 0, done.stdout + done.stderr


def _on_a_terminal(args: list[str], answer: str) -> str:
    """``policy-export ARGS`` on a pseudo-terminal, ``answer`` typed at the first prompt; its output."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        env = {k: v for k, v in os.environ.items() if k not in (ENV, "GITHUB_STEP_SUMMARY")}
        os.execve(sys.executable, [sys.executable, "-m", "policy_export", *args], env)
    output, answered, deadline = b"", False, time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child is gone
            break
        if not chunk:
            break
        output += chunk
        if not answered and b"password of" in output:
            os.write(fd, answer.encode() + b"\n")
            answered = True
    os.waitpid(pid, 0)
    os.close(fd)
    return output.decode("utf-8", errors="replace")


def test_an_encrypted_key_with_a_certificate_is_refused_by_name(many, tmp_path):
    tmp, keys = many
    cert = tmp_path / "leaf.crt"
    cert.write_text("not read: the key is refused first\n")
    done = _run("export-many", str(SPEC), "--out", str(tmp_path / "root"), "--sign-key", str(keys["enc"][0]),
                "--signing-certificate", str(cert), "--sign-key-password-env", ENV, env={ENV: PASSWORD})
    assert done.returncode == 2 and "certificate signer reads unencrypted keys only" in done.stderr, done.stderr


def test_a_league_entry_cannot_set_the_signing_key(tmp_path):
    from policy_export.errors import InputError
    from policy_export.exporter.many.jobs import league_options, read_league

    assert not {"sign_key", "sign_key_password_env", "signing_certificate", "sign_keyless"} & set(league_options())
    league = tmp_path / "league.json"
    league.write_text(json.dumps({"policies": [{"source": str(SPEC), "options": {"sign_key": "key.pem"}}]}))
    with pytest.raises(InputError, match="unknown option"):
        read_league(league)


def test_verify_reports_name_the_signer_and_time_every_case(many, tmp_path):
    tmp, keys = many
    report, junit, summary = tmp_path / "v.json", tmp_path / "v.xml", tmp_path / "v.md"
    done = cli("verify", str(tmp / "root" / "p0"), "--public-key", str(keys["enc"][1]), "--report-json", str(report),
               "--junit", str(junit), env_extra={"GITHUB_STEP_SUMMARY": str(summary)})
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads(report.read_text())["signature"]
    assert entry["method"] == "key" and entry["key_sha256"] == _hint(keys["enc"][1]) and entry["seconds"] > 0
    root = ET.parse(junit).getroot()
    cases = root.findall("testsuite/testcase")
    assert {c.get("name") for c in cases} >= {"signature", "sha256"}
    assert all(float(c.get("time")) > 0 for c in cases), [(c.get("classname"), c.get("time")) for c in cases]
    assert float(root.find("testsuite").get("time")) > 0
    (sig,) = [c for c in cases if c.get("name") == "signature"]
    assert {p.get("name") for p in sig.findall("properties/property")} >= {"signature.method", "signature.key_sha256"}
    assert f"- signed by key sha256:{_hint(keys['enc'][1])} (key; " in summary.read_text()


def test_junit_times_share_each_measured_format_time_among_its_cases():
    from policy_export.exporter import reports
    from policy_export.exporter.parity.compare import ParityReport

    seconds = {"onnx": 0.3, "keras": 0.6, "tflite vs saved_model": 0.2, "files": 0.05}
    assert reports._timed_label("onnx (stepped 200)", seconds) == "onnx"
    assert reports._timed_label("keras_v3", seconds) == "keras" and reports._timed_label("other", seconds) is None
    report = ParityReport("golden_outputs", 0, 0, {}, errors={"tflite vs saved_model": "cannot open"},
                          seconds=seconds)
    root = ET.fromstring(reports.junit_xml(report, "verify", ["changed file x"],
                                           {"passed": True, "method": "key", "key_sha256": "ab", "seconds": 0.1,
                                            "files": 3}).split("?>", 1)[1])
    cases = {c.get("classname"): c for c in root.iter("testcase")}
    assert float(cases["verify.tflite vs saved_model"].get("time")) == pytest.approx(0.2)
    assert float(cases["verify.files"].get("time")) == pytest.approx(0.05)
    assert float(cases["verify.signature"].get("time")) == pytest.approx(0.1)
    assert float(root.find("testsuite").get("time")) == pytest.approx(0.35) == float(root.get("time"))


def test_an_export_that_cannot_be_signed_fails_alone():
    from policy_export.errors import InputError
    from policy_export.exporter.many import _signed

    class Refusing:
        def sign(self, out):
            raise InputError(f"cannot sign {out} with --sign-key k.pem: ValueError: bad key")

    passed = {"name": "p0", "kind": "spec", "status": "passed", "failures": [], "seconds": 1.0}
    out = _signed(passed, {"p0": "/zoo/p0"}, Refusing())
    assert out["status"] == "failed" and out["failures"] == ["not signed: cannot sign /zoo/p0 with --sign-key k.pem: "
                                                             "ValueError: bad key"]
    assert out["signature"]["passed"] is False and out["signature"]["seconds"] >= 0
    failed = {**passed, "status": "failed"}
    assert _signed(failed, {"p0": "/zoo/p0"}, Refusing()) is failed  # a failed export is not signed
    assert _signed({**passed, "kind": "verify"}, {}, Refusing())["status"] == "passed"
