"""An export's ``triton/`` repository on a real ``tritonserver``, exactly as written: the binary
PyTriton's wheel ships, which has the Python backend and no ONNX Runtime backend, so the package's
own engine stands in for that backend: :mod:`exporter.serve.standin_model`, installed as
``<backends>/onnxruntime/model.py``, which Triton's core loads as a "Python-based backend" named
``onnxruntime`` for every model whose config names that backend. The configs are not changed:
names, versions, data types, dims, reshapes, optional inputs, the dynamic batcher and the sequence
batcher with its ``START`` control and implicit state are Triton's own reading of the files
written; no model file the export brings is run (the stand-in reads each ``model.onnx`` into ONNX
Runtime).

The server is given the models the export's manifest says the triton format wrote and nothing
else (:func:`expected_repository`): the batched model and its ``_explore`` sibling, their one
version, their ``config.pbtxt`` and ``model.onnx`` (and its external data); any other entry of
``triton/`` (a ``model.py``, a ``triton_python_backend_stub``, a backend library, a dot folder,
another model or version) is refused by name before a server starts, and only regular files are
copied into the server's own folder. The server loads those models by name
(``--model-control-mode=explicit``) with no auto-completed config
(``--disable-auto-complete-config``); each config must name its folder's model and select the one
version written.

Nothing of the server is reachable but through the package's fronts
(:mod:`exporter.serve.server`): ``tritonserver`` listens on Unix-domain sockets in a folder only
the serving user may enter (mode 0700; the sockets 0700 too, the server's umask), on no TCP port
(no metrics, SageMaker or Vertex AI endpoint); its management APIs (model loading, shared memory,
logging, tracing, statistics) are also closed behind a random key, and the fronts never pass them
on. The Python backend's shared-memory regions (``/dev/shm``, which it creates 0644) are made
0600 once the models are loaded and removed when the server stops.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.errors import ExportError, InputError
from policy_export.exporter.formats.triton.repository import CONFIG, EXPLORE_SUFFIX, MODEL_FILE
from policy_export.exporter.serve import workspace

HOST = "127.0.0.1"
INSTALL_HINT = 'install the serve extra: pip install "policy-export[serve]"'
# tritonserver's APIs no client of an export needs (model loading with uploaded files, shared
# memory, logging and trace files, statistics): closed behind a random key no one is told
RESTRICTED_APIS = "shared-memory,model-repository,statistics,trace,logging"
BACKEND = "onnxruntime"  # the backend the written configs name, and the stand-in's folder
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
READY_TIMEOUT_S = 120.0
SOCKET_PATH_BYTES = 107  # what an AF_UNIX socket address holds on Linux
SHM_DIR = Path("/dev/shm")


def _pytriton_dir() -> Path:
    try:
        import pytriton
    except ImportError as e:
        raise InputError(f"a Triton server needs PyTriton's tritonserver ({e}); {INSTALL_HINT}") from None
    return Path(pytriton.__file__).parent


# What a config this package writes may hold, field by field (Triton's ModelConfig message names):
# anything else (backend parameters such as the Python backend's EXECUTION_ENV_PATH, repository
# agents, model warm-up files, host policies...) is refused before a server reads the file.
ALLOWED_FIELDS = {
    "ModelConfig": {"name", "backend", "max_batch_size", "input", "output", "dynamic_batching",
                    "sequence_batching", "instance_group", "version_policy"},
    "ModelInput": {"name", "data_type", "dims", "reshape", "optional"},
    "ModelOutput": {"name", "data_type", "dims", "reshape"},
    "ModelTensorReshape": {"shape"},
    "ModelDynamicBatching": {"max_queue_delay_microseconds", "preferred_batch_size"},
    "ModelSequenceBatching": {"max_sequence_idle_microseconds", "control_input", "state"},
    "ControlInput": {"name", "control"},
    "Control": {"kind", "int32_false_true"},
    "State": {"input_name", "output_name", "data_type", "dims", "initial_state"},
    "InitialState": {"data_type", "dims", "zero_data", "name"},
    "ModelInstanceGroup": {"kind", "count"},
    "ModelVersionPolicy": {"specific"},
    "Specific": {"versions"},
}


def check_written_config(text: str, where: str):
    """Raises InputError unless ``text`` parses with Triton's own ``ModelConfig`` schema, names the
    ONNX Runtime backend and holds only fields of :data:`ALLOWED_FIELDS` (what this package writes);
    returns the parsed ``ModelConfig``."""
    from google.protobuf import text_format

    from policy_export.exporter.formats.triton.config import model_config_schema

    config = model_config_schema()[0]()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as e:
        raise InputError(f"{where}: not a Triton model config: {str(e)[:300]}") from None
    if config.backend != "onnxruntime":
        raise InputError(f"{where}: backend {config.backend[:80]!r}; the repositories this package writes name "
                         "onnxruntime")

    def walk(message, path: str) -> None:
        kind = message.DESCRIPTOR.name
        for field, value in message.ListFields():
            if field.name not in ALLOWED_FIELDS.get(kind, ()):
                raise InputError(f"{where}: field {path}{field.name} is not one this package writes; the "
                                 "repository is not loaded")
            if field.message_type is not None:
                for item in (value if field.label == field.LABEL_REPEATED else [value]):
                    walk(item, f"{path}{field.name}.")

    walk(config, "")
    return config


@dataclass(frozen=True)
class ExpectedRepository:
    """What an export's manifest says its triton format wrote: the models (name -> ``max_batch_size``),
    the one version each holds, and every file (relative to ``triton/``)."""

    models: Mapping[str, int]
    version: int
    files: frozenset[str]


def _refuse(what: str) -> InputError:
    return InputError(f"{what}; the triton repository is not loaded")


def expected_repository(info: Any) -> ExpectedRepository:
    """The repository the manifest's ``triton`` record describes, as the triton format writes it:
    the batched model ``NAME`` and, where the policy samples, ``NAME_explore`` (nothing else), each
    ``NAME/config.pbtxt`` and ``NAME/VERSION/model.onnx`` (and its ``model.onnx.data``, where listed).

    Raises:
        InputError: a record naming another model, version or file.
    """
    models = info.get("models") if isinstance(info, Mapping) else None
    version = info.get("version", 1) if isinstance(info, Mapping) else None
    if not isinstance(version, int) or isinstance(version, bool) or not 0 < version < 2 ** 63:
        raise _refuse(f"the manifest's model version {str(version)[:40]!r} is not a version number")
    if not isinstance(models, Mapping) or not models or not all(isinstance(r, Mapping) for r in models.values()):
        raise _refuse("the manifest's triton record lists no models")
    from policy_export.exporter.formats.triton.runner import serving_model

    sizes = {str(n): r.get("max_batch_size") for n, r in models.items()}
    serving = serving_model(models)
    if serving is None or not MODEL_NAME.fullmatch(serving):
        batched = [n for n, b in sizes.items() if isinstance(b, int) and not isinstance(b, bool) and b > 0]
        names = ", ".join(repr(n[:130]) for n in batched[:3])
        raise _refuse(f"the manifest's triton record names {len(batched)} batched models ({names}) and no one "
                      "serving model; the triton format writes one, with a legal model name")
    allowed = {serving: sizes[serving], serving + EXPLORE_SUFFIX: 0}
    batched = [serving]
    files = set()
    for name, record in models.items():
        if name not in allowed or sizes[name] != allowed[name]:
            raise _refuse(f"model {str(name)[:130]!r} is not one the triton format writes ({batched[0]!r}, "
                          f"and {batched[0] + EXPLORE_SUFFIX!r} not batched)")
        paths = {"config": f"{name}/{CONFIG}", "model": f"{name}/{version}/{MODEL_FILE}"}
        if any(record.get(k) != v for k, v in paths.items()):
            raise _refuse(f"model {name!r}: the manifest records other files than {', '.join(paths.values())}")
        files |= set(paths.values())
    listed = info.get("files")
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise _refuse("the manifest's triton record has no file list")
    data = {f"{n}/{version}/{MODEL_FILE}.data" for n in models}
    for path in listed:
        rel = path[len("triton/"):] if path.startswith("triton/") else None
        if rel not in files | data:
            raise _refuse(f"{path[:200]} is listed for the triton format, but is not a file it writes")
    missing = files - {p[len("triton/"):] for p in listed if p.startswith("triton/")}
    if missing:
        raise _refuse(f"triton/{sorted(missing)[0]} is not listed in the manifest")
    files |= {p[len("triton/"):] for p in listed if p[len("triton/"):] in data}
    return ExpectedRepository({n: allowed[n] for n in models}, version, frozenset(files))


def _scan(repository: Path, expected: ExpectedRepository) -> None:
    """Raises InputError naming the first entry of ``repository`` (not following links) that is not
    one of ``expected``'s files or their folders, or is not a regular file or folder."""
    folders = {str(Path(f).parent) for f in expected.files} | set(expected.models)
    for dirpath, dirnames, filenames in os.walk(repository, followlinks=False):
        for entry in sorted(dirnames + filenames):
            full = Path(dirpath) / entry
            rel = full.relative_to(repository).as_posix()
            mode = os.lstat(full).st_mode
            if stat.S_ISDIR(mode) and rel in folders or stat.S_ISREG(mode) and rel in expected.files:
                continue
            kind = "a symbolic link" if stat.S_ISLNK(mode) else ("a folder" if stat.S_ISDIR(mode) else "a file")
            raise _refuse(f"triton/{rel[:200]} ({kind}) is not one the manifest records the triton format writing")


def _check_identity(config, name: str, expected: ExpectedRepository, where: str) -> None:
    """Raises InputError unless ``config`` names ``name``, batches as the manifest says, and its
    version policy selects the one version written."""
    policy = config.version_policy
    versions = list(policy.specific.versions) if policy.WhichOneof("policy_choice") == "specific" else None
    if config.name != name:
        raise _refuse(f"{where}: names model {config.name[:130]!r}, not {name!r}")
    if config.max_batch_size != expected.models[name]:
        raise _refuse(f"{where}: max_batch_size {config.max_batch_size}, the manifest records "
                      f"{expected.models[name]}")
    if versions != [expected.version]:
        raise _refuse(f"{where}: its version policy must select version {expected.version} alone, the one "
                      "written")


def stand_in_repository(repository: Path, target: Path, info: Mapping[str, Any]) -> dict[str, Any]:
    """Build ``target`` from the files of ``repository`` (an export's ``triton/``) that its manifest
    record ``info`` says the triton format wrote, and nothing else, each copied as written; returns
    each model's parsed config (name -> Triton's ``ModelConfig``).

    Raises:
        InputError: anything else in the repository or the record (:func:`expected_repository`), a
            link, or a config that is not one this package writes (:func:`check_written_config`).
    """
    expected = expected_repository(info)
    _scan(repository, expected)
    for rel in sorted(expected.files):
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repository / rel, target / rel, follow_symlinks=False)
    configs = {}
    for name in expected.models:
        where = f"{repository.name}/{name}/{CONFIG}"
        config = check_written_config((target / name / CONFIG).read_text(), where)
        _check_identity(config, name, expected, where)
        configs[name] = config
    return configs


def install_backends(target: Path) -> None:
    """``target`` as tritonserver's backend directory: PyTriton's Python backend (its library and
    the stub for this interpreter's Python) and the stand-in as the ``onnxruntime`` backend.

    Raises:
        InputError: PyTriton's server or its stub for this Python is missing.
    """
    root = _pytriton_dir() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not (root / "bin" / "tritonserver").is_file() or not stub.is_file():
        raise InputError(f"PyTriton's tritonserver or its Python {version} backend stub is missing; {INSTALL_HINT}")
    python = target / "python"
    shutil.copytree(root / "backends" / "python", python, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, python / "triton_python_backend_stub")
    (target / BACKEND).mkdir()
    shutil.copyfile(Path(__file__).with_name("standin_model.py"), target / BACKEND / "model.py")


class RepositoryServer:
    """``tritonserver`` on a copy of an export's ``triton/`` repository (a context manager): the
    models its manifest record ``info`` names, as written, loaded by name (explicit model control,
    no auto-completed config), the stand-in as their backend, listening on private Unix-domain
    sockets only (:attr:`http_socket`, :attr:`grpc_target`), the management APIs closed.

    ``work`` is the folder to build it in (a new private temporary folder when ``None``, removed
    when the server stops; a given one is left to its owner)."""

    def __init__(self, repository: Path, info: Mapping[str, Any], work: Path | None = None):
        self.binary = _pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
        self.owns_work = work is None
        self.work = workspace.make("policy-export-triton-") if work is None else Path(work)
        try:
            self.configs = stand_in_repository(repository, self.work / "models", info)
            install_backends(self.work / "backends")
            self.private = self.work / "sock"
            self.private.mkdir(mode=0o700)
            self.http_socket = self.private / "http"
            self.grpc_target = f"unix:{self.private / 'grpc'}:0"  # tritonserver appends ":<port>"
            longest = len(str(self.private / "grpc:0").encode())
            if longest > SOCKET_PATH_BYTES:
                raise InputError(f"the server's socket paths under {str(self.work)[:200]} would be {longest} bytes, "
                                 f"more than the {SOCKET_PATH_BYTES} a socket address holds: set TMPDIR to a shorter "
                                 "folder")
        except BaseException:
            if self.owns_work:
                workspace.remove(self.work)
            raise
        self.models = list(self.configs)
        self.libs = _pytriton_dir().parent / "nvidia_pytriton.libs"
        self.shm_prefix = f"policy_export_{secrets.token_hex(8)}_"
        self.log = self.work / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    def arguments(self) -> list[str]:
        """The server's command line: only the expected models, loaded by name, their configs as
        written; Unix-domain sockets in the private folder, no TCP endpoint."""
        key = f"{RESTRICTED_APIS}:policy-export-key={secrets.token_hex(16)}"
        return [str(self.binary), f"--model-repository={self.work / 'models'}",
                f"--backend-directory={self.work / 'backends'}", "--model-control-mode=explicit",
                *(f"--load-model={m}" for m in self.models), "--disable-auto-complete-config",
                f"--http-restricted-api={key}", f"--grpc-restricted-protocol={key}",
                f"--http-address=unix:{self.http_socket}", "--http-port=0",
                f"--grpc-address=unix:{self.private / 'grpc'}", "--grpc-port=0",
                "--allow-metrics=false", "--allow-sagemaker=false", "--allow-vertex-ai=false",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                "--exit-timeout-secs=5", f"--log-file={self.log}"]

    def start(self) -> "RepositoryServer":
        """Start the server and wait until every model is ready.

        Raises:
            ExportError: the server refused the repository or stopped (its log's errors named).
        """
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH")) if p)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (sysconfig.get_config_var("LIBDIR"), str(self.libs),
                                                             env.get("LD_LIBRARY_PATH")) if p)
        workspace.quiet_interrupts()
        try:
            self.process = subprocess.Popen(self.arguments(), env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=_private_child)
            workspace.add_process(self.work, self.process.pid)
            workspace.add_cleanup(self.work, self._remove_shared_memory)
            self._wait_ready()
            self._close_shared_memory()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        deadline = time.monotonic() + READY_TIMEOUT_S
        with grpc.insecure_channel(self.grpc_target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ExportError(f"tritonserver refused the repository: {self.errors()}")
                with contextlib.suppress(grpc.RpcError):
                    if all(stub.ModelReady(service_pb2.ModelReadyRequest(name=m), timeout=5).ready
                           for m in self.models):
                        return
                time.sleep(0.1)
        raise ExportError(f"tritonserver was not ready in {READY_TIMEOUT_S:.0f} s: {self.errors()}")

    def shared_memory(self) -> list[Path]:
        """The Python backend's shared-memory regions of this server."""
        with contextlib.suppress(OSError):
            return sorted(SHM_DIR.glob(self.shm_prefix + "*"))
        return []

    def _close_shared_memory(self) -> None:
        for region in self.shared_memory():
            with contextlib.suppress(OSError):
                os.chmod(region, 0o600)

    def _remove_shared_memory(self) -> None:
        """What a killed backend could not remove."""
        for region in self.shared_memory():
            with contextlib.suppress(OSError):
                region.unlink()

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def errors(self) -> str:
        """The error lines of the server's log (the last few), or its last line."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        # (a server without CUDA logs "CudaDriverHelper has not been initialized." as an error)
        errors = [line for line in lines if line.startswith("E") and "CudaDriverHelper" not in line] or lines[-1:]
        # (the stand-in's exceptions end with the Python backend's "At: <file>(<line>)" trace)
        return " | ".join(re.sub(r"(\\n)+At:\\n.*", "", line)[:400] for line in errors[-4:])

    def stop(self) -> None:
        """Stop the server (SIGINT, then SIGKILL to its process group), remove its shared memory and
        (when it made it) its folder, also when an interrupt arrives while it waits."""
        try:
            if self.process is not None and self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=30)
        finally:
            try:
                if self.owns_work:
                    workspace.remove(self.work)  # SIGKILL to the process group (the backend's stubs), the folder
                elif self.process is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.process.pid, signal.SIGKILL)
            finally:
                self._remove_shared_memory()
                if self.process is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.process.wait(timeout=10)

    def __enter__(self) -> "RepositoryServer":
        return self if self.process is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _private_child() -> None:
    """In the server's process before it executes: files and sockets it makes are its user's alone,
    and it dies with the command."""
    os.umask(0o077)
    workspace.die_with_parent()
