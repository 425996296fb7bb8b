"""The exploration group: a few probe observations, each drawn from many times with ``explore``
on, and the reference's own draws for them (``parity/exploration.npz``); each format that samples
draws as many and the two sets of samples are compared as distributions
(:mod:`exporter.parity.exploration`), with ``action_dist_inputs`` compared value by value. At export
the reference (the TF session) also scores each format's own samples: their ``action_logp``
against the session's log-probability of the same actions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from policy_export.errors import ExportError
from policy_export.exporter.defaults import DEFAULT_OBSERVATIONS
from policy_export.exporter.parity.compare import ParityReport, Runner, Tolerances, compare, compare_arrays, layout_record
from policy_export.exporter.parity.exploration import (
    compare_samples, draw, logp_of_given_actions, repeated_observations, rounding_allowance, within_allowance,
)
from policy_export.exporter.parity.groups.base import ParityGroup, Stored, check_against_contract, check_rows, prefixed
from policy_export.policy.spaces import leaves
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import ACTION_DIST_INPUTS, ACTION_LOGP, action_key, is_action

EXPLORATION = "parity/exploration.npz"


@dataclass
class ExplorationGroup(ParityGroup):
    """Probe observations, each repeated ``draws_per_observation`` times, and the reference's
    sampled actions (and distribution inputs) for them; ``scorer``: the session that scores a
    format's own samples (at export), or None."""

    probe: dict[str, np.ndarray]
    draws_per_observation: int
    reference: dict[str, np.ndarray]
    action_space: gym.Space
    batch_size: int
    contract: Contract | None = None
    drawn_by: str = ""  # how the reference's draws were made (exploration.draw): "head" or "network"
    scorer: Any = None

    name = "exploration"
    files = (EXPLORATION,)
    order, lossy_order = 2, None

    @classmethod
    def make(cls, reference, golden_inputs: Mapping[str, np.ndarray], samples: int) -> "ExplorationGroup":
        """Draw ``samples`` actions with the reference (its sampler) for the first few golden inputs."""
        contract = reference.contract
        required = {k: v for k, v in golden_inputs.items() if k in {s.key for s in contract.required_inputs}}
        m = min(DEFAULT_OBSERVATIONS, len(next(iter(required.values()))))
        probe = {k: v[:m] for k, v in required.items()}
        per = math.ceil(samples / m)
        group = cls(probe, per, {}, reference.action_space, reference.batch_size, contract, scorer=reference.policy)
        drawn, group.drawn_by = draw(reference.sampler(), group.probe, per, reference.batch_size)
        group.reference = {k: v for k, v in drawn.items() if k in group.compared_keys(drawn)}
        return group

    @property
    def observations(self) -> int:
        return len(next(iter(self.probe.values())))

    def feeds(self) -> dict[str, np.ndarray]:
        """The probe observations, each repeated ``draws_per_observation`` times (row-major)."""
        return repeated_observations(self.probe, self.observations, self.observations * self.draws_per_observation)

    def compared_keys(self, outputs: Mapping[str, Any]) -> list[str]:
        n = len(list(leaves(self.action_space)))
        return [k for k in [*(action_key(i) for i in range(n)), ACTION_DIST_INPUTS] if k in outputs]

    def rows(self, fmt) -> int:
        return self.observations * self.draws_per_observation if fmt.capabilities.explores else 0

    def check(self, label: str, fmt, runner, replay, report) -> None:
        if fmt.capabilities.lossy or not fmt.explores(replay.formats_info.get(fmt.name)):
            return
        got = self.check_samples(label, runner, replay.tolerances, report)
        if self.scorer is not None and self.scorer.raw_actions is not None and ACTION_LOGP in got:
            self._score(label, got, replay.tolerances, report)

    def check_samples(self, fmt: str, runner: Runner, tolerances: Tolerances, report: ParityReport) -> dict[str, np.ndarray]:
        """Sample with ``runner`` and add the two-sample tests (and the numeric comparison of
        ``action_dist_inputs``) to ``report``; returns the runner's draws."""
        got, how = draw(runner, self.probe, self.draws_per_observation, self.batch_size)
        label = f"{fmt} (explore)"
        actions = [k for k in self.reference if is_action(k)]
        bad = [r for r in (layout_record(label, k, self.reference[k], got.get(k), tolerances, self.contract)
                           for k in actions) if r is not None]
        if bad:  # a missing output or another dtype or shape: no distribution test can be made
            report.records.extend(bad)
            return got
        report.exploration.extend(compare_samples(fmt, self.action_space, self.observations, self.reference, got,
                                                  drawn_by=how))
        if ACTION_DIST_INPUTS in self.reference:
            report.records.extend(compare(label, self.reference, got, tolerances, [ACTION_DIST_INPUTS], self.contract))
        return got

    def _score(self, fmt: str, got: Mapping[str, np.ndarray], tolerances: Tolerances, report: ParityReport) -> None:
        """The session's log-probability of the format's own samples against the format's ``action_logp``."""
        policy = self.scorer
        logp, keep = logp_of_given_actions(policy, self.feeds, got, self.batch_size,
                                           self.reference.get(ACTION_DIST_INPUTS))
        # float16 Box actions: the session scores the rounded action, the format's logp is of
        # its unrounded sample; the difference that rounding explains is not an error
        allowance = rounding_allowance(policy.action_space, got[ACTION_DIST_INPUTS], got)
        actual = within_allowance(logp, got[ACTION_LOGP], allowance).astype(np.asarray(got[ACTION_LOGP]).dtype)
        report.records.append(compare_arrays(f"{fmt} (explore)", "action_logp of its samples", logp[keep],
                                             actual[keep], tolerances.for_output(ACTION_LOGP),
                                             allow_non_finite=tolerances.allows_non_finite(ACTION_LOGP)))

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {**{f"probe/{k}": v for k, v in self.probe.items()},
                "draws_per_observation": np.array(self.draws_per_observation, np.int64),
                **{f"session/{k}": v for k, v in self.reference.items()}}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], stored: Stored, where: str) -> "ExplorationGroup":
        """Raises:
            ExportError: the arrays are not an exploration plan for this action space and contract."""
        probe, reference = prefixed(arrays, "probe/"), prefixed(arrays, "session/")
        per = arrays.get("draws_per_observation")
        if not probe or per is None or per.shape != () or not np.issubdtype(per.dtype, np.integer) or int(per) < 1:
            raise ExportError(f"{where}: expected probe/<input> arrays and a positive draws_per_observation")
        group = cls(probe, int(per), reference, stored.action_space, stored.batch_size, stored.contract)
        check_rows(where, "probe", probe, group.observations)
        wanted = [action_key(i) for i in range(len(list(leaves(stored.action_space))))]
        missing = [k for k in wanted if k not in reference]
        if missing:
            raise ExportError(f"{where}: the session's draws {missing} are missing")
        check_rows(where, "session", reference, group.observations * group.draws_per_observation)
        check_against_contract(where, "probe", probe, stored.contract, inputs=True)
        check_against_contract(where, "session", reference, stored.contract, inputs=False)
        return group

    def describe(self) -> list[str]:
        return [f"exploration: {self.observations} observations x {self.draws_per_observation} draws "
                "vs the session's stored draws"]
