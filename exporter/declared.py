"""An option, declared once by its owner (the core, a source, a format): the Python keyword, the
command-line flag, the type, default, rule and help. The command line's flags and ``--help``
groups are made from the declarations (:mod:`exporter.cli_args`), and one rule refuses an option
whose owner is neither the source given nor a format chosen (:mod:`exporter.pipeline`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from policy_export.errors import InputError


@dataclass(frozen=True)
class Option:
    """One option, declared once by its owner.

    ``name`` is the Python keyword; the flag is ``--name-with-dashes`` unless ``flag`` says
    otherwise. ``kind`` is ``"value"`` (one value, made by ``type`` on the command line),
    ``"flag"`` (true when given; false when given if its default is true: ``use_filter`` is
    ``--no-filter``), ``"list"`` (repeatable, values made by ``type``) or
    ``"choice"`` (one of ``choices``). ``rule`` checks a value (the command line's or the Python
    API's) and returns it, perhaps converted; it raises :class:`InputError` naming the option.
    ``path`` says the value names a file (each item of a list does): a league file's entry gives it
    relative to the league file, as it gives its source.
    """

    name: str
    help: str
    default: Any = None
    kind: str = "value"
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    rule: Callable[[Any, "Option"], Any] | None = None
    flag_name: str | None = None
    short: str | None = None  # a one-letter flag besides the long one ("-q")
    required: bool = False  # a flag the command cannot run without
    cli: bool = True  # False: a keyword of the Python API (and league files) only
    league: bool = False  # a league file's entry may set it (the core's options; every source's and format's may)
    api_type: type | tuple[type, ...] | None = None  # the API's type where it is not the command line's
    path: bool = False  # a file's path (each item's, for a list): a league file names it relative to itself

    @property
    def python_type(self) -> type | tuple[type, ...]:
        """The type the Python API (and a league file's JSON) gives the option."""
        if self.api_type is not None:
            return self.api_type
        return {"flag": bool, "list": list, "choice": str}.get(self.kind, self.type)

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")

    def add_to(self, parser: Any, keep_default: bool = False) -> None:
        """Add the flag to an argparse parser or group. Its value is absent unless given (so that
        whether it was given is known exactly), or the declared default with ``keep_default``."""
        default = argparse.SUPPRESS
        if keep_default:
            default = list(self.default) if self.kind == "list" and self.default is not None else self.default
        common = {"dest": self.name, "default": default, "help": self.help}
        if self.required:
            common["required"] = True
        flags = (self.short, self.flag) if self.short else (self.flag,)
        if self.kind == "flag":
            parser.add_argument(*flags, action="store_false" if self.default is True else "store_true", **common)
        elif self.kind == "list":
            parser.add_argument(*flags, action="append", type=self.type, metavar=self.metavar, **common)
        elif self.kind == "choice":
            parser.add_argument(*flags, choices=self.choices, **common)
        else:
            parser.add_argument(*flags, type=self.type, metavar=self.metavar, **common)

    def check(self, value: Any) -> Any:
        """``value`` checked by the option's ``rule`` (and its kind)."""
        if self.kind == "flag" and not isinstance(value, bool):
            raise InputError(f"{self.name} ({self.flag}) must be true or false, got {value!r:.80}")
        if self.kind == "choice" and value not in self.choices:
            raise InputError(f"{self.name} ({self.flag}) must be one of {', '.join(self.choices)}, got {value!r:.80}")
        if self.kind == "list" and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
            raise InputError(f"{self.name} ({self.flag}) must be a list, got {type(value).__name__}")
        return self.rule(value, self) if self.rule is not None else value
