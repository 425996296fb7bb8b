"""Every cheap check of a command's options, once, without TensorFlow.

:class:`ExportOptions` and :class:`VerifyOptions` check their values when they are made; the
command line makes them from its arguments before TensorFlow loads, the Python API from its
keywords, and the pipelines take them as made, so a refusal reads the same from either and runs
once. What needs the policy (the sample budget of its observation space, tolerance keys of its
outputs) is checked by :meth:`ExportOptions.check_policy`, also once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter import formats as registry
from policy_export.exporter.defaults import (
    DEFAULT_BATCH, DEFAULT_EXPLORE_SAMPLES, DEFAULT_EXTERNAL_DATA_THRESHOLD, DEFAULT_OBSERVATIONS, DEFAULT_OPSET,
    DEFAULT_EPISODES, DEFAULT_RETURN_TOLERANCE, DEFAULT_SAMPLES, DEFAULT_STEPS,
)
from policy_export.exporter.devices import DevicePlan
from policy_export.exporter.parity.compare import Tolerances
from policy_export.exporter.progress import Progress
from policy_export.exporter.watchdog import check_run_timeout
from policy_export.policy.spaces import MAX_SAMPLES, check_sample_budget

SUPPORTED_OPSETS = range(13, 22)
ALL_FORMATS = registry.names()  # every registered format, in export order
MAX_SEED = 2**31 - 1


def resolve_formats(formats: Sequence[str] | None) -> tuple[str, ...]:
    """Validate a format list (``None`` means the default formats) and put it in export order.

    Raises:
        InputError: an empty list, an unknown format, or one whose library is not installed (the
            extra to install named).
    """
    if formats is None:
        return registry.default_names()
    if isinstance(formats, str) or not formats:
        raise InputError("formats (--formats) is empty or not a list; name at least one format, or leave it out "
                         "for the defaults")
    unknown = [f for f in formats if f not in ALL_FORMATS]
    if unknown:
        raise InputError(f"unknown format(s) {unknown}; choose from {', '.join(ALL_FORMATS)}")
    for name in formats:  # a format whose library is not installed: the extra that brings it
        registry.get(name).check_installed()
    return tuple(f for f in ALL_FORMATS if f in formats)


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


def check_opset(opset: int) -> None:
    """Raises InputError for an opset outside :data:`SUPPORTED_OPSETS`."""
    if opset not in SUPPORTED_OPSETS:
        raise InputError(f"opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}")


def check_count(name: str, value: Any, least: int, most: int | None = None) -> int:
    """``value`` as an integer option of at least ``least`` (and at most ``most``).

    Raises:
        InputError: naming the option as the API and the command line spell it.
    """
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} ({flag}) must be an integer, got {value!r}")
    if value < least:
        raise InputError(f"{name} ({flag}) must be at least {least}, got {value}")
    if most is not None and value > most:
        raise InputError(f"{name} ({flag}) {value} exceeds the limit of {most}")
    return value


def check_pin(digest: str | None) -> str | None:
    """An expected manifest sha256 (64 hex digits) in lower case, or ``None``."""
    if digest is None:
        return None
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdefABCDEF" for c in digest)):
        raise InputError(f"expected manifest sha256 must be 64 hexadecimal digits, got {digest!r}")
    return digest.lower()


def check_tolerance_keys(tolerances: Tolerances, output_keys: Sequence[str], also: Sequence[str] = ()) -> None:
    """Every output a tolerance names must be one of ``output_keys`` (or ``also``): a typo would
    silently check nothing."""
    unknown = sorted((set(tolerances.per_output) | tolerances.allow_non_finite) - set(output_keys) - set(also))
    if unknown:
        raise InputError(f"tolerance given for unknown output(s) {unknown}; outputs are {list(output_keys)}")


@dataclass(frozen=True)
class ExportOptions:
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

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "explicit_formats", self.formats is not None)
        set_(self, "formats", resolve_formats(self.formats))
        check_opset(self.opset)
        check_count("samples", self.samples, 1, MAX_SAMPLES)
        check_count("seed", self.seed, 0, MAX_SEED)
        check_count("batch_size", self.batch_size, 1)
        check_count("explore_samples", self.explore_samples, 0, MAX_SAMPLES)
        check_count("stepped_steps", self.stepped_steps, 0, MAX_SAMPLES)
        check_count("external_data_threshold", self.external_data_threshold, 0)
        set_(self, "run_timeout", check_run_timeout(self.run_timeout))
        if self.model_name is not None:
            check_model_name(self.model_name)
        check_count("model_version", self.model_version, 1, MAX_MODEL_VERSION)
        if self.tolerances is not None and not isinstance(self.tolerances, Tolerances):
            raise InputError(f"tolerances must be a Tolerances, got {type(self.tolerances).__name__}")
        set_(self, "budgeted", [])  # the observation spaces whose sample budget these counts passed

    @classmethod
    def make(cls, options: "ExportOptions | None", keywords: Mapping[str, Any]) -> "ExportOptions":
        """``options`` as given, or made from ``keywords`` (not both)."""
        return _make(cls, options, keywords)

    def check_policy(self, observation_space, output_keys: Sequence[str] | None = None) -> None:
        """The checks that need the policy: sample budgets of its observation space, tolerance keys
        of its outputs (when known: ``None`` before the policy is built). A space whose budget
        passed already (the command line checks before TensorFlow loads, the export again when
        called directly) is not checked twice."""
        if not any(space is observation_space for space in self.budgeted):
            check_sample_budget(self.samples, observation_space, "samples (--samples)")
            if self.explore_samples:
                check_sample_budget(self.explore_samples * DEFAULT_OBSERVATIONS, observation_space,
                                    f"explore_samples (--explore-samples) {self.explore_samples} x "
                                    f"{DEFAULT_OBSERVATIONS} observations:")
            self.budgeted.append(observation_space)
        if self.tolerances is not None and output_keys is not None:
            check_tolerance_keys(self.tolerances, output_keys)


@dataclass(frozen=True)
class VerifyOptions:
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

    def __post_init__(self):
        if self.server not in (None, "triton"):
            raise InputError(f"server {self.server!r} is not one of: triton")
        if self.server is not None:
            from policy_export.exporter.compat import require

            require(("pytriton", "tritonclient"), "serve", f"verify --server {self.server}")
        check_count("samples", self.samples, 0, MAX_SAMPLES)
        check_count("seed", self.seed, 0, MAX_SEED)
        check_count("batch_size", self.batch_size, 1)
        object.__setattr__(self, "expect_manifest_sha256", check_pin(self.expect_manifest_sha256))
        object.__setattr__(self, "run_timeout", check_run_timeout(self.run_timeout))
        if self.tolerances is not None and not isinstance(self.tolerances, Tolerances):
            raise InputError(f"tolerances must be a Tolerances, got {type(self.tolerances).__name__}")

    @classmethod
    def make(cls, options: "VerifyOptions | None", keywords: Mapping[str, Any]) -> "VerifyOptions":
        """``options`` as given, or made from ``keywords`` (not both)."""
        return _make(cls, options, keywords)


@dataclass(frozen=True)
class RolloutOptions:
    """What :func:`exporter.rollout.rollout` takes besides the export and the environment (see its docstring)."""

    episodes: int = DEFAULT_EPISODES
    seed: int = 0
    device: str | DevicePlan = "auto"
    max_steps: int | None = None
    formats: Sequence[str] | None = None
    return_tolerance: float = DEFAULT_RETURN_TOLERANCE
    run_timeout: float | None = None

    def __post_init__(self):
        check_count("episodes", self.episodes, 1, MAX_SAMPLES)
        check_count("seed", self.seed, 0, MAX_SEED)
        if self.max_steps is not None:
            check_count("max_steps", self.max_steps, 1)
        value = self.return_tolerance
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InputError(f"return_tolerance (--return-tolerance) must be a finite number >= 0, got {value!r}")
        object.__setattr__(self, "run_timeout", check_run_timeout(self.run_timeout))

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
    """``options`` with ``changes``, checked again (formats left to the default stay so; the
    sample budgets already passed carry over unless the sample counts change)."""
    if "formats" not in changes and getattr(options, "explicit_formats", True) is False:
        changes["formats"] = None  # formats left to the default stay so (skipped, not refused, if unwritable)
    new = dataclasses.replace(options, **changes)
    if hasattr(options, "budgeted") and not {"samples", "explore_samples"} & changes.keys():
        object.__setattr__(new, "budgeted", options.budgeted)
    return new
