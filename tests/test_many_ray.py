"""``export-many``/``verify-many`` on a real Ray cluster: a local one on 127.0.0.1 that this module
starts (``ray start --head --block``) and stops itself, shared by every test. With a Ray that has
token authentication (2.52 and later) the cluster requires a token of its own, which the tests'
drivers find as a user's would (``RAY_AUTH_TOKEN_PATH``; ``RAY_AUTH_MODE`` left unset)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray executor needs ray (pip install 'policy-export[ray]')")

from conftest import FIXTURES_DIR  # noqa: E402

from policy_export.exporter import formats, manifest  # noqa: E402
from policy_export.exporter.many import export_many, verify_many  # noqa: E402
from policy_export.exporter.many.jobs import STATE_DIR  # noqa: E402
from policy_export.exporter.many.ray_pool import TASK_NAME, _auth_available  # noqa: E402

BIN = Path(sys.executable).parent
QUICK = dict(samples=100, explore_samples=500, formats=["saved_model", "onnx"])
POLICIES = 4  # twice the test cluster's CPUs: tasks queue, and each still gets a worker of its own
TITLE = f"ray::{TASK_NAME}".encode()
AUTH = _auth_available()
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """Stop the cluster this module started: its ``ray start --block`` and every process of its group."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=20)


@pytest.fixture(scope="module")
def address():
    """``127.0.0.1:PORT`` of a 2-CPU Ray head node started for this module (its own temp dir); with
    token authentication on, its token is in a file of that dir, named by ``RAY_AUTH_TOKEN_PATH``
    in this process while the module runs."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must stay under 107 bytes
    log = open(Path(temp) / "start.log", "w+")
    command = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
               f"--ray-client-server-port={_free_port()}", "--num-cpus=2", "--include-dashboard=false",
               "--disable-usage-stats", f"--temp-dir={temp}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in AUTH_VARS}
    saved = {k: os.environ.pop(k) for k in AUTH_VARS if k in os.environ}
    if AUTH:
        token = Path(temp) / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in (Path(temp) / "start.log").read_text():
            assert process.poll() is None and time.monotonic() < deadline, (Path(temp) / "start.log").read_text()
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(process)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        for name in AUTH_VARS:  # as before the module (connecting may have set RAY_AUTH_MODE=token)
            os.environ.pop(name, None)
        os.environ.update(saved)
        if AUTH:
            from ray._raylet import Config

            Config.initialize("")


def _copies(tmp: Path, count: int) -> list[Path]:
    """``count`` small policies, alternately copies of cartpole_mlp and pendulum_mlp, each its own name."""
    out = []
    for i in range(count):
        out.append(tmp / f"p{i}")
        shutil.copytree(FIXTURES_DIR / ("cartpole_mlp" if i % 2 == 0 else "pendulum_mlp"), out[-1])
    return out


def _task_pids() -> list[int]:
    """The pids of the processes running a policy's Ray task right now (their title: ray::policy_export_job)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(TITLE):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _wait_no_tasks(limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while _task_pids():
        assert time.monotonic() < deadline, f"tasks still running: {_task_pids()}"
        time.sleep(0.2)


def _assert_whole(root: Path, names: list[str], address: str) -> None:
    for name in names:
        manifest = json.loads((root / name / "manifest.json").read_text())
        assert manifest["files"], name
    verified = verify_many(root, ray=address, progress=lambda line: None)
    assert verified.passed, verified.results
    assert sorted(r["name"] for r in verified.results) == sorted(names)
    assert all(r["status"] == "passed" and r["kind"] == "verify" for r in verified.results)


def test_export_many_on_ray_exports_and_verifies_every_policy(tmp_path, address):
    sources = _copies(tmp_path / "src", POLICIES)
    lines: list[str] = []
    result = export_many(sources, tmp_path / "out", ray=address, progress=lines.append, **QUICK)
    assert result.passed and result.failed == [], result.results
    assert [r["name"] for r in result.results] == [f"p{i}" for i in range(POLICIES)]
    assert {r["status"] for r in result.results} == {"passed"}
    assert all(r["attempts"] == 1 and r["max_error"] is not None and r["max_error"] < 1e-3 for r in result.results)
    # each policy ran in a process of its own: distinct worker pids, none of them the driver's
    pids = {r["pid"] for r in result.results}
    assert len(pids) == POLICIES and os.getpid() not in pids
    for name in (f"p{i}" for i in range(POLICIES)):
        assert (tmp_path / "out" / name / "manifest.json").is_file()
        assert (tmp_path / "out" / STATE_DIR / f"{name}.json").is_file()
    executor = result.executor
    assert executor["executor"] == "ray" and executor["ray_version"] == ray.__version__
    assert executor["address"] == address and executor["gcs_address"].endswith(address[address.rindex(":"):])
    assert executor["cluster"]["cpus"] == 2.0 and executor["parallel"] == 2 and executor["nodes"] == 1
    assert executor["task"] == {"num_cpus": 1, "memory_mb": None, "max_calls": 1, "timeout_s": 1800.0}
    assert executor["retries"] == 3
    assert any(f"{POLICIES}/{POLICIES} done" in line for line in lines)
    assert json.loads(json.dumps(result.to_json()))  # the report, executor included, is plain JSON
    # and each of those processes exited when its policy was done (max_calls=1): nothing is reused
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        time.sleep(0.2)
    _assert_whole(tmp_path / "out", [f"p{i}" for i in range(POLICIES)], address)
    assert not ray.is_initialized()  # the pool disconnected when it was done


def test_the_driver_connects_without_tensorflow_and_reports_the_cluster(address):
    code = ("import json, sys; from policy_export.exporter.many.ray_pool import RayPool; "
            f"pool = RayPool({address!r}, memory_mb=256); d = pool.describe(); pool.close(); "
            "print(json.dumps({'describe': d, 'tf': 'tensorflow' in sys.modules}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tf"] is False
    assert out["describe"]["task"] == {"num_cpus": 1, "memory_mb": 256, "max_calls": 1, "timeout_s": None}
    assert out["describe"]["nodes"] == 1 and out["describe"]["cluster"]["memory_mb"] > 0


def test_no_cluster_at_the_address_is_an_input_error():
    from policy_export.errors import InputError
    from policy_export.exporter.many.ray_pool import RayPool

    with pytest.raises(InputError, match="ray start --head"):
        RayPool(f"127.0.0.1:{_free_port()}")
    assert not ray.is_initialized()


def test_ctrl_c_in_the_driver_cancels_the_running_tasks(tmp_path, address):
    from policy_export.exporter.many.jobs import expand
    from policy_export.exporter.many.ray_pool import RayPool, connect

    jobs = expand(_copies(tmp_path / "src", 2), tmp_path / "out", QUICK)
    connect(address)  # connected already (its token too, if it wants one): the pool must leave it connected
    try:
        pool, running = RayPool(address), []

        def interrupt_once_running(job, attempt):
            if job.name == jobs[-1].name:
                deadline = time.monotonic() + 60
                while not running:
                    assert time.monotonic() < deadline
                    running.extend(_task_pids())
                    time.sleep(0.05)
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            pool.run(jobs, interrupt_once_running, lambda result: pytest.fail(f"no result expected: {result}"))
        assert ray.is_initialized() and running
        _wait_no_tasks(limit=15)  # cancelled (force): their processes are gone while the driver stays connected
    finally:
        ray.shutdown()
    assert not list((tmp_path / "out").glob(f"{STATE_DIR}/*.json"))


def test_a_worker_killed_mid_task_is_retried_in_a_new_process(tmp_path, address):
    sources = _copies(tmp_path / "src", 2)
    killed: list[int] = []

    def kill_first_task() -> None:
        deadline = time.monotonic() + 120
        while not killed and time.monotonic() < deadline:
            pids = _task_pids()
            if pids:
                time.sleep(1.0)  # well into the policy's work
                if pids[0] in _task_pids():
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_task, daemon=True)
    killer.start()
    lines: list[str] = []
    result = export_many(sources, tmp_path / "out", ray=address, progress=lines.append, **QUICK)
    killer.join(timeout=5)
    assert len(killed) == 1
    assert result.passed, result.results
    retried = [r for r in result.results if r["attempts"] == 2]
    assert len(retried) == 1 and all(r["attempts"] == 1 for r in result.results if r not in retried)
    assert retried[0]["status"] == "passed" and retried[0]["pid"] != killed[0]
    assert any(f"{retried[0]['name']}: started (attempt 2)" in line for line in lines)
    _assert_whole(tmp_path / "out", [r["name"] for r in result.results], address)


def test_a_broken_policy_fails_with_its_reason_and_the_others_pass(tmp_path, address):
    sources = _copies(tmp_path / "src", 2)
    broken = tmp_path / "src" / "broken"
    shutil.copytree(FIXTURES_DIR / "cartpole_mlp", broken)
    weights = broken / "weights.h5"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated
    result = export_many([sources[0], broken, sources[1]], tmp_path / "out", ray=address,
                         progress=lambda line: None, **QUICK)
    assert result.failed == ["broken"]
    by_name = {r["name"]: r for r in result.results}
    assert by_name["p0"]["status"] == by_name["p1"]["status"] == "passed"
    bad = by_name["broken"]
    assert bad["status"] == "failed" and bad["attempts"] == 1  # a policy's own problem is not retried
    assert bad["failures"][0].startswith(f"WeightsError: cannot use weights from {weights}: not a readable HDF5"), bad
    assert not (tmp_path / "out" / STATE_DIR / "broken.json").exists()


def _driver(sources: list[Path], root: Path, address: str, log, env: dict | None = None) -> subprocess.Popen:
    options = ["--samples", str(QUICK["samples"]), "--explore-samples", str(QUICK["explore_samples"]),
               "--formats", ",".join(QUICK["formats"])]
    script = BIN / "policy-export"
    if script.exists():
        command = [str(script), "export-many", *map(str, sources), "--out", str(root), "--ray", address, *options]
    else:
        code = (f"from policy_export.exporter.many import export_many; export_many({list(map(str, sources))!r}, "
                f"{str(root)!r}, ray={address!r}, **{QUICK!r})")
        command = [sys.executable, "-c", code]
    env = {**(os.environ if env is None else env), "RAY_ADDRESS": address}
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.mark.skipif(not AUTH, reason=f"ray {ray.__version__} has no token authentication (Ray 2.52 and later)")
@pytest.mark.parametrize("token", ["wrong", "none"])
def test_a_cluster_refusing_the_drivers_token_is_an_input_error_that_never_shows_it(tmp_path, address, token):
    wrong = f"not-the-cluster-token-{secrets.token_hex(8)}"
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    if token == "wrong":
        env["RAY_AUTH_TOKEN"] = wrong
    else:  # no token anywhere: none in the environment, and a home without ~/.ray/auth_token
        env["HOME"] = str(tmp_path)
    with open(tmp_path / "driver.log", "w") as log:
        driver = _driver(_copies(tmp_path / "src", 1), tmp_path / "out", address, log, env=env)
        driver.wait(timeout=120)
    output = (tmp_path / "driver.log").read_text()
    assert driver.returncode == 2, output
    assert "refused the connection: authentication" in output, output
    assert "RAY_AUTH_TOKEN" in output and "ray get-auth-token" in output, output
    assert ("does not accept the token" if token == "wrong" else "no token was found") in output, output
    assert "no Ray cluster" not in output and "Traceback" not in output, output
    assert wrong not in output and wrong[-16:] not in output
    assert Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text().strip() not in output
    assert not (tmp_path / "out" / "p0").exists()


def test_a_killed_driver_rerun_skips_what_is_done(tmp_path, address):
    sources = _copies(tmp_path / "src", 4)
    root = tmp_path / "out"
    with open(tmp_path / "driver.log", "w") as log:
        driver = _driver(sources, root, address, log)
        try:
            deadline = time.monotonic() + 120
            while not list((root / STATE_DIR).glob("*.json")):
                assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()
                time.sleep(0.05)
        finally:
            driver.kill()
            driver.wait(timeout=30)
    assert driver.returncode == -signal.SIGKILL
    _wait_no_tasks()  # the cluster ends a dead driver's tasks
    done = sorted(p.stem for p in (root / STATE_DIR).glob("*.json"))
    assert 1 <= len(done) < 4, done
    result = export_many(sources, root, ray=address, progress=lambda line: None, **QUICK)
    assert result.passed, result.results
    statuses = {r["name"]: r["status"] for r in result.results}
    assert sorted(n for n, s in statuses.items() if s == "skipped") == done
    assert all(s == "passed" for n, s in statuses.items() if n not in done)
    for name in statuses:  # every export whole: its files match the hashes of its manifest
        assert not manifest.check_files(root / name, manifest.read_manifest(root / name), formats.paths()).problems


def test_a_policy_past_its_time_limit_is_ended_by_its_worker_and_fails(tmp_path, address):
    start = time.monotonic()
    result = export_many(_copies(tmp_path / "src", 1), tmp_path / "out", ray=address, policy_timeout=1.0,
                         progress=lambda line: None, **QUICK)
    [only] = result.results
    assert only["status"] == "failed" and only["attempts"] == 1, only  # the policy's failure: not retried
    assert "over the time limit of 1 s per policy" in only["failures"][0], only
    assert result.executor["task"]["timeout_s"] == 1.0
    assert not (tmp_path / "out" / "p0" / "manifest.json").exists()
    _wait_no_tasks(limit=15)
    assert time.monotonic() - start < 60
