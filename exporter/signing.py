"""Signed exports: an OpenSSF Model Signing signature over a whole export directory.

The signature is made and checked by the ``model-signing`` library (the ``signing`` extra): a
Sigstore bundle whose DSSE envelope holds an in-toto statement listing every file of the export,
``manifest.json`` included, with its sha256. It goes *beside* the export (``OUT.sig`` by
default) or, as model-signing's own command line and published models keep it, *inside* it at
its top (``OUT/model.sig``): then it is the one file the signature does not cover (it is left
out of its own hashing, as ``model_signing sign`` leaves it out) and the one file the manifest
does not list that ``verify`` accepts, and only while that signature is the one being checked.

    from policy_export.exporter.signing import sign_export, verify_signature
    sign_export("out/cartpole", private_key="key.pem")            # writes out/cartpole.sig
    verify_signature("out/cartpole", public_key="key.pub").passed

Three ways to sign, as ``model_signing sign`` has them: an elliptic-curve private key (PEM), a
private key with its signing certificate (and chain), or keyless through Sigstore's OIDC flow (a
network service: it cannot run offline). :func:`verify_signature` first lets the library check the
signature and every file's digest, then checks that what was signed is the export as its manifest
describes it: every listed file and ``manifest.json`` signed, nothing else, with the manifest's
digests, and no file of the export left out; an export signed with files left out
(``--ignore-paths``) is refused by name.

Every key, certificate and signature file is opened without following a symbolic link, must be a
regular file (``fstat``) within a size limit (:data:`MAX_KEY_BYTES`, :data:`MAX_CERTIFICATE_BYTES`,
:data:`MAX_SIGNATURE_BYTES`), and is read once; model-signing, whose API takes paths only, is
handed those bytes through an anonymous memory file (:class:`_Handoff`), never the path given.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter import manifest
from policy_export.exporter.compat import require

EXTRA = "signing"
MODULES = ("model_signing", "OpenSSL", "certifi")  # model-signing, pyopenssl and certifi
SUFFIX = ".sig"
STANDARD_NAME = "model.sig"  # model_signing's default signature, inside the model's folder

# What a file signing reads may hold at most; a larger one is refused (exit 2) before it is read.
# A signature lists every file of the export (name and sha256, base64 in the DSSE envelope): measured,
# 10,275 bytes for the 38 files of the CartPole fixture exported in all 14 formats (~270 bytes a file).
# 16 MiB holds ~60,000 such files, 1,600 times that export; sign_export refuses to write a larger one.
MAX_SIGNATURE_BYTES = 16 << 20
# A PEM key: an encrypted P-521 private key is under 1 KiB, an RSA-16384 one about 12 KiB.
MAX_KEY_BYTES = 64 << 10
# A PEM file of certificates (a chain): certifi's bundle of every public root is 229 KiB.
MAX_CERTIFICATE_BYTES = 4 << 20


def require_signing(what: str) -> None:
    """Raise :class:`InputError` naming the ``signing`` extra when its libraries are missing."""
    require(MODULES, EXTRA, what)


# ----------------------------------------------------------------- reading keys, certificates, signatures

_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def _open_checked(what: str, path: str | Path, limit: int, noun: str) -> int:
    """A descriptor of ``path`` opened without following a symbolic link (and without waiting on a
    FIFO), once ``fstat`` shows a regular file of at most ``limit`` bytes; the caller closes it.

    Raises:
        InputError: one line naming ``what`` (the flag or role), the path and the reason.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            reason = "no such file"
        elif os.path.islink(path):  # ELOOP on Linux (EMLINK on some BSDs)
            reason = "is a symbolic link, which is never followed: give the file itself"
        else:
            reason = f"cannot be opened ({e.strerror})"
        raise InputError(f"{what} {path}: {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _KINDS if test(info.st_mode)), "special file")
            raise InputError(f"{what} {path}: is a {kind}, not a regular file")
        if info.st_size > limit:
            raise InputError(f"{what} {path}: is {info.st_size:,} bytes, more than {noun} may hold ({limit:,})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _limit(what: str) -> tuple[int, str]:
    """The size limit of a file by its role, and how the refusal names that kind of file."""
    if what == "signature":
        return MAX_SIGNATURE_BYTES, "a signature"
    if what in ("--signing-certificate", "--certificate-chain"):
        return MAX_CERTIFICATE_BYTES, "a certificate file"
    return MAX_KEY_BYTES, "a key file"


def check_input(what: str, path: str | Path) -> None:
    """Check, without reading it, that the key, certificate or signature file ``path`` (its role
    ``what``: ``--sign-key``, ``--public-key``, ``--signing-certificate``, ``--certificate-chain``
    or ``signature``) can be read: a regular file, not a symbolic link, within its size limit.

    Raises:
        InputError: it cannot, naming the file and the reason.
    """
    os.close(_open_checked(what, path, *_limit(what)))


def read_input(what: str, path: str | Path) -> bytes:
    """The bytes of the key, certificate or signature file ``path`` (its role ``what``, as
    :func:`check_input` takes it), read once, whole, from a descriptor opened without following a
    symbolic link and checked to be a regular file within its size limit.

        read_input("--public-key", "key.pub")

    Raises:
        InputError: no such file, a symbolic link, not a regular file (a directory, a FIFO, a
            device), over its limit (also one that grows past it while read), or unreadable.
    """
    limit, noun = _limit(what)
    fd = _open_checked(what, path, limit, noun)
    try:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise InputError(f"{what} {path}: cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise InputError(f"{what} {path}: grew past {limit:,} bytes, more than {noun} may hold, while it was read")
    return b"".join(chunks)


class _Handoff:
    """Paths through which model-signing, whose API takes paths only, reads the bytes read here
    and writes the signature it makes, so that it never opens a path a user gave.

    On Linux each is an anonymous memory file (``memfd_create``), which model-signing opens as
    ``/proc/self/fd/N``: nothing touches a disk, and no name outside this process leads to it.
    Elsewhere (no ``memfd_create`` or no ``/proc``) each is a file (mode 0600) in a private
    temporary directory (mode 0700), removed on exit: a private key is then on a disk, in that
    directory, while model-signing reads it.
    """

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._folder: Path | None = None

    def __enter__(self) -> "_Handoff":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds:
            os.close(fd)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _new(self) -> Path:
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("policy-export-signing", os.MFD_CLOEXEC)
            self._fds.append(fd)
            path = Path(f"/proc/self/fd/{fd}")
            if path.exists():
                return path
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="policy-export-signing-"))  # mode 0700
        fd, name = tempfile.mkstemp(dir=self._folder)  # mode 0600
        os.close(fd)
        return Path(name)

    def give(self, data: bytes) -> Path:
        """A path that holds exactly ``data``."""
        path = self._new()
        path.write_bytes(data)
        return path

    def blank(self) -> Path:
        """An empty path for model-signing to write."""
        return self._new()

    def taken(self, path: Path, what: str) -> bytes:
        """What model-signing wrote to :meth:`blank`'s ``path`` (``what`` names it in errors),
        within :data:`MAX_SIGNATURE_BYTES`.

        Raises:
            InputError: it is larger.
        """
        size = path.stat().st_size
        if size > MAX_SIGNATURE_BYTES:
            raise InputError(f"{what}: the signature is {size:,} bytes, more than a signature may hold "
                             f"({MAX_SIGNATURE_BYTES:,}, what verify reads): not written")
        return path.read_bytes()


def _write_signature(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: a new file beside it (created exclusively, so never through
    a symbolic link), then renamed over it (a link there is replaced, not followed)."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------- where the signature is


def default_signature(out: str | Path) -> Path:
    """Where the signature of the export at ``out`` goes by default: ``OUT.sig``, beside it."""
    root = Path(os.path.abspath(out))
    return root.parent / (root.name + SUFFIX)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def inside_export(out: str | Path, signature: str | Path) -> str | None:
    """The name of the signature file ``signature`` when it lies at the top of the export ``out``
    (``model.sig`` for ``OUT/model.sig``; the folders compared with links resolved), else ``None``."""
    path = Path(os.path.abspath(signature))
    return path.name if _real(path.parent) == _real(Path(os.path.abspath(out))) else None


def signature_path(out: str | Path, signature: str | Path | None = None) -> Path:
    """The signature file of the export at ``out`` (``signature``, or ``OUT.sig``), absolute.

    Beside the export (or anywhere outside it), any name; inside it, only a ``.sig`` file at its
    top (``OUT/model.sig``, as model_signing keeps it): a name no export writes, so that signing
    never replaces a file of the export, and the one file :func:`inside_export` names.

    Raises:
        InputError: the path is the export itself, a directory, deeper inside the export than its
            top, or a file at its top whose name does not end in ``.sig``.
    """
    root = Path(os.path.abspath(out))
    path = Path(os.path.abspath(signature)) if signature else default_signature(out)
    real_root, real_parent = _real(root), _real(path.parent)
    if path == root or _real(path) == real_root:
        raise InputError(f"--signature-file {signature}: is the export {out} itself")
    if real_root in real_parent.parents:
        raise InputError(f"--signature-file {signature}: is inside the export {out} below its top; a signature "
                         f"inside an export is a .sig file at its top ({Path(out) / STANDARD_NAME}, where "
                         f"model_signing keeps it), or beside it (default {default_signature(out)})")
    if real_parent == real_root and path.suffix != SUFFIX:
        raise InputError(f"--signature-file {signature}: is inside the export {out} and its name does not end in "
                         f"{SUFFIX}; a signature inside an export is a {SUFFIX} file at its top "
                         f"({Path(out) / STANDARD_NAME}), a name no export writes")
    if path.is_dir():
        raise InputError(f"signature {path}: is a directory, not a regular file")
    return path


def find_signature(out: str | Path, signature: str | Path | None = None) -> Path:
    """The signature to check for the export at ``out``: ``signature`` when given; else ``OUT.sig``
    beside the export; else, when there is none, ``OUT/model.sig`` (model_signing's default,
    inside the model's folder) if that exists; else ``OUT.sig`` (missing). Not read here.

    Raises:
        InputError: as :func:`signature_path`.
    """
    if signature:
        return signature_path(out, signature)
    beside = default_signature(out)
    standard = Path(os.path.abspath(out)) / STANDARD_NAME
    return standard if not os.path.lexists(beside) and os.path.lexists(standard) else beside


def _not_listed(out: str | Path, name: str) -> None:
    """Refuse a signature inside the export at a name its manifest lists (signing would replace
    that file); an export not yet written (``export --sign-key``'s early check) has nothing listed."""
    if not (Path(out) / manifest.MANIFEST).exists():
        return
    listed = {f["path"] for f in manifest.read_manifest(Path(out))["files"]}
    if name in listed:
        raise InputError(f"--signature-file {Path(out) / name}: is a file the manifest of {out} lists; the "
                         "signature would replace it")


# ---------------------------------------------------------------------------------------------- signing


def check_sign_inputs(out: str | Path, private_key: str | Path | None, signature: str | Path | None = None, *,
                      signing_certificate: str | Path | None = None, certificate_chain: Sequence[str | Path] = (),
                      keyless: bool = False) -> Path:
    """The cheap checks of a signing request, made before any work: the extra is installed, one
    way to sign is chosen, the key and certificates are regular files within their limits (not
    read yet), and the signature goes beside the export or at its top (:func:`signature_path`).
    Returns the signature's path."""
    if keyless == (private_key is not None):
        raise InputError("sign with --sign-key KEY (an elliptic-curve private key, PEM) or --sign-keyless "
                         "(Sigstore), one of them")
    if signing_certificate is not None and private_key is None:
        raise InputError("--signing-certificate needs --sign-key, the private key the certificate certifies")
    require_signing("signing an export")
    path = signature_path(out, signature)
    if private_key is not None:
        check_key("--sign-key", private_key, "private", elliptic=signing_certificate is None)
    if signing_certificate is not None:
        check_input("--signing-certificate", signing_certificate)
    for chain in certificate_chain:
        check_input("--certificate-chain", chain)
    return path


def _load_key(data: bytes, password: bytes | None) -> None:
    from cryptography.hazmat.primitives import serialization

    serialization.load_pem_private_key(data, password)


def key_password(private_key: str | Path | None, password_env: str | None = None, *,
                 signing_certificate: str | Path | None = None,
                 ask: Callable[[str], str] | None = None) -> bytes | None:
    """The password of an encrypted ``private_key``, for the command line, checked against the key
    before any work: read from the environment variable named ``password_env`` (the password is
    never an argument, so it is not in the process list or the shell's history), else asked with
    ``ask`` (a prompt without echo, given where stdin is a terminal). ``None`` for a key that is not
    encrypted (a variable named then is not read). The password is never printed.

    Raises:
        InputError: the key cannot be read (:func:`read_input`), the key is encrypted and no
            password was given, the variable is not set, the password does not decrypt the key, or
            an encrypted key is given with ``--signing-certificate`` (model-signing's certificate
            signer takes no password).
    """
    if private_key is None:
        if password_env:
            raise InputError("--sign-key-password-env names the password of --sign-key KEY: give the key")
        return None
    data = read_input("--sign-key", private_key)
    try:
        _load_key(data, None)
        return None  # not encrypted
    except TypeError:
        pass  # "Password was not given but private key is encrypted"
    except ValueError:
        return None  # not a PEM private key: model-signing names the problem when it signs
    if signing_certificate is not None:
        raise InputError(f"--sign-key {private_key} is encrypted and model-signing's certificate signer reads "
                         "unencrypted keys only: sign with --sign-key alone, or decrypt the key for this signature")
    if password_env:
        if password_env not in os.environ:
            raise InputError(f"--sign-key-password-env {password_env}: the environment variable {password_env} is "
                             f"not set (it holds the password of --sign-key {private_key})")
        value, given = os.environ[password_env], f"the environment variable {password_env}"
    elif ask is not None:
        value, given = ask(f"password of {private_key}: "), "the password typed"
    else:
        raise InputError(f"--sign-key {private_key} is encrypted: name an environment variable holding its password "
                         "with --sign-key-password-env VAR (or run on a terminal to be asked for it)")
    secret = value.encode("utf-8")
    try:
        _load_key(data, secret)
    except (TypeError, ValueError):
        raise InputError(f"--sign-key {private_key}: wrong password ({given}): the key cannot be decrypted") from None
    return secret


@dataclass(frozen=True)
class SignRequest:
    """How to sign exports (``export-many --sign-key``): each export signed beside it, ``OUT.sig``.
    ``password``: of an encrypted ``private_key`` (see :func:`key_password`); never shown."""

    private_key: str | Path | None = None
    signing_certificate: str | Path | None = None
    certificate_chain: tuple[str | Path, ...] = ()
    keyless: bool = False
    password: bytes | None = field(default=None, repr=False)

    def check(self, out: str | Path) -> Path:
        """:func:`check_sign_inputs` of this request for the export at ``out``; its signature's path."""
        return check_sign_inputs(out, self.private_key, signing_certificate=self.signing_certificate,
                                 certificate_chain=self.certificate_chain, keyless=self.keyless)

    def sign(self, out: str | Path) -> Signed:
        return sign_export(out, self.private_key, signing_certificate=self.signing_certificate,
                           certificate_chain=self.certificate_chain, keyless=self.keyless, password=self.password)


def _hashing(inside: str | None = None) -> Any:
    """Every file of the export is signed: no path ignored (git's files neither), no link followed;
    but the signature itself when it lies at the export's top (``inside``: its name), as
    ``model_signing sign`` leaves out its own signature."""
    from model_signing import hashing

    return (hashing.Config().set_ignored_paths(paths=[inside] if inside else [], ignore_git_paths=False)
            .set_allow_symlinks(False))


@dataclass(frozen=True)
class Signed:
    """What :func:`sign_export` wrote: the signature's path and who signed (key or certificate)."""

    signature: Path
    signer: str
    files: int
    info: dict[str, str] = field(default_factory=dict)  # signer_info(): method, key_sha256 or subject...


def sign_export(out: str | Path, private_key: str | Path | None = None, signature: str | Path | None = None, *,
                signing_certificate: str | Path | None = None, certificate_chain: Sequence[str | Path] = (),
                keyless: bool = False, password: str | bytes | None = None) -> Signed:
    """Sign the export at ``out`` (every file, ``manifest.json`` included) with model-signing.

    ``private_key``: an elliptic-curve private key (PEM; ``password`` if it is encrypted); with
    ``signing_certificate`` (and ``certificate_chain``) the certificate signer. ``keyless``:
    Sigstore's OIDC flow instead (network). The signature goes to ``signature`` or ``OUT.sig``; a
    ``signature`` at the export's top (``OUT/model.sig``) is left out of what it signs, as
    ``model_signing sign`` does. It is written whole (a failed signing leaves no file). The key and
    certificates are read once (:func:`read_input`) and model-signing is given those bytes. The
    export is not checked here: the ``sign`` command verifies it first.

    Raises:
        InputError: the extra is missing, a key or certificate is missing, refused or unusable,
            the signature path is refused (:func:`signature_path`) or is a file the manifest lists,
            or the signature would be larger than :data:`MAX_SIGNATURE_BYTES`.
    """
    path = check_sign_inputs(out, private_key, signature, signing_certificate=signing_certificate,
                             certificate_chain=certificate_chain, keyless=keyless)
    inside = inside_export(out, path)
    if inside is not None:
        _not_listed(out, inside)
    key = None if private_key is None else read_input("--sign-key", private_key)
    cert = None if signing_certificate is None else read_input("--signing-certificate", signing_certificate)
    chain = [read_input("--certificate-chain", c) for c in certificate_chain]
    import model_signing

    config = model_signing.signing.Config().set_hashing_config(_hashing(inside))
    what = "Sigstore (keyless)" if keyless else f"--sign-key {private_key}"
    try:
        with _Handoff() as hand:
            if keyless:
                config.use_sigstore_signer()
            elif cert is not None:
                config.use_certificate_signer(private_key=hand.give(key), signing_certificate=hand.give(cert),
                                              certificate_chain=[hand.give(c) for c in chain])
            else:
                # cryptography takes the password as bytes (model-signing passes it on as given)
                secret = password.encode("utf-8") if isinstance(password, str) else password
                config.use_elliptic_key_signer(private_key=hand.give(key), password=secret)
            made = hand.blank()
            config.sign(Path(out), made)
            data = hand.taken(made, f"cannot sign {out}")
        _write_signature(path, data)
    except (ValueError, TypeError, OSError) as e:
        raise InputError(f"cannot sign {out} with {what}: {type(e).__name__}: {e}") from e
    bundle = _parse_bundle(path, data)
    info = signer_info(bundle)
    return Signed(path, describe_signer(info), len(_signed_files(bundle)), info)


# --------------------------------------------------------------------------------------------- checking


@dataclass
class SignatureCheck:
    """What :func:`verify_signature` found: the problems (each naming a file or the reason), who
    signed, and the files the signature covers (path -> sha256)."""

    signature: Path
    signer: str = ""
    files: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)  # signer_info(): method, key_sha256 or subject...

    def to_json(self) -> dict[str, Any]:
        """The ``signature`` entry of a report: path, passed, signer (text and fields), files signed, problems."""
        return {"path": str(self.signature), "passed": self.passed, "signer": self.signer, **self.info,
                "files": len(self.files), "problems": list(self.problems)}

    @property
    def passed(self) -> bool:
        return not self.problems


def _verifier(hand: _Handoff, public_key: bytes | None, certificate_chain: Sequence[bytes], identity, issuer,
              inside: str | None) -> Any:
    import model_signing

    config = model_signing.verifying.Config().set_hashing_config(_hashing(inside))
    if identity is not None:
        return config.use_sigstore_verifier(identity=identity, oidc_issuer=issuer)
    if public_key is not None:
        return config.use_elliptic_key_verifier(public_key=hand.give(public_key))
    return config.use_certificate_verifier(certificate_chain=[hand.give(c) for c in certificate_chain])


def check_verify_inputs(out: str | Path, signature: str | Path | None = None, public_key: str | Path | None = None,
                        certificate_chain: Sequence[str | Path] = (), identity: str | None = None,
                        issuer: str | None = None) -> Path:
    """The cheap checks of a signature check, made before any work: the extra is installed, one
    way to check is given, the signature (:func:`find_signature`) and key files are regular files
    within their limits (not read yet). Returns the signature's path."""
    check_verify_request(public_key, certificate_chain, identity, issuer)
    path = find_signature(out, signature)
    try:
        check_input("signature", path)
    except InputError as e:
        if signature or os.path.lexists(path):
            raise
        raise InputError(f"{e} (nor {Path(out) / STANDARD_NAME}, inside the export)") from None
    return path


def check_verify_request(public_key: str | Path | None = None, certificate_chain: Sequence[str | Path] = (),
                         identity: str | None = None, issuer: str | None = None) -> None:
    """The checks of a signature check that need no export: the extra is installed, one way to
    check is given, the key and certificate files are regular files within their limits."""
    require_signing("checking an export's signature")
    if (identity is None) != (issuer is None):
        raise InputError("keyless signatures are checked with --identity and --identity-issuer, both")
    if identity is None and public_key is None and not certificate_chain:
        raise InputError("check a signature with --public-key KEY, --certificate-chain PEM, or --identity and "
                         "--identity-issuer (keyless)")
    if public_key is not None:
        check_key("--public-key", public_key, "public")
    for chain in certificate_chain:
        check_input("--certificate-chain", chain)


_PEM_LABEL = re.compile(rb"-----BEGIN ([A-Z0-9 ]{1,40})-----")


def key_kind(data: bytes) -> str | None:
    """What a PEM file holds, by its first ``-----BEGIN ...-----`` line: ``private`` (a private key,
    encrypted or not), ``public``, ``certificate``, or ``None`` (no PEM label)."""
    match = _PEM_LABEL.search(data[:MAX_KEY_BYTES])
    if match is None:
        return None
    label = match.group(1).decode("ascii")
    if label.endswith("PRIVATE KEY"):
        return "private"
    if label.endswith("PUBLIC KEY"):
        return "public"
    return "certificate" if "CERTIFICATE" in label else label.lower()


def check_key(flag: str, path: str | Path, want: str, elliptic: bool = True) -> None:
    """The key file ``path`` given as ``flag`` holds the kind of key the flag takes (``want``:
    ``private`` for ``--sign-key``, ``public`` for ``--public-key``), an elliptic-curve one
    (unless not ``elliptic``: a certificate's key is model-signing's to judge), decided from the
    file before any work (a swapped pair is the common mistake).

    Raises:
        InputError: it cannot be read (:func:`read_input`), or holds another kind of key, a
            certificate, no PEM at all, or a key that is not elliptic-curve, said in one line.
    """
    data = read_input(flag, path)
    kind = key_kind(data)
    other = "--public-key" if want == "private" else "--sign-key"
    if kind is None:
        raise InputError(f"{flag} {path}: not a PEM key file (no -----BEGIN ...----- line); {flag} takes the "
                         f"{want} key of an elliptic-curve pair, PEM")
    if kind in ("private", "public") and kind != want:  # the pair swapped
        raise InputError(f"{flag} {path} is a {kind} key, not the {want} one ({other} takes it)")
    if kind != want:
        raise InputError(f"{flag} {path} holds a {kind}, not a {want} key (PEM)")
    if not elliptic:
        return
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        key = (serialization.load_pem_public_key(data) if want == "public"
               else serialization.load_pem_private_key(data, None))
    except TypeError:  # an encrypted private key: its password is asked for (or read) next
        return
    except (ValueError, UnsupportedAlgorithm) as e:
        reason = " ".join(str(e).split())[:120]
        raise InputError(f"{flag} {path}: not a readable {want} key ({reason})") from None
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        algorithm = type(key).__name__.removeprefix("_").replace("PrivateKey", "").replace("PublicKey", "")
        raise InputError(f"{flag} {path} is an {algorithm} key; model signing takes an elliptic-curve key (PEM)")


def verify_signature(out: str | Path, signature: str | Path | None = None, public_key: str | Path | None = None,
                     certificate_chain: Sequence[str | Path] = (), identity: str | None = None,
                     issuer: str | None = None) -> SignatureCheck:
    """Check the signature of the export at ``out`` (``signature``, else :func:`find_signature`'s:
    ``OUT.sig``, else ``OUT/model.sig``).

    First model-signing checks the signature (with ``public_key``; or a certificate signature
    against ``certificate_chain``; or a keyless one against the signer's ``identity`` and OIDC
    ``issuer``, which needs the network) and every file's digest. Then the files signed must be
    exactly the export as ``manifest.json`` lists it, plus ``manifest.json``, with the manifest's
    sha256s, and every file of the export must be signed: an unsigned, missing or extra file is
    named. A signature at the export's top is the one file left out of both (it cannot sign itself).
    The signature, key and certificates are read once each (:func:`read_input`) and model-signing
    is given those bytes.

    Raises:
        InputError: the extra is missing, no way to check was given, the signature file or a key
            cannot be read (missing, a symbolic link, not a regular file, over its size limit).
    """
    path = check_verify_inputs(out, signature, public_key, certificate_chain, identity, issuer)
    inside = inside_export(out, path)
    data = read_input("signature", path)
    key = None if public_key is None else read_input("--public-key", public_key)
    chain = [read_input("--certificate-chain", c) for c in certificate_chain]
    check = SignatureCheck(path)
    with _Handoff() as hand:
        try:
            config = _verifier(hand, key, chain, identity, issuer, inside)
        except (ValueError, TypeError, OSError) as e:
            raise InputError(f"cannot check a signature with {public_key or list(certificate_chain) or identity}: "
                             f"{type(e).__name__}: {e}") from e
        try:
            config.verify(Path(out), hand.give(data))
        except Exception as e:  # the library refuses a signature with many exception types
            reasons = (_differences(Path(out), _signed_files(_parse_bundle(path, data)), inside)
                       if str(e).startswith("Signature mismatch") else [])
            check.problems.append(f"signature {path.name} does not match the export: "
                                  f"{'; '.join(reasons) or _reason(e)}")
            return check
    bundle = _parse_bundle(path, data)
    check.info = signer_info(bundle)
    check.signer, check.files = describe_signer(check.info), _signed_files(bundle)
    check.problems += _cross_check(Path(out), check.files, inside)
    return check


def _reason(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 600 else text[:600] + "..."


def _differences(out: Path, signed: dict[str, str | None], inside: str | None) -> list[str]:
    """Each file of the export that is not as ``signed`` (after the library found the signature
    itself good and the files different), named; the signature at the top (``inside``) is none."""
    found = manifest.scan(out)
    present = {p: size for p, size in found.files.items() if p != inside}
    if (out / manifest.MANIFEST).is_file() and not (out / manifest.MANIFEST).is_symlink():
        present[manifest.MANIFEST] = 0
    problems = [f"{p} is a {kind}, not a signed file" for p, kind in sorted(found.special.items())]
    problems += [f"missing file {p} (signed)" for p in sorted(signed.keys() - present.keys() - found.special.keys())]
    problems += [f"extra file {p} (not signed)" for p in sorted(present.keys() - signed.keys())]
    for p in sorted(present.keys() & signed.keys()):
        if signed[p] is not None and manifest.sha256(out / p) != signed[p]:
            problems.append(f"changed file {p} (its sha256 is not the signed one)")
    return problems


def _cross_check(out: Path, signed: dict[str, str], inside: str | None) -> list[str]:
    """What is wrong with the files signed, against the export's manifest and its files: a file
    the signature leaves out (model-signing skips what the bundle says it ignored) is named too."""
    doc = manifest.read_manifest(out)
    listed = {f["path"]: f["sha256"] for f in doc["files"]}
    problems = [f"unsigned file {p} (listed in the manifest, not covered by the signature)"
                for p in sorted(listed.keys() - signed.keys())]
    if manifest.MANIFEST not in signed:
        problems.append(f"unsigned file {manifest.MANIFEST} (the signature does not cover the manifest)")
    problems += [f"signed file {p} is not in the manifest" for p in sorted(signed.keys() - listed.keys())
                 if p != manifest.MANIFEST]
    problems += [f"changed file {p} (the signed sha256 is not the manifest's)" for p in sorted(signed.keys() & listed.keys())
                 if signed[p] is not None and signed[p] != listed[p]]
    present = manifest.scan(out).files.keys() - {inside} - listed.keys()  # the listed ones are named above
    problems += [f"extra file {p} (not signed: the signature leaves it out)" for p in sorted(present - signed.keys())]
    return problems


def _parse_bundle(path: Path, data: bytes) -> dict[str, Any]:
    """The Sigstore bundle ``data`` (read from ``path``, which names it in errors)."""
    try:
        bundle = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"signature {path}: not a Sigstore bundle ({e})") from e
    if not isinstance(bundle, dict):
        raise InputError(f"signature {path}: not a Sigstore bundle")
    return bundle


def _signed_files(bundle: dict[str, Any]) -> dict[str, str | None]:
    """The resources of the bundle's in-toto statement: path -> sha256 (``None`` for another hash)."""
    try:
        statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
        resources = statement["predicate"]["resources"]
        return {r["name"]: (r["digest"] if r.get("algorithm") == "sha256" else None) for r in resources}
    except (KeyError, TypeError, ValueError, binascii.Error) as e:
        raise InputError(f"the signature's in-toto statement lists no resources ({type(e).__name__}: {e})") from e


# the OIDC issuer of a Sigstore (Fulcio) certificate: the current extension (a DER UTF8String), the old one (raw)
_FULCIO_ISSUER = ("1.3.6.1.4.1.57264.1.8", "1.3.6.1.4.1.57264.1.1")


def _fulcio_issuer(cert: Any) -> str:
    for oid in _FULCIO_ISSUER:
        for ext in cert.extensions:
            if ext.oid.dotted_string == oid:
                raw = getattr(ext.value, "value", b"")
                if oid == _FULCIO_ISSUER[0] and raw[:1] == b"\x0c" and len(raw) > 2:  # UTF8String, short length
                    raw = raw[2:]
                return raw.decode("utf-8", errors="replace")
    return ""


def signer_info(bundle: dict[str, Any]) -> dict[str, str]:
    """Who signed and with what, from the bundle, for reports: ``method`` ``key`` (with
    ``key_sha256``, model-signing's hint of the public key), ``certificate`` (``subject``,
    ``identity``: the subject alternative names, ``certificate_sha256``) or ``sigstore`` (a Fulcio
    certificate: ``identity``, ``issuer``, ``subject``, ``certificate_sha256``)."""
    material = bundle.get("verificationMaterial") or {}
    hint = (material.get("publicKey") or {}).get("hint")
    if hint:
        return {"method": "key", "key_sha256": str(hint)}
    certs = (material.get("x509CertificateChain") or {}).get("certificates") or [material.get("certificate") or {}]
    raw = certs[0].get("rawBytes") if certs and isinstance(certs[0], dict) else None
    if not raw:
        return {"method": "unknown"}
    from cryptography import x509

    der = base64.b64decode(raw)
    cert = x509.load_der_x509_certificate(der)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        alt = ", ".join(str(getattr(n, "value", n)) for n in names)
    except x509.ExtensionNotFound:
        alt = ""
    issuer = _fulcio_issuer(cert)
    info = {"method": "sigstore" if issuer else "certificate", "subject": cert.subject.rfc4514_string(),
            "identity": alt, "certificate_sha256": hashlib.sha256(der).hexdigest()}
    return {**info, "issuer": issuer} if issuer else info


def describe_signer(info: dict[str, str]) -> str:
    """One line naming the signer (:func:`signer_info`): "public key sha256:..." or "certificate CN=... (SANs), sha256:..."."""
    if info.get("method") == "key":
        return f"public key sha256:{info['key_sha256']}"
    if info.get("method") not in ("certificate", "sigstore"):
        return "unknown signer"
    alt = f" ({info['identity']})" if info.get("identity") else ""
    by = f" issued by {info['issuer']}" if info.get("issuer") else ""
    what = "Sigstore certificate" if info["method"] == "sigstore" else "certificate"
    return f"{what} {info.get('subject') or '(empty subject)'}{alt}{by}, sha256:{info['certificate_sha256']}"

