"""Hostile Keras files for the ``keras`` format's runner: ``.keras`` archives whose members inflate
past their limits (declared or lied about), members tf-keras never writes, and model configs whose
``class_name``/``module``/``registered_name``/``function`` fields would make tf-keras build
something else than its own built-in objects. Each file is a real one written by tf-keras and then
altered, or a zip built byte by byte."""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import tensorflow as tf

from policy_export.errors import ExportError
from policy_export.exporter.formats.keras.model import MAX_ARCHIVE_MEMBERS, KerasRunner

MiB = 1 << 20


@pytest.fixture(scope="module")
def keras_files(tmp_path_factory):
    """A small functional model as tf-keras writes it (``.keras``, ``.h5``): a wrapper around a
    nested model, a TF op layer, activations, initializers and a regularizer."""
    import tf_keras as keras

    inputs = keras.Input((2, 4), name="obs")
    inner = keras.Sequential([keras.layers.Dense(3, activation="tanh", kernel_regularizer=keras.regularizers.l2(0.1))],
                             name="inner")
    x = keras.layers.Flatten()(keras.layers.TimeDistributed(inner)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(tf.concat([x, x], axis=-1)))
    root = tmp_path_factory.mktemp("keras")
    model.save(str(root / "base_model.keras"), save_format="keras")
    model.save(str(root / "base_model.h5"), save_format="h5")
    keras.backend.clear_session()
    return root


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _config(keras_files: Path) -> dict:
    return json.loads(_members(keras_files / "base_model.keras")["config.json"])


def _write_keras(path: Path, config: dict, keras_files: Path) -> Path:
    members = {**_members(keras_files / "base_model.keras"), "config.json": json.dumps(config).encode()}
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def _write_h5(path: Path, config: dict, keras_files: Path) -> Path:
    path.write_bytes((keras_files / "base_model.h5").read_bytes())
    with h5py.File(path, "r+") as f:
        f.attrs["model_config"] = json.dumps(config)
    return path


# ---------------------------------------------------------------------------------------- zip by hand

def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's ``crc32_combine``: the CRC-32 of A + B from those of A and B (``len2`` bytes)."""
    def times(matrix, vector):
        out, i = 0, 0
        while vector:
            out, vector, i = (out ^ matrix[i]) if vector & 1 else out, vector >> 1, i + 1
        return out

    def square(matrix):
        return [times(matrix, matrix[n]) for n in range(32)]

    odd = [0xEDB88320] + [1 << n for n in range(31)]
    odd = square(square(odd))  # four zero bits; the loop squares on to a byte
    while len2:
        even = square(odd)
        if len2 & 1:
            crc1 = times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = square(even)
        if len2 & 1:
            crc1 = times(odd, crc1)
        len2 >>= 1
    return crc1 ^ crc2


def _bomb(head: bytes, tail: bytes, megabytes: int) -> tuple[bytes, int, int]:
    """A raw deflate stream of ``head``, ``megabytes`` MiB of spaces and ``tail``: each part is
    flushed in full, so one compressed MiB repeats (1,038 bytes for each MiB). Returns the stream,
    its inflated size and CRC-32, computed without inflating it."""
    def part(data: bytes, last: bool = False) -> bytes:
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        return c.compress(data) + c.flush(zlib.Z_FINISH if last else zlib.Z_FULL_FLUSH)

    block, spaces = part(b" " * MiB), b" " * MiB
    crc, run, run_crc, count = zlib.crc32(head), MiB, zlib.crc32(spaces), megabytes
    while count:  # the CRC of the spaces by doubling
        if count & 1:
            crc = _crc32_combine(crc, run_crc, run)
        run_crc, run, count = _crc32_combine(run_crc, run_crc, run), run * 2, count >> 1
    crc = _crc32_combine(crc, zlib.crc32(tail), len(tail))
    return part(head) + block * megabytes + part(tail, last=True), len(head) + megabytes * MiB + len(tail), crc


def _zip(path: Path, members: list[tuple[str, bytes, int, int, int]]) -> Path:
    """A zip of ``(name, payload, method, crc, declared size)`` members: both headers say what is
    given, whatever the payload holds."""
    local, central = b"", b""
    for name, payload, method, crc, size in members:
        raw = name.encode()
        header = struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, method, 0, 0x21, crc, len(payload), size,
                             len(raw), 0)
        central += struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 20, 3, 20, 0, 0, method, 0, 0x21, crc,
                               len(payload), size, len(raw), 0, 0, 0, 0, 0o644 << 16, len(local)) + raw
        local += header + raw + payload
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(local), 0)
    path.write_bytes(local + central + end)
    return path


def _stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
    return name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data)


def _refused(path: Path, *fragments: str) -> str:
    """Open ``path`` in the runner: refused with every fragment, within 5 s and 64 MiB, nothing written."""
    before = sorted(p.name for p in path.parent.iterdir())
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ExportError) as caught:
            KerasRunner(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert all(f in message for f in fragments), message
    assert len(message) < 600
    assert time.perf_counter() - started < 5 and peak < 64 * MiB, peak
    assert sorted(p.name for p in path.parent.iterdir()) == before
    return message


# ------------------------------------------------------------------------------------ archive limits

def test_the_real_files_pass_every_check_and_run(keras_files):
    for name in ("base_model.keras", "base_model.h5"):
        with KerasRunner(keras_files / name) as runner:
            out = runner({"obs": np.ones((3, 2, 4), np.float32)})
        assert next(iter(out.values())).shape == (3, 2)


@pytest.mark.parametrize("member, megabytes", [("config.json", 1536), ("metadata.json", 64),
                                               ("model.weights.h5", 2100)])
def test_a_member_declared_past_its_limit_is_refused_before_inflating(tmp_path, keras_files, member, megabytes):
    # a config.json of 1.5 GiB of JSON whitespace: 1.6 MB on disk, honest headers and CRC
    stream, size, crc = _bomb(b'{"class_name": "Functional", "config": {}, "pad": "', b'"}', megabytes)
    real = _members(keras_files / "base_model.keras")
    members = [_stored(n, d) for n, d in real.items() if n != member] + [(member, stream, 8, crc, size)]
    path = _zip(tmp_path / "bomb.keras", members)
    assert path.stat().st_size < 3 * MiB and size > MAX_ARCHIVE_MEMBERS[member]
    _refused(path, f"member {member!r} declares {size} bytes, more than its limit of {MAX_ARCHIVE_MEMBERS[member]} "
                   "bytes; nothing was inflated")


def test_a_member_that_inflates_past_its_declared_size_is_stopped_there(tmp_path, keras_files):
    # the headers say 2,000 bytes; the stream holds 1.5 GiB
    stream, _, _ = _bomb(b'{"class_name": "Functional", "config": {}, "pad": "', b'"}', 1536)
    real = _members(keras_files / "base_model.keras")
    members = [_stored(n, d) for n, d in real.items() if n != "config.json"]
    path = _zip(tmp_path / "liar.keras", [*members, ("config.json", stream, 8, 0x1234, 2000)])
    _refused(path, "liar.keras:config.json inflates past its declared 2000 bytes; refusing it")


def test_a_lie_that_passes_its_crc_is_refused_before_tf_keras_reads_it(tmp_path, keras_files):
    # the declared bytes are a whole, valid config that passes its CRC, and the stream goes on to
    # 1.5 GiB: zipfile's read() inflates all of it before cutting it to the declared size (2 GiB
    # at its peak, measured), so the stream must end where its header says
    real = _members(keras_files / "base_model.keras")
    config = real["config.json"] + b" " * 64
    stream, _, _ = _bomb(config, b"", 1536)
    members = [_stored(n, d) for n, d in real.items() if n != "config.json"]
    path = _zip(tmp_path / "prefix.keras", [*members, ("config.json", stream, 8, zlib.crc32(config), len(config))])
    _refused(path, f"config.json inflates past its declared {len(config)} bytes")


def test_a_member_shorter_than_declared_is_refused(tmp_path, keras_files):
    real = _members(keras_files / "base_model.keras")
    members = [_stored(n, d) for n, d in real.items() if n != "metadata.json"]
    data = real["metadata.json"]
    path = _zip(tmp_path / "short.keras", [*members, ("metadata.json", data, 0, zlib.crc32(data), len(data) + 100)])
    _refused(path, "short.keras")


@pytest.mark.parametrize("extra", [["../../evil.py"], ["assets/x"], ["a", "b", "c", "d", "e"]])
def test_members_tf_keras_does_not_write_are_refused(tmp_path, keras_files, extra):
    real = _members(keras_files / "base_model.keras")
    members = [_stored(n, d) for n, d in real.items()] + [_stored(n, b"x") for n in extra]
    path = _zip(tmp_path / "extra.keras", members)
    _refused(path, "extra.keras")


def test_a_symlinked_keras_file_is_not_followed(tmp_path, keras_files):
    (tmp_path / "link.keras").symlink_to(keras_files / "base_model.keras")
    _refused(tmp_path / "link.keras", "symbolic link is never followed")


# --------------------------------------------------------------------------------- class pickers

def _lambda_writing(marker: Path) -> list:
    """A Lambda's ``function`` field as tf-keras writes one: marshalled bytecode that writes ``marker``."""
    from tf_keras.src.utils import generic_utils

    return list(generic_utils.func_dump(lambda x, p=str(marker): (open(p, "w").write("ran"), x)[1]))


def _lambda_config(marker: Path) -> dict:
    return {"name": "evil", "trainable": True, "dtype": "float32", "function": _lambda_writing(marker),
            "function_type": "lambda", "module": "builtins", "output_shape": None, "output_shape_type": "raw",
            "output_shape_module": None, "arguments": {}}


def test_a_model_whose_module_and_registered_name_pick_lambda_is_refused_with_nothing_run(tmp_path, keras_files):
    import tf_keras as keras

    marker = tmp_path / "marker"
    config = {"module": "tf_keras.src.layers.core.lambda_layer", "class_name": "Functional",
              "registered_name": "Lambda", "config": _lambda_config(marker)}
    for path in (_write_keras(tmp_path / "evil.keras", config, keras_files),
                 _write_h5(tmp_path / "evil.h5", config, keras_files)):
        _refused(path, "class 'Functional' with module 'tf_keras.src.layers.core.lambda_layer' and registered name "
                       "'Lambda' would load another class")
        assert not marker.exists()
    # what the fields do without the check: tf-keras builds a Lambda from the marshalled code
    picked = keras.models.load_model(str(tmp_path / "evil.keras"), compile=False, safe_mode=False)
    assert type(picked).__name__ == "Lambda"
    picked(np.ones((1, 3), np.float32))
    assert marker.read_text() == "ran"


def _layer(config: dict, cls: str) -> dict:
    """The model's one top-level layer of class ``cls``."""
    return next(layer for layer in config["config"]["layers"] if layer["class_name"] == cls)


def _inner_dense(config: dict) -> dict:
    """The Dense layer of the model nested in the TimeDistributed wrapper."""
    return _layer(config, "TimeDistributed")["config"]["layer"]["config"]["layers"][-1]


def _pick_lambda(node: dict) -> None:
    node.update(module="tf_keras.src.layers.core.lambda_layer", registered_name="Lambda")


def _as_function(node: dict, marker: Path) -> None:
    node.update(class_name="function", module="keras.layers", registered_name="Lambda", config=_lambda_config(marker))


HOSTILE = {
    # an allowed class whose module/registered_name pick Lambda, inside a wrapper's nested model
    "nested registered_name": (lambda c, m: _pick_lambda(_inner_dense(c)), "would load another class"),
    "registered_name alone": (lambda c, m: _layer(c, "Dense").update(registered_name="Lambda"),
                              "registered name 'Lambda'"),
    "module of another package": (lambda c, m: _layer(c, "Dense").update(module="os"), "with module 'os'"),
    "public module without the class": (lambda c, m: _layer(c, "Dense").update(module="keras.initializers"),
                                        "would load another class"),
    "the function special": (lambda c, m: _as_function(_layer(c, "Dense"), m), "class 'function' is not"),
    "lambda special in an inbound node": (
        lambda c, m: _layer(c, "Dense")["inbound_nodes"][0][0][3].update(
            fn={"class_name": "__lambda__", "config": {"value": _lambda_writing(m)}}), "class '__lambda__' is not"),
    "code fields on a built-in layer": (lambda c, m: _layer(c, "Dense")["config"].update(_lambda_config(m)),
                                        "a config field that carries Python code"),
    "initializer picking another": (
        lambda c, m: _inner_dense(c)["config"]["kernel_initializer"].update(registered_name="Orthogonal"),
        "registered name 'Orthogonal'"),
    "activation outside the built-ins": (lambda c, m: _inner_dense(c)["config"].update(activation="deserialize"),
                                         "activation 'deserialize'"),
    "an op layer's function": (lambda c, m: _layer(c, "TFOpLambda")["config"].update(function="io.write_file"),
                               "names TF function 'io.write_file'"),
}


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_every_field_that_picks_a_class_is_on_the_allowlist(tmp_path, keras_files, case, suffix):
    marker = tmp_path / "marker"
    config = _config(keras_files)
    alter, fragment = HOSTILE[case]
    alter(config, marker)
    write = _write_keras if suffix == ".keras" else _write_h5
    _refused(write(tmp_path / f"evil{suffix}", config, keras_files), fragment)
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "io.write_file")


def test_an_h5_model_config_over_the_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.h5"
    with h5py.File(path, "w", libver="latest") as f:  # dense attribute storage: an attribute of any size
        f.attrs["model_config"] = np.frombuffer(b" " * (65 * MiB), "S1").view(f"S{65 * MiB}")[0]
    _refused(path, f"big.h5: a model config of {65 * MiB} bytes, over {64 * MiB}")
