"""The Python API does everything the command line does: each command has its function in
``policy_export``, and the function gives what the command prints (``--json``) or does."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import FIXTURES_DIR
from helpers import cli

# each command of the command line -> the function (or class) of ``policy_export`` that does it
API_OF = {
    "export": "export_source", "convert": "export_source", "verify": "verify_export",
    "inspect": "inspect_path", "diff": "diff_exports", "rollout": "rollout", "sign": "sign_verified",
    "export-many": "export_many", "verify-many": "verify_many", "serve": "TritonServer",
    "example": "write_example", "docs": "read_docs",
}


def _commands() -> set[str]:
    import argparse

    from policy_export.exporter.cli_args import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_every_command_has_its_function_in_the_api():
    import policy_export

    commands = _commands()
    assert commands == set(API_OF), f"commands without an API function: {sorted(commands - set(API_OF))}"
    for command, name in API_OF.items():
        assert name in policy_export.__all__, (command, name)
        assert callable(getattr(policy_export, name)), (command, name)


def test_inspect_and_diff_give_what_the_commands_print(exports, tmp_path):
    from policy_export import diff_exports, inspect_path

    _, mlp = exports("cartpole_mlp")
    _, pendulum = exports("pendulum_mlp")
    for path in (mlp, mlp / "model.onnx"):
        shown = inspect_path(path)
        assert shown == json.loads(cli("inspect", str(path), "--json").stdout)
        assert shown["inputs"][0]["key"] == "observations"
    assert inspect_path(FIXTURES_DIR / "sb3" / "ppo_cartpole" / "model.zip")["algorithm"] == "PPO"
    same = diff_exports(mlp, mlp / "model.onnx")
    assert same["compatible"] and same["weights"] == json.loads(
        cli("diff", str(mlp), str(mlp / "model.onnx"), "--json").stdout)["weights"]
    other = diff_exports(mlp, pendulum)
    assert not other["compatible"] and other["breaking"] >= 1
    assert other == json.loads(cli("diff", str(mlp), str(pendulum), "--json").stdout)


def test_sign_verifies_then_signs_and_refuses_a_changed_export(exports, tmp_path):
    pytest.importorskip("model_signing", exc_type=ImportError)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from policy_export import sign_verified, verify_signature

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = tmp_path / "a.pem", tmp_path / "a.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    out = tmp_path / "exp"
    shutil.copytree(exports("cartpole_mlp")[1], out)
    result, signed = sign_verified(out, private, device="cpu")
    assert result.passed and signed is not None and signed.signature == tmp_path / "exp.sig"
    check = verify_signature(out, public_key=public)
    assert check.passed and len(check.files) == signed.files
    model = out / "model.onnx"
    model.write_bytes(model.read_bytes() + b"\0")  # verify fails: nothing is signed
    signed.signature.unlink()
    result, signed = sign_verified(out, private, device="cpu")
    assert not result.passed and signed is None and not (tmp_path / "exp.sig").exists()


def test_docs_and_example(tmp_path):
    from policy_export import read_docs, write_example

    topics = dict(read_docs())
    assert "ci-gate" in topics and read_docs("ci-gate").startswith("#")
    target = write_example(tmp_path / "ex")
    assert (target / "policy.json").is_file()
