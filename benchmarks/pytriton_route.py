"""The PyTriton route: an export behind a real Triton Inference Server through PyTriton, as
``policy-export serve`` ran before it served the export's own ``triton/`` repository
(:mod:`exporter.serve.server`). Kept for ``python -m benchmarks.serve``, which measures both routes
in one run; ``serve`` and ``verify --server triton`` do not use it.

PyTriton starts the ``tritonserver`` its wheel ships (HTTP and gRPC, KServe v2) with a Python
backend that hands each request to this process, where the export's own model runs (ONNX Runtime
on ``model.onnx``; the SavedModel where the export has no ONNX model). The export's files are
checked against its manifest first: a file that fails its hash is never loaded. HTTP requests
pass through :mod:`exporter.serve.front`, which refuses a request the server could not survive (a
declared shape with more elements than the request has bytes) and every API but health, metadata
and inference; gRPC goes to the server, whose management APIs PyTriton closes behind a random key.
A ``host`` other than loopback is logged as a warning: there is no authentication.

    with PyTritonServer.start("out/cartpole", http_port=8000, grpc_port=8001) as server:
        server.endpoints()   # {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}

Stopping (leaving the ``with``, Ctrl-C or SIGTERM in :func:`serve_forever`, or an interrupt while
it starts or stops) stops the server process and removes its workspace
(:mod:`exporter.serve.workspace`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import ExportError, InputError, PolicyExportError
from policy_export.exporter import formats as registry
from policy_export.exporter import manifest
from policy_export.exporter.devices import plan_devices
from policy_export.exporter.serve import workspace as workspaces
from policy_export.exporter.serve.models import DEFAULT_MAX_BATCH_SIZE, ServedModel, plan_models
from policy_export.exporter.serve.repository import HOST
from policy_export.exporter.serve.server import (  # noqa: F401 (serve_forever: the benchmark's, for both routes)
    OPEN_WARNING, check_ports_free, free_port, is_loopback, serve_forever,
)
from policy_export.signatures.contract import Contract

log = logging.getLogger(__name__)

# the formats that can stand behind the server, in order of preference
ENGINES = ("onnx", "onnx_deterministic", "saved_model")


def import_pytriton():
    """PyTriton's modules, or an :class:`InputError` naming the extra to install."""
    from policy_export.exporter.compat import require

    require(("pytriton", "tritonclient"), "serve", "serving with Triton")
    from pytriton import model_config, triton

    return triton, model_config


@dataclass
class Engine:
    """The export's model that answers requests, with a lock per call (one session)."""

    format: str
    runner: Any
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            return self.runner(feeds)


def open_engine(out: Path, doc: Mapping[str, Any], device: str = "cpu") -> Engine:
    """The first of :data:`ENGINES` the export holds, its files checked against the manifest.

    Raises:
        InputError: files that fail the check, or no format that can be served.
    """
    check = manifest.check_files(out, doc, registry.paths())
    if check.problems:
        raise InputError(f"{out}: not served, its files do not match its manifest: " + "; ".join(check.problems[:5]))
    for name in ENGINES:
        if name in doc["formats"]:
            fmt = registry.get(name)
            return Engine(name, fmt.open(out / fmt.path, doc, plan_devices(device)))
    raise InputError(f"{out} holds none of {', '.join(ENGINES)}; export one of them to serve it")


def _explores(engine: Engine, doc: Mapping[str, Any]) -> bool:
    fmt = registry.get(engine.format)
    return fmt.explores((doc.get("formats") or {}).get(engine.format)) and fmt.capabilities.explores


class PyTritonServer:
    """A running Triton server (PyTriton) serving one export; a context manager that stops it.

    HTTP requests reach it through :class:`~exporter.serve.front.RequestFront` on ``host:http_port``
    (the server's own HTTP endpoint listens on a private loopback port); gRPC requests go to the
    server on ``host:grpc_port``."""

    def __init__(self, out: Path, models: list[ServedModel], engine: Engine, parts: tuple[Any, Any, Path],
                 host: str, ports: Mapping[str, int]):
        self.out, self.models, self.engine = out, models, engine
        self._triton, self._front, self._workspace = parts
        self.host, self.ports = host, dict(ports)

    @classmethod
    def start(cls, out: str | Path, http_port: int = 8000, grpc_port: int = 8001, host: str = HOST,
              model_name: str = "policy", max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
              device: str = "cpu", queue_delay_us: int = 100) -> "PyTritonServer":
        """Check the export, start the server and wait until it is ready (a warning is logged when
        ``host`` is not a loopback address).

        Raises:
            InputError: not an export, files that fail their check, a busy port, no PyTriton.
            ExportError: the server did not start (its log's last lines named).
        """
        out = Path(out)
        triton_mod, mc = import_pytriton()
        doc = manifest.read_manifest(out)
        ports = {"http": int(http_port), "grpc": int(grpc_port)}
        check_ports_free(host, ports)
        if not 0 < max_batch_size <= 65536:
            raise InputError(f"--max-batch-size {max_batch_size} is not in 1..65536")
        engine = open_engine(out, doc, device)
        contract = Contract.from_json(doc["contract"])
        models = plan_models(contract, set(engine.runner.inputs) | set(engine.runner.accepted),
                             list(engine.runner.outputs), _explores(engine, doc), model_name, max_batch_size)
        if not is_loopback(host):
            log.warning(OPEN_WARNING.format(host=host, ports=f"{ports['http']} and {ports['grpc']}"))
        workspaces.quiet_interrupts()
        workspace = workspaces.make("policy-export-serve-")
        try:
            _check_socket_room(workspace, models)
            triton, front = _run_triton(triton_mod, mc, models, engine, workspace, host, ports, queue_delay_us)
        except BaseException as e:  # (_run_triton stopped the server it started)
            try:
                engine.runner.close()
            finally:
                workspaces.remove(workspace)
            if isinstance(e, PolicyExportError) or not isinstance(e, Exception):
                raise
            raise ExportError(f"the Triton server did not start: {type(e).__name__}: {str(e)[:500]}") from e
        return cls(out, models, engine, (triton, front, workspace), host, ports)

    @property
    def workspace(self) -> Path:
        """The server's working directory (its model store, its log); removed when it stops."""
        return self._workspace

    def endpoints(self) -> dict[str, str]:
        return {what: f"{self.host}:{port}" for what, port in self.ports.items()}

    def is_alive(self) -> bool:
        return self._triton.is_alive()

    def stop(self) -> None:
        """Stop the HTTP front and the server (its process and the backend's stubs) and remove its
        workspace, also when an interrupt arrives while the server stops."""
        if self._triton is None:
            return
        triton, self._triton = self._triton, None
        try:
            self._front.stop()
            triton.stop()
        finally:
            try:
                self.engine.runner.close()
            finally:
                workspaces.remove(self._workspace)

    def __enter__(self) -> "PyTritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


SOCKET_PATH_BYTES = 107  # what an AF_UNIX socket address holds on Linux


def _check_socket_room(workspace: Path, models: list[ServedModel]) -> None:
    """Raises InputError when PyTriton's sockets (``<workspace>/pytriton/<model>_0_0-server.sock``)
    would not fit an AF_UNIX address (a long ``TMPDIR`` or model name)."""
    longest = max(len(f"{workspace}/pytriton/{m.name}_0_0-server.sock".encode()) for m in models)
    if longest > SOCKET_PATH_BYTES:
        raise InputError(f"the server's socket paths under {str(workspace)[:200]} would be {longest} bytes, more "
                         f"than the {SOCKET_PATH_BYTES} a socket address holds: set TMPDIR to a shorter folder or "
                         "choose a shorter --model-name")


def _run_triton(triton_mod, mc, models: list[ServedModel], engine: Engine, workspace: Path, host: str,
                ports: Mapping[str, int], queue_delay_us: int) -> tuple[Any, Any]:
    """PyTriton's server (HTTP on a private loopback port, gRPC on ``host``) with ``models`` bound,
    running, and the HTTP front on ``host``; returns both."""
    from policy_export.exporter.serve.front import RequestFront

    backend_http = free_port()
    config = triton_mod.TritonConfig(http_address=HOST, http_port=backend_http, grpc_address=host,
                                     grpc_port=ports["grpc"], allow_metrics=False, exit_timeout_secs=5,
                                     log_file=workspace / "tritonserver.log")
    with _server_environment():
        triton = triton_mod.Triton(config=config, workspace=workspace / "pytriton")
        try:
            for model in models:
                _bind(triton, mc, model, engine, queue_delay_us)
            triton.run()
            return triton, RequestFront(host, ports["http"], backend_http, models)
        except BaseException:
            with contextlib.suppress(Exception):
                triton.stop()
            raise


@contextlib.contextmanager
def _server_environment():
    """The environment the server process starts with, restored once it has started: this
    interpreter's directory first on ``PATH`` (the Python backend's stub takes its ``sys.prefix``,
    and so its packages, from the ``python3`` it finds there) and its shared library first on
    ``LD_LIBRARY_PATH`` (so the stub links the libpython that matches this interpreter's standard
    library; another one on the system fails in PyTriton's model proxy)."""
    before = {k: os.environ.get(k) for k in ("PATH", "LD_LIBRARY_PATH")}
    os.environ["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), before["PATH"]) if p)
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and Path(libdir, sysconfig.get_config_var("LDLIBRARY") or "").is_file():
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, before["LD_LIBRARY_PATH"]) if p)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tensor(mc, wire) -> Any:
    return mc.Tensor(name=wire.key, dtype=np.dtype(wire.spec.dtype).type, shape=wire.dims, optional=wire.optional)


def _bind(triton, mc, model: ServedModel, engine: Engine, queue_delay_us: int) -> None:
    if model.batched:
        config = mc.ModelConfig(max_batch_size=model.max_batch_size,
                                batcher=mc.DynamicBatcher(max_queue_delay_microseconds=queue_delay_us))
    else:
        config = mc.ModelConfig(batching=False)
    triton.bind(model_name=model.name, infer_func=_infer_function(model, engine),
                inputs=[_tensor(mc, w) for w in model.inputs], outputs=[_tensor(mc, w) for w in model.outputs],
                config=config, strict=True)


def _infer_function(model: ServedModel, engine: Engine) -> Callable:
    """PyTriton's ``infer_func`` for ``model``: the requests of one batch concatenated into one
    engine call (a batched model), or one call per request; an error names what is wrong."""

    def infer(requests):
        try:
            if model.batched:
                rows = [len(next(iter(r.values()))) for r in requests]
                joined = {k: np.concatenate([np.asarray(r[k]) for r in requests]) for k in requests[0].keys()}
                out = model.response(engine(model.feeds(joined)))
                bounds = np.cumsum([0, *rows])
                return [{k: v[bounds[i]:bounds[i + 1]] for k, v in out.items()} for i in range(len(requests))]
            return [model.response(engine(model.feeds(dict(r.items())))) for r in requests]
        except PolicyExportError as e:
            raise _client_error(str(e)) from None

    return infer


def _client_error(message: str) -> Exception:
    """PyTriton's error for a bad request (answered with that message; the server keeps serving)."""
    try:
        from pytriton.exceptions import PyTritonBadParameterError

        return PyTritonBadParameterError(message)
    except ImportError:  # pragma: no cover
        return ValueError(message)
