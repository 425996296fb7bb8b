"""The one door for an ONNX file this package did not write (exporter/formats/onnx/trust.py):
hostile external data, links and sizes, tried on every route that opens such a file (``inspect``,
``verify --candidate``, ``verify MODEL.onnx --reference``), with a FIFO outside the model's folder as the tripwire: a route that
opened it would block (and the test time out) instead of answering at once."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import spec_exports
from helpers import cli, one_line_error, snapshot


@pytest.fixture(scope="module")
def external(tmp_path_factory) -> Path:
    """An export whose model keeps its weights as external data (``model.onnx.data``)."""
    return spec_exports(tmp_path_factory, "door", {"formats": ["onnx"], "samples": 32, "explore_samples": 0,
                                                    "external_data_threshold": 1024})("image_uint8")[1]


def _hostile(external: Path, folder: Path, change) -> Path:
    """A copy of the export's model in ``folder`` (with its data file), rewritten by ``change(model, folder)``."""
    folder.mkdir(parents=True)
    shutil.copy(external / "model.onnx.data", folder / "model.onnx.data")
    model = onnx.load(str(external / "model.onnx"), load_external_data=False)
    change(model, folder)
    target = folder / "model.onnx"
    if not target.is_symlink():
        target.write_bytes(model.SerializeToString())
    return target


def _set(model, key: str, value: str, index: int = 0) -> None:
    tensor = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL][index]
    entries = {e.key: e for e in tensor.external_data}
    if key in entries:
        entries[key].value = value
    else:
        tensor.external_data.add(key=key, value=value)


def _tripwire(tmp_path: Path) -> Path:
    fifo = tmp_path / "outside.data"
    os.mkfifo(fifo)
    return fifo


def _linked(kind: str):
    def change(model, folder):
        outside = folder.parent / "outside.data"
        (folder / "model.onnx.data").unlink()
        if kind == "symlink":
            (folder / "model.onnx.data").symlink_to(outside)
        else:
            real = folder.parent / "real.data"
            shutil.copy(folder.parent / "keep.data", real)
            os.link(real, folder / "model.onnx.data")
    return change


def _model_link(model, folder):
    (folder.parent / "elsewhere.onnx").write_bytes(model.SerializeToString())
    (folder / "model.onnx").symlink_to(folder.parent / "elsewhere.onnx")


CASES = {
    "data through a symbolic link out of the folder": (_linked("symlink"), "symbolic link is not followed"),
    "data as a second name of another file": (_linked("hardlink"), "has 2 names"),
    "data at ../": (lambda m, f: _set(m, "location", "../outside.data"), "not in a file beside the model"),
    "data at an absolute path": (lambda m, f: _set(m, "location", str(f.parent / "outside.data")),
                                 "not in a file beside the model"),
    "an offset past the file": (lambda m, f: _set(m, "offset", str(10 ** 9)), "beyond the end of 'model.onnx.data'"),
    "a 2 GiB length over a small file": (lambda m, f: _set(m, "length", str(2 << 30)),
                                         "beyond the end of 'model.onnx.data'"),
    "a key ONNX does not define": (lambda m, f: _set(m, "basepath", "/"), "that ONNX does not define"),
    "the model through a symbolic link": (_model_link, "is a symbolic link; refusing to follow it"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("route", ["inspect", "verify --candidate", "verify --reference"])
def test_hostile_external_data_is_refused_on_every_route_with_nothing_outside_opened(
        external, tmp_path, case, route):
    change, fragment = CASES[case]
    _tripwire(tmp_path)
    (tmp_path / "keep.data").write_bytes(os.urandom(512 << 10))
    model = _hostile(external, tmp_path / "m", change)
    before = snapshot(tmp_path, skip=("outside.data", "ref.npz"))
    start = time.monotonic()
    if route == "inspect":
        done = cli("inspect", str(model))
    elif route == "verify --reference":
        np.savez(tmp_path / "ref.npz", observations=np.zeros((2, 1), np.float32))
        done = cli("verify", str(model), "--reference", str(tmp_path / "ref.npz"))
    else:
        done = cli("verify", str(external), "--candidate", f"onnx={model}", "--samples", "8")
    elapsed = time.monotonic() - start
    if route != "verify --candidate":
        one_line_error(done, 2, fragment)
    else:  # verify names the candidate in its report and fails it
        assert done.returncode in (1, 2), done.stderr[-2000:]
        assert fragment in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]
        assert "Traceback" not in done.stderr
    assert elapsed < 60
    assert snapshot(tmp_path, skip=("outside.data", "ref.npz")) == before


def test_a_fifo_as_the_model_does_not_hang(tmp_path):
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    one_line_error(cli("inspect", str(fifo)), 2, "is not an export directory, a .onnx file")


def test_a_graph_over_the_node_budget_is_refused_before_the_checker(tmp_path, monkeypatch):
    from policy_export.errors import DeclaredSizeError
    from policy_export.exporter.formats.onnx import trust

    nodes = [onnx.helper.make_node("Identity", [f"t{i}"], [f"t{i + 1}"]) for i in range(40)]
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("t0", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("t40", onnx.TensorProto.FLOAT, [1])])
    path = tmp_path / "chain.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    trust.check_file(path)
    monkeypatch.setattr(trust, "NODE_LIMIT", 32)
    with pytest.raises(DeclaredSizeError, match="more than 32 nodes"):
        trust.check_file(path)


def test_an_onnx_older_than_1_21_is_refused_where_the_stack_allows_1_21(tmp_path, monkeypatch):
    from policy_export.errors import ExportError
    from policy_export.exporter.formats.onnx import trust

    monkeypatch.setattr(trust.onnx, "__version__", "1.18.0")
    monkeypatch.setattr(trust, "stack_allows_safe_onnx", lambda: True)
    with pytest.raises(ExportError, match=r"onnx 1.18.0 is older than 1.21.*pip install 'onnx>=1.21'"):
        trust.check_file(tmp_path / "any.onnx")
    monkeypatch.setattr(trust, "stack_allows_safe_onnx", lambda: False)  # TF 2.15-2.18: ml_dtypes below 0.5
    with pytest.raises(ExportError, match="does not exist"):
        trust.check_file(tmp_path / "any.onnx")


def test_a_fresh_install_of_the_newest_stack_has_onnx_1_21_or_later():
    from policy_export.exporter.formats.onnx import trust

    if not trust.stack_allows_safe_onnx():
        pytest.skip(f"this TensorFlow pins ml_dtypes below 0.5, which onnx >= 1.21 needs (onnx {onnx.__version__})")
    assert trust.onnx_release() >= trust.SAFE_ONNX, onnx.__version__
