"""Signed exports (the signing extra): OpenSSF Model Signing over a whole export, the signature
beside it or at its top (``OUT/model.sig``, where model_signing keeps it). Round trips with the
``model_signing`` command line both ways and in both places, a certificate signature, and every
kind of tampering after signing refused by name (exit 1); beside a signature inside the export,
any other file not in the manifest still fails, named."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("model_signing")

from cryptography import x509  # noqa: E402  (model-signing brings it)
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from conftest import ROOT  # noqa: E402
from helpers import cli, notes  # noqa: E402

SPEC = ROOT / "fixtures" / "cartpole_mlp"
MODEL_SIGNING = Path(sys.executable).parent / "model_signing"
EXPORT_FLAGS = ("--formats", "onnx", "--explore-samples", "0", "--samples", "50", "-q")


def _key(folder: Path, name: str) -> tuple[Path, Path]:
    """A fresh P-256 key pair as PEM files: (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / f"{name}.pem", folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """An export of CartPole signed by ``export --sign-key``; a second export (another seed); keys a and b."""
    root = tmp_path_factory.mktemp("signing")
    keys = {name: _key(root, name) for name in ("a", "b")}
    done = cli("export", str(SPEC), "--out", str(root / "exp"), *EXPORT_FLAGS, "--sign-key", str(keys["a"][0]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "signed" in done.stdout and (root / "exp.sig").is_file() and not (root / "exp" / "exp.sig").exists()
    other = cli("export", str(SPEC), "--out", str(root / "other"), *EXPORT_FLAGS, "--seed", "7")
    assert other.returncode == 0, other.stdout + other.stderr
    return root, keys


def _copy(signed, tmp_path: Path) -> Path:
    root, _ = signed
    shutil.copytree(root / "exp", tmp_path / "exp")
    shutil.copy(root / "exp.sig", tmp_path / "exp.sig")
    return tmp_path / "exp"


def _model_signing(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(MODEL_SIGNING), *args], capture_output=True, text=True, timeout=300)


def test_an_export_signed_here_verifies_with_the_model_signing_command_line(signed):
    root, keys = signed
    done = _model_signing("verify", "key", str(root / "exp"), "--signature", str(root / "exp.sig"),
                          "--public_key", str(keys["a"][1]))
    assert done.returncode == 0, done.stdout + done.stderr
    report = root / "verify.json"
    done = cli("verify", str(root / "exp"), "--public-key", str(keys["a"][1]), "--report-json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads(report.read_text())["signature"]
    assert entry["passed"] and entry["files"] == 5 and entry["signer"].startswith("public key sha256:")
    assert notes(done.stdout, "signature") == [f"signature: {root / 'exp.sig'} signed by {entry['signer']}; covers "
                                               "5 files, the export as its manifest lists it"]


def test_an_export_signed_by_the_model_signing_command_line_verifies_here(signed, tmp_path):
    out = _copy(signed, tmp_path)
    _, keys = signed
    sig = tmp_path / "by-cli.sig"
    done = _model_signing("sign", "key", str(out), "--private_key", str(keys["b"][0]), "--signature", str(sig))
    assert done.returncode == 0, done.stdout + done.stderr
    done = cli("verify", str(out), "--public-key", str(keys["b"][1]), "--signature-file", str(sig))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_sign_command_verifies_first_and_signs_beside_the_export(signed, tmp_path):
    out = _copy(signed, tmp_path)
    _, keys = signed
    (tmp_path / "exp.sig").unlink()
    done = cli("sign", str(out), "--sign-key", str(keys["b"][0]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "exp.sig").is_file() and "verified and signed" in done.stdout
    assert cli("verify", str(out), "--public-key", str(keys["b"][1])).returncode == 0
    data = bytearray((out / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "model.onnx").write_bytes(bytes(data))
    (tmp_path / "exp.sig").unlink()
    done = cli("sign", str(out), "--sign-key", str(keys["b"][0]))
    assert done.returncode == 1 and "sign refused" in done.stderr and "changed file model.onnx" in done.stdout
    assert not (tmp_path / "exp.sig").exists()


def _flip_byte(out: Path, tmp_path: Path, signed) -> None:
    data = bytearray((out / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / "model.onnx").write_bytes(bytes(data))


def _add_file(out: Path, tmp_path: Path, signed) -> None:
    (out / "notes.txt").write_text("added after signing\n")


def _remove_file(out: Path, tmp_path: Path, signed) -> None:
    (out / "parity" / "report.json").unlink()


def _symlink(out: Path, tmp_path: Path, signed) -> None:
    (out / "model.onnx").rename(tmp_path / "elsewhere.onnx")
    (out / "model.onnx").symlink_to(tmp_path / "elsewhere.onnx")


def _rehash_manifest(out: Path, tmp_path: Path, signed) -> None:
    """The model changed and manifest.json rewritten to match it: verify's own file check passes."""
    from policy_export.exporter import manifest

    _flip_byte(out, tmp_path, signed)
    doc = json.loads((out / "manifest.json").read_text())
    doc["files"] = manifest.file_records(out)
    (out / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")


def _other_key(out: Path, tmp_path: Path, signed) -> None:
    from policy_export.exporter.signing import sign_export

    sign_export(out, signed[1]["b"][0])  # over the same export, replacing OUT.sig


def _other_export(out: Path, tmp_path: Path, signed) -> None:
    from policy_export.exporter.signing import sign_export

    root, keys = signed
    sign_export(root / "other", keys["a"][0], tmp_path / "exp.sig")  # a's signature of another export


@pytest.mark.parametrize("tamper, reasons", [
    (_flip_byte, ["changed file model.onnx (its sha256 is not the signed one)"]),
    (_add_file, ["extra file notes.txt (not signed)"]),
    (_remove_file, ["missing file parity/report.json (signed)"]),
    (_symlink, ["model.onnx", "symlink"]),
    (_rehash_manifest, ["changed file manifest.json (its sha256 is not the signed one); "
                        "changed file model.onnx (its sha256 is not the signed one)"]),
    (_other_key, ["Key mismatch"]),
    (_other_export, ["changed file parity/inputs.npz (its sha256 is not the signed one)"]),
], ids=["changed-byte", "added-file", "removed-file", "symlink", "manifest-rehashed", "other-key", "other-export"])
def test_tampering_after_signing_fails_verify_with_the_reason(signed, tmp_path, tamper, reasons):
    out = _copy(signed, tmp_path)
    tamper(out, tmp_path, signed)
    done = cli("verify", str(out), "--public-key", str(signed[1]["a"][1]))
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert "signature exp.sig does not match the export" in text
    for reason in reasons:
        assert reason in text, text


def test_a_signature_that_leaves_a_file_out_is_refused_by_name(signed, tmp_path):
    """model_signing verifies a signature made with --ignore-paths; the cross-check with the
    manifest does not: every listed file must be signed."""
    out = _copy(signed, tmp_path)
    _, keys = signed
    done = _model_signing("sign", "key", str(out), "--private_key", str(keys["a"][0]), "--signature",
                          str(tmp_path / "exp.sig"), "--ignore-paths", str(out / "model.onnx"))
    assert done.returncode == 0, done.stdout + done.stderr
    done = cli("verify", str(out), "--public-key", str(keys["a"][1]))
    assert done.returncode == 1 and "unsigned file model.onnx" in done.stdout, done.stdout + done.stderr


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a leaf certificate for signing, made here: (leaf key, leaf certificate, CA certificate)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "releaser")]))
            .issuer_name(ca_name).public_key(leaf_key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "leaf.pem", folder / "leaf.crt", folder / "ca.crt"
    paths[0].write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return paths


def test_a_certificate_signature_round_trips_and_names_its_subject(signed, tmp_path):
    out = _copy(signed, tmp_path)
    key, cert, ca = _certificates(tmp_path)
    done = cli("sign", str(out), "--sign-key", str(key), "--signing-certificate", str(cert),
               "--certificate-chain", str(ca))
    assert done.returncode == 0, done.stdout + done.stderr
    done = cli("verify", str(out), "--certificate-chain", str(ca))
    assert done.returncode == 0, done.stdout + done.stderr
    (note,) = notes(done.stdout, "signature")
    assert "signed by certificate CN=releaser" in note
    done = _model_signing("verify", "certificate", str(out), "--signature", str(tmp_path / "exp.sig"),
                          "--certificate_chain", str(ca))
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "other").mkdir()
    other_ca = _certificates(tmp_path / "other")[2]
    done = cli("verify", str(out), "--certificate-chain", str(other_ca))
    assert done.returncode == 1 and "does not match the export" in done.stdout, done.stdout + done.stderr


def test_bad_signing_requests_are_refused_before_any_work(signed, tmp_path):
    root, keys = signed
    done = cli("sign", str(root / "exp"), "--sign-key", str(keys["a"][0]), "--signature-file",
               str(root / "exp" / "parity" / "inside.sig"))
    assert done.returncode == 2 and "is inside the export" in done.stderr and "below its top" in done.stderr
    done = cli("sign", str(root / "exp"), "--sign-key", str(keys["a"][0]), "--signature-file",
               str(root / "exp" / "model.onnx"))
    assert done.returncode == 2 and "does not end in .sig" in done.stderr
    assert not (root / "exp" / "parity" / "inside.sig").exists()
    done = cli("sign", str(root / "exp"))
    assert done.returncode == 2 and "--sign-key KEY" in done.stderr
    done = cli("verify", str(root / "exp"), "--public-key", str(keys["a"][1]), "--signature-file",
               str(tmp_path / "none.sig"))
    assert done.returncode == 2 and "no such file" in done.stderr
    done = cli("export", str(SPEC), "--out", str(tmp_path / "o"), "--signature-file", str(tmp_path / "o.sig"))
    assert done.returncode == 2 and "give --sign-key" in done.stderr and not (tmp_path / "o").exists()


def test_a_missing_extra_names_it(signed, monkeypatch):
    root, keys = signed
    monkeypatch.setitem(sys.modules, "model_signing", None)
    done = cli("verify", str(root / "exp"), "--public-key", str(keys["a"][1]))
    assert done.returncode == 2 and 'pip install "policy-export[signing]"' in done.stderr, done.stderr


def test_the_api_reports_the_signer_and_the_files_signed(signed):
    from policy_export.exporter.signing import verify_signature

    root, keys = signed
    check = verify_signature(root / "exp", public_key=keys["a"][1])
    assert check.passed and check.signer.startswith("public key sha256:")
    manifest = json.loads((root / "exp" / "manifest.json").read_text())
    assert set(check.files) == {f["path"] for f in manifest["files"]} | {"manifest.json"}
    assert all(check.files[f["path"]] == f["sha256"] for f in manifest["files"])


def test_export_reports_name_the_signer_and_an_encrypted_key_takes_its_password_from_the_environment(tmp_path):
    import hashlib
    import xml.etree.ElementTree as ET

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = tmp_path / "enc.pem", tmp_path / "enc.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.BestAvailableEncryption(b"s3cret-pass")))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    report, junit, summary = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "s.md"
    done = cli("export", str(SPEC), "--out", str(tmp_path / "exp"), *EXPORT_FLAGS, "--sign-key", str(private),
               "--sign-key-password-env", "EXPORT_KEY_PASSWORD", "--report-json", str(report), "--junit", str(junit),
               env_extra={"EXPORT_KEY_PASSWORD": "s3cret-pass", "GITHUB_STEP_SUMMARY": str(summary)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "s3cret-pass" not in done.stdout + done.stderr + report.read_text() + junit.read_text()
    hint = hashlib.sha256(public.read_bytes()).hexdigest()  # model-signing's key hint: sha256 of the public PEM
    entry = json.loads(report.read_text())["signature"]
    assert entry["method"] == "key" and entry["key_sha256"] == hint and entry["passed"] and entry["seconds"] > 0
    assert entry["path"] == str(tmp_path / "exp.sig") and (tmp_path / "exp.sig").is_file()
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert all(float(c.get("time")) > 0 for c in cases) and float(suite.get("time")) > 0
    (sig,) = [c for c in cases if c.get("name") == "signature"]
    props = {p.get("name"): p.get("value") for p in sig.findall("properties/property")}
    assert props["signature.method"] == "key" and props["signature.key_sha256"] == hint
    assert f"- signed by key sha256:{hint} (key; " in summary.read_text()
    assert cli("verify", str(tmp_path / "exp"), "--public-key", str(public)).returncode == 0
    done = cli("export", str(SPEC), "--out", str(tmp_path / "exp2"), *EXPORT_FLAGS, "--sign-key", str(private),
               "--sign-key-password-env", "EXPORT_KEY_PASSWORD", env_extra={"EXPORT_KEY_PASSWORD": "not-it"})
    assert done.returncode == 2 and "wrong password" in done.stderr and not (tmp_path / "exp2").exists()


# ------------------------------------------------------------------- the signature inside the export


def _serialization(sig: Path) -> dict:
    """The serialization the signature records: model-signing's method, and the paths it left out."""
    import base64

    payload = json.loads(sig.read_text())["dsseEnvelope"]["payload"]
    return json.loads(base64.b64decode(payload))["predicate"]["serialization"]


@pytest.mark.parametrize("place", ["beside", "inside"])
@pytest.mark.parametrize("signer", ["policy-export", "model_signing"])
def test_a_signature_beside_or_inside_the_export_round_trips_with_the_model_signing_command_line(
        signed, tmp_path, signer, place):
    """Signed by either tool, beside the export (``exp.sig``) or at its top (``exp/model.sig``, as
    model_signing keeps it), checked by both. Inside, the signature leaves itself out, as
    model_signing's command line does (its ``ignore_paths``), and ``verify`` finds it there when
    no ``--signature-file`` is given and there is no ``exp.sig``."""
    out = _copy(signed, tmp_path)
    _, keys = signed
    (tmp_path / "exp.sig").unlink()
    sig = tmp_path / "exp.sig" if place == "beside" else out / "model.sig"
    if signer == "policy-export":
        done = cli("sign", str(out), "--sign-key", str(keys["b"][0]), "--signature-file", str(sig))
    else:
        done = _model_signing("sign", "key", str(out), "--private_key", str(keys["b"][0]), "--signature", str(sig))
    assert done.returncode == 0, done.stdout + done.stderr
    ignored = _serialization(sig).get("ignore_paths", [])  # model_signing's also names git's files
    assert ("model.sig" in ignored) == (place == "inside") and "manifest.json" not in ignored
    done = _model_signing("verify", "key", str(out), "--signature", str(sig), "--public_key", str(keys["b"][1]))
    assert done.returncode == 0, done.stdout + done.stderr
    named = ("--signature-file", str(sig)) if signer == "model_signing" else ()  # by name, and found
    report = tmp_path / "verify.json"
    done = cli("verify", str(out), "--public-key", str(keys["b"][1]), *named, "--report-json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads(report.read_text())["signature"]
    assert entry["passed"] and entry["path"] == str(sig) and entry["files"] == 5
    assert notes(done.stdout, "signature")[0].startswith(f"signature: {sig} signed by public key sha256:")


@pytest.mark.parametrize("added", ["extra.txt", "model.sig.bak"])
def test_beside_a_signature_inside_the_export_any_other_added_file_fails_naming_it(signed, tmp_path, added):
    from policy_export.exporter.signing import sign_export

    out = _copy(signed, tmp_path)
    _, keys = signed
    (tmp_path / "exp.sig").unlink()
    sign_export(out, keys["a"][0], out / "model.sig")
    (out / added).write_bytes((out / "model.sig").read_bytes() if added.startswith("model.sig") else b"notes\n")
    for named in ((), ("--signature-file", str(out / "model.sig"))):
        done = cli("verify", str(out), "--public-key", str(keys["a"][1]), *named)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"extra file {added} (not in the manifest)" in done.stdout, done.stdout
        assert f"signature model.sig does not match the export: extra file {added} (not signed)" in done.stdout
        assert "extra file model.sig " not in done.stdout  # the signature checked is the one file let through
    done = _model_signing("verify", "key", str(out), "--signature", str(out / "model.sig"), "--public_key",
                          str(keys["a"][1]))
    assert done.returncode == 1 and added in done.stderr, done.stdout + done.stderr


def test_only_the_signature_being_checked_is_let_through(signed, tmp_path):
    """A plain ``verify`` checks no signature, so ``model.sig`` is an extra file like any other;
    with ``exp.sig`` beside the export, that is the signature checked, and ``model.sig`` is extra."""
    from policy_export.exporter.signing import sign_export

    out = _copy(signed, tmp_path)
    _, keys = signed
    sign_export(out, keys["a"][0], out / "model.sig")
    done = cli("verify", str(out))
    assert done.returncode == 1 and "extra file model.sig (not in the manifest)" in done.stdout, done.stdout
    done = cli("verify", str(out), "--public-key", str(keys["a"][1]))  # exp.sig beside: the one checked
    assert done.returncode == 1 and "extra file model.sig (not in the manifest)" in done.stdout, done.stdout
    assert "signature exp.sig does not match the export: extra file model.sig (not signed)" in done.stdout
    (tmp_path / "exp.sig").unlink()
    assert cli("verify", str(out), "--public-key", str(keys["a"][1])).returncode == 0
    done = cli("sign", str(out), "--sign-key", str(keys["a"][0]))  # beside, with model.sig inside: unsigned
    assert done.returncode == 1 and "extra file model.sig" in done.stdout and not (tmp_path / "exp.sig").exists()


def test_a_signature_inside_that_leaves_an_unlisted_file_out_fails_naming_it(signed, tmp_path):
    """model_signing accepts a signature that says it ignored a file (``--ignore-paths``); here
    every file of the export must be signed, but the signature itself."""
    from policy_export.exporter.signing import verify_signature

    out = _copy(signed, tmp_path)
    _, keys = signed
    (tmp_path / "exp.sig").unlink()
    (out / "extra.txt").write_text("left out of the signature\n")
    done = _model_signing("sign", "key", str(out), "--private_key", str(keys["a"][0]), "--signature",
                          str(out / "model.sig"), "--ignore-paths", str(out / "extra.txt"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _model_signing("verify", "key", str(out), "--signature", str(out / "model.sig"), "--public_key",
                          str(keys["a"][1])).returncode == 0
    check = verify_signature(out, public_key=keys["a"][1])
    assert check.problems == ["extra file extra.txt (not signed: the signature leaves it out)"]
    done = cli("verify", str(out), "--public-key", str(keys["a"][1]))
    assert done.returncode == 1 and "extra file extra.txt (not in the manifest)" in done.stdout, done.stdout


def test_a_signature_inside_never_replaces_a_file_of_the_export(signed, tmp_path):
    from policy_export.errors import InputError
    from policy_export.exporter.signing import sign_export

    from helpers import resign

    out = _copy(signed, tmp_path)
    _, keys = signed
    (out / "listed.sig").write_text("a file the manifest lists\n")
    resign(out)
    with pytest.raises(InputError, match="is a file the manifest of .* lists"):
        sign_export(out, keys["a"][0], out / "listed.sig")
    assert (out / "listed.sig").read_text() == "a file the manifest lists\n"
    with pytest.raises(InputError, match="does not end in .sig"):
        sign_export(out, keys["a"][0], out / "manifest.json")
