"""Run a Triton repository's models in ONNX Runtime the way Triton's ONNX Runtime backend feeds
them: the batched model unless an optional input is given a value other than its default (then
the sampling model), ``START`` 0 and the state the caller passes for recurrent models (the server
would feed back the state it kept), ``seq_lens`` left to the model (one step per sequence)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import ExportError, InputError
from policy_export.exporter.formats.runner import Runner, TensorMeta
from policy_export.exporter.formats.triton.graph import START
from policy_export.signatures.contract import Contract
from policy_export.signatures.keys import SEQ_LENS


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def model_records(label: str, info: Any) -> dict[str, dict]:
    """The manifest record's ``models``, each checked to be well formed.

    Raises:
        InputError: no models listed. ExportError: a malformed record (named).
    """
    models = info.get("models") if isinstance(info, dict) and isinstance(info.get("models"), dict) else {}
    if not models:
        raise InputError(f"{label}: the manifest lists no Triton models")
    for name, r in models.items():
        if not (isinstance(r, dict) and isinstance(r.get("model"), str) and _int(r.get("max_batch_size", 0))
                and _strs(r.get("outputs", [])) and isinstance(r.get("states") or [], list)
                and all(_strs(p) for p in r.get("states") or [])):
            raise ExportError(f"{label}: the manifest's triton model record {name!r} is malformed (expected "
                              "{model: path, max_batch_size: int, outputs: [keys], states: [[keys]]})")
    return models


EXPLORE_SUFFIX = "_explore"  # the sampling model's name: the serving model's and this


def serving_model(models: Mapping[str, Any]) -> str | None:
    """The serving model of a repository's models (name -> record with ``max_batch_size``): the one
    that batches, else (a model exported elsewhere whose batch is fixed, or whose state keeps its
    batch off the first axis) the one model not named ``*_explore``; ``None`` when that is not one."""
    def size(record) -> int:
        value = record.get("max_batch_size") if isinstance(record, Mapping) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    batched = [str(n) for n, r in models.items() if size(r) > 0]
    if batched:
        return batched[0] if len(batched) == 1 else None
    plain = [str(n) for n in models if not str(n).endswith(EXPLORE_SUFFIX)]
    return plain[0] if len(plain) == 1 else None


class TritonRunner(Runner):
    """The batched model and (where written) the sampling model of one repository, by contract key."""

    def __init__(self, root: Path, contract: Contract, info: Mapping[str, Any], device):
        from policy_export.exporter.formats.onnx.model import OnnxRunner

        self.label = f"Triton repository {root}"
        self.contract = contract
        models = model_records(self.label, info)
        self.runners: dict[str, Any] = {}
        # the serving model: the one that batches, else (a model exported elsewhere with a static
        # batch, or state kept off the first axis) the first listed; the other samples
        serving = serving_model(models)
        if serving is None:
            raise InputError(f"{self.label}: the manifest lists no one serving model (one that batches, or one "
                             f"not named *{EXPLORE_SUFFIX})")
        self.batched = self.sampling = None
        self.states = [list(p) for p in models[serving].get("states") or []]
        for name, record in models.items():
            path = _inside(root, record.get("model"))
            runner = OnnxRunner(path, device, threads=1, contract=None)
            self.runners[name] = runner
            if name == serving:
                self.batched = runner
            else:
                self.sampling = runner
        # a recurrent model that does not batch takes one sequence a request: its open dims are 1
        one_sequence = bool(self.states) and not models[serving].get("max_batch_size", 0)
        self.inputs = {s.key: TensorMeta(s.key, s.dtype, tuple(1 if one_sequence and d is None else d for d in s.shape))
                       for s in contract.inputs}
        self.outputs = dict(self.batched.outputs)

    def _choose(self, feeds: Mapping[str, np.ndarray]):
        """The sampling model when an optional input is fed a value other than its default
        (:meth:`Contract.non_default_inputs`), else the batched model."""
        switched = self.contract.non_default_inputs(feeds)
        if switched and self.sampling is None:
            raise InputError(f"{self.label}: input {switched[0]!r} can only be its default here "
                             "(the repository has no sampling model)")
        return self.sampling if switched else self.batched

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        runner = self._choose(feeds)
        arrays = {k: v for k, v in feeds.items() if k in runner.inputs}
        if SEQ_LENS in feeds and not np.all(np.asarray(feeds[SEQ_LENS]) == 1):
            raise InputError(f"{self.label}: the Triton models take one step per request (seq_lens 1)")
        if START in runner.inputs:
            batched_start = len(runner.inputs[START].shape or ()) == 2
            rows = next((np.shape(feeds[p[0]])[0] for p in self.states if p and p[0] in feeds), 1)
            arrays[START] = np.zeros((rows, 1) if batched_start else (1,), np.int32)
        out = runner._run(arrays)
        return {k: v for k, v in out.items() if k in self.contract.output_keys}

    def device_info(self) -> dict[str, Any]:
        return self.batched.device_info()

    def _close(self) -> None:
        for runner in self.runners.values():
            runner.close()


def _inside(root: Path, rel: Any) -> Path:
    if not isinstance(rel, str) or rel.startswith("/") or ".." in Path(rel).parts:
        raise InputError(f"Triton model path {rel!r} is not a path inside {root}")
    return root / rel
