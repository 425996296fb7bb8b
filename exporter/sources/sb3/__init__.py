"""The source of Stable-Baselines3: a model zip as ``model.save`` writes it (SB3 2.x and
sb3-contrib), with the ``vec_normalize.pkl`` that ``VecNormalize.save`` writes apart from it,
read without torch and without SB3 (:mod:`.reader`) and rebuilt as the TF policy graph of what
``model.predict(obs, deterministic=True)`` computes (:mod:`.graph`): the export takes the
observations the environment gives and returns the action the environment takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter.sources.base import Inspection, Loaded, Opened, Option, Source, check_values


def _file(value: Any, option: Option) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise InputError(f"{option.name} ({option.flag}) must be a path, got {type(value).__name__}")
    return str(value)


VEC_NORMALIZE = Option("vec_normalize", "the VecNormalize statistics saved beside the model (VecNormalize.save: "
                       "vec_normalize.pkl); the export then takes the observations the environment gives and "
                       "normalises them as SB3 does", None, metavar="FILE", rule=_file, api_type=(str, Path), path=True)


class SB3Source(Source):
    name = "sb3"
    description = "a Stable-Baselines3 model zip (model.save)"
    order = 40
    stage = "rebuild policy"
    reference = "the rebuilt policy's TF session"
    shows_itself = True
    light_inspect = True
    options = (VEC_NORMALIZE,)

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return path.suffix.lower() == ".zip" and not path.is_dir()

    def open(self, path: Path, values: Mapping[str, Any]) -> Opened:
        from policy_export.exporter.sources.sb3.reader import read_sb3

        checked = check_values(self, values)
        model = read_sb3(path, checked["vec_normalize"])  # nothing imported or run: no TensorFlow, torch or SB3
        return Opened(self, Path(path), checked, {None: model.observation_space}, model)

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        from policy_export.exporter.sources.sb3.graph import load_sb3_policy

        model = opened.state
        policy, record = load_sb3_policy(model, device=device.tf_device)
        described = {"converted_from": str(Path(model.path).absolute()), **record}
        return Loaded(policy, described, {"state_names": record["state_names"], "postprocess": record["postprocess"]})

    def inspect(self, opened: Opened) -> Inspection:
        from policy_export.exporter.sources.sb3.inspect import network_text, postprocess_text

        model = opened.state
        norm = model.vec_normalize
        front = "none" if norm is None else f"VecNormalize (clip {norm.clip_obs:g})"
        row = (model.algorithm, model.policy_class.rsplit(".", 1)[-1], str(model.observation_space),
               str(model.action_space), network_text(model), front, postprocess_text(model))
        return Inspection(
            title=f"{opened.path} (Stable-Baselines3 {model.sb3_version} model zip)",
            columns=("algorithm", "policy", "observations", "actions", "network", "in front", "after the network"),
            rows=[row],
            json={"kind": "sb3_zip", "sb3_version": model.sb3_version, "algorithm": model.algorithm,
                  "policy_class": model.policy_class, "observation_space": str(model.observation_space),
                  "action_space": str(model.action_space), "network": network_text(model),
                  "extractor": model.extractor, "activation": model.kwargs["activation_fn"],
                  "use_sde": model.use_sde, "vec_normalize": norm.record() if norm else None,
                  "postprocess": postprocess_text(model)})

    def summary(self, record: Mapping[str, Any] | None) -> list[str]:
        source = record or {}
        norm = " behind VecNormalize" if source.get("vec_normalize") else ""
        return [f"  {source.get('algorithm')} ({str(source.get('policy_class', '?')).rsplit('.', 1)[-1]}){norm}, "
                f"{len(source.get('weights_used') or [])} weights; actions: {source.get('postprocess')}"]


SOURCE = SB3Source()
