"""The spec source: a directory holding ``policy.json`` (or the file itself), read by
:mod:`policy.spec` without TensorFlow and built by :class:`policy.TFPolicy`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.exporter.sources.base import Inspection, Loaded, Opened, Source, check_values


class SpecSource(Source):
    name = "spec"
    description = "a spec directory (policy.json)"
    order = 10
    stage = "graph build"
    shows_itself = True
    light_inspect = True
    has_base_model = True

    def detect(self, path: Path) -> bool:
        return (path.is_file() and path.name == "policy.json") or (path / "policy.json").is_file()

    def open(self, path: Path, values: Mapping[str, Any]) -> Opened:
        from policy_export.policy.spec import load_spec

        return self._opened(load_spec(path), Path(path), values)  # load_spec checks the weights file

    def opened(self, spec: Any, path: Path, values: Mapping[str, Any] = {}) -> Opened:  # noqa: B006 - read only
        """A :class:`policy.PolicySpec` already parsed (the Python API takes one), as :meth:`open` makes it;
        its weights file's names and shapes checked before TensorFlow loads, as :func:`load_spec` does."""
        from policy_export.policy.spec import check_weights_file

        check_weights_file(spec)
        return self._opened(spec, path, values)

    def _opened(self, spec: Any, path: Path, values: Mapping[str, Any]) -> Opened:
        return Opened(self, path, check_values(self, values), {None: spec.observation_space}, spec)

    def inspect(self, opened: Opened) -> Inspection:
        """The spec: its spaces, its network and its weights file (read without TensorFlow)."""
        from policy_export.policy.spaces import space_text

        spec = opened.state
        model = spec.model
        layers = [f"conv {len(model.conv_filters)} layers"] if model.conv_filters else []
        layers.append(f"dense {list(model.hiddens)} {model.activation}")
        if model.lstm is not None:
            layers.append(f"LSTM {model.lstm.cell_size}")
        weights = spec.weights.name if spec.weights is not None else f"none (seed {spec.seed})"
        row = (spec.name, space_text(spec.observation_space), space_text(spec.action_space), ", ".join(layers), weights)
        return Inspection(
            title=f"{opened.path} (spec, format version {spec.format_version})",
            columns=("name", "observations", "actions", "network", "weights"), rows=[row],
            json={"kind": "spec", **spec.to_json(relative_to=spec.weights.parent if spec.weights else None)})

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        from policy_export.policy.tf_policy import TFPolicy

        return Loaded(TFPolicy.from_spec(opened.state, device=device.tf_device))


SOURCE = SpecSource()
