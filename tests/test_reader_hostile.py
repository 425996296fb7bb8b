"""Hostile RLlib checkpoints: every file is written by the attacker, each test feeds one to the reader.

Each case is a real crafted checkpoint directory (``rllib_checkpoint.json`` and a state file)
read with :func:`read_checkpoint` or the CLI, asserting the refusal, a short message, and that
time and memory stay bounded.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import messages
from policy_export.errors import UnsafeCheckpointError
from policy_export.exporter.sources.checkpoint import read_checkpoint
from policy_export.exporter.sources.safe_pickle import OBJECTS_LIMIT, ReadBudget, loads

PLACEHOLDER = "\x00crafted\x00"
PPO = "ray.rllib.algorithms.ppo.ppo_tf_policy.PPOTF1Policy"


def _ser(array: np.ndarray) -> str:
    """RLlib's ``_serialize_ndarray``: base64(zlib(npy))."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(zlib.compress(buf.getvalue(), 9)).decode()


def _box(n: int = 4) -> dict:
    return {"space": "box", "low": _ser(np.full(n, -1.0, np.float32)), "high": _ser(np.full(n, 1.0, np.float32)),
            "shape": [n], "dtype": "float32"}


def _filter(num_pushes=5, mean=None, m2=None, **params) -> dict:
    stats = {"num_pushes": num_pushes, "mean_array": _ser(np.zeros(4) if mean is None else mean),
             "std_array": _ser(np.full(4, 8.0) if m2 is None else m2)}
    entry = ("MeanStdObservationFilterAgentConnector", {"running_stats": [stats], "clip": 10.0, **params})
    return {"agent": ("AgentConnectorPipeline", [entry])}


def _state(weights=None, spec=None, config=None, **top) -> dict:
    """A Policy checkpoint's state as RLlib writes it, in plain data (which pickle writes itself)."""
    return {"weights": weights if weights is not None else {"p/fc_1/kernel": np.ones((4, 2), np.float32)},
            "global_timestep": 3,
            "policy_spec": {"observation_space": {"space": _box()},
                            "action_space": {"space": {"space": "discrete", "n": 2}}, "policy_class": PPO,
                            "config": {"model": {"fcnet_hiddens": [2]}, "normalize_actions": True, **(config or {})},
                            **(spec or {})},
            **top}


def _pickle(state: dict, fragment: bytes | None = None) -> bytes:
    """``state`` pickled (protocol 2), with the placeholder string replaced by a crafted ``fragment``
    (opcodes that push one value; its memo slots are high, apart from the pickler's own)."""
    data = pickle.dumps(state, protocol=2)
    if fragment is None:
        return data
    raw = PLACEHOLDER.encode()
    target = b"X" + struct.pack("<I", len(raw)) + raw
    assert data.count(target) == 1
    return data.replace(target, fragment)


def _checkpoint(tmp_path: Path, data: bytes, meta: dict | bytes | None = None, name: str = "policy_state.pkl",
                folder: str = "ck") -> Path:
    target = tmp_path / folder
    target.mkdir()
    meta = meta if meta is not None else {"type": "Policy", "checkpoint_version": "1.1", "format": "cloudpickle",
                                          "ray_version": "2.9.3"}
    (target / "rllib_checkpoint.json").write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    (target / name).write_bytes(data)
    return target


def _refused(path: Path, match: str, budget: ReadBudget | None = None, seconds: float = 2.0,
             peak_mb: float | None = None) -> str:
    """Read ``path``: refused with ``match`` in a short message, within ``seconds`` and (when
    given) ``peak_mb`` MiB of Python and numpy allocations (tracemalloc's peak)."""
    if peak_mb is not None:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(UnsafeCheckpointError, match=match) as caught:
            read_checkpoint(path, budget)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] / (1 << 20) if peak_mb is not None else 0.0
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert len(message) < 600, message[:2000]
    assert elapsed < seconds, f"{elapsed:.2f} s"
    assert peak_mb is None or peak < peak_mb, f"{peak:.1f} MiB"
    return message


def test_the_crafted_state_reads_when_nothing_is_crafted(tmp_path):
    read = read_checkpoint(_checkpoint(tmp_path, _pickle(_state(connector_configs=_filter()))))
    policy = read.policy()
    assert (policy.policy_class, policy.global_timestep, policy.filter.n, policy.filter.clip) == (PPO, 3, 5, 10.0)
    assert policy.observation_space.shape == (4,) and policy.weights["p/fc_1/kernel"].shape == (4, 2)


# ------------------------------------------------------------------------ 1. numpy dtype state

def _dtype_bomb(twice: bool, elsize: int = 1 << 20) -> bytes:
    """An ``S1`` dtype (memo 0x7f000001) used by a one-byte array, then given an item size of
    ``elsize`` by a BUILD (after its own first BUILD when ``twice``): numpy's ``__setstate__``
    would make the array read ``elsize`` bytes from a one-byte buffer."""
    def put(i: int) -> bytes:
        return b"r" + struct.pack("<I", 0x7F000000 + i)

    def get(i: int) -> bytes:
        return b"j" + struct.pack("<I", 0x7F000000 + i)

    state = b"(K\x03X\x01\x00\x00\x00|NNNK\x01K\x01K\x00tb"
    p = b"cnumpy\ndtype\n(X\x02\x00\x00\x00S1\x89\x88tR" + put(1) + (state if twice else b"") + b"0"
    p += b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R"
    p += b"(K\x01K\x01\x85" + get(1) + b"\x89C\x01atb" + put(2) + b"0"
    p += get(1) + b"(K\x03X\x01\x00\x00\x00|NNNJ" + struct.pack("<i", elsize) + b"K\x01K\x00tb0"
    return p + get(2)


@pytest.mark.parametrize("twice", [True, False], ids=["second-build", "build-after-use"])
def test_a_dtype_state_never_resizes_an_array(tmp_path, twice):
    path = _checkpoint(tmp_path, _pickle(_state(spec={"observation_space": {"space": {"space": PLACEHOLDER}}}),
                                         _dtype_bomb(twice)))
    message = _refused(path, "dtype|take a state")
    assert "once" in message if twice else "item size" in message


def test_the_cli_refuses_a_dtype_bomb_in_one_line(tmp_path):
    """The 2 KB checkpoint that made ``inspect`` and ``inspect --json`` crash (exit 139); with an item
    size of 1 MiB they printed megabytes of process memory instead."""
    path = _checkpoint(tmp_path, _pickle(_state(spec={"observation_space": {"space": {"space": PLACEHOLDER}}}),
                                         _dtype_bomb(False, 100_000_000)))
    assert (path / "policy_state.pkl").stat().st_size < 2048
    for extra in ([], ["--json"]):
        out = subprocess.run([sys.executable, "-m", "policy_export", "inspect", *extra, str(path)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (out.returncode, out.stderr[-1000:])
        assert out.stdout == "" and len(messages(out.stderr)) == 1 and len(out.stderr) < 600
        assert "dtype" in out.stderr and "Traceback" not in out.stderr


def test_an_array_is_never_refilled_under_a_view(tmp_path):
    """A filled array, an array made from its memory, then the first filled again: numpy would free
    the memory the second still reads."""
    n = 4096
    p = pickle.dumps(np.full(n, 1.5), 2)[2:-1] + b"r\x01\x00\x00\x7f"
    p += b"cnumpy._core.numeric\n_frombuffer\n(j\x01\x00\x00\x7fX\x02\x00\x00\x00f8M" + struct.pack("<H", n)
    p += b"\x85X\x01\x00\x00\x00CtR0j\x01\x00\x00\x7f(K\x01K\x01\x85cnumpy\ndtype\n(X\x02\x00\x00\x00f8\x89\x88tR"
    p += b"\x89C\x08" + b"\0" * 8 + b"tb"
    path = _checkpoint(tmp_path, _pickle(_state(weights={"w": PLACEHOLDER}), p))
    _refused(path, "only from bytes")
    # the same refill without the view: an array is filled once
    p = pickle.dumps(np.full(n, 1.5), 2)[2:-1] + b"(K\x01K\x01\x85cnumpy\ndtype\n(X\x02\x00\x00\x00f8\x89\x88tR"
    p += b"\x89C\x08" + b"\0" * 8 + b"tb"
    _refused(_checkpoint(tmp_path, _pickle(_state(weights={"w": PLACEHOLDER}), p), folder="again"), "take a state")


def test_byte_orders_still_read_through_the_memo():
    big = [np.arange(3, dtype=">i2"), np.arange(2, dtype=">i2"), np.dtype(">f8"), np.arange(4, dtype="<f4")]
    for protocol in (2, 4, 5):
        got = loads(pickle.dumps(big, protocol), "state.pkl")
        assert [np.asarray(g).tolist() for g in got[:2]] == [[0, 1, 2], [0, 1]] and got[2] == np.dtype(">f8")
        np.testing.assert_array_equal(got[3], np.arange(4, dtype="<f4"))


# ------------------------------------------------------------------------ 2. budgets

def _shared(levels: int = 48) -> list:
    """A list whose repr has 2**levels entries, pickled in a few hundred bytes."""
    value: list = []
    for _ in range(levels):
        value = [value, value]
    return value


@pytest.mark.parametrize("where,match", [  # wherever it stands, the read refuses it before anything walks it
    ("kind", "holds values that expand to more than 262144 values"),
    ("policy_class", "holds values that expand to more than 262144 values"),
    ("custom_model", "holds values that expand to more than 262144 values"),
    ("clip", "holds values that expand to more than 262144 values"),
    ("str", "calls str on list"),
], ids=lambda v: v if v in ("kind", "policy_class", "custom_model", "clip", "str") else "")
def test_shared_references_are_never_expanded(tmp_path, where, match):
    bomb = _shared()
    state = {"kind": _state(spec={"observation_space": {"space": {"space": bomb}}}),
             "policy_class": _state(spec={"policy_class": bomb}),
             "custom_model": _state(config={"model": {"custom_model": bomb}}),
             "clip": _state(connector_configs=_filter(clip=bomb)),
             "str": _state(spec={"policy_class": PLACEHOLDER})}[where]
    fragment = b"cbuiltins\nstr\n" + pickle.dumps(bomb, 2)[2:-1] + b"\x85R" if where == "str" else None
    data = _pickle(state, fragment)
    assert len(data) < 8192
    _refused(_checkpoint(tmp_path, data), match, peak_mb=16)


def test_chained_record_calls_are_bounded(tmp_path):
    fragment = b"cray.rllib.x\ny\n" + b")R" * 50_000
    _refused(_checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PLACEHOLDER}), fragment)),
             r"more than 8 calls deep", peak_mb=16)


def _deep_stack(items: int) -> bytes:
    """``items`` values on the stack while as many globals are resolved (each one scanned the whole
    stack before), popped after: one value pushed."""
    return b"(" + b"N" * items + b"cray.rllib.x\ny\n0" * items + b"1N"


def test_resolving_globals_over_a_deep_stack_is_linear(tmp_path):
    path = _checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PLACEHOLDER}), _deep_stack(40_000)))
    _refused(path, "is not a class name", seconds=3.0)  # read to the end, in linear time


def test_the_time_budget_stops_a_long_read(tmp_path):
    path = _checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PLACEHOLDER}), _deep_stack(400_000)))
    _refused(path, r"longer than 0.05 s", ReadBudget(seconds=0.05), seconds=1.0)


def test_the_object_budget_stops_a_pickle_of_many_small_objects(tmp_path):
    fragment = b"(" + b"}" * 150_000 + b"l"
    path = _checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PLACEHOLDER}), fragment))
    _refused(path, "more than 100000 objects", ReadBudget(objects=100_000), peak_mb=40)


def test_the_default_object_budget_ends_a_pickle_of_millions_of_objects(tmp_path):
    fragment = b"(" + b"}" * (OBJECTS_LIMIT + 100_000) + b"l"
    path = _checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PLACEHOLDER}), fragment))
    _refused(path, f"more than {OBJECTS_LIMIT} objects", seconds=6.0)


@pytest.mark.parametrize("fragment,match", [
    (b"\x96" + struct.pack("<Q", 1 << 30), "declares a bytearray of 1073741824 bytes"),  # allocated before reading
    (b"cnumpy\ndtype\n(X\x02\x00\x00\x00S0\x89\x88tR", "numpy dtype"),  # no bytes per item: any shape fits
], ids=["bytearray8", "S0"])
def test_a_declared_size_never_allocates_beyond_the_file(tmp_path, fragment, match):
    path = _checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PLACEHOLDER}), fragment))
    _refused(path, match, peak_mb=16)


def test_a_msgpack_shape_of_huge_dims_is_refused_before_multiplying(tmp_path):
    msgpack = pytest.importorskip("msgpack")
    value = {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [(1 << 64) - 1] * 160_000, b"data": b""}
    data = msgpack.packb({"weights": {"w": value}}, use_bin_type=True)
    meta = {"type": "Policy", "checkpoint_version": "1.1", "format": "msgpack"}
    _refused(_checkpoint(tmp_path, data, meta, "policy_state.msgpck"), "at most 32", seconds=3.0, peak_mb=64)


def test_one_zlib_string_shared_by_many_leaves_is_decoded_within_budget(tmp_path):
    big = _ser(np.zeros(1 << 20, np.float32))  # 4 MiB inflated from a few KiB; pickled once, shared by memo
    leaf = {"space": "box", "low": big, "high": big, "shape": [1 << 20], "dtype": "float32"}
    state = _state(spec={"observation_space": {"space": {"space": "tuple", "spaces": [leaf] * 200}}})
    data = _pickle(state)
    assert len(data) < 64 << 10
    _refused(_checkpoint(tmp_path, data), "decoding budget", ReadBudget(decoded=32 << 20), peak_mb=64)
    # with the default budget, the space's element limit ends it first (after 16 leaves)
    _refused(_checkpoint(tmp_path, data, folder="default"), "elements exceeds the limit", seconds=5.0, peak_mb=200)


@pytest.mark.parametrize("space,match", [
    ({"space": "dict", "spaces": {f"k{i}": {"space": "discrete", "n": 2} for i in range(5000)}}, "at most 1024"),
    ({"space": "tuple", "spaces": [{"space": "dict", "spaces": {f"k{i}": {"space": "discrete", "n": 2}
                                                                for i in range(600)}}] * 2}, "more than 1024 leaf"),
    ({"space": "box", "low": _ser(np.zeros(1)), "high": _ser(np.ones(1)), "shape": [1 << 40], "dtype": "float32"},
     "space dimension"),
    ({"space": "discrete", "n": True}, "Discrete n"),
], ids=lambda v: v.replace(" ", "-") if isinstance(v, str) else "")
def test_checkpoint_spaces_obey_the_spec_limits(tmp_path, space, match):
    _refused(_checkpoint(tmp_path, _pickle(_state(spec={"observation_space": {"space": space}}))), match)


def test_spaces_nested_past_the_depth_limit_are_refused(tmp_path):
    space = {"space": "discrete", "n": 2}
    for _ in range(40):
        space = {"space": "tuple", "spaces": [space]}
    _refused(_checkpoint(tmp_path, _pickle(_state(spec={"observation_space": {"space": space}}))), "deeper than")


# ------------------------------------------------------------------------ 3. values

@pytest.mark.parametrize("state,match", [
    (_state(weights={"w": np.array([1.0, np.nan], np.float32)}), "weight w holds non-finite"),
    (_state(weights=[np.array([np.inf])]), "weight #0 holds non-finite"),
    (_state(connector_configs=_filter(mean=np.array([0.0, np.nan, 0, 0]))), "mean holds non-finite"),
    (_state(connector_configs=_filter(m2=np.array([np.inf, 1, 1, 1]))), "M2 holds non-finite"),
    (_state(connector_configs=_filter(clip=float("inf"))), "clip inf"),
    (_state(connector_configs=_filter(clip=float("nan"))), "clip nan"),
    (_state(connector_configs=_filter(num_pushes=-1)), "count -1"),
    (_state(connector_configs=_filter(num_pushes=1 << 63)), "count 9223372036854775808"),
    (_state(connector_configs=_filter(num_pushes=True)), "count True"),
    (_state(connector_configs=_filter(demean="no")), "demean is str"),
    (_state(global_timestep=1 << 70), "global_timestep"),
    (_state(global_timestep=2.5), "global_timestep"),
    (_state(config={"normalize_actions": "false"}), "normalize_actions is str"),
    (_state(config={"model": {"use_lstm": [0]}}), "model.use_lstm is list"),
], ids=lambda v: v.replace(" ", "-") if isinstance(v, str) else "")
def test_values_out_of_range_are_refused(tmp_path, state, match):
    _refused(_checkpoint(tmp_path, _pickle(state)), match)


# ------------------------------------------------------------------------ 4. names and metadata

def test_names_with_a_trailing_newline_are_refused(tmp_path):
    meta = {"type": "Algorithm", "checkpoint_version": "1.1", "format": "cloudpickle", "policy_ids": ["alpha\n"]}
    _refused(_checkpoint(tmp_path, pickle.dumps({}), meta, "algorithm_state.pkl"), "not a plain name")
    skeleton = b"cray.cloudpickle.cloudpickle\n_make_skeleton_class\n(NX\x05\x00\x00\x00Evil\ntR"
    _refused(_checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PLACEHOLDER}), skeleton), folder="a"),
             "not a plain class name")
    _refused(_checkpoint(tmp_path, _pickle(_state(spec={"policy_class": PPO + "\n"})), folder="b"), "not a class name")


@pytest.mark.parametrize("meta,match", [
    (b'{"type": "Policy", "type": "Policy", "checkpoint_version": "1.1"}', "duplicate key"),
    (b'\xef\xbb\xbf{"type": "Policy", "checkpoint_version": "1.1"}', "strict JSON"),
    (b'{"type": "Policy", "checkpoint_version": NaN}', "strict JSON"),
], ids=lambda v: v.replace(" ", "-") if isinstance(v, str) else "")
def test_the_metadata_is_read_strictly(tmp_path, meta, match):
    _refused(_checkpoint(tmp_path, _pickle(_state()), meta), match)
