"""Recorded episodes replayed stepped: a recurrent policy given ``--observations`` with episode
boundaries (and no state) is also stepped through whole episodes from its initial state, its state
carried, the session's per-step outputs stored in the plan and replayed by every format at export
and verify."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR
from helpers import resign, verify_cli

LSTM = FIXTURES_DIR / "cartpole_lstm"
OFFLINE = FIXTURES_DIR / "rllib" / "offline"
EPISODES = 5


def _play(root: Path) -> dict[str, np.ndarray]:
    """A few real CartPole-v1 episodes (random actions, seeded): observations, the episode of each
    row, the reward each step earned and whether it ended the episode; saved as two files, one
    with episode ids and rewards, one with dones only."""
    import gymnasium as gym

    env, rng = gym.make("CartPole-v1"), np.random.default_rng(0)
    rows: dict[str, list] = {"observations": [], "episode_ids": [], "rewards": [], "dones": []}
    for episode in range(EPISODES):
        obs, _ = env.reset(seed=episode)
        for step in range(60):
            rows["observations"].append(obs)
            rows["episode_ids"].append(1000 + 7 * episode)
            obs, reward, terminated, truncated, _ = env.step(int(rng.integers(2)))
            rows["rewards"].append(reward)
            rows["dones"].append(terminated or truncated or step == 59)
            if terminated or truncated:
                break
    env.close()
    arrays = {"observations": np.asarray(rows["observations"], np.float32),
              "episode_ids": np.asarray(rows["episode_ids"], np.int64),
              "rewards": np.asarray(rows["rewards"], np.float32), "dones": np.asarray(rows["dones"], bool)}
    np.savez(root / "episodes.npz", **{k: arrays[k] for k in ("observations", "episode_ids", "rewards")})
    np.savez(root / "dones.npz", **{k: arrays[k] for k in ("observations", "dones")})
    return arrays


@pytest.fixture(scope="module")
def stepped_export(tmp_path_factory):
    from policy_export.exporter import export_spec

    root = tmp_path_factory.mktemp("recorded_stepped")
    arrays = _play(root)
    export_spec(LSTM, root / "out", formats=["saved_model", "onnx"], observations=[str(root / "episodes.npz")],
                samples=100, explore_samples=0, stepped_steps=10, device="cpu")
    return root, arrays


def _starts_and_lengths(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    return starts, np.diff(np.r_[starts, len(ids)])


def _records(report: dict, label: str) -> list[dict]:
    return [r for r in report["records"] if r["format"] == label]


def test_the_plan_holds_the_recorded_episodes_stepped(stepped_export):
    root, arrays = stepped_export
    out = root / "out"
    starts, lengths = _starts_and_lengths(arrays["episode_ids"])
    steps = int(lengths.max())
    with np.load(out / "parity/recorded.npz") as plan:
        np.testing.assert_array_equal(plan["stepped/lengths"], lengths)
        np.testing.assert_array_equal(plan["stepped/episodes"],
                                      np.stack([np.zeros(EPISODES), np.arange(EPISODES), lengths, starts], 1))
        observations = plan["stepped/inputs/observations"]
        assert observations.shape == (steps, EPISODES, 4) and plan["stepped/serving/actions_0"].shape == (steps, EPISODES)
        for s, (a, n) in enumerate(zip(starts, lengths)):
            np.testing.assert_array_equal(observations[:n, s], arrays["observations"][a:a + n])
            np.testing.assert_array_equal(plan["stepped/inputs/prev_reward"][1:n, s], arrays["rewards"][a:a + n - 1])
        assert not plan["stepped/inputs/prev_reward"][0].any() and not plan["stepped/inputs/prev_action"][0].any()
        np.testing.assert_array_equal(plan["stepped/inputs/prev_action"][1:], plan["stepped/serving/actions_0"][:-1])
    doc = json.loads((out / "manifest.json").read_text())
    record = doc["parity"]["recorded"]["stepped"]
    assert record["sequences"] == EPISODES and record["steps"] == steps and record["episodes"] == EPISODES
    assert list(record["from"].values()) == ["episode_ids"] and "recorded reward" in record["fed"]["prev_reward"]
    assert doc["parity"]["plan"]["recorded"] == "parity/recorded.npz"
    report = json.loads((out / "parity/report.json").read_text())
    for fmt in ("saved_model", "onnx"):
        stepped = _records(report, f"{fmt} (recorded stepped {steps})")
        assert stepped and all(r["passed"] for r in stepped)
        assert f"action_dist_inputs (stepped {steps})" in report["on_recorded"][fmt]["outputs"]


def test_the_sessions_stored_steps_are_the_policys_own_stepping(stepped_export):
    """Each episode stepped here through the TF policy (its training-time graph, one step per
    sequence, state and previous action carried) gives the plan's stored outputs."""
    from policy_export import TFPolicy, load_spec

    root, arrays = stepped_export
    starts, lengths = _starts_and_lengths(arrays["episode_ids"])
    with np.load(root / "out/parity/recorded.npz") as plan:
        stored = {k: plan[f"stepped/serving/{k}"] for k in ("action_dist_inputs", "actions_0", "state_out_0")}
    policy = TFPolicy.from_spec(load_spec(LSTM), device="/CPU:0")
    try:
        for s, (a, n) in enumerate(zip(starts, lengths)):
            state, action, reward = policy.get_initial_state(), 0, 0.0
            state = [x[None] for x in state]
            for t in range(n):
                result = policy.compute_actions(arrays["observations"][a + t][None], state=state,
                                                prev_action=np.array([action]), prev_reward=np.array([reward], np.float32),
                                                seq_lens=np.ones(1, np.int32))
                np.testing.assert_allclose(stored["action_dist_inputs"][t, s], result.fetches["action_dist_inputs"][0],
                                           rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(stored["state_out_0"][t, s], result.state_out[0][0], rtol=1e-5, atol=1e-5)
                assert stored["actions_0"][t, s] == result.fetches["actions_0"][0]
                state, action, reward = result.state_out, int(result.fetches["actions_0"][0]), arrays["rewards"][a + t]
    finally:
        policy.close()


def test_verify_replays_the_stepped_episodes_from_the_plan(stepped_export, tmp_path):
    root, arrays = stepped_export
    steps = int(_starts_and_lengths(arrays["episode_ids"])[1].max())
    code, report = verify_cli(str(root / "out"), tmp_path=tmp_path)
    assert code == 0
    for fmt in ("saved_model", "onnx"):
        stepped = _records(report, f"{fmt} (recorded stepped {steps})")
        assert {r["key"] for r in stepped} >= {"actions_0", "action_dist_inputs", "state_out_0", "state_out_1"}
        assert all(r["passed"] for r in stepped)
        assert report["on_recorded"][fmt]["passed"]


def test_a_tampered_stored_step_fails_verify_only_on_the_stepped_episodes(stepped_export, tmp_path):
    from policy_export.exporter import manifest

    root, arrays = stepped_export
    _, lengths = _starts_and_lengths(arrays["episode_ids"])
    steps = int(lengths.max())
    export = tmp_path / "export"
    shutil.copytree(root / "out", export)
    plan = manifest.load_npz(export / "parity/recorded.npz")
    short = int(np.argmin(lengths))
    plan["stepped/serving/action_dist_inputs"][steps - 1, short] += 1.0  # padding: never compared
    plan["stepped/serving/action_dist_inputs"][3, 1] += 0.01
    manifest.save_npz(export / "parity/recorded.npz", plan, compressed=True)
    resign(export)
    code, report = verify_cli(str(export), tmp_path=tmp_path)
    assert code == 1
    for fmt in ("saved_model", "onnx"):
        assert all(r["passed"] for r in _records(report, fmt) + _records(report, f"{fmt} (recorded)"))
        [bad] = [r for r in _records(report, f"{fmt} (recorded stepped {steps})") if not r["passed"]]
        assert bad["key"] == "action_dist_inputs" and bad["worst_step"] == 3
        assert abs(bad["max_abs_err"] - 0.01) < 1e-4
        assert not report["on_recorded"][fmt]["passed"]


def test_dones_give_the_same_episodes_as_ids(stepped_export):
    from policy_export.exporter.recorded import open_file
    from policy_export.exporter.recorded.episodes import boundary_column, choose, episode_numbers

    root, arrays = stepped_export
    _, lengths = _starts_and_lengths(arrays["episode_ids"])
    for name, key in (("episodes.npz", "episode_ids"), ("dones.npz", "dones")):
        f = open_file(root / name)
        assert boundary_column(f.columns) == key
        chosen, total = choose([f], seed=0)
        assert total == EPISODES and [c for _, _, c in chosen] == lengths.tolist()
        numbers = np.concatenate(list(episode_numbers(f.columns[key])))
        np.testing.assert_array_equal(numbers, np.repeat(np.arange(EPISODES), lengths))


def test_many_episodes_are_sub_sampled_and_long_ones_truncated(tmp_path):
    from policy_export.exporter.recorded import open_file
    from policy_export.exporter.recorded.episodes import MAX_SEQUENCES, _rows_of, choose

    ids = np.repeat(np.arange(40), np.arange(1, 41))  # episode e has e + 1 rows
    np.savez(tmp_path / "many.npz", observations=np.zeros((len(ids), 4), np.float32), eps_id=ids)
    f = open_file(tmp_path / "many.npz")
    chosen, total = choose([f], seed=3)
    assert total == 40 and len(chosen) == MAX_SEQUENCES and chosen == choose([f], seed=3)[0]
    assert all(c == e + 1 for _, e, c in chosen)
    rows = _rows_of(f.columns["eps_id"], np.array([0, 39]), steps=5)
    np.testing.assert_array_equal(rows[0], [0])
    np.testing.assert_array_equal(rows[39], np.flatnonzero(ids == 39)[:5])


@pytest.mark.parametrize("case", ["json_plain", "json_samplebatch", "json_compressed"])
def test_rllib_json_episodes_are_its_eps_id_column(case):
    """The old stack's JSON: the episodes are its ``eps_id`` column, read here from the file itself."""
    from policy_export.exporter.recorded import open_file
    from policy_export.exporter.recorded.episodes import boundary_column, choose, episode_numbers

    path = next((OFFLINE / case / "data").glob("*.json"))
    own = []
    for line in path.read_text().splitlines():
        batch = json.loads(line)
        part = batch["policy_batches"]["default_policy"] if "policy_batches" in batch else batch
        own.extend(part["eps_id"])
    order = {v: i for i, v in enumerate(dict.fromkeys(own))}
    f = open_file(path)
    assert boundary_column(f.columns) == "eps_id"
    np.testing.assert_array_equal(np.concatenate(list(episode_numbers(f.columns["eps_id"]))),
                                  [order[v] for v in own])
    chosen, total = choose([f], seed=0)
    assert total == len(order) and [c for _, _, c in chosen] == [own.count(v) for v in order]


def test_rllib_parquet_episodes_are_its_cells():
    from policy_export.exporter.recorded import open_file
    from policy_export.exporter.recorded.episodes import choose

    f = open_file(OFFLINE / "parquet_episodes/data")
    with np.load(OFFLINE / "parquet_episodes/expected.npz") as data:
        lengths, seen = [], set()
        for e in sorted({k.split("/")[0] for k in data.files}, key=lambda k: int(k[1:])):
            if str(data[f"{e}/id"]) not in seen and len(data[f"{e}/obs"]) > 1:
                seen.add(str(data[f"{e}/id"]))
                lengths.append(len(data[f"{e}/obs"]) - 1)
    chosen, total = choose([f], seed=0)
    assert total == len(lengths) and sum(lengths) == f.rows
    if total <= 16:
        assert [c for _, _, c in chosen] == lengths


def test_a_policy_without_state_keeps_one_step_per_row(tmp_path):
    from policy_export.exporter import export_spec

    rng = np.random.default_rng(1)
    np.savez(tmp_path / "eps.npz", observations=rng.standard_normal((30, 4)).astype(np.float32) * 0.1,
             episode_ids=np.repeat([4, 5, 6], 10))
    export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "out", formats=["onnx"],
                observations=[str(tmp_path / "eps.npz")], samples=50, explore_samples=0, device="cpu")
    with np.load(tmp_path / "out/parity/recorded.npz") as plan:
        assert not [k for k in plan.files if k.startswith("stepped/")] and len(plan["inputs/observations"]) == 30
    doc = json.loads((tmp_path / "out/manifest.json").read_text())
    assert "stepped" not in doc["parity"]["recorded"]
    report = json.loads((tmp_path / "out/parity/report.json").read_text())
    assert not [r for r in report["records"] if "recorded stepped" in r["format"]]
    assert set(report["on_recorded"]["onnx"]["outputs"]) == {r["key"] for r in _records(report, "onnx (recorded)")}


def test_a_file_holding_the_state_keeps_one_step_per_row(stepped_export, tmp_path):
    """Rows that carry their own state already say where they are: no episodes are stepped."""
    from policy_export.exporter.recorded import read_recorded
    from policy_export.policy.spaces import space_from_json
    from policy_export.signatures.contract import Contract

    root, arrays = stepped_export
    doc = json.loads((root / "out/manifest.json").read_text())
    contract = Contract.from_json(doc["contract"])
    space = space_from_json(doc["spaces"]["observation"], "$.spaces.observation", "manifest")
    rows = len(arrays["observations"])
    np.savez(tmp_path / "state.npz", observations=arrays["observations"], episode_ids=arrays["episode_ids"],
             state_in_0=np.zeros((rows, 32), np.float32), state_in_1=np.zeros((rows, 32), np.float32))
    with_state = read_recorded([tmp_path / "state.npz"], space, contract, 1000, 0)
    assert with_state.episodes is None and with_state.rows == rows
    without = read_recorded([root / "episodes.npz"], space, contract, 1000, 0)
    assert without.episodes is not None and len(without.episodes.lengths) == EPISODES


def test_the_verdict_folds_the_stepped_episodes_into_each_formats_line(stepped_export):
    """One line per format (the recorded stepped records are a group of it, not a format); the
    "on your observations" note names the stepped outputs."""
    from helpers import cli, notes

    root, _ = stepped_export
    done = cli("verify", str(root / "out"), "--device", "cpu", "-q")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    (rule,) = [i for i, line in enumerate(lines) if set(line.strip()) == {"─"}]
    table = [line for line in lines[rule + 1:] if line and not line.startswith(("plan:", " ", "full table"))]
    table = table[:[i for i, line in enumerate(table) if line.startswith("verified")][0]] if any(
        line.startswith("verified") for line in table) else table
    assert [line.split()[0] for line in table] == ["saved_model", "onnx"], lines
    assert any("recorded: " in note for note in notes(done.stdout, "plan"))
