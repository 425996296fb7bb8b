"""What the command line prints, fitted to the width it prints at.

The width (:func:`width_of`): ``COLUMNS`` when it is set, else the terminal's where the stream is
one, else 80 (a pipe, a CI log). Everything a command prints for a person goes through here:

- :func:`wrap`: text broken at spaces only, its continuation lines indented; a word longer than
  the width (a long path) stands alone on its line and is never cut;
- :func:`say` and :func:`note`: such text printed, ``label: text`` with the continuation lines
  under the text;
- :func:`fit`: a table fitted to the width: each column as wide as its cells, narrowed where
  its cells wrap at spaces; when even the narrowest layout does not fit, the columns that matter
  least are left out, and :func:`print_table` says which;
- :func:`emit`: a rich renderable printed with no line's trailing spaces.

No line printed ends in a space. JSON output (``--json``) is data and is printed as it is.

    out = console_for(sys.stdout)
    note(out, "plan", "golden: 1000 samples, deterministic outputs")
    print_table(out, "title", [Column("format"), Column("error", justify="right")], rows)
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

DEFAULT_WIDTH = 80  # through a pipe, in a CI log
MIN_WIDTH = 40  # below this no table is laid out narrower: its lines are then longer than the width
GAP = 2  # spaces between two columns of a table


def width_of(stream: TextIO | None, environ: Mapping[str, str] | None = None) -> int:
    """The width to print at on ``stream``: ``COLUMNS`` when set (a whole number above 0), else
    the terminal's width where ``stream`` is a terminal, else :data:`DEFAULT_WIDTH`."""
    environ = os.environ if environ is None else environ
    columns = environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        if stream is not None and stream.isatty():
            size = os.get_terminal_size(stream.fileno()).columns
            if size > 0:
                return size
    except (AttributeError, ValueError, OSError):  # no descriptor, closed, or not a terminal after all
        pass
    return DEFAULT_WIDTH


def console_for(stream: TextIO | None = None, stderr: bool = False):
    """A rich Console on ``stream`` (default stdout, or stderr with ``stderr``) at :func:`width_of`
    it, whose every line fits that width (see ``Screen`` in :func:`_screen_class`)."""
    import sys

    stream = stream if stream is not None else (sys.stderr if stderr else sys.stdout)
    return _screen_class()(file=stream, width=width_of(stream), stderr=stderr)


def wrap(text: str, width: int, first: str = "", rest: str | None = None) -> list[str]:
    """``text`` on lines of at most ``width`` columns, broken at spaces only: ``first`` starts the
    first line, ``rest`` (default: as many spaces as ``first`` is long) every other line. A word
    longer than the room left stands alone on its line, whole."""
    rest = " " * len(first) if rest is None else rest
    longest = max((len(word) for word in text.split()), default=0)
    if len(rest) + longest > width:  # a long word (a digest, a path) gets the room it needs, if any line has it
        rest = rest[:max(0, width - longest)]
    lines = textwrap.wrap(text, max(width, len(rest) + 1), initial_indent=first, subsequent_indent=rest,
                          break_long_words=False, break_on_hyphens=False, drop_whitespace=True)
    return [line.rstrip() for line in lines] or [first.rstrip()]


def one_line(text: object) -> str:
    """``text`` on one line: newlines and other control characters escaped, and every path the
    user typed (:func:`paths_as_typed`) shown as typed."""
    return _typed.shown("".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text)))


class TypedPaths:
    """The paths a person typed, each relative one with the absolute forms the package may print
    for it (made absolute; links resolved): :meth:`shown` puts the typed form back, so a message
    names ``out/cartpole`` where the user typed that, whatever the library made of it. The folder
    a relative path was typed in is shown as typed too (``out/cartpole.sig`` beside
    ``out/cartpole``; a file of the working directory by its name). A path typed absolute is
    printed as it is already."""

    _EDGE = r"[\w.~+@%-]"  # a character a path's name holds: a match must not start or end inside a name

    def __init__(self, typed: Sequence[str] = ()):
        import re

        forms: dict[str, str] = {}
        prefixes: dict[str, str] = {}  # the working directory, shown as nothing before a relative path
        for text in typed:
            if not isinstance(text, str) or not text or text.startswith("-") or "\n" in text or len(text) > 4096:
                continue
            if os.path.isabs(text):
                forms.setdefault(text.rstrip("/") or text, text.rstrip("/") or text)  # kept as typed
                continue
            shown = text.rstrip("/") or text
            folder = os.path.dirname(shown)
            for absolute in {os.path.abspath(shown), os.path.realpath(shown)}:
                if absolute != "/":
                    forms.setdefault(absolute, shown)
            if folder:
                for absolute in {os.path.abspath(folder), os.path.realpath(folder)}:
                    if absolute != "/":
                        forms.setdefault(absolute, folder)
            else:
                for here in {os.getcwd(), os.path.realpath(os.getcwd())}:
                    if here != "/":
                        prefixes.setdefault(here + "/", "")
        self._forms = {**forms, **prefixes}
        alternatives = [rf"{re.escape(a)}(?!{self._EDGE})" for a in forms] + [re.escape(p) for p in prefixes]
        order = sorted(range(len(alternatives)), key=lambda i: -len((list(forms) + list(prefixes))[i]))
        keys = list(forms) + list(prefixes)
        self._keys = [keys[i] for i in order]
        self._pattern = re.compile(rf"(?<!{self._EDGE})(?:" + "|".join(f"({alternatives[i]})" for i in order) + ")") \
            if alternatives else None

    def shown(self, text: str) -> str:
        if self._pattern is None or "/" not in text:
            return text
        return self._pattern.sub(lambda m: self._forms[self._keys[m.lastindex - 1]], text)


_typed = TypedPaths()


def paths_as_typed(typed: Sequence[str]) -> None:
    """From now on (until called again) every text printed through this module shows the paths in
    ``typed`` as typed (see :class:`TypedPaths`); the command line calls it with its arguments."""
    global _typed
    _typed = TypedPaths(typed)


def typed_arguments(args: Any) -> list[str]:
    """Every text value of parsed arguments (``argparse.Namespace``): strings, the strings of
    lists, and the value of ``NAME=VALUE`` items; the paths among them are what the user typed."""
    found: list[str] = []
    for value in vars(args).values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str):
                found.append(item)
                if "=" in item:
                    found.append(item.split("=", 1)[1])
    return found


def error_line(text: str, stream: TextIO | None = None) -> None:
    """One message on stderr (or ``stream``), wrapped at its width (80 columns unless a terminal
    or ``COLUMNS`` says otherwise), its continuation lines indented by two spaces; paths as the
    user typed them."""
    import sys

    stream = sys.stderr if stream is None else stream
    for line in wrap(one_line(text), width_of(stream), rest="  "):
        print(line, file=stream)


def fitted(text, width: int, first: str = "", rest: str = "  ") -> list:
    """``text`` (a rich Text, its styles kept; or plain text) as lines of at most ``width``
    columns (see :func:`wrap`): ``first`` before the first line, ``rest`` before every other."""
    from rich.text import Text

    if not isinstance(text, Text):
        text = Text(one_line(text))
    else:
        plain = one_line(text.plain)
        if plain != text.plain:  # a control character or a path to show as typed: the plain text wins
            text = Text(plain, style=text.style)
    lines, at, plain = [], 0, text.plain
    for n, line in enumerate(wrap(plain, width, first=first, rest=rest)):
        lead = first.rstrip() if n == 0 and line.startswith(first.rstrip()) else ""
        lead += line[len(lead):][:len(line[len(lead):]) - len(line[len(lead):].lstrip(" "))]  # the indent wrap() gave
        body = line[len(lead):]
        while at < len(plain) and plain[at] == " " and not plain.startswith(body, at):
            at += 1
        start = plain.find(body, at) if body else at
        if start < 0:  # not found as it is (cannot happen for text wrap() made): the plain line
            lines.append(Text(line))
            continue
        piece = Text(lead) + text[start:start + len(body)]
        piece.rstrip()
        lines.append(piece)
        at = start + len(body)
    return lines


def say(console, text: object, indent: str = "  ", style: str | None = None, first: str = "") -> None:
    """``text`` (plain, never read as markup; or a rich Text) wrapped at the console's width, its
    continuation lines indented by ``indent``; ``style`` for every line of it (on a terminal)."""
    for line in fitted(text, console.width, first=first, rest=indent):
        if style:
            line.stylize(style)
        _print_line(console, line)


def _print_line(console, line) -> None:
    """One line already fitted: printed as it is (neither wrapped nor cut again)."""
    from rich.console import Console

    Console.print(console, line, soft_wrap=True, highlight=False)


def note(console, label: str, text: object, style: str | None = None) -> None:
    """``label: text`` wrapped at the console's width with the continuation lines indented under
    the text: a line that starts with a space continues the one above."""
    say(console, text, indent=" " * (len(label) + 2), style=style, first=f"{label}: ")


def emit(console, renderable, width: int | None = None) -> None:
    """``renderable`` (a rich Table, say) rendered at ``width`` (default the console's), every line
    printed without its trailing spaces."""
    from rich.text import Text

    options = console.options.update_width(width or console.width)
    for line in console.render_lines(renderable, options, pad=False):
        text = Text.assemble(*((s.text, s.style) for s in line if not s.control))
        text.rstrip()
        _print_line(console, text)


def _screen_class():
    from rich.console import Console
    from rich.text import Text

    class Screen(Console):
        """A rich Console whose every line fits its width, whatever its caller asks: text (a
        string, read as markup as rich reads it, or a Text) is wrapped at spaces only by
        :func:`fitted`, its continuation lines indented by two spaces (``soft_wrap`` changes
        nothing); any other renderable (a table) is rendered at the width with no line's
        trailing spaces (:func:`emit`)."""

        def print(self, *objects: Any, **options: Any) -> None:  # rich's keywords: sep, end, style, width...
            if not objects or options.get("end", "\n") != "\n" or self.is_jupyter:
                return super().print(*objects, **{**options, "highlight": False})
            style, width = options.get("style"), options.get("width")
            if all(isinstance(o, (str, Text)) for o in objects):
                texts = [o if isinstance(o, Text) else self.render_str(_typed.shown(o), markup=options.get("markup"),
                                                                      emoji=options.get("emoji"), highlight=False)
                         for o in objects]
                joined = Text(options.get("sep", " ")).join(texts)
                lead = len(joined.plain) - len(joined.plain.lstrip(" "))
                for line in fitted(joined, width or self.width, rest=" " * (lead + 2)):
                    if style:
                        line.stylize(style)
                    _print_line(self, line)
                return None
            for o in objects:
                emit(self, o, width)
            return None

    return Screen


@dataclass(frozen=True)
class Column:
    """One column of a table: its header, ``keep`` (higher stays longer when columns must be left
    out; ``None``: never left out), ``justify``, whether its cells may wrap at spaces, and
    ``narrow`` (the columns that matter least are narrowed first; among equals, the lower
    ``narrow``)."""

    header: str
    keep: int | None = None
    justify: str = "left"
    wraps: bool = True
    narrow: int = 0  # among columns that may wrap, the lower is narrowed first


def _plain(cell: Any) -> str:
    return cell.plain if hasattr(cell, "plain") else str(cell)


def _longest_word(text: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(word) for word in text.split()), default=0)


@dataclass
class Fitted:
    """A table fitted to a width: the columns kept (their indices), each one's width, and the
    headers of the columns left out."""

    kept: list[int]
    widths: list[int]
    dropped: list[str]
    full_width: int  # the width at which nothing is left out
    total: int  # the width of the table laid out (above the width asked for only when nothing else fits)


def fit(columns: Sequence[Column], rows: Sequence[Sequence[Any]], width: int) -> Fitted:
    """The layout of ``rows`` under ``columns`` at ``width``: every column as wide as its widest cell;
    when that is too wide, the columns whose cells wrap are narrowed (the widest first, never below
    their longest word); when that is not enough, the column with the lowest ``keep`` is left out,
    then the next. Columns with ``keep=None`` always stay; the columns that matter least are
    narrowed first. Cells are never cut: when the columns that must stay do not fit even at their
    narrowest, the table is wider than ``width``."""
    from rich.cells import cell_len

    width = max(width, MIN_WIDTH)
    natural, least = [], []
    for i, column in enumerate(columns):
        cells = [_plain(row[i]) for row in rows] + [column.header]
        natural.append(max(cell_len(c) for c in cells))
        least.append(max(_longest_word(c) for c in cells) if column.wraps else natural[-1])

    def span(kept: list[int], sizes: Sequence[int]) -> int:
        return sum(sizes[i] for i in kept) + GAP * (len(kept) - 1)

    kept = list(range(len(columns)))
    full = span(kept, least)
    droppable = sorted((i for i, c in enumerate(columns) if c.keep is not None), key=lambda i: (columns[i].keep, -i))
    while span(kept, least) > width and droppable:
        kept.remove(droppable.pop(0))
    widths = {i: natural[i] for i in kept}
    excess = span(kept, natural) - width
    rank = {i: (math.inf if columns[i].keep is None else columns[i].keep, columns[i].narrow) for i in kept}
    while excess > 0:
        slack = [i for i in kept if widths[i] > least[i]]
        if not slack:
            break
        lowest = min(rank[i] for i in slack)
        widest = max((i for i in slack if rank[i] == lowest), key=lambda i: (widths[i], i))
        widths[widest] -= 1
        excess -= 1
    dropped = [columns[i].header for i in range(len(columns)) if i not in kept]
    return Fitted(kept, [widths[i] for i in kept], dropped, full, span(kept, widths))


def table(columns: Sequence[Column], rows: Sequence[Sequence[Any]], width: int):
    """A rich Table of ``rows`` fitted to ``width`` (see :func:`fit`), and the :class:`Fitted` layout."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    layout = fit(columns, rows, width)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), collapse_padding=True)
    for i, w in zip(layout.kept, layout.widths):
        c = columns[i]
        t.add_column(c.header, justify=c.justify, width=w, no_wrap=not c.wraps, overflow="fold")
    for row in rows:
        t.add_row(*(row[i] if isinstance(row[i], Text) else Text(one_line(row[i])) for i in layout.kept))
    return t, layout


def print_table(console, title: str | None, columns: Sequence[Column], rows: Sequence[Sequence[Any]],
                more: str = "") -> None:
    """``title`` (wrapped), then the table fitted to the console's width, then, when columns were
    left out, a line naming them and the width that shows them all (``more``: where else they are)."""
    if title:
        say(console, title)
    t, layout = table(columns, rows, console.width)
    emit(console, t, max(console.width, layout.total))
    if layout.dropped:
        where = f"; {more}" if more else ""
        note(console, "left out", f"{', '.join(layout.dropped)} (to fit {console.width} columns; all fit at "
             f"COLUMNS={layout.full_width}{where})", style="dim")
