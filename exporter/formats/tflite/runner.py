"""Run a ``.tflite`` export by signature key: the standalone LiteRT interpreter
(``ai_edge_litert``) where it is installed, TensorFlow's ``tf.lite.Interpreter`` otherwise.

TFLite has no optional inputs: every input of a signature must be fed on every call. The
export's ``serving_default`` takes the required inputs alone (the optional ones were folded to
their defaults), and ``serving_explore``/``serving_all_inputs`` (where written) every input. The
runner calls ``serving_default`` unless the caller feeds an optional input a value other than its
default (``explore`` true, say), and then the signature that takes it, feeding the contract's
defaults for the optional inputs left out; so a client of this runner feeds what it feeds every
other format. Inputs the model no longer holds (pruned when the graph was frozen) may be fed and
change nothing; an optional input no signature takes (a model that does not explore) may be fed
only its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter.formats.tflite.convert import (
    ALL_INPUTS_SIGNATURE, EXPLORE_SIGNATURE, SIGNATURE_KEY, check_tflite_file,
)
from policy_export.exporter.formats.runner import Runner, TensorMeta, with_defaults
from policy_export.exporter.formats.tflite.interpreter import create_interpreter, interpreter_class
from policy_export.errors import ExportError, InputError
from policy_export.signatures.contract import Contract


def _meta(key: str, detail: Mapping[str, Any]) -> TensorMeta:
    shape = detail.get("shape_signature")
    if shape is None:
        shape = detail.get("shape")
    dims = tuple(None if int(d) < 0 else int(d) for d in shape) if shape is not None else None
    return TensorMeta(key, np.dtype(detail["dtype"]).name, dims)


class TFLiteRunner(Runner):
    """A TFLite interpreter over one model file, run through its ``serving_default`` signature."""

    def __init__(self, path: Path, contract: Contract | None = None, fixed_inputs=(), threads: int | None = 1,
                 interpreter: str = "auto"):
        check_tflite_file(path)
        self.label = f"TFLite model {path}"
        self.contract = contract
        if interpreter == "auto":
            cls, self.interpreter_name = interpreter_class()
        elif interpreter == "tensorflow.lite":
            import tensorflow as tf

            cls, self.interpreter_name = tf.lite.Interpreter, interpreter
        else:
            from ai_edge_litert.interpreter import Interpreter as cls

            self.interpreter_name = "ai_edge_litert"
        try:
            self.interpreter = create_interpreter(cls, strict=False, model_path=str(path), num_threads=threads)
            signatures = self.interpreter.get_signature_list()
            if SIGNATURE_KEY not in signatures:
                raise ExportError(f"{path} has no {SIGNATURE_KEY!r} signature (it has {sorted(signatures)})")
            names = [SIGNATURE_KEY] + [n for n in (EXPLORE_SIGNATURE, ALL_INPUTS_SIGNATURE) if n in signatures]
            self.signatures = {n: self.interpreter.get_signature_runner(n) for n in names}
        except ExportError:
            raise
        except Exception as e:  # the interpreter raises ValueError / RuntimeError on a bad model
            raise ExportError(f"{self.label} does not load: {type(e).__name__}: {e}") from e
        self.signature_inputs = {n: {k: _meta(k, d) for k, d in r.get_input_details().items()}
                                 for n, r in self.signatures.items()}
        self.inputs = max(self.signature_inputs.values(), key=len)  # the signature taking the most inputs
        self.outputs = {k: _meta(k, d) for k, d in self.signatures[SIGNATURE_KEY].get_output_details().items()}
        self.fixed = frozenset(fixed_inputs)
        known = set(contract.input_keys) if contract is not None else set()
        self.accepted = frozenset(known - set(self.inputs))
        self.defaults = {s.key: np.asarray(s.default, np.dtype(s.dtype))
                         for s in (contract.inputs if contract is not None else ()) if not s.required}

    def _pick(self, feeds: Mapping[str, np.ndarray]) -> str:
        """``serving_default`` unless an optional input is fed other than its default: then the
        first signature that takes every such input."""
        set_keys = {k for k in feeds if k in self.defaults and not np.array_equal(feeds[k], self.defaults[k])}
        for name, inputs in self.signature_inputs.items():
            if set_keys <= set(inputs):
                return name
        key = sorted(set_keys - set(self.inputs))[0]
        raise InputError(f"{self.label}: input {key!r} was fixed to its default {self.defaults[key].tolist()!r} "
                         "when the model was converted (this model serves the deterministic path alone)")

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        name = self._pick(feeds)
        arrays = with_defaults(self.label, self.signature_inputs[name], feeds, self.defaults)
        # the interpreter cannot be told to stop: at the run limit or on a signal its call is left
        # to finish in a background thread (the runner is then never closed or run again)
        signature = self.signatures[name]
        values = self.stoppable(lambda: signature(**arrays))
        return {k: np.array(v, copy=True) for k, v in values.items()}

    def device_info(self) -> dict[str, Any]:
        return {"tflite_interpreter": self.interpreter_name}

    def _close(self) -> None:
        self.signatures = {}
        self.interpreter = None
