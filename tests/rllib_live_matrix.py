"""Live RLlib TF policies of every algorithm the installed ray carries, exported with
``from_rllib`` and compared with RLlib's own ``policy.compute_actions(obs, explore=False)``.

Each policy is RLlib's own policy class built in-process from its algorithm's own config (no
``ray.init``), given random weights (seeded) so that its outputs are far from RLlib's near-zero
initial heads. ``python -m tests.rllib_live_matrix`` prints the tables docs/rllib-algorithms.md quotes: per
case the largest absolute error of ``model.onnx`` and ``model_deterministic.onnx``, run in ONNX
Runtime fed exactly the inputs each lists, over 64 observations (discrete actions: identical or
``differs``). ray 2.8+ keeps only deprecation stubs of TD3, DDPG and A3C: those rows need
ray <= 2.7 (``python -m tests.rllib_live_matrix`` in such an environment).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import tensorflow  # noqa: F401, I001  (first: imported before it, RLlib switches TF's v2 behaviour off)
import gymnasium as gym

ATOL = 1e-5
OBS = (-1.0, 1.0, (5,))  # every case's observation space: Box(-1, 1, (5,))
FORMATS = ["saved_model", "onnx", "onnx_deterministic"]
COMPARED = ("action_dist_inputs", "q_values", "vf_preds", "action_logp")


def _box(low, high, shape):
    return gym.spaces.Box(low, high, shape, np.float32)


def _custom_model():
    """A custom Keras ModelV2 (not one of RLlib's catalog models), registered under a name."""
    import tensorflow as tf
    from ray.rllib.models import ModelCatalog
    from ray.rllib.models.tf.tf_modelv2 import TFModelV2

    class TwoTowers(TFModelV2):
        def __init__(self, obs_space, action_space, num_outputs, model_config, name):
            super().__init__(obs_space, action_space, num_outputs, model_config, name)
            obs = tf.keras.layers.Input(shape=obs_space.shape, name="obs")
            left = tf.keras.layers.Dense(12, activation="tanh")(obs)
            right = tf.keras.layers.Dense(12, activation="elu")(obs)
            joined = tf.keras.layers.Concatenate()([left, right * left])
            logits = tf.keras.layers.Dense(num_outputs)(joined)
            value = tf.keras.layers.Dense(1)(right)
            self.base_model = tf.keras.Model(obs, [logits, value])

        def forward(self, input_dict, state, seq_lens):
            logits, self._value = self.base_model(input_dict["obs"])
            return logits, state

        def value_function(self):
            return tf.reshape(self._value, [-1])

    ModelCatalog.register_custom_model("policy_export_two_towers", TwoTowers)
    return {"custom_model": "policy_export_two_towers"}


# name: (config class, policy class, action space, training options)
SAC_NETS = {"policy_model_config": {"fcnet_hiddens": [16]}, "q_model_config": {"fcnet_hiddens": [16]}}
DDPG_NETS = {"actor_hiddens": [16], "critic_hiddens": [16]}
CASES = {
    "dqn_dueling_double_nstep": ("dqn.DQNConfig", "dqn.dqn_tf_policy.DQNTFPolicy", gym.spaces.Discrete(4),
                                 {"dueling": True, "double_q": True, "n_step": 3, "hiddens": [16]}),
    "dqn_plain": ("dqn.DQNConfig", "dqn.dqn_tf_policy.DQNTFPolicy", gym.spaces.Discrete(3),
                  {"dueling": False, "double_q": False, "hiddens": []}),
    "simple_q": ("simple_q.SimpleQConfig", "simple_q.simple_q_tf_policy.SimpleQTF1Policy",
                 gym.spaces.Discrete(3), {}),
    "sac_box": ("sac.SACConfig", "sac.sac_tf_policy.SACTFPolicy", _box(-2.0, 2.0, (2,)), SAC_NETS),
    "sac_discrete": ("sac.SACConfig", "sac.sac_tf_policy.SACTFPolicy", gym.spaces.Discrete(3), SAC_NETS),
    "cql": ("cql.CQLConfig", "cql.cql_tf_policy.CQLTFPolicy", _box(-1.0, 1.0, (2,)), SAC_NETS),
    "td3": ("td3.TD3Config", "ddpg.ddpg_tf_policy.DDPGTF1Policy", _box(-1.0, 1.0, (2,)), DDPG_NETS),
    "ddpg_ou": ("ddpg.DDPGConfig", "ddpg.ddpg_tf_policy.DDPGTF1Policy", _box(-2.0, 2.0, (2,)), DDPG_NETS),
    "appo": ("appo.APPOConfig", "appo.appo_tf_policy.APPOTF1Policy", gym.spaces.Discrete(3), {}),
    "impala_box": ("impala.ImpalaConfig", "impala.impala_tf_policy.ImpalaTF1Policy", _box(-1.0, 1.0, (2,)), {}),
    "pg": ("pg.PGConfig", "pg.pg_tf_policy.PGTF1Policy", gym.spaces.Discrete(3), {}),
    "a3c": ("a3c.A3CConfig", "a3c.a3c_tf_policy.A3CTF1Policy", gym.spaces.Discrete(3), {}),
    "marwil": ("marwil.MARWILConfig", "marwil.marwil_tf_policy.MARWILTF1Policy", gym.spaces.Discrete(3), {}),
    "bc_box": ("bc.BCConfig", "marwil.marwil_tf_policy.MARWILTF1Policy", _box(-1.0, 1.0, (2,)), {}),
    "custom_keras_model": ("ppo.PPOConfig", "ppo.ppo_tf_policy.PPOTF1Policy", gym.spaces.Discrete(3), {}),
    "r2d2": ("r2d2.R2D2Config", "r2d2.r2d2_tf_policy.R2D2TFPolicy", gym.spaces.Discrete(3),
             {"dueling": True, "hiddens": [16], "model": {"fcnet_hiddens": [16], "use_lstm": True,
                                                          "lstm_cell_size": 8, "max_seq_len": 5}}),
}
RECURRENT = {"r2d2"}  # compared step by step, the state fed back (stepped_errors)
# DDPG's Ornstein-Uhlenbeck noise keeps state between calls: explore is refused and the export
# serves the actor's action (model.onnx is the deterministic model; no second one is written)
FORMATS_OF = {"ddpg_ou": ["saved_model", "onnx"],
              "r2d2": ["saved_model", "onnx"]}  # recurrent: no separate deterministic model


def _load(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"ray.rllib.algorithms.{module}"), name)


class NotCarried(Exception):
    """The installed ray has no TF policy for this algorithm."""


def _policy_class(path: str):
    """RLlib's TF policy class (ray 2.8+ keeps only deprecation stubs of TD3, DDPG and A3C).

    Raises:
        NotCarried: the installed ray has no such class.
    """
    import ray

    try:
        return _load(path)
    except ImportError as e:
        raise NotCarried(f"ray {ray.__version__} has no {path} ({e}); its TF policy is in ray <= 2.7") from e


def _old_api_stack(config):
    """The config with RLlib's RLModule/Learner stack off, in the words of its ray version."""
    import inspect

    def takes(method, name):
        return hasattr(config, method) and name in inspect.signature(getattr(config, method)).parameters

    if takes("experimental", "_enable_new_api_stack"):  # ray 2.9
        return config.experimental(_enable_new_api_stack=False)
    if takes("rl_module", "_enable_rl_module_api"):  # ray 2.5-2.8
        config = config.rl_module(_enable_rl_module_api=False)
    if takes("training", "_enable_learner_api"):
        config = config.training(_enable_learner_api=False)
    return config


def build(name: str, seed: int):
    """RLlib's policy for the case, from its algorithm's config, with random weights (seeded)."""
    import tensorflow as tf

    config_cls, policy_cls, action_space, training = CASES[name]
    policy_class = _policy_class(policy_cls)
    training = dict(training)
    model = _custom_model() if name == "custom_keras_model" else training.pop("model", {"fcnet_hiddens": [16, 16]})
    config = _old_api_stack(_load(config_cls)().framework("tf").rollouts(num_rollout_workers=0))
    config = config.training(model=model, **training).to_dict()
    with tf.Graph().as_default(), tf.compat.v1.variable_scope("default_policy"):
        policy = policy_class(_box(*OBS), action_space, config)
    rng = np.random.default_rng(seed)
    policy.set_weights({k: ((0.1 if "bias" in k else 0.7) * rng.standard_normal(np.shape(v))).astype(np.asarray(v).dtype)
                        for k, v in policy.get_weights().items()})
    return policy


def export_case(name: str, work: Path):
    """(policy, export folder, ExportResult) of one case."""
    from policy_export import export_policy, from_rllib

    policy = build(name, seed=sorted(CASES).index(name))
    out = work / name
    result = export_policy(from_rllib(policy), out, samples=100, explore_samples=600, device="cpu",
                           formats=FORMATS_OF.get(name, FORMATS))
    return policy, out, result


def observations(n: int = 64, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).uniform(*OBS[:2], (n, *OBS[2])).astype(np.float32)


def run_listed(path: Path, feeds: dict[str, np.ndarray]) -> tuple[list[str], dict[str, np.ndarray]]:
    """``path`` in ONNX Runtime fed the inputs it lists as required, and of ``feeds`` the
    optional ones it has (``explore``, ``timestep``: initializers a client may override)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    listed = [i.name for i in session.get_inputs()]
    optional = [i.name for i in session.get_overridable_initializers()]
    outputs = session.run(None, {k: feeds[k] for k in listed + optional if k in feeds})
    return listed, dict(zip([o.name for o in session.get_outputs()], outputs))


def largest_errors(policy, out: Path) -> dict[str, dict[str, float]]:
    """Per ONNX model: the largest absolute error per output against RLlib's
    ``compute_actions(explore=False)`` (``inf``: a discrete action differs)."""
    obs = observations()
    actions, _, fetches = policy.compute_actions(obs, explore=False)
    reference = {"actions_0": np.asarray(actions), **{k: np.asarray(v) for k, v in fetches.items()
                                                      if k in COMPARED and k != "action_logp"}}
    rows = {}
    for model in ("model.onnx", "model_deterministic.onnx"):
        if not (out / model).is_file():
            continue
        listed, got = run_listed(out / model, {"observations": obs})
        errors = {"listed inputs": listed}
        for key, want in reference.items():
            if key in got:
                have = np.asarray(got[key])
                errors[key] = ((0.0 if np.array_equal(have, want) else float("inf"))
                               if np.issubdtype(want.dtype, np.integer)
                               else float(np.max(np.abs(have.astype(np.float64) - want))))
        rows[model] = errors
    return rows


def stepped_errors(policy, out: Path, steps: int = 20, batch: int = 4) -> dict[str, dict[str, float]]:
    """A recurrent case: ``model.onnx`` stepped ``steps`` times over ``batch`` sequences, each
    side carrying its own state, against RLlib's ``compute_actions(explore=False)`` with its
    state fed back; the largest absolute error per output over every step."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    listed = [i.name for i in session.get_inputs()]
    names = [o.name for o in session.get_outputs()]
    theirs = [np.zeros((batch, *np.shape(s)), np.float32) for s in policy.get_initial_state()]
    ours = [s.copy() for s in theirs]
    worst: dict[str, Any] = {"listed inputs": listed}
    for step in range(steps):
        obs = observations(batch, seed=100 + step)
        actions, state, fetches = policy.compute_actions(obs, state_batches=theirs, explore=False)
        feeds = {"observations": obs, "seq_lens": np.ones(batch, np.int32),
                 **{f"state_in_{i}": s for i, s in enumerate(ours)}}
        got = dict(zip(names, session.run(None, {k: feeds[k] for k in listed})))
        reference = {"actions_0": np.asarray(actions), **{f"state_out_{i}": s for i, s in enumerate(state)},
                     **{k: np.asarray(v) for k, v in fetches.items() if k in COMPARED and k != "action_logp"}}
        for key, want in reference.items():
            if key in got:
                err = ((0.0 if np.array_equal(got[key], want) else float("inf")) if np.issubdtype(want.dtype, np.integer)
                       else float(np.max(np.abs(got[key].astype(np.float64) - want))))
                worst[key] = max(worst.get(key, 0.0), err)
        theirs, ours = list(state), [got[f"state_out_{i}"] for i in range(len(ours))]
    return {"model.onnx": worst}


def run_case(name: str, work: Path) -> dict[str, Any]:
    import ray

    row: dict[str, Any] = {"case": name, "ray": ray.__version__, "policy": CASES[name][1].rsplit(".", 1)[1]}
    try:
        policy, out, result = export_case(name, work)
    except NotCarried as e:
        row["not_carried"] = str(e)
        return row
    row["formats"] = sorted(result.formats)
    row["parity"] = result.parity.passed
    row["explore"] = ("refused" if result.manifest.get("explore_refused")
                      else "checked" if result.parity.exploration else "none")
    row["onnx"] = stepped_errors(policy, out) if name in RECURRENT else largest_errors(policy, out)
    return row


def _cell(errors: dict | None) -> str:
    if errors is None:
        return "not written"
    values = [v for k, v in errors.items() if k != "listed inputs"]
    if any(v == float("inf") for v in values):
        return "differs"
    return f"{max(values):.1e}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | RLlib policy (ray) | formats written | explore | parity | model.onnx | model_deterministic.onnx |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "not_carried" in r:
            lines.append(f"| {r['case']} | {r['policy']} ({r['ray']}) | not in this ray | | | | |")
            continue
        onnx = r["onnx"]
        lines.append(f"| {r['case']} | {r['policy']} ({r['ray']}) | {', '.join(r['formats'])} | {r['explore']} | "
                     f"{'passed' if r['parity'] else 'FAILED'} | {_cell(onnx.get('model.onnx'))} | "
                     f"{_cell(onnx.get('model_deterministic.onnx'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("cases", nargs="*", help="case names (default: every case)")
    args = parser.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(name, Path(tmp)) for name in (args.cases or sorted(CASES))]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0 if all(r.get("parity", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
