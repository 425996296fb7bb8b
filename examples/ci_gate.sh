#!/usr/bin/env bash
# A deployment gate: export a candidate, verify it against a pinned manifest, record its
# interface, and diff it against what clients use today. Every step's exit code decides.
#
#   bash examples/ci_gate.sh [OUT_DIR]           # OUT_DIR relative to the checkout; default out/examples
set -euo pipefail
cd "$(dirname "$0")/.."                                        # the checkout: fixtures/ is here
command -v policy-export >/dev/null || PATH="$PWD/.venv/bin:$PATH"
out=${1:-out/examples}/gate
mkdir -p "$out"

# 1. The candidate export (exit 0: every format written and proven; 1: parity failed, nothing
#    written; 4: a format asked for could not be made; 2: bad input).
policy-export export fixtures/cartpole_mlp --out "$out/candidate" --overwrite --quiet \
    --formats saved_model,onnx --samples 200 --explore-samples 1000 > "$out/export.txt"

# 2. The manifest's digest, taken at export time and kept outside the export (in the deployment's
#    config, say), pins it: verify exits 1 if any file or the manifest itself changed, and
#    writes JUnit and JSON reports for the CI.
digest=$(sha256sum "$out/candidate/manifest.json" | cut -d ' ' -f 1)
policy-export verify "$out/candidate" --quiet --expect-manifest-sha256 "$digest" \
    --junit "$out/verify.xml" --report-json "$out/verify.json" > "$out/verify.txt"
tail -n 1 "$out/verify.txt"

# 3. The interface clients program against, as JSON (inputs and outputs: key, dtype, shape,
#    required or default).
policy-export inspect "$out/candidate" --json > "$out/contract.json"
echo "contract written to $out/contract.json"

# 4. Diff against what is deployed. The same contract (here: the export's own model.onnx) is
#    compatible, exit 0.
policy-export diff "$out/candidate" "$out/candidate/model.onnx"

# 5. A policy whose interface changed (Pendulum: 3 observations, a Box action) is breaking, exit 1.
policy-export export fixtures/pendulum_mlp --out "$out/changed" --overwrite --quiet \
    --formats onnx --samples 100 --explore-samples 0 > /dev/null
status=0
policy-export diff "$out/candidate" "$out/changed" || status=$?
echo "diff exit code: $status"
[ "$status" -eq 1 ]                        # a gate fails the build here; the example expects it
