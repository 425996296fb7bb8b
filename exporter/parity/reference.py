"""The reference side of an export's parity plan: what the policy's own TF session computes.

:func:`session_plan` runs the session once on everything the plan holds (the golden inputs, the
golden values formats add, such as the Keras base model's own inputs and outputs, the exploration draws and the stepped sequences) and
returns the plan that every format is then replayed against (:mod:`exporter.parity.replay`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_export.exporter.defaults import DEFAULT_OBSERVATIONS, DEFAULT_SEQUENCES
from policy_export.exporter import formats
from policy_export.exporter.parity.compare import ParityReport, Tolerances, compare_arrays, run_batched, sample_inputs
from policy_export.exporter.parity.exploration import logp_of_given_actions, rounding_allowance, within_allowance
from policy_export.exporter.parity.plan import ExplorationPlan, ParityPlan, RecordedPlan, SteppedPlan
from policy_export.exporter.parity.stepped import run_stepped, run_training_graph, stepped_inputs
from policy_export.exporter.progress import Counted, Progress
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import ACTION_DIST_INPUTS, ACTION_LOGP, EXPLORE



def session_plan(policy, contract: Contract, opts, progress: Progress,
                 recorded: Any = None) -> tuple[ParityPlan, "ExploreSetup | None"]:
    """The parity plan of ``policy`` for the export options ``opts`` (an
    :class:`exporter.options.ExportOptions`), the session's rows counted on ``progress``; and the
    exploration setup that also scores each format's own samples (``None`` without exploration).
    ``recorded`` (the user's recorded observations, read: ``inputs``, ``indices``, ``record``)
    joins the plan as its own group, with the session's outputs on it."""
    explores = opts.explore_samples > 0 and EXPLORE in contract.input_keys
    steps = policy.is_recurrent and policy.sequence_graph is not None and opts.stepped_steps > 0
    rows = (opts.samples * (1 + sum(fmt.reference_passes(policy) for fmt in formats.all_formats()))
            + (_explore_rows(opts.samples, opts.explore_samples) if explores else 0)
            + (opts.stepped_steps * DEFAULT_SEQUENCES if steps else 0)
            + (recorded.rows if recorded is not None else 0)
            + (_episode_rows(recorded)))
    with progress.stage("parity session", rows) as task:
        run = Counted(policy.run, task)
        golden_in = sample_inputs(policy.observation_space, policy.action_space, contract, opts.samples, opts.seed)
        plan = ParityPlan(golden_in, reference_outputs(policy, golden_in, opts.batch_size, run))
        explore = None
        if explores:
            explore = ExploreSetup.make(policy, golden_in, contract, opts.explore_samples, opts.batch_size, run)
            plan.exploration = explore.plan
        if steps:
            inputs = stepped_inputs(policy, contract, opts.stepped_steps, DEFAULT_SEQUENCES, opts.seed)
            initial = policy.get_initial_state()
            plan.stepped = SteppedPlan(inputs, initial, run_stepped(run, inputs, initial),
                                       run_training_graph(policy, inputs, policy.sequence_graph_chunk))
        if recorded is not None:
            plan.recorded = RecordedPlan(recorded.inputs, run_batched(run, recorded.inputs, opts.batch_size),
                                         recorded.indices, recorded.record)
            if _episode_rows(recorded) and policy.is_recurrent:
                _recorded_stepped(plan.recorded, recorded.episodes, policy, contract, run)
    return plan, explore


def _episode_rows(recorded: Any) -> int:
    episodes = getattr(recorded, "episodes", None)
    return 0 if episodes is None else episodes.steps * len(episodes.lengths)


def _recorded_stepped(plan: RecordedPlan, episodes: Any, policy, contract: Contract, run) -> None:
    """The recorded episodes stepped by the session from its initial state, state carried; the
    plan's ``stepped`` part and the record's ``stepped`` entry."""
    from policy_export.exporter.parity.stepped import step_recorded

    initial = policy.get_initial_state()
    inputs, serving, fed = step_recorded(run, episodes.inputs, initial, episodes.rewards, contract)
    plan.stepped = SteppedPlan(inputs, initial, serving, lengths=episodes.lengths, group="recorded stepped")
    plan.episodes = episodes.episodes
    plan.record = {**plan.record, "stepped": {**episodes.record, "fed": fed}}


def _explore_rows(samples: int, explore_samples: int) -> int:
    """How many rows exploration parity runs per runtime (the probe observations times their draws)."""
    m = min(DEFAULT_OBSERVATIONS, samples)
    return m * -(-explore_samples // m)


def reference_outputs(policy, feeds: Mapping[str, np.ndarray], batch_size: int, run=None) -> dict[str, np.ndarray]:
    """The session's outputs for ``feeds`` (``run``: the session's runner, e.g. one that counts rows),
    with the golden values each format adds (:meth:`exporter.formats.base.Format.reference_outputs`:
    the Keras base model's own inputs and outputs)."""
    out = run_batched(run or policy.run, feeds, batch_size)

    def batched(fn):
        return run_batched(Counted(fn, run.task) if isinstance(run, Counted) else fn, feeds, batch_size)

    for fmt in formats.all_formats():
        out.update(fmt.reference_outputs(policy, batched))
    return out


class _SessionSampler:
    """The policy's session as exploration draws from it: the whole graph, or its action head."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.policy.run(feeds)

    def head(self):
        from policy_export.exporter.formats.tf_runner import tf_head

        return tf_head(self.policy.session, self.policy.inputs, self.policy.outputs)


@dataclass
class ExploreSetup:
    """The exploration plan, and the session that also scores each format's own samples (export only)."""

    policy: Any
    plan: ExplorationPlan

    @classmethod
    def make(cls, policy, golden_in, contract: Contract, samples: int, batch_size: int, run=None) -> "ExploreSetup":
        required = {k: v for k, v in golden_in.items() if k in {s.key for s in contract.required_inputs}}
        m = min(DEFAULT_OBSERVATIONS, len(next(iter(required.values()))))
        probe = {k: v[:m] for k, v in required.items()}
        sampler = _SessionSampler(policy)
        if isinstance(run, Counted):  # count its rows on the session's progress bar
            sampler = Counted(sampler, run.task)
        return cls(policy, ExplorationPlan.make(sampler, probe, samples, policy.action_space, batch_size, contract))

    def check(self, fmt: str, runner, tolerances: Tolerances, report: ParityReport) -> None:
        got = self.plan.check(fmt, runner, tolerances, report)
        if self.policy.raw_actions is not None and ACTION_LOGP in got:
            logp, keep = logp_of_given_actions(self.policy, self.plan.feeds, got, self.plan.batch_size,
                                               self.plan.reference.get(ACTION_DIST_INPUTS))
            # float16 Box actions: the session scores the rounded action, the format's logp is of
            # its unrounded sample; the difference that rounding explains is not an error
            allowance = rounding_allowance(self.policy.action_space, got[ACTION_DIST_INPUTS], got)
            actual = within_allowance(logp, got[ACTION_LOGP], allowance).astype(np.asarray(got[ACTION_LOGP]).dtype)
            report.records.append(compare_arrays(f"{fmt} (explore)", "action_logp of its samples", logp[keep],
                                                 actual[keep], tolerances.for_output(ACTION_LOGP),
                                                 allow_non_finite=tolerances.allows_non_finite(ACTION_LOGP)))
