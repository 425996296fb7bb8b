"""Key, certificate and signature files are read bounded (the signing extra): each opened without
following a symbolic link, only as a regular file, within its size limit, and read once, the bytes
handed to model-signing. A huge sparse file, a link to a real file, a FIFO and a directory are each
refused with exit 2 and one line naming the file and the reason, before TensorFlow loads, in a
process whose time and peak memory are measured."""

from __future__ import annotations

import builtins
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("model_signing")

from cryptography.hazmat.primitives import serialization  # noqa: E402  (model-signing brings it)
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from conftest import ROOT  # noqa: E402
from helpers import cli  # noqa: E402

SPEC = ROOT / "fixtures" / "cartpole_mlp"
EXPORT_FLAGS = ("--formats", "onnx", "--explore-samples", "0", "--samples", "50", "-q")
HUGE = 8 << 30  # a sparse file: no disk used, but reading it whole would take 8 GiB of memory
SECONDS, PEAK_MIB = 5.0, 160  # measured: 0.35-1.5 s and 44-46 MiB a refusal (the interpreter and the CLI's imports)

# the command line in a process of its own, measured: its peak memory (VmHWM, this process's own),
# the seconds from start to exit code (imports included), and whether TensorFlow was loaded
DRIVER = """
import sys, time
start = time.perf_counter()
from policy_export.exporter.cli import main
code = main(sys.argv[1:])
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("MEASURED", hwm, time.perf_counter() - start, "tensorflow" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


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
    """An export of CartPole signed beside it (``exp.sig``) and its key pair."""
    root = tmp_path_factory.mktemp("signing-files")
    private, public = _key(root, "a")
    done = cli("export", str(SPEC), "--out", str(root / "exp"), *EXPORT_FLAGS, "--sign-key", str(private))
    assert done.returncode == 0, done.stdout + done.stderr
    return root, private, public


def _huge(path: Path, real: Path) -> str:
    path.touch()
    os.truncate(path, HUGE)
    return f"is {HUGE:,} bytes, more than"


def _link(path: Path, real: Path) -> str:
    path.symlink_to(real)
    return "is a symbolic link, which is never followed"


def _fifo(path: Path, real: Path) -> str:
    os.mkfifo(path)
    return "is a FIFO, not a regular file"


def _directory(path: Path, real: Path) -> str:
    path.mkdir()
    return "is a directory, not a regular file"


HOSTILE = {"huge": _huge, "link": _link, "fifo": _fifo, "directory": _directory}


def _measured(*args: str) -> tuple[subprocess.CompletedProcess, int, float, bool]:
    """``policy-export ARGS`` in a process of its own: (the process, its peak KiB, its seconds, TensorFlow loaded)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GITHUB_STEP_SUMMARY")}
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)
    lines = done.stderr.strip().splitlines()
    kib, seconds, tf = lines[-1].split()[1:]
    done.stderr = "\n".join(lines[:-1]) + "\n"
    return done, int(kib), float(seconds), tf == "True"


def _refused(args: tuple[str, ...], fragments: tuple[str, ...]) -> None:
    done, kib, seconds, tf = _measured(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), done.stderr
    assert "Traceback" not in done.stderr and not tf, done.stderr
    assert seconds < SECONDS and kib < PEAK_MIB * 1024, f"{seconds:.2f} s, peak {kib / 1024:.0f} MiB"
    print(f"refused in {seconds:.2f} s, peak {kib / 1024:.0f} MiB: {lines[0]}")


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_signature_beside_the_export_is_refused_before_tensorflow(signed, tmp_path, kind):
    root, _, public = signed
    out = tmp_path / "exp"
    out.mkdir()
    for name in ("manifest.json", "model.onnx"):  # verify reads the manifest first: an export to refuse
        (out / name).write_bytes((root / "exp" / name).read_bytes())
    why = HOSTILE[kind](tmp_path / "exp.sig", root / "exp.sig")
    _refused(("verify", str(out), "--public-key", str(public)), (f"signature {tmp_path / 'exp.sig'}: ", why))


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_signature_file_inside_the_export_is_refused(signed, tmp_path, kind):
    root, _, public = signed
    sig = root / "exp" / f"{kind}.sig"  # at the export's top, where model_signing keeps model.sig
    try:
        why = HOSTILE[kind](sig, root / "exp.sig")
        _refused(("verify", str(root / "exp"), "--public-key", str(public), "--signature-file", str(sig)),
                 (f"signature {sig}: ", why))
    finally:
        sig.rmdir() if kind == "directory" else sig.unlink()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_private_key_is_refused_before_tensorflow(signed, tmp_path, kind):
    root, private, _ = signed
    why = HOSTILE[kind](tmp_path / "key.pem", private)
    _refused(("sign", str(root / "exp"), "--sign-key", str(tmp_path / "key.pem")),
             (f"--sign-key {tmp_path / 'key.pem'}: ", why))


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_public_key_is_refused_before_tensorflow(signed, tmp_path, kind):
    root, _, public = signed
    why = HOSTILE[kind](tmp_path / "key.pub", public)
    _refused(("verify", str(root / "exp"), "--public-key", str(tmp_path / "key.pub")),
             (f"--public-key {tmp_path / 'key.pub'}: ", why))


@pytest.mark.parametrize("flag, kind", [
    ("--certificate-chain", "huge"), ("--certificate-chain", "fifo"),
    ("--signing-certificate", "huge"), ("--signing-certificate", "link"),
])
def test_a_hostile_certificate_file_is_refused_before_tensorflow(signed, tmp_path, flag, kind):
    root, private, public = signed
    pem = tmp_path / "cert.pem"
    why = HOSTILE[kind](pem, public)  # what it would hold does not matter: it is never read
    args = (("verify", str(root / "exp"), flag, str(pem)) if flag == "--certificate-chain"
            else ("sign", str(root / "exp"), "--sign-key", str(private), flag, str(pem)))
    _refused(args, (f"{flag} {pem}: ", why))


@pytest.mark.parametrize("kind", ["huge", "fifo"])
def test_export_with_a_hostile_key_is_refused_before_anything_is_exported(tmp_path, kind):
    private, _ = _key(tmp_path, "real")
    why = HOSTILE[kind](tmp_path / "key.pem", private)
    _refused(("export", str(SPEC), "--out", str(tmp_path / "out"), "--sign-key", str(tmp_path / "key.pem")),
             (f"--sign-key {tmp_path / 'key.pem'}: ", why))
    assert not (tmp_path / "out").exists()


def test_export_many_and_verify_many_refuse_a_hostile_key_before_anything_runs(signed, tmp_path):
    root, private, public = signed
    why = _huge(tmp_path / "key.pem", private)
    _refused(("export-many", str(SPEC), "--out", str(tmp_path / "zoo"), "--sign-key", str(tmp_path / "key.pem")),
             (f"--sign-key {tmp_path / 'key.pem'}: ", why))
    assert not (tmp_path / "zoo").exists()
    _link(tmp_path / "key.pub", public)
    _refused(("verify-many", str(root), "--public-key", str(tmp_path / "key.pub")),
             (f"--public-key {tmp_path / 'key.pub'}: ", "is a symbolic link"))


@pytest.mark.parametrize("what, limit", [("signature", "MAX_SIGNATURE_BYTES"), ("--public-key", "MAX_KEY_BYTES"),
                                         ("--sign-key", "MAX_KEY_BYTES"),
                                         ("--certificate-chain", "MAX_CERTIFICATE_BYTES")])
def test_read_input_takes_a_file_at_its_limit_and_refuses_one_byte_more(tmp_path, what, limit):
    from policy_export.errors import InputError
    from policy_export.exporter import signing

    size = getattr(signing, limit)
    path = tmp_path / "f"
    path.touch()
    os.truncate(path, size)
    assert len(signing.read_input(what, path)) == size
    os.truncate(path, size + 1)
    with pytest.raises(InputError, match=f"{what} {path}: is {size + 1:,} bytes"):
        signing.read_input(what, path)


def test_the_limits_fit_a_real_export_with_margin(signed):
    """What the size limits are made from: the signature of a real export, per file it signs."""
    from policy_export.exporter import signing

    root, _, public = signed
    check = signing.verify_signature(root / "exp", public_key=public)
    per_file = (root / "exp.sig").stat().st_size / len(check.files)
    assert check.passed and per_file < 600, per_file  # ~350 bytes a file here (a fixed part, then ~280 a file)
    assert signing.MAX_SIGNATURE_BYTES / per_file > 25_000  # files an export may have before it cannot be signed
    assert signing.MAX_KEY_BYTES > 16 * (root / "a.pem").stat().st_size


@pytest.fixture
def opened(monkeypatch):
    """Every path Python opens by name (``open``, ``Path.read_bytes``/``read_text``), recorded."""
    seen: list[str] = []
    real_open = builtins.open

    def recording_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            seen.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: (seen.append(str(self)), _read(self, "rb"))[1])
    monkeypatch.setattr(pathlib.Path, "read_text",
                        lambda self, encoding=None, errors=None: (seen.append(str(self)),
                                                                  _read(self, "r", encoding, errors))[1])
    return seen


def _read(path: pathlib.Path, mode: str, encoding=None, errors=None):
    with open(path, mode, encoding=encoding, errors=errors) as f:
        return f.read()


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "private-folder"])
def test_model_signing_is_given_the_bytes_read_never_the_paths_given(signed, tmp_path, monkeypatch, opened, memfd):
    """The key and signature are read once here (no link followed, bounded); model-signing, whose
    API takes paths, opens only a memory file holding those bytes (or, without memfd, a private
    temporary folder's file, removed after), so a file swapped after the check cannot reach it."""
    from policy_export.exporter.signing import sign_export, verify_signature

    root, private, public = signed
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    if not memfd:
        monkeypatch.delattr(os, "memfd_create")
    done = sign_export(root / "exp", private, tmp_path / "here.sig")
    check = verify_signature(root / "exp", tmp_path / "here.sig", public_key=public)
    assert check.passed and done.files == len(check.files) == 5, check.problems
    given = {str(private), str(public), str(tmp_path / "here.sig")}
    assert not given & set(opened), opened
    handed = [p for p in opened if p.startswith("/proc/self/fd/") or p.startswith(str(tmp_path / "tmp"))]
    assert len(handed) >= 4, opened  # key, signature written, public key, signature read
    assert all(p.startswith("/proc/self/fd/" if memfd else str(tmp_path / "tmp")) for p in handed), handed
    assert not list((tmp_path / "tmp").iterdir())  # nothing left in the private folder


def test_a_signature_larger_than_verify_reads_is_not_written(signed, tmp_path, monkeypatch):
    from policy_export.errors import InputError
    from policy_export.exporter import signing

    root, private, _ = signed
    monkeypatch.setattr(signing, "MAX_SIGNATURE_BYTES", 1000)
    with pytest.raises(InputError, match="more than a signature may hold"):
        signing.sign_export(root / "exp", private, tmp_path / "big.sig")
    assert not list(tmp_path.iterdir())
