"""The export's written ``triton/`` repository on a real ``tritonserver``, its own config checks
included: the binary PyTriton's wheel ships, which has the Python backend only, so each model's
``backend: "onnxruntime"`` is swapped for ``backend: "python"`` in a copy of the repository, with
:mod:`exporter.serve.standin_model` beside each ``model.onnx`` doing what the ONNX Runtime
backend does. Everything else (names, data types, dims, reshapes, optional inputs, the dynamic
batcher, the sequence batcher with its ``START`` control and state) is the written config.

The server is given the models the export's manifest says the triton format wrote and nothing
else (:func:`expected_repository`): the batched model and its ``_explore`` sibling, their one
version, their ``config.pbtxt`` and ``model.onnx`` (and its external data); any other entry of
``triton/`` (a ``model.py``, a dot folder, another model or version) is refused by name before a
server starts. The server loads those models by name (``--model-control-mode=explicit``) with no
auto-completed config (``--disable-auto-complete-config``), its management APIs (model loading,
shared memory, logging, tracing, statistics) closed behind a random key, and each config must
name its folder's model and select the one version written.

What a stand-in cannot show, and stays checked by schema and load rules alone
(:mod:`exporter.formats.triton`): the ONNX Runtime backend's own checks of the config against the
model, and its implicit state (the Python backend does not carry state, so the stand-in keeps it
by correlation id).
"""

from __future__ import annotations

import contextlib
import itertools
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

import numpy as np

from policy_export.errors import ExportError, InputError, PolicyExportError
from policy_export.exporter.formats.base import Capabilities, Format
from policy_export.exporter.formats.runner import Runner, TensorMeta
from policy_export.exporter.formats.triton.repository import CONFIG, EXPLORE_SUFFIX, MODEL_FILE
from policy_export.exporter.serve import workspace
from policy_export.exporter.serve.client import PROTOCOLS, WIRE_TYPES, client_module
from policy_export.exporter.serve.server import HOST, INSTALL_HINT, RESTRICTED_APIS, free_port
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import SEQ_LENS, is_state_out, state_in_key, state_out_key

BACKEND = re.compile(r'^backend:\s*"onnxruntime"\s*$', re.M)
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
READY_TIMEOUT_S = 120.0


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
    sizes = {str(n): r.get("max_batch_size") for n, r in models.items()}
    batched = [n for n, b in sizes.items() if isinstance(b, int) and not isinstance(b, bool) and b > 0]
    if len(batched) != 1 or not MODEL_NAME.fullmatch(batched[0]):
        names = ", ".join(repr(n[:130]) for n in batched[:3])
        raise _refuse(f"the manifest's triton record names {len(batched)} batched models ({names}); the triton "
                      "format writes one, with a legal model name")
    allowed = {batched[0]: sizes[batched[0]], batched[0] + EXPLORE_SUFFIX: 0}
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


def stand_in_repository(repository: Path, target: Path, info: Mapping[str, Any]) -> list[str]:
    """Build ``target`` from the files of ``repository`` (an export's ``triton/``) that its manifest
    record ``info`` says the triton format wrote, and nothing else: every model on the Python
    backend, the stand-in beside each ``model.onnx``; returns the model names.

    Raises:
        InputError: anything else in the repository or the record (:func:`expected_repository`), a
            link, or a config that is not one this package writes (:func:`check_written_config`).
        ExportError: a config without the ONNX Runtime backend's line to replace.
    """
    expected = expected_repository(info)
    _scan(repository, expected)
    for rel in sorted(expected.files):
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repository / rel, target / rel, follow_symlinks=False)
    source = Path(__file__).with_name("standin_model.py").read_text()
    for name in expected.models:
        config = target / name / CONFIG
        text = config.read_text()
        where = f"{repository.name}/{name}/{CONFIG}"
        _check_identity(check_written_config(text, where), name, expected, where)
        if not BACKEND.search(text):
            raise ExportError(f"{config}: no 'backend: \"onnxruntime\"' line to stand in for")
        config.write_text(BACKEND.sub('backend: "python"', text))
        (target / name / str(expected.version) / "model.py").write_text(source)
    return list(expected.models)


class RepositoryServer:
    """``tritonserver`` on a stand-in copy of an export's ``triton/`` repository (a context manager):
    the models its manifest record ``info`` names, loaded by name (explicit model control, no
    auto-completed config), the management APIs closed (a random key)."""

    def __init__(self, repository: Path, info: Mapping[str, Any]):
        root = _pytriton_dir()
        self.binary = root / "tritonserver" / "bin" / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not self.binary.is_file() or not stub.is_file():
            raise InputError(f"PyTriton's tritonserver or its Python {version} backend stub is missing; {INSTALL_HINT}")
        self.work = workspace.make("policy-export-triton-")
        try:
            backend = self.work / "backends" / "python"
            shutil.copytree(root / "tritonserver" / "backends" / "python", backend,
                            ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(stub, backend / "triton_python_backend_stub")
            self.models = stand_in_repository(repository, self.work / "models", info)
        except BaseException:
            workspace.remove(self.work)
            raise
        self.libs = root.parent / "nvidia_pytriton.libs"
        self.ports = {"http": free_port(), "grpc": free_port()}
        self.log = self.work / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    def arguments(self) -> list[str]:
        """The server's command line: only the expected models, loaded by name, their configs as written."""
        key = f"{RESTRICTED_APIS}:policy-export-key={secrets.token_hex(16)}"
        return [str(self.binary), f"--model-repository={self.work / 'models'}",
                f"--backend-directory={self.work / 'backends'}", "--model-control-mode=explicit",
                *(f"--load-model={m}" for m in self.models), "--disable-auto-complete-config",
                f"--http-restricted-api={key}", f"--grpc-restricted-protocol={key}", f"--http-address={HOST}",
                f"--http-port={self.ports['http']}", f"--grpc-address={HOST}", f"--grpc-port={self.ports['grpc']}",
                "--allow-metrics=false", "--exit-timeout-secs=5", f"--log-file={self.log}"]

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
            self.process = subprocess.Popen(self.arguments(), env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=workspace.die_with_parent)
            workspace.add_process(self.work, self.process.pid)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        client = client_module("http").InferenceServerClient(f"{HOST}:{self.ports['http']}")
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ExportError(f"tritonserver refused the repository: {self.errors()}")
                with contextlib.suppress(Exception):
                    if all(client.is_model_ready(m) for m in self.models):
                        return
                time.sleep(0.25)
            raise ExportError(f"tritonserver was not ready in {READY_TIMEOUT_S:.0f} s: {self.errors()}")
        finally:
            client.close()

    def errors(self) -> str:
        """The error lines of the server's log (the last few), or its last line."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        # (a server without CUDA logs "CudaDriverHelper has not been initialized." as an error)
        errors = [line for line in lines if line.startswith("E") and "CudaDriverHelper" not in line] or lines[-1:]
        return " | ".join(line[:400] for line in errors[-4:])

    def stop(self) -> None:
        """Stop the server (SIGINT, then SIGKILL to its process group) and remove its folder, also
        when an interrupt arrives while it waits."""
        try:
            if self.process is not None and self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=30)
        finally:
            workspace.remove(self.work)  # SIGKILL to the process group (the backend's stubs), then the folder
            if self.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=10)

    def __enter__(self) -> "RepositoryServer":
        return self if self.process is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RepositoryClient(Runner):
    """The contract through the repository's models on a live server, over one protocol.

    Feed-forward: the batched model, or the sampling model when an optional input is fed a value
    other than its default. Recurrent: one sequence per row, the server keeping the state; a call
    whose state inputs are all zero starts new sequences, any other continues them, and the state
    outputs returned are step counters that only this client reads back (the server does not send
    state)."""

    _ids = itertools.count(1)

    def __init__(self, url: str, protocol: str, models: Mapping[str, Mapping[str, Any]], contract: Contract):
        self.protocol, self.contract = protocol, contract
        self.label = f"tritonserver {url} ({protocol}), the written triton/ repository"
        self._module = client_module(protocol)
        self._client = self._module.InferenceServerClient(url=url)
        self.records = dict(models)
        self.batched = next(n for n, r in models.items() if r.get("max_batch_size"))
        self.sampling = next((n for n, r in models.items() if not r.get("max_batch_size")), None)
        self.recurrent = bool(models[self.batched].get("states"))
        self.inputs = {s.key: TensorMeta(s.key, s.dtype, s.shape) for s in contract.inputs}
        self.outputs = {s.key: TensorMeta(s.key, s.dtype, s.shape) for s in contract.outputs}
        self._sequences: list[int] = []

    def _choose(self, feeds: Mapping[str, np.ndarray]) -> str:
        """The sampling model's name when an optional input is fed a value other than its default
        (:meth:`Contract.non_default_inputs`), else the batched model's."""
        switched = self.contract.non_default_inputs(feeds)
        if switched and self.sampling is None:
            raise InputError(f"{self.label}: input {switched[0]!r} can only be its default here")
        return self.sampling if switched else self.batched

    def _infer(self, name: str, arrays: Mapping[str, np.ndarray], **sequence) -> dict[str, np.ndarray]:
        record = self.records[name]
        inputs = []
        for key in record["inputs"]:
            if key not in arrays:
                continue
            value = np.ascontiguousarray(arrays[key])
            item = self._module.InferInput(key, list(value.shape), WIRE_TYPES[value.dtype.name])
            item.set_data_from_numpy(value)
            inputs.append(item)
        result = self._client.infer(name, inputs, outputs=[self._module.InferRequestedOutput(k)
                                                          for k in record["outputs"]], **sequence)
        return {k: result.as_numpy(k) for k in record["outputs"]}

    def _wire(self, name: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Contract feeds as the written config declares them: ``[batch]`` as ``[batch, 1]`` in
        the batched model, a scalar as ``[1]``."""
        batched = bool(self.records[name].get("max_batch_size"))
        out = {}
        for key, value in feeds.items():
            value = np.asarray(value, dtype=self.contract.input(key).dtype)
            out[key] = value.reshape(1) if value.ndim == 0 else (value.reshape(-1, 1) if batched and value.ndim == 1
                                                                 else value)
        return out

    def _shaped(self, out: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v).reshape(-1) if len(self.contract.output(k).shape) == 1 else v for k, v in out.items()}

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.recurrent:
            return self._step(feeds)
        name = self._choose(feeds)
        return self._shaped(self._infer(name, self._wire(name, {k: v for k, v in feeds.items() if k != SEQ_LENS})))

    def _step(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        states = sorted(k for k in feeds if k.startswith("state_in_"))
        rows = len(np.asarray(feeds[states[0]]))
        start = all(not np.any(feeds[k]) for k in states)
        if start:
            self._sequences = [next(self._ids) for _ in range(rows)]
        elif len(self._sequences) != rows:
            raise InputError(f"{self.label}: a call continues {len(self._sequences)} sequences, not {rows}")
        step = 0 if start else int(np.asarray(feeds[states[0]]).flat[0])
        per_step = {k: v for k, v in feeds.items() if k not in states and k != SEQ_LENS}
        collected: dict[str, list[np.ndarray]] = {}
        for row, sequence_id in enumerate(self._sequences):
            arrays = self._wire(self.batched, {k: np.asarray(v)[row:row + 1] for k, v in per_step.items()})
            out = self._infer(self.batched, arrays, sequence_id=sequence_id, sequence_start=start)
            for key, value in self._shaped(out).items():
                collected.setdefault(key, []).append(value)
        result = {k: np.concatenate(v) for k, v in collected.items()}
        for i, key in enumerate(states):  # step counters the server never sees
            result[state_out_key(i)] = np.full_like(np.asarray(feeds[state_in_key(i)]), step + 1)
        return result

    def device_info(self) -> dict[str, Any]:
        return {"triton_protocol": self.protocol}

    def _close(self) -> None:
        self._client.close()


class RepositoryTarget(Format):
    """The repository's models on the live server over one protocol, checked like a format:
    golden and exploration parity for feed-forward policies, the stepped sequences for recurrent
    ones (a server keeping implicit state takes no golden state; its state outputs are not sent)."""

    def __init__(self, server: RepositoryServer, protocol: str, info: Mapping[str, Any], contract: Contract):
        self.server, self.protocol, self.info, self.contract = server, protocol, info, contract
        self.name = f"triton-repository/{protocol}"
        self.recurrent = bool(info.get("recurrent"))
        self.capabilities = Capabilities(explores=bool(info.get("explores")), default=False)

    def open(self, path: Path, manifest: Mapping[str, Any], device: Any) -> RepositoryClient:
        return RepositoryClient(f"{HOST}:{self.server.ports[self.protocol]}", self.protocol, self.info["models"],
                                self.contract)

    def explores(self, info) -> bool:
        return self.capabilities.explores

    def output_keys(self, contract: Contract, info) -> list[str]:
        record = next(r for r in self.info["models"].values() if r.get("max_batch_size"))
        return [k for k in contract.output_keys if k in record["outputs"]]

    def check(self, label, path, manifest, device, replay, report) -> None:
        if not self.recurrent:
            return super().check(label, path, manifest, device, replay, report)
        if replay.plan.stepped is None:
            return None
        with self.open(path, manifest, device) as runner:
            replay.plan.stepped.check(label, runner, replay.tolerances, report,
                                      [k for k in self.output_keys(self.contract, None) if not is_state_out(k)])
        return None


REPOSITORY_CHECK = "triton-repository"


def check_repository(out: Path, doc: Mapping[str, Any], replay, report, device: Any) -> list[str]:
    """The export's ``triton/`` on a real ``tritonserver`` (:class:`RepositoryServer`), checked over
    HTTP and gRPC; returns notes for the verify report. A repository the server is not given (a
    model, version or file its manifest record does not account for) or refuses fails the
    ``triton-repository`` check with the reason."""
    from policy_export.exporter.serve.targets import run_target

    info = doc["formats"]["triton"]
    contract = Contract.from_json(doc["contract"])
    try:
        server = RepositoryServer(out / "triton", info)
        server.start()
    except PolicyExportError as e:
        report.errors[REPOSITORY_CHECK] = f"{type(e).__name__}: {str(e)[:500]}"
        return [f"triton repository: not loaded ({str(e)[:200]})"]
    with server:
        for protocol in PROTOCOLS:
            run_target(RepositoryTarget(server, protocol, info, contract), out, doc, replay, report, device)
        what = "the stepped sequences (the server keeping the state)" if info.get("recurrent") else \
            "the golden outputs" + (" and exploration" if info.get("explores") else "")
        return [f"triton repository: tritonserver loaded {', '.join(server.models)} (Python backend standing in for "
                f"ONNX Runtime's), {what} checked over {' and '.join(PROTOCOLS)}"]
