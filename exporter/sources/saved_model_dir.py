"""The SavedModel source: a directory holding ``saved_model.pb`` that someone else wrote.

It is read once (:func:`exporter.trust.read_saved_model`) and routed by what it holds: a Keras base
model (RLlib >= 2.1 ``export_model``: the network alone, the action head rebuilt from
``action_space``; :mod:`exporter.sources.keras`) or a TF1 policy graph (RLlib <= 2.0, whose
signature has ``actions`` outputs; :mod:`exporter.sources.legacy`). The manifest's ``source``
records where every key came from.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter.sources.base import Loaded, Opened, Option, Source, check_values
from policy_export.signatures.keys import EXPLORE

log = logging.getLogger(__name__)


def _space(value: Any, option: Option) -> Any:
    """A gymnasium space: as is, from policy.json's space format (a dict, JSON text) or a .json file."""
    import gymnasium as gym

    from policy_export.policy import jsonio
    from policy_export.policy.spaces import space_from_json

    if value is None or isinstance(value, gym.Space):
        return value
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        try:
            value = Path(value).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"{option.flag} {value!r}: neither JSON text nor a readable file ({e.strerror})") from e
    obj = jsonio.loads(value, option.flag) if isinstance(value, str) else value  # strict JSON
    return space_from_json(obj, "$", option.flag)


def _state_pairs(value: Any, option: Option) -> list[tuple[str, str]] | None:
    """``IN_KEY=OUT_KEY`` items (or ``(in, out)`` pairs), in order; ``None`` or empty: natural order."""
    pairs = []
    for item in value or []:
        if isinstance(item, str):
            a, sep, b = item.partition("=")
            if not sep or not a or not b:
                raise InputError(f"{option.flag} {item!r}: expected IN_KEY=OUT_KEY")
            pairs.append((a, b))
        elif isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(k, str) and k for k in item):
            pairs.append((item[0], item[1]))
        else:
            raise InputError(f"{option.flag}: expected IN_KEY=OUT_KEY items, got {item!r:.80}")
    return pairs or None


class SavedModelSource(Source):
    name = "saved_model"
    description = "a SavedModel directory (saved_model.pb)"
    order = 30
    stage = "load SavedModel"
    reference = "the source SavedModel's session"
    options = (
        Option("signature_key", "the signature (default serving_default)", "serving_default",
               metavar="KEY", flag_name="--signature"),
        Option("tag", "the meta graph tag (default serve)", "serve", metavar="TAG"),
        Option("state_pairs", "pair a state input with its output, in order (repeat); default: natural "
               "order of names", None, kind="list", metavar="IN_KEY=OUT_KEY", rule=_state_pairs, flag_name="--state"),
        Option("observation_space", "the observation space the graph takes, in policy.json's space "
               "format (JSON text or a .json file); parity samples from it (default: inferred from the tensors)",
               None, metavar="JSON|FILE", rule=_space,
               api_type=(dict, str)),
        Option("action_space", "the action space the graph computes, same format (default: inferred "
               "from the tensors; required for a Keras base model)", None, metavar="JSON|FILE", rule=_space,
               api_type=(dict, str)),
        Option("weights", "TF1 policy SavedModels: take the variables' values from this tf.compat.v1.train.Saver "
               "checkpoint instead (RLlib <= 2.0's export_checkpoint: its directory, prefix or .index), by variable "
               "name, every one checked before any is assigned", None, metavar="TF1_CHECKPOINT", path=True),
        Option("dist_inputs", "Keras base models: the output holding the action distribution inputs (default: the "
               "one output of the width the action space needs)", None, metavar="KEY"),
    )

    def detect(self, path: Path) -> bool:
        return (path / "saved_model.pb").is_file()

    def open(self, path: Path, values: Mapping[str, Any]) -> Opened:
        checked = check_values(self, values)
        return Opened(self, Path(path), checked, {None: checked["observation_space"]})

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        from policy_export.exporter.sources.keras import is_keras_base_model
        from policy_export.exporter.trust import read_saved_model

        path, v = opened.path, opened.values
        proto = read_saved_model(path)  # read once, for both routes
        if is_keras_base_model(path, v["signature_key"], v["tag"], proto=proto):
            if v["weights"] is not None:
                raise InputError("--weights applies to TF1 policy SavedModels (RLlib <= 2.0's export_model); this "
                                 "is a Keras base model")
            return _keras(path, v, proto, device)
        if v["dist_inputs"] is not None:
            raise InputError("--dist-inputs applies to Keras base models only; this SavedModel has 'actions' outputs")
        return _legacy(path, v, proto, device)

    def summary(self, record: Mapping[str, Any] | None) -> list[str]:
        return [f"  {old} -> {new}" for new, old in ((record or {}).get("key_mapping") or {}).items()]


def _legacy(path: Path, v: Mapping[str, Any], proto: Any, device: str | None) -> Loaded:
    from policy_export.exporter.sources.legacy import SavedModelFiles, load_saved_model_policy

    policy, record = load_saved_model_policy(path, v["signature_key"], v["tag"], device, v["state_pairs"],
                                             v["observation_space"], v["action_space"],
                                             files=SavedModelFiles(proto=proto, weights=v["weights"]))
    if EXPLORE in record and "refused" in record[EXPLORE]:
        log.warning("explore refused: %s", record[EXPLORE]["refused"])
    elif EXPLORE in record:
        log.info("the hidden exploration switch %s (default %s) is the 'explore' input, default false",
                 record[EXPLORE]["from"], record[EXPLORE]["original_default"])
    return Loaded(policy, {"converted_from": str(Path(path).absolute()), "signature": v["signature_key"],
                           "tag": v["tag"], **record})


def _keras(path: Path, v: Mapping[str, Any], proto: Any, device: str | None) -> Loaded:
    from policy_export.exporter.sources.keras import load_keras_policy
    from policy_export.policy.spaces import space_to_json

    if v["action_space"] is None:
        raise InputError(f"{path} is a Keras base model (its signature has no 'actions' output): the action head "
                         f"is not stored in it, so --action-space is required, e.g. "
                         f"'{{\"type\": \"Discrete\", \"n\": 2}}'")
    policy, mapping = load_keras_policy(path, v["action_space"], observation_space=v["observation_space"],
                                        dist_inputs=v["dist_inputs"], signature_key=v["signature_key"],
                                        tag=v["tag"], device=device, proto=proto)
    return Loaded(policy, {"converted_from": str(Path(path).absolute()), "kind": "keras_base_model",
                           "signature": v["signature_key"], "tag": v["tag"], "key_mapping": mapping,
                           "action_space": space_to_json(v["action_space"])})


SOURCE = SavedModelSource()
