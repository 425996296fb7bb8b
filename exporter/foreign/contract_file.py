"""The contract file of a policy exported elsewhere (``--contract FILE``): what its graph cannot say.

A small JSON file, optional::

    {
      "spaces": {
        "obs": {"type": "Box", "low": -10.0, "high": 10.0, "shape": [48], "dtype": "float32"},
        "actions": {"type": "Box", "low": -1.0, "high": 1.0, "shape": [12], "dtype": "float32"}
      },
      "actions": ["actions"]
    }

- ``spaces``: a graph input's or output's gymnasium space, written as a spec file writes spaces
  (``Box``, ``Discrete``, ``MultiDiscrete``, ``MultiBinary``: one tensor is one leaf), each checked
  against the graph: its shape is the tensor's row (the graph's shape without its batch axis) and
  its kind the tensor's dtype (a ``Box`` a float or integer tensor, the others integer or bool);
- ``actions``: the outputs that are the policy's actions (default: the outputs given a space, else
  every recorded output). Lossy formats (``onnx_int8``, ``onnx_fp16``, ``openvino_bf16``) are
  judged on them: a Box by its error as a share of its range (the range the recording spans where
  a bound is infinite or no space is given), any other space, and an integer output without one,
  by the share of identical actions.

The file is read as every JSON file this package reads (a regular file, not a link, bounded,
strict); unknown keys are refused. It goes into the export's manifest as the contract's
``spaces`` and ``actions``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.policy import jsonio

MAX_BYTES = 1 << 20
KEYS = ("spaces", "actions")
FLAG = "--contract"


def read_contract_file(path: str | Path, contract) -> dict[str, Any]:
    """The contract file at ``path`` checked against the graph's ``contract``: ``{"spaces": {name:
    space JSON}, "actions": [names]}`` (either absent when the file has none).

    Raises:
        InputError: not a readable JSON object of ``spaces`` and ``actions``, or a name, shape or
            kind that does not fit the graph (named).
    """
    import gymnasium as gym

    from policy_export.policy.spaces import leaf_shape, space_from_json, space_to_json
    from policy_export.errors import SpecError

    where = f"{FLAG} {path}"
    try:
        doc = jsonio.read_file(path, MAX_BYTES, where)
    except jsonio.JSONError as e:
        raise InputError(f"{where}: {e.problem}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a JSON object with {' and/or '.join(KEYS)}")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise InputError(f"{where}: unknown key(s) {', '.join(k[:40] for k in unknown)}; a contract file holds "
                         f"{' and '.join(KEYS)}")
    out: dict[str, Any] = {}
    specs = {s.key: s for s in (*contract.inputs, *contract.outputs)}
    spaces = doc.get("spaces", {})
    if not isinstance(spaces, dict):
        raise InputError(f"{where}: spaces must be an object of graph input or output name -> space")
    checked = {}
    for name, obj in spaces.items():
        if name not in specs:
            raise InputError(f"{where}: spaces names {name[:80]!r}, which is not an input or output of the graph "
                             f"(inputs: {', '.join(contract.input_keys)}; outputs: {', '.join(contract.output_keys)})")
        try:
            space = space_from_json(obj, f"$.spaces.{name}", where)
        except SpecError as e:
            raise InputError(str(e)) from None
        if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
            raise InputError(f"{where}: spaces.{name} is a {type(space).__name__}; one tensor is one Box, Discrete, "
                             "MultiDiscrete or MultiBinary")
        _check_fits(name, space, specs[name], leaf_shape(space), where)
        checked[name] = space_to_json(space)
    if checked:
        out["spaces"] = checked
    actions = doc.get("actions")
    if actions is not None:
        if not isinstance(actions, list) or not actions or not all(isinstance(a, str) for a in actions) \
                or len(set(actions)) != len(actions):
            raise InputError(f"{where}: actions must be a list of distinct output names")
        stray = [a for a in actions if a not in contract.output_keys]
        if stray:
            raise InputError(f"{where}: actions names {stray[0][:80]!r}, which is not an output of the graph "
                             f"({', '.join(contract.output_keys)})")
        out["actions"] = list(actions)
    return out


def _check_fits(name: str, space, spec, shape: Sequence[int], where: str) -> None:
    import gymnasium as gym

    row = tuple(spec.shape[1:]) if spec.shape and spec.shape[0] in (None, 1) else tuple(spec.shape)
    fits = len(row) == len(shape) and all(d is None or d == s for d, s in zip(row, shape))
    single = int(np.prod([d or 1 for d in row], dtype=np.int64)) == 1 and int(np.prod(shape, dtype=np.int64)) == 1
    if not (fits or single):
        shown = "[" + ", ".join("?" if d is None else str(d) for d in row) + "]"
        raise InputError(f"{where}: spaces.{name} has shape {list(shape)}; the graph's {name} has rows of {shown}")
    kind = np.dtype(spec.dtype).kind
    allowed = "fiu" if isinstance(space, gym.spaces.Box) else "iub"
    if kind not in allowed:
        raise InputError(f"{where}: spaces.{name} is a {type(space).__name__}; the graph's {name} is {spec.dtype}")
