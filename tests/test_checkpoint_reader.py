"""RLlib checkpoints read without Ray and without running a pickle.

The fixtures under ``fixtures/rllib/checkpoints/`` were written by RLlib itself (2.9.3; ``ray25_*`` by 2.5.1)
(``fixtures/rllib/make_checkpoints.py``); ``expected.npz`` holds RLlib's own filtered observations.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from os import system
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from policy_export.errors import UnsafeCheckpointError
from policy_export.exporter.sources import checkpoint as ckpt
from policy_export.exporter.sources.safe_pickle import Record, loads, msgpack_loads

ROOT = Path(__file__).resolve().parent.parent
CASES = sorted(p.name for p in (ROOT / "fixtures/rllib/checkpoints").iterdir() if (p / "case.json").is_file())


def _case(name: str):
    here = ROOT / "fixtures/rllib/checkpoints" / name
    return here / "checkpoint", json.loads((here / "case.json").read_text()), np.load(here / "expected.npz")


def test_every_kind_of_checkpoint_is_here():
    kinds = {(_case(c)[1]["rllib_checkpoint"]["type"], _case(c)[1]["rllib_checkpoint"]["format"]) for c in CASES}
    assert kinds == {("Algorithm", "cloudpickle"), ("Algorithm", "msgpack"), ("Policy", "cloudpickle"),
                     ("Policy", "msgpack")}
    assert len(CASES) >= 9


@pytest.mark.parametrize("name", CASES)
def test_reads_what_rllib_wrote(name):
    path, case, expected = _case(name)
    read = ckpt.read_checkpoint(path)
    assert (read.type, read.format, read.ray_version) == (case["rllib_checkpoint"]["type"],
                                                           case["rllib_checkpoint"]["format"], case["ray_version"])
    assert sorted(read.policies) == case["policy_ids"]
    for pid, policy in read.policies.items():
        obs = _raw_observations(expected, pid, policy)
        assert policy.observation_space.shape == obs.shape[-len(policy.observation_space.shape):]
        weights = policy.weight_list if case.get("framework") == "tf2" else list(policy.weights.values())
        assert weights and all(w.dtype == np.float32 for w in weights)
        assert policy.framework == case.get("framework", "tf")
        want = case["filters"][pid]
        if want is None:
            assert policy.filter is None
            np.testing.assert_array_equal(expected[f"{pid}/filtered"], obs)
            continue
        if read.type == "Policy" and not case.get("connectors", True):
            # RLlib kept the filter in the algorithm's worker: the checkpoint has none, and says so
            assert policy.filter is None and "connectors off" in policy.filter_note
            continue
        # RLlib's ConcurrentMeanStdObservationFilterAgentConnector writes its state under its
        # parent's name (MeanStdObservationFilterAgentConnector): the same arithmetic
        kinds = {want["class"], "MeanStdFilter"} if want["class"] == "ConcurrentMeanStdFilter" else {want["class"]}
        assert policy.filter.kind in kinds
        assert (policy.filter.n, policy.filter.clip) == (want["n"], want["clip"])
        np.testing.assert_allclose(policy.filter.mean, want["mean"], rtol=1e-12)
        np.testing.assert_allclose(policy.filter.std, want["std"], rtol=1e-12)
        # RLlib's own filter output for the raw observations, to the last bit
        np.testing.assert_array_equal(policy.filter.apply(obs), expected[f"{pid}/filtered"])


def _raw_observations(expected: dict, pid: str, policy) -> np.ndarray:
    """The raw observations as the policy's flat input: a Dict case's samples flattened by
    gymnasium (Discrete one-hot, Box flattened, keys in order), as RLlib's preprocessor does."""
    if f"{pid}/obs" in expected:
        return expected[f"{pid}/obs"]
    leaves = {k.split("/", 2)[2]: v for k, v in expected.items() if k.startswith(f"{pid}/obs/")}
    space = policy.original_observation_space
    rows = len(next(iter(leaves.values())))
    return np.stack([gym.spaces.flatten(space, {k: v[i] for k, v in leaves.items()})
                     for i in range(rows)]).astype(np.float32)


def test_filter_source_follows_connectors():
    on = ckpt.read_checkpoint(_case("ppo_filter")[0]).policies["default_policy"].filter
    off = ckpt.read_checkpoint(_case("ppo_filter_no_connectors")[0]).policies["default_policy"].filter
    assert (on.source, off.source) == ("connector", "worker")


def test_policy_ids_and_sizes_of_a_multi_agent_checkpoint():
    policies = ckpt.read_checkpoint(_case("multi_agent")[0]).policies
    assert sorted(policies) == ["alpha", "beta"]
    assert policies["alpha"].weights["alpha/fc_1/kernel"].shape == (4, 16)
    assert policies["beta"].weights["beta/fc_2/kernel"].shape == (8, 8)


def test_box_action_space_and_sac_scalar_weight():
    normalize = ckpt.read_checkpoint(_case("ppo_normalize")[0]).policies["default_policy"]
    assert (normalize.action_space.low.tolist(), normalize.action_space.high.tolist()) == ([-2.0], [2.0])
    sac = ckpt.read_checkpoint(_case("sac_box")[0]).policies["default_policy"]
    assert sac.weights["default_policy/log_alpha"].shape == ()


def test_reads_with_ray_unimportable():
    code = ("import sys; sys.modules['ray'] = None\n"
            "from policy_export.exporter.sources.checkpoint import read_checkpoint\n"
            f"for c in {CASES!r}:\n"
            f"    read_checkpoint({str(ROOT / 'fixtures/rllib/checkpoints')!r} + '/' + c + '/checkpoint')\n"
            "assert sys.modules['ray'] is None and 'cloudpickle' not in sys.modules\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---------------------------------------------------------------------------------------- hostile

class _Payload:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("func", [os.system, eval, exec, getattr, __import__, subprocess.call])
def test_a_reduce_that_would_run_code_is_refused(tmp_path, func):
    marker = tmp_path / "ran"
    arg = f"touch {marker}" if func in (os.system, subprocess.call) else f"open({str(marker)!r}, 'w')"
    data = pickle.dumps({"weights": {}, "x": _Payload(func, arg) if func is not getattr else _Payload(func, 1, "real")})
    with pytest.raises(UnsafeCheckpointError, match=r"references .*(system|eval|exec|getattr|__import__|call)"):
        loads(data, "state.pkl")
    assert not marker.exists()


def test_a_function_pickled_by_value_is_never_built(tmp_path):
    cloudpickle = pytest.importorskip("cloudpickle")
    marker = tmp_path / "ran"
    where = str(marker)
    data = cloudpickle.dumps({"mapping": lambda *a: open(where, "w"), "n": np.arange(3)})
    state = loads(data, "state.pkl")
    assert isinstance(state["mapping"], Record) and state["mapping"].ref.startswith("cloudpickle.")
    state["mapping"]("agent")  # a record: a call only builds another record
    np.testing.assert_array_equal(state["n"], np.arange(3))
    assert not marker.exists()


def test_a_class_pickled_by_value_is_never_built(tmp_path):
    """RLlib pickles an eager DQN/SAC policy class by value: cloudpickle's skeleton of the class, its
    functions' code and the globals they use. What those refer to stays a name (a record), and the
    same global outside such a definition is still refused."""
    cloudpickle = pytest.importorskip("cloudpickle")
    marker = tmp_path / "ran"

    class EagerPolicy:  # defined here, so cloudpickle writes it by value
        where = str(marker)

        def __init__(self):
            system(f"touch {self.where}")

        def __reduce__(self):
            return system, (f"touch {self.where}",)

    data = cloudpickle.dumps({"policy_class": EagerPolicy, "n": np.arange(3)})
    assert b"_make_skeleton_class" in data and b"system" in data
    state = loads(data, "state.pkl")
    assert isinstance(state["policy_class"], Record) and state["policy_class"].args[1] == "EagerPolicy"
    state["policy_class"]()  # a record: a call only builds another record
    np.testing.assert_array_equal(state["n"], np.arange(3))
    assert not marker.exists()
    # a hand-made pickle calling os.system inside the arguments of cloudpickle's function builder
    crafted = (b"cray.cloudpickle.cloudpickle\n_make_function\n(cos\nsystem\n(V" + f"touch {marker}".encode()
               + b"\ntRtR.")
    assert isinstance(loads(crafted, "state.pkl"), Record) and not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="references os.system"):
        loads(b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.", "state.pkl")
    assert not marker.exists()


def _reconstruct_pickle(shape) -> bytes:
    """A pickle that asks numpy's ``_reconstruct`` for an array of ``shape`` (protocol 2)."""
    return (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + pickle.dumps(shape, 2)[2:-1]
            + b"C\x01b\x87R.")


def test_a_huge_declared_array_is_refused_before_allocation():
    with pytest.raises(UnsafeCheckpointError, match="shape"):
        loads(_reconstruct_pickle((1 << 40,)), "state.pkl")
    big = pickle.dumps(np.zeros(4, np.float32)).replace(b"\x04\x85", b"\x40\x85")
    with pytest.raises(UnsafeCheckpointError):
        loads(big, "state.pkl")


def test_msgpack_bombs_are_refused():
    with pytest.raises(UnsafeCheckpointError):
        msgpack_loads(b"\xdf\xff\xff\xff\xff", "state.msgpck")  # a map declaring 4 billion entries
    with pytest.raises(UnsafeCheckpointError):
        msgpack_loads(b"\x91" * 100_000 + b"\xc0", "state.msgpck")  # nesting past the decoder's stack
    msgpack = pytest.importorskip("msgpack")
    declared = msgpack.packb({"w": {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [1 << 40],
                                    b"data": b"\0" * 8}})
    with pytest.raises(UnsafeCheckpointError, match="do not hold"):
        msgpack_loads(declared, "state.msgpck")


@pytest.fixture
def copied(tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(_case("policy_cloudpickle")[0], target)
    return target


def test_a_symlinked_state_file_is_not_followed(copied, tmp_path):
    outside = tmp_path / "outside.pkl"
    shutil.copy(copied / "policy_state.pkl", outside)
    (copied / "policy_state.pkl").unlink()
    (copied / "policy_state.pkl").symlink_to(outside)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        ckpt.read_checkpoint(copied)


@pytest.mark.parametrize("state_file", ["../outside.pkl", "/etc/passwd", "sub/policy_state.pkl", 7])
def test_metadata_pointing_elsewhere_is_refused(copied, state_file):
    if state_file == "sub/policy_state.pkl":  # another file of the same name, inside the checkpoint
        (copied / "sub").mkdir()
        shutil.copy(copied / "policy_state.pkl", copied / "sub/policy_state.pkl")
    meta = json.loads((copied / "rllib_checkpoint.json").read_text())
    (copied / "rllib_checkpoint.json").write_text(json.dumps({**meta, "state_file": state_file}))
    with pytest.raises(UnsafeCheckpointError, match="state_file"):
        ckpt.read_checkpoint(copied)


def test_a_policy_id_that_is_a_path_is_refused(tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(_case("ppo_filter")[0], target)
    meta = json.loads((target / "rllib_checkpoint.json").read_text())
    (target / "rllib_checkpoint.json").write_text(json.dumps({**meta, "policy_ids": ["../../etc"]}))
    with pytest.raises(UnsafeCheckpointError, match="not a plain name"):
        ckpt.read_checkpoint(target)


def test_a_state_file_over_the_limit_is_not_read(copied, monkeypatch):
    monkeypatch.setattr(ckpt, "STATE_LIMIT", 1000)
    with pytest.raises(UnsafeCheckpointError, match="over 1000 bytes"):
        ckpt.read_checkpoint(copied)


@pytest.mark.parametrize("meta", [{"type": "Learner", "checkpoint_version": "1.1"},
                                  {"type": "Policy", "checkpoint_version": "2.0"},
                                  {"type": "Policy", "checkpoint_version": "1.1", "format": "json"}])
def test_unknown_checkpoint_kinds_are_named(copied, meta):
    (copied / "rllib_checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(UnsafeCheckpointError, match="Learner|2.0|json"):
        ckpt.read_checkpoint(copied)


def test_a_policy_without_a_readable_config_is_refused():
    root = ROOT / "fixtures/rllib/checkpoints/ppo_filter/checkpoint"
    parts = ("policies", "default_policy")
    state = ckpt._state(root, parts, ckpt._metadata(root, parts))
    assert ckpt.policy_from_state("default_policy", state, "here").config["model"]["fcnet_hiddens"] == [16, 16]
    state["policy_spec"]["config"] = None  # rebuilding from RLlib's defaults would build another network
    with pytest.raises(UnsafeCheckpointError, match="no readable config"):
        ckpt.policy_from_state("default_policy", state, "here")


def test_a_config_object_is_read_as_its_fields():
    policy = ckpt.read_checkpoint(ROOT / "fixtures/rllib/checkpoints/pg/checkpoint").policy()
    assert policy.policy_class.endswith("PGTF1Policy")  # a class pickled by reference
    assert policy.config["model"]["fcnet_hiddens"] == [16, 8] and policy.config["observation_filter"] == "MeanStdFilter"


@pytest.mark.parametrize("data,message", [
    (pickle.dumps(np.zeros(2, dtype=[("x", "<f8")])), "numpy dtype"),  # fields: offsets numpy does not check
    (pickle.dumps(np.zeros(2, dtype=object)), "numpy dtype"),
    # BUILD on a rebuilder: (None, {"__defaults__": (True, False)}) would rewrite the reader itself
    (b"\x80\x04cnumpy\ndtype\nN}\x8c\x0c__defaults__\x88\x89\x86s\x86b.", "sets the state of function"),
    (b"\x80\x04cbuiltins\nstr\nC\x01a\x8c\x04idna\x86R.", "not a readable pickle"),  # a decoding imports codecs
])
def test_what_a_pickle_may_build_is_checked(data, message):
    import sys

    before = set(sys.modules)
    with pytest.raises(UnsafeCheckpointError, match=message):
        loads(data, "state.pkl")
    assert not {m for m in set(sys.modules) - before if "idna" in m}


def test_plain_arrays_and_dtypes_still_read():
    for value in (np.arange(6, dtype=np.float32).reshape(2, 3), np.float64(2.5), np.dtype(">i4"),
                  np.array([b"ab", b"c"]), np.bool_(True)):
        for protocol in (2, 4, 5):
            got = loads(pickle.dumps(value, protocol=protocol), "state.pkl")
            assert type(got) is type(value) and np.array_equal(np.asarray(got), np.asarray(value))
