"""Hostile ``--observations`` files: small on disk, built to cost gigabytes or minutes, or to end
in an internal error. Each is refused with exit 2 and one line naming the file and the bound,
nothing written, in bounded memory and time (:mod:`policy_export.exporter.recorded.budget`).

Every class is run once through the command line on the trigger a hostile round found (each
past 2 GiB or a minute before the budget), its variants through the reader; both in a child
process whose peak resident memory (``wait4``) and wall time are measured. The files are built
here, small on disk (a deflate stream of zeros repeated, an LZ4 frame streamed, Parquet's
dictionary encoding).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR
from helpers import messages

MLP = FIXTURES_DIR / "cartpole_mlp"
LSTM = FIXTURES_DIR / "cartpole_lstm"
PEAK_MIB = 1024  # a child's peak resident memory, at most (an export with TensorFlow holds about 700)
SECONDS = 30.0  # a child's wall time, at most (a loaded 2-core machine; the reads take 1 to 3 s, an export 10)

# the reader in a child: every file checked (as before TensorFlow loads), then read for a CartPole-shaped
# policy (recurrent: with state inputs, so that episodes are counted); exit 2 on InputError, 0 read, 1 a bug
READER = r"""
import sys
from pathlib import Path
from policy_export.errors import InputError
from policy_export.exporter.recorded import check_paths, read_recorded
from policy_export.policy.spaces import space_from_json

space = space_from_json({"type": "Box", "low": -1e9, "high": 1e9, "shape": [4], "dtype": "float32"}, "$", "t")

class Contract:
    required_inputs = []
    input_keys = ["observations"] + (["state_in_0", "state_in_1"] if sys.argv[1] == "recurrent" else [])

    @staticmethod
    def input(key):
        return None

paths = [Path(p) for p in sys.argv[2:]]
try:
    check_paths(paths)
    read = read_recorded(paths, space, Contract, 1000, 0)
except InputError as e:
    print(f"refused: {e}")
    sys.exit(2)
print(f"read: {read.rows} rows; episodes {None if read.episodes is None else read.episodes.record['episodes']}")
"""


# a child's own peak resident memory: VmHWM, reset through /proc/self/clear_refs as it starts (a forked
# child's wait4 peak includes its parent's resident set, here a pytest worker that may hold TensorFlow),
# written to the file named by its first argument when it exits; then the command runs in it
PEAK = r"""
import atexit, runpy, sys
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")

def peak(path=sys.argv[1]):
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(path, "w") as f:
        f.write(str(kib))

atexit.register(peak)
if sys.argv[2] == "-c":
    sys.argv = ["-c", *sys.argv[4:]]
    exec(compile(CODE, "<child>", "exec"))
else:
    sys.argv = ["policy-export", *sys.argv[3:]]
    from policy_export.exporter.cli import main
    sys.exit(main(sys.argv[1:]))
"""


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    peak_mib: float
    seconds: float


def _measured(args: list[str], tmp_path: Path, code: str | None = None, timeout: float = 120.0) -> Run:
    """In a child process, ``policy-export ARGS`` (or ``code`` with ``args`` as its ``sys.argv[1:]``):
    its exit code, output, peak resident memory (its own) and wall time; killed after ``timeout`` s."""
    env = {k: v for k, v in os.environ.items() if k not in ("GITHUB_STEP_SUMMARY",)}
    out, err, peak = tmp_path / "child.out", tmp_path / "child.err", tmp_path / "child.peak"
    script = PEAK.replace("CODE", repr(code)) if code else PEAK
    cmd = [sys.executable, "-c", script, str(peak), *(["-c", "code"] if code else ["cli"]), *args]
    start = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e:
        child = subprocess.Popen(cmd, stdout=o, stderr=e, env=env)
    killer = threading.Timer(timeout, child.kill)
    killer.start()
    try:
        child.wait()
    finally:
        killer.cancel()
    seconds = time.monotonic() - start
    return Run(child.returncode, out.read_text(), err.read_text(), int(peak.read_text()) / 1024, seconds)


def _export(tmp_path: Path, spec: Path, path: Path) -> Run:
    return _measured(["export", str(spec), "--out", str(tmp_path / "out"), "--formats", "onnx",
                      "--explore-samples", "0", "-q", "--observations", str(path)], tmp_path)


def _read(tmp_path: Path, path: Path, recurrent: bool = False) -> Run:
    return _measured(["recurrent" if recurrent else "plain", str(path)], tmp_path, code=READER)


def _bounded(run: Run) -> None:
    assert run.peak_mib < PEAK_MIB, f"peak {run.peak_mib:.0f} MiB"
    assert run.seconds < SECONDS, f"{run.seconds:.1f} s"


def _refused_by_export(run: Run, tmp_path: Path, path: Path, fragment: str) -> None:
    """Exit 2, exactly one line on stderr naming the file and the fragment, nothing at --out, bounded."""
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    lines = messages(run.stderr)
    assert len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(f"policy-export: error: --observations {path}"), lines[0]
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    _bounded(run)


def _refused_by_reader(run: Run, path: Path, fragment: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stdout[-1000:], run.stderr[-2000:])
    assert run.stdout.startswith(f"refused: --observations {path}"), run.stdout
    assert fragment in run.stdout, run.stdout
    assert len(run.stdout.strip().splitlines()) == 1
    _bounded(run)


# ----------------------------------------------------------------------------- builders (small on disk)


def _deflated_run(header: bytes, nbytes: int, fill: int) -> tuple[bytes, int]:
    """A raw deflate stream of ``header`` then ``nbytes`` bytes ``fill``, and its CRC-32, built
    without holding them: one deflated MiB of them (after a full flush: it refers to nothing
    before it) repeated."""
    block, parts = 1 << 20, []
    for data in (header, bytes([fill]) * (nbytes % block)):
        stream = zlib.compressobj(9, zlib.DEFLATED, -15)
        parts.append(stream.compress(data) + stream.flush(zlib.Z_FULL_FLUSH))
    stream = zlib.compressobj(9, zlib.DEFLATED, -15)
    run = bytes([fill]) * block
    body = stream.compress(run) + stream.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(header)
    for _ in range(nbytes // block):
        crc = zlib.crc32(run, crc)
    crc = zlib.crc32(run[:nbytes % block], crc)
    return parts[0] + body * (nbytes // block) + parts[1] + b"\x03\x00", crc  # an empty final block ends it


def _npz_of_deflated_zeros(path: Path, arrays: dict[str, tuple]) -> Path:
    """An ``.npz`` of arrays of one byte repeated (``name: (dtype, shape[, byte])``, zeros unless
    said), each member deflated, written without holding them; numpy reads it (``np.load``)."""
    local, central = b"", b""
    for key, (descr, shape, *fill) in arrays.items():
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
        header = header.getvalue()
        size = len(header) + int(np.prod(shape)) * np.dtype(descr).itemsize
        data, crc = _deflated_run(header, size - len(header), fill[0] if fill else 0)
        name = f"{key}.npy".encode()
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, crc, len(data), size,
                               len(name), 0, 0, 0, 0, 0, len(local)) + name
        local += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, len(data), size, len(name), 0) \
            + name + data
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(arrays), len(arrays), len(central), len(local), 0)
    path.write_bytes(local + central + end)
    return path


def _packed(array: np.ndarray, declare: bool = True) -> str:
    """RLlib's ``pack`` of ``array`` (base64 of an LZ4 frame of its pickle), streamed: a gigabyte
    of zeros (``np.zeros``: pages never touched) is packed without holding it. ``declare``: the
    frame says its size."""
    import lz4.frame

    class Count:
        n = 0

        def write(self, b):
            self.n += memoryview(b).nbytes

    counter = Count()
    pickle.dump(array, counter, protocol=5)
    compressor = lz4.frame.LZ4FrameCompressor()
    parts = [compressor.begin(source_size=counter.n if declare else 0)]

    class Writer:
        def write(self, b):
            view = memoryview(b).cast("B")
            for i in range(0, len(view), 16 << 20):
                parts.append(compressor.compress(view[i:i + (16 << 20)]))

    pickle.dump(array, Writer(), protocol=5)
    parts.append(compressor.flush())
    return base64.b64encode(b"".join(parts)).decode("ascii")


def _msgpack_array(data: bytes, shape, type_: str = "<f4") -> dict:
    return {b"nd": True, b"type": type_, b"kind": b"", b"shape": list(shape), b"data": data}


def _episode(observations: list, eid="e0") -> bytes:
    import msgpack

    return msgpack.packb({"id_": eid, "t": len(observations), "observations": {"lookback": 0, "data": observations}})


def _parquet(path: Path, column: str, cells, repeat: int = 1, kind=None) -> Path:
    """A Parquet file of one column: ``cells`` (bytes or strings), each repeated ``repeat`` times
    as a dictionary array (stored once: N identical cells cost a bit each on disk), zstd."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = pa.array(cells, kind or (pa.binary() if isinstance(cells[0], bytes) else pa.string()))
    indices = pa.array(np.repeat(np.arange(len(cells), dtype=np.int32), repeat))
    pq.write_table(pa.table({column: pa.DictionaryArray.from_arrays(indices, values)}), path, compression="zstd")
    return path


def _parquet_lists(path: Path, rows: int, values: int) -> Path:
    """A Parquet ``obs`` column of ``rows`` rows of ``values`` zeros each (dictionary-encoded: a few
    bytes on disk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * values)
    column = pa.ListArray.from_arrays(offsets, pa.array(np.zeros(rows * values)))
    pq.write_table(pa.table({"obs": column}), path, compression="zstd")
    return path


# ----------------------------------------------------------------------------- 1. Parquet cells


def test_a_parquet_episode_of_200_mib_dictionary_encoded_is_refused_before_it_is_decoded(tmp_path):
    """The trigger: a 12 KB file whose ten cells are one 200 MiB episode, stored once
    (dictionary encoding). ``to_pylist`` of the column made ten copies and decoded each: 4.1 GB
    and 53 s. Now the page header says 200 MiB, more than a cell, before pyarrow reads the page."""
    half = np.zeros(((100 << 20) // 16, 4), np.float32).tobytes()
    cell = _episode([_msgpack_array(half, ((100 << 20) // 16, 4))] * 2)
    del half
    path = _parquet(tmp_path / "episodes.parquet", "item", [cell], repeat=10)
    del cell
    assert path.stat().st_size < 64 << 10
    run = _export(tmp_path, MLP, path)
    _refused_by_export(run, tmp_path, path, "item: a Parquet page that inflates to more than 64 MiB")


def _rows_of_one_string(tmp_path: Path) -> Path:
    return _parquet(tmp_path / "rows.parquet", "obs", ["A" * (80 << 20)], repeat=10)


def _episodes_under_a_cell(tmp_path: Path) -> Path:
    rows = (30 << 20) // 16
    cell = _episode([_msgpack_array(bytes(rows * 16), (rows, 4))] * 2)
    return _parquet(tmp_path / "episodes.parquet", "item", [cell], repeat=20)


def _tiny_cells(tmp_path: Path) -> Path:
    cell = _episode([_msgpack_array(bytes(16), (4,))] * 2)
    return _parquet(tmp_path / "tiny.parquet", "item", [cell], repeat=1_000_000)


def _empty_lists(tmp_path: Path, nested: bool) -> Path:
    """An episode whose observations are millions of empty msgpack arrays (one byte each): one
    array of them, or 15 arrays each under the length a single array may have."""
    import msgpack

    head = msgpack.packb({"id_": "e", "t": 1})[1:]  # the two pairs, without their map's header
    inner = (b"\xdd" + (4_000_000).to_bytes(4, "big") + b"\x90" * 4_000_000) * 3 if nested else b""
    data = b"\x93" + inner if nested else b"\xdd" + (5 << 20).to_bytes(4, "big") + b"\x90" * (5 << 20)
    cell = b"\x83" + head + msgpack.packb("observations") + b"\x82" + msgpack.packb("lookback") + b"\x00" \
        + msgpack.packb("data") + data
    return _parquet(tmp_path / "lists.parquet", "item", [cell], repeat=3)


PARQUET = {
    "rows: one 80 MiB obs cell, ten times": (_rows_of_one_string,
                                             "obs: a Parquet page that inflates to more than 64 MiB"),
    "episodes: one 60 MiB episode, twenty times": (_episodes_under_a_cell, "its episodes inflate to more than 256 MiB"),
    "episodes: a million one-step episodes, stored once": (_tiny_cells, "its episodes inflate to more than 256 MiB"),
    "episodes: 5 million empty msgpack arrays": (lambda p: _empty_lists(p, False), "exceeds max_array_len"),
    "episodes: 3 x 4 million empty msgpack arrays": (lambda p: _empty_lists(p, True),
                                                      "its episodes build more than 1048576 values"),
    "rows: five rows of 7 million numbers": (lambda p: _parquet_lists(p / "lists.parquet", 5, 7_000_000),
                                             "a row group of obs that decodes to more than 256 MiB"),
    "rows: one row of 9 million numbers": (lambda p: _parquet_lists(p / "row.parquet", 1, 9_000_000),
                                           "a row of more than 64 MiB"),
}


@pytest.mark.parametrize("case", sorted(PARQUET))
def test_a_parquet_file_that_would_inflate_is_refused_in_bounded_memory_and_time(tmp_path, case):
    build, fragment = PARQUET[case]
    path = build(tmp_path)
    assert path.stat().st_size < 1 << 20
    _refused_by_reader(_read(tmp_path, path), path, fragment)


# ----------------------------------------------------------------------------- 2. episodes


def test_sixteen_million_one_step_episodes_are_refused_before_tensorflow(tmp_path):
    """The trigger: a 264 KB ``.npz`` whose ``dones`` (all true) made 16 million one-step episodes
    for a recurrent policy, one Python tuple each: 2.5 GB and 72 s. Its deflated arrays declare
    272 MiB, more than the floor: refused from their headers, before TensorFlow loads."""
    path = _npz_of_deflated_zeros(tmp_path / "dones.npz", {"observations": ("<f4", (16 << 20, 4)),
                                                           "dones": ("|b1", (16 << 20,), 1)})
    assert path.stat().st_size < 300_000
    run = _export(tmp_path, LSTM, path)
    _refused_by_export(run, tmp_path, path, "its arrays inflate to more than 256 MiB")
    assert run.seconds < 8  # no TensorFlow


def test_episodes_are_counted_in_arrays_and_refused_past_the_cap(tmp_path):
    """Four million one-step episodes within the floor (68 MiB): the policy is known to be
    recurrent only once TensorFlow built it, so it is the count that stops, as it passes
    MAX_EPISODES, in arrays."""
    from policy_export.exporter.recorded.budget import MAX_EPISODES

    path = _npz_of_deflated_zeros(tmp_path / "dones.npz", {"observations": ("<f4", (4 << 20, 4)),
                                                           "dones": ("|b1", (4 << 20,), 1)})
    run = _export(tmp_path, LSTM, path)
    _refused_by_export(run, tmp_path, path, f"dones: more than {MAX_EPISODES} episodes")


def test_many_episode_ids_are_refused_past_the_cap_and_a_million_are_read(tmp_path):
    from policy_export.exporter.recorded.budget import MAX_EPISODES

    many = tmp_path / "ids.npz"
    np.savez(many, observations=np.zeros((MAX_EPISODES + 1, 4), np.float32),
             episode_ids=np.random.default_rng(0).permutation(MAX_EPISODES + 1))
    _refused_by_reader(_read(tmp_path, many, recurrent=True), many, f"episode_ids: more than {MAX_EPISODES} episodes")
    fits = tmp_path / "dones.npz"
    np.savez(fits, observations=np.zeros((MAX_EPISODES, 4), np.float32), dones=np.ones(MAX_EPISODES, bool))
    run = _read(tmp_path, fits, recurrent=True)
    assert run.returncode == 0, (run.stdout, run.stderr[-2000:])
    assert run.stdout.strip() == f"read: 1000 rows; episodes {MAX_EPISODES}"
    _bounded(run)


def test_the_episodes_kept_are_the_sub_sample_drawn_before(tmp_path):
    """The episodes are counted in arrays now; the ones kept for a seed are those drawn before:
    ``rng.choice`` over every episode in file order (ids interleaved, as vectorised environments
    write them, and given by dones)."""
    from policy_export.exporter.recorded import open_file
    from policy_export.exporter.recorded.episodes import choose

    rng = np.random.default_rng(5)
    ids = np.repeat(np.arange(300) * 7 + 3, rng.integers(1, 9, 300))
    rng.shuffle(ids)
    np.savez(tmp_path / "ids.npz", observations=np.zeros((len(ids), 4), np.float32), eps_id=ids)
    dones = rng.random(2000) < 0.05
    np.savez(tmp_path / "dones.npz", observations=np.zeros((2000, 4), np.float32), dones=dones)
    first = list(dict.fromkeys(ids.tolist()))
    found = [(0, i, int((ids == v).sum())) for i, v in enumerate(first)]
    ends = np.flatnonzero(dones)
    lengths = np.diff(np.r_[0, ends + 1, 2000])
    found += [(1, i, int(n)) for i, n in enumerate(lengths[lengths > 0])]
    files = [open_file(tmp_path / "ids.npz"), open_file(tmp_path / "dones.npz")]
    for seed in (0, 1, 7):
        picked = np.sort(np.random.default_rng(seed).choice(len(found), size=16, replace=False))
        assert choose(files, seed) == ([found[i] for i in picked], len(found))


# ----------------------------------------------------------------------------- 3. RLlib's offline JSON


def test_a_json_line_whose_lz4_column_inflates_to_a_gibibyte_is_refused_before_inflating(tmp_path):
    """The trigger: a 5.7 MB line whose compressed obs column inflates to 1 GiB (the old limit):
    7.0 GB and 73 s. Now the LZ4 frame's declared size is more than a cell: refused before a
    byte is inflated."""
    path = tmp_path / "batch.json"
    path.write_text(json.dumps({"type": "SampleBatch",
                                "obs": _packed(np.zeros(((1 << 30) // 16 - 16, 4), np.float32))}) + "\n")
    assert path.stat().st_size < 6 << 20
    run = _export(tmp_path, MLP, path)
    _refused_by_export(run, tmp_path, path, "a compressed column of more than 64 MiB")


def _long_line(tmp_path: Path) -> Path:
    path = tmp_path / "long.json"
    with open(path, "w") as f:
        f.write('{"type": "SampleBatch", "obs": [')
        f.writelines("[0,0,0,0]," * ((1 << 20) // 10) for _ in range(237))
        f.write("[0,0,0,0]]}\n")
    return path


def _lines(tmp_path: Path, name: str, lines: list[dict]) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _pickle_opcodes(tmp_path: Path) -> Path:
    import lz4.frame

    plain = pickle.dumps(np.zeros((1, 4), np.float32), protocol=2)
    busy = plain[:2] + b"N0" * 600_000 + plain[2:]  # None pushed and popped: 1.2 million opcodes, one array
    text = base64.b64encode(lz4.frame.compress(busy)).decode()
    return _lines(tmp_path, "opcodes.json", [{"type": "SampleBatch", "obs": text}] * 4)


JSON = {
    "a 237 MB line": (_long_line, "line 1 is longer than 64 MiB"),
    "a line of 15 million empty lists": (
        lambda p: _lines(p, "lists.json", [{"type": "SampleBatch", "obs": [[]] * 15_000_000}]),
        "line 1 would parse into more than 256 MiB of objects"),
    "lines whose columns inflate to 60 MiB each": (
        lambda p: _lines(p, "many.json", [{"type": "SampleBatch",
                                           "obs": _packed(np.zeros(((60 << 20) // 16, 4), np.float32))}] * 8),
        "its compressed columns inflate to more than 256 MiB"),
    "a frame that does not declare its 1 GiB": (
        lambda p: _lines(p, "undeclared.json", [{"type": "SampleBatch", "obs": _packed(
            np.zeros(((1 << 30) // 16, 4), np.float32), declare=False)}]),
        "a compressed column of more than 64 MiB"),
    "pickles of a million opcodes each": (_pickle_opcodes, "pickles run more than 1048576 opcodes"),
}


@pytest.mark.parametrize("case", sorted(JSON))
def test_a_json_file_that_would_inflate_is_refused_in_bounded_memory_and_time(tmp_path, case):
    build, fragment = JSON[case]
    path = build(tmp_path)
    _refused_by_reader(_read(tmp_path, path), path, fragment)


# ----------------------------------------------------------------------------- 4. .npz members


def test_an_npz_that_inflates_to_a_gibibyte_is_refused_from_its_headers(tmp_path):
    """The trigger: a 7.6 MB ``.npz`` whose deflated member inflated to 8 GiB of rows, streamed
    through every check: 85 s. Here a 1 MB one of 1 GiB (numpy reads it): its header declares more
    than 64 times the file, past the floor: refused before a byte is inflated (and before
    TensorFlow loads)."""
    path = _npz_of_deflated_zeros(tmp_path / "bomb.npz", {"observations": ("<f4", ((1 << 30) // 16, 4))})
    with np.load(path) as data:  # a real .npz (numpy would inflate the whole gibibyte)
        assert data.files == ["observations"]
    assert path.stat().st_size < 2 << 20
    run = _export(tmp_path, MLP, path)
    _refused_by_export(run, tmp_path, path, "its arrays inflate to more than 256 MiB (64x its 1 MiB on disk")
    assert run.seconds < 8  # no TensorFlow


def _bzip2(tmp_path: Path) -> Path:
    import zipfile

    path = tmp_path / "bzip2.npz"
    buf = io.BytesIO()
    np.save(buf, np.zeros((1000, 4), np.float32))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_BZIP2) as archive:
        archive.writestr("observations.npy", buf.getvalue())
    return path


def _corrupt(tmp_path: Path) -> Path:
    path = tmp_path / "corrupt.npz"
    np.savez_compressed(path, observations=np.random.default_rng(0).standard_normal((20000, 4)).astype(np.float32))
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    return path


NPZ = {
    "a bzip2 member (45 million to one)": (_bzip2, "a member compressed otherwise than numpy writes them"),
    "arrays that together inflate past the floor": (
        lambda p: _npz_of_deflated_zeros(p / "two.npz", {"observations": ("<f4", (10 << 20, 4)),
                                                         "dones": ("|b1", (160 << 20,))}),
        "its arrays inflate to more than 256 MiB"),
    "a corrupt deflate stream": (_corrupt, "cannot be read"),
}


@pytest.mark.parametrize("case", sorted(NPZ))
def test_an_npz_member_that_would_inflate_or_fail_is_refused(tmp_path, case):
    build, fragment = NPZ[case]
    path = build(tmp_path)
    _refused_by_reader(_read(tmp_path, path), path, fragment)


# ----------------------------------------------------------------------------- 5. exit 2, not 3


def test_a_json_line_nested_100000_deep_is_exit_2(tmp_path):
    """The trigger: ``json.loads`` raised RecursionError, an internal error (exit 3)."""
    path = tmp_path / "deep.json"
    path.write_text('{"type": "SampleBatch", "obs": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    run = _export(tmp_path, MLP, path)
    _refused_by_export(run, tmp_path, path, "line 1 nests deeper than a sample batch does")


def _npy_header(path: Path, shape_text: str) -> Path:
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text + ", }"
    header += " " * ((64 - (len(header) + 13) % 64) % 64) + "\n"
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", len(header)) + header.encode() + bytes(64))
    return path


def _parquet_obs(path: Path, cells: list, leaf) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"obs": pa.array(cells, pa.list_(leaf()))}), path)
    return path


def _json_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _nan_ids(path: Path) -> Path:
    np.savez(path, observations=np.zeros((3, 4), np.float32), episode_ids=np.array([0.0, np.nan, np.nan]))
    return path


def _pa(name: str):
    def leaf():
        import pyarrow as pa

        return getattr(pa, name)()
    return leaf


BAD = {
    "a Parquet episode of dtype 'zz'": (
        lambda p: _parquet(p / "zz.parquet", "item", [_episode([_msgpack_array(bytes(16), (4,), "zz")] * 2)]),
        "an episode holds an array of 'zz', which is not read"),
    "a Parquet episode of observations of two shapes": (
        lambda p: _parquet(p / "shapes.parquet", "item", [_episode([_msgpack_array(bytes(16), (4,)),
                                                                    _msgpack_array(bytes(12), (3,)),
                                                                    _msgpack_array(bytes(16), (4,))])]),
        "an episode's observations of different shapes"),
    "a Parquet episode whose array declares more than its bytes": (
        lambda p: _parquet(p / "declares.parquet", "item",
                           [_episode([_msgpack_array(b"", (0, 1 << 62))] * 2)]),
        "an episode's array has no shape"),
    "a Parquet episode whose id is a map": (
        lambda p: _parquet(p / "id.parquet", "item", [_episode([_msgpack_array(bytes(16), (4,))] * 2, eid={"a": 1})]),
        "an episode whose id_ is not a string"),
    "a Parquet episode nested 100,000 deep": (
        lambda p: _parquet(p / "deep.parquet", "item", [b"\x91" * 100_000 + b"\xc0"]),
        "an episode that is not msgpack"),
    "a ragged Parquet obs cell": (
        lambda p: _parquet_obs(p / "ragged.parquet", [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], _pa("float64")),
        "obs: ragged rows (lists of different lengths)"),
    "Parquet obs cells of strings": (lambda p: _parquet_obs(p / "strings.parquet", [["a", "b"]], _pa("string")),
                                     "values of string, not numbers"),
    "a ragged JSON obs column": (
        lambda p: _lines(p, "ragged.json", [{"type": "SampleBatch", "obs": [[0, 0, 0, 0], [0, 0, 0]]}]),
        "obs: not a column of numbers"),
    "a JSON policy batch that is a list": (
        lambda p: _lines(p, "list.json", [{"type": "MultiAgentBatch", "policy_batches": {"p": [1, 2]}}]),
        "a policy batch that is not an object of columns"),
    "a JSON column packing a string": (
        lambda p: _lines(p, "string.json", [{"type": "SampleBatch", "obs": _packed(np.array(["x" * 40]))}]),
        "a compressed column holds an array of <U40"),
    "a JSON column packing one number": (
        lambda p: _lines(p, "scalar.json", [{"type": "SampleBatch", "obs": _packed(np.float32(1.0))}]),
        "not an array of rows of numbers"),
    "a JSON line of a 5,001-digit integer": (
        lambda p: _json_text(p / "digits.json", '{"type": "SampleBatch", "obs": [' + "9" * 5001 + "]}\n"),
        "line 1 is not JSON"),
    "an .npy of a 5,001-digit dimension": (lambda p: _npy_header(p / "digits.npy", "(2, " + "9" * 5001 + ")"),
                                           "not a numpy array file"),
    "an .npy of a 30-digit dimension": (lambda p: _npy_header(p / "dim.npy", "(2, " + "9" * 30 + ")"),
                                        "a declared shape with a dimension beyond"),
    "an .npy whose rows hold no values": (lambda p: _npy_header(p / "empty.npy", "(1099511627776, 0)"),
                                          "rows of shape [0], which hold no values"),
    "episode ids of NaN": (lambda p: _nan_ids(p / "nan.npz"), "an episode id that is NaN or infinite"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_file_that_would_end_in_an_internal_error_is_exit_2(tmp_path, case):
    """Each of these raised something other than ``InputError`` (TypeError, ValueError,
    RecursionError, an uncaught library error): type-checked before use, caught per decode, and
    said in one short line (a file's number is never formatted whole)."""
    build, fragment = BAD[case]
    path = build(tmp_path)
    _refused_by_reader(_read(tmp_path, path, recurrent=True), path, fragment)
