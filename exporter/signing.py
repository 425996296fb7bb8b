"""Signed exports: an OpenSSF Model Signing signature over a whole export directory.

The signature is made and checked by the ``model-signing`` library (the ``signing`` extra): a
Sigstore bundle whose DSSE envelope holds an in-toto statement listing every file of the export,
``manifest.json`` included, with its sha256. It is written *beside* the export (``OUT.sig`` by
default), never inside it: a file inside would be a file the manifest does not list, which
``verify`` refuses.

    from policy_export.exporter.signing import sign_export, verify_signature
    sign_export("out/cartpole", private_key="key.pem")            # writes out/cartpole.sig
    verify_signature("out/cartpole", public_key="key.pub").passed

Three ways to sign, as ``model_signing sign`` has them: an elliptic-curve private key (PEM), a
private key with its signing certificate (and chain), or keyless through Sigstore's OIDC flow (a
network service: it cannot run offline). :func:`verify_signature` first lets the library check the
signature and every file's digest, then checks that what was signed is the export as its manifest
describes it: every listed file and ``manifest.json`` signed, nothing else, with the manifest's
digests; an export signed with files left out (``--ignore-paths``) is refused by name.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
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


def require_signing(what: str) -> None:
    """Raise :class:`InputError` naming the ``signing`` extra when its libraries are missing."""
    require(MODULES, EXTRA, what)


def default_signature(out: str | Path) -> Path:
    """Where the signature of the export at ``out`` goes by default: ``OUT.sig``, beside it."""
    root = Path(os.path.abspath(out))
    return root.parent / (root.name + SUFFIX)


def signature_path(out: str | Path, signature: str | Path | None = None) -> Path:
    """The signature file of the export at ``out`` (``signature``, or ``OUT.sig``), absolute.

    Raises:
        InputError: the path is inside the export (it would be a file the manifest does not
            list) or is a directory.
    """
    root = Path(os.path.abspath(out))
    path = Path(os.path.abspath(signature)) if signature else default_signature(out)
    if path == root or root in path.parents:
        raise InputError(f"--signature-file {signature}: is inside the export {out}, where it would be a file the "
                         f"manifest does not list; keep it beside the export (default {default_signature(out)})")
    if path.is_dir():
        raise InputError(f"--signature-file {signature}: is a directory")
    return path


def _readable(what: str, path: str | Path | None) -> None:
    if path is not None and not Path(path).is_file():
        raise InputError(f"{what} {path}: no such file")


def check_sign_inputs(out: str | Path, private_key: str | Path | None, signature: str | Path | None = None, *,
                      signing_certificate: str | Path | None = None, certificate_chain: Sequence[str | Path] = (),
                      keyless: bool = False) -> Path:
    """The cheap checks of a signing request, made before any work: the extra is installed, one
    way to sign is chosen, the key and certificates exist, and the signature goes outside the
    export. Returns the signature's path."""
    if keyless == (private_key is not None):
        raise InputError("sign with --sign-key KEY (an elliptic-curve private key, PEM) or --sign-keyless "
                         "(Sigstore), one of them")
    if signing_certificate is not None and private_key is None:
        raise InputError("--signing-certificate needs --sign-key, the private key the certificate certifies")
    require_signing("signing an export")
    _readable("--sign-key", private_key)
    _readable("--signing-certificate", signing_certificate)
    for chain in certificate_chain:
        _readable("--certificate-chain", chain)
    return signature_path(out, signature)


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
        InputError: the key is encrypted and no password was given, the variable is not set, the
            password does not decrypt the key, or an encrypted key is given with
            ``--signing-certificate`` (model-signing's certificate signer takes no password).
    """
    if private_key is None:
        if password_env:
            raise InputError("--sign-key-password-env names the password of --sign-key KEY: give the key")
        return None
    data = Path(private_key).read_bytes()
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


def _hashing() -> Any:
    """Every file of the export is signed: no path ignored (git's files neither), no link followed."""
    from model_signing import hashing

    return hashing.Config().set_ignored_paths(paths=[], ignore_git_paths=False).set_allow_symlinks(False)


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
    Sigstore's OIDC flow instead (network). The signature goes to ``signature`` or ``OUT.sig``
    (written whole: a failed signing leaves no file). The export is not checked here: the
    ``sign`` command verifies it first.

    Raises:
        InputError: the extra is missing, a key or certificate is missing or unusable, or the
            signature path is inside the export.
    """
    path = check_sign_inputs(out, private_key, signature, signing_certificate=signing_certificate,
                             certificate_chain=certificate_chain, keyless=keyless)
    import model_signing

    config = model_signing.signing.Config().set_hashing_config(_hashing())
    what = "Sigstore (keyless)" if keyless else f"--sign-key {private_key}"
    partial = path.with_name(path.name + ".partial")
    try:
        if keyless:
            config.use_sigstore_signer()
        elif signing_certificate is not None:
            config.use_certificate_signer(private_key=private_key, signing_certificate=signing_certificate,
                                          certificate_chain=list(certificate_chain))
        else:
            # cryptography takes the password as bytes (model-signing passes it on as given)
            secret = password.encode("utf-8") if isinstance(password, str) else password
            config.use_elliptic_key_signer(private_key=private_key, password=secret)
        config.sign(Path(out), partial)
        os.replace(partial, path)
    except (ValueError, TypeError, OSError) as e:
        raise InputError(f"cannot sign {out} with {what}: {type(e).__name__}: {e}") from e
    finally:
        partial.unlink(missing_ok=True)
    bundle = _read_bundle(path)
    info = signer_info(bundle)
    return Signed(path, describe_signer(info), len(_signed_files(bundle)), info)


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


def _verifier(public_key, certificate_chain: Sequence[str | Path], identity, issuer) -> Any:
    import model_signing

    config = model_signing.verifying.Config().set_hashing_config(_hashing())
    if identity is not None:
        return config.use_sigstore_verifier(identity=identity, oidc_issuer=issuer)
    if public_key is not None:
        return config.use_elliptic_key_verifier(public_key=public_key)
    return config.use_certificate_verifier(certificate_chain=list(certificate_chain))


def check_verify_inputs(out: str | Path, signature: str | Path | None = None, public_key: str | Path | None = None,
                        certificate_chain: Sequence[str | Path] = (), identity: str | None = None,
                        issuer: str | None = None) -> Path:
    """The cheap checks of a signature check, made before any work: the extra is installed, one
    way to check is given, the signature and key files exist. Returns the signature's path."""
    check_verify_request(public_key, certificate_chain, identity, issuer)
    path = signature_path(out, signature)
    _readable("signature", path)
    return path


def check_verify_request(public_key: str | Path | None = None, certificate_chain: Sequence[str | Path] = (),
                         identity: str | None = None, issuer: str | None = None) -> None:
    """The checks of a signature check that need no export: the extra is installed, one way to
    check is given, the key and certificate files exist."""
    require_signing("checking an export's signature")
    if (identity is None) != (issuer is None):
        raise InputError("keyless signatures are checked with --identity and --identity-issuer, both")
    if identity is None and public_key is None and not certificate_chain:
        raise InputError("check a signature with --public-key KEY, --certificate-chain PEM, or --identity and "
                         "--identity-issuer (keyless)")
    _readable("--public-key", public_key)
    for chain in certificate_chain:
        _readable("--certificate-chain", chain)


def verify_signature(out: str | Path, signature: str | Path | None = None, public_key: str | Path | None = None,
                     certificate_chain: Sequence[str | Path] = (), identity: str | None = None,
                     issuer: str | None = None) -> SignatureCheck:
    """Check the signature of the export at ``out`` (``signature`` or ``OUT.sig``).

    First model-signing checks the signature (with ``public_key``; or a certificate signature
    against ``certificate_chain``; or a keyless one against the signer's ``identity`` and OIDC
    ``issuer``, which needs the network) and every file's digest. Then the files signed must be
    exactly the export as ``manifest.json`` lists it, plus ``manifest.json``, with the manifest's
    sha256s: an unsigned, missing or extra file is named.

    Raises:
        InputError: the extra is missing, no way to check was given, the signature file or a key
            does not exist.
    """
    path = check_verify_inputs(out, signature, public_key, certificate_chain, identity, issuer)
    check = SignatureCheck(path)
    try:
        config = _verifier(public_key, certificate_chain, identity, issuer)
    except (ValueError, TypeError, OSError) as e:
        raise InputError(f"cannot check a signature with {public_key or list(certificate_chain) or identity}: "
                         f"{type(e).__name__}: {e}") from e
    try:
        config.verify(Path(out), path)
    except Exception as e:  # the library refuses a signature with many exception types
        reasons = _differences(Path(out), path) if str(e).startswith("Signature mismatch") else []
        check.problems.append(f"signature {path.name} does not match the export: "
                              f"{'; '.join(reasons) or _reason(e)}")
        return check
    bundle = _read_bundle(path)
    check.info = signer_info(bundle)
    check.signer, check.files = describe_signer(check.info), _signed_files(bundle)
    check.problems += _cross_check(Path(out), check.files)
    return check


def _reason(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 600 else text[:600] + "..."


def _differences(out: Path, path: Path) -> list[str]:
    """Each file of the export that is not as signed, named (after the library found the signature
    itself good and the files different)."""
    signed = _signed_files(_read_bundle(path))
    found = manifest.scan(out)
    present = dict(found.files)
    if (out / manifest.MANIFEST).is_file() and not (out / manifest.MANIFEST).is_symlink():
        present[manifest.MANIFEST] = 0
    problems = [f"{p} is a {kind}, not a signed file" for p, kind in sorted(found.special.items())]
    problems += [f"missing file {p} (signed)" for p in sorted(signed.keys() - present.keys() - found.special.keys())]
    problems += [f"extra file {p} (not signed)" for p in sorted(present.keys() - signed.keys())]
    for p in sorted(present.keys() & signed.keys()):
        if signed[p] is not None and manifest.sha256(out / p) != signed[p]:
            problems.append(f"changed file {p} (its sha256 is not the signed one)")
    return problems


def _cross_check(out: Path, signed: dict[str, str]) -> list[str]:
    """What is wrong with the files signed, against the export's manifest."""
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
    return problems


def _read_bundle(path: Path) -> dict[str, Any]:
    try:
        bundle = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
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

