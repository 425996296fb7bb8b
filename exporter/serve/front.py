"""The HTTP side of ``serve``: a KServe v2 front that checks each request before the Triton server
(listening on a private loopback port) sees it, and relays the server's answer.

``tritonserver`` (2.51, PyTriton's) allocates an input's bytes from the shape a JSON request
declares before it checks the shape against the model: a 100-byte request declaring
``[2147483648, 2147483648]`` ends the server process. The front lets through only:

- ``GET`` of ``/v2``, ``/v2/health/live``, ``/v2/health/ready`` and of a served model's metadata,
  ``/ready`` and ``/config`` (with or without ``/versions/N``);
- ``POST`` of a served model's ``/infer``, with a ``Content-Length`` of at most
  :data:`MAX_BODY_BYTES` (no chunked or compressed body), whose JSON header parses and declares
  for each input a shape of non-negative integers holding at most as many elements as the request
  has bytes (every element takes at least one byte, in JSON or binary data); an input the model
  takes must also have its rank, its fixed dimensions, and at most the model's batch limit.

Everything else is answered here (``{"error": ...}``, status 400, 404, 411 or 413) and never
reaches the server; the management APIs (model loading, shared memory, logging, tracing) cannot
be reached through it at all.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import socket
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from policy_export.exporter.serve.models import ServedModel

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # tritonserver's own default --http-max-input-size
MAX_RANK = 16
BACKEND_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 60.0
LINGER_S, LINGER_BYTES = 2.0, 256 << 10  # what is read of a refused body before its connection closes
PATH = re.compile(r"/v2(?:/health/(?P<health>live|ready)|/models/(?P<model>[A-Za-z0-9_.-]{1,128})"
                  r"(?:/versions/[0-9]{1,19})?(?P<what>/ready|/config|/infer)?)?")
FORWARDED = ("Content-Type", "Inference-Header-Content-Length")


class Refused(Exception):
    """A request answered by the front itself: an HTTP status and the message; ``close`` when the
    connection cannot carry another request (a body that was not read)."""

    def __init__(self, status: int, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.close = status, close


def check_infer(model: ServedModel, body: bytes, header_length: str | None) -> None:
    """Raises :class:`Refused` unless ``body`` is an inference request for ``model`` whose declared
    shapes the server may allocate (see the module's description)."""
    if header_length is not None:
        if not header_length.isdigit() or not 0 < int(header_length) <= len(body):
            raise Refused(400, f"Inference-Header-Content-Length {header_length[:20]!r} is not within the "
                               f"body's {len(body)} bytes")
        body_json = body[:int(header_length)]
    else:
        body_json = body
    try:  # fractional numbers are not kept: only the structure and the shapes (integers) are checked
        doc = json.loads(body_json, parse_float=_drop, parse_constant=_drop)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise Refused(400, f"the request is not a JSON inference request: {str(e)[:120]}") from None
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(inputs, list) or not inputs:
        raise Refused(400, "the request has no 'inputs' list")
    wires = {w.key: w for w in model.inputs}
    for item in inputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise Refused(400, "an input of the request is not an object with a name")
        name, shape = item["name"], item.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise Refused(400, f"input {name[:100]!r}: 'shape' must be a list of at most {MAX_RANK} non-negative "
                               "integers")
        count = math.prod(shape)
        if count > len(body):
            raise Refused(400, f"input {name[:100]!r}: shape {shape} declares {count} elements, more than the "
                               f"request's {len(body)} bytes can carry")
        if name in wires:
            _check_dims(model, name, wires[name].dims, shape)


def _drop(_value: str) -> None:
    return None


def _check_dims(model: ServedModel, name: str, dims: Sequence[int], shape: list[int]) -> None:
    """The shape of an input ``model`` takes against its declared ``dims`` (Triton's own messages)."""
    expected = ([-1] if model.batched else []) + list(dims)
    if len(shape) != len(expected) or any(e >= 0 and d != e for d, e in zip(shape, expected)):
        raise Refused(400, f"unexpected shape for input {name!r} for model {model.name!r}. Expected {expected}, "
                           f"got {shape}")
    if model.batched and shape[0] > model.max_batch_size:
        raise Refused(400, f"inference request batch-size must be <= {model.max_batch_size} for {model.name!r}")


class FrontHandler(BaseHTTPRequestHandler):
    """One client connection to the front (:func:`_handler` binds the models and the server's port)."""

    models: dict[str, ServedModel] = {}
    backend_port = 0
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    server_version = "policy-export"

    backend: http.client.HTTPConnection | None = None  # one per client connection, kept alive
    linger = False  # the answer refused a body that was not read

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no delayed answers

    def finish(self) -> None:
        super().finish()
        self._close_backend()
        if self.linger:
            self._drain()

    def _drain(self) -> None:
        """After an answer to a body that was not read: stop sending, then read what the client
        still sends (at most :data:`LINGER_BYTES` for :data:`LINGER_S`), so that closing does not
        reset the connection before the client has read the answer (a "lingering close")."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            left = LINGER_BYTES
            while left > 0:
                data = self.connection.recv(min(left, 65536))
                if not data:
                    return
                left -= len(data)
        except OSError:  # the client went away, or kept sending past the time
            return

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        log.debug("front: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def _handle(self, method: str) -> None:
        try:
            body = self._checked(method)
            status, headers, data = self._relay(method, body)
        except Refused as e:
            status, headers, data = e.status, {"Content-Type": "application/json"}, \
                json.dumps({"error": str(e)}).encode()
            if e.close:
                self.close_connection = self.linger = True
                headers["Connection"] = "close"
        except OSError as e:
            status, headers, data = 502, {"Content-Type": "application/json"}, \
                json.dumps({"error": f"the Triton server did not answer: {str(e)[:200]}"}).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _relay(self, method: str, body: bytes | None) -> tuple[int, dict[str, str], bytes]:
        """The server's answer (only the headers of :data:`FORWARDED` pass either way), over
        this client's kept connection; one the server closed meanwhile is opened again, once."""
        try:
            return self._send(method, body)
        except ConnectionError:  # (http.client's RemoteDisconnected is one)
            self._close_backend()
            try:
                return self._send(method, body)
            except OSError:
                self._close_backend()
                raise

    def _send(self, method: str, body: bytes | None) -> tuple[int, dict[str, str], bytes]:
        if self.backend is None:
            self.backend = http.client.HTTPConnection("127.0.0.1", self.backend_port, timeout=BACKEND_TIMEOUT_S)
        self.backend.request(method, self.path, body=body,
                             headers={k: self.headers[k] for k in FORWARDED if k in self.headers})
        response = self.backend.getresponse()
        data = response.read()
        return response.status, {k: response.headers[k] for k in FORWARDED if k in response.headers}, data

    def _close_backend(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def _checked(self, method: str) -> bytes | None:
        """The request's body when it may go to the server (``None`` for a ``GET``).

        Raises:
            Refused: anything but the paths, methods and bodies this front lets through.
        """
        body = self._body()
        match = PATH.fullmatch(self.path)
        model = match and match["model"]
        infer = bool(match) and match["what"] == "/infer"
        if not match or (method == "POST") != infer:
            raise Refused(404, f"{method} {self.path[:100]} is not served here")
        if model is not None and model not in self.models:
            raise Refused(404, f"unknown model {model!r}; this server serves {', '.join(self.models)}")
        if not infer:
            if body:
                raise Refused(400, f"{method} takes no body here")
            return None
        if self.headers.get("Content-Encoding", "identity") != "identity":
            raise Refused(415, "the request's body must not be compressed here")
        check_infer(self.models[model], body, self.headers.get("Inference-Header-Content-Length"))
        return body

    def _body(self) -> bytes:
        """The body its ``Content-Length`` announces (empty without one), read whole.

        Raises:
            Refused: a chunked body, a length that is not a number or above :data:`MAX_BODY_BYTES`,
                a body that ends early (the connection is closed after the answer).
        """
        if self.headers.get("Transfer-Encoding"):
            raise Refused(411, "the request needs a Content-Length (no chunked body)", close=True)
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        if not length.isdigit():
            raise Refused(400, f"Content-Length {length[:20]!r} is not a number", close=True)
        if int(length) > MAX_BODY_BYTES:
            raise Refused(413, f"the request's {length} bytes are more than {MAX_BODY_BYTES}", close=True)
        body = self.rfile.read(int(length))
        if len(body) != int(length):
            raise Refused(400, "the request's body ended early", close=True)
        return body


def _handler(models: dict[str, ServedModel], backend_port: int) -> type[FrontHandler]:
    return type("Handler", (FrontHandler,), {"models": models, "backend_port": backend_port})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-request: logged (debug), never a traceback on the terminal."""
        log.debug("front: a request from %s ended early", client_address, exc_info=True)


class RequestFront:
    """The front on ``host:port`` for the server's HTTP endpoint on loopback ``backend_port``."""

    def __init__(self, host: str, port: int, backend_port: int, models: Sequence[ServedModel]):
        self._server = _Server((host, port), _handler({m.name: m for m in models}, backend_port))
        self._thread = threading.Thread(target=self._server.serve_forever, name="policy-export-http-front",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
