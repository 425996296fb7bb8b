#!/usr/bin/env bash
# Convert a checkpoint RLlib wrote (algo.save) into a verified export, without ray installed.
#
#   bash examples/rllib_checkpoint.sh [OUT_DIR]  # OUT_DIR relative to the checkout; default out/examples
set -euo pipefail
cd "$(dirname "$0")/.."                                        # the checkout: fixtures/ is here
command -v policy-export >/dev/null || PATH="$PWD/.venv/bin:$PATH"
out=${1:-out/examples}
checkpoint=fixtures/rllib/checkpoints/ppo_filter/checkpoint   # PPO on CartPole, ray 2.9.3, MeanStdFilter

# What the checkpoint holds: each policy id with its class, spaces, observation filter and the
# network convert would rebuild (read without ray, none of its pickles run).
policy-export inspect "$checkpoint"

# Rebuild the policy from the stored config and weights and write a full export that takes the
# observations the environment emits (the filter is in the graph) and returns the action the
# environment takes. --policy-id ID picks one policy of a multi-agent checkpoint,
# --all-policies exports each. Parity runs against the rebuilt policy's session, as for export;
# `policy-export verify OUT` checks the export again wherever it is deployed.
policy-export convert "$checkpoint" --out "$out/ppo_filter" --overwrite \
    --formats saved_model,onnx --samples 200 --explore-samples 1000
