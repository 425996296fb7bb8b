"""``serve`` and ``verify --server triton`` on a real Triton server (PyTriton's ``tritonserver``,
the ``serve`` extra), through Triton's own HTTP and gRPC clients.

Skipped where the extra is not installed. CI runs them in an environment of their own
(``pip install ".[test,serve]"``), where PyTriton keeps numpy below 2.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES_DIR, spec_exports

pytest.importorskip("pytriton", reason="PyTriton is not installed (the serve extra: pip install '.[serve]')")
tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from policy_export.exporter.manifest import read_manifest  # noqa: E402
from policy_export.exporter.serve.client import TritonClientRunner  # noqa: E402
from policy_export.exporter.serve.server import TritonServer, free_port  # noqa: E402
from policy_export.exporter.verify import verify_export  # noqa: E402
from policy_export.signatures.contract import Contract  # noqa: E402

pytestmark = pytest.mark.serve
FORMATS = ["saved_model", "onnx", "triton"]
CHECKPOINTS = FIXTURES_DIR / "rllib" / "checkpoints"


@pytest.fixture(scope="module")
def served_exports(tmp_path_factory):
    return spec_exports(tmp_path_factory, "served", {"formats": FORMATS, "samples": 200, "explore_samples": 2000})


def _server_rows(result, protocol: str) -> dict[str, float]:
    return {r.key: r.max_abs_err for r in result.parity.records if r.format.startswith(f"triton-server/{protocol}")
            and r.dtype != "samples"}


@pytest.mark.parametrize("name", ["cartpole_mlp", "dict_image_vector", "tuple_action", "cartpole_lstm"])
def test_verify_against_a_live_triton_server(served_exports, name):
    """Feed-forward, Dict observations, Tuple actions and an LSTM (its stepped sequences carried by
    the client through state_in/state_out) over HTTP and gRPC, within the export's tolerances."""
    _, out = served_exports(name)
    result = verify_export(out, server="triton", device="cpu")
    assert result.passed, [r.describe() for r in result.parity.failures()] + list(result.parity.errors.items())
    contract = Contract.from_json(read_manifest(out)["contract"])
    for protocol in ("http", "grpc"):
        rows = [r for r in result.parity.records if r.format.startswith(f"triton-server/{protocol}")]
        assert {r.key for r in rows} >= set(contract.output_keys), (protocol, sorted({r.key for r in rows}))
        assert all(r.passed for r in rows)
        if name == "cartpole_lstm":
            assert any("stepped" in r.format for r in rows)
        assert any("explore" in r.format for r in rows)  # the sampling model's draws against the session's
    errors = _server_rows(result, "grpc")
    assert 0 <= max(errors.values()) <= 1e-5
    assert any("server: Triton" in note for note in result.notes)
    # the written triton/ repository on tritonserver itself (Python backend standing in for ONNX Runtime's)
    for protocol in ("http", "grpc"):
        rows = [r for r in result.parity.records if r.format.startswith(f"triton-repository/{protocol}")]
        assert rows and all(r.passed for r in rows), protocol
        if name == "cartpole_lstm":  # the sequence batcher, START and the state kept per sequence
            assert all("stepped" in r.format for r in rows)
            assert {r.key for r in rows} >= {"actions_0", "action_dist_inputs"}
        else:
            assert {r.key for r in rows} >= {"actions_0", "action_dist_inputs"}
    assert any("tritonserver loaded" in note for note in result.notes)


def test_a_converted_rllib_checkpoint_served(tmp_path):
    """An LSTM policy RLlib 2.9.3 wrote (previous action and reward, MeanStdFilter), converted and
    checked on the live server."""
    from policy_export.exporter import convert_checkpoint

    out = tmp_path / "ppo_lstm_prev"
    convert_checkpoint(CHECKPOINTS / "ppo_lstm_prev" / "checkpoint", out, device="cpu", samples=100,
                       explore_samples=1000, stepped_steps=20, formats=FORMATS)
    result = verify_export(out, server="triton", device="cpu")
    assert result.passed, [r.describe() for r in result.parity.failures()]
    assert {"prev_action", "prev_reward"} <= {s.key for s in Contract.from_json(read_manifest(out)["contract"]).inputs}
    assert max(_server_rows(result, "http").values()) <= 1e-5
    assert any(r.format.startswith("triton-repository/grpc (stepped") for r in result.parity.records)


def test_tritonserver_applies_its_own_load_rules_to_a_repository(served_exports, tmp_path):
    """The real server refuses what Triton refuses: an empty reshape of a scalar input in a model
    that does not batch (the rule the written configs follow), named from the server's log."""
    import shutil

    from policy_export.errors import ExportError
    from policy_export.exporter.serve.repository import RepositoryServer

    _, out = served_exports("cartpole_mlp")
    bad = tmp_path / "triton"
    shutil.copytree(out / "triton", bad)
    config = bad / "cartpole_mlp_explore" / "config.pbtxt"
    text = config.read_text()
    assert 'name: "explore"\n    data_type: TYPE_BOOL\n    dims: [ 1 ]' in text
    config.write_text(text.replace('name: "explore"\n    data_type: TYPE_BOOL\n    dims: [ 1 ]',
                                   'name: "explore"\n    data_type: TYPE_BOOL\n    dims: [ 1 ]\n    reshape: { shape: [ ] }'))
    info = read_manifest(out)["formats"]["triton"]
    with pytest.raises(ExportError, match="cannot have empty reshape for non-batching model"):
        with RepositoryServer(bad, info):
            pass
    with RepositoryServer(out / "triton", info) as server:  # the repository as written loads
        assert sorted(server.models) == ["cartpole_mlp", "cartpole_mlp_explore"]


@pytest.mark.parametrize("extra,message", [
    # the Python backend would unpack and run this environment: never loaded
    ('parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "/tmp/env.tar.gz" } }', "field parameters"),
    ('model_repository_agents { agents [ { name: "checksum" } ] }', "field model_repository_agents"),
    ('model_warmup [ { name: "w" batch_size: 1 inputs { key: "observations" value: { data_type: TYPE_FP32 '
     'dims: [ 4 ] input_data_file: "../../etc/passwd" } } } ]', "field model_warmup"),
    ("not a config {", "not a Triton model config"),
])
def test_a_repository_config_the_package_did_not_write_is_refused_before_a_server_reads_it(
        served_exports, tmp_path, extra, message):
    import shutil

    from policy_export.errors import InputError
    from policy_export.exporter.serve.repository import RepositoryServer

    _, out = served_exports("cartpole_mlp")
    bad = tmp_path / "triton"
    shutil.copytree(out / "triton", bad)
    config = bad / "cartpole_mlp" / "config.pbtxt"
    config.write_text(config.read_text() + extra + "\n")
    with pytest.raises(InputError, match=message):
        RepositoryServer(bad, read_manifest(out)["formats"]["triton"])


@pytest.fixture(scope="module")
def live(served_exports):
    _, out = served_exports("cartpole_mlp")
    with TritonServer.start(out, http_port=free_port(), grpc_port=free_port(), max_batch_size=16) as server:
        yield out, server


def _golden(out: Path):
    with np.load(out / "parity" / "inputs.npz") as inputs, np.load(out / "parity" / "outputs.npz") as outputs:
        return {k: inputs[k] for k in inputs.files}, {k: outputs[k] for k in outputs.files}


def _request(client, model: str, name: str, value: np.ndarray, datatype: str):
    item = tritonclient_http.InferInput(name, list(value.shape), datatype)
    item.set_data_from_numpy(value)
    return client.infer(model, [item])


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(live):
    out, server = live
    inputs, outputs = _golden(out)
    obs = inputs["observations"][:8]
    client = tritonclient_http.InferenceServerClient(server.endpoints()["http"])
    cases = [
        ("policy", "observations", obs.astype(np.float64), "FP64", "data-type is 'FP64', but model 'policy' expects 'FP32'"),
        ("policy", "observations", obs[:, :3].copy(), "FP32", "unexpected shape for input 'observations'"),
        ("policy", "observations", np.zeros((17, 4), np.float32), "FP32", "batch-size must be <= 16"),
        ("policy", "obs", obs, "FP32", "unexpected inference input 'obs'"),
        ("nope", "observations", obs, "FP32", "unknown model"),
        # the sampling model does not batch: the row limit is the package's own, with the reason
        ("policy_explore", "observations", np.zeros((17, 4), np.float32), "FP32", "17 rows in one request"),
    ]
    for model, name, value, datatype, message in cases:
        with pytest.raises(InferenceServerException, match=message):
            _request(client, model, name, value, datatype)
    good = _request(client, "policy", "observations", np.ascontiguousarray(obs), "FP32")  # still serving
    np.testing.assert_array_equal(good.as_numpy("actions_0").reshape(-1), outputs["actions_0"][:8])
    np.testing.assert_allclose(good.as_numpy("action_dist_inputs"), outputs["action_dist_inputs"][:8], atol=1e-5)
    client.close()


def test_concurrent_clients_are_batched_and_answered_row_for_row(live):
    """Eight clients at once, each with its own rows: every answer is its own rows' (the dynamic
    batcher joins requests; the server splits the engine's outputs back)."""
    from concurrent.futures import ThreadPoolExecutor

    out, server = live
    inputs, outputs = _golden(out)
    contract = Contract.from_json(read_manifest(out)["contract"])

    def one(i: int) -> bool:
        with TritonClientRunner(server.endpoints()["grpc"], "grpc", server.models, contract) as runner:
            rows = slice(3 * i, 3 * i + 3)
            got = runner({"observations": inputs["observations"][rows]})
            return bool(np.array_equal(got["actions_0"], outputs["actions_0"][rows])
                        and np.allclose(got["action_dist_inputs"], outputs["action_dist_inputs"][rows], atol=1e-5))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(8)))


def test_serve_refuses_a_busy_port_and_a_changed_export(served_exports, tmp_path):
    from helpers import cli

    _, out = served_exports("cartpole_mlp")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        run = cli("serve", str(out), "--port", str(busy), "--grpc-port", str(free_port()))
    assert run.returncode == 2 and f"http port {busy} on 127.0.0.1 is in use" in run.stderr, run.stderr
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    (changed / "model.onnx").write_bytes((changed / "model.onnx").read_bytes() + b"\0")
    run = cli("serve", str(changed), "--port", str(free_port()), "--grpc-port", str(free_port()))
    assert run.returncode == 2 and "do not match its manifest" in run.stderr and "model.onnx" in run.stderr


def _servers_on(port: int) -> list[str]:
    """The tritonserver processes with gRPC on ``port`` (HTTP goes through the front, the server's
    own HTTP endpoint is on a private port)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "tritonserver" in line and f"--grpc-port={port}" in line
            or "tritonserver" in line and f"--grpc-port {port}" in line]


def test_the_serve_command_prints_ready_answers_and_stops_on_sigterm(served_exports):
    _, out = served_exports("cartpole_mlp")
    http, grpc = free_port(), free_port()
    script = Path(sys.executable).parent / "policy-export"
    proc = subprocess.Popen([str(script), "serve", str(out), "--port", str(http), "--grpc-port", str(grpc)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        assert any(f"http://127.0.0.1:{http}/v2/models/policy/infer" in line for line in lines)
        assert _servers_on(grpc), "no tritonserver process on the port"
        inputs, outputs = _golden(out)
        client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{http}")
        got = _request(client, "policy", "observations", np.ascontiguousarray(inputs["observations"][:5]), "FP32")
        np.testing.assert_array_equal(got.as_numpy("actions_0").reshape(-1), outputs["actions_0"][:5])
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while _servers_on(grpc) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _servers_on(grpc), "a tritonserver process was left behind"
