"""Weights files with exactly the names and shapes a spec's model holds, for bringing your own weights.

A spec's model names its layers ``fc_1..fc_N``, ``fc_out``, ``lstm`` and ``<input>_conv_<i>``
(see docs/spec.md, "Layer and weight names"); a weights file must hold every one of their
weights under those names, and nothing else. Write a file to fill in, or list what it must hold::

    from policy_export.policy.template import weight_shapes, write_weights_template

    write_weights_template("my_policy", "my_policy/weights.h5")   # the spec's initial weights
    weight_shapes("my_policy")        # {"fc_1/kernel": (4, 64), "fc_1/bias": (64,), ...}

or from the shell: ``python -m policy_export.policy.template my_policy [my_policy/weights.h5]``.

The spec's own ``weights`` key is ignored here (the file it names need not exist yet), so a
``policy.json`` written before its weights works as it is.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from policy_export.errors import PolicyExportError
from policy_export.policy.spec import PolicySpec, read_spec_json, spec_from_json


def template_spec(spec_or_dir: PolicySpec | str | Path) -> PolicySpec:
    """The spec (a :class:`PolicySpec`, a ``policy.json`` or its directory) without its weights file."""
    if isinstance(spec_or_dir, PolicySpec):
        spec = spec_or_dir
    else:
        obj, file = read_spec_json(spec_or_dir)
        if isinstance(obj, dict):
            obj = {k: v for k, v in obj.items() if k != "weights"}
        spec = spec_from_json(obj, base_dir=file.parent, source=str(file))
    return dataclasses.replace(spec, weights=None)


def weight_shapes(spec_or_dir: PolicySpec | str | Path) -> dict[str, tuple[int, ...]]:
    """The weights the spec's model holds, ``layer/weight`` -> shape, in layer order: what the loader
    checks a weights file against (:func:`policy.layout.expected_weights`; no TensorFlow, no build).

    Raises:
        SpecError: the spec is invalid.
        UnsupportedSpaceError: a space the model cannot take.
    """
    from policy_export.policy.layout import expected_weights

    return expected_weights(template_spec(spec_or_dir))


def write_weights_template(spec_or_dir: PolicySpec | str | Path, path: str | Path, *,
                           zeros: bool = False, overwrite: bool = False) -> Path:
    """Write a weights file for the spec's model: every weight it needs, named and shaped as
    :meth:`TFPolicy.import_model_from_h5` and ``load_spec`` expect (Keras's HDF5 weights layout).

    The values are the spec's initial weights (from its ``seed``), or zeros with ``zeros=True``.
    Replace them with your own (h5py: ``f["fc_1/fc_1/kernel:0"][...] = array``), or load the file
    into your Keras model by name to see where each weight goes. Returns ``path``.

    Raises:
        SpecError, UnsupportedSpaceError: the spec is invalid or cannot be built.
        PolicyExportError: ``path`` exists and ``overwrite`` is false.
    """
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise PolicyExportError(f"{path} exists; pass overwrite=True to replace it")
    if zeros:  # no build: the shapes are the spec's own
        weights = {key: np.zeros(shape, np.float32) for key, shape in weight_shapes(spec_or_dir).items()}
    else:
        weights = _initial_weights(spec_or_dir)
    from policy_export.policy import h5io

    path.parent.mkdir(parents=True, exist_ok=True)
    return h5io.write_h5_weights(path, weights)


def _initial_weights(spec_or_dir: PolicySpec | str | Path) -> dict[str, np.ndarray]:
    from policy_export.policy.tf_policy import TFPolicy

    policy = TFPolicy.from_spec(template_spec(spec_or_dir))
    try:
        return policy.get_weights()
    finally:
        policy.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m policy_export.policy.template SPEC [OUT.h5] [--zeros]``: list, or write, the weights."""
    args = list(sys.argv[1:] if argv is None else argv)
    zeros = "--zeros" in args
    args = [a for a in args if a != "--zeros"]
    if len(args) not in (1, 2):
        print("usage: python -m policy_export.policy.template SPEC_DIR_OR_FILE [OUT.h5] [--zeros]", file=sys.stderr)
        return 2
    try:
        if len(args) == 2:
            print(write_weights_template(args[0], args[1], zeros=zeros))
        else:
            for key, shape in weight_shapes(args[0]).items():
                print(f"{key}\t{list(shape)}")
    except PolicyExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
