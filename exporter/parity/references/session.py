"""The TF session as the reference of an export this package builds: it runs the golden inputs
(with the golden values formats add, such as the Keras base model's own inputs and outputs), draws
the exploration samples and scores a format's own, steps the sequences of a recurrent policy and
runs its training-time graph, and computes its outputs on the user's recorded observations.

:func:`session_plan` makes every group that applies from it (:mod:`exporter.parity.groups`), in
one progress stage counting the rows the session runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_export.exporter import formats
from policy_export.exporter.defaults import DEFAULT_OBSERVATIONS, DEFAULT_SEQUENCES
from policy_export.exporter.parity.compare import run_batched
from policy_export.exporter.parity.groups import ExplorationGroup, GoldenGroup, RecordedGroup, SteppedGroup
from policy_export.exporter.parity.plan import ParityPlan
from policy_export.exporter.progress import Counted, Progress
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import EXPLORE


@dataclass
class SessionReference:
    """The policy's session, what the groups ask of it; ``run`` counts the rows it runs."""

    policy: Any
    contract: Contract
    batch_size: int
    run: Any = None

    @property
    def observation_space(self):
        return self.policy.observation_space

    @property
    def action_space(self):
        return self.policy.action_space

    def golden_outputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The session's outputs for ``feeds``, with the golden values each format adds
        (:meth:`exporter.formats.base.Format.reference_outputs`: the Keras base model's own inputs
        and outputs)."""
        return reference_outputs(self.policy, feeds, self.batch_size, self.run)

    def sampler(self):
        """The session as exploration draws from it: the whole graph, or its action head."""
        sampler = _SessionSampler(self.policy)
        return Counted(sampler, self.run.task) if isinstance(self.run, Counted) else sampler


def session_plan(policy, contract: Contract, opts, progress: Progress, recorded: Any = None) -> ParityPlan:
    """The parity plan of ``policy`` for the export options ``opts`` (an
    :class:`exporter.options.ExportOptions`), the session's rows counted on ``progress``.
    ``recorded`` (the user's recorded observations, read: ``inputs``, ``indices``, ``record``)
    joins the plan as its own group, with the session's outputs on it."""
    explores = opts.explore_samples > 0 and EXPLORE in contract.input_keys
    steps = policy.is_recurrent and policy.sequence_graph is not None and opts.stepped_steps > 0
    rows = (opts.samples * (1 + sum(fmt.reference_passes(policy) for fmt in formats.all_formats()))
            + (_explore_rows(opts.samples, opts.explore_samples) if explores else 0)
            + (opts.stepped_steps * DEFAULT_SEQUENCES if steps else 0)
            + (recorded.rows if recorded is not None else 0)
            + (_episode_rows(recorded)))
    reference = SessionReference(policy, contract, opts.batch_size)
    with progress.stage("parity session", rows) as task:
        reference.run = Counted(policy.run, task)
        plan = ParityPlan()
        plan.add(GoldenGroup.make(reference, opts.samples, opts.seed))
        if explores:
            plan.add(ExplorationGroup.make(reference, plan.golden_inputs, opts.explore_samples))
        if steps:
            plan.add(SteppedGroup.make(reference, opts.stepped_steps, DEFAULT_SEQUENCES, opts.seed))
        if recorded is not None:
            plan.add(RecordedGroup.make(reference, recorded))
    return plan


def _episode_rows(recorded: Any) -> int:
    episodes = getattr(recorded, "episodes", None)
    return 0 if episodes is None else episodes.steps * len(episodes.lengths)


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
