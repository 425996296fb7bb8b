"""Stable-Baselines3 model zips (``fixtures/sb3/``, written by SB3 2.9.2 and 2.0.0 with
``fixtures/sb3/make_sb3.py``) read without torch and SB3 and without running a pickle, each policy
rebuilt and checked against SB3's own recorded outputs (deterministic and sampled actions,
values, Q-values, distribution parameters, a recurrent policy stepped); exports through ONNX
Runtime; refusals; hostile zips."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from helpers import cli, one_line_error, snapshot
from sb3_matrix import (
    SB3, all_cases, case_record, export_case, expected_outputs, onnx_errors, passes, run_policy,
    source_options,
)

REBUILT = [(root, case) for root, case in all_cases() if case != "custom_extractor"]
PPO = SB3 / "ppo_cartpole/model.zip"


def _id(item) -> str:
    root, case = item
    return case if root == SB3 else f"{root.name}/{case}"


def _load(root: Path, case: str):
    from policy_export.exporter.sources.sb3.graph import load_sb3_policy
    from policy_export.exporter.sources.sb3.reader import read_sb3

    return load_sb3_policy(read_sb3(root / case / "model.zip", source_options(root, case).get("vec_normalize")))


def _session_runner(policy, outputs=None):
    outputs = outputs if outputs is not None else policy.deterministic_outputs

    def run(feeds):
        return policy.session.run(outputs, {policy.inputs[k]: v for k, v in feeds.items()})

    return run


def test_the_fixtures_cover_every_algorithm_and_two_releases():
    records = [case_record(root, case) for root, case in all_cases()]
    assert {r["versions"]["stable_baselines3"] for r in records} == {"2.9.2", "2.0.0"}
    algos = {r["algo"].rsplit(".", 1)[-1] for r in records}
    assert algos >= {"PPO", "A2C", "DQN", "SAC", "TD3", "DDPG", "RecurrentPPO", "MaskablePPO", "QRDQN", "TQC", "TRPO"}
    assert len(REBUILT) >= 30


@pytest.mark.parametrize("item", REBUILT, ids=_id)
def test_each_policy_computes_what_sb3_computed(item):
    """The rebuilt graph on the raw observations against ``predict(obs, deterministic=True)``,
    the values or Q-values and the distribution's parameters (a recurrent policy stepped)."""
    root, case = item
    policy, record = _load(root, case)
    try:
        errors = run_policy(_session_runner(policy), expected_outputs(root, case), case_record(root, case),
                            record["state_names"])
    finally:
        policy.close()
    assert passes(errors), errors
    assert record["weights_used"]


def test_the_algorithm_is_told_from_what_the_zip_holds():
    from policy_export.exporter.sources.sb3.reader import read_sb3

    for case, algorithm in (("ddpg_pendulum", "DDPG"), ("td3_pendulum", "TD3"), ("trpo_pendulum", "TRPO"),
                            ("a2c_mountaincar", "A2C"), ("ppo_pendulum", "PPO"), ("tqc_pendulum", "TQC")):
        model = read_sb3(SB3 / case / "model.zip", weights=False)
        assert model.algorithm == algorithm, case
    assert read_sb3(SB3 / "ddpg_pendulum/model.zip", weights=False).policy_class.endswith("td3.policies.TD3Policy")


@pytest.mark.parametrize("case", ["ppo_cnn", "recurrent_ppo_cartpole", "maskable_ppo", "sac_dict_vecnorm",
                                  "sb3_2.0.0/ppo_vecnorm", "ppo_multibinary_obs", "ppo_pendulum_sde"])
def test_model_onnx_matches_sb3(tmp_path, case):
    root, name = (SB3 / case).parent, Path(case).name
    out = export_case(root, name, tmp_path / "out")
    errors = onnx_errors(out, root, name)
    assert passes(errors), errors
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "sb3_zip"
    assert manifest["source"]["sb3_version"] == case_record(root, name)["versions"]["stable_baselines3"]


SAMPLED = ["ppo_cartpole", "ppo_pendulum", "ppo_pendulum_sde", "sac_pendulum", "sac_pendulum_sde", "maskable_ppo",
           "ppo_multibinary_action", "ppo_multidiscrete_action", "tqc_pendulum"]


@pytest.mark.parametrize("case", SAMPLED)
def test_sampled_actions_are_distributed_as_sb3_samples_them(case):
    """``explore`` on: 2,000 of the graph's samples for one observation against SB3's own 2,000
    (``predict(deterministic=False)``), by the exploration parity's two-sample tests."""
    from policy_export.exporter.parity.exploration import compare_samples
    from policy_export.signatures.keys import EXPLORE

    want = expected_outputs(SB3, case)
    policy, _ = _load(SB3, case)
    try:
        feeds = {"observations": np.repeat(want["samples_obs"], 2000, axis=0)}
        if "samples_action_masks" in want:
            feeds["action_masks"] = np.repeat(want["samples_action_masks"], 2000, axis=0)
        got = policy.session.run(policy.outputs["actions_0"], {**{policy.inputs[k]: v for k, v in feeds.items()},
                                                               policy.inputs[EXPLORE]: True})
    finally:
        policy.close()
    checks = compare_samples("session", policy.action_space, 1, {"actions_0": want["samples"]}, {"actions_0": got},
                             alpha=1e-4)
    assert checks and all(c.passed for c in checks), [c.describe() for c in checks if not c.passed]
    if case == "maskable_ppo":  # a masked action is never sampled
        allowed = np.flatnonzero(want["samples_action_masks"][0])
        assert set(np.unique(got)) <= set(allowed.tolist())


def test_greedy_policies_serve_no_exploration():
    policy, _ = _load(SB3, "dqn_cartpole")
    try:
        assert "explore" not in policy.inputs and "epsilon-greedily" in policy.explore_refused
    finally:
        policy.close()


def test_export_and_verify_an_sb3_zip_from_the_command_line(tmp_path):
    out = tmp_path / "out"
    done = cli("export", str(SB3 / "ppo_vecnorm/model.zip"), "--vec-normalize", str(SB3 / "ppo_vecnorm/vec_normalize.pkl"),
               "--out", str(out), "--formats", "onnx,tflite", "--samples", "200")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PPO (ActorCriticPolicy) behind VecNormalize" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["vec_normalize"]["clip_obs"] == 5.0
    assert cli("verify", str(out)).returncode == 0


def test_a_policy_of_the_users_own_is_refused_naming_it_and_the_other_routes(tmp_path):
    done = cli("export", str(SB3 / "custom_extractor/model.zip"), "--out", str(tmp_path / "out"))
    one_line_error(done, 2, "features_extractor_class is TinyExtractor, a class of your own pickled with its code")
    assert "MultiInputPolicy (CombinedExtractor)" in done.stderr and "--reference" in done.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_shows_the_policy_without_tensorflow_or_torch():
    code = ("import sys, json\n"
            "sys.modules['torch'] = None; sys.modules['stable_baselines3'] = None\n"
            "from policy_export.exporter.cli import main\n"
            f"rc = main(['inspect', {str(SB3 / 'recurrent_ppo_cartpole/model.zip')!r}, '--json'])\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
            "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout)
    assert shown["algorithm"] == "RecurrentPPO" and shown["postprocess"] == "argmax"
    assert "LSTM 8x1 (own LSTM)" in shown["network"]


def test_convert_needs_neither_torch_nor_sb3(tmp_path):
    code = ("import sys\n"
            "for name in ('torch', 'stable_baselines3', 'sb3_contrib', 'cloudpickle'): sys.modules[name] = None\n"
            "from policy_export.exporter.cli import main\n"
            f"sys.exit(main(['export', {str(SB3 / 'sac_dict/model.zip')!r}, '--out', {str(tmp_path / 'out')!r}, "
            "'--formats', 'onnx', '--samples', '50', '--explore-samples', '0', '--quiet']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out/model.onnx").is_file()


def test_the_python_api_takes_a_zip(tmp_path):
    from policy_export import export_source

    results = export_source(SB3 / "qrdqn_cartpole/model.zip", tmp_path / "out", formats=["onnx"], samples=50,
                            explore_samples=0)
    (result,) = results.values()
    assert result.parity.passed and result.manifest["source"]["algorithm"] == "QR-DQN"


# ---------------------------------------------------------------------------------------- hostile

class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _rewrite(zip_path: Path, target: Path, change=None, extra: list[tuple[zipfile.ZipInfo, bytes]] = ()) -> Path:
    """A copy of ``zip_path`` at ``target`` with members changed by ``change(name, data) -> data``
    and ``extra`` members added."""
    with zipfile.ZipFile(zip_path) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info, change(info.filename, data) if change else data)
        for info, data in extra:
            dst.writestr(info, data)
    return target


def _torch_zip(pickle_bytes: bytes, storages: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        z.writestr("archive/byteorder", b"little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


class _FakeStorage:  # pickles as torch.FloatStorage, by name
    __module__ = "torch"
    __qualname__ = "FloatStorage"


def _tensor_pickle(key: str, numel: int, offset: int, size: tuple, stride: tuple) -> bytes:
    """A state dict ``{"w": tensor}`` as torch pickles it (persistent id of a FloatStorage)."""
    import collections
    import types

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", _FakeStorage, key, "cpu", numel) if obj is STORAGE else None

    STORAGE = object()
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):  # pragma: no cover - never called, only named
        pass

    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch = types.ModuleType("torch")
    torch.FloatStorage, torch._utils = _FakeStorage, utils
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules.update({"torch": torch, "torch._utils": utils})
    try:
        class Tensor:
            def __reduce__(self):
                return _rebuild_tensor_v2, (STORAGE, offset, size, stride, False, collections.OrderedDict())

        buffer = io.BytesIO()
        Pickler(buffer, protocol=2).dump(collections.OrderedDict(w=Tensor()))
        return buffer.getvalue()
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _policy_pth(pickle_bytes: bytes, storages: dict[str, bytes]):
    blob = _torch_zip(pickle_bytes, storages)
    return lambda name, data: blob if name == "policy.pth" else data


def _serialized_payload(marker: Path):
    payload = json.dumps({":type:": "<class 'gymnasium.spaces.box.Box'>",
                          ":serialized:": __import__("base64").b64encode(pickle.dumps(_Payload(marker))).decode()})

    def change(name, data):
        if name != "data":
            return data
        doc = json.loads(data)
        doc["observation_space"] = json.loads(payload)
        return json.dumps(doc).encode()
    return change


def _member(name: str, mode: int = 0o100644) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    return info


HOSTILE = {
    "a :serialized: payload that would run a command": (
        lambda t: _serialized_payload(t / "ran"), (), "posix.system, which is not on the allowlist"),
    "a policy.pth that would run a command": (
        lambda t: _policy_pth(pickle.dumps(_Payload(t / "ran"), protocol=2), {}), (),
        "posix.system, which is not on the allowlist"),
    "a storage offset past its bytes": (
        lambda t: _policy_pth(_tensor_pickle("0", 4, 2, (4,), (1,)), {"0": b"\0" * 16}), (),
        "reads past its storage of 4 values"),
    "a storage smaller than it says": (
        lambda t: _policy_pth(_tensor_pickle("0", 1 << 20, 0, (4,), (1,)), {"0": b"\0" * 16}), (),
        "holds 16 bytes, not the 1048576 values of FloatStorage"),
    "a huge declared tensor over one value": (
        lambda t: _policy_pth(_tensor_pickle("0", 1, 0, (1 << 31, 1 << 31), (0, 0)), {"0": b"\0" * 4}), (),
        "MiB of arrays, the tensor budget of one read; nothing was allocated"),
    "a symbolic link member": (None, [(_member("evil", 0o120777), b"/etc/passwd")], "is a symbolic link"),
    "a ../ member": (None, [(_member("../evil"), b"x")], "is not a plain relative name"),
    "a duplicated member": (None, [(_member("data"), b"{}")], "appears twice"),
    "a member of a folder": (None, [(_member("sub/data"), b"x")], "is not one this archive holds"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_zip_is_refused_with_nothing_run_or_written(tmp_path, kind):
    make, extra, fragment = HOSTILE[kind]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicated name it writes
        model = _rewrite(PPO, tmp_path / "model.zip", make(tmp_path) if make else None, extra)
    before = snapshot(tmp_path)
    for command in (["inspect", str(model)], ["export", str(model), "--out", str(tmp_path / "out")]):
        one_line_error(cli(*command), 2, fragment)
    assert not (tmp_path / "ran").exists() and snapshot(tmp_path) == before


def _bomb(path: Path, declared: int | None = None) -> Path:
    """A model zip whose ``data`` member deflates 256 MiB of zeros into a few hundred kilobytes;
    ``declared`` rewrites the size its headers declare (a header that lies)."""
    inflated = 256 << 20
    with zipfile.ZipFile(PPO) as src:
        policy = src.read("policy.pth")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("policy.pth", policy)
        with z.open("data", "w") as f:
            chunk = b"\0" * (1 << 24)
            for _ in range(inflated // len(chunk)):
                f.write(chunk)
    if declared is not None:
        raw = bytearray(path.read_bytes())
        for signature, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # local header, directory entry
            start = raw.rfind(signature)  # "data" is the last member of both
            raw[start + at:start + at + 4] = declared.to_bytes(4, "little")
        path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("declared,fragment", [(None, "declares 268435456 bytes, more than its limit"),
                                               (100, "inflates past its declared 100 bytes")])
def test_a_zip_bomb_is_refused_in_bounded_time_and_memory(tmp_path, declared, fragment):
    model = _bomb(tmp_path / "model.zip", declared)
    assert model.stat().st_size < 2 << 20
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    script = Path(sys.executable).parent / "policy-export"
    done = subprocess.run([str(script), "inspect", str(model)], capture_output=True, text=True, timeout=60,
                          preexec_fn=limit)
    one_line_error(done, 2, fragment)


def test_a_file_that_is_not_a_zip_is_refused(tmp_path):
    model = tmp_path / "model.zip"
    model.write_bytes(b"not a zip at all\n" * 10)
    one_line_error(cli("inspect", str(model)), 2, "is not a zip archive")
    link = tmp_path / "link.zip"
    link.symlink_to(SB3 / "ppo_cartpole/model.zip")
    one_line_error(cli("inspect", str(link)), 2, "a symbolic link is never followed")


def test_a_vec_normalize_file_that_would_run_a_command_or_does_not_fit_is_refused(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "vec_normalize.pkl"
    bad.write_bytes(pickle.dumps(_Payload(marker)))
    done = cli("export", str(SB3 / "ppo_vecnorm/model.zip"), "--vec-normalize", str(bad), "--out", str(tmp_path / "o"))
    one_line_error(done, 2, "system, which is not on the allowlist")
    assert not marker.exists()
    other = cli("export", str(SB3 / "ppo_cartpole/model.zip"), "--vec-normalize",
                str(SB3 / "ppo_vecnorm/vec_normalize.pkl"), "--out", str(tmp_path / "o"))
    one_line_error(other, 2, "statistics of shape [3] for observations Box")
    assert not (tmp_path / "o").exists()


def test_the_torch_reader_reads_views_and_dtypes_as_torch_saved_them():
    """A state dict of views, a transpose, a scalar and several dtypes, as torch 2.13 wrote it."""
    from policy_export.exporter.sources.torchfile import read_state_dict
    from policy_export.exporter.sources.sb3.reader import open_zip

    with open_zip(SB3 / "ppo_cnn/model.zip") as archive:
        weights = read_state_dict(archive.read("policy.pth"), "policy.pth")
    shared = [k for k in weights if k.startswith("features_extractor.")]
    assert shared and all(np.array_equal(weights[k], weights["pi_" + k]) for k in shared)
    assert weights["features_extractor.cnn.0.weight"].shape == (32, 3, 8, 8)
    assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in weights.values())
