"""Hostile inputs to the serving formats: OpenVINO IR directories (``verify --candidate openvino=DIR``),
Triton repositories and TF Serving base paths (``verify``, ``verify --candidate``, ``inspect``, ``diff``).

Every file read may be hostile. Each attack must end in the package's own error (``inspect``/``diff``
and candidate-path refusals: exit 2; a format of ``verify`` that is refused: its failure, exit 1),
never an internal error (exit 3), a crash, a hang or a huge allocation, and nothing outside the
given directory may be read or changed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import cli, messages
from helpers import resign, snapshot

INTERNAL = 3


def _no_internal_error(proc) -> None:
    assert proc.returncode != INTERNAL and "internal error" not in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def _refused(proc, code: int, fragment: str) -> None:
    """``proc`` ended with ``code`` and ``fragment`` in its output, and no internal error."""
    _no_internal_error(proc)
    text = proc.stdout + proc.stderr
    assert proc.returncode == code, (proc.returncode, text[-3000:])
    assert fragment in " ".join(text.split()), text[-3000:]


def _inspect_refused(proc, fragment: str) -> None:
    """``inspect``/``diff``: exit 2 and one line on stderr naming the problem."""
    _refused(proc, 2, fragment)
    assert len(messages(proc.stderr)) == 1, proc.stderr


def _triton_schema():
    try:
        from tritonclient.grpc import model_config_pb2  # noqa: F401
    except ImportError as e:  # the serving extra is not installed
        pytest.skip(f"tritonclient[grpc] is not installed (the serving extra): {e}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One export of cartpole_mlp with the SavedModel and the three serving formats."""
    pytest.importorskip("openvino", reason="OpenVINO is not installed in this environment")
    from conftest import FIXTURES_DIR
    from policy_export.exporter import export_spec

    out = tmp_path_factory.mktemp("serving") / "export"
    export_spec(FIXTURES_DIR / "cartpole_mlp", out, device="cpu", samples=50, explore_samples=0,
                formats=["saved_model", "openvino", "triton", "tf_serving"])
    return out


@pytest.fixture
def outside(tmp_path):
    """A directory beside the one under attack; tests assert it is left as it was."""
    d = tmp_path / "outside"
    d.mkdir()
    return d


def _copy(served: Path, tmp_path: Path, name: str = "copy") -> Path:
    dest = tmp_path / name
    shutil.copytree(served, dest, symlinks=True)
    return dest


def _tamper(export: Path, edit) -> None:
    """Edit the manifest and re-sign its file list: what an attacker without the pinned digest can do."""
    doc = json.loads((export / "manifest.json").read_text())
    edit(doc)
    (export / "manifest.json").write_text(json.dumps(doc))
    resign(export)


def _triton_model(served: Path, tmp_path: Path, config: bytes | None = None) -> Path:
    d = tmp_path / "model"
    shutil.copytree(served / "triton" / "cartpole_mlp", d)
    if config is not None:
        (d / "config.pbtxt").write_bytes(config)
    return d


def _base_path(served: Path, tmp_path: Path, versions) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    for v in versions:
        shutil.copytree(served / "tf_serving" / "cartpole_mlp" / "1", base / v)
    return base


# ------------------------------------------------------------------------------------- inspect / diff: Triton


def test_inspect_triton_config_sound(served):
    _triton_schema()
    proc = cli("inspect", "--json", str(served / "triton" / "cartpole_mlp"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kind"] == "triton"


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_inspect_config_not_a_regular_file_is_refused(served, tmp_path, kind):
    _triton_schema()
    d = _triton_model(served, tmp_path)
    cfg = d / "config.pbtxt"
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)  # opening it for reading would hang
    elif kind == "dev_zero":
        cfg.symlink_to("/dev/zero")  # reading it would never end
    else:
        cfg.mkdir()
    _inspect_refused(cli("inspect", str(d)), "is not an export directory, a .onnx file, a SavedModel directory")


def test_inspect_config_over_limit_is_refused_unread(served, tmp_path):
    _triton_schema()
    d = _triton_model(served, tmp_path)
    with open(d / "config.pbtxt", "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB declared, nothing on disk
    _inspect_refused(cli("inspect", str(d)), "1073741824 bytes, over 1048576 bytes")


@pytest.mark.parametrize("config", [
    pytest.param(b'name: "\xff\xfe"\n', id="not-utf8"),
    pytest.param(b"optimization { " * 20000 + b"}" * 20000, id="deeply-nested"),
    pytest.param(b'input { name: "x" data_type: TYPE_NOPE dims: [1] }', id="unknown-enum-name"),
    pytest.param(b"\x00\x01binary", id="binary"),
])
def test_inspect_config_not_a_model_config_is_refused(served, tmp_path, config):
    _triton_schema()
    d = _triton_model(served, tmp_path, config)
    _inspect_refused(cli("inspect", str(d)), "is not a valid Triton ModelConfig")


def test_inspect_config_string_type_is_refused(served, tmp_path):
    _triton_schema()
    base = (served / "triton" / "cartpole_mlp" / "config.pbtxt").read_text()
    d = _triton_model(served, tmp_path, base.replace("TYPE_FP32", "TYPE_STRING", 1).encode())
    _inspect_refused(cli("inspect", str(d)), "has data type TYPE_STRING, which has no numpy dtype")


@pytest.mark.parametrize("command", ["inspect", "diff"])
def test_inspect_config_unknown_data_type_number_is_refused(served, tmp_path, command):
    _triton_schema()
    base = (served / "triton" / "cartpole_mlp" / "config.pbtxt").read_text()
    d = _triton_model(served, tmp_path, base.replace("TYPE_FP32", "999", 1).encode())
    args = [str(d)] if command == "inspect" else [str(d), str(served / "triton" / "cartpole_mlp")]
    _inspect_refused(cli(command, *args), "has data type 999, which has no numpy dtype")


@pytest.mark.parametrize("nested", [False, True], ids=["model-dir", "repository"])
def test_inspect_config_symlink_is_refused(served, tmp_path, outside, nested):
    _triton_schema()
    target = outside / "config.pbtxt"
    shutil.copy(served / "triton" / "cartpole_mlp" / "config.pbtxt", target)
    before = snapshot(outside)
    d = _triton_model(served, tmp_path)
    (d / "config.pbtxt").unlink()
    (d / "config.pbtxt").symlink_to(target)
    path = d.parent if nested else d
    if nested:  # a repository holding the one model: the same file is reached through serving_layout's inner walk
        repo = tmp_path / "repo"
        repo.mkdir()
        d.rename(repo / "model")
        path = repo
    _inspect_refused(cli("inspect", str(path)), "cannot be read as a regular file")
    assert snapshot(outside) == before


# ------------------------------------------------------------------------------------- inspect / diff: TF Serving


def test_inspect_base_path_ignores_linked_version(served, tmp_path):
    base = _base_path(served, tmp_path, ["1"])
    (base / "5").symlink_to("/", target_is_directory=True)  # a "newer" version that is a link to /
    from policy_export.exporter.inspection import serving_layout

    assert serving_layout(base) == ("tf_serving", base / "1")
    proc = cli("inspect", "--json", str(base))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kind"] == "tf_serving"


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_inspect_version_saved_model_pb_not_regular(served, tmp_path, outside, kind):
    base = tmp_path / "base"
    (base / "7").mkdir(parents=True)
    pb = base / "7" / "saved_model.pb"
    if kind == "symlink":
        shutil.copy(served / "saved_model" / "saved_model.pb", outside / "saved_model.pb")
        pb.symlink_to(outside / "saved_model.pb")
        fragment = "Too many levels of symbolic links"
    else:
        os.mkfifo(pb)
        fragment = "is not an export directory, a .onnx file, a SavedModel directory"
    before = snapshot(outside)
    _inspect_refused(cli("inspect", str(base)), fragment)
    assert snapshot(outside) == before


@pytest.mark.parametrize("command", ["inspect", "diff"])
def test_inspect_non_ascii_digit_version_is_not_a_version(served, tmp_path, command):
    base = _base_path(served, tmp_path, ["\u00b2"])
    args = [str(base)] if command == "inspect" else [str(base), str(served)]
    _inspect_refused(cli(command, *args), "is not an export directory, a .onnx file, a SavedModel directory")


@pytest.mark.parametrize("name", ["999999999999999999999", "\u0663"])
def test_inspect_version_tf_serving_would_skip_is_not_newest(served, tmp_path, name):
    from policy_export.exporter.inspection import serving_layout

    base = _base_path(served, tmp_path, ["1", name])
    assert serving_layout(base) == ("tf_serving", base / "1")


# ------------------------------------------------------------------------------------- verify: tampered manifest


@pytest.mark.parametrize("model", ["../saved_model/saved_model.pb", "/etc/passwd", "cartpole_mlp/../../manifest.json"])
def test_verify_triton_model_path_outside_is_refused(served, tmp_path, model):
    copy = _copy(served, tmp_path)
    _tamper(copy, lambda d: d["formats"]["triton"]["models"]["cartpole_mlp"].__setitem__("model", model))
    _refused(cli("verify", str(copy)), 1, "is not a path inside")


def test_verify_triton_linked_model_is_not_loaded(served, tmp_path, outside):
    copy = _copy(served, tmp_path)
    shutil.copy(served / "triton" / "cartpole_mlp" / "1" / "model.onnx", outside / "model.onnx")
    before = snapshot(outside)
    model = copy / "triton" / "cartpole_mlp" / "1" / "model.onnx"
    model.unlink()
    model.symlink_to(outside / "model.onnx")
    proc = cli("verify", str(copy))
    _refused(proc, 1, "a symbolic link, not a regular file")
    assert "not loaded: its files failed the hash check" in proc.stdout + proc.stderr
    assert snapshot(outside) == before


@pytest.mark.parametrize("fmt,target", [("triton", "triton/cartpole_mlp"), ("tf_serving", "tf_serving/cartpole_mlp")])
def test_verify_linked_model_directory_is_not_loaded(served, tmp_path, outside, fmt, target):
    copy = _copy(served, tmp_path)
    shutil.copytree(copy / target, outside / "model")
    shutil.rmtree(copy / target)
    (copy / target).symlink_to(outside / "model", target_is_directory=True)
    before = snapshot(outside)
    _refused(cli("verify", str(copy)), 1, f"changed file {target} (a symbolic link")
    assert snapshot(outside) == before


def test_verify_triton_config_fifo_does_not_hang(served, tmp_path):
    copy = _copy(served, tmp_path)
    cfg = copy / "triton" / "cartpole_mlp" / "config.pbtxt"
    cfg.unlink()
    os.mkfifo(cfg)
    _refused(cli("verify", str(copy)), 1, "changed file triton/cartpole_mlp/config.pbtxt (a FIFO")


@pytest.mark.parametrize("field,value,fragment", [
    ("model_name", "../saved_model", "is not a legal model name"),
    ("model_name", ["x"], "is not a legal model name"),
    ("model_version", 999999999999999999999, "is not an integer from 1 to"),
    ("model_version", 1.0, "is not an integer from 1 to"),
    ("model_version", True, "is not an integer from 1 to"),
])
def test_verify_tf_serving_record_is_checked(served, tmp_path, field, value, fragment):
    copy = _copy(served, tmp_path)
    _tamper(copy, lambda d: d["formats"]["tf_serving"].__setitem__(field, value))
    _refused(cli("verify", str(copy)), 1, fragment)


@pytest.mark.parametrize("models", [[1], {}, "x"])
def test_verify_triton_models_not_an_object_is_refused(served, tmp_path, models):
    copy = _copy(served, tmp_path)
    _tamper(copy, lambda d: d["formats"]["triton"].__setitem__("models", models))
    _refused(cli("verify", str(copy)), 1, "the manifest lists no Triton models")


@pytest.mark.parametrize("field,value", [
    (None, "not a record"),
    ("max_batch_size", None),
    ("states", [5]),
    ("outputs", [[1]]),
    ("model", 5),
])
def test_verify_triton_malformed_model_record_is_refused(served, tmp_path, field, value):
    copy = _copy(served, tmp_path)

    def edit(doc):
        models = doc["formats"]["triton"]["models"]
        if field is None:
            models["cartpole_mlp"] = value
        else:
            models["cartpole_mlp"][field] = value

    _tamper(copy, edit)
    _refused(cli("verify", str(copy)), 1, "triton model record")


def test_verify_pinned_manifest_loads_nothing(served, tmp_path):
    """With the digest pinned, a re-signed manifest whose record points elsewhere loads nothing."""
    from policy_export.exporter.manifest import manifest_sha256

    pin = manifest_sha256(served)
    copy = _copy(served, tmp_path)
    _tamper(copy, lambda d: d["formats"]["triton"]["models"].__setitem__("cartpole_mlp", "x"))
    proc = cli("verify", str(copy), "--expect-manifest-sha256", pin)
    _refused(proc, 1, "changed file manifest.json")
    assert "nothing was loaded" in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------- verify --candidate triton / tf_serving


@pytest.mark.parametrize("what", ["model-dir", "model-file"])
def test_candidate_triton_links_are_refused(served, tmp_path, outside, what):
    cand = tmp_path / "candidate"
    shutil.copytree(served / "triton", cand)
    if what == "model-dir":
        shutil.move(str(cand / "cartpole_mlp"), str(outside / "cartpole_mlp"))
        (cand / "cartpole_mlp").symlink_to(outside / "cartpole_mlp", target_is_directory=True)
    else:
        shutil.move(str(cand / "cartpole_mlp" / "1" / "model.onnx"), str(outside / "model.onnx"))
        (cand / "cartpole_mlp" / "1" / "model.onnx").symlink_to(outside / "model.onnx")
    before = snapshot(outside)
    _refused(cli("verify", str(served), "--candidate", f"triton={cand}"), 2, "is a symbolic link")
    assert snapshot(outside) == before


@pytest.mark.parametrize("what", ["base", "version", "variables"])
def test_candidate_tf_serving_links_are_refused(served, tmp_path, outside, what):
    cand = tmp_path / "candidate"
    shutil.copytree(served / "tf_serving", cand)
    rel = {"base": "cartpole_mlp", "version": "cartpole_mlp/1", "variables": "cartpole_mlp/1/variables"}[what]
    shutil.move(str(cand / rel), str(outside / "moved"))
    (cand / rel).symlink_to(outside / "moved", target_is_directory=True)
    before = snapshot(outside)
    _refused(cli("verify", str(served), "--candidate", f"tf_serving={cand}"), 2, "is a symbolic link")
    assert snapshot(outside) == before


def test_candidate_triton_model_fifo_does_not_hang(served, tmp_path):
    cand = tmp_path / "candidate"
    shutil.copytree(served / "triton", cand)
    model = cand / "cartpole_mlp" / "1" / "model.onnx"
    model.unlink()
    os.mkfifo(model)
    _refused(cli("verify", str(served), "--candidate", f"triton={cand}"), 2, "a candidate directory holds regular files")


# ------------------------------------------------------------------------------------- verify --candidate openvino


def _ir(served: Path, tmp_path: Path, name: str = "ir") -> Path:
    pytest.importorskip("openvino", reason="OpenVINO is not installed in this environment")
    d = tmp_path / name
    shutil.copytree(served / "openvino", d)
    return d


def _verify_ir(served: Path, ir: Path):
    return cli("verify", str(served), "--candidate", f"openvino={ir}")


def test_candidate_openvino_sound(served, tmp_path):
    proc = _verify_ir(served, _ir(served, tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


@pytest.mark.parametrize("xml,fragment", [
    pytest.param(b'<?xml version="1.0"?><!DOCTYPE net [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;&a;">]><net>&b;</net>',
                 "declares a DOCTYPE or ENTITY", id="billion-laughs"),
    pytest.param(b'<?xml version="1.0"?>\n<!-- c --><net name="x" version="11"><layers/></net>\n<!doctype x>',
                 "declares a DOCTYPE or ENTITY", id="late-lowercase-doctype"),
    pytest.param(b'<?xml version="1.0"?><net><!ENTITY x SYSTEM "file:///etc/passwd"></net>',
                 "declares a DOCTYPE or ENTITY", id="entity-without-doctype"),
    pytest.param('<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE n [<!ENTITY a "b">]><net/>'.encode("utf-16"),
                 "is not an OpenVINO IR (no <net> element at its start)", id="utf16-hides-doctype"),
    pytest.param(b"\x08\x07\x12\x04onnx", "is not an OpenVINO IR (no <net> element at its start)", id="onnx-bytes"),
])
def test_candidate_openvino_xml_refused(served, tmp_path, xml, fragment):
    ir = _ir(served, tmp_path)
    (ir / "model.xml").write_bytes(xml)
    _refused(_verify_ir(served, ir), 1, fragment)


def test_candidate_openvino_error_echoing_huge_attribute_is_clipped(served, tmp_path):
    import time

    ir = _ir(served, tmp_path)
    (ir / "model.xml").write_bytes(b'<?xml version="1.0"?><net name="x" version="11"><layers><layer id="0" name="'
                                   + b"A" * (16 << 10) + b'" type="Parameter" version="opset1"/></layers></net>')
    (ir / "model.bin").write_bytes(b"")  # what its (no) constants take: OpenVINO itself reads it
    start = time.monotonic()
    proc = _verify_ir(served, ir)
    _refused(proc, 1, "does not load")
    assert max(len(line) for line in (proc.stdout + proc.stderr).splitlines()) <= 4096
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("kind", ["dir-link", "xml-link", "bin-link", "bin-fifo", "extra-file", "missing-bin"])
def test_candidate_openvino_directory_refused(served, tmp_path, outside, kind):
    ir = _ir(served, tmp_path)
    for name in ("model.xml", "model.bin"):
        shutil.copy(ir / name, outside / name)
    before = snapshot(outside)
    if kind == "dir-link":
        shutil.rmtree(ir)
        ir.symlink_to(outside, target_is_directory=True)
        fragment = "is not an OpenVINO IR directory"
    elif kind in ("xml-link", "bin-link"):
        name = "model.xml" if kind == "xml-link" else "model.bin"
        (ir / name).unlink()
        (ir / name).symlink_to(outside / name)
        fragment = "cannot read the IR files without following links"
    elif kind == "bin-fifo":
        (ir / "model.bin").unlink()
        os.mkfifo(ir / "model.bin")
        fragment = "not a regular file"
    elif kind == "extra-file":
        (ir / "weights.bin").write_bytes(b"x")
        fragment = "beside model.xml and model.bin"
    else:
        (ir / "model.bin").unlink()
        fragment = "has no model.bin"
    _refused(_verify_ir(served, ir), 1, fragment)
    assert snapshot(outside) == before


@pytest.mark.parametrize("edit", ["truncated", "offset-beyond", "offset-wraps", "size-short", "shape-huge"])
def test_candidate_openvino_weights_not_matching_xml_refused(served, tmp_path, edit):
    """Const offsets/sizes that do not fit model.bin, or a shape its size cannot hold: OpenVINO's own
    checks refuse them (no out-of-bounds read)."""

    ir = _ir(served, tmp_path)
    xml = (ir / "model.xml").read_text()
    if edit == "truncated":
        (ir / "model.bin").write_bytes((ir / "model.bin").read_bytes()[:100])
    else:
        sub = {"offset-beyond": ('offset="1"', f'offset="{1 << 40}"'),
               "offset-wraps": ('offset="1"', f'offset="{2**64 - 8}"'),
               "size-short": ('size="256"', 'size="4"'),
               "shape-huge": ('shape="16, 4"', 'shape="1600000000000, 4"')}[edit]
        assert sub[0] in xml
        xml = xml.replace(*sub, 1)
        (ir / "model.xml").write_text(xml)
    fragment = {"truncated": "the constants of model.xml take", "offset-beyond": "outside 0..",
                "offset-wraps": "outside 0..", "size-short": "does not load",
                "shape-huge": "does not load"}[edit]
    _refused(_verify_ir(served, ir), 1, fragment)


def test_candidate_openvino_bin_larger_than_constants_refused(served, tmp_path):
    ir = _ir(served, tmp_path)
    with open(ir / "model.bin", "r+b") as f:
        f.truncate(64 << 20)  # sparse padding: nothing on disk, 64 MiB read (and copied) today
    _refused(_verify_ir(served, ir), 1, "the constants of model.xml take")


def _broadcast_ir(target) -> tuple[bytes, bytes]:
    """A tiny IR whose constant subgraph (a scalar broadcast to ``target``) OpenVINO folds at compile time."""
    def dims(shape):
        return "".join(f"<dim>{d}</dim>" for d in shape)

    n = len(target)
    layers = [
        '<layer id="0" name="observations" type="Parameter" version="opset1"><data shape="?,4" element_type="f32"/>'
        '<output><port id="0" precision="FP32" names="observations"><dim>-1</dim><dim>4</dim></port></output></layer>',
        '<layer id="1" name="one" type="Const" version="opset1"><data element_type="f32" shape="" offset="0" size="4"/>'
        '<output><port id="0" precision="FP32"/></output></layer>',
        f'<layer id="2" name="shape" type="Const" version="opset1"><data element_type="i64" shape="{n}" offset="4" '
        f'size="{8 * n}"/><output><port id="0" precision="I64"><dim>{n}</dim></port></output></layer>',
        f'<layer id="3" name="bc" type="Broadcast" version="opset3"><data mode="numpy"/><input><port id="0" '
        f'precision="FP32"/><port id="1" precision="I64"><dim>{n}</dim></port></input><output><port id="2" '
        f'precision="FP32" names="action_dist_inputs">{dims(target)}</port></output></layer>',
        f'<layer id="4" name="out" type="Result" version="opset1"><input><port id="0" precision="FP32">{dims(target)}'
        '</port></input></layer>',
    ]
    edges = [(1, 0, 3, 0), (2, 0, 3, 1), (3, 2, 4, 0)]
    xml = ('<?xml version="1.0"?>\n<net name="bomb" version="11">\n<layers>\n' + "\n".join(layers)
           + "\n</layers>\n<edges>\n"
           + "\n".join(f'<edge from-layer="{a}" from-port="{b}" to-layer="{c}" to-port="{d}"/>' for a, b, c, d in edges)
           + "\n</edges>\n</net>\n")
    return xml.encode(), np.float32(1).tobytes() + np.asarray(target, np.int64).tobytes()


def test_candidate_openvino_folding_beyond_memory_is_refused(served, tmp_path):
    """A constant far beyond memory (4 TB): refused by the tensor budget before OpenVINO allocates."""
    ir = _ir(served, tmp_path)
    xml, weights = _broadcast_ir((100000, 100000, 100))
    (ir / "model.xml").write_bytes(xml)
    (ir / "model.bin").write_bytes(weights)
    _refused(_verify_ir(served, ir), 1, "refusing to compile it")


def test_candidate_openvino_constant_folding_bomb_refused(served, tmp_path):
    ir = _ir(served, tmp_path)
    xml, weights = _broadcast_ir((1000, 1000, 40))  # 160 MB from 28 bytes of weights
    (ir / "model.xml").write_bytes(xml)
    (ir / "model.bin").write_bytes(weights)
    _refused(_verify_ir(served, ir), 1, "refusing to compile it")


def test_candidate_openvino_without_export_format(served, tmp_path):
    """An export without the openvino format still checks the candidate IR (and still refuses a bad one)."""
    copy = _copy(served, tmp_path)
    ir = _ir(served, tmp_path, "ir2")
    shutil.rmtree(copy / "openvino")
    _tamper(copy, lambda d: d["formats"].pop("openvino"))
    assert _verify_ir(copy, ir).returncode == 0
    (ir / "model.xml").write_bytes(b'<?xml version="1.0"?><!DOCTYPE x><net/>')
    _refused(_verify_ir(copy, ir), 1, "declares a DOCTYPE or ENTITY")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
