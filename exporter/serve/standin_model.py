"""A Triton Python-backend model standing in for Triton's ONNX Runtime backend: it runs the
``model.onnx`` beside it in ONNX Runtime, taking from Triton what that backend would take.

This file is not imported by the package: :mod:`exporter.serve.repository` copies it as
``<model>/<version>/model.py`` into a copy of an export's ``triton/`` repository, whose configs
then name ``backend: "python"``, so that a real ``tritonserver`` (PyTriton's, which has the Python
backend only) loads the repository and applies its own config checks, dims and reshape rules,
dynamic batcher and sequence batcher to it.

- A model that batches gets each batch's requests joined on the first dimension, one session run,
  and each request its own rows back.
- Inputs arrive as Triton shaped them (after ``reshape``); each is brought to the rank ONNX
  Runtime declares (a ``[1]`` scalar to ``[]``). An optional input a request leaves out is left
  out of the run, so the model's own default (an initializer) holds.
- Sequence batching: Triton's Python backend does not carry implicit state (it hands the model
  the zero initial state every time and drops a returned state), so this model keeps each
  sequence's state itself, by correlation id, as the ONNX Runtime backend's implicit state would:
  the ``START`` control input zeroes it inside the model, and requests Triton fills a batch slot
  with (correlation id 0) are answered without touching any state.
"""

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.batching = int(config.get("max_batch_size", 0)) > 0
        path = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        declared = [*self.session.get_inputs(), *self.session.get_overridable_initializers()]
        self.ranks = {a.name: len(a.shape) for a in declared}
        self.inputs = [i["name"] for i in config.get("input", [])]
        self.outputs = [o["name"] for o in config.get("output", [])]
        sequence = config.get("sequence_batching") or {}
        self.states = [(s["input_name"], s["output_name"]) for s in sequence.get("state", [])]
        self.controls = [c["name"] for c in sequence.get("control_input", [])]  # START: a plain input here
        self.state_dims = {s["input_name"]: [int(d) for d in s["dims"]] for s in sequence.get("state", [])}
        self.kept = {}  # correlation id -> {state input name: array}

    def _array(self, name, value):
        rank = self.ranks.get(name)
        if rank is not None and value.ndim > rank:
            value = value.reshape(value.shape[: rank - 1] + (-1,) if rank else ())
        return value

    def _feeds(self, request):
        feeds = {}
        for name in self.inputs + self.controls + [s for s, _ in self.states]:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None and name in self.ranks:
                feeds[name] = self._array(name, tensor.as_numpy())
        return feeds

    def _respond(self, out, rows=slice(None)):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, np.ascontiguousarray(out[name][rows] if self.batching else out[name]))
            for name in self.outputs])

    def _run(self, feeds):
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, feeds)))

    def execute(self, requests):
        if self.states:
            return [self._step(request) for request in requests]
        if not self.batching:
            return [self._respond(self._run(self._feeds(request))) for request in requests]
        feeds = [self._feeds(request) for request in requests]
        rows = [len(next(iter(f.values()))) for f in feeds]
        joined = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
        out = self._run(joined)
        bounds = np.cumsum([0] + rows)
        return [self._respond(out, slice(bounds[i], bounds[i + 1])) for i in range(len(requests))]

    def _step(self, request):
        feeds = self._feeds(request)
        corrid = request.correlation_id()
        kept = self.kept.get(corrid) if corrid else None
        for name, _ in self.states:
            if kept is not None and name in kept:
                feeds[name] = kept[name]
            else:
                rows = len(next(v for k, v in feeds.items() if k in self.inputs))
                feeds[name] = np.zeros([rows, *self.state_dims[name]], np.float32)
        out = self._run(feeds)
        if corrid:  # a real sequence (0: a slot Triton filled)
            self.kept[corrid] = {name: out[output] for name, output in self.states}
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                self.kept.pop(corrid, None)
        return self._respond(out)

    def finalize(self):
        self.kept.clear()
