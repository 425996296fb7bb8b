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
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
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
from policy_export.exporter.staging import check_target
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


def _opset(value: int) -> int:
    check_opset(value)
    return value


def _model_name(value: str | None) -> str | None:
    if value is not None:
        check_model_name(value)
    return value


def _tolerances(value: Tolerances | None) -> Tolerances | None:
    if value is not None and not isinstance(value, Tolerances):
        raise InputError(f"tolerances must be a Tolerances, got {type(value).__name__}")
    return value


def _count(name: str, least: int, most: int | None = None) -> Callable[[Any], int]:
    return lambda value: check_count(name, value, least, most)


def _server(value: str | None) -> str | None:
    if value not in (None, "triton"):
        raise InputError(f"server {value!r} is not one of: triton")
    if value is not None:
        from policy_export.exporter.compat import require

        require(("pytriton", "tritonclient"), "serve", f"verify --server {value}")
    return value


def _optional(rule: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else rule(value)


def _return_tolerance(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(f"return_tolerance (--return-tolerance) must be a finite number >= 0, got {value!r}")
    return value


def _rollout_formats(value: Sequence[str] | None) -> Sequence[str] | None:
    if value is not None and (isinstance(value, str) or not value):
        raise InputError("formats (--formats): give two or more formats, e.g. saved_model,onnx, or leave it out "
                         "for saved_model,onnx")
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

    RULES = {"formats": resolve_formats, "opset": _opset, "samples": _count("samples", 1, MAX_SAMPLES),
             "seed": _count("seed", 0, MAX_SEED), "batch_size": _count("batch_size", 1),
             "explore_samples": _count("explore_samples", 0, MAX_SAMPLES),
             "stepped_steps": _count("stepped_steps", 0, MAX_SAMPLES),
             "external_data_threshold": _count("external_data_threshold", 0), "run_timeout": check_run_timeout,
             "model_name": _model_name, "model_version": _count("model_version", 1, MAX_MODEL_VERSION),
             "tolerances": _tolerances}

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

    RULES = {"server": _server, "samples": _count("samples", 0, MAX_SAMPLES), "seed": _count("seed", 0, MAX_SEED),
             "batch_size": _count("batch_size", 1), "expect_manifest_sha256": check_pin,
             "run_timeout": check_run_timeout, "tolerances": _tolerances}

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

    RULES = {"formats": _rollout_formats, "episodes": _count("episodes", 1, MAX_SAMPLES),
             "seed": _count("seed", 0, MAX_SEED), "max_steps": _optional(_count("max_steps", 1)),
             "return_tolerance": _return_tolerance, "run_timeout": check_run_timeout}

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
