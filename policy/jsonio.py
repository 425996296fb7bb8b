"""One strict JSON reader for every JSON document the package loads.

Standard JSON is accepted, with these limits (each refusal names the source and the problem):

* a key that appears twice in one object is refused (Python would keep the last one silently);
* the literals ``NaN``, ``Infinity`` and ``-Infinity``, and numbers that overflow a float
  (``1e999``), are refused;
* integers of more than :data:`MAX_INT_DIGITS` digits are refused before conversion;
* the text must be UTF-8 (or a ``str``) without unpaired surrogates (``"\\ud800"``);
* at most :data:`MAX_DEPTH` levels of nested arrays and objects, and ``max_bytes`` of text.

::

    obj = loads(data, source="policy.json")      # JSONError on any of the above
    obj = read_file(path, max_bytes=1 << 20)     # a regular file, opened without following a link
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from policy_export.errors import PolicyExportError

MAX_INT_DIGITS = 30
MAX_DEPTH = 800
MAX_JSON_BYTES = 64 << 20


class JSONError(PolicyExportError, ValueError):
    """A JSON document is malformed or breaks one of the reader's limits.

    ``source`` names the document, ``problem`` says what is wrong (without the source).
    """

    def __init__(self, source: str, problem: str):
        self.source = source
        self.problem = problem
        super().__init__(f"{source}: {problem}")


class _Refused(Exception):
    """Raised inside the decoder's hooks; turned into :class:`JSONError` by :func:`loads`."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {key[:40]!r}{'...' if len(key) > 40 else ''} in an object")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number; write a finite number")


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits exceeds the limit of {MAX_INT_DIGITS} digits")
    try:
        return int(text)
    except ValueError as e:  # never reached for JSON's digit strings; kept so no ValueError escapes
        raise _Refused(f"integer {text[:40]!r} cannot be read: {e}") from e


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]!r} overflows a float; write a finite number")
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_int, parse_float=_float)
# for documents another tool writes with Python's json.dumps, whose NaN and Infinity are its own
# (a Stable-Baselines3 zip's ``data``): those literals read as floats, every other limit kept
_LENIENT = json.JSONDecoder(object_pairs_hook=_pairs, parse_int=_int, parse_float=float)


def _check_tree(obj: Any) -> str | None:
    """The first problem in a decoded document (depth, unpaired surrogates), or ``None``."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not is_utf8(node):
                return f"string {node[:40]!r} holds an unpaired surrogate; it is not UTF-8 text"
        elif isinstance(node, (dict, list)):
            if depth > MAX_DEPTH:
                return f"nested too deeply (more than {MAX_DEPTH} levels of arrays and objects)"
            if isinstance(node, dict):
                stack.extend((k, depth) for k in node)
                stack.extend((v, depth + 1) for v in node.values())
            else:
                stack.extend((v, depth + 1) for v in node)
    return None


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates): what a strict JSON file may hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def loads(data: str | bytes, source: str = "<json>", max_bytes: int = MAX_JSON_BYTES, *,
          constants: bool = False) -> Any:
    """Parse one JSON document strictly (see the module docstring); ``constants`` reads ``NaN``,
    ``Infinity`` and ``-Infinity`` (and numbers that overflow) as floats, as Python's own
    ``json.dumps`` writes them.

    Returns:
        The decoded value: dicts, lists, str, int, float, bool, ``None``.

    Raises:
        JSONError: the text is too large, not UTF-8, not valid JSON, or breaks a limit.
    """
    if len(data) > max_bytes:
        raise JSONError(source, f"{len(data)} bytes exceed the limit of {max_bytes} for a JSON document")
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONError(source, f"not UTF-8 text ({e.reason} at byte {e.start})") from e
    elif isinstance(data, str):
        text = data
    else:
        raise JSONError(source, f"expected text or bytes, got {type(data).__name__}")
    try:
        obj = (_LENIENT if constants else _DECODER).decode(text)
    except _Refused as e:
        raise JSONError(source, f"not valid JSON: {e}") from e
    except RecursionError as e:
        raise JSONError(source, f"not valid JSON: nested too deeply (more than {MAX_DEPTH} levels of arrays "
                                "and objects)") from e
    except json.JSONDecodeError as e:
        raise JSONError(source, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except ValueError as e:  # anything else the decoder raises on odd input
        raise JSONError(source, f"not valid JSON: {e}") from e
    problem = _check_tree(obj)
    if problem is not None:
        raise JSONError(source, f"not valid JSON: {problem}")
    return obj


def read_file(path: str | Path, max_bytes: int = MAX_JSON_BYTES, source: str | None = None) -> Any:
    """Read and parse a JSON file strictly; ``path`` must be a regular file, not a symbolic link.

    Returns:
        The decoded value (see :func:`loads`).

    Raises:
        JSONError: the file is a link, FIFO or device, cannot be read, is larger than
            ``max_bytes``, or its text is refused by :func:`loads`.
    """
    source = str(path) if source is None else source
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "a symbolic link; give the file itself" if e.errno == errno.ELOOP else f"cannot be read: {e.strerror}"
        raise JSONError(source, why) from e
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise JSONError(source, "not a regular file")
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise JSONError(source, f"cannot be read: {e.strerror}") from e
    if len(data) > max_bytes:
        raise JSONError(source, f"larger than the limit of {max_bytes} bytes for this file")
    return loads(data, source, max_bytes)
