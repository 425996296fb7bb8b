"""The HTTP side of ``serve``: a KServe v2 front that checks each request before the Triton server
(listening on a private Unix-domain socket, :mod:`exporter.serve.repository`) sees it, relays the
server's answer, and bounds what any number of clients can make it hold.

``tritonserver`` (2.51, PyTriton's) allocates an input's bytes from the shape a JSON request
declares before it checks the shape against the model (a 100-byte request declaring
``[2147483648, 2147483648]`` ends the server process), reads a repeated JSON key by its first
value, and answers several client errors with 500. Every request therefore passes one door,
:meth:`_Connection.serve`, which reads it with the strict HTTP/1.1 reader of
:mod:`exporter.serve.http1` and lets through only:

- ``GET`` of ``/v2``, ``/v2/health/live``, ``/v2/health/ready`` and of a served model's metadata,
  ``/ready`` and ``/config`` (with or without ``/versions/N``), with no body;
- ``POST`` of a served model's ``/infer`` with a ``Content-Length`` of at most
  :data:`MAX_BODY_BYTES` (no chunked or compressed body), a JSON header of at most
  :data:`MAX_JSON_BYTES`, that :func:`exporter.serve.kserve.check_infer` accepts for the model.

Everything else is answered here with ``{"error": ...}`` and the status that says why (400, 404,
408, 411, 413, 414, 415, 417, 431, 501, 503, 505) and never reaches the server; the management
APIs (model loading, shared memory, logging, tracing) cannot be reached through it at all. A
model's ``/config`` is answered as Triton's ONNX Runtime backend would have it: without the
``runtime`` that names the stand-in (:func:`as_onnxruntime_config`).

What clients can make the front hold is bounded, whatever their number (:class:`Limits`):

- connections: at most :data:`MAX_CONNECTIONS` at once. A new one beyond them closes the one that
  has waited longest on its client (idle, or sending its request, or reading its answer), so a
  client that sends its request at once is served while others hold connections; when every
  connection is busy with the server, the new one gets a 503 at once;
- time: a request's header must arrive within :data:`HEAD_TIMEOUT_S` of its first byte and its body
  within :data:`BODY_TIMEOUT_S` plus a second per :data:`MIN_BODY_RATE` bytes (deadlines for the
  whole, not per read: a byte now and then extends nothing); else 408. A kept connection waits
  :data:`IDLE_TIMEOUT_S` for its next request;
- bytes: a header of :data:`http1.MAX_HEAD_BYTES`; each connection may hold
  :data:`SMALL_REQUEST_BYTES` of body and decoding (:func:`kserve.parse_cost`) of its own, and what
  larger requests need comes from :data:`SHARED_BUDGET_BYTES` that all connections share, held from
  before the body is read until the server has answered. A request that does not fit waits up to
  :data:`BUDGET_WAIT_S`, then gets a 503 (``Retry-After``) before its body is read.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import re
import socket
import socketserver
import threading
from pathlib import Path
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policy_export.exporter.serve import kserve
from policy_export.exporter.serve.http1 import Head, HeadReader, Refused, clip
from policy_export.exporter.serve.kserve import check_infer
from policy_export.exporter.serve.models import ServedModel

__all__ = ["Limits", "Refused", "RequestFront", "check_infer"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 128
MAX_BODY_BYTES = 64 << 20  # tritonserver's own default --http-max-input-size
MAX_JSON_BYTES = 8 << 20  # the JSON header of an inference request (larger tensors travel as binary data)
SMALL_REQUEST_BYTES = 512 << 10  # body and decoding each connection may hold without the shared budget
SHARED_BUDGET_BYTES = 192 << 20  # what larger requests hold together, across all connections
BUDGET_WAIT_S = 5.0
IDLE_TIMEOUT_S = 60.0
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 10.0
MIN_BODY_RATE = 1 << 20  # bytes a second a body must arrive at, beyond BODY_TIMEOUT_S
SEND_TIMEOUT_S = 30.0
BACKEND_TIMEOUT_S = 600.0
LINGER_S, LINGER_BYTES = 2.0, 256 << 10  # what is read of a refused body before its connection closes
RECV_BYTES = 64 << 10
ONE_WRITE_BYTES = 64 << 10  # a body up to this size goes to the server in the same write as its head
POLL_S = 0.1  # how soon the accept loop sees a stop
PATH = re.compile(r"/v2(?:/health/(?P<health>live|ready)|/models/(?P<model>[A-Za-z0-9_.-]{1,128})"
                  r"(?:/versions/[0-9]{1,19})?(?P<what>/ready|/config|/infer)?)?")
FORWARDED = ("content-type", "inference-header-content-length")  # the only headers passed either way
JSON_TYPE = "application/json"


@dataclass(frozen=True)
class Limits:
    """What the front holds for its clients (the module's description); the defaults are the
    module's constants."""

    max_connections: int = MAX_CONNECTIONS
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_bytes: int = MAX_JSON_BYTES
    small_request_bytes: int = SMALL_REQUEST_BYTES
    shared_budget_bytes: int = SHARED_BUDGET_BYTES
    budget_wait_s: float = BUDGET_WAIT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    head_timeout_s: float = HEAD_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    min_body_rate: int = MIN_BODY_RATE
    send_timeout_s: float = SEND_TIMEOUT_S
    backend_timeout_s: float = BACKEND_TIMEOUT_S

    def body_deadline(self, start: float, length: int) -> float:
        return start + self.body_timeout_s + length / self.min_body_rate


class _Budget:
    """Bytes shared by all connections' larger requests (:data:`SHARED_BUDGET_BYTES`)."""

    def __init__(self, total: int):
        self.total, self._used = total, 0
        self._free = threading.Condition()

    def acquire(self, amount: int, deadline: float) -> bool:
        """Take ``amount`` once it is free; ``False`` when ``deadline`` (monotonic) passes first."""
        with self._free:
            while self._used + amount > self.total:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._free.wait(left)
            self._used += amount
            return True

    def release(self, amount: int) -> None:
        with self._free:
            self._used -= amount
            self._free.notify_all()


class _Hold:
    """What one request holds: up to ``small`` bytes of its own, the rest from the shared budget."""

    def __init__(self, budget: _Budget, small: int):
        self._budget, self._small, self.shared = budget, small, 0

    def grow(self, total: int, deadline: float) -> None:
        """Hold ``total`` bytes in all.

        Raises:
            Refused: 413 when ``total`` can never fit, 503 when it does not fit by ``deadline``.
        """
        more = max(0, total - self._small) - self.shared
        if more <= 0:
            return
        if self.shared + more > self._budget.total:
            raise Refused(413, f"the request needs {total} bytes of memory to be checked, more than the "
                               f"{self._budget.total + self._small} the front holds for one request")
        if not self._budget.acquire(more, deadline):
            raise Refused(503, "the front holds as many large requests as it can; try again",
                          headers={"Retry-After": "1"})
        self.shared += more

    def release(self) -> None:
        if self.shared:
            self._budget.release(self.shared)
            self.shared = 0


class _Closed(Exception):
    """The client went away, or the connection was closed to make room for another."""


class _TimedOut(Exception):
    """A deadline for the client passed."""


class _Connection:
    """One client connection: its requests read, checked, relayed and answered in turn."""

    def __init__(self, sock: socket.socket, front: "_Server"):
        self.sock, self.front = sock, front
        self.limits = front.limits
        self.waiting, self.since, self.evicted = True, time.monotonic(), False
        self.backend: http.client.HTTPConnection | None = None
        self.hold = _Hold(front.budget, self.limits.small_request_bytes)
        self.pending = b""  # what arrived past the request being served (the next one's start)

    # -- the table's side (called under its lock, from other threads)
    def evict(self) -> None:
        """Close this connection to make room: its thread sees its socket shut and ends."""
        self.evicted = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _state(self, waiting: bool) -> None:
        self.waiting, self.since = waiting, time.monotonic()

    # -- the connection's own thread
    def run(self) -> None:
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no delayed answers
            while not self.evicted and self.serve():
                pass
        except (_Closed, OSError):
            pass
        finally:
            self.hold.release()
            if self.backend is not None:
                self.backend.close()

    def serve(self) -> bool:
        """Read, check, relay and answer one request; whether the connection stays open for another."""
        start, close, linger = time.monotonic(), False, False
        try:
            head = self._head()
            if head is None:
                return False
            close = not head.keep_alive
            try:
                status, headers, data = self._answer(head)
            finally:
                self.hold.release()
        except Refused as e:
            status, headers, data = e.status, {"Content-Type": JSON_TYPE, **e.headers}, _error(str(e))
            close = close or e.close
            linger = e.close
        except _TimedOut:
            status, headers, data = 408, {"Content-Type": JSON_TYPE}, _error("the request did not arrive in time")
            close = True
        except _Closed:
            return False
        except Exception as e:  # a fault of the front's own: answered, logged, and the connection closed
            log.warning("front: a request failed: %s: %s", type(e).__name__, str(e)[:200])
            log.debug("front: the failure", exc_info=True)
            status, headers, data = 500, {"Content-Type": JSON_TYPE}, _error("the front failed on this request")
            close = True
        self._state(True)
        self._send(status, headers, data, close)
        log.debug("front: %s in %.3f s", status, time.monotonic() - start)
        if close:
            if linger:
                self._linger()
            return False
        return True

    def _head(self) -> Head | None:
        """The next request's head (what arrived after it kept in :attr:`pending`); ``None`` when
        the client closes or stays idle past :data:`IDLE_TIMEOUT_S` between requests."""
        reader = HeadReader()  # (waiting on the client since it connected, or since its last answer)
        data, self.pending = self.pending, b""
        if not data:
            try:
                data = self._recv(RECV_BYTES, time.monotonic() + self.limits.idle_timeout_s)
            except _TimedOut:
                return None
            if not data:
                return None
        deadline = time.monotonic() + self.limits.head_timeout_s
        while True:
            head = reader.feed(data)
            if head is not None:
                self.pending = reader.rest
                return head
            data = self._recv(RECV_BYTES, deadline)
            if not data:
                raise _Closed()

    def _answer(self, head: Head) -> tuple[int, dict[str, str], bytes]:
        """The answer to one request whose head is read (the check, the body, the relay)."""
        model, infer = self._route(head)
        length = head.content_length
        if not infer:
            return self._relay(head, None)
        limits = self.limits
        if head.get("content-length") is None:
            raise Refused(411, "the request needs a Content-Length", close=True)
        if length > limits.max_body_bytes:
            raise Refused(413, f"the request's {length} bytes are more than {limits.max_body_bytes}", close=True)
        header_length = head.get("inference-header-content-length")
        try:  # (the body is not read: the connection closes after these answers)
            json_end = kserve.json_length(header_length, length)
            if json_end > limits.max_json_bytes:
                raise Refused(413, f"the request's JSON header is {json_end} bytes, more than "
                                   f"{limits.max_json_bytes}; send large tensors as binary data (binary_data_size)")
            self.hold.grow(length, time.monotonic() + limits.budget_wait_s)
        except Refused as e:
            e.close = True
            raise
        if head.expect_continue:
            self._sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = self._body(length)
        self._state(False)
        self.hold.grow(length + kserve.parse_cost(body, json_end), time.monotonic() + limits.budget_wait_s)
        check_infer(self.front.models[model], body, header_length)
        return self._relay(head, body)

    def _route(self, head: Head) -> tuple[str | None, bool]:
        """The served model a request names and whether it is an inference.

        Raises:
            Refused: a method, path or body that is not served.
        """
        unread = head.content_length > 0
        if head.method not in ("GET", "POST"):
            raise Refused(501, f"the method {clip(head.method)} is not implemented here", close=unread)
        match = PATH.fullmatch(head.target)
        model = match and match["model"]
        infer = bool(match) and match["what"] == "/infer"
        if not match or (head.method == "POST") != infer:
            raise Refused(404, f"{head.method} {head.target[:100]} is not served here", close=unread)
        if model is not None and model not in self.front.models:
            raise Refused(404, f"Request for unknown model: {clip(model)} is not found", close=unread)
        if not infer and unread:
            raise Refused(400, f"{head.method} takes no body here", close=True)
        if infer and (head.get("content-encoding") or "identity").lower() != "identity":
            raise Refused(415, "the request's body must not be compressed here", close=unread)
        return model, infer

    def _body(self, length: int) -> bytearray:
        """The body of ``length`` bytes (its start may be in :attr:`pending`, and what follows it is
        left there), read within its deadline.

        Raises:
            Refused: a body that ends early (the connection closes after the answer).
        """
        deadline = self.limits.body_deadline(time.monotonic(), length)
        body = bytearray(length)
        view = memoryview(body)
        rest, self.pending = self.pending[:length], self.pending[length:]
        got = len(rest)
        view[:got] = rest
        while got < length:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _TimedOut()
            self.sock.settimeout(left)
            try:
                n = self.sock.recv_into(view[got:], min(length - got, 1 << 20))
            except TimeoutError:
                raise _TimedOut() from None
            except OSError as e:  # (a reset)
                raise _Closed() from e
            if self.evicted:
                raise _Closed()
            if n == 0:
                raise Refused(400, "the request's body ended early", close=True)
            got += n
        return body

    def _recv(self, size: int, deadline: float) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _TimedOut()
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(size)
        except TimeoutError:
            raise _TimedOut() from None
        except OSError as e:  # (a reset)
            raise _Closed() from e
        if self.evicted:
            raise _Closed()
        return data

    def _relay(self, head: Head, body: bytearray | None) -> tuple[int, dict[str, str], bytes]:
        """The server's answer (only the headers of :data:`FORWARDED` pass either way), over
        this client's kept connection; one the server closed meanwhile is opened again, once."""
        self._state(False)
        try:
            try:
                return self._send_backend(head, body)
            except ConnectionError:  # (http.client's RemoteDisconnected is one)
                self._close_backend()
                return self._send_backend(head, body)
        except OSError as e:
            self._close_backend()
            return 502, {"Content-Type": JSON_TYPE}, _error(f"the Triton server did not answer: {str(e)[:200]}")

    def _send_backend(self, head: Head, body: bytearray | None) -> tuple[int, dict[str, str], bytes]:
        if self.backend is None:
            self.backend = backend_connection(self.front.backend, self.limits.backend_timeout_s)
        backend = self.backend
        backend.putrequest(head.method, head.target, skip_accept_encoding=True)
        for name in FORWARDED:
            value = head.get(name)
            if value is not None:
                backend.putheader(name, value)
        if body is not None:
            backend.putheader("Content-Length", str(len(body)))
        if body and len(body) <= ONE_WRITE_BYTES:  # head and body in one write: one wake-up of the server
            backend.endheaders(bytes(body))
        else:
            backend.endheaders()
            if body:
                backend.send(memoryview(body))
        response = backend.getresponse()
        data = response.read()
        headers = {name: response.headers[name] for name in FORWARDED if name in response.headers}
        if response.status == 200 and head.method == "GET" and head.target.endswith("/config"):
            data = as_onnxruntime_config(data)
        return response.status, headers, data

    def _close_backend(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def _send(self, status: int, headers: dict[str, str], data: bytes, close: bool) -> None:
        """The answer, within :data:`SEND_TIMEOUT_S`."""
        self.hold.release()
        lines = [f"HTTP/1.1 {status} {http.client.responses.get(status, 'Unknown')}",
                 f"Date: {email.utils.formatdate(usegmt=True)}", "Server: policy-export"]
        lines += [f"{_title(k)}: {v}" for k, v in headers.items()]
        lines.append(f"Content-Length: {len(data)}")
        if close:
            lines.append("Connection: close")
        self._sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        self._sendall(data)

    def _sendall(self, data: bytes) -> None:
        try:
            self.sock.settimeout(self.limits.send_timeout_s)  # (the whole of one sendall, since Python 3.5)
            self.sock.sendall(data)
        except OSError as e:
            raise _Closed() from e

    def _linger(self) -> None:
        """After an answer to a request that was not read whole: stop sending, then read what the
        client still sends (at most :data:`LINGER_BYTES` for :data:`LINGER_S`), so that closing does
        not reset the connection before the client has read the answer (a "lingering close")."""
        self._state(True)
        try:
            self.sock.shutdown(socket.SHUT_WR)
            deadline, left = time.monotonic() + LINGER_S, LINGER_BYTES
            while left > 0 and not self.evicted:
                data = self._recv(min(left, RECV_BYTES), deadline)
                if not data:
                    return
                left -= len(data)
        except (OSError, _TimedOut, _Closed):  # the client went away, or kept sending past the time
            return


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


STAND_IN_RUNTIME = "model.py"  # the runtime Triton's core records for a Python-based backend


def as_onnxruntime_config(data: bytes) -> bytes:
    """A model config as tritonserver answers it (JSON), as the ONNX Runtime backend would have it:
    ``runtime`` empty instead of the stand-in's ``model.py`` (Triton's core names the runtime of a
    Python-based backend; a C++ backend's is left empty); anything else unchanged."""
    try:
        doc = json.loads(data)
    except ValueError:
        return data
    if not isinstance(doc, dict) or doc.get("runtime") != STAND_IN_RUNTIME:
        return data
    doc["runtime"] = ""
    return json.dumps(doc, separators=(",", ":")).encode()


class _UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over a Unix-domain socket (the server's private endpoint)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def backend_connection(backend: int | str | Path, timeout: float) -> http.client.HTTPConnection:
    """A connection to the server's HTTP endpoint: a port on 127.0.0.1, or a Unix-domain socket's path."""
    if isinstance(backend, int):
        return http.client.HTTPConnection("127.0.0.1", backend, timeout=timeout)
    return _UnixConnection(str(backend), timeout)


def _title(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))


class _Server(socketserver.TCPServer):
    """The listening socket, and the table of connections it admits (at most
    :attr:`Limits.max_connections`, each served by a thread of its own)."""

    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], backend: int | str | Path, models: dict[str, ServedModel],
                 limits: Limits):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.backend, self.models, self.limits = backend, models, limits
        self.budget = _Budget(limits.shared_budget_bytes)
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self.closing = False
        super().__init__(address, None)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        connection = _Connection(request, self)
        if not self._admit(connection):
            _refuse_at_once(request)
            self.shutdown_request(request)
            return
        threading.Thread(target=self._run, args=(connection,), name="policy-export-front", daemon=True).start()

    def _admit(self, connection: _Connection) -> bool:
        """Whether ``connection`` may be served: there is room, or the connection that has waited
        longest on its client is closed to make it (the threads of closed ones end at once, and at
        most twice :attr:`Limits.max_connections` threads run)."""
        with self._lock:
            if self.closing or len(self._connections) >= 2 * self.limits.max_connections:
                return False
            open_ = [c for c in self._connections if not c.evicted]
            if len(open_) >= self.limits.max_connections:
                waiting = [c for c in open_ if c.waiting]
                if not waiting:
                    return False
                min(waiting, key=lambda c: c.since).evict()
            self._connections.add(connection)
            return True

    def _run(self, connection: _Connection) -> None:
        try:
            connection.run()
        finally:
            with self._lock:
                self._connections.discard(connection)
            self.shutdown_request(connection.sock)

    def close_all(self) -> None:
        with self._lock:
            self.closing = True
            for connection in self._connections:
                connection.evict()

    def handle_error(self, request, client_address) -> None:
        """A connection that failed in the accept loop: logged (debug), never a traceback on the terminal."""
        log.debug("front: a connection from %s failed", client_address, exc_info=True)


def _refuse_at_once(sock: socket.socket) -> None:
    """A 503 for a connection beyond the limit, sent without waiting (the answer fits the socket's buffer)."""
    data = _error("the front serves as many connections as it can; try again")
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: {JSON_TYPE}\r\nContent-Length: {len(data)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.setblocking(False)
        sock.send(head + data)
    except OSError:
        pass


class RequestFront:
    """The front on ``host:port`` (0: a free port, then :attr:`port`) for the server's HTTP endpoint
    ``backend``: the path of its Unix-domain socket, or a port on 127.0.0.1."""

    def __init__(self, host: str, port: int, backend: int | str | Path, models: Sequence[ServedModel],
                 limits: Limits = Limits()):
        self._server = _Server((host, port), backend, {m.name: m for m in models}, limits)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, args=(POLL_S,),
                                        name="policy-export-http-front", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering, close the listening socket and every client connection."""
        self._server.shutdown()
        self._server.server_close()
        self._server.close_all()
