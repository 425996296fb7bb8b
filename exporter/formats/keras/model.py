"""The Keras base model on its own: a Keras SavedModel, a ``.keras`` file and an ``.h5`` file.

The model is rebuilt from its config in eager mode and given the session's weights, so the
files hold exactly the weights the policy runs with. Loading for checks never deserialises code:
configs are checked to hold built-in layers only, ``.keras`` loads in safe mode, and the
SavedModel is loaded like every SavedModel here (:func:`exporter.trust.open_saved_model`) and
run through its serving signature.
"""

from __future__ import annotations

import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import tensorflow as tf

from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.runner import Runner, TensorMeta
from policy_export.policy import jsonio
from policy_export.errors import ExportError, RunTimeoutError

SAVED_MODEL = "saved_model"
KERAS_FILE = "base_model.keras"
H5_FILE = "base_model.h5"
FORMATS = {"keras_saved_model": SAVED_MODEL, "keras_v3": KERAS_FILE, "keras_h5": H5_FILE}
MODEL_OUTPUT = "base_model_out"


def output_keys(count: int) -> list[str]:
    """Parity keys of the base model's outputs: ``base_model_out``, or ``base_model_out_0..``."""
    return [MODEL_OUTPUT] if count == 1 else [f"{MODEL_OUTPUT}_{i}" for i in range(count)]


def write(ctx: ExportContext, target: Path) -> FormatRecord:
    """Write the three Keras files of the policy's base model under ``target`` (a directory).

    Raises:
        ExportError: the policy has no Keras base model, or Keras fails to save (never only a warning).
    """
    import tf_keras as keras

    policy = ctx.policy
    if policy.model is None:
        raise ExportError("the policy has no Keras base model; leave 'keras' out of the formats")
    if not tf.executing_eagerly():
        raise ExportError("the Keras formats are written in eager mode; call export outside a graph context")
    weights = policy.session.run(policy.model.weights)
    target.mkdir()
    try:
        model = keras.Model.from_config(policy.model.get_config())
        model.set_weights(weights)
        del weights  # the model holds them now
        model.save(str(target / SAVED_MODEL), save_format="tf", include_optimizer=False)
        model.save(str(target / KERAS_FILE), save_format="keras")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*HDF5 file.*legacy", category=UserWarning)
            model.save(str(target / H5_FILE), save_format="h5", include_optimizer=False)
    except Exception as e:  # Keras raises many kinds; none may pass as a warning
        raise ExportError(f"saving the Keras base model failed: {type(e).__name__}: {e}") from e
    finally:
        keras.backend.clear_session()
    names = [t.name.split(":")[0] for t in policy.model.inputs]
    return FormatRecord("keras", tuple(f"{target.name}/{p}" for p in FORMATS.values()),
                        {"files": FORMATS, "inputs": names, "outputs": list(model.output_names)})


_SAFE_EXTRA = ("Functional", "Model", "Sequential", "TFOpLambda", "SlicingOpLambda", "Policy", "DTypePolicy")


# TF API symbols a ``TFOpLambda``/``SlicingOpLambda`` layer may name (its ``function``): pure tensor computation
# only. Keras resolves the name against the whole ``tf`` namespace, so any other name (``io.write_file``...) is refused.
OP_LAMBDA_FUNCTIONS = frozenset({
    # array manipulation
    "cast", "concat", "expand_dims", "fill", "gather", "identity", "one_hot", "ones_like", "rank", "reshape",
    "sequence_mask", "shape", "size", "split", "squeeze", "stack", "tile", "transpose", "unstack", "where",
    "zeros_like", "broadcast_to", "clip_by_value", "stop_gradient",
    # element-wise math and reductions
    "abs", "add", "argmax", "argmin", "divide", "exp", "maximum", "minimum", "multiply", "negative", "pow",
    "sqrt", "square", "subtract", "tanh", "sigmoid", "reduce_max", "reduce_mean", "reduce_min", "reduce_sum",
    "math.abs", "math.add", "math.argmax", "math.argmin", "math.divide", "math.exp", "math.log", "math.log1p",
    "math.maximum", "math.minimum", "math.multiply", "math.negative", "math.pow", "math.reduce_max",
    "math.reduce_mean", "math.reduce_min", "math.reduce_sum", "math.sigmoid", "math.softplus", "math.sqrt",
    "math.square", "math.subtract", "math.tanh", "math.truediv", "math.floordiv", "math.equal", "math.greater",
    "math.less", "math.logical_and", "math.logical_not", "math.logical_or", "linalg.matmul", "matmul",
    "nn.relu", "nn.elu", "nn.selu", "nn.softmax", "nn.log_softmax", "nn.softplus", "nn.leaky_relu", "nn.bias_add",
    # Python operators on Keras tensors (x + y, x[:, :1], ...)
    "__operators__.add", "__operators__.sub", "__operators__.mul", "__operators__.truediv",
    "__operators__.floordiv", "__operators__.neg", "__operators__.pow", "__operators__.getitem",
    "__operators__.eq", "__operators__.ne", "__operators__.lt", "__operators__.le", "__operators__.gt",
    "__operators__.ge", "__operators__.and", "__operators__.or", "__operators__.invert",
})
_OP_LAMBDAS = ("TFOpLambda", "SlicingOpLambda")


def check_config_safe(config: Any, source: str) -> None:
    """Refuse a model config naming a class that is not built into tf-keras, or ``Lambda``.

    Every object in the config (layers, nested models, wrappers, cells, initializers,
    regularizers, constraints...) is checked. ``TFOpLambda``/``SlicingOpLambda`` may name only a TF API
    symbol of :data:`OP_LAMBDA_FUNCTIONS`; ``Lambda`` would deserialise and run code from the file.
    """
    import tf_keras as keras

    modules = (keras.layers, keras.initializers, keras.regularizers, keras.constraints, keras.activations)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            cls = node.get("class_name")
            if cls is not None and "config" in node:
                known = isinstance(cls, str) and (cls in _SAFE_EXTRA or any(hasattr(m, cls) for m in modules))
                if not known or cls == "Lambda":
                    raise ExportError(f"{source}: class {cls!r} is not built into tf-keras; refusing to load it")
                if cls in _OP_LAMBDAS:
                    fn = node["config"].get("function") if isinstance(node["config"], dict) else None
                    if fn not in OP_LAMBDA_FUNCTIONS:
                        raise ExportError(f"{source}: layer {cls} names TF function {fn!r}, which is not on the list "
                                          "of pure tensor functions a Keras file may call; refusing to load it")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    if not (isinstance(config, dict) and "class_name" in config):
        raise ExportError(f"{source}: malformed model config")
    walk(config)


def _read_config(path: Path) -> Any:
    try:
        if path.suffix == ".keras":
            with zipfile.ZipFile(path) as z:
                return jsonio.loads(z.read("config.json"), f"{path}:config.json")
        with h5py.File(path, "r") as f:
            raw = f.attrs.get("model_config")
            return jsonio.loads(raw, f"{path}:model_config")
    except Exception as e:  # zip, h5 and JSON errors alike mean "not a model file"
        raise ExportError(f"{path} is not a readable Keras model file: {e}") from e


class KerasRunner(Runner):
    """Runs one Keras file on base-model inputs keyed by input name; outputs keyed by :func:`output_keys`.

    ``output_names`` (the model's, recorded at export) orders a SavedModel signature's outputs.
    """

    def __init__(self, path: Path, output_names: list[str] | None = None, device=None):
        import tf_keras as keras

        self.path = path
        self.label = f"Keras model {path}"
        self.output_names = output_names
        self._model = self._graph = None
        try:
            if path.is_dir():
                # the package's one SavedModel loader: checked, pruned to the signature, and its
                # restore and init ops run under the run limit (device: a DevicePlan; default CPU)
                from policy_export.exporter.devices import plan_devices
                from policy_export.exporter.formats.tf_runner import TFGraphRunner

                self._graph = TFGraphRunner.from_saved_model(path, device or plan_devices("cpu"), "serving_default")
                self._graph.label = self.label
                self.inputs = dict(self._graph.inputs)
            else:
                check_config_safe(_read_config(path), str(path))
                kwargs = {"safe_mode": True} if path.suffix == ".keras" else {}
                self._model = keras.models.load_model(str(path), compile=False, **kwargs)
                self.inputs = {t.name.split(":")[0]: TensorMeta(t.name.split(":")[0], t.dtype.name,
                                                                tuple(t.shape.as_list())) for t in self._model.inputs}
        except (ExportError, RunTimeoutError):
            raise
        except Exception as e:  # loaders raise many kinds
            raise ExportError(f"cannot load Keras model {path}: {type(e).__name__}: {e}") from e
        self.outputs = {}

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._model is not None:
            model = self._model
            args = [feeds[t.name.split(":")[0]] for t in model.inputs]
            # built-in layers run op by op: a call cannot be cancelled, only left behind
            out = self.stoppable(lambda: model(args[0] if len(args) == 1 else args, training=False))
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
        else:
            self._graph.run_timeout = self.run_timeout
            result = self._graph(feeds)  # that runner keeps the run limit and stops on signals
            names = self.output_names or sorted(result)
            outs = [result[n] for n in names]
        return {k: np.asarray(v) for k, v in zip(output_keys(len(outs)), outs)}

    def _close(self) -> None:
        import gc

        import tf_keras as keras

        if self._graph is not None:
            self._graph.close()
        self._model = self._graph = None
        keras.backend.clear_session()  # Keras keeps models alive in its global state otherwise
        gc.collect()
