"""Every check of a command's options, in one place, without TensorFlow.

:class:`ExportOptions`, :class:`VerifyOptions` and :class:`RolloutOptions` check their values
when they are made, and :func:`replace` checks the values it changes; the command line makes them
from its arguments before TensorFlow loads, the Python API from its keywords, and the pipelines
take them as made, so a refusal reads the same from either and is made once. What an export
needs besides its options, the sample budgets of its policy's observation space and its target
directory, is checked by :meth:`ExportOptions.check_export`, once, where the pipeline first knows
them; the tolerance keys of the policy's outputs, once its signature is built.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter import formats as registry
from policy_export.exporter import core_options as declared
from policy_export.exporter.core_options import (  # noqa: F401  (the API's names for them)
    MAX_SEED, SUPPORTED_OPSETS, check_count, check_opset, check_pin, resolve_formats,
)
from policy_export.exporter.defaults import (
    DEFAULT_BATCH, DEFAULT_EXPLORE_SAMPLES, DEFAULT_EXTERNAL_DATA_THRESHOLD, DEFAULT_OBSERVATIONS, DEFAULT_OPSET,
    DEFAULT_EPISODES, DEFAULT_RETURN_TOLERANCE, DEFAULT_SAMPLES, DEFAULT_STEPS,
)
from policy_export.exporter.devices import DevicePlan
from policy_export.exporter.parity.compare import Tolerances
from policy_export.exporter.progress import Progress
from policy_export.exporter.staging import check_target
from policy_export.policy.spaces import check_sample_budget

ALL_FORMATS = registry.names()  # every registered format, in export order


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_MODEL_VERSION = 2**63 - 1


def check_model_name(name: str) -> None:
    """Raises InputError unless ``name`` can name a model on a model server and a directory (letters,
    digits, ``_``, ``.``, ``-``; at most 128; not starting with a separator)."""
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        raise InputError(f"model name {name!r}: use 1-128 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit (it names the model on a model server and its directory)")


def serving_name(name: str) -> str:
    """``name`` (a policy's) made into a legal model name: other characters become ``_``."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", name.strip())[:128].lstrip("_.-")
    return cleaned or "policy"


def check_tolerance_keys(tolerances: Tolerances, output_keys: Sequence[str], also: Sequence[str] = ()) -> None:
    """Every output a tolerance names must be one of ``output_keys`` (or ``also``): a typo would
    silently check nothing."""
    unknown = sorted((set(tolerances.per_output) | tolerances.allow_non_finite) - set(output_keys) - set(also))
    if unknown:
        raise InputError(f"tolerance given for unknown output(s) {unknown}; outputs are {list(output_keys)}")


def _model_name(value: str | None) -> str | None:
    if value is not None:
        check_model_name(value)
    return value


class _Checked:
    """Options checked when made: ``RULES`` maps a field to the function that checks its value
    and returns it as kept (in the order the fields are checked); :func:`replace` checks the
    fields it changes."""

    RULES: dict[str, Callable[[Any], Any]] = {}

    def __post_init__(self):
        self._check(self.RULES)

    def _check(self, names: Collection[str]) -> None:
        for name, rule in self.RULES.items():
            if name in names:
                object.__setattr__(self, name, rule(getattr(self, name)))


@dataclass(frozen=True)
class ExportOptions(_Checked):
    """What :func:`exporter.export.export_policy` takes besides the policy and the target (the
    keywords of the Python API, one for one; see its docstring). Checked when made."""

    formats: Sequence[str] | None = None
    opset: int = DEFAULT_OPSET
    samples: int = DEFAULT_SAMPLES
    seed: int = 0
    tolerances: Tolerances | None = None
    device: str | DevicePlan = "auto"
    overwrite: bool = False
    batch_size: int = DEFAULT_BATCH
    explore_samples: int = DEFAULT_EXPLORE_SAMPLES
    inputs_as_nchw: bool = False
    stepped_steps: int = DEFAULT_STEPS
    source: Mapping[str, Any] | None = None
    external_data_threshold: int = DEFAULT_EXTERNAL_DATA_THRESHOLD
    progress: Progress | None = None
    behaviour: Mapping[str, Mapping[str, float]] | None = None
    run_timeout: float | None = None
    model_name: str | None = None
    model_version: int = 1
    observations: Sequence[str | Path] | None = None
    # a model file exported elsewhere (exporter.foreign.export): the recording it is proven against
    reference: str | Path | None = None
    reference_names: Mapping[str, str] | None = None
    reference_state_pairs: Mapping[str, str] | None = None
    contract_file: str | Path | None = None

    RULES = {**declared.rules(declared.EXPORT, __annotations__), "model_name": _model_name,
             "model_version": lambda value: check_count("model_version", value, 1, MAX_MODEL_VERSION)}

    def _check(self, names: Collection[str]) -> None:
        if "formats" in names:  # formats left to the default stay so (skipped, not refused, if unwritable)
            object.__setattr__(self, "explicit_formats", self.formats is not None)
        super()._check(names)

    @classmethod
    def make(cls, options: "ExportOptions | None", keywords: Mapping[str, Any]) -> "ExportOptions":
        """``options`` as given, or made from ``keywords`` (not both)."""
        return _make(cls, options, keywords)

    def check_policy(self, observation_space) -> None:
        """The sample budgets of the observation space the export samples (``samples``, and
        ``explore_samples`` per exploration observation)."""
        check_sample_budget(self.samples, observation_space, "samples (--samples)")
        if self.observations:  # recorded observations of another shape: refused before any work
            from policy_export.exporter.recorded import check_fit

            check_fit(self.observations, observation_space)
        if self.explore_samples:
            check_sample_budget(self.explore_samples * DEFAULT_OBSERVATIONS, observation_space,
                                f"explore_samples (--explore-samples) {self.explore_samples} x "
                                f"{DEFAULT_OBSERVATIONS} observations:")

    def check_export(self, observation_space, out: str | Path) -> None:
        """What an export of a policy with ``observation_space`` to ``out`` must pass before any
        work: the sample budgets (:meth:`check_policy`; ``None``: the space is known only once the
        policy is loaded, whose budgets are then checked) and the target
        (:func:`exporter.staging.check_target`, with ``overwrite``).

        Each pipeline runs it once, where it first knows both: the command line before TensorFlow
        loads, the Python API's functions on entry; the stages after it take both as checked.
        """
        if observation_space is not None:
            self.check_policy(observation_space)
        check_target(out, self.overwrite)


@dataclass(frozen=True)
class VerifyOptions(_Checked):
    """What :func:`exporter.verify.verify_export` takes besides the export (see its docstring)."""

    samples: int = 0
    seed: int = 1
    device: str | DevicePlan = "auto"
    tolerances: Tolerances | None = None
    batch_size: int = DEFAULT_BATCH
    expect_manifest_sha256: str | None = None
    candidates: Mapping[str, str | Path] | None = None
    localize: bool = False
    progress: Progress | None = None
    behaviour: Mapping[str, Mapping[str, float]] | None = None
    run_timeout: float | None = None
    server: str | None = None  # "triton": also serve the export and check it through the server's clients
    observations: Sequence[str | Path] | None = None  # recorded observations, checked against the SavedModel
    reference: str | Path | None = None  # a model file (not an export) checked against this recording
    reference_names: Mapping[str, str] | None = None  # recorded name -> the graph's
    reference_state_pairs: Mapping[str, str] | None = None  # a recurrent graph's state input -> the output fed back

    RULES = declared.rules(declared.VERIFY, __annotations__)

    @classmethod
    def make(cls, options: "VerifyOptions | None", keywords: Mapping[str, Any]) -> "VerifyOptions":
        """``options`` as given, or made from ``keywords`` (not both)."""
        return _make(cls, options, keywords)


@dataclass(frozen=True)
class RolloutOptions(_Checked):
    """What :func:`exporter.rollout.rollout` takes besides the export and the environment (see its docstring)."""

    episodes: int = DEFAULT_EPISODES
    seed: int = 0
    device: str | DevicePlan = "auto"
    max_steps: int | None = None
    formats: Sequence[str] | None = None
    return_tolerance: float = DEFAULT_RETURN_TOLERANCE
    run_timeout: float | None = None

    RULES = declared.rules(declared.ROLLOUT, __annotations__)

    @classmethod
    def make(cls, options: "RolloutOptions | None", keywords: Mapping[str, Any]) -> "RolloutOptions":
        """``options`` as given, or made from ``keywords`` (not both)."""
        return _make(cls, options, keywords)


def _make(cls, options, keywords: Mapping[str, Any]):
    if options is None:
        return cls(**keywords)
    if keywords:
        raise TypeError(f"pass either options or keywords, not both (got {sorted(keywords)})")
    if not isinstance(options, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
    return options


def replace(options, **changes):
    """``options`` with ``changes``, each changed value checked (the others were checked when
    ``options`` was made); formats left to the default stay so unless ``formats`` is changed."""
    known = {f.name for f in dataclasses.fields(options)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"{type(options).__name__} has no option(s) {unknown}")
    new = copy.copy(options)
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    new._check(changes)
    return new
