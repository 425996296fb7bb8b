"""Shared test fixtures: the declared fixture matrix and one export per fixture per session."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The command line wraps what it prints at 80 columns through a pipe unless COLUMNS says otherwise.
# The tests check what it says with the paths pytest makes (their length differs from machine to
# machine), so they run it unwrapped; how it is laid out at 80 columns, through a pipe and on a
# terminal, is tested apart with paths of known length and no COLUMNS (tests/test_width.py,
# tests/test_cheap_mistakes.py; helpers.cli(..., narrow=True)).
WIDE_ENOUGH = "10000"  # set once pytest has measured its own terminal (see pytest_configure)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES_DIR = ROOT / "fixtures"
# every bundled fixture must be listed here (test_matrix_covers_every_fixture checks it)
FIXTURES = ["cartpole_mlp", "pendulum_mlp", "dict_image_vector", "image_uint8", "tuple_action",
            "multibinary_action", "discrete_obs", "cartpole_lstm"]
RECURRENT = ["cartpole_lstm"]
FORMATS = ["saved_model", "frozen_graph", "onnx", "onnx_deterministic", "keras"]


def default_signals() -> None:
    """``preexec_fn`` of a child a test sends signals to: SIGINT, SIGTERM and SIGHUP at their
    defaults, whatever the suite inherited (``nohup`` ignores SIGHUP; a shell's background job
    starts with SIGINT ignored, and Python then installs no KeyboardInterrupt handler)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.hookimpl(trylast=True)  # after pytest's terminal reporter has taken the terminal's width
def pytest_configure(config):
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    if config.pluginmanager.get_plugin("terminalreporter") is not None:  # pytest's own lines keep their width
        writer = config.get_terminal_writer()
        writer.fullwidth = writer.fullwidth
    os.environ["COLUMNS"] = WIDE_ENOUGH  # the command line's, in this process and the ones it starts


def gpu_available() -> tuple[bool, str]:
    from policy_export.exporter.devices import gpu_availability

    tf_gpu, ort_gpu = gpu_availability()
    if not tf_gpu:
        return False, "no GPU visible to TensorFlow"
    if not ort_gpu:
        return False, "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    return True, ""


# Modules whose subject is not the stack (TensorFlow, numpy, Ray, the runtimes' versions): what is
# printed and how (width, pipes, progress, the verdict's layout), processes and signals, the
# package's files and docs, the import contracts, the JavaScript clients' runtimes. Marked `once`:
# CI runs them in its first run (the newest stack) and leaves them out of the second (RLlib's TF
# stack), where every other not-slow test runs again. No test is left out of CI.
ONCE = {
    "test_width.py", "test_pipes.py", "test_progress.py", "test_verdict.py", "test_packaging.py",
    "test_cheap_mistakes.py", "test_readme.py", "test_layers.py", "test_help_registries.py",
    "test_declared_values.py", "test_js_clients.py", "test_many.py", "test_trust_staging.py",
    "test_api_commands.py", "test_examples.py", "test_cli.py", "test_options.py", "test_early_refusals.py",
    "test_many_hostile.py", "test_signing.py", "test_signing_files.py", "test_signing_many.py",
    "test_spec_schema.py", "test_serve_front.py",
}


def pytest_collection_modifyitems(config, items):
    once = pytest.mark.once
    for item in items:
        if item.path.name in ONCE:
            item.add_marker(once)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    ok, reason = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def shared_artifact(tmp_path_factory, key: str, build):
    """``(value, path)`` of the artifact ``key``: built once per test session, however many xdist
    workers ask for it.

    ``build(path)`` makes the artifact at ``path`` and returns a picklable value (for an export,
    its ``ExportResult``). Artifacts live in ``shared/``, in the directory all workers of a session
    share: the parent of each worker's ``getbasetemp()`` (without xdist, the basetemp itself). Each
    key has a ``filelock.FileLock`` beside it; the first worker to take it builds the artifact,
    then pickles the value to ``<key>.pickle`` (written last, by rename: the mark of a complete
    artifact). The others wait on the lock and load the pickle. A build that raised, or a worker
    that died building, leaves no pickle: the next to take the lock clears ``path`` and builds
    again. Every worker reads the same files: a test that changes them works on a copy
    (``helpers.copy_of``)."""
    import pickle

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared" / key
    done = path.with_name(path.name + ".pickle")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_name(path.name + ".lock")):
        if done.exists():
            return pickle.loads(done.read_bytes()), path
        if path.exists():
            shutil.rmtree(path)
        value = build(path)
        partial = path.with_name(path.name + ".pickle.partial")
        partial.write_bytes(pickle.dumps(value))
        partial.replace(done)
        return value, path


def spec_exports(tmp_path_factory, label: str, options=None):
    """``get(name)`` -> (ExportResult, path): each bundled fixture exported once per session (see
    :func:`shared_artifact`), on CPU, under a directory of its own (``label``, and a digest of the
    options), with ``options`` (keywords of ``export_spec``, or a function of the fixture's name
    returning them)."""
    import hashlib

    from policy_export.exporter import export_spec

    cache = {}

    def get(name: str):
        if name not in cache:
            keywords = options(name) if callable(options) else dict(options or {})
            digest = hashlib.sha256(repr(sorted(keywords.items())).encode()).hexdigest()[:8]
            cache[name] = shared_artifact(tmp_path_factory, f"{label}/{digest}/{name}", lambda out: export_spec(
                FIXTURES_DIR / name, out, device="cpu", **keywords))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """``exports(name)`` -> (ExportResult, path): each fixture exported once, on CPU, 1,000 samples."""
    return spec_exports(tmp_path_factory, "exports")


@pytest.fixture(scope="session")
def policies():
    """``policies(name)`` -> a TFPolicy built from the fixture (cached for the session)."""
    from policy_export.policy import TFPolicy, load_spec

    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = TFPolicy.from_spec(load_spec(FIXTURES_DIR / name))
        return cache[name]

    return get


def splice_into_serving_path(pb: Path, build) -> None:
    """Add the nodes (and library functions) ``build(obs)`` makes in a scratch graph to the
    SavedModel at ``pb``, with the serving signature's first output waiting on the node ``build``
    returns the name of. ``obs`` stands for the signature's ``observations`` input (the scratch
    graph's placeholder of the same name is not copied: the copied nodes read the real one)."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString(pb.read_bytes())
    meta = proto.meta_graphs[0]
    signature = meta.signature_def["serving_default"]
    obs_name = signature.inputs["observations"].name.split(":")[0]
    scratch = tf.Graph()
    with scratch.as_default():
        waited_on = build(tf.compat.v1.placeholder(tf.float32, name=obs_name))
    scratch_def = scratch.as_graph_def()
    meta.graph_def.node.extend(n for n in scratch_def.node if n.name != obs_name)
    meta.graph_def.library.function.extend(scratch_def.library.function)
    output = next(iter(signature.outputs.values())).name.split(":")[0]
    next(n for n in meta.graph_def.node if n.name == output).input.append(f"^{waited_on}")
    pb.write_bytes(proto.SerializeToString())


def splice_endless_init(pb: Path) -> None:
    """Make what loading the SavedModel at ``pb`` runs before any signature loop for ever: an
    endless ``while`` (allowed ops only, so the file passes the op check) becomes the init op
    (``saved_model_main_op``) and a control input of every variable's initializer (a loader that
    assigns variable values itself runs those instead of the init op)."""
    import tensorflow as tf
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import saved_model_pb2

    tf1 = tf.compat.v1
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString(pb.read_bytes())
    meta = proto.meta_graphs[0]
    scratch = tf.Graph()
    with scratch.as_default(), tf1.name_scope("endless_init"):
        start = tf1.placeholder_with_default(tf.constant(0, tf.int64), [], name="start")  # not folded away
        done = tf.while_loop(lambda i: i < tf.constant(2**62, tf.int64), lambda i: i + 1, [start])
        main_op = tf.group(done, name="main_op")
    scratch_def = scratch.as_graph_def()
    meta.graph_def.node.extend(scratch_def.node)
    meta.graph_def.library.function.extend(scratch_def.library.function)
    initializers = set()
    for key in ("variables", "local_variables"):
        for data in meta.collection_def[key].bytes_list.value if key in meta.collection_def else ():
            var = variable_pb2.VariableDef()
            var.ParseFromString(data)
            initializers.add(var.initializer_name)
    for node in meta.graph_def.node:
        if node.name in initializers:
            node.input.append(f"^{main_op.name}")
    for key in ("saved_model_main_op", "legacy_init_op"):
        meta.collection_def.pop(key, None)
    meta.signature_def.pop("__saved_model_init_op", None)
    meta.collection_def["saved_model_main_op"].node_list.value.append(main_op.name)
    pb.write_bytes(proto.SerializeToString())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The slowest 15 test modules by the summed time of their tests (setup, call and teardown;
    with xdist, the workers' times added up), so the suite's growth shows in every run."""
    per_module: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid, duration = getattr(report, "nodeid", ""), getattr(report, "duration", None)
            if nodeid and isinstance(duration, float):
                module = nodeid.split("::", 1)[0]
                per_module[module] = per_module.get(module, 0.0) + duration
    if not per_module:
        return
    terminalreporter.write_sep("-", "slowest 15 test modules (summed test time)")
    ranked = sorted(per_module.items(), key=lambda kv: -kv[1])
    for module, seconds in ranked[:15]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
    every = os.environ.get("POLICY_EXPORT_MODULE_TIMES")  # a file for every module's time, to plan CI
    if every:
        Path(every).write_text("".join(f"{seconds:.1f} {module}\n" for module, seconds in ranked))
