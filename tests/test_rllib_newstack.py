"""RLlib's new API stack: checkpoints RLlib 2.40 and 2.60 wrote (``fixtures/rllib/newstack/``, made by
``fixtures/rllib/make_newstack.py``) read without ray, torch or pickle, each default module rebuilt
and checked against RLlib's own recorded outputs; exports through ONNX Runtime; refusals; hostile files."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT
from helpers import cli, one_line_error, snapshot
from newstack_matrix import (
    NEWSTACK, all_cases, case_record, export_case, expected_outputs, module_ids, onnx_errors, passes, run_policy,
    source_options,
)
from policy_export.errors import UnsafeCheckpointError

REBUILT = [(root, case, mid) for root, case in all_cases() if case != "custom_module"
           for mid in module_ids(root, case)]


def _id(item) -> str:
    root, case, mid = item
    return f"{'ray240/' if root.name == 'ray240' else ''}{case}/{mid}"


def test_the_fixtures_cover_both_ray_releases_and_every_family():
    records = [case_record(root, case) for root, case in all_cases()]
    assert {r["ray_version"] for r in records} == {"2.40.0", "2.60.0"}
    assert {r["algo"] for r in records} >= {"PPO", "APPO", "IMPALA", "DQN", "SAC"}
    assert len(REBUILT) >= 40


@pytest.mark.parametrize("item", REBUILT, ids=_id)
def test_each_module_computes_what_rllib_computed(item):
    """The rebuilt graph on RLlib's raw observations against RLlib's ``forward_inference``,
    ``compute_values`` and the environment's action (an LSTM stepped with its own state)."""
    from policy_export.exporter.sources.rlmodule.graph import load_module_policy
    from policy_export.exporter.sources.rlmodule.reader import read_module_checkpoint

    root, case, mid = item
    checkpoint = read_module_checkpoint(root / case / "checkpoint")
    options = source_options(root, case, mid)
    policy, record = load_module_policy(checkpoint, checkpoint.module(mid), filter_agent=options.get("filter_agent"))
    try:
        outputs = policy.deterministic_outputs

        def run(feeds):
            return policy.session.run(outputs, {policy.inputs[k]: v for k, v in feeds.items()})

        errors = run_policy(run, expected_outputs(root, case), mid, record["state_names"])
    finally:
        policy.close()
    assert passes(errors), errors
    expected = expected_outputs(root, case)
    if f"{mid}/vf_preds" in expected:
        assert "vf_preds" in errors  # the critic is checked where RLlib recorded it
    assert record["weights_used"] and not any(w.startswith(("_target", "_old", "target_")) for w in record["weights_used"])


@pytest.mark.parametrize("case,mid", [("ppo_box", "default_policy"), ("ray240/ppo_lstm", "default_policy"),
                                      ("ray240/dqn_distributional", "default_policy"), ("sac_box", "default_policy"),
                                      ("ppo_flatten", "default_policy"), ("multi_agent_filter", "p1")])
def test_model_onnx_matches_rllib(tmp_path, case, mid):
    root, name = (NEWSTACK / case).parent, Path(case).name
    out = export_case(root, name, mid, tmp_path / "out")
    errors = onnx_errors(out, root, name, mid)
    assert passes(errors), errors
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "rllib_module_checkpoint"
    assert manifest["source"]["ray_version"] == case_record(root, name)["ray_version"]


def test_convert_exports_every_module_of_a_multi_agent_checkpoint(tmp_path):
    out = tmp_path / "zoo"
    done = cli("convert", str(NEWSTACK / "multi_agent/checkpoint"), "--out", str(out), "--all-policies",
               "--formats", "saved_model,onnx", "--samples", "100", "--explore-samples", "0", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["p0", "p1"]
    for mid in ("p0", "p1"):
        assert passes(onnx_errors(out / mid, NEWSTACK, "multi_agent", mid))
    shapes = [json.loads((out / m / "manifest.json").read_text())["source"]["weights_used"] for m in ("p0", "p1")]
    assert len(shapes[0]) != len(shapes[1])  # p1 has two hidden layers


def test_a_checkpoint_saved_with_a_relative_path_and_moved_converts(tmp_path):
    moved = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_relative_moved/checkpoint", moved)
    assert case_record(NEWSTACK, "ppo_relative_moved")["saved_with_relative_path"] is True
    done = cli("export", str(moved), "--out", str(tmp_path / "out"), "--formats", "onnx", "--samples", "50",
               "--explore-samples", "0", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    assert passes(onnx_errors(tmp_path / "out", NEWSTACK, "ppo_relative_moved", "default_policy"))


def test_module_only_layouts_convert(tmp_path):
    single = NEWSTACK / "module_only/checkpoint"
    done = cli("export", str(single), "--out", str(tmp_path / "one"), "--formats", "onnx", "--samples", "50",
               "--explore-samples", "0", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((tmp_path / "one/manifest.json").read_text())
    assert manifest["source"]["layout"] == "rl_module"
    assert "vf_preds" not in [o["key"] for o in manifest["contract"]["outputs"]]  # an env runner's copy: no critic
    assert passes(onnx_errors(tmp_path / "one", NEWSTACK, "module_only", "default_policy"))
    done = cli("export", str(NEWSTACK / "ray240/multi_module_only/checkpoint/p1"), "--out", str(tmp_path / "p1"),
               "--formats", "onnx", "--samples", "50", "--explore-samples", "0", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "p1/manifest.json").read_text())["source"]["module_id"] == "p1"


def test_inspect_shows_modules_and_connectors_without_tensorflow():
    code = ("import sys, io, contextlib\n"
            "from policy_export.exporter.cli import main\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            f"    code = main(['inspect', {str(NEWSTACK / 'ppo_filter/checkpoint')!r}, '--json'])\n"
            "print(code, 'tensorflow' in sys.modules, 'torch' in sys.modules)\n"
            "print(buf.getvalue())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    first, _, rest = done.stdout.partition("\n")
    assert first == "0 False False", done.stderr[-2000:]
    shown = json.loads(rest)
    assert shown["kind"] == "rllib_module_checkpoint" and shown["ray_version"] == "2.60.0"
    assert shown["connectors"]["env_to_module"][0] == "MeanStdFilter"
    assert "NormalizeAndClipActions" in shown["connectors"]["module_to_env"]
    module = shown["modules"][0]
    assert module["module_id"] == "default_policy" and module["observation_filter"]["count"] == 136
    assert module["network"].startswith("actor-critic: MLP [16] tanh, separate value branch")


def test_convert_needs_neither_torch_nor_ray(tmp_path):
    """An import of torch or ray fails in this process, as where neither is installed."""
    out = tmp_path / "out"
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'ray'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from policy_export.exporter.cli import main\n"
            f"code = main(['convert', {str(NEWSTACK / 'ray240/ppo_lstm/checkpoint')!r}, '--out', {str(out)!r}, "
            "'--formats', 'saved_model,onnx', '--samples', '50', '--explore-samples', '0', '-q'])\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')]\n"
            "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert passes(onnx_errors(out, NEWSTACK / "ray240", "ppo_lstm", "default_policy"))


def test_a_custom_module_is_refused_saying_what_is_supported(tmp_path):
    done = cli("convert", str(NEWSTACK / "custom_module/checkpoint"), "--out", str(tmp_path / "out"))
    one_line_error(done, 2, "MyTorchModule (a class of your own, pickled with its code)")
    assert "RLlib's default modules of PPO, APPO, IMPALA" in done.stderr and "torch.onnx" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_filter_kept_per_agent_needs_the_agent_named(tmp_path):
    done = cli("convert", str(NEWSTACK / "multi_agent_filter/checkpoint"), "--out", str(tmp_path / "out"),
               "--policy-id", "p0")
    one_line_error(done, 2, "--filter-agent")
    done = cli("convert", str(NEWSTACK / "multi_agent_filter/checkpoint"), "--out", str(tmp_path / "out"),
               "--policy-id", "p0", "--filter-agent", "7")
    one_line_error(done, 2, "holds no agent '7'; its agents: 0, 1")
    assert not (tmp_path / "out").exists()


def test_an_option_of_the_new_stack_is_refused_for_another_source(tmp_path):
    done = cli("convert", str(ROOT / "fixtures/rllib/checkpoints/ppo_filter/checkpoint"), "--out",
               str(tmp_path / "out"), "--filter-agent", "0")
    one_line_error(done, 2, "--filter-agent applies to an RLlib new API stack checkpoint (torch RLModules) only")


def test_a_weight_of_another_shape_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_discrete/checkpoint", ckpt)
    state = ckpt / "learner_group/learner/rl_module/default_policy/module_state.pkl"
    from policy_export.exporter.sources.safe_pickle import loads

    weights = loads(state.read_bytes(), "state")
    weights["pi.net.mlp.0.weight"] = np.zeros((3, 16), np.float32)
    state.write_bytes(pickle.dumps(weights, protocol=5))
    done = cli("convert", str(ckpt), "--out", str(tmp_path / "out"), "--formats", "onnx")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pi.net.mlp.0.weight has shape [3, 16], the network implies [2, 16]" in done.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------- hostile

class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


HOSTILE = {  # every file kind the reader opens, in one checkpoint of each release
    "module weights (2.60)": ("ppo_filter", "learner_group/learner/rl_module/default_policy/module_state.pkl"),
    "module weights (2.40 .pt)": ("ray240/ppo_filter", "learner_group/learner/rl_module/default_policy/module_state.pt"),
    "module class and config": ("ppo_filter", "learner_group/learner/rl_module/default_policy/class_and_ctor_args.pkl"),
    "env-to-module pipeline": ("ppo_filter", "env_runner/env_to_module_connector/class_and_ctor_args.pkl"),
    "module-to-env pipeline": ("ppo_filter", "env_runner/module_to_env_connector/class_and_ctor_args.pkl"),
    "filter statistics": ("ppo_filter", "env_runner/env_to_module_connector/MeanStdFilter/state.pkl"),
    "lone module weights": ("module_only", "module_state.pkl"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_pickle_that_would_run_code_is_refused_with_nothing_run(tmp_path, kind):
    case, name = HOSTILE[kind]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / case / "checkpoint", ckpt)
    marker = tmp_path / "ran"
    (ckpt / name).write_bytes(pickle.dumps({"x": _Payload(marker)}, protocol=5))
    before = snapshot(tmp_path)
    weights = "weights" in kind  # inspect opens no weights file: it shows the modules from their configs
    for command in (["inspect", str(ckpt)], ["convert", str(ckpt), "--out", str(tmp_path / "out")]):
        done = cli(*command)
        if weights and command[0] == "inspect":
            assert done.returncode == 0, done.stderr[-2000:]
            continue
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert "os.system" in done.stderr or "posix.system" in done.stderr, done.stderr[-2000:]
        assert "nothing was run" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists() and snapshot(tmp_path) == before


def test_a_link_out_of_the_checkpoint_is_not_followed(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_discrete/checkpoint", ckpt)
    weights = ckpt / "learner_group/learner/rl_module/default_policy/module_state.pkl"
    outside = tmp_path / "outside.pkl"
    weights.rename(outside)
    weights.symlink_to(outside)
    done = cli("convert", str(ckpt), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "symbolic link" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("text,fragment", [
    (b'{"checkpoint_version": "9.9", "ray_version": "9"}', "is not one of 2.0, 2.1"),
    (b'{"checkpoint_version": "2.1", "checkpoint_version": "2.1"}', "not strict JSON"),
    (b"\xff\xfe{}", "not strict JSON: not UTF-8 text"),
])
def test_bad_metadata_is_refused(tmp_path, text, fragment):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_discrete/checkpoint", ckpt)
    (ckpt / "learner_group/learner/rl_module/metadata.json").write_bytes(text)
    done = cli("convert", str(ckpt), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and fragment in done.stderr, done.stderr[-2000:]


def _classes(monkeypatch, *names: str) -> list[type]:
    """Stand-in classes that pickle as references to ``names`` (their modules made importable here)."""
    import types

    made = []
    for name in names:
        module, _, attr = name.rpartition(".")
        fake = sys.modules.get(module) if module.startswith("fake_") else types.ModuleType(module)
        cls = type(attr, (), {"__module__": module})
        setattr(fake, attr, cls)
        monkeypatch.setitem(sys.modules, module, fake)
        made.append(cls)
    return made


def _env_pipeline(tmp_path, monkeypatch, *connectors: str) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_filter/checkpoint", ckpt)
    pipeline, *classes = _classes(
        monkeypatch, "ray.rllib.connectors.env_to_module.env_to_module_pipeline.EnvToModulePipeline", *connectors)
    data = {"class": pipeline, "ctor_args_and_kwargs": ((), {"connectors": [(c, (), {}) for c in classes]})}
    (ckpt / "env_runner/env_to_module_connector/class_and_ctor_args.pkl").write_bytes(pickle.dumps(data, protocol=5))
    return ckpt


FILTER = "ray.rllib.connectors.env_to_module.mean_std_filter.MeanStdFilter"
FLATTEN = "ray.rllib.connectors.common.flatten_observations.FlattenObservations"


@pytest.mark.parametrize("connectors,fragment", [
    ((FILTER, FLATTEN), "MeanStdFilter, FlattenObservations in this order are not rebuilt"),
    (("ray.rllib.connectors.env_to_module.prev_actions_prev_rewards.PrevActionsPrevRewards", FILTER),
     "holds ray.rllib.connectors.env_to_module.prev_actions_prev_rewards.PrevActionsPrevRewards, which this "
     "package does not rebuild"),
])
def test_connectors_it_does_not_rebuild_are_refused_naming_them(tmp_path, monkeypatch, connectors, fragment):
    ckpt = _env_pipeline(tmp_path, monkeypatch, *connectors)
    done = cli("convert", str(ckpt), "--out", str(tmp_path / "out"))
    one_line_error(done, 2, fragment)


def test_an_old_stack_checkpoint_is_not_taken_for_a_new_one():
    from policy_export.exporter import sources
    from policy_export.exporter.sources.rlmodule.reader import read_module_checkpoint

    old = ROOT / "fixtures/rllib/checkpoints/appo/checkpoint"
    assert sources.detect(old).name == "checkpoint"
    assert sources.detect(NEWSTACK / "appo_discrete/checkpoint").name == "rlmodule"
    with pytest.raises(UnsafeCheckpointError, match="not a checkpoint of RLlib's new API stack"):
        read_module_checkpoint(old)


def test_activations_are_torchs_by_rllibs_names():
    """RLlib's torch activations by the names its config takes, with torch's defaults."""
    import tensorflow as tf

    from policy_export.exporter.sources.rlmodule.graph import TORCH_ACTIVATIONS, ModuleConfig

    x = tf.constant([-2.0, -0.5, 0.0, 1.5])
    got = {name: TORCH_ACTIVATIONS[name](x).numpy() for name in ("LeakyReLU", "GELU", "swish", "Mish")}
    v = np.array([-2.0, -0.5, 0.0, 1.5])
    from math import erf

    np.testing.assert_allclose(got["LeakyReLU"], np.where(v > 0, v, 0.01 * v), rtol=1e-6)
    np.testing.assert_allclose(got["GELU"], [0.5 * a * (1 + erf(a / np.sqrt(2))) for a in v], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["swish"], v / (1 + np.exp(-v)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["Mish"], v * np.tanh(np.log1p(np.exp(v))), rtol=1e-5, atol=1e-7)
    with pytest.raises(Exception, match="'hardswish' is not an activation rebuilt here"):
        ModuleConfig({"fcnet_activation": "hardswish"}, "module 'm'").activation("fcnet_activation")


# ------------------------------------------------------------------ values a file may not afford

MODULE_ARGS = "learner_group/learner/rl_module/default_policy/class_and_ctor_args.pkl"


def _module_args(monkeypatch, path: Path, model_config, *, raw_value: bytes | None = None) -> None:
    """Rewrite a PPO module's ``class_and_ctor_args.pkl`` with ``model_config`` (RLlib's classes as
    stand-ins that pickle by name); ``raw_value`` replaces the pickled string "ZZZMARK" by raw opcodes."""
    import gymnasium as gym

    module, catalog = _classes(monkeypatch, "ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module."
                                            "DefaultPPOTorchRLModule", "ray.rllib.algorithms.ppo.ppo_catalog.PPOCatalog")
    data = {"class": module, "ctor_args_and_kwargs": ((), {
        "observation_space": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), "action_space": gym.spaces.Discrete(2),
        "inference_only": False, "learner_only": False, "model_config": model_config, "catalog_class": catalog})}
    raw = pickle.dumps(data, protocol=5)
    if raw_value is not None:
        raw = raw.replace(b"\x8c\x07ZZZMARK", raw_value, 1)
    path.write_bytes(raw)


def _shared_many_times() -> list:
    value: list = [1]
    for _ in range(7):  # 16 ** 7 = 268 million references in about a kilobyte
        value = [value] * 16
    return value


def _bounded_cli(*args: str, seconds: float = 30, memory: int = 2 << 30) -> subprocess.CompletedProcess:
    """The console script in a process limited to ``memory`` bytes of address space and ``seconds``."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    script = Path(sys.executable).parent / "policy-export"
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=seconds, preexec_fn=limit)


@pytest.mark.parametrize("where", ["a key it reads", "a key it does not read"])
def test_a_config_of_shared_references_is_refused_at_once(tmp_path, monkeypatch, where):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_discrete/checkpoint", ckpt)
    config = {"vf_share_layers": False, "fcnet_hiddens": [16]}
    config["fcnet_hiddens" if where == "a key it reads" else "mine"] = _shared_many_times()
    _module_args(monkeypatch, ckpt / MODULE_ARGS, config)
    assert (ckpt / MODULE_ARGS).stat().st_size < 2000
    before = snapshot(tmp_path)
    done = _bounded_cli("inspect", str(ckpt))
    one_line_error(done, 2, "holds values that expand to more than 262144 values")
    one_line_error(cli("convert", str(ckpt), "--out", str(tmp_path / "out")), 2, "expand to more than")
    assert snapshot(tmp_path) == before


def test_a_config_nested_200000_deep_is_refused(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_discrete/checkpoint", ckpt)
    deep = 200_000  # lists in lists, built by the unpickler without recursion: ']' * n, 1, 'a' * n
    _module_args(monkeypatch, ckpt / MODULE_ARGS, {"vf_share_layers": False, "mine": "ZZZMARK"},
                 raw_value=b"]" * deep + b"K\x01" + b"a" * deep)
    one_line_error(_bounded_cli("inspect", str(ckpt)), 2, "nests values more than 100 deep")
    one_line_error(cli("convert", str(ckpt), "--out", str(tmp_path / "out")), 2, "nests values more than 100 deep")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key,value,fragment", [
    ("fcnet_hiddens", 16, "model_config fcnet_hiddens is 16, not a list of at most 64 layer sizes"),
    ("fcnet_hiddens", [10 ** 5000], "model_config fcnet_hiddens is [<int of 16610 bits>]"),
    ("num_atoms", float("nan"), "model_config num_atoms is nan, not a whole number from 1 to 4096"),
    ("num_atoms", 10 ** 5000, "model_config num_atoms is <int of 16610 bits>, not a whole number"),
    ("log_std_clip_param", float("inf"), "model_config log_std_clip_param is inf, not a finite number"),
    ("fcnet_activation", ["tanh"], "model_config fcnet_activation is ['tanh'], not an activation's name"),
    ("use_lstm", "yes", "model_config use_lstm is 'yes', not true or false"),
], ids=["sizes-a-number", "sizes-5001-digits", "atoms-nan", "atoms-5001-digits", "clip-inf", "activation-list",
        "flag-text"])
def test_a_config_value_of_another_kind_is_refused_naming_the_key(tmp_path, monkeypatch, key, value, fragment):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_discrete/checkpoint", ckpt)
    _module_args(monkeypatch, ckpt / MODULE_ARGS, {"vf_share_layers": False, "fcnet_hiddens": [16], key: value})
    for command in (["inspect", str(ckpt)], ["convert", str(ckpt), "--out", str(tmp_path / "out")]):
        one_line_error(cli(*command), 2, fragment)
    assert not (tmp_path / "out").exists()


FILTER_STATE = "env_runner/env_to_module_connector/MeanStdFilter/state.pkl"


def _filter_agents(tmp_path: Path, change) -> Path:
    from policy_export.exporter.sources.safe_pickle import loads

    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "multi_agent_filter/checkpoint", ckpt)
    state = loads((ckpt / FILTER_STATE).read_bytes(), "state")
    change(state)
    (ckpt / FILTER_STATE).write_bytes(pickle.dumps(state, protocol=5))
    return ckpt


def test_an_agent_id_of_5001_digits_is_refused(tmp_path):
    ckpt = _filter_agents(tmp_path, lambda state: state.__setitem__(10 ** 5000, state[0]))
    for command in (["inspect", str(ckpt)], ["convert", str(ckpt), "--out", str(tmp_path / "out"),
                                             "--policy-id", "p0", "--filter-agent", "0"]):
        one_line_error(cli(*command), 2, "agent id <int of 16610 bits> is not a name (at most 128 characters)")


def test_a_filter_agent_matching_a_name_and_a_number_is_ambiguous(tmp_path):
    ckpt = _filter_agents(tmp_path, lambda state: state.__setitem__("1", state[0]))
    done = cli("convert", str(ckpt), "--out", str(tmp_path / "out"), "--policy-id", "p1", "--filter-agent", "1")
    one_line_error(done, 2, "--filter-agent 1 is ambiguous: the MeanStdFilter holds agents 1 and '1'")
    assert not (tmp_path / "out").exists()
    done = cli("convert", str(ckpt), "--out", str(tmp_path / "out"), "--policy-id", "p1", "--filter-agent", "2")
    one_line_error(done, 2, "holds no agent '2'; its agents: 0, 1, '1'")


def test_float64_weights_that_float32_cannot_hold_are_refused(tmp_path):
    from policy_export.exporter.sources.safe_pickle import loads

    ckpt = tmp_path / "ckpt"
    shutil.copytree(NEWSTACK / "ppo_discrete/checkpoint", ckpt)
    state = ckpt / "learner_group/learner/rl_module/default_policy/module_state.pkl"
    weights = loads(state.read_bytes(), "state")
    exact = {k: v.astype(np.float64) for k, v in weights.items()}  # float64 holding float32 values: converted
    state.write_bytes(pickle.dumps(exact, protocol=5))
    assert cli("convert", str(ckpt), "--out", str(tmp_path / "exact"), "--formats", "saved_model").returncode == 0
    exact["pi.net.mlp.0.bias"] = np.full(exact["pi.net.mlp.0.bias"].shape, 0.1)  # 0.1 is no float32
    state.write_bytes(pickle.dumps(exact, protocol=5))
    done = cli("convert", str(ckpt), "--out", str(tmp_path / "out"), "--formats", "saved_model")
    one_line_error(done, 2, "weight pi.net.mlp.0.bias has dtype float64 values that float32 cannot hold exactly")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["ppo_box", "ppo_box_free_log_std"])
def test_the_gaussian_log_std_is_clipped_to_log_std_clip_param(case):
    """RLlib clamps a Box policy's log_std to ``[-log_std_clip_param, log_std_clip_param]``: with a
    clip the recorded log-stds cross, the rebuilt graph gives RLlib's values clamped."""
    from policy_export.exporter.sources.rlmodule.graph import load_module_policy
    from policy_export.exporter.sources.rlmodule.reader import read_module_checkpoint

    expected = expected_outputs(NEWSTACK, case)
    recorded = expected["default_policy/action_dist_inputs"]
    mean, log_std = np.split(recorded, 2, axis=-1)
    clip = float(np.max(np.abs(log_std))) / 2  # the larger log-stds cross it
    assert (np.abs(log_std) > clip * 1.01).any()
    checkpoint = read_module_checkpoint(NEWSTACK / case / "checkpoint")
    spec = checkpoint.module("default_policy")
    spec.model_config["log_std_clip_param"] = clip
    policy, _ = load_module_policy(checkpoint, spec)
    try:
        got = policy.session.run(policy.deterministic_outputs["action_dist_inputs"],
                                 {policy.inputs["observations"]: expected["default_policy/obs"]})
    finally:
        policy.close()
    want = np.concatenate([mean, np.clip(log_std, -clip, clip)], axis=-1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_multi_agent_flatten_is_rebuilt_for_the_modules_it_applies_to():
    """``FlattenObservations(multi_agent=True, agent_ids=[0])``: p0 takes agent 0's Dict observation,
    flattened; p1 agent 1's Box, untouched. Each module's agent is found from the spaces alone where
    only one agent's observations fit it; where two agents' different observations both fit, the
    agent must be named."""
    from policy_export.errors import ExportError
    from policy_export.exporter.sources.rlmodule.reader import read_module_checkpoint

    checkpoint = read_module_checkpoint(NEWSTACK / "multi_agent_flatten/checkpoint")
    assert checkpoint.flatten_agents == frozenset({0})
    p0, flat0 = checkpoint.input_space(checkpoint.module("p0"), True)
    p1, flat1 = checkpoint.input_space(checkpoint.module("p1"), True)
    assert flat0 and sorted(p0.spaces) == ["mode", "pos"] and not flat1 and p1.shape == (3,)
    everyone = read_module_checkpoint(NEWSTACK / "multi_agent_flatten_all/checkpoint")
    assert everyone.flatten_agents is None
    with pytest.raises(ExportError, match="the observations of agents 0, 1 all fit module 'p0'"):
        everyone.input_space(everyone.module("p0"), True)
    space, flat = everyone.input_space(everyone.module("p1"), True, "1")
    assert flat and sorted(space.spaces) == ["flag", "vel"]
    with pytest.raises(ExportError, match="agent 1 observes .* which module 'p0' does not take"):
        checkpoint.input_space(checkpoint.module("p0"), True, "1")


def test_a_multi_agent_flatten_converts_from_the_command_line(tmp_path):
    done = cli("convert", str(NEWSTACK / "multi_agent_flatten/checkpoint"), "--out", str(tmp_path / "out"),
               "--all-policies", "--formats", "onnx")
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((tmp_path / "out/p0/manifest.json").read_text())
    assert [s["key"] for s in manifest["contract"]["inputs"] if s["required"]] == ["observations/mode",
                                                                                  "observations/pos"]
    done = cli("convert", str(NEWSTACK / "multi_agent_flatten_all/checkpoint"), "--out", str(tmp_path / "all"),
               "--policy-id", "p0", "--formats", "onnx")
    one_line_error(done, 2, "name the agent with --filter-agent ID")
