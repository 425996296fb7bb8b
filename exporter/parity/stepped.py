"""Stepped parity for recurrent policies: many consecutive steps, state carried by each runtime.

Several independent sequences (one batch) run ``steps`` consecutive steps. Each format steps one
call at a time, feeding back its own ``state_out``; the TF session does the same on its serving
graph, and also runs the training-time graph over padded chunks of ``max_seq_len`` steps (the
semantics the policy was trained with), carrying state between chunks. Observations,
``prev_action`` and ``prev_reward`` are fixed sequences sampled up front, so every runtime sees
the same inputs. Every output is compared at every step; the record names the step where the
error was largest, so drift shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from policy_export.exporter.parity.compare import OutputParity, Runner, Tolerances, compare, compare_arrays, sample_inputs
from policy_export.signatures.keys import (
    OBSERVATIONS, PREV_ACTION, PREV_REWARD, SEQ_LENS, action_key, is_observation, is_per_step, is_state_out, state_in_key,
    state_out_key,
)

from policy_export.exporter.defaults import DEFAULT_SEQUENCES, DEFAULT_STEPS  # noqa: E402,F401 (re-exported)


def stepped_inputs(policy, contract, steps: int, sequences: int, seed: int) -> dict[str, np.ndarray]:
    """Step-major inputs ``[steps, sequences, ...]``: observations, ``prev_action`` and
    ``prev_reward`` sampled as parity samples them, and ``seq_lens`` of 1 (one step per call);
    the state is the stepping's own."""
    feeds = sample_inputs(policy.observation_space, policy.action_space, contract, steps * sequences, seed)
    return {k: v.reshape(steps, sequences, *v.shape[1:]) for k, v in feeds.items()
            if is_per_step(k) or k == SEQ_LENS}


def run_stepped(runner: Runner, inputs: Mapping[str, np.ndarray], initial_state: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Step ``runner`` through ``inputs``, feeding back its own state; outputs ``[steps, sequences, ...]``.

    ``seq_lens`` is taken from ``inputs`` when it is there (``[steps, sequences]``), else 1 per step.
    """
    steps, sequences = next(iter(inputs.values())).shape[:2]
    state = [np.repeat(s[None], sequences, axis=0) for s in initial_state]
    seq_lens = np.ones(sequences, np.int32)
    collected: dict[str, list[np.ndarray]] = {}
    for t in range(steps):
        feeds = {k: v[t] for k, v in inputs.items()}
        feeds.setdefault(SEQ_LENS, seq_lens)
        feeds.update({state_in_key(i): s for i, s in enumerate(state)})
        out = runner(feeds)
        state = [out[state_out_key(i)] for i in range(len(state))]
        for key, value in out.items():
            collected.setdefault(key, []).append(np.asarray(value))
    return {k: np.stack(v) for k, v in collected.items()}


def run_training_graph(policy, inputs: Mapping[str, np.ndarray], chunk: int) -> dict[str, np.ndarray]:
    """The training-time graph over padded chunks of ``chunk`` steps, state carried between them.

    Per-step outputs come back ``[steps, sequences, ...]``; ``state_out_i`` only exists at chunk
    ends, so it is returned as ``[chunks, sequences, cell]`` with the chunk-end steps in ``chunk_ends``.
    """
    steps, sequences = next(iter(inputs.values())).shape[:2]
    state = [np.repeat(s[None], sequences, axis=0) for s in policy.get_initial_state()]
    per_step: dict[str, list[np.ndarray]] = {}
    states: list[list[np.ndarray]] = []
    ends = []
    for start in range(0, steps, chunk):
        t = min(chunk, steps - start)
        # [t, seq, ...] -> [seq, t, ...] -> [seq * t, ...] (each sequence's steps contiguous)
        rows = {k: np.swapaxes(v[start:start + t], 0, 1).reshape(sequences * t, *v.shape[2:]) for k, v in inputs.items()
                if k != SEQ_LENS}
        obs = {k: v for k, v in rows.items() if is_observation(k)}
        result = policy.compute_actions(_nest(policy, obs), state=state, prev_action=rows.get(PREV_ACTION),
                                        prev_reward=rows.get(PREV_REWARD), seq_lens=np.full(sequences, t, np.int32))
        state = result.state_out
        states.append(state)
        ends.append(start + t - 1)
        for key, value in result.fetches.items():
            if not is_state_out(key):
                per_step.setdefault(key, []).append(np.swapaxes(value.reshape(sequences, t, *value.shape[1:]), 0, 1))
    out = {k: np.concatenate(v) for k, v in per_step.items()}
    for i in range(len(state)):
        out[state_out_key(i)] = np.stack([s[i] for s in states])
    out["chunk_ends"] = np.array(ends)
    return out


def _nest(policy, leaf_feeds: Mapping[str, np.ndarray]):
    from policy_export.policy.spaces import nest_from_leaves

    return nest_from_leaves(policy.observation_space, leaf_feeds, OBSERVATIONS)


def compare_stepped(label: str, reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray],
                    tolerances: Tolerances, keys: list[str], lengths: np.ndarray | None = None) -> list[OutputParity]:
    """Compare ``[steps, ...]`` outputs; each record names the step of its largest error. With
    ``lengths`` (``[sequences]``: recorded episodes) only each sequence's first ``lengths`` steps
    are compared, the steps after an episode's end being padding."""
    records = []
    for key in keys:
        if key not in reference:
            continue
        if key not in actual:
            records.append(compare(label, reference, actual, tolerances, [key])[0])
            continue
        ref, got = np.asarray(reference[key]), np.asarray(actual[key])
        if is_state_out(key) and "chunk_ends" in reference:
            got = got[reference["chunk_ends"]]
        step_of = None
        if lengths is not None and got.shape == ref.shape and ref.ndim >= 2:
            mask = valid_steps(lengths, len(ref))
            step_of, ref, got = np.nonzero(mask)[0], ref[mask], got[mask]
        record = compare_arrays(label, key, ref, got, tolerances.for_output(key),
                                allow_non_finite=tolerances.allows_non_finite(key))
        if got.shape == ref.shape and ref.size:
            per_step = np.abs(got.astype(np.float64) - ref.astype(np.float64)).reshape(len(ref), -1).max(axis=1)
            worst = int(np.argmax(per_step))
            if is_state_out(key) and "chunk_ends" in reference:
                worst = int(reference["chunk_ends"][worst])
            record = replace(record, worst_step=int(step_of[worst]) if step_of is not None else worst)
        records.append(record)
    return records


def valid_steps(lengths: np.ndarray, steps: int) -> np.ndarray:
    """``[steps, sequences]``: whether each step is one of its sequence's own (not padding)."""
    return np.arange(steps)[:, None] < np.asarray(lengths)[None, :]


def step_recorded(runner: Runner, inputs: Mapping[str, np.ndarray], initial_state: list[np.ndarray],
                  rewards: np.ndarray | None, contract) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """Step ``runner`` (the session) through recorded episodes ``[steps, sequences, ...]`` from
    ``initial_state``, its state carried; the ``prev_action`` and ``prev_reward`` the contract
    takes and the files do not hold are made as it steps: its own previous action, the previous
    step's recorded reward (``rewards``, else zeros), zeros at the first step. Returns the inputs
    every format is then fed (fixed), its per-step outputs, and what was fed, in words."""
    steps, sequences = next(iter(inputs.values())).shape[:2]
    made = {k: contract.input(k) for k in (PREV_ACTION, PREV_REWARD) if k in contract.input_keys and k not in inputs}
    fed = {PREV_ACTION: "its own previous action (zero at an episode's first step)",
           PREV_REWARD: "the previous step's recorded reward (zero at an episode's first step)" if rewards is not None
           else "zeros (the files hold no rewards)"}
    full = {k: np.array(v) for k, v in inputs.items()}
    for key, spec in made.items():
        full[key] = np.zeros((steps, sequences, *(1 if d is None else d for d in spec.shape[1:])), np.dtype(spec.dtype))
    if PREV_REWARD in made and rewards is not None:
        full[PREV_REWARD][1:] = rewards[:-1].reshape(full[PREV_REWARD][1:].shape).astype(full[PREV_REWARD].dtype)
    state = [np.repeat(s[None], sequences, axis=0) for s in initial_state]
    collected: dict[str, list[np.ndarray]] = {}
    for t in range(steps):
        feeds = {k: v[t] for k, v in full.items()}
        feeds.setdefault(SEQ_LENS, np.ones(sequences, np.int32))
        feeds.update({state_in_key(i): s for i, s in enumerate(state)})
        out = runner(feeds)
        state = [np.asarray(out[state_out_key(i)]) for i in range(len(state))]
        for key, value in out.items():
            collected.setdefault(key, []).append(np.asarray(value))
        action = np.asarray(out.get(action_key(0), np.zeros(0)))
        if PREV_ACTION in made and t + 1 < steps:
            if action.size == full[PREV_ACTION][t + 1].size:
                full[PREV_ACTION][t + 1] = action.reshape(full[PREV_ACTION][t + 1].shape)
            else:
                fed[PREV_ACTION] = "zeros (the policy's action does not fit prev_action)"
    said = {k: ("the recorded files' own" if k in inputs else fed[k]) for k in (PREV_ACTION, PREV_REWARD)
            if k in contract.input_keys}
    return full, {k: np.stack(v) for k, v in collected.items()}, said
