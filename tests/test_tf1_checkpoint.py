"""TF1 ``Saver`` checkpoints and SavedModel variables read by :mod:`policy.bundleio`, without
TensorFlow's reader: against that reader on real files, against RLlib 2.0.1's own outputs for
``convert --weights`` (``fixtures/rllib/saver/``, ``fixtures/rllib/make_saver.py``), and on
hostile files."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from policy_export import TFPolicy, load_spec
from policy_export.errors import UnsafeCheckpointError, WeightsError
from policy_export.exporter.convert import convert_saved_model
from policy_export.exporter.options import ExportOptions
from policy_export.policy.bundleio import (TOTAL_LIMIT, bundle_entries, checkpoint_prefix, crc32c, masked_crc32c,
                                          read_bundle)
from helpers import cli, messages
from tests.checkpoint_matrix import OnnxPolicy

ROOT = Path(__file__).resolve().parent.parent
SAVER = ROOT / "fixtures/rllib/saver"
BUNDLES = sorted([*SAVER.glob("*/tf1_checkpoint/model.index"),
                  *(ROOT / "fixtures/rllib").glob("*/*/saved_model/variables/variables.index")])
FAST = ExportOptions(samples=200, explore_samples=1000)


@pytest.mark.parametrize("index", BUNDLES, ids=lambda p: str(p.relative_to(ROOT / "fixtures/rllib")))
def test_the_reader_agrees_with_tensorflows_on_every_real_checkpoint(index):
    prefix = checkpoint_prefix(index)
    mine = read_bundle(prefix)
    theirs = tf.train.load_checkpoint(str(prefix))
    assert set(mine) == set(theirs.get_variable_to_shape_map())
    for name, value in mine.items():
        np.testing.assert_array_equal(value, theirs.get_tensor(name), err_msg=name)


def test_a_directory_its_prefix_and_its_index_name_the_same_checkpoint():
    directory = SAVER / "cartpole_ff/tf1_checkpoint"
    assert checkpoint_prefix(directory) == checkpoint_prefix(directory / "model.index") == directory / "model"


@pytest.mark.parametrize("case", sorted(p.name for p in SAVER.iterdir() if p.is_dir()))
def test_convert_weights_serves_what_the_checkpoint_holds(tmp_path, case):
    expected = np.load(SAVER / case / "expected.npz")
    obs = expected["observations"]
    runs = {}
    for label, weights in (("before", None), ("after", SAVER / case / "tf1_checkpoint")):
        out = tmp_path / label
        convert_saved_model(SAVER / case / "saved_model", out, weights=weights, device="cpu", options=FAST)
        got = OnnxPolicy(out).run({"observations": obs})
        for name in ("action_dist_inputs", "vf_preds"):
            np.testing.assert_allclose(got[name], expected[f"{label}/{name}"], atol=1e-5, rtol=1e-5)
        if np.issubdtype(expected[f"{label}/actions"].dtype, np.integer):
            np.testing.assert_array_equal(got["actions_0"], expected[f"{label}/actions"])
        runs[label] = got["action_dist_inputs"]
        record = json.loads((out / "manifest.json").read_text())["source"]["variables"]
        assert record.get("variables_from_weights", 0) == (0 if weights is None else record["variables"])
    assert np.abs(runs["before"] - runs["after"]).max() > 1e-3  # training moved the weights


def test_weights_of_another_policy_are_refused_with_each_variable_named(tmp_path):
    out = tmp_path / "out"
    run = cli("convert", str(SAVER / "cartpole_ff/saved_model"), "--out", str(out),
              "--weights", str(SAVER / "pendulum_box/tf1_checkpoint"))
    assert run.returncode == 2, run.stderr
    assert "'default_policy/fc_1/kernel' is float32 [3, 16], the SavedModel's float32 [4, 16]" in run.stderr
    assert not out.exists()


def test_spec_policy_imports_a_saver_checkpoint(tmp_path):
    spec = load_spec(ROOT / "fixtures/cartpole_mlp")
    trained = TFPolicy.from_spec(spec)
    with trained.graph.as_default():
        tf.compat.v1.train.Saver().save(trained.session, str(tmp_path / "model"))
    fresh = TFPolicy.from_spec(dataclasses.replace(spec, weights=None, seed=99))
    obs = np.random.default_rng(0).uniform(-1, 1, (8, 4)).astype(np.float32)
    before = fresh.compute_actions(obs).fetches["action_dist_inputs"]
    fresh.import_model_from_tf1_checkpoint(tmp_path)
    want = trained.compute_actions(obs).fetches["action_dist_inputs"]
    assert np.abs(before - want).max() > 1e-3
    np.testing.assert_array_equal(fresh.compute_actions(obs).fetches["action_dist_inputs"], want)


def test_a_checkpoint_that_misses_weights_changes_nothing(tmp_path):
    spec = load_spec(ROOT / "fixtures/cartpole_mlp")
    policy = TFPolicy.from_spec(spec)
    obs = np.zeros((2, 4), np.float32)
    before = policy.compute_actions(obs).fetches["action_dist_inputs"]
    with pytest.raises(WeightsError, match="missing weight"):
        policy.import_model_from_tf1_checkpoint(SAVER / "cartpole_ff/tf1_checkpoint")  # RLlib's names, not ours
    np.testing.assert_array_equal(policy.compute_actions(obs).fetches["action_dist_inputs"], before)


# ---------------------------------------------------------------------------------------- hostile

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _block(entries: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(_varint(0) + _varint(len(k)) + _varint(len(v)) + k + v for k, v in entries)
    return body + (0).to_bytes(4, "little") + (1).to_bytes(4, "little")


def _index(entries: list[tuple[bytes, bytes]], block_type: int = 0, data: bytes | None = None) -> bytes:
    """A table as TensorFlow writes one: a data block (``data``, else made of ``entries``), an
    empty meta index, an index block, a footer."""
    data = _block(entries) if data is None else data
    out = data + _trailer(data, block_type)
    meta_at = len(out)
    meta = _block([])
    out += meta + _trailer(meta)
    index_at = len(out)
    index = _block([(b"\xff", _varint(0) + _varint(len(data)))])
    out += index + _trailer(index)
    handles = _varint(meta_at) + _varint(len(meta)) + _varint(index_at) + _varint(len(index))
    return out + handles + b"\0" * (40 - len(handles)) + (0xDB4775248B80FB57).to_bytes(8, "little")


def _trailer(block: bytes, block_type: int = 0) -> bytes:
    """A table block's trailer as TensorFlow writes it: its type and the masked CRC32C of both."""
    return bytes([block_type]) + masked_crc32c(block + bytes([block_type])).to_bytes(4, "little")


def _entry(shape: list[int], size: int, offset: int = 0, dtype: int = 1, sliced: bool = False,
           data: bytes | None = None, shard: int = 0) -> bytes:
    """A ``BundleEntryProto``; with ``data``, the masked CRC32C of its bytes there (field 6)."""
    dims = b"".join(_field(2, _field(1, d)) for d in shape)
    crc = b"" if data is None else _varint(6 << 3 | 5) + masked_crc32c(data[offset:offset + size]).to_bytes(4, "little")
    return (_field(1, dtype) + _field(2, dims) + (_field(3, shard) if shard else b"") + _field(4, offset)
            + _field(5, size) + crc + (_field(7, _field(1, b"")) if sliced else b""))


def _write(tmp_path: Path, entries, data: bytes = b"\0" * 16, block_type: int = 0, shards: int = 1) -> Path:
    header = (b"", _field(1, shards))
    (tmp_path / "model.index").write_bytes(_index([header, *entries], block_type))
    (tmp_path / "model.data-00000-of-00001").write_bytes(data)
    return tmp_path / "model"


def test_a_minimal_checkpoint_reads(tmp_path):
    data = np.arange(4, dtype="<f4").tobytes()
    prefix = _write(tmp_path, [(b"w", _entry([2, 2], 16, data=data))], data)
    np.testing.assert_array_equal(read_bundle(prefix)["w"], np.arange(4, dtype=np.float32).reshape(2, 2))


@pytest.mark.parametrize("entries,block_type,message", [
    ([(b"w", _entry([1 << 40], 4))], 0, "too large"),
    ([(b"w", _entry([1 << 20, 1 << 20], 4))], 0, "declares shape"),
    ([(b"w", _entry([4], 16, offset=8))], 0, "past the end of its data file"),
    ([(b"w", _entry([4], 16, sliced=True))], 0, "sliced"),
    ([(b"w", _entry([4], 16))], 1, "compressed"),
    ([(b"w", _entry([2], 2, dtype=7))], 0, "not a number"),
])
def test_hostile_entries_are_refused_before_reading(tmp_path, entries, block_type, message):
    prefix = _write(tmp_path, entries, block_type=block_type)
    with pytest.raises(UnsafeCheckpointError, match=message):
        read_bundle(prefix, ["w"])


@pytest.mark.parametrize("damage", ["magic", "truncate", "varint"])
def test_a_damaged_index_is_refused(tmp_path, damage):
    prefix = _write(tmp_path, [(b"w", _entry([4], 16))])
    index = bytearray((tmp_path / "model.index").read_bytes())
    if damage == "magic":
        index[-1] ^= 0xFF
    elif damage == "truncate":
        index = index[:30]
    else:
        index[:8] = b"\xff" * 8  # a varint that never ends inside the block
    (tmp_path / "model.index").write_bytes(bytes(index))
    with pytest.raises(UnsafeCheckpointError):
        read_bundle(prefix)


def test_a_symlinked_data_file_is_not_followed(tmp_path):
    shutil.copytree(SAVER / "cartpole_ff/tf1_checkpoint", tmp_path / "ck")
    data = tmp_path / "ck/model.data-00000-of-00001"
    shutil.move(data, tmp_path / "elsewhere")
    data.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        read_bundle(tmp_path / "ck/model")
    _, entries = bundle_entries(tmp_path / "ck/model")  # the index alone still reads
    assert "default_policy/fc_1/kernel" in entries


def test_names_that_grow_by_prefix_sharing_are_bounded(tmp_path):
    # each key shares all of the previous one and adds a byte: tiny on disk, quadratic in memory
    body = b"".join(_varint(min(i, 5000)) + _varint(1) + _varint(0) + b"a" for i in range(60_000))
    block = body + (0).to_bytes(4, "little") + (1).to_bytes(4, "little")
    (tmp_path / "model.index").write_bytes(_index([], data=block))
    with pytest.raises(UnsafeCheckpointError, match="at most 4096"):
        bundle_entries(tmp_path / "model")


@pytest.mark.parametrize("entry", [_field(1, b"xx"), _field(2, 5), _field(3, b"x") + _field(1, 1)])
def test_fields_of_the_wrong_wire_type_are_refused(tmp_path, entry):
    prefix = _write(tmp_path, [(b"w", entry)])
    with pytest.raises(UnsafeCheckpointError, match="wire type"):
        bundle_entries(prefix)


# ------------------------------------------------------------------------------------ checksums

FC_OUT = "default_policy/fc_out/kernel"


def _flip(path: Path, at: int, bit: int = 0x80) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= bit
    path.write_bytes(bytes(data))


def test_crc32c_is_tensorflows():
    # the check value of CRC-32C and the masked CRC TensorFlow stored for a real tensor
    assert crc32c(b"123456789") == 0xE3069283
    _, entries = bundle_entries(SAVER / "cartpole_ff/tf1_checkpoint/model")
    data = (SAVER / "cartpole_ff/tf1_checkpoint/model.data-00000-of-00001").read_bytes()
    entry = entries[FC_OUT]
    assert masked_crc32c(data[entry.offset:entry.offset + entry.size]) == entry.crc32c


def test_a_flipped_bit_in_a_real_checkpoint_is_refused_as_tensorflow_refuses_it(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(SAVER / "cartpole_ff/tf1_checkpoint", ck)
    _, entries = bundle_entries(ck / "model")
    _flip(ck / "model.data-00000-of-00001", entries[FC_OUT].offset + 3)  # the sign of one action weight
    with pytest.raises(tf.errors.OpError, match="Checksum does not match"):
        tf.train.load_checkpoint(str(ck / "model")).get_tensor(FC_OUT)
    with pytest.raises(UnsafeCheckpointError, match=f"the bytes of '{FC_OUT}' does not match its checksum"):
        read_bundle(ck / "model", [FC_OUT])
    out = tmp_path / "out"
    run = cli("convert", str(SAVER / "cartpole_ff/saved_model"), "--out", str(out), "--weights", str(ck))
    assert run.returncode == 2, run.stderr
    assert f"'{FC_OUT}' does not match its checksum" in run.stderr and "Traceback" not in run.stderr
    assert len(messages(run.stderr)) == 1 and len(run.stderr) < 600
    assert not out.exists()


def test_a_changed_byte_in_a_real_index_is_refused_as_tensorflow_refuses_it(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(SAVER / "cartpole_ff/tf1_checkpoint", ck)
    index = (ck / "model.index").read_bytes()
    _flip(ck / "model.index", index.index(b"fc_out"), 0x01)  # a same-size rename: fc_out -> gc_out
    with pytest.raises(tf.errors.OpError, match="block checksum mismatch"):
        tf.train.load_checkpoint(str(ck / "model"))
    with pytest.raises(UnsafeCheckpointError, match="does not match its checksum; the file was altered"):
        bundle_entries(ck / "model")


def test_fresh_saver_checkpoints_of_every_dtype_read_and_a_flip_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    values = {f"v_{np.dtype(d).name}": (rng.uniform(-9, 9, (5, 3)) > 0 if d == bool else
                                         rng.uniform(-9, 9, (5, 3)).astype(d))
              for d in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.int8, np.int16, bool)}
    values["big"] = rng.standard_normal((301, 257)).astype(np.float32)  # past the lane path's threshold, odd length
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(v, name=k) for k, v in values.items()]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            tf.compat.v1.train.Saver(variables).save(session, str(tmp_path / "model"))
    got = read_bundle(tmp_path / "model")
    assert set(got) == set(values)
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert got[name].dtype == value.dtype
    _, entries = bundle_entries(tmp_path / "model")
    _flip(tmp_path / "model.data-00000-of-00001", entries["big"].offset + entries["big"].size - 1, 0x01)
    with pytest.raises(UnsafeCheckpointError, match="'big' does not match its checksum"):
        read_bundle(tmp_path / "model")
    np.testing.assert_array_equal(read_bundle(tmp_path / "model", ["v_int64"])["v_int64"], values["v_int64"])


def test_an_entry_without_a_checksum_is_refused(tmp_path):
    prefix = _write(tmp_path, [(b"w", _entry([4], 16))])
    with pytest.raises(UnsafeCheckpointError, match="'w' has no checksum"):
        read_bundle(prefix)


# --------------------------------------------------------------------------------- total budget

def test_a_checkpoint_of_several_shards_reads_each_tensor_from_its_own(tmp_path):
    parts = [np.full(3, i, "<f4").tobytes() for i in range(3)]
    entries = [(f"w{i}".encode(), _entry([3], 12, data=part, shard=i)) for i, part in enumerate(parts)]
    prefix = _write(tmp_path, entries, shards=3)
    for i, part in enumerate(parts):
        (tmp_path / f"model.data-{i:05d}-of-00003").write_bytes(part)
    got = read_bundle(prefix)
    assert {k: v.tolist() for k, v in got.items()} == {f"w{i}": [float(i)] * 3 for i in range(3)}


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)  # a hole: no disk, and reading it would cost the full size in memory


def _refused_within_budget(prefix: Path, message: str) -> None:
    import time
    import tracemalloc

    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(UnsafeCheckpointError, match=message) as caught:
            read_bundle(prefix)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 10 and peak < 96 << 20, peak  # the index read: up to its 64 MiB limit
    assert len(str(caught.value)) < 400


def test_shards_each_within_the_limit_that_sum_past_the_budget_are_refused(tmp_path):
    # 1100 shards of 1 MiB each: every file is far below the per-file limit, the sum is not
    count, size = 1100, 1 << 20
    entries = [(f"w{i:04d}".encode(), _entry([size // 4], size, shard=i)) for i in range(count)]
    prefix = _write(tmp_path, entries, shards=count)
    for i in range(count):
        _sparse(tmp_path / f"model.data-{i:05d}-of-{count:05d}", size)
    assert count * size > TOTAL_LIMIT
    _refused_within_budget(prefix, f"1100 tensors of {count * size} bytes in all \\(across 1100 data files\\), "
                                   "over the 1024 MiB a checkpoint may hold; nothing was read")


def test_entries_that_all_read_the_same_bytes_count_against_the_budget(tmp_path):
    # one 8 MiB shard, 130 entries that each declare all of it: 1040 MiB to read from 8 on disk
    size = 8 << 20
    entries = [(f"w{i:03d}".encode(), _entry([size // 4], size)) for i in range(130)]
    prefix = _write(tmp_path, entries, data=b"")
    _sparse(tmp_path / "model.data-00000-of-00001", size)
    _refused_within_budget(prefix, "130 tensors of 1090519040 bytes in all \\(across 1 data files\\)")
