"""``policy-export serve``: an export's own ``triton/`` repository on a real Triton Inference Server,
behind the package's two fronts, so that a client of ``serve`` is a client of the repository.

- The repository is the export's ``triton/``, exactly as written (names, versions, batching, the
  dynamic batcher, sequence batching with implicit state), or, for an export without the
  ``triton`` format, the one ``export --formats triton`` writes from the export's SavedModel,
  written first into the server's workspace (parity proven as for every export).
- ``tritonserver`` (PyTriton's) loads it with the package's stand-in for the ONNX Runtime backend
  (:mod:`exporter.serve.repository`, :mod:`exporter.serve.standin_model`): no model file the
  export brings is run, and every config is Triton's own reading of the file.
- Clients reach it through the fronts only: HTTP (:mod:`exporter.serve.front`: every request
  checked before the server sees it) and gRPC (:mod:`exporter.serve.grpc_front`), on ``host``;
  the server's own endpoints are Unix-domain sockets in a folder only the serving user may enter.
  A ``host`` other than loopback is logged as a warning: there is no authentication.

    with TritonServer.start("out/cartpole", http_port=8000, grpc_port=8001) as server:
        server.endpoints()   # {"http": "127.0.0.1:8000", "grpc": "127.0.0.1:8001"}
        [m.name for m in server.models]   # the repository's models: ["cartpole_mlp", "cartpole_mlp_explore"]

Stopping (leaving the ``with``, Ctrl-C or SIGTERM in :func:`serve_forever`, or an interrupt while
it starts or stops) stops the fronts and the server's processes and removes the workspace
(:mod:`exporter.serve.workspace`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.errors import ExportError, InputError, PolicyExportError
from policy_export.exporter import formats as registry
from policy_export.exporter import manifest
from policy_export.exporter.serve import workspace as workspaces
from policy_export.exporter.serve.models import ServedModel
from policy_export.exporter.serve.repository import HOST, INSTALL_HINT, RepositoryServer

log = logging.getLogger(__name__)

__all__ = ["HOST", "INSTALL_HINT", "OPEN_WARNING", "Repository", "TritonServer", "check_ports_free", "free_port",
           "is_loopback", "serve_forever"]

OPEN_WARNING = ("serving on {host}: anyone who can reach ports {ports} can send requests to the model "
                "(there is no authentication); use 127.0.0.1 unless the network is trusted")
TRITON = "triton"
SAVED_MODEL = "saved_model"
WRITE_TIMEOUT_S = 1800.0  # writing the repository of an export without one (a TensorFlow export)


def check_ports_free(host: str, ports: Mapping[str, int]) -> None:
    """Raises InputError naming the first of ``ports`` (what -> port) something already listens on,
    before the server is started."""
    for what, port in ports.items():
        if not 0 < port < 65536:
            raise InputError(f"{what} port {port} is not a port number")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise InputError(f"{what} port {port} on {host} is in use ({e.strerror}); choose another with "
                                 f"--{'port' if what == 'http' else what + '-port'}") from None
    if len(set(ports.values())) < len(ports):
        raise InputError(f"the ports must differ: {dict(ports)}")


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now (for tests and benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Repository:
    """The repository ``serve`` loads: its folder, the manifest record of the ``triton`` format that
    wrote it, and whether ``serve`` wrote it (the export had no ``triton`` format)."""

    path: Path
    info: Mapping[str, Any]
    written: bool


def batched_model(info: Mapping[str, Any]) -> str | None:
    """The name of the serving model a triton record lists (the batched one, or the one a model
    exported elsewhere is served as; ``None``: none)."""
    from policy_export.exporter.formats.triton.runner import serving_model

    models = info.get("models") if isinstance(info, Mapping) else None
    if not isinstance(models, Mapping):
        return None
    return serving_model(models)


def repository_of(out: Path, doc: Mapping[str, Any], work: Path, model_name: str | None = None) -> Repository:
    """The export's ``triton/`` repository, or the one the triton format writes from the export's
    SavedModel into ``work`` (named ``model_name``, by default the policy's name).

    Raises:
        InputError: ``model_name`` other than the repository's, or neither a repository nor a SavedModel.
    """
    formats = doc.get("formats") or {}
    if TRITON in formats:
        info = formats[TRITON]
        name = batched_model(info)
        if model_name is not None and model_name != name:
            raise InputError(f"{out}'s triton/ repository names its model {str(name)[:130]!r}; serve serves it as "
                             f"written (--model-name names the model of a repository serve writes, for an export "
                             "without the triton format)")
        return Repository(out / TRITON, info, written=False)
    if SAVED_MODEL not in formats:
        raise InputError(f"{out} holds no triton/ repository and no saved_model/ to write one from; export it with "
                         "--formats triton (or with its saved_model) to serve it")
    target = work / "export"
    log.info("%s has no triton/ repository: writing it into %s", out, target)
    write_repository(out, target, model_name)
    written = manifest.read_manifest(target)
    if TRITON not in written["formats"]:
        raise ExportError(f"the triton repository for {out} could not be written")
    return Repository(target / TRITON, written["formats"][TRITON], written=True)


def write_repository(out: Path, target: Path, model_name: str | None = None) -> None:
    """``policy-export convert OUT --out TARGET --formats triton``: the export exported again from its
    SavedModel with the triton format (parity checked), in a process of its own, so that TensorFlow
    is never loaded into the serving process.

    Raises:
        InputError: the command refused its input (exit 2). ExportError: it failed (its last line).
    """
    command = [sys.executable, "-m", "policy_export", "convert", str(out), "--out", str(target), "--formats", TRITON,
               "--device", "cpu", "-q"]
    if model_name is not None:
        command += ["--model-name", model_name]
    run = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=WRITE_TIMEOUT_S,
                         preexec_fn=workspaces.die_with_parent)
    if run.returncode != 0:
        lines = [line for line in run.stderr.splitlines() if line.strip()] or [f"exit {run.returncode}"]
        message = f"the triton repository for {out} could not be written: {lines[-1][:500]}"
        raise (InputError if run.returncode == 2 else ExportError)(message)


class TritonServer:
    """A running ``serve``: the repository's server and the HTTP and gRPC fronts before it; a context
    manager that stops them.

    Attributes:
        models: each served model as its config declares it (the batched model first).
        repository: the :class:`Repository` loaded.
    """

    def __init__(self, out: Path, repository: Repository, server: RepositoryServer, fronts: tuple[Any, Any],
                 host: str, ports: Mapping[str, int]):
        self.out, self.repository, self._server, self._work = out, repository, server, server.work
        self._pid = server.process.pid
        self.models = sorted((ServedModel.from_config(c) for c in server.configs.values()),
                             key=lambda m: (m.samples, m.name))
        self._http, self._grpc = fronts
        self.host, self.ports = host, dict(ports)

    @classmethod
    def start(cls, out: str | Path, http_port: int = 8000, grpc_port: int = 8001, host: str = HOST,
              model_name: str | None = None) -> "TritonServer":
        """Check the export, load its repository (writing it first where the export has none), start
        the server and the fronts and wait until every model is ready (a warning is logged when
        ``host`` is not a loopback address).

        Raises:
            InputError: not an export, files that fail their check, a repository the package did not
                write, a busy port, no PyTriton.
            ExportError: the server did not start or refused the repository (its log's errors named).
        """
        from policy_export.exporter.compat import require

        require(("pytriton", "tritonclient"), "serve", "serving with Triton")
        out = Path(out)
        doc = manifest.read_manifest(out)
        ports = {"http": int(http_port), "grpc": int(grpc_port)}
        check_ports_free(host, ports)
        check = manifest.check_files(out, doc, registry.paths())
        if check.problems:
            raise InputError(f"{out}: not served, its files do not match its manifest: " + "; ".join(check.problems[:5]))
        if not is_loopback(host):
            log.warning(OPEN_WARNING.format(host=host, ports=f"{ports['http']} and {ports['grpc']}"))
        workspaces.quiet_interrupts()
        work = workspaces.make("policy-export-serve-")
        server = fronts = None
        try:
            repository = repository_of(out, doc, work, model_name)
            server = RepositoryServer(repository.path, repository.info, work=work)
            server.start()
            fronts = _start_fronts(server, host, ports)
            return cls(out, repository, server, fronts, host, ports)
        except BaseException as e:
            try:
                _stop_fronts(fronts)
                if server is not None:
                    server.stop()
            finally:
                workspaces.remove(work)
            if isinstance(e, (PolicyExportError, OSError)) or not isinstance(e, Exception):
                raise
            raise ExportError(f"the Triton server did not start: {type(e).__name__}: {str(e)[:500]}") from e

    @property
    def workspace(self) -> Path:
        """The server's working directory (its repository, backends, private sockets and log)."""
        return self._work

    @property
    def process_id(self) -> int:
        """The ``tritonserver`` process's id."""
        return self._pid

    def endpoints(self) -> dict[str, str]:
        return {what: f"{self.host}:{port}" for what, port in self.ports.items()}

    def describe(self) -> list[str]:
        """What a client needs to know, a line each: every model (batching, inputs, outputs as its
        config declares them) and the endpoints."""
        lines = []
        for model in self.models:
            if model.sequence:
                batching = (f"sequence batching, up to {model.max_batch_size} sequences a batch" if model.batched
                            else "sequence batching, one sequence a request")
            elif model.batched:
                batching = f"batched, up to {model.max_batch_size} rows"
            else:
                batching = "not batched"
            inputs = ", ".join(f"{w.key} {w.spec.dtype} {_shape(model, w)}{' (optional)' if w.optional else ''}"
                               for w in model.inputs)
            outputs = ", ".join(f"{w.key} {w.spec.dtype} {_shape(model, w)}" for w in model.outputs)
            lines.append(f"model {model.name} ({batching}): inputs {inputs}; outputs {outputs}")
        ends = self.endpoints()
        lines.append(f"HTTP  http://{ends['http']}/v2/models/{self.models[0].name}/infer")
        lines.append(f"gRPC  {ends['grpc']}")
        source = "written by serve from its SavedModel" if self.repository.written else "as written"
        lines.append(f"repository: {self.repository.path} ({source})")
        return lines

    def is_alive(self) -> bool:
        return self._server is not None and self._server.is_alive()

    def stop(self) -> None:
        """Stop the fronts and the server (its process and the backend's stubs) and remove the
        workspace, also when an interrupt arrives while the server stops."""
        if self._server is None:
            return
        server, self._server = self._server, None
        work = server.work
        try:
            _stop_fronts((self._http, self._grpc))
            server.stop()
        finally:
            workspaces.remove(work)

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _shape(model: ServedModel, wire) -> str:
    """A tensor's full shape as a client sends or receives it: ``[-1, dims...]`` where the model batches."""
    return "[" + ", ".join(map(str, ([-1] if model.batched else []) + list(wire.dims))) + "]"


def _start_fronts(server: RepositoryServer, host: str, ports: Mapping[str, int]) -> tuple[Any, Any]:
    from policy_export.exporter.serve.front import RequestFront
    from policy_export.exporter.serve.grpc_front import GrpcFront

    models = [ServedModel.from_config(c) for c in server.configs.values()]
    http = RequestFront(host, ports["http"], server.http_socket, models)
    try:
        return http, GrpcFront(host, ports["grpc"], server.grpc_target)
    except BaseException:
        http.stop()
        raise


def _stop_fronts(fronts: tuple[Any, Any] | None) -> None:
    for front in fronts or ():
        if front is not None:
            with contextlib.suppress(Exception):
                front.stop()


def serve_forever(server: TritonServer, ready: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM (or the server process dies), then stop it."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if ready is not None:
            ready()
        while not stop.wait(0.5):
            if not server.is_alive():
                raise ExportError("the Triton server process stopped")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.stop()
