"""The package's stand-in for Triton's ONNX Runtime backend: a Python-based backend named
``onnxruntime`` that runs each model's ``model.onnx`` in ONNX Runtime, inside the Python backend's
own stub process, taking from Triton what the ONNX Runtime backend takes.

This file is not imported by the package. :mod:`exporter.serve.repository` copies it as
``<backends>/onnxruntime/model.py``: PyTriton's ``tritonserver`` has no ``libtriton_onnxruntime.so``,
so Triton's core loads a model whose config names ``backend: "onnxruntime"`` through this file
(a "Python-based backend", ``runtime: "model.py"``), and every config stays exactly as written.
Triton's core then applies its own config checks, ``reshape`` rules, dynamic batcher, sequence
batcher and request checks; this file does what the backend does
(``onnxruntime_backend/src/onnxruntime.cc``):

- at load, the backend's checks of the config against the model (``ValidateInputs``,
  ``ValidateOutputs``, ``ValidateBooleanSequenceControl``), with its messages: the input count
  (required inputs, controls and states), each input's and output's data type and dims (after
  ``reshape``; inputs loosely, outputs exactly), no optional input in a model that batches,
  controls of dims ``[1]``;
- a batch of requests joined on the first dimension into one session run, each request its own
  rows back; a scalar model input fed as a scalar; an optional input a request leaves out left
  out of the run (the model's own default holds); a scalar model output given the config's dims;
- implicit state (``sequence_batching.state``): the Python backend cannot update Triton's state,
  so the state each sequence's last step returned is kept here, by correlation id, and fed back
  on its next step, as the backend's ``TRITONBACKEND_StateUpdate`` would have Triton do; a
  sequence's first step (the START flag) takes the initial state Triton gives, its last (END)
  drops what was kept. At most one state is kept per batch slot (the direct sequence batcher's
  slots: ``max_batch_size`` per instance) and none beyond the sequence idle time: a sequence the
  batcher released is never continued, only started again.
"""

import collections
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

MODEL_FILE = "model.onnx"
# ONNX Runtime's type strings -> Triton's config data types
ORT_TYPES = {"tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64", "tensor(float16)": "TYPE_FP16",
             "tensor(int8)": "TYPE_INT8", "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32",
             "tensor(int64)": "TYPE_INT64", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
             "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(bool)": "TYPE_BOOL",
             "tensor(string)": "TYPE_STRING", "tensor(bfloat16)": "TYPE_BF16"}
SEQUENCE_CONTROLS = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY",
                     "CONTROL_SEQUENCE_CORRID")


class LoadError(Exception):
    """A config the ONNX Runtime backend would not load (its message)."""


def _dims(arg):
    return [d if isinstance(d, int) else -1 for d in arg.shape]


def _shape(dims):
    return "[" + ",".join(str(d) for d in dims) + "]"


def _config_dims(io):
    reshape = io.get("reshape")
    return [int(d) for d in (reshape.get("shape", []) if reshape is not None else io.get("dims", []))]


def compare_dims(model, tensor, model_shape, dims, max_batch_size, exact):
    """``CompareDimsSupported`` (onnxruntime_utils.cc)."""
    if max_batch_size > 0:
        if not model_shape or model_shape[0] != -1:
            raise LoadError(f"model '{model}', tensor '{tensor}': for the model to support batching the shape should "
                            "have at least 1 dimension and the first dimension must be -1; but shape expected by the "
                            f"model is {_shape(model_shape)}")
        full = [-1, *dims]
        ok = len(model_shape) == len(full) and all(m == f for m, f in zip(model_shape, full) if exact or m != -1)
        if not ok:
            raise LoadError(f"model '{model}', tensor '{tensor}': the model expects {len(model_shape)} dimensions "
                            f"(shape {_shape(model_shape)}) but the model configuration specifies {len(full)} "
                            "dimensions (an initial batch dimension because max_batch_size > 0 followed by the "
                            f"explicit tensor shape, making complete shape {_shape(full)})")
    elif len(model_shape) != len(dims) or not all(m == d for m, d in zip(model_shape, dims) if exact or m != -1):
        raise LoadError(f"model '{model}', tensor '{tensor}': the model expects {len(model_shape)} dimensions (shape "
                        f"{_shape(model_shape)}) but the model configuration specifies {len(dims)} dimensions (shape "
                        f"{_shape(dims)})")


def _scalar_dims(model, name, dims):
    if any(d != 1 for d in dims):
        raise LoadError(f"unable to load model '{model}', scalar tensor '{name}', should only provide 1 in the model "
                        "configuration when the model doesn't support batching. Model configuration provided: "
                        f"{_shape(dims)}.")


def validate(config, session):
    """The ONNX Runtime backend's load checks of ``config`` (the model config as JSON) against
    ``session``; raises :class:`LoadError` with the backend's message."""
    model, batch = config["name"], int(config.get("max_batch_size", 0))
    inputs = {a.name: a for a in session.get_inputs()}
    overridable = {a.name: a for a in session.get_overridable_initializers()}
    outputs = {a.name: a for a in session.get_outputs()}
    declared = config.get("input", [])
    expected = sum(1 for io in declared if not io.get("optional", False))
    sequence = config.get("sequence_batching")
    if sequence is not None:
        for kind in SEQUENCE_CONTROLS:
            for control in sequence.get("control_input", []):
                if any(c.get("kind") == kind for c in control.get("control", [])):
                    _validate_control(model, batch, control["name"], kind, control, inputs)
                    expected += 1
        expected += len(sequence.get("state", []))
    if len(inputs) != expected:
        raise LoadError(f"unable to load model '{model}', configuration expects {expected} inputs, model provides "
                        f"{len(inputs)}")
    known = {**inputs, **overridable}
    for io in declared:
        name, optional = io["name"], io.get("optional", False)
        if optional and batch != 0:
            raise LoadError(f"unable to load model '{model}', optional input '{name}' is not supported for models that "
                            "support batching")
        arg = known.get(name)
        if arg is None:
            raise LoadError(f"unexpected inference input '{name}', allowed inputs are: {', '.join(sorted(known))}")
        _validate_type(model, name, "input", io.get("data_type"), arg)
        dims, model_shape = _config_dims(io), _dims(arg)
        if model_shape:
            compare_dims(model, name, model_shape, dims, batch, exact=False)
        else:
            _scalar_dims(model, name, dims)
    for io in config.get("output", []):
        name = io["name"]
        arg = outputs.get(name)
        if arg is None:
            raise LoadError(f"unexpected inference output '{name}', allowed outputs are: {', '.join(sorted(outputs))}")
        _validate_type(model, name, "output", io.get("data_type"), arg)
        dims, model_shape = _config_dims(io), _dims(arg)
        if model_shape:
            compare_dims(model, name, model_shape, dims, batch, exact=True)
        else:
            _scalar_dims(model, name, dims)


def _validate_type(model, name, what, data_type, arg):
    provides = ORT_TYPES.get(arg.type, arg.type)
    if data_type != provides:
        raise LoadError(f"unable to load model '{model}', configuration expects datatype {data_type} for {what} "
                        f"'{name}', model provides {provides}")


def _validate_control(model, batch, name, kind, control, inputs):
    """``ValidateBooleanSequenceControl`` / ``ValidateTypedSequenceControl``."""
    arg = inputs.get(name)
    if arg is None:
        raise LoadError(f"configuration specified sequence control '{name}', but model does not provide that input")
    dims = _dims(arg)[1 if batch > 0 else 0:]
    if dims != [1]:
        raise LoadError(f"unable to load model '{model}', sequence control '{name}' in model has dims {_shape(dims)} "
                        "but dims [1] is expected")
    entry = next(c for c in control["control"] if c.get("kind") == kind)
    if entry.get("int32_false_true"):
        data_type = "TYPE_INT32"
    elif entry.get("fp32_false_true"):
        data_type = "TYPE_FP32"
    elif entry.get("bool_false_true"):
        data_type = "TYPE_BOOL"
    else:
        data_type = entry.get("data_type", "TYPE_UINT64")
    if ORT_TYPES.get(arg.type) != data_type:
        raise LoadError(f"unable to load model '{model}', sequence control '{name}', the model expects data-type "
                        f"{arg.type} but the model configuration specifies data-type {data_type}")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = Path(args["model_repository"]) / args["model_version"] / MODEL_FILE
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # one session per instance; tiny models run fastest on one thread
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        try:
            validate(config, self.session)
        except LoadError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        self.name = config["name"]
        self.batching = int(config.get("max_batch_size", 0)) > 0
        declared = [*self.session.get_inputs(), *self.session.get_overridable_initializers()]
        self.scalar_inputs = {a.name for a in declared if not a.shape}
        self.scalar_outputs = {a.name: None for a in self.session.get_outputs() if not a.shape}
        self.outputs = [o["name"] for o in config.get("output", [])]
        for io in config.get("output", []):
            if io["name"] in self.scalar_outputs:
                self.scalar_outputs[io["name"]] = _config_dims(io)
        sequence = config.get("sequence_batching") or {}
        self.states = [(s["input_name"], s["output_name"]) for s in sequence.get("state", [])]
        names = [i["name"] for i in config.get("input", [])]
        names += [c["name"] for c in sequence.get("control_input", [])]
        self.inputs = [n for n in names if n in {a.name for a in declared}]
        self.run_outputs = self.outputs + [out for _, out in self.states if out not in self.outputs]
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        self.slots = max(1, int(config.get("max_batch_size", 0))) * instances
        self.idle_s = int(sequence.get("max_sequence_idle_microseconds", 1_000_000)) / 1e6
        self.kept = collections.OrderedDict()  # correlation id -> (last step's time, {state input: rows})

    # -- requests
    def _feeds(self, request):
        feeds = {}
        for name in self.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                value = tensor.as_numpy()
                feeds[name] = value.reshape(()) if name in self.scalar_inputs else value
        return feeds

    def _run(self, feeds):
        return dict(zip(self.run_outputs, self.session.run(self.run_outputs, feeds)))

    def _respond(self, out, rows=None):
        tensors = []
        for name in self.outputs:
            value = out[name] if rows is None else out[name][rows]
            if value.ndim == 0 and self.scalar_outputs.get(name) is not None:
                value = value.reshape(self.scalar_outputs[name])
            tensors.append(pb_utils.Tensor(name, np.ascontiguousarray(value)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        try:
            if self.states:
                return self._sequences(requests)
            if len(requests) == 1 or not self.batching:
                return [self._respond(self._run(self._feeds(r))) for r in requests]
            return self._joined(requests, [self._feeds(r) for r in requests])
        except Exception as e:  # what the backend answers when ONNX Runtime fails: every request gets the error
            error = pb_utils.TritonError(f"onnx runtime error: {str(e)[:1000]}")
            return [pb_utils.InferenceResponse(output_tensors=[], error=error) for _ in requests]

    def _joined(self, requests, feeds):
        """One run of every request's rows (a model that batches), each request its own rows back."""
        rows = [len(next(iter(f.values()))) if f else 0 for f in feeds]
        joined = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
        out = self._run(joined)
        bounds = np.cumsum([0, *rows])
        return [self._respond(out, slice(bounds[i], bounds[i + 1])) for i in range(len(requests))]

    # -- implicit state
    def _sequences(self, requests):
        now = time.monotonic()
        while self.kept and now - next(iter(self.kept.values()))[0] > self.idle_s:
            self.kept.popitem(last=False)  # released by the sequence batcher: only a START can use its id again
        feeds = []
        for request in requests:
            f = self._feeds(request)
            corrid, flags = request.correlation_id(), request.flags()
            kept = self.kept.get(corrid) if corrid and not flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START \
                else None
            for name, _ in self.states:
                if kept is not None:
                    f[name] = kept[1][name]
                else:  # Triton's initial state (the config's initial_state)
                    f[name] = pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            feeds.append(f)
        if self.batching and len(requests) > 1:
            rows = [len(f[self.states[0][0]]) for f in feeds]
            joined = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
            out = self._run(joined)
            bounds = np.cumsum([0, *rows])
            parts = [(out, slice(bounds[i], bounds[i + 1])) for i in range(len(requests))]
        else:
            parts = [(self._run(f), None) for f in feeds]
        responses = []
        for request, (out, rows) in zip(requests, parts):
            self._keep(request, out, rows, now)
            responses.append(self._respond(out, rows))
        return responses

    def _keep(self, request, out, rows, now):
        corrid = request.correlation_id()
        if not corrid:  # a slot the batcher filled: no sequence to keep
            return
        self.kept.pop(corrid, None)
        if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
            return
        self.kept[corrid] = (now, {name: np.array(out[output] if rows is None else out[output][rows])
                                   for name, output in self.states})
        while len(self.kept) > self.slots:
            self.kept.popitem(last=False)

    def finalize(self):
        self.kept.clear()
