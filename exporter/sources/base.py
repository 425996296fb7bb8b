"""The plugin protocol of sources, as :mod:`exporter.formats.base` is that of formats.

A source is what ``export SOURCE`` (and its alias ``convert``) takes: it declares how a path is
recognised (:meth:`Source.detect`), its own options (:class:`Option`, each declared here once:
the Python keyword, the command-line flag, the type, default, rule and help), the policies it
holds (:meth:`Source.policy_ids`, names only, for ``export-many``), what it reads and checks
before TensorFlow loads (:meth:`Source.open` -> :class:`Opened`), which policies one run exports
(:meth:`Source.choose`), what ``inspect`` shows of it (:meth:`Source.inspect`), and
:meth:`Source.load`, which returns one type, :class:`Loaded`, for every source: the policy, the
record of where it came from, what it adds to the contract, and a tolerance hint.

Sources import nothing from formats or parity (an import-linter contract): a tolerance hint is a
plain ``(atol, rtol)`` pair.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter.declared import Option  # noqa: F401 (a source's options are Options)


@dataclass
class Opened:
    """A source read and checked before TensorFlow loads.

    ``policies`` maps each policy it holds (``None``: a source of one unnamed policy) to the
    observation space its export samples, or ``None`` where that is known only once it is
    loaded; ``values`` are the source's own options, checked; ``state`` is what was read (a
    spec, a checkpoint, the SavedModel's options), for :meth:`Source.load`.
    """

    source: "Source"
    path: Path
    values: dict[str, Any]
    policies: dict[str | None, Any]
    state: Any = None


@dataclass
class Loaded:
    """What :meth:`Source.load` returns, for every source.

    ``policy`` is the loaded policy (a :class:`policy.TFPolicy`: graph, session, signature
    tensors, spaces), closed by the caller; ``record`` is the manifest's ``source`` (``None``:
    nothing recorded, as for a spec); ``contract`` what the source adds to the I/O contract;
    ``tolerance`` an ``(atol, rtol)`` default parity tolerance the source needs (``None``: the
    package's default), used only when the user gave no tolerance of their own.
    """

    policy: Any
    record: dict[str, Any] | None = None
    contract: dict[str, Any] = field(default_factory=dict)
    tolerance: tuple[float, float] | None = None


@dataclass(frozen=True)
class Inspection:
    """What ``inspect`` shows of a source: a title, a table (columns and rows of text) and JSON."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    json: dict[str, Any]


class Source:
    """The base of every source plugin; see the module docstring."""

    name: str = ""
    description: str = ""  # what it is, for messages: "a spec directory (policy.json)"
    order: int = 100  # detection order: a path that is several kinds is the first
    options: tuple[Option, ...] = ()
    stage: str = "load"  # the progress stage of loading one policy
    reference: str = "the TF session"  # what parity compares every format with, for the reports
    shows_itself: bool = False  # inspect shows the source (inspect()) rather than a model's contract
    light_inspect: bool = False  # inspect() imports no TensorFlow
    has_base_model: bool = False  # the policies it loads carry a Keras base model (what the keras format writes)

    def detect(self, path: Path) -> bool:
        raise NotImplementedError

    def policy_ids(self, path: Path) -> list[str] | None:
        """The names of the policies ``path`` holds, read without any state (``None``: one unnamed
        policy, or names known only once it is read)."""
        return None

    def job_stem(self, path: Path) -> str:
        """What ``export-many`` names the policy at ``path`` after (before it is made a serving
        name): the folder's own name; a source whose folders carry the tool's names (RLlib's
        ``checkpoint_000010``) names the folder that holds them."""
        return path.name

    def open(self, path: Path, values: Mapping[str, Any]) -> Opened:
        """Read and check ``path`` (no TensorFlow): raises the package's errors for bad input."""
        raise NotImplementedError

    def choose(self, opened: Opened) -> tuple[list[str | None], bool]:
        """The policies one run exports, and whether each goes to ``OUT/<policy id>``."""
        return list(opened.policies), False

    def inspect(self, opened: Opened) -> Inspection | None:
        """What ``inspect`` shows (``None``: the source is read as a model's contract instead)."""
        return None

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        """Load one policy of ``opened`` (``policy_id`` one of its ``policies``) on ``device`` (a
        :class:`~exporter.devices.DevicePlan`); raises the package's errors, never leaves a session open."""
        raise NotImplementedError

    def summary(self, record: Mapping[str, Any] | None) -> list[str]:
        """Plain lines the command line prints about a loaded policy's ``record`` after its export."""
        return []

    def stage_name(self, policy_id: str | None) -> str:
        return self.stage if policy_id is None else f"{self.stage} {policy_id}"

    def __repr__(self) -> str:
        return f"<source {self.name}>"


def check_values(source: Source, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (option name -> value) checked by their options; every option of ``source`` not
    given takes its default.

    Raises:
        InputError: a value is refused, or names no option of ``source``.
    """
    own = {o.name: o for o in source.options}
    unknown = sorted(set(values) - set(own))
    if unknown:
        raise InputError(f"{', '.join(unknown)}: not an option of {source.description}")
    return {name: (option.check(values[name]) if name in values else option.default) for name, option in own.items()}


# the options of both RLlib checkpoint sources (the old API stack's and the new one's), declared once
CHECKPOINT_OPTIONS = (
    Option("policy_id", "the policy (the new API stack: the module) to export (default: the only one)", None,
           metavar="ID"),
    Option("all_policies", "one export per policy (module) id, at OUT/<id>/", False, kind="flag"),
    Option("use_filter", "leave RLlib's observation filter (MeanStdFilter) out of the graph (the export then takes "
           "filtered observations)", True, kind="flag", flag_name="--no-filter"),
    Option("actions", "serve the action the environment takes (unsquashed to the action space's bounds with "
           "normalize_actions, clipped with clip_actions; the default) or the policy's own (as the policy or "
           "module computes it)", "environment", kind="choice", choices=("environment", "policy")),
)


RLLIB_CHECKPOINT_NAME = re.compile(r"checkpoint(_\d+)?")  # the folder names RLlib gives its checkpoints


def rllib_job_stem(path: Path) -> str:
    """An RLlib checkpoint's name for ``export-many``: RLlib's own folder names (``checkpoint``,
    ``checkpoint_000010``) say nothing of the run, so the folder holding one names it."""
    return path.parent.name if RLLIB_CHECKPOINT_NAME.fullmatch(path.name) else path.name
