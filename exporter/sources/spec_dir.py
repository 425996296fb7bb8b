"""The spec source: a directory holding ``policy.json`` (or the file itself), read by
:mod:`policy.spec` without TensorFlow and built by :class:`policy.TFPolicy`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.exporter.sources.base import Loaded, Opened, Source, check_values


class SpecSource(Source):
    name = "spec"
    description = "a spec directory (policy.json)"
    order = 10
    stage = "graph build"

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

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        from policy_export.policy.tf_policy import TFPolicy

        return Loaded(TFPolicy.from_spec(opened.state, device=device.tf_device))


SOURCE = SpecSource()
