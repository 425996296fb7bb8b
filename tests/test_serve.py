"""``serve`` and ``verify --server triton``: the export's own ``triton/`` repository on a real Triton
server (PyTriton's ``tritonserver``, the ``serve`` extra), with the package's stand-in for the ONNX
Runtime backend, behind the package's HTTP and gRPC fronts, through Triton's own clients.

What a client sees is held to what the repository declares: every served model's name, version,
platform, inputs, outputs, shapes, data types and batching are its ``config.pbtxt``'s (read with
Triton's own schema); one client function, written from ``config.pbtxt`` alone, runs unchanged over
HTTP and gRPC; a recurrent policy steps the export's stored episodes through the sequence batcher
with the state kept by the server; a wrong request gets tritonserver's own error over both
protocols; and a config the ONNX Runtime backend would not load is refused with that backend's
message (its rules from ``onnxruntime_backend/src/onnxruntime.cc``: ``ValidateInputs``,
``ValidateOutputs``, ``ValidateBooleanSequenceControl``).

Skipped where the extra is not installed. One server per module fixture (a feed-forward policy and
an LSTM), started once.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import descendants
from conftest import FIXTURES_DIR, spec_exports

pytest.importorskip("pytriton", reason="PyTriton is not installed (the serve extra: pip install '.[serve]')")
tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from policy_export.exporter import manifest  # noqa: E402
from policy_export.exporter.formats.triton.config import model_config_schema  # noqa: E402
from policy_export.exporter.manifest import read_manifest  # noqa: E402
from policy_export.exporter.serve.server import TritonServer, free_port  # noqa: E402
from policy_export.exporter.verify import verify_export  # noqa: E402
from policy_export.signatures.contract import Contract  # noqa: E402

pytestmark = pytest.mark.serve
FORMATS = ["saved_model", "onnx", "triton"]
CHECKPOINTS = FIXTURES_DIR / "rllib" / "checkpoints"
CLIENTS = {"http": tritonclient_http, "grpc": tritonclient_grpc}
# Triton's config data types as KServe v2 names them
KSERVE = {"TYPE_FP32": "FP32", "TYPE_FP64": "FP64", "TYPE_FP16": "FP16", "TYPE_INT64": "INT64", "TYPE_INT32": "INT32",
          "TYPE_INT16": "INT16", "TYPE_INT8": "INT8", "TYPE_UINT8": "UINT8", "TYPE_UINT16": "UINT16",
          "TYPE_UINT32": "UINT32", "TYPE_UINT64": "UINT64", "TYPE_BOOL": "BOOL"}
NUMPY = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32,
         "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
         "UINT64": np.uint64, "BOOL": np.bool_}


@pytest.fixture(scope="module")
def served_exports(tmp_path_factory):
    return spec_exports(tmp_path_factory, "served", {"formats": FORMATS, "samples": 200, "explore_samples": 2000})


def _serve(out: Path):
    return TritonServer.start(out, http_port=free_port(), grpc_port=free_port())


@pytest.fixture(scope="module")
def mlp(served_exports):
    _, out = served_exports("cartpole_mlp")
    with _serve(out) as server:
        yield out, server


@pytest.fixture(scope="module")
def lstm(served_exports):
    _, out = served_exports("cartpole_lstm")
    with _serve(out) as server:
        yield out, server


def _client(server, protocol: str):
    return CLIENTS[protocol].InferenceServerClient(server.endpoints()[protocol])


def _configs(out: Path) -> dict:
    """Each model of the export's ``triton/`` as its ``config.pbtxt`` declares it (Triton's schema)."""
    from google.protobuf import text_format

    model_config, data_types = model_config_schema()
    configs = {}
    for path in sorted((out / "triton").glob("*/config.pbtxt")):
        config = text_format.Parse(path.read_text(), model_config())
        configs[config.name] = config
    return configs, data_types


def _declared(config, io, data_types) -> tuple[str, list[int]]:
    """An input's or output's KServe data type and full shape (``-1`` first where the model batches)."""
    return KSERVE[data_types.values_by_number[io.data_type].name], \
        ([-1] if config.max_batch_size > 0 else []) + [int(d) for d in io.dims]


def _metadata(client, protocol: str, name: str) -> dict:
    if protocol == "grpc":
        return client.get_model_metadata(name, as_json=True)
    return client.get_model_metadata(name)


def _config(client, protocol: str, name: str) -> dict:
    if protocol == "grpc":
        return client.get_model_config(name, as_json=True)["config"]
    return client.get_model_config(name)


@pytest.mark.parametrize("served", ["mlp", "lstm"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_served_model_is_its_config_pbtxt(request, served, protocol):
    """Names, versions, platform, inputs, outputs, shapes, data types, optional inputs and batching
    (the dynamic batcher, the sequence batcher's controls and implicit state) of every served model
    are what its ``config.pbtxt`` declares, read as a real Triton with the ONNX Runtime backend
    reports them; no other model or version is served."""
    out, server = request.getfixturevalue(served)
    configs, data_types = _configs(out)
    assert sorted(m.name for m in server.models) == sorted(configs)
    client = _client(server, protocol)
    try:
        assert client.is_server_ready()
        for name, config in configs.items():
            version = str(config.version_policy.specific.versions[0])
            assert client.is_model_ready(name) and client.is_model_ready(name, version)
            assert not client.is_model_ready(name, str(int(version) + 1))
            meta = _metadata(client, protocol, name)
            assert meta["name"] == name and meta["versions"] == [version] and meta["platform"] == "onnxruntime_onnx"
            for key, entries in (("inputs", config.input), ("outputs", config.output)):
                got = [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in meta[key]]
                assert got == [(io.name, *_declared(config, io, data_types)) for io in entries], (name, key)
            served_config = _config(client, protocol, name)
            assert served_config["name"] == name and served_config["backend"] == "onnxruntime"
            assert served_config.get("platform") == "onnxruntime_onnx" and not served_config.get("runtime")
            assert int(served_config.get("max_batch_size", 0)) == config.max_batch_size
            inputs = {i["name"]: i for i in served_config["input"]}
            for io in config.input:
                assert [int(d) for d in inputs[io.name]["dims"]] == list(io.dims)
                assert bool(inputs[io.name].get("optional", False)) == io.optional
                assert ("reshape" in inputs[io.name]) == io.HasField("reshape")
            assert ("dynamic_batching" in served_config) == config.HasField("dynamic_batching")
            if config.HasField("dynamic_batching"):
                assert int(served_config["dynamic_batching"]["max_queue_delay_microseconds"]) == \
                    config.dynamic_batching.max_queue_delay_microseconds
            assert ("sequence_batching" in served_config) == config.HasField("sequence_batching")
            if config.HasField("sequence_batching"):
                sequence = served_config["sequence_batching"]
                assert [c["name"] for c in sequence["control_input"]] == \
                    [c.name for c in config.sequence_batching.control_input]
                assert [(s["input_name"], s["output_name"]) for s in sequence["state"]] == \
                    [(s.input_name, s.output_name) for s in config.sequence_batching.state]
    finally:
        client.close()


def _golden(out: Path):
    with np.load(out / "parity" / "inputs.npz") as inputs, np.load(out / "parity" / "outputs.npz") as outputs:
        return {k: inputs[k] for k in inputs.files}, {k: outputs[k] for k in outputs.files}


def declared_client(module, url: str, config, data_types, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A client of a Triton model written from its ``config.pbtxt`` alone, the same for
    ``tritonclient.http`` and ``tritonclient.grpc``: each declared input sent with its declared data
    type, as ``[rows]`` + its dims (a ``[rows]`` value as ``[rows, 1]`` where the dims say so), every
    declared output requested; each answer checked against its declared data type and dims."""
    client = module.InferenceServerClient(url)
    try:
        inputs = []
        for io in config.input:
            if io.name not in rows:
                continue
            datatype, shape = _declared(config, io, data_types)
            value = np.asarray(rows[io.name], dtype=NUMPY[datatype])
            if value.ndim + 1 == len(shape) and shape[-1] == 1:
                value = value[..., None]
            value = np.ascontiguousarray(value)
            item = module.InferInput(io.name, list(value.shape), datatype)
            item.set_data_from_numpy(value)
            inputs.append(item)
        result = client.infer(config.name, inputs, outputs=[module.InferRequestedOutput(io.name) for io in config.output])
        answers = {}
        for io in config.output:
            datatype, shape = _declared(config, io, data_types)
            value = result.as_numpy(io.name)
            assert value.dtype == NUMPY[datatype], (io.name, value.dtype, datatype)
            assert value.ndim == len(shape) and all(d in (-1, g) for d, g in zip(shape, value.shape)), \
                (io.name, value.shape, shape)
            answers[io.name] = value
        return answers
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_one_client_from_config_pbtxt_runs_against_serve(mlp, protocol):
    """The declared client, unchanged, over each protocol: both models answer as declared, with
    ``actions_0`` ``[rows, 1]`` in each, and the batched model's answers are the export's golden outputs."""
    out, server = mlp
    configs, data_types = _configs(out)
    inputs, outputs = _golden(out)
    url = server.endpoints()[protocol]
    batched = declared_client(CLIENTS[protocol], url, configs["cartpole_mlp"], data_types,
                              {"observations": inputs["observations"][:16]})
    np.testing.assert_array_equal(batched["actions_0"], outputs["actions_0"][:16, None])
    np.testing.assert_allclose(batched["action_dist_inputs"], outputs["action_dist_inputs"][:16], rtol=1e-5, atol=1e-5)
    greedy = declared_client(CLIENTS[protocol], url, configs["cartpole_mlp_explore"], data_types,
                             {"observations": inputs["observations"][:16]})
    np.testing.assert_array_equal(greedy["actions_0"], outputs["actions_0"][:16, None])
    zeros = {"observations": np.zeros((400, 4), np.float32)}
    sampled = declared_client(CLIENTS[protocol], url, configs["cartpole_mlp_explore"], data_types,
                              {**zeros, "explore": np.array([True])})
    greedy = declared_client(CLIENTS[protocol], url, configs["cartpole_mlp_explore"], data_types, zeros)
    assert sampled["actions_0"].shape == greedy["actions_0"].shape == (400, 1)
    assert len(np.unique(greedy["actions_0"])) == 1 and 0.05 < np.mean(sampled["actions_0"] != greedy["actions_0"]) < 0.95


def _steps(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "parity" / "stepped.npz") as stepped:
        return {k: stepped[k] for k in stepped.files}


def test_a_recurrent_policy_steps_its_episodes_with_the_state_kept_by_the_server(lstm):
    """The export's stored episodes (4 sequences of 200 steps), each stepped by a client of its own at
    the same time over gRPC and HTTP (so the sequence batcher batches them), sending only the per-step
    inputs with a sequence id, START on the first step and END on the last: every action is the
    export's stored one, every other output within the export's tolerance."""
    out, server = lstm
    steps = _steps(out)
    count, sequences = steps["inputs/observations"].shape[:2]
    errors, worst = [], []

    def episode(protocol: str, q: int) -> None:
        client = _client(server, protocol)
        try:
            actions = []
            for t in range(count):
                inputs = []
                for key, datatype in (("observations", "FP32"), ("prev_action", "INT64"), ("prev_reward", "FP32")):
                    value = np.asarray(steps[f"inputs/{key}"][t, q:q + 1], NUMPY[datatype])
                    value = np.ascontiguousarray(value if value.ndim == 2 else value[:, None])
                    item = CLIENTS[protocol].InferInput(key, list(value.shape), datatype)
                    item.set_data_from_numpy(value)
                    inputs.append(item)
                result = client.infer("cartpole_lstm", inputs, sequence_id=1000 * (protocol == "http") + q + 1,
                                      sequence_start=t == 0, sequence_end=t == count - 1)
                actions.append(int(result.as_numpy("actions_0")[0, 0]))
                got = result.as_numpy("action_dist_inputs")[0]
                want = steps["serving/action_dist_inputs"][t, q]
                worst.append(float(np.max(np.abs(got - want) - 1e-5 * np.abs(want))))
            if actions != steps["serving/actions_0"][:, q].tolist():
                errors.append((protocol, q, "actions differ"))
        except Exception as e:  # reported below
            errors.append((protocol, q, repr(e)))
        finally:
            client.close()

    threads = [threading.Thread(target=episode, args=(p, q)) for p in ("grpc", "http") for q in range(sequences)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert max(worst) <= 1e-5, max(worst)
    # a sequence that was never started is refused by the sequence batcher itself
    client = _client(server, "grpc")
    value = np.zeros((1, 4), np.float32)
    items = []
    for key, datatype, v in (("observations", "FP32", value), ("prev_action", "INT64", np.zeros((1, 1), np.int64)),
                             ("prev_reward", "FP32", np.zeros((1, 1), np.float32))):
        items.append(tritonclient_grpc.InferInput(key, list(v.shape), datatype))
        items[-1].set_data_from_numpy(v)
    with pytest.raises(InferenceServerException, match="must specify the START flag on the first request"):
        client.infer("cartpole_lstm", items, sequence_id=987654)
    client.close()


def _bad(protocol: str, server, model: str, name: str, value: np.ndarray, datatype: str) -> str:
    client = _client(server, protocol)
    try:
        item = CLIENTS[protocol].InferInput(name, list(value.shape), datatype)
        item.set_data_from_numpy(value)
        with pytest.raises(InferenceServerException) as refused:
            client.infer(model, [item])
        return refused.value.message()
    finally:
        client.close()


def test_a_wrong_request_gets_tritonservers_own_error_over_both_protocols(mlp):
    """Over HTTP the front refuses these before the server sees them, over gRPC the server itself
    does: the messages are the same, tritonserver's own; the server keeps serving."""
    out, server = mlp
    inputs, outputs = _golden(out)
    obs = np.ascontiguousarray(inputs["observations"][:8])
    cases = [
        ("cartpole_mlp", "observations", obs.astype(np.float64), "FP64",
         "[request id: <id_unknown>] inference input 'observations' data-type is 'FP64', but model 'cartpole_mlp' "
         "expects 'FP32'"),
        ("cartpole_mlp", "observations", np.ascontiguousarray(obs[:, :3]), "FP32",
         "[request id: <id_unknown>] unexpected shape for input 'observations' for model 'cartpole_mlp'. Expected "
         "[-1,4], got [8,3]. NOTE: Setting a non-zero max_batch_size"),
        ("cartpole_mlp", "observations", obs[None], "FP32", "Expected [-1,4], got [1,8,4]."),
        ("cartpole_mlp", "observations", np.zeros((257, 4), np.float32), "FP32",
         "[request id: <id_unknown>] inference request batch-size must be <= 256 for 'cartpole_mlp'"),
        ("cartpole_mlp_explore", "observations", np.zeros((2, 2, 4), np.float32), "FP32",
         "unexpected shape for input 'observations' for model 'cartpole_mlp_explore'. Expected [-1,4], got [2,2,4]. "),
        ("cartpole_mlp", "obs", obs, "FP32", "unexpected inference input 'obs' for model 'cartpole_mlp'"),
        ("nope", "observations", obs, "FP32", "Request for unknown model: 'nope' is not found"),
    ]
    for model, name, value, datatype, message in cases:
        answers = {p: _bad(p, server, model, name, value, datatype) for p in ("http", "grpc")}
        assert message in answers["grpc"], (message, answers)
        assert answers["http"] == answers["grpc"], answers
    client = _client(server, "http")
    item = tritonclient_http.InferInput("observations", list(obs.shape), "FP32")
    item.set_data_from_numpy(obs)
    good = client.infer("cartpole_mlp", [item])  # still serving
    np.testing.assert_array_equal(good.as_numpy("actions_0")[:, 0], outputs["actions_0"][:8])
    client.close()


def test_concurrent_clients_are_batched_and_answered_row_for_row(mlp):
    """Eight clients at once, each with its own rows, over both protocols: every answer is its own
    rows' (the dynamic batcher joins requests; the stand-in splits the run's outputs back)."""
    from concurrent.futures import ThreadPoolExecutor

    out, server = mlp
    inputs, outputs = _golden(out)

    def one(i: int) -> bool:
        protocol = ("http", "grpc")[i % 2]
        client = _client(server, protocol)
        try:
            rows = slice(3 * i, 3 * i + 3)
            value = np.ascontiguousarray(inputs["observations"][rows])
            item = CLIENTS[protocol].InferInput("observations", list(value.shape), "FP32")
            item.set_data_from_numpy(value)
            for _ in range(20):
                got = client.infer("cartpole_mlp", [item])
                if not (np.array_equal(got.as_numpy("actions_0")[:, 0], outputs["actions_0"][rows]) and
                        np.allclose(got.as_numpy("action_dist_inputs"), outputs["action_dist_inputs"][rows],
                                    atol=1e-5)):
                    return False
            return True
        finally:
            client.close()

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(8)))


def test_a_stream_is_passed_through(mlp):
    """``ModelStreamInfer`` (tritonclient's ``start_stream``/``async_stream_infer``) through the gRPC front."""
    import queue

    out, server = mlp
    inputs, outputs = _golden(out)
    answers: queue.Queue = queue.Queue()
    client = _client(server, "grpc")
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(3):
            value = np.ascontiguousarray(inputs["observations"][i:i + 1])
            item = tritonclient_grpc.InferInput("observations", [1, 4], "FP32")
            item.set_data_from_numpy(value)
            client.async_stream_infer("cartpole_mlp", [item], request_id=str(i))
        got = {}
        for _ in range(3):
            result, error = answers.get(timeout=60)
            assert error is None, error
            got[int(result.get_response().id)] = int(result.as_numpy("actions_0")[0, 0])
        assert got == {i: int(outputs["actions_0"][i]) for i in range(3)}
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("name", ["cartpole_mlp", "dict_image_vector", "tuple_action", "cartpole_lstm"])
def test_verify_against_serve(served_exports, name):
    """Feed-forward, Dict observations, Tuple actions and an LSTM (its stepped sequences with the
    state kept by the server) over HTTP and gRPC through serve's fronts, within the export's tolerances."""
    _, out = served_exports(name)
    result = verify_export(out, server="triton", device="cpu")
    assert result.passed, [r.describe() for r in result.parity.failures()] + list(result.parity.errors.items())
    for protocol in ("http", "grpc"):
        rows = [r for r in result.parity.records if r.format.startswith(f"triton-server/{protocol}")]
        assert rows and all(r.passed for r in rows), protocol
        assert {r.key for r in rows} >= {"actions_0", "action_dist_inputs"}
        if name == "cartpole_lstm":
            assert all("stepped" in r.format for r in rows)
        else:
            assert any("explore" in r.format for r in rows)  # the sampling model's draws against the session's
    assert max(r.max_abs_err for r in result.parity.records if r.format.startswith("triton-server/")
               and r.dtype != "samples") <= 1e-5
    assert any("server: Triton" in note and "the export's triton/" in note for note in result.notes)


def test_a_converted_rllib_checkpoint_served(tmp_path):
    """An LSTM policy RLlib 2.9.3 wrote (previous action and reward, MeanStdFilter), converted and
    checked on serve."""
    from policy_export.exporter import convert_checkpoint

    out = tmp_path / "ppo_lstm_prev"
    convert_checkpoint(CHECKPOINTS / "ppo_lstm_prev" / "checkpoint", out, device="cpu", samples=100,
                       explore_samples=1000, stepped_steps=20, formats=FORMATS)
    result = verify_export(out, server="triton", device="cpu")
    assert result.passed, [r.describe() for r in result.parity.failures()]
    assert {"prev_action", "prev_reward"} <= {s.key for s in Contract.from_json(read_manifest(out)["contract"]).inputs}
    assert any(r.format.startswith("triton-server/grpc (stepped") for r in result.parity.records)


def test_serve_writes_the_repository_of_an_export_without_one(tmp_path_factory):
    """An export without the triton format: serve writes the repository ``export --formats triton``
    writes into its workspace (in a process of its own), and serves it; ``model_name`` names it."""
    get = spec_exports(tmp_path_factory, "unserved", {"formats": ["saved_model", "onnx"], "samples": 100})
    _, out = get("cartpole_mlp")
    inputs, outputs = _golden(out)
    with TritonServer.start(out, http_port=free_port(), grpc_port=free_port(), model_name="cp") as server:
        assert server.repository.written and server.repository.path.is_relative_to(server.workspace)
        assert [m.name for m in server.models] == ["cp", "cp_explore"]
        client = _client(server, "grpc")
        value = np.ascontiguousarray(inputs["observations"][:4])
        item = tritonclient_grpc.InferInput("observations", [4, 4], "FP32")
        item.set_data_from_numpy(value)
        np.testing.assert_array_equal(client.infer("cp", [item]).as_numpy("actions_0")[:, 0], outputs["actions_0"][:4])
        client.close()
        workspace = server.workspace
    assert not workspace.exists() and not (out / "triton").exists()


def test_model_name_is_refused_for_an_export_that_has_its_repository(served_exports):
    from policy_export.errors import InputError

    _, out = served_exports("cartpole_mlp")
    with pytest.raises(InputError, match="names its model 'cartpole_mlp'; serve serves it as written"):
        TritonServer.start(out, http_port=free_port(), grpc_port=free_port(), model_name="other")


def _tampered(out: Path, target: Path, model: str, edit) -> Path:
    """A copy of ``out`` whose ``model``'s config is edited by ``edit`` (text -> text), the manifest
    rewritten to match (the attacker may rewrite both)."""
    shutil.copytree(out, target)
    config = target / "triton" / model / "config.pbtxt"
    config.write_text(edit(config.read_text()))
    doc = json.loads((target / "manifest.json").read_text())
    doc["files"] = manifest.file_records(target)
    (target / "manifest.json").write_text(json.dumps(doc, indent=2))
    return target


EXPLORE_SCALAR = 'name: "explore"\n    data_type: TYPE_BOOL\n    dims: [ 1 ]'
OBSERVATIONS = 'name: "observations"\n    data_type: TYPE_FP32\n    dims: [ 4 ]'


@pytest.mark.parametrize("model,edit,message", [
    # Triton's core (model_config_utils.cc ValidateIOShape)
    ("cartpole_mlp_explore", lambda t: t.replace(EXPLORE_SCALAR, EXPLORE_SCALAR + "\n    reshape: { shape: [ ] }"),
     "model input 'explore' cannot have empty reshape for non-batching model"),
    # the ONNX Runtime backend (onnxruntime.cc ValidateInputs, CompareDimsSupported)
    ("cartpole_mlp", lambda t: t.replace(OBSERVATIONS, OBSERVATIONS.replace("[ 4 ]", "[ 5 ]")),
     "model 'cartpole_mlp', tensor 'observations': the model expects 2 dimensions (shape [-1,4]) but the model "
     "configuration specifies 2 dimensions (an initial batch dimension because max_batch_size > 0 followed by the "
     "explicit tensor shape, making complete shape [-1,5])"),
    ("cartpole_mlp", lambda t: t.replace(OBSERVATIONS, OBSERVATIONS.replace("TYPE_FP32", "TYPE_FP64")),
     "unable to load model 'cartpole_mlp', configuration expects datatype TYPE_FP64 for input 'observations', "
     "model provides TYPE_FP32"),
    # (an optional input is left out of the count the backend checks first)
    ("cartpole_mlp", lambda t: t.replace(OBSERVATIONS, OBSERVATIONS + "\n    optional: true"),
     "unable to load model 'cartpole_mlp', configuration expects 0 inputs, model provides 1"),
    # ValidateOutputs: output dims compared exactly
    ("cartpole_mlp_explore", lambda t: t.replace('name: "action_dist_inputs"\n    data_type: TYPE_FP32\n    dims: [ -1, 2 ]',
                                                 'name: "action_dist_inputs"\n    data_type: TYPE_FP32\n    dims: [ -1, -1 ]'),
     "model 'cartpole_mlp_explore', tensor 'action_dist_inputs': the model expects 2 dimensions (shape [-1,2]) but "
     "the model configuration specifies 2 dimensions (shape [-1,-1])"),
])
def test_a_config_the_backend_would_not_load_is_refused_with_its_message(served_exports, tmp_path, model, edit,
                                                                          message):
    """The repository is loaded as written: what Triton's core or its ONNX Runtime backend refuses
    at load, serve refuses with the same message, and nothing is left running."""
    from policy_export.errors import ExportError

    _, out = served_exports("cartpole_mlp")
    bad = _tampered(out, tmp_path / "bad", model, edit)
    assert (bad / "triton" / model / "config.pbtxt").read_text() != (out / "triton" / model / "config.pbtxt").read_text()
    with pytest.raises(ExportError, match="tritonserver refused the repository") as refused:
        TritonServer.start(bad, http_port=free_port(), grpc_port=free_port())
    assert message in str(refused.value), str(refused.value)


@pytest.mark.parametrize("extra,message", [
    # the Python backend would unpack and run this environment: never loaded
    ('parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "/tmp/env.tar.gz" } }', "field parameters"),
    ('model_repository_agents { agents [ { name: "checksum" } ] }', "field model_repository_agents"),
    ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "observations" value: { data_type: TYPE_FP32 '
     'dims: [ 4 ] input_data_file: "../../etc/passwd" } } } ]', "field model_warmup"),
    ('runtime: "model.py"', "field runtime"),
    ("not a config {", "not a Triton model config"),
])
def test_a_repository_config_the_package_did_not_write_is_refused_before_a_server_reads_it(
        served_exports, tmp_path, extra, message):
    from policy_export.errors import InputError
    from policy_export.exporter.serve.repository import RepositoryServer

    _, out = served_exports("cartpole_mlp")
    bad = tmp_path / "triton"
    shutil.copytree(out / "triton", bad)
    config = bad / "cartpole_mlp" / "config.pbtxt"
    config.write_text(config.read_text() + extra + "\n")
    with pytest.raises(InputError, match=message):
        RepositoryServer(bad, read_manifest(out)["formats"]["triton"])


def test_serve_refuses_a_busy_port_and_a_changed_export(served_exports, tmp_path):
    import socket

    from helpers import cli

    _, out = served_exports("cartpole_mlp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        run = cli("serve", str(out), "--port", str(busy), "--grpc-port", str(free_port()))
    assert run.returncode == 2 and f"http port {busy} on 127.0.0.1 is in use" in run.stderr, run.stderr
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    (changed / "triton" / "cartpole_mlp" / "1" / "model.onnx").write_bytes(
        (changed / "triton" / "cartpole_mlp" / "1" / "model.onnx").read_bytes() + b"\0")
    run = cli("serve", str(changed), "--port", str(free_port()), "--grpc-port", str(free_port()))
    assert run.returncode == 2 and "do not match its manifest" in run.stderr and "model.onnx" in run.stderr


def test_the_serve_command_prints_ready_answers_and_stops_on_sigterm(served_exports):
    """The console script: each model as its config declares it, the endpoints, ``ready:``; the
    printed curl-able URL answers; SIGTERM stops the server's processes and removes the workspace."""
    _, out = served_exports("cartpole_mlp")
    http, grpc = free_port(), free_port()
    script = Path(sys.executable).parent / "policy-export"
    proc = subprocess.Popen([str(script), "serve", str(out), "--port", str(http), "--grpc-port", str(grpc)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("ready:"):
                break
        assert lines and lines[-1].startswith("ready:"), (lines, proc.stderr.read() if proc.poll() is not None else "")
        text = " ".join("".join(lines).split())  # (however the terminal's width wrapped the lines)
        assert f"http://127.0.0.1:{http}/v2/models/cartpole_mlp/infer" in text and f"gRPC 127.0.0.1:{grpc}" in text
        assert "model cartpole_mlp (batched, up to 256 rows): inputs observations float32 [-1, 4]" in text
        assert "model cartpole_mlp_explore (not batched)" in text and "explore bool [1] (optional)" in text
        children = descendants(proc.pid)
        assert any(_name(pid) == "tritonserver" for pid in children), children
        inputs, outputs = _golden(out)
        client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{http}")
        value = np.ascontiguousarray(inputs["observations"][:5])
        item = tritonclient_http.InferInput("observations", [5, 4], "FP32")
        item.set_data_from_numpy(value)
        np.testing.assert_array_equal(client.infer("cartpole_mlp", [item]).as_numpy("actions_0")[:, 0],
                                      outputs["actions_0"][:5])
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children), "a server process was left behind"


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


