"""The Python API: export the bundled CartPole policy, verify it, and run its ONNX model.

    python examples/python_api.py [OUT_DIR]       # default out/examples
"""

import sys
from pathlib import Path

import numpy as np

from policy_export import ExportOptions, export_spec, verify_export
from policy_export.exporter.formats.onnx.model import inference_session

ROOT = Path(__file__).resolve().parent.parent  # the checkout: fixtures/ is here
out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "out" / "examples") / "api_cartpole"

# The options are checked when they are made, before TensorFlow loads (a bad value is an
# InputError here, with the message the command line gives).
options = ExportOptions(formats=["saved_model", "onnx"], samples=200, explore_samples=1000, overwrite=True)
result = export_spec(ROOT / "fixtures" / "cartpole_mlp", out, options)
worst = max(result.parity.records, key=lambda record: record.max_abs_err)
print(f"exported {result.path}: {', '.join(result.formats)}; parity passed: {result.parity.passed}")
print(f"largest error: {worst.format} {worst.key} {worst.max_abs_err:.1e}")

# File hashes, then the stored parity plan replayed on every format loaded fresh from disk.
check = verify_export(out)
check.raise_if_failed()  # ParityFailedError naming every problem
print(f"verify passed: {check.passed}")

# Serve it: model.onnx in ONNX Runtime, fed only the inputs it lists as required.
session = inference_session(out / "model.onnx", threads=1)
observations = np.array([[0.01, -0.2, 0.03, 0.4], [0.0, 0.5, -0.1, -0.8]], dtype=np.float32)
print("required inputs:", [i.name for i in session.get_inputs()])
print("actions:", session.run(["actions_0"], {"observations": observations})[0])
