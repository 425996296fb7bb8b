"""The ONNX exports as JavaScript clients run them: onnxruntime-web on its WebAssembly backend,
under Node.js and in a headless Chromium page, and onnxruntime-node (``tests/js/``, driven by
``benchmarks/js_clients.py``).

Those packages feed only the inputs a session lists, so ``model.onnx``'s optional inputs (ONNX
initializers that may be overridden) cannot be fed from JavaScript; ``model_explore.onnx`` (the
``onnx_explore`` format) lists every input. The expectations come from each export's own files
(``manifest.json``, ``parity/*.npz``). The JavaScript tests skip where Node.js, the packages
(``npm ci --prefix tests/js``) or, for the browser, a headless Chromium are missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from benchmarks.js_clients import RUNTIMES, defaults, exploration_probe, read_export as read, run_js, runtime_missing
from conftest import FIXTURES_DIR

# bundled specs, and policies RLlib wrote (its checkpoints, converted without ray)
EXPLORE_FIXTURES = ["cartpole_mlp", "pendulum_mlp", "tuple_action", "dict_image_vector", "cartpole_lstm",
                    "rllib:ppo_lstm_prev", "rllib:sac_box", "rllib:dqn", "rllib:ppo_dict_obs"]

# web: onnxruntime-web (WebAssembly) under Node.js; node: onnxruntime-node; browser: onnxruntime-web in headless Chromium
JS_RUNTIMES = [pytest.param(r, marks=pytest.mark.skipif(runtime_missing(r) is not None, reason=str(runtime_missing(r))))
               for r in RUNTIMES]


def assert_close(manifest: dict, got: dict, expected: dict, keys: list[str], who: str) -> None:
    tol = manifest["tolerances"]
    for key in keys:
        value, want = got[key], expected[key]
        assert value.shape == want.shape and value.dtype == want.dtype, \
            f"{who} {key}: {value.dtype}{list(value.shape)}, golden {want.dtype}{list(want.shape)}"
        t = tol["per_output"].get(key, tol["default"])
        if np.issubdtype(value.dtype, np.floating):
            np.testing.assert_allclose(value, want, atol=t["atol"], rtol=t["rtol"], err_msg=f"{who} {key}")
        else:
            np.testing.assert_array_equal(value, want, err_msg=f"{who} {key}")


@pytest.fixture(scope="module")
def explore_exports(tmp_path_factory):
    """``explore_exports(name)`` -> the path of an export of ``model.onnx`` and ``model_explore.onnx``
    (``rllib:NAME``: RLlib's checkpoint ``fixtures/rllib/checkpoints/NAME``)."""
    from policy_export.exporter import convert_checkpoint, export_spec

    base, cache = tmp_path_factory.mktemp("explore_exports"), {}

    def get(name: str) -> Path:
        if name not in cache:
            out = base / name.replace(":", "_")
            options = dict(device="cpu", formats=["onnx", "onnx_deterministic", "onnx_explore"], samples=200, stepped_steps=20)
            if name.startswith("rllib:"):
                convert_checkpoint(FIXTURES_DIR / "rllib" / "checkpoints" / name[6:] / "checkpoint", out, **options)
            else:
                export_spec(FIXTURES_DIR / name, out, **options)
            cache[name] = out
        return cache[name]

    return get


# ---------------------------------------------------------------------------- the file, in ONNX Runtime


@pytest.mark.parametrize("name", ["cartpole_mlp", "cartpole_lstm", "rllib:ppo_lstm_prev"])
def test_model_explore_lists_every_input_and_samples(explore_exports, name):
    out = explore_exports(name)
    manifest, inputs, outputs = read(out)
    contract = manifest["contract"]
    optional = defaults(manifest)
    assert optional, "the fixture should have optional inputs"
    so = ort.SessionOptions()
    so.log_severity_level = 3
    session = ort.InferenceSession(str(out / "model_explore.onnx"), so, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [s["key"] for s in contract["inputs"]]
    assert session.get_overridable_initializers() == []
    plain = json.loads(session.get_modelmeta().custom_metadata_map["policy_export.contract"])
    assert all(s["required"] for s in plain["inputs"]) and plain["outputs"] == contract["outputs"]
    record = manifest["formats"]["onnx_explore"]
    assert record["plain_inputs"] == list(optional)
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, {**inputs, **optional})))
    assert_close(manifest, got, outputs, names, "model_explore.onnx")
    sampled = dict(zip(names, session.run(names, {**inputs, **optional, "explore": np.array(True)})))
    assert not np.array_equal(sampled["actions_0"], outputs["actions_0"]), "explore=True gave the deterministic actions"
    missing = {k: v for k, v in optional.items() if k != "explore"}
    with pytest.raises(Exception, match="explore"):
        session.run(names, {**inputs, **missing})
    explored = manifest["parity"]["max_abs_err"]
    assert any(k.startswith("onnx_explore (explore)") for k in explored), sorted(explored)


# ---------------------------------------------------------------------------- JavaScript


@pytest.mark.parametrize("runtime", JS_RUNTIMES)
def test_js_runs_model_onnx_on_the_required_inputs(explore_exports, runtime, tmp_path):
    """Every fixture's model.onnx (and model_deterministic.onnx, where the policy has one) in
    JavaScript: the session lists the contract's required inputs, and fed those gives the golden
    (deterministic) outputs within the export's tolerances."""
    cases, requests = [], []
    for name in EXPLORE_FIXTURES:
        out = explore_exports(name)
        manifest, inputs, outputs = read(out)
        det = manifest["formats"].get("onnx_deterministic")
        cases.append((name, manifest, outputs, det))
        requests += [(out / "model.onnx", inputs)] + ([(out / "model_deterministic.onnx", inputs)] if det else [])
    assert all(c[3] is not None for c in cases), "each of these policies has a deterministic model"
    results = iter(run_js(runtime, requests, tmp_path))
    for name, manifest, outputs, det in cases:
        result = next(results)
        assert "error" not in result, f"{name}: {result.get('error')}"
        required = [s["key"] for s in manifest["contract"]["inputs"] if s["required"]]
        assert result["inputNames"] == required, name
        assert sorted(result["outputNames"]) == sorted(s["key"] for s in manifest["contract"]["outputs"]), name
        assert_close(manifest, result["outputs"], outputs, list(outputs), f"{runtime} {name} model.onnx")
        if det:
            result = next(results)
            assert "error" not in result, f"{name} model_deterministic.onnx: {result.get('error')}"
            assert result["inputNames"] == det["inputs"] and result["outputNames"] == det["outputs"], name
            assert_close(manifest, result["outputs"], outputs, det["outputs"], f"{runtime} {name} model_deterministic.onnx")


@pytest.mark.parametrize("runtime", JS_RUNTIMES)
def test_js_samples_with_model_explore(explore_exports, runtime, tmp_path):
    """model_explore.onnx in JavaScript: every contract input listed; explore false gives the golden
    outputs; explore true samples from the session's distribution (the package's two-sample tests
    against the session's own draws in parity/exploration.npz)."""
    from policy_export.exporter.parity.exploration import compare_samples
    from policy_export.policy.spaces import space_from_json

    requests, expected = [], []
    for name in EXPLORE_FIXTURES:
        out = explore_exports(name)
        manifest, inputs, outputs = read(out)
        probe = exploration_probe(out)
        requests.append((out / "model_explore.onnx", {**inputs, **defaults(manifest)}))
        if probe is None:
            assert "explore" not in defaults(manifest), f"{name}: an explore input but no exploration plan"
        else:
            requests.append((out / "model_explore.onnx", {**probe[0], **defaults(manifest), "explore": np.array(True)}))
        expected.append((name, manifest, outputs, probe))
    assert sum(p is not None for *_, p in expected) >= 6, "most of these policies sample"
    results = iter(run_js(runtime, requests, tmp_path))
    for name, manifest, outputs, probe in expected:
        golden = next(results)
        assert "error" not in golden, f"{name}: {golden['error']}"
        assert golden["inputNames"] == [s["key"] for s in manifest["contract"]["inputs"]], name
        assert_close(manifest, golden["outputs"], outputs, list(outputs), f"{runtime} {name} model_explore.onnx")
        if probe is None:
            continue
        sampled = next(results)
        assert "error" not in sampled, f"{name}: {sampled['error']}"
        checks = compare_samples(f"{runtime} {name}", space_from_json(manifest["spaces"]["action"]), probe[2], probe[1],
                                 sampled["outputs"])
        assert checks and all(c.passed for c in checks), [c.describe() for c in checks if not c.passed]


def test_verify_refuses_a_candidate_whose_inputs_javascript_cannot_feed(explore_exports, exports, capsys):
    from policy_export.exporter.cli import main

    out = explore_exports("cartpole_mlp")
    assert main(["verify", str(out), "--candidate", f"onnx_explore={out / 'model_explore.onnx'}", "-q"]) == 0
    _, without = exports("cartpole_mlp")  # the same policy, exported without the format
    assert "onnx_explore" not in json.loads((without / "manifest.json").read_text())["formats"]
    assert main(["verify", str(without), "--candidate", f"onnx_explore={out / 'model_explore.onnx'}", "-q"]) == 0
    assert main(["verify", str(out), "--candidate", f"onnx_explore={out / 'model.onnx'}", "-q"]) == 1
    captured = capsys.readouterr()
    assert "inputs ['explore', 'is_training', 'timestep'] are initializers holding defaults" in captured.out + captured.err
