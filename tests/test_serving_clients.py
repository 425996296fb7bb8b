"""Exports as plain serving clients see them, with no project code in the path under test.

Each export is read the way a third party would: ``saved_model_cli`` and an eager TF2 process
for the SavedModel, a bare ONNX Runtime session and ONNX's own checker for ``model.onnx``. The
expectations come from the export's files only (``manifest.json`` and ``parity/*.npz``), so these
tests check the files against their own manifest and golden outputs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import FIXTURES

BATCH_DIM = "batch"
CONTRACT_METADATA = "policy_export.contract"
FLOAT_ATOL = 1e-5
SUBPROCESS_TIMEOUT = 600
# how saved_model_cli and ONNX Runtime spell each contract dtype (contract dtypes are numpy names)
TF_DTYPES = {"float16": "DT_HALF", "float32": "DT_FLOAT", "float64": "DT_DOUBLE", "int8": "DT_INT8",
             "int16": "DT_INT16", "int32": "DT_INT32", "int64": "DT_INT64", "uint8": "DT_UINT8",
             "bool": "DT_BOOL"}
ORT_TYPES = {"float16": "tensor(float16)", "float32": "tensor(float)", "float64": "tensor(double)",
             "int8": "tensor(int8)", "int16": "tensor(int16)", "int32": "tensor(int32)",
             "int64": "tensor(int64)", "uint8": "tensor(uint8)", "bool": "tensor(bool)"}

# Run in a separate, plain TF2 process: for each job of the JSON list in argv[1] (one export each),
# load the TF1 SavedModel eagerly, record the signature function's input signature, call it once
# with the job's feeds and save what it returns; a job that fails leaves its traceback in its
# error file and the others still run. (One process serves every export: TF's import is most of
# a client's time.)
TF2_CLIENT = """
import json, sys, traceback
import numpy as np
import tensorflow as tf

for job in json.load(open(sys.argv[1])):
    try:
        fn = tf.saved_model.load(job["saved_model"]).signatures["serving_default"]
        args, kwargs = fn.structured_input_signature
        with open(job["signature"], "w") as f:
            json.dump({"positional": len(args),
                       "inputs": {k: [s.dtype.name, s.shape.as_list()] for k, s in kwargs.items()}}, f)
        with np.load(job["feeds"]) as data:
            feeds = {k: tf.constant(data[k]) for k in data.files}
        np.savez(job["outputs"], **{k: v.numpy() for k, v in fn(**feeds).items()})
    except Exception:
        with open(job["error"], "w") as f:
            f.write(traceback.format_exc())
"""

# Run in a separate process: the installed ``saved_model_cli`` script (argv[1]) run as its own
# ``__main__`` with ``show --dir <saved_model> --all`` for each SavedModel in argv[3:], its exit
# code, stdout and stderr per SavedModel written to the JSON file argv[2]. (One process runs the
# script for every export: TF's import is most of a run's time.)
SAVED_MODEL_CLI = """
import contextlib, io, json, runpy, sys, traceback

script, results = sys.argv[1:3]
shown = {}
for saved_model in sys.argv[3:]:
    sys.argv = [script, "show", "--dir", saved_model, "--all"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except Exception:  # what the script would die of, with its traceback
            traceback.print_exc()
            code = 1
    shown[saved_model] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
with open(results, "w") as f:
    json.dump(shown, f)
"""


# ---------------------------------------------------------------------------- helpers


def client_env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def read_manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text(encoding="utf-8"))


def read_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def golden(out: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Golden inputs and outputs (``base_model/...`` keys are not signature outputs: dropped)."""
    inputs = read_npz(out / "parity" / "inputs.npz")
    outputs = {k: v for k, v in read_npz(out / "parity" / "outputs.npz").items() if not k.startswith("base_model/")}
    return inputs, outputs


def required_feeds(contract: dict, golden_in: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    required = [s["key"] for s in contract["inputs"] if s["required"]]
    assert sorted(golden_in) == sorted(required), "parity/inputs.npz should hold exactly the required inputs"
    return {k: golden_in[k] for k in required}


def default_value(spec: dict) -> np.ndarray:
    return np.asarray(spec["default"], dtype=np.dtype(spec["dtype"]))


def assert_outputs_match(contract: dict, got: dict[str, np.ndarray], expected: dict[str, np.ndarray],
                         who: str) -> None:
    """Every contract output is in ``got`` with its dtype; ints equal, floats within FLOAT_ATOL."""
    keys = [s["key"] for s in contract["outputs"]]
    assert sorted(expected) == sorted(keys), "parity/outputs.npz should hold every signature output"
    assert sorted(got) == sorted(keys), f"{who} returned {sorted(got)}, the contract has {sorted(keys)}"
    for spec in contract["outputs"]:
        key, value, want = spec["key"], np.asarray(got[spec["key"]]), expected[spec["key"]]
        assert value.dtype == np.dtype(spec["dtype"]), f"{who} {key}: dtype {value.dtype}, contract {spec['dtype']}"
        assert value.shape == want.shape, f"{who} {key}: shape {value.shape}, golden {want.shape}"
        if np.issubdtype(value.dtype, np.floating):
            np.testing.assert_allclose(value, want, rtol=0, atol=FLOAT_ATOL, err_msg=f"{who} {key}")
        else:
            np.testing.assert_array_equal(value, want, err_msg=f"{who} {key}")


def has_batch(spec: dict) -> bool:
    return len(spec["shape"]) > 0 and spec["shape"][0] is None


def ort_session(out: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the optional inputs are initializers listed as inputs: ORT warns
    return ort.InferenceSession(str(out / "model.onnx"), options, providers=["CPUExecutionProvider"])


def action_space_leaf(space: dict, path: list[str]) -> dict:
    for part in path:
        space = space["spaces"][part if space["type"] == "Dict" else int(part)]
    return space


def action_bounds(space: dict) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive (low, high) of one leaf of the manifest's action space."""
    kind = space["type"]
    if kind == "Discrete":
        start = space.get("start", 0)
        return np.asarray(start), np.asarray(start + space["n"] - 1)
    if kind == "Box":
        # bounds are JSON numbers (or "inf") written in the Box dtype's shortest form: read them back
        # in that dtype so that an action clipped to a float32 bound compares equal to it
        shape, dtype = tuple(space["shape"]), np.dtype(space.get("dtype", "float32"))
        return tuple(np.broadcast_to(np.asarray(space[b], dtype=np.float64).astype(dtype), shape)
                     for b in ("low", "high"))
    if kind == "MultiDiscrete":
        nvec = np.asarray(space["nvec"])
        return np.zeros_like(nvec), nvec - 1
    if kind == "MultiBinary":
        return np.asarray(0), np.asarray(1)
    pytest.fail(f"no bounds check for action leaf type {kind}: extend action_bounds")


def tf2_feeds(out: Path) -> dict[str, np.ndarray]:
    """The golden required inputs and, for every optional input, its default from the manifest.

    A TF1 SavedModel loaded in TF2 gives a pruned wrapped function whose arguments are *all* the
    signature inputs, none with a default: calling it without ``explore``, ``is_training`` or
    ``timestep`` raises "TypeError: missing a required argument: 'explore'", although they are
    placeholder_with_default in the graph. So a TF2 client must pass every optional input; we pass
    the defaults from the manifest contract (explore=False: deterministic actions)."""
    contract = read_manifest(out)["contract"]
    feeds = required_feeds(contract, golden(out)[0])
    feeds.update({s["key"]: default_value(s) for s in contract["inputs"] if not s["required"]})
    return feeds


def run_tf2_client(exports: dict[str, Path], tmp: Path) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """Run TF2_CLIENT once over ``<export>/saved_model`` of every export; returns the process and,
    per name, the job's files (``signature``, ``outputs``, ``error``)."""
    jobs = {}
    for name, out in exports.items():
        job = {key: str(tmp / f"{name}-{key}{ext}") for key, ext in
               (("feeds", ".npz"), ("outputs", ".npz"), ("signature", ".json"), ("error", ".txt"))}
        job["saved_model"] = str(out / "saved_model")
        np.savez(job["feeds"], **tf2_feeds(out))
        jobs[name] = job
    (tmp / "jobs.json").write_text(json.dumps(list(jobs.values())), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-c", TF2_CLIENT, str(tmp / "jobs.json")], cwd=tmp, env=client_env(),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    return proc, jobs


@pytest.fixture(scope="module")
def tf2_client(exports, tmp_path_factory):
    """``tf2_client(name)`` -> (input signature, outputs) the plain TF2 process got for the export."""
    proc, jobs = run_tf2_client({name: exports(name)[1] for name in FIXTURES}, tmp_path_factory.mktemp("tf2_client"))

    def get(name: str) -> tuple[dict, dict[str, np.ndarray]]:
        assert proc.returncode == 0, f"TF2 client failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        job = jobs[name]
        error = Path(job["error"])
        assert not error.exists(), f"TF2 client failed on {name}:\n{error.read_text(encoding='utf-8')[-4000:]}"
        signature = json.loads(Path(job["signature"]).read_text(encoding="utf-8"))
        return signature, read_npz(Path(job["outputs"]))

    return get


@pytest.fixture(scope="module")
def saved_model_cli(exports, tmp_path_factory):
    """``saved_model_cli(name)`` -> what ``saved_model_cli show --dir <export>/saved_model --all``
    gave (``returncode``, ``stdout``, ``stderr``); the script run for every export in one process."""
    cli = Path(sys.executable).parent / "saved_model_cli"
    if not cli.is_file():
        pytest.skip(f"saved_model_cli is not installed next to {sys.executable}")
    dirs = {name: str(exports(name)[1] / "saved_model") for name in FIXTURES}
    results = tmp_path_factory.mktemp("saved_model_cli") / "shown.json"
    proc = subprocess.run([sys.executable, "-c", SAVED_MODEL_CLI, str(cli), str(results), *dirs.values()],
                          env=client_env(), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)

    def get(name: str) -> dict:
        assert proc.returncode == 0, f"saved_model_cli runner failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        return json.loads(results.read_text(encoding="utf-8"))[dirs[name]]

    return get


def cli_tensor_text(spec: dict) -> str:
    """``dtype: DT_X`` and ``shape: (...)`` as saved_model_cli prints a tensor_info."""
    dims = ", ".join("-1" if d is None else str(d) for d in spec["shape"])
    return f"dtype: {TF_DTYPES[spec['dtype']]}\n        shape: ({dims})"


# ---------------------------------------------------------------------------- SavedModel


@pytest.mark.parametrize("name", FIXTURES)
def test_saved_model_cli_shows_the_contract(exports, saved_model_cli, name):
    _, out = exports(name)
    contract = read_manifest(out)["contract"]
    shown = saved_model_cli(name)
    assert shown["returncode"] == 0, f"saved_model_cli failed ({shown['returncode']}):\n{shown['stderr'][-4000:]}"
    text = shown["stdout"]
    assert "MetaGraphDef with tag-set: 'serve'" in text
    assert "signature_def['serving_default']:" in text
    # only the serving_default block counts: its inputs, outputs and method name
    block = text.split("signature_def['serving_default']:", 1)[1]
    block = re.split(r"\nsignature_def\[|\nThe MetaGraph with tag set", block)[0]
    for kind in ("inputs", "outputs"):
        printed = re.findall(rf"{kind}\['([^']+)'\] tensor_info:", block)
        assert sorted(printed) == sorted(s["key"] for s in contract[kind]), f"{kind} printed: {printed}"
        for spec in contract[kind]:
            entry = f"{kind}['{spec['key']}'] tensor_info:\n        {cli_tensor_text(spec)}\n"
            assert entry in block, f"saved_model_cli does not show {entry!r}:\n{block}"
    assert "Method name is: tensorflow/serving/predict" in block


@pytest.mark.parametrize("name", FIXTURES)
def test_plain_tf2_process_reproduces_golden_outputs(exports, tf2_client, name):
    _, out = exports(name)
    contract = read_manifest(out)["contract"]
    _, golden_out = golden(out)
    signature, got = tf2_client(name)  # called with every input: see tf2_feeds
    assert signature["positional"] == 0
    expected_sig = {s["key"]: [s["dtype"], s["shape"]] for s in contract["inputs"]}
    assert signature["inputs"] == expected_sig, "the loaded signature's inputs differ from the contract"
    assert_outputs_match(contract, got, golden_out, "TF2 signature function")


# ---------------------------------------------------------------------------- ONNX Runtime


@pytest.mark.parametrize("name", FIXTURES)
def test_onnx_runtime_io_matches_contract(exports, name):
    _, out = exports(name)
    contract = read_manifest(out)["contract"]
    session = ort_session(out)
    required = [s for s in contract["inputs"] if s["required"]]
    optional = [s for s in contract["inputs"] if not s["required"]]

    assert sorted(i.name for i in session.get_inputs()) == sorted(s["key"] for s in required)
    overridable = {i.name: i for i in session.get_overridable_initializers()}
    assert sorted(overridable) == sorted(s["key"] for s in optional)
    for spec in optional:
        arg = overridable[spec["key"]]
        assert arg.type == ORT_TYPES[spec["dtype"]], f"{spec['key']}: {arg.type}"
        assert list(arg.shape) == spec["shape"], f"{spec['key']}: shape {arg.shape}"
    for arg in session.get_inputs():
        spec = next(s for s in required if s["key"] == arg.name)
        assert arg.type == ORT_TYPES[spec["dtype"]], f"{arg.name}: {arg.type}"
    outputs = {o.name: o for o in session.get_outputs()}
    assert sorted(outputs) == sorted(s["key"] for s in contract["outputs"])
    for spec in contract["outputs"]:
        assert outputs[spec["key"]].type == ORT_TYPES[spec["dtype"]], f"{spec['key']}: {outputs[spec['key']].type}"


@pytest.mark.parametrize("name", FIXTURES)
def test_onnx_graph_io_has_symbolic_batch(exports, name):
    _, out = exports(name)
    contract = read_manifest(out)["contract"]
    graph = onnx.load(str(out / "model.onnx")).graph
    for kind, values in (("inputs", graph.input), ("outputs", graph.output)):
        by_name = {v.name: v for v in values}
        assert sorted(by_name) == sorted(s["key"] for s in contract[kind]), f"graph {kind}: {sorted(by_name)}"
        for spec in contract[kind]:
            tensor_type = by_name[spec["key"]].type.tensor_type
            assert tensor_type.elem_type == onnx.helper.np_dtype_to_tensor_dtype(np.dtype(spec["dtype"]))
            dims = tensor_type.shape.dim
            assert len(dims) == len(spec["shape"]), f"{spec['key']}: rank {len(dims)}, contract {spec['shape']}"
            for i, (dim, want) in enumerate(zip(dims, spec["shape"])):
                if i == 0 and has_batch(spec):
                    assert dim.WhichOneof("value") == "dim_param" and dim.dim_param == BATCH_DIM, \
                        f"{spec['key']}: first dim is {dim}, expected the symbolic {BATCH_DIM!r}"
                elif want is not None:
                    assert dim.dim_value == want, f"{spec['key']}: dim {i} is {dim}, contract {want}"


@pytest.mark.parametrize("name", FIXTURES)
def test_onnx_metadata_holds_the_contract(exports, name):
    _, out = exports(name)
    props = {p.key: p.value for p in onnx.load(str(out / "model.onnx")).metadata_props}
    assert CONTRACT_METADATA in props, f"metadata keys: {sorted(props)}"
    assert json.loads(props[CONTRACT_METADATA]) == read_manifest(out)["contract"]


@pytest.mark.parametrize("name", FIXTURES)
def test_onnx_runtime_required_inputs_reproduce_golden_outputs(exports, name):
    _, out = exports(name)
    contract = read_manifest(out)["contract"]
    golden_in, golden_out = golden(out)
    session = ort_session(out)
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, required_feeds(contract, golden_in))))
    assert_outputs_match(contract, got, golden_out, "ONNX Runtime")


@pytest.mark.parametrize("name", FIXTURES)
def test_onnx_runtime_explore_samples_inside_the_action_space(exports, name):
    _, out = exports(name)
    doc = read_manifest(out)
    golden_in, golden_out = golden(out)
    session = ort_session(out)
    names = [o.name for o in session.get_outputs()]
    feeds = {**required_feeds(doc["contract"], golden_in), "explore": np.array(True)}
    got = dict(zip(names, session.run(names, feeds)))
    action_keys = doc["keys"]["actions"]
    assert action_keys, "the manifest names no action outputs"
    for key, path in action_keys.items():
        space = action_space_leaf(doc["spaces"]["action"], path)
        low, high = action_bounds(space)
        sampled, deterministic = got[key], golden_out[key]
        assert sampled.dtype == deterministic.dtype and sampled.shape == deterministic.shape
        assert np.isfinite(sampled).all(), f"{key}: non-finite sampled actions"
        assert (sampled >= low).all() and (sampled <= high).all(), \
            f"{key}: sampled actions in [{sampled.min()}, {sampled.max()}], space is [{low}, {high}]"
        # the policy is stochastic: exploring over 1,000 observations must change some action
        assert not np.array_equal(sampled, deterministic), f"{key}: explore=True gave the deterministic actions"


# ---------------------------------------------------------------------------- ONNX tools


@pytest.mark.parametrize("name", FIXTURES)
def test_onnx_checker_and_strict_shape_inference(exports, name):
    _, out = exports(name)
    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    assert opsets.get("ai.onnx") == read_manifest(out)["opset"], f"opset_import: {opsets}"
