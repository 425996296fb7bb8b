"""The ONNX exports in ONNX Runtime's JavaScript packages, against the TF session's golden outputs.

    npm ci --prefix tests/js                   # onnxruntime-web and onnxruntime-node, as pinned there
    python -m benchmarks.js_clients            # the fixtures below, results in benchmarks/js_results.json

Each fixture (bundled specs, and RLlib checkpoints converted without ray) is exported with
``onnx``, ``onnx_deterministic`` and ``onnx_explore``; then ``tests/js/run_onnx.mjs`` runs
the files in onnxruntime-web on its WebAssembly backend under Node.js and in a headless Chromium
page, and in onnxruntime-node. Per runtime and file: the inputs the session lists, the largest absolute error of
every float output on the export's golden inputs (``model.onnx`` and ``model_deterministic.onnx``
fed their listed inputs, ``model_explore.onnx`` fed every input with ``explore`` false), the
integer outputs that differ,
and for ``model_explore.onnx`` with ``explore`` true the smallest p-value of the two-sample tests
against the session's own draws (``parity/exploration.npz``) beside the threshold it must reach.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
JS_DIR = ROOT / "tests" / "js"
RUNTIMES = ("web", "node", "browser")
# headless Chromium builds, first found on PATH is used ("browser" runs onnxruntime-web's WebAssembly build in it)
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
BROWSER_TIMEOUT_S = 300
# bundled specs, and policies RLlib wrote (``rllib:NAME``: its checkpoint fixtures/rllib/checkpoints/NAME)
FIXTURES = ("cartpole_mlp", "pendulum_mlp", "tuple_action", "dict_image_vector", "cartpole_lstm",
            "rllib:ppo_lstm_prev", "rllib:sac_box", "rllib:dqn", "rllib:ppo_dict_obs")
GOLDEN_ROWS = 64  # rows of the golden inputs sent to JavaScript (an image fixture's rows are large)


def js_missing() -> str | None:
    """Why the JavaScript runtimes cannot run here, or ``None``."""
    if shutil.which("node") is None:
        return "Node.js is not installed"
    missing = [p for p in ("onnxruntime-web", "onnxruntime-node") if not (JS_DIR / "node_modules" / p).is_dir()]
    return f"{', '.join(missing)} not installed (npm ci --prefix tests/js)" if missing else None


def browser() -> str | None:
    """The headless Chromium to run, or ``None``."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def runtime_missing(runtime: str) -> str | None:
    """Why ``runtime`` (``web``, ``node`` or ``browser``) cannot run here, or ``None``."""
    if runtime == "browser" and browser() is None:
        return f"no headless Chromium on PATH ({', '.join(BROWSERS)})"
    return js_missing()


def encode(value) -> dict:
    arr = np.ascontiguousarray(value)
    return {"dtype": str(arr.dtype), "dims": list(arr.shape),
            "data": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()).decode()}


def decode(record: dict) -> np.ndarray:
    little = np.dtype(record["dtype"]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(record["data"]), dtype=little).reshape(record["dims"]).astype(
        little.newbyteorder("="))


def run_js(runtime: str, requests: list[tuple[Path, dict]], work: Path) -> list[dict]:
    """Each (model path, feeds) run in ``runtime``: ``web`` or ``node`` by one Node.js process,
    ``browser`` in a headless Chromium page (:func:`run_browser`); per request ``inputNames``,
    ``outputNames`` and the decoded ``outputs``, or ``error``."""
    if runtime == "browser":
        results = run_browser(requests, work)
    else:
        req, res = work / f"requests_{runtime}.json", work / f"results_{runtime}.json"
        req.write_text(json.dumps([{"model": str(m), "feeds": {k: encode(v) for k, v in f.items()}}
                                   for m, f in requests]))
        done = subprocess.run(["node", str(JS_DIR / "run_onnx.mjs"), runtime, str(req), str(res)],
                              capture_output=True, text=True, timeout=600, cwd=JS_DIR)
        if done.returncode != 0:
            raise RuntimeError(f"node {runtime} failed: {done.stderr[-3000:]}")
        results = json.loads(res.read_text())
    for r in results:
        if "outputs" in r:
            r["outputs"] = {k: decode(v) for k, v in r["outputs"].items()}
    return results


_TYPES = {".html": "text/html", ".mjs": "text/javascript", ".wasm": "application/wasm", ".json": "application/json",
          ".onnx": "application/octet-stream"}


def run_browser(requests: list[tuple[Path, dict]], work: Path, timeout: float = BROWSER_TIMEOUT_S) -> list[dict]:
    """Run the requests in a headless Chromium: a server on 127.0.0.1 serves ``tests/js/browser.html``,
    onnxruntime-web's files, the models and the requests, and takes the page's results (raw, as
    ``client.mjs`` returns them). Only those files are served; the browser's profile lives in ``work``."""
    dist = JS_DIR / "node_modules" / "onnxruntime-web" / "dist"
    files = {"/": JS_DIR / "browser.html", "/js/client.mjs": JS_DIR / "client.mjs",
             **{f"/ort/{p.name}": p for p in dist.iterdir() if p.suffix in (".mjs", ".wasm")},
             **{f"/model/{i}.onnx": Path(m) for i, (m, _) in enumerate(requests)}}
    payload = json.dumps([{"model": f"/model/{i}.onnx", "feeds": {k: encode(v) for k, v in f.items()}}
                          for i, (_, f) in enumerate(requests)]).encode()
    done, posted = threading.Event(), {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            body = payload if path == "/requests.json" else files[path].read_bytes() if path in files else None
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", _TYPES.get(Path(path).suffix or ".html", "application/octet-stream"))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            if self.path != "/results":
                self.send_error(404)
                return
            posted["body"] = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(204)
            self.end_headers()
            done.set()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log = work / "browser.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 f"--user-data-dir={work / 'browser-profile'}",
                                 f"http://127.0.0.1:{server.server_address[1]}/"],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            if not done.wait(timeout):
                raise RuntimeError(f"the browser page posted no results within {timeout:.0f} s "
                                   f"(exit code {proc.poll()}): {log.read_text(errors='replace')[-2000:]}")
        finally:
            # the browser's own processes (zygote, renderer, GPU) too: its whole process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            server.shutdown()
            server.server_close()
    results = json.loads(posted["body"])
    if isinstance(results, dict):
        raise RuntimeError(f"the browser page failed: {results.get('error')}")
    return results


def read_export(out: Path, rows: int = GOLDEN_ROWS):
    """The manifest, the first ``rows`` golden inputs and outputs (signature outputs only)."""
    manifest = json.loads((out / "manifest.json").read_text())
    with np.load(out / "parity" / "inputs.npz") as i, np.load(out / "parity" / "outputs.npz") as o:
        inputs = {k: i[k][:rows] for k in i.files}
        outputs = {k: o[k][:rows] for k in o.files if not k.startswith("base_model/")}
    return manifest, inputs, outputs


def defaults(manifest: dict) -> dict[str, np.ndarray]:
    return {s["key"]: np.asarray(s["default"], dtype=s["dtype"]) for s in manifest["contract"]["inputs"]
            if not s["required"]}


def exploration_probe(out: Path):
    """The probe feeds repeated as parity drew them, the session's draws, and the probe's row count;
    ``None`` for an export that does not sample (no ``explore`` input)."""
    if not (out / "parity" / "exploration.npz").is_file():
        return None
    with np.load(out / "parity" / "exploration.npz") as e:
        probe = {k[len("probe/"):]: e[k] for k in e.files if k.startswith("probe/")}
        per = int(e["draws_per_observation"])
        session = {k[len("session/"):]: e[k] for k in e.files if k.startswith("session/")}
    rows = len(next(iter(probe.values())))
    return {k: np.repeat(v, per, axis=0) for k, v in probe.items()}, session, rows


def errors(got: dict, expected: dict) -> dict[str, float | int]:
    """Per output: the largest absolute error (floats) or the number of differing values (integers)."""
    out = {}
    for key, want in expected.items():
        value = got.get(key)
        if value is None or value.shape != want.shape:
            out[key] = float("nan")
        elif np.issubdtype(want.dtype, np.floating):
            out[key] = float(np.max(np.abs(value.astype(np.float64) - want))) if want.size else 0.0
        else:
            out[key] = int(np.sum(value != want))
    return out


def measure(exports: dict[str, Path], work: Path) -> dict:
    from policy_export.exporter.parity.exploration import compare_samples
    from policy_export.policy.spaces import space_from_json

    rows: dict = {}
    for runtime in RUNTIMES:
        requests, cases = [], []
        for name, out in exports.items():
            manifest, inputs, outputs = read_export(out)
            probe = exploration_probe(out)
            det = manifest["formats"].get("onnx_deterministic")
            requests += [(out / "model.onnx", inputs), (out / "model_explore.onnx", {**inputs, **defaults(manifest)})]
            if det:
                requests.append((out / "model_deterministic.onnx", inputs))
            if probe is not None:
                requests.append((out / "model_explore.onnx", {**probe[0], **defaults(manifest), "explore": np.array(True)}))
            cases.append((name, manifest, outputs, probe, det))
        results = iter(run_js(runtime, requests, work))
        for name, manifest, outputs, probe, det in cases:
            full, plain = next(results), next(results)
            greedy = next(results) if det else None
            sampled = next(results) if probe is not None else {"n/a": "no explore input: the policy does not sample"}
            row = rows.setdefault(name, {})[runtime] = {}
            row["model.onnx"] = {"inputs": full.get("inputNames"), "error": full.get("error"),
                                 "errors": errors(full.get("outputs", {}), outputs)}
            row["model_explore.onnx"] = {"inputs": plain.get("inputNames"), "error": plain.get("error"),
                                         "errors": errors(plain.get("outputs", {}), outputs)}
            if greedy is not None:
                row["model_deterministic.onnx"] = {
                    "inputs": greedy.get("inputNames"), "error": greedy.get("error"),
                    "errors": errors(greedy.get("outputs", {}), {k: outputs[k] for k in det["outputs"]})}
            if "outputs" in sampled:
                checks = compare_samples(runtime, space_from_json(manifest["spaces"]["action"]), probe[2],
                                         probe[1], sampled["outputs"])
                row["explore"] = {"tests": len(checks), "passed": all(c.passed for c in checks),
                                  "min_p": min(c.p_value for c in checks), "threshold": checks[0].threshold}
            else:
                row["explore"] = {k: sampled[k] for k in ("error", "n/a") if k in sampled}
    return rows


def export_all(work: Path) -> dict[str, Path]:
    from policy_export.exporter import convert_checkpoint, export_spec

    made = {}
    for name in FIXTURES:
        made[name] = out = work / name.replace(":", "_")
        if name.startswith("rllib:"):
            convert_checkpoint(ROOT / "fixtures" / "rllib" / "checkpoints" / name[6:] / "checkpoint", out, device="cpu",
                               formats=["onnx", "onnx_deterministic", "onnx_explore"])
        else:
            export_spec(ROOT / "fixtures" / name, out, device="cpu", formats=["onnx", "onnx_deterministic", "onnx_explore"])
    return made


def table(rows: dict) -> str:
    lines = ["| fixture | runtime | model.onnx max float err | model_explore.onnx max float err | "
             "model_deterministic.onnx max float err | integer outputs differing | explore: min p (threshold) |",
             "|---|---|---|---|---|---|---|"]
    for name, per in rows.items():
        for runtime, row in per.items():
            def worst(rec, floats=True):
                if rec is None:
                    return "-"
                vals = [v for v in rec["errors"].values() if isinstance(v, float) == floats]
                return (f"{max(vals):.1e}" if floats else str(sum(vals))) if vals else "-"
            ex, det = row["explore"], row.get("model_deterministic.onnx")
            ints = ", ".join(worst(r, False) for r in (row["model.onnx"], row["model_explore.onnx"], det))
            lines.append(f"| {name} | {runtime} | {worst(row['model.onnx'])} | {worst(row['model_explore.onnx'])} | "
                         f"{worst(det)} | {ints} | "
                         + (f"{ex['min_p']:.2g} ({ex['threshold']:.1g})" if "min_p" in ex else
                            f"n/a: {ex['n/a']}" if "n/a" in ex else f"error: {ex.get('error')}")
                         + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.js_clients", description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "js_results.json")
    args = parser.parse_args(argv)
    reason = js_missing()
    if reason:
        parser.error(reason)
    if browser() is None:
        parser.error(runtime_missing("browser"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = measure(export_all(work), work)
    versions = json.loads((JS_DIR / "package.json").read_text())["dependencies"]
    args.json.write_text(json.dumps({"versions": versions, "rows": rows}, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
