"""The source of RLlib's new API stack (ray 2.40-2.60, torch RLModules): an Algorithm checkpoint
(``algo.save_to_path``), a MultiRLModule or an RLModule directory (``save_to_path`` of a module),
read without ray, without torch and without running a pickle (:mod:`.reader`); each default
module rebuilt as a TF policy graph from its stored config and weights (:mod:`.graph`), with the
MeanStdFilter connector in front and ``NormalizeAndClipActions`` behind, as RLlib's env runner
computes actions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.errors import ExportError, InputError, UnsafeCheckpointError
from policy_export.exporter.sources.base import (
    CHECKPOINT_OPTIONS, Inspection, Loaded, Opened, Option, Source, check_values, rllib_job_stem,
)
from policy_export.exporter.sources.safe_pickle import short_repr

FILTER_AGENT = Option("filter_agent", "the agent whose observations the module takes, where the connectors keep "
                      "them per agent: its MeanStdFilter statistics, its space behind a multi-agent "
                      "FlattenObservations (which agent maps to which module is code in the checkpoint, which is "
                      "not run)", None, metavar="AGENT_ID")


class ModuleCheckpointSource(Source):
    name = "rlmodule"
    description = "an RLlib new API stack checkpoint (torch RLModules)"
    order = 15  # before the old stack's: both write rllib_checkpoint.json
    stage = "rebuild module"
    reference = "the rebuilt module's TF session"
    shows_itself = True
    light_inspect = True
    options = (*CHECKPOINT_OPTIONS, FILTER_AGENT)

    def job_stem(self, path: Path) -> str:
        return rllib_job_stem(path)

    def detect(self, path: Path) -> bool:
        from policy_export.exporter.sources.rlmodule.reader import detect_layout

        return detect_layout(Path(path)) is not None

    def policy_ids(self, path: Path) -> list[str] | None:
        """The module ids by folder name (no pickle is opened)."""
        from policy_export.exporter.sources.rlmodule.reader import MODULE_ROOT, _module_ids, detect_layout

        layout = detect_layout(Path(path))
        if layout == "rl_module":
            return None
        try:
            return _module_ids(Path(path), MODULE_ROOT if layout == "algorithm" else ())
        except UnsafeCheckpointError:
            raise

    def open(self, path: Path, values: Mapping[str, Any]) -> Opened:
        from policy_export.exporter.sources.rlmodule.reader import read_module_checkpoint

        checked = check_values(self, values)
        if checked["all_policies"] and checked["policy_id"] is not None:
            raise InputError("--policy-id and --all-policies exclude each other")
        checkpoint = read_module_checkpoint(path)  # nothing imported or run
        policies = {}
        for mid, spec in checkpoint.modules.items():
            policies[mid] = export_space(checkpoint, spec, checked["use_filter"], checked["filter_agent"])
        return Opened(self, Path(checkpoint.path), checked, policies, checkpoint)

    def choose(self, opened: Opened) -> tuple[list[str | None], bool]:
        """The modules one run exports; each is checked here, before TensorFlow loads (its class,
        catalog and spaces; the filter in front of it)."""
        checkpoint, v = opened.state, opened.values
        ids = list(opened.policies) if v["all_policies"] else [checkpoint.module(v["policy_id"]).module_id]
        for mid in ids:
            refusal = checkpoint.modules[mid].refusal()
            if refusal:
                raise ExportError(refusal)
            if v["use_filter"]:
                checkpoint.filter_for(mid, v["filter_agent"])
            checkpoint.input_space(checkpoint.modules[mid], v["use_filter"], v["filter_agent"])
        return ids, bool(v["all_policies"])

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        from policy_export.exporter.sources.rlmodule.graph import load_module_policy

        checkpoint, v = opened.state, opened.values
        spec = checkpoint.module(policy_id)
        policy, record = load_module_policy(checkpoint, spec, use_filter=v["use_filter"], actions=v["actions"],
                                            device=device.tf_device, filter_agent=v["filter_agent"])
        described = {"converted_from": str(Path(checkpoint.path).absolute()), "kind": "rllib_module_checkpoint",
                     "layout": checkpoint.layout, "checkpoint_version": checkpoint.checkpoint_version,
                     "ray_version": checkpoint.ray_version, **record}
        return Loaded(policy, described, {"observation_filter": record["observation_filter"], "actions": v["actions"],
                                          "state_names": record["state_names"]}, None)

    def inspect(self, opened: Opened) -> Inspection:
        from policy_export.exporter.sources.rllib_checks import filter_record
        from policy_export.exporter.sources.rlmodule.reader import describe_network

        checkpoint, rows, table = opened.state, [], []
        for spec in checkpoint.modules.values():
            try:
                network = describe_network(spec)
            except ExportError as e:
                network = f"not rebuilt: {e}"
            filt = None
            try:
                filt = filter_record(checkpoint.filter_for(spec.module_id))
            except ExportError as e:
                filt = {"class": "per agent", "count": 0, "note": str(e)}
            rows.append({"module_id": spec.module_id, "module_class": spec.module_class,
                         "catalog_class": spec.catalog_class, "observation_space": str(spec.observation_space),
                         "action_space": str(spec.action_space), "model_config": _plain(spec.model_config),
                         "observation_filter": filt, "network": network})
            table.append((spec.module_id, spec.module_class.rsplit(".", 1)[-1], str(spec.observation_space),
                          str(spec.action_space), f"{filt['class']} (n={filt['count']})" if filt else "none", network))
        connectors = {"env_to_module": checkpoint.env_to_module, "module_to_env": checkpoint.module_to_env,
                      "normalize_actions": checkpoint.normalize_actions, "clip_actions": checkpoint.clip_actions,
                      "env_observation_space": str(checkpoint.env_observation_space)
                      if checkpoint.env_observation_space is not None else None}
        return Inspection(
            title=f"{opened.path} (RLlib new API stack, {checkpoint.layout.replace('_', ' ')} checkpoint "
                  f"{checkpoint.checkpoint_version}, ray {checkpoint.ray_version})",
            columns=("module id", "class", "observations", "actions", "filter", "network"), rows=table,
            json={"kind": "rllib_module_checkpoint", "layout": checkpoint.layout,
                  "checkpoint_version": checkpoint.checkpoint_version, "ray_version": checkpoint.ray_version,
                  "connectors": connectors, "modules": rows})

    def summary(self, record: Mapping[str, Any] | None) -> list[str]:
        source = record or {}
        filt = source.get("observation_filter")
        return [f"  {str(source.get('module_class', '?')).rsplit('.', 1)[-1]} ({source.get('family')}): "
                f"{source.get('network')} network, {len(source.get('weights_used') or [])} weights; observation "
                f"filter: {filt['class'] + ' (n=' + str(filt['count']) + ')' if filt else 'none'}; actions: "
                f"{source.get('actions')}"]


def export_space(checkpoint: Any, spec: Any, use_filter: bool, agent: str | None = None) -> Any:
    """The observation space an export of ``spec`` takes (and samples); None where it depends on
    an agent not named (the export says so when it loads)."""
    try:
        return checkpoint.input_space(spec, use_filter, agent)[0]
    except ExportError:
        return None


def _plain(value: Any) -> Any:
    """A stored config as JSON values: containers kept, bounded (the reader held the whole value
    to the pickled-value size), anything else by a short description."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else short_repr(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, str)) or value is None or (isinstance(value, float) and math.isfinite(value)) \
            or (isinstance(value, int) and abs(value) < 1 << 63):
        return value
    return short_repr(value)


SOURCE = ModuleCheckpointSource()
