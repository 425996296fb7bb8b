"""The gRPC side of ``serve``: a KServe v2 ``GRPCInferenceService`` front that passes on the calls a
client of the export needs to the Triton server (listening on a private Unix-domain socket,
:mod:`exporter.serve.repository`) and answers every other call itself.

Passed on, as the bytes the client sent and the server answered (neither is decoded here, but a
model's config, see below): ``ServerLive``, ``ServerReady``, ``ModelReady``, ``ServerMetadata``,
``ModelMetadata``, ``ModelConfig``, ``ModelInfer`` and the stream ``ModelStreamInfer``. The server
itself checks a gRPC request against the model before it allocates (a shape the model does not
take is ``INVALID_ARGUMENT``), so its answers, errors included, reach the client as it gave them.
A model's config is answered as Triton's ONNX Runtime backend would have it: without the
``runtime`` that names the stand-in.

Answered here and never passed on: the management calls (``RepositoryIndex``,
``RepositoryModelLoad``/``Unload``, the shared-memory, trace, log and statistics calls) with
``UNAVAILABLE`` ("This protocol is restricted", as tritonserver answers a restricted protocol), and
any other method with ``UNIMPLEMENTED``. Bounds: a request message of at most
:data:`MAX_MESSAGE_BYTES` (tritonserver's own HTTP default for an input), at most
:data:`MAX_CONCURRENT_CALLS` calls in flight (more are ``RESOURCE_EXHAUSTED`` at once), at most
:data:`MAX_STREAMS_PER_CONNECTION` streams on one connection, and idle connections closed after
:data:`IDLE_TIMEOUT_S`.

The front runs its own asyncio event loop (gRPC's ``grpc.aio``) in a thread of the ``serve``
process: one call costs a few tens of microseconds of Python on top of the server's round trip.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
UNARY = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig", "ModelInfer")
STREAMS = ("ModelStreamInfer",)
RESTRICTED = ("ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
              "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
              "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
              "TraceSetting", "LogSettings")
RESTRICTED_MESSAGE = ("This protocol is restricted: policy-export serve offers health, metadata, model config and "
                      "inference only")
MAX_MESSAGE_BYTES = 64 << 20
MAX_CONCURRENT_CALLS = 128
MAX_STREAMS_PER_CONNECTION = 16
IDLE_TIMEOUT_S = 60.0
BACKEND_TIMEOUT_S = 600.0
START_TIMEOUT_S = 30.0


def as_onnxruntime_config(data: bytes) -> bytes:
    """A ``ModelConfigResponse`` as tritonserver answers it, as the ONNX Runtime backend would have
    it: ``runtime`` empty instead of the stand-in's ``model.py``; anything else unchanged."""
    from tritonclient.grpc import service_pb2

    from policy_export.exporter.serve.front import STAND_IN_RUNTIME

    response = service_pb2.ModelConfigResponse.FromString(data)
    if response.config.runtime != STAND_IN_RUNTIME:
        return data
    response.config.runtime = ""
    return response.SerializeToString()


class GrpcFront:
    """The front on ``host:port`` (0: a free port, then :attr:`port`) for the server's gRPC
    endpoint ``backend`` (a gRPC target: ``unix:PATH`` or ``HOST:PORT``); started at once, in a
    thread of its own.

    Raises:
        OSError: the port could not be bound.
    """

    def __init__(self, host: str, port: int, backend: str):
        self.backend = backend
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._server: Any = None
        self._stopped: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, args=(host, port), name="policy-export-grpc-front",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise OSError(f"the gRPC front did not start in {START_TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise self._error

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(host, port))
        except BaseException as e:  # (reported to the starting thread, or logged once it has started)
            if not self._started.is_set():
                self._error = e if isinstance(e, OSError) else OSError(f"the gRPC front failed: {e}")
                self._started.set()
            else:
                log.warning("gRPC front: stopped: %s: %s", type(e).__name__, str(e)[:200])
        finally:
            self._loop.close()

    async def _serve(self, host: str, port: int) -> None:
        import grpc

        channel = grpc.aio.insecure_channel(self.backend, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        server = grpc.aio.server(maximum_concurrent_rpcs=MAX_CONCURRENT_CALLS, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", -1),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ("grpc.max_connection_idle_ms", int(IDLE_TIMEOUT_S * 1000)), ("grpc.so_reuseport", 0)])
        handlers = {name: _unary(channel, name) for name in UNARY}
        handlers.update({name: _stream(channel, name) for name in STREAMS})
        handlers.update({name: _restricted() for name in RESTRICTED})
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"the gRPC front could not listen on {address}")
        await server.start()
        self._server, self._stopped = server, asyncio.Event()
        self._started.set()
        try:
            await self._stopped.wait()
        finally:
            await server.stop(grace=None)
            await channel.close()

    def stop(self) -> None:
        """Stop answering: close the listening socket and every call in flight."""
        if self._thread.is_alive() and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(timeout=10)


def _unary(channel, name: str):
    import grpc

    call = channel.unary_unary(f"/{SERVICE}/{name}")  # bytes in, bytes out: nothing decoded
    rewrite = as_onnxruntime_config if name == "ModelConfig" else None

    async def handle(request: bytes, context) -> bytes:
        try:
            answer = await call(request, timeout=BACKEND_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")
        return rewrite(answer) if rewrite is not None else answer

    return grpc.unary_unary_rpc_method_handler(handle)


def _stream(channel, name: str):
    import grpc

    call = channel.stream_stream(f"/{SERVICE}/{name}")

    async def handle(requests, context):
        try:
            async for answer in call(requests, timeout=BACKEND_TIMEOUT_S):
                yield answer
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")

    return grpc.stream_stream_rpc_method_handler(handle)


def _restricted():
    import grpc

    async def handle(request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.UNAVAILABLE, RESTRICTED_MESSAGE)

    return grpc.unary_unary_rpc_method_handler(handle)
