"""The RLlib checkpoint source (ray 2.1-2.9, old API stack): read without ray and without running
a pickle (:mod:`exporter.sources.checkpoint`), every policy id of a multi-agent checkpoint, each
policy's network rebuilt from its config and weights (:mod:`exporter.sources.checkpoint_policy`)
with RLlib's observation filter and action unsquashing in the graph."""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.errors import ExportError, InputError, UnsafeCheckpointError
from policy_export.exporter.sources.base import (
    CHECKPOINT_OPTIONS, Inspection, Loaded, Opened, Source, check_values, rllib_job_stem,
)

log = logging.getLogger(__name__)
# the default parity tolerance of a policy with RLlib's vision net: it takes raw pixel values
# (0-255, unscaled), and sums of that size differ between runtimes' convolutions by more than 1e-5
VISION_TOLERANCE = (1e-4, 1e-5)
CHECKPOINT_JSON_LIMIT = 1 << 20  # bytes of rllib_checkpoint.json read to list the policies by name
MAX_POLICIES = 4096  # entries of a checkpoint's policies/ directory
POLICY_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.\-]{1,128}")  # a policy id as a plain directory name


class CheckpointSource(Source):
    name = "checkpoint"
    description = "an RLlib checkpoint (rllib_checkpoint.json)"
    order = 20
    stage = "rebuild policy"
    reference = "the rebuilt policy's TF session"
    shows_itself = True
    options = CHECKPOINT_OPTIONS

    def job_stem(self, path: Path) -> str:
        return rllib_job_stem(path)

    def detect(self, path: Path) -> bool:
        from policy_export.exporter.sources.checkpoint import is_rllib_checkpoint

        return is_rllib_checkpoint(path)

    def policy_ids(self, path: Path) -> list[str] | None:
        """See :func:`policy_ids_by_name`: no state file is opened."""
        return policy_ids_by_name(path)

    def open(self, path: Path, values: Mapping[str, Any]) -> Opened:
        from policy_export.exporter.sources.checkpoint import Checkpoint, read_checkpoint

        checked = check_values(self, values)
        if checked["all_policies"] and checked["policy_id"] is not None:
            raise InputError("--policy-id and --all-policies exclude each other")
        checkpoint = path if isinstance(path, Checkpoint) else read_checkpoint(path)  # nothing imported or run
        policies = {pid: p.original_observation_space or p.observation_space for pid, p in checkpoint.policies.items()}
        return Opened(self, Path(checkpoint.path), checked, policies, checkpoint)

    def choose(self, opened: Opened) -> tuple[list[str | None], bool]:
        if opened.values["all_policies"]:
            return list(opened.policies), True
        return [opened.state.policy(opened.values["policy_id"]).policy_id], False

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        from policy_export.exporter.sources.checkpoint_policy import load_checkpoint_policy

        checkpoint, v = opened.state, opened.values
        policy = checkpoint.policy(policy_id)
        if policy.filter is None and policy.filter_note:
            log.warning("policy %r: %s", policy.policy_id, policy.filter_note)
        tf_policy, record = load_checkpoint_policy(policy, use_filter=v["use_filter"], actions=v["actions"],
                                                   device=device.tf_device)
        described = {"converted_from": str(Path(checkpoint.path).absolute()), "kind": "rllib_checkpoint",
                     "checkpoint_type": checkpoint.type, "checkpoint_format": checkpoint.format,
                     "checkpoint_version": checkpoint.version, "ray_version": checkpoint.ray_version, **record}
        return Loaded(tf_policy, described,
                      {"observation_filter": record["observation_filter"], "actions": v["actions"]},
                      VISION_TOLERANCE if record["base_network"] == "vision" else None)

    def inspect(self, opened: Opened) -> Inspection:
        from policy_export.exporter.sources.checkpoint_policy import filter_record, network_kind
        from policy_export.exporter.sources.safe_pickle import short_repr

        checkpoint, rows, table = opened.state, [], []
        for policy in checkpoint.policies.values():
            try:
                rebuilt = network_kind(policy)
            except ExportError as e:
                rebuilt = f"not rebuilt: {e}"
            filt = filter_record(policy.filter)
            name = policy.policy_class if len(policy.policy_class) <= 200 else short_repr(policy.policy_class, 200)
            rows.append({"policy_id": policy.policy_id, "policy_class": name,
                         "observation_space": str(policy.original_observation_space or policy.observation_space),
                         "action_space": str(policy.action_space), "weights": policy.weight_count,
                         "framework": policy.framework, "observation_filter": filt, "filter_note": policy.filter_note,
                         "network": rebuilt})
            table.append((policy.policy_id, name.rsplit(".", 1)[-1], rows[-1]["observation_space"],
                          rows[-1]["action_space"], f"{filt['class']} (n={filt['count']})" if filt else "none", rebuilt))
        return Inspection(
            title=f"{opened.path} (RLlib {checkpoint.type} checkpoint, {checkpoint.format}, ray {checkpoint.ray_version})",
            columns=("policy id", "class", "observations", "actions", "filter", "network"), rows=table,
            json={"kind": "rllib_checkpoint", "type": checkpoint.type, "format": checkpoint.format,
                  "ray_version": checkpoint.ray_version, "policies": rows})

    def summary(self, record: Mapping[str, Any] | None) -> list[str]:
        source = record or {}
        filt = source.get("observation_filter")
        framework = " (framework tf2: its unnamed weights laid out in RLlib's variable order)" \
            if source.get("framework") == "tf2" else ""
        lines = [f"  {source.get('policy_class')}: {source.get('network')} network, "
                 f"{len(source.get('weights_used') or [])} weights{framework}; observation filter: "
                 f"{filt['class'] + ' (n=' + str(filt['count']) + ')' if filt else 'none'}; "
                 f"actions: {source.get('actions')}"]
        if source.get("observation_filter_note"):
            lines.append(f"  note: {source['observation_filter_note']}")
        return lines



def _policies_dir(root: Path) -> list[str] | None:
    """The entries of ``root/policies/`` (sorted), each a plain name of a real directory; ``None``
    without that directory. Nothing inside an entry is opened.

    Raises:
        UnsafeCheckpointError: the directory is a link or not a directory, holds too many entries,
            or an entry that is not a plain name or not a directory (a link is not followed).
    """
    where = root / "policies"
    try:
        info = os.lstat(where)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCheckpointError(f"{where} is not a directory (a symbolic link is not followed)")
    names = []
    with os.scandir(where) as entries:
        for entry in entries:
            if len(names) >= MAX_POLICIES:
                raise UnsafeCheckpointError(f"{where} holds more than {MAX_POLICIES} entries")
            if not POLICY_NAME.fullmatch(entry.name):
                raise UnsafeCheckpointError(f"{where}: entry {entry.name[:80]!r} is not a plain policy name "
                                            "(letters, digits, '_', '.', '-')")
            if not entry.is_dir(follow_symlinks=False):
                raise UnsafeCheckpointError(f"{where / entry.name} is not a directory "
                                            "(a symbolic link is not followed)")
            names.append(entry.name)
    if not names:
        raise UnsafeCheckpointError(f"{where} holds no policy")
    return sorted(names)


def policy_ids_by_name(path: Path) -> list[str] | None:
    """The policy ids of an RLlib checkpoint, by name only: ``["default_policy"]`` for a Policy
    checkpoint, the entries of ``policies/`` for an Algorithm checkpoint, ``None`` when only its
    state names them (then the policy's own process reads them). Read: ``rllib_checkpoint.json``
    (strictly, at most :data:`CHECKPOINT_JSON_LIMIT` bytes, not through a link) and the listing of
    ``policies/``; never a state file.

    Raises:
        UnsafeCheckpointError: the directory is a link, its JSON is refused, its ``type`` is neither
            Algorithm nor Policy, or its ``policies/`` listing is refused (:func:`_policies_dir`).
    """
    from policy_export.policy import jsonio

    if path.is_symlink() or not path.is_dir():
        raise UnsafeCheckpointError(f"{path} is not a checkpoint directory (a real directory, not a link)")
    try:
        meta = jsonio.read_file(path / "rllib_checkpoint.json", CHECKPOINT_JSON_LIMIT)
    except jsonio.JSONError as e:
        raise UnsafeCheckpointError(str(e)[:400]) from None
    kind = meta.get("type") if isinstance(meta, dict) else None
    if kind not in ("Algorithm", "Policy"):
        raise UnsafeCheckpointError(f"{path / 'rllib_checkpoint.json'}: type {str(kind)[:40]!r} is neither "
                                    "'Algorithm' nor 'Policy'")
    return ["default_policy"] if kind == "Policy" else _policies_dir(path)


SOURCE = CheckpointSource()
