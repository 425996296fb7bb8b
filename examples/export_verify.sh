#!/usr/bin/env bash
# Export the bundled CartPole policy and verify the export.
#
#   bash examples/export_verify.sh [OUT_DIR]     # OUT_DIR relative to the checkout; default out/examples
set -euo pipefail
cd "$(dirname "$0")/.."                                        # the checkout: fixtures/ is here
command -v policy-export >/dev/null || PATH="$PWD/.venv/bin:$PATH"
out=${1:-out/examples}

# Without --formats every default format is written (saved_model, frozen_graph, onnx,
# onnx_deterministic, keras) and parity draws 1,000 samples; two formats and fewer samples keep
# this example quick. The export lands only when every format has passed parity (exit 0).
policy-export export fixtures/cartpole_mlp --out "$out/cartpole_mlp" --overwrite \
    --formats saved_model,onnx --samples 200 --explore-samples 1000

# Check every file against the manifest, then replay the stored parity plan on each format
# loaded fresh from disk: exit 0 and "every format matches", or exit 1 naming what failed.
policy-export verify "$out/cartpole_mlp"
