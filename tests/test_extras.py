"""A missing optional dependency is exit 2 with the extra that installs it, for every extra a
command can need: never an internal error, never a half-written export.

Each case runs the command in a fresh process where the extra's module cannot be imported
(``sys.modules[name] = None``, as if it were not installed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import FIXTURES_DIR

SPEC = FIXTURES_DIR / "cartpole_mlp"


def run_without(modules: list[str], *args: str) -> subprocess.CompletedProcess:
    code = ("import sys\n"
            f"for name in {modules!r}: sys.modules[name] = None\n"
            "from policy_export.exporter.cli import main\n"
            f"sys.exit(main({list(args)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    from policy_export.exporter import export_spec

    out = tmp_path_factory.mktemp("extras") / "cartpole"
    export_spec(SPEC, out, device="cpu", formats=["onnx"], samples=50, explore_samples=200)
    return out


def _refused(run: subprocess.CompletedProcess, extra: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert f'pip install "policy-export[{extra}]"' in run.stderr, run.stderr[-2000:]
    assert "internal error" not in run.stderr and "Traceback" not in run.stderr


def test_openvino_formats_without_openvino(tmp_path):
    for fmt in ("openvino", "openvino_bf16"):
        run = run_without(["openvino"], "export", str(SPEC), "--out", str(tmp_path / fmt), "--formats", f"onnx,{fmt}")
        _refused(run, "openvino")
        assert f"format '{fmt}' needs the module openvino, which is not installed" in run.stderr
        assert not (tmp_path / fmt).exists()


def test_an_openvino_candidate_without_openvino(small_export, tmp_path):
    (tmp_path / "ir").mkdir()
    run = run_without(["openvino"], "verify", str(small_export), "--candidate", f"openvino={tmp_path / 'ir'}")
    _refused(run, "openvino")


def test_verifying_an_export_that_holds_openvino_without_openvino(tmp_path):
    pytest.importorskip("openvino", reason="OpenVINO is not installed (the openvino extra) to write the export")
    from policy_export.exporter import export_spec

    out = tmp_path / "with_ir"
    export_spec(SPEC, out, device="cpu", formats=["onnx", "openvino"], samples=50, explore_samples=200)
    _refused(run_without(["openvino"], "verify", str(out)), "openvino")


def test_ray_without_ray(tmp_path):
    run = run_without(["ray"], "export-many", str(SPEC), "--out", str(tmp_path / "root"), "--ray", "auto")
    _refused(run, "ray")
    assert "--ray needs the module ray, which is not installed" in run.stderr


@pytest.mark.parametrize("blocked", [["pytriton"], ["tritonclient"]])
def test_serve_and_verify_server_without_the_serve_extra(small_export, blocked):
    _refused(run_without(blocked, "serve", str(small_export), "--port", "0"), "serve")
    _refused(run_without(blocked, "verify", str(small_export), "--server", "triton"), "serve")
