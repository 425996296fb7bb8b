"""Strict HTTP/1.1 request heads for the ``serve`` front (RFC 9112, RFC 9110), read from bytes with
no I/O: :class:`HeadReader` takes what arrives and gives a :class:`Head` once the head is whole, or
raises :class:`Refused` with the status the front answers and ``close`` set (a head that breaks the
grammar cannot be trusted to frame what follows it).

Accepted: ``METHOD SP origin-form SP HTTP/1.1`` (or ``HTTP/1.0``) and field lines
``name ":" OWS value OWS``, every line ending in CRLF, a name being a token and a value visible
ASCII, obs-text, spaces and tabs. Refused, whatever the line:

- a line ending in a bare LF, a CR anywhere but before the LF, any other control character (400);
- a field line that starts with a space or tab (obs-fold, RFC 9112 5.2), whitespace between a name
  and its colon (RFC 9112 5.1: ``Transfer-Encoding : chunked``), a name that is not a token (400);
- a request line longer than :data:`MAX_REQUEST_LINE_BYTES` (414); a field line longer than
  :data:`MAX_FIELD_LINE_BYTES`, more than :data:`MAX_FIELDS` of them, a head longer than
  :data:`MAX_HEAD_BYTES` (431); another version than 1.0 and 1.1 (505);
- ``Content-Length`` other than ASCII digits (at most :data:`MAX_LENGTH_DIGITS`), or present twice
  even with the same value (RFC 9110 8.6 lets a server take identical copies; nothing a client
  of this front sends needs them, and refusing leaves no two readings of one request) (400);
- ``Transfer-Encoding`` with ``Content-Length`` (RFC 9112 6.1, 400), in an HTTP/1.0 request (400),
  ``chunked`` (411: the front takes a ``Content-Length``), any other coding (501);
- an HTTP/1.1 request without exactly one ``Host``, more than one ``Host`` in any request, or a
  ``Host`` that is not ``host[:port]`` (RFC 9112 3.2, 400); two of any field the front reads or
  passes on (:data:`SINGLE_FIELDS`) (400); an ``Expect`` other than ``100-continue`` (417).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_REQUEST_LINE_BYTES = 8 << 10
MAX_FIELD_LINE_BYTES = 8 << 10
MAX_FIELDS = 64
MAX_HEAD_BYTES = 32 << 10
MAX_LENGTH_DIGITS = 18  # below 2**63, whatever limit the front then applies
MAX_EMPTY_LINES = 2  # CRLFs before a request line, which RFC 9112 2.2 asks a server to ignore
# fields the front reads or passes to the server: one each, so that no two parties read two values
SINGLE_FIELDS = ("host", "content-length", "transfer-encoding", "content-type", "content-encoding",
                 "inference-header-content-length", "expect")

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") (/[\x21-\x7e]*) HTTP/([0-9])\.([0-9])")
_FIELD_LINE = re.compile(rb"(" + _TOKEN + rb"):(.*)", re.DOTALL)  # (control characters are refused before)
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_DIGITS = re.compile(rb"[0-9]{1,%d}" % MAX_LENGTH_DIGITS)
_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::[0-9]{0,5})?")


class Refused(Exception):
    """A request answered by the front itself: an HTTP status and the message; ``close`` when the
    connection cannot carry another request (a head or body that was not read whole)."""

    def __init__(self, status: int, message: str, close: bool = False, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.close, self.headers = status, close, dict(headers or {})


@dataclass(frozen=True)
class Head:
    """A request head that passed every rule above. ``fields`` keeps each field as sent (names
    lower-cased, values latin-1 text); ``content_length`` is 0 without the field."""

    method: str
    target: str
    version: tuple[int, int]
    fields: tuple[tuple[str, str], ...]
    content_length: int
    keep_alive: bool  # HTTP/1.1 without ``Connection: close``
    expect_continue: bool

    def get(self, name: str) -> str | None:
        """The value of field ``name`` (lower case), the first where it may repeat; ``None`` without it."""
        return next((v for k, v in self.fields if k == name), None)


class HeadReader:
    """Reads one request head from the bytes :meth:`feed` is given.

    ``reader.feed(data)`` returns the :class:`Head` once its empty line has arrived (what came after
    it is :attr:`rest`, the start of the body or of the next request), ``None`` while more is needed,
    and raises :class:`Refused` as soon as the bytes so far break a rule: a defect is refused on the
    line it is in, a limit as soon as it is passed, never after waiting for more.
    """

    def __init__(self):
        self._buffer = bytearray()
        self._start = 0  # where the line being read starts
        self._lines: list[bytes] = []
        self._empty = 0
        self.rest = b""

    def feed(self, data: bytes) -> Head | None:
        """Take ``data``; the head when it is complete (see the class)."""
        self._buffer += data
        while True:
            end = self._buffer.find(b"\n", self._start)
            if end < 0:
                self._check_partial()
                return None
            line = bytes(self._buffer[self._start:end + 1])
            self._start = end + 1
            head = self._line(line)
            if head is not None:
                self.rest = bytes(self._buffer[self._start:])
                self._buffer.clear()
                return head

    def _check_partial(self) -> None:
        """Limits on the line still arriving, and on the whole head."""
        partial = len(self._buffer) - self._start
        if not self._lines:
            if partial > MAX_REQUEST_LINE_BYTES:
                raise Refused(414, f"the request line is longer than {MAX_REQUEST_LINE_BYTES} bytes", close=True)
        elif partial > MAX_FIELD_LINE_BYTES:
            raise Refused(431, f"a header line is longer than {MAX_FIELD_LINE_BYTES} bytes", close=True)
        if len(self._buffer) > MAX_HEAD_BYTES:
            raise Refused(431, f"the request's header is longer than {MAX_HEAD_BYTES} bytes", close=True)

    def _line(self, line: bytes) -> Head | None:
        if not line.endswith(b"\r\n"):
            raise Refused(400, "a line of the request's header ends in a bare LF (CRLF is required)", close=True)
        text = line[:-2]
        if not self._lines and not text:
            self._empty += 1
            if self._empty > MAX_EMPTY_LINES:
                raise Refused(400, "the request starts with empty lines", close=True)
            return None
        if not self._lines and len(line) > MAX_REQUEST_LINE_BYTES:
            raise Refused(414, f"the request line is longer than {MAX_REQUEST_LINE_BYTES} bytes", close=True)
        if self._lines and len(line) > MAX_FIELD_LINE_BYTES:
            raise Refused(431, f"a header line is longer than {MAX_FIELD_LINE_BYTES} bytes", close=True)
        if self._start > MAX_HEAD_BYTES:
            raise Refused(431, f"the request's header is longer than {MAX_HEAD_BYTES} bytes", close=True)
        if text:
            if len(self._lines) > MAX_FIELDS:  # (the request line is the first)
                raise Refused(431, f"the request has more than {MAX_FIELDS} header lines", close=True)
            self._lines.append(text)
            return None
        return parse_head(self._lines)


def parse_head(lines: list[bytes]) -> Head:
    """A :class:`Head` from the request line and field lines (without their CRLFs).

    Raises:
        Refused: any rule of the module's description broken.
    """
    request_line, field_lines = lines[0], lines[1:]
    if _CONTROL.search(request_line):
        raise Refused(400, "the request line holds a control character", close=True)
    match = _REQUEST_LINE.fullmatch(request_line)
    if match is None:
        raise Refused(400, f"the request line {clip(request_line)} is not 'METHOD /path HTTP/1.1'", close=True)
    method, target = match[1].decode("ascii"), match[2].decode("ascii")
    version = (int(match[3]), int(match[4]))
    if version not in ((1, 0), (1, 1)):
        raise Refused(505, f"HTTP/{version[0]}.{version[1]} is not served here (HTTP/1.1 is)", close=True)
    fields = tuple(_field(line) for line in field_lines)
    names = [k for k, _ in fields]
    for name in SINGLE_FIELDS:
        if names.count(name) > 1:
            raise Refused(400, f"the request has {names.count(name)} {name} header fields; one is allowed",
                          close=True)
    get = dict(reversed(fields)).get  # the first of each name (single fields are single by now)
    host = get("host")
    if version == (1, 1) and host is None:
        raise Refused(400, "an HTTP/1.1 request needs a Host header field", close=True)
    if host is not None and not _HOST.fullmatch(host):
        raise Refused(400, f"the Host header field {clip(host)} is not host[:port]", close=True)
    length = _content_length(get("content-length"))
    coding = get("transfer-encoding")
    if coding is not None:
        if version == (1, 0):
            raise Refused(400, "an HTTP/1.0 request cannot have a Transfer-Encoding", close=True)
        if length is not None:
            raise Refused(400, "the request has both Transfer-Encoding and Content-Length", close=True)
        if coding.lower() == "chunked":
            raise Refused(411, "the request needs a Content-Length (no chunked body)", close=True)
        raise Refused(501, f"the transfer coding {clip(coding)} is not implemented here", close=True)
    expect = get("expect")
    if expect is not None and expect.lower() != "100-continue":
        raise Refused(417, f"Expect {clip(expect)} cannot be met (only 100-continue)", close=True)
    connection = {t.strip().lower() for k, v in fields if k == "connection" for t in v.split(",")}
    return Head(method, target, version, fields, length or 0, version == (1, 1) and "close" not in connection,
                expect is not None and version == (1, 1))


def _field(line: bytes) -> tuple[str, str]:
    if line[:1] in (b" ", b"\t"):
        raise Refused(400, "a header line starts with whitespace (obsolete line folding is not accepted)",
                      close=True)
    if _CONTROL.search(line):
        raise Refused(400, "a header line holds a control character (a bare CR, NUL...)", close=True)
    match = _FIELD_LINE.fullmatch(line)
    if match is None:
        raise Refused(400, f"the header line {clip(line)} is not 'name: value' (a token, then the colon with no "
                           "space before it)", close=True)
    return match[1].decode("ascii").lower(), match[2].strip(b" \t").decode("latin-1")


def _content_length(value: str | None) -> int | None:
    if value is None:
        return None
    if not _DIGITS.fullmatch(value.encode("latin-1")):
        raise Refused(400, f"Content-Length {clip(value)} is not a number of ASCII digits (at most "
                           f"{MAX_LENGTH_DIGITS})", close=True)
    return int(value)


def clip(value: bytes | str, limit: int = 40) -> str:
    """``value`` for a message: at most ``limit`` characters, quoted, control characters escaped."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
