"""The Keras base model on its own: a Keras SavedModel, a ``.keras`` file and an ``.h5`` file.

The model is rebuilt from its config in eager mode and given the session's weights, so the
files hold exactly the weights the policy runs with. Loading for checks never deserialises code:
configs are checked to hold built-in layers only, ``.keras`` loads in safe mode, and the
SavedModel is loaded like every SavedModel here (:func:`exporter.trust.open_saved_model`) and
run through its serving signature.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import tensorflow as tf

from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.runner import Runner, TensorMeta
from policy_export.policy import h5io, jsonio
from policy_export.policy.zipio import Archive
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
# what a string activation may name: tf-keras's built-in activation functions
ACTIVATIONS = frozenset({"elu", "exponential", "gelu", "hard_sigmoid", "linear", "mish", "relu", "selu", "sigmoid",
                         "softmax", "softplus", "softsign", "swish", "tanh"})
_ACTIVATION_KEYS = ("activation", "recurrent_activation")
# fields with which tf-keras picks a class or a function to call: each is decided here, wherever it stands
_PICKERS = ("class_name", "module", "registered_name", "spec_name")
_CODE_FIELDS = ("function_type", "output_shape_type", "output_shape_module")  # a Lambda's code and its kind
# what a ``module`` field may say besides a class's own defining module: tf-keras's public namespaces
_PUBLIC_MODULES = ("keras", "keras.layers", "keras.initializers", "keras.regularizers", "keras.constraints",
                   "keras.mixed_precision")
# the members tf-keras writes into a ``.keras`` archive, and the most each may inflate to
MAX_ARCHIVE_MEMBERS = {"config.json": jsonio.MAX_JSON_BYTES, "metadata.json": 1 << 20,
                       "model.weights.h5": h5io.MAX_WEIGHTS_BYTES, "model.weights.npz": h5io.MAX_WEIGHTS_BYTES}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.cache
def _allowed_classes() -> dict[str, type]:
    """Class name -> class, for every class a Keras file may name: tf-keras's built-in layers (not
    ``Lambda``), initializers, regularizers and constraints, its models, the op layers and the dtype policy."""
    import tf_keras as keras
    from tf_keras.src.engine.functional import Functional
    from tf_keras.src.layers.core.tf_op_layer import SlicingOpLambda, TFOpLambda

    bases = ((keras.layers, keras.layers.Layer), (keras.initializers, keras.initializers.Initializer),
             (keras.regularizers, keras.regularizers.Regularizer), (keras.constraints, keras.constraints.Constraint))
    allowed: dict[str, type] = {}
    for module, base in bases:
        for name in dir(module):
            obj = getattr(module, name)
            if (not name.startswith("_") and inspect.isclass(obj) and issubclass(obj, base)
                    and not issubclass(obj, keras.layers.Lambda)):
                allowed.setdefault(name, obj)
    allowed.update(Functional=Functional, Model=keras.Model, Sequential=keras.Sequential, TFOpLambda=TFOpLambda,
                   SlicingOpLambda=SlicingOpLambda, Policy=keras.mixed_precision.Policy)
    return allowed


def _resolves_to(cls: type, name: str, module: Any) -> bool:
    """Whether tf-keras, given ``module`` and class ``name``, picks ``cls`` (nothing is imported)."""
    import tf_keras as keras

    if module is None:
        return True
    if module in _PUBLIC_MODULES:
        namespace = keras if module == "keras" else getattr(keras, module.split(".", 1)[1])
        return getattr(namespace, name, None) is cls
    return module == cls.__module__  # the class's own defining module (tf-keras's, for its non-public classes)


def _check_object(node: dict, source: str) -> str:
    """Check the object reference ``node`` (a dict with a picker field); its class name."""
    cls_name, module, registered = (node.get(k) for k in ("class_name", "module", "registered_name"))
    allowed = _allowed_classes()
    if not isinstance(cls_name, str) or cls_name not in allowed or "spec_name" in node:
        raise ExportError(f"{source}: class {_short(cls_name)} is not built into tf-keras (its layers but Lambda, "
                          "initializers, regularizers, constraints, models); refusing to load it")
    if registered not in (None, cls_name) or not _resolves_to(allowed[cls_name], cls_name, module):
        raise ExportError(f"{source}: class {cls_name!r} with module {_short(module)} and registered name "
                          f"{_short(registered)} would load another class than tf-keras's {cls_name}; refusing "
                          "to load it")
    return cls_name


def _check_fields(node: dict, owner: str | None, source: str) -> None:
    """Check the plain fields of a dict: ``owner`` is the class whose ``config`` it is, if any."""
    if any(k in node for k in _CODE_FIELDS):
        raise ExportError(f"{source}: a config field that carries Python code ({', '.join(_CODE_FIELDS)}); "
                          "refusing to load it")
    if "function" in node and (owner not in _OP_LAMBDAS or node["function"] not in OP_LAMBDA_FUNCTIONS):
        raise ExportError(f"{source}: layer {owner} names TF function {_short(node['function'])}, which is not on "
                          "the list of pure tensor functions a Keras file may call; refusing to load it")
    for key in _ACTIVATION_KEYS:
        if isinstance(node.get(key), str) and node[key] not in ACTIVATIONS:
            raise ExportError(f"{source}: activation {_short(node[key])} is not one of tf-keras's built-in "
                              "activations; refusing to load it")


def check_config_safe(config: Any, source: str) -> None:
    """Refuse a model config that could make tf-keras build anything but its own built-in objects.

    Every dict at any depth (layers, nested models, wrappers, cells, initializers, regularizers,
    constraints, dtype policies, inbound nodes and their arguments) is checked, and every field
    tf-keras picks a class or a function by is decided on an allowlist: ``class_name`` a built-in
    class (:func:`_allowed_classes`; never ``Lambda`` nor the ``function``/``__lambda__`` specials),
    ``registered_name`` absent or that same name, ``module`` a public tf-keras namespace holding that
    class or the class's own module. ``TFOpLambda``/``SlicingOpLambda`` may name only a TF API symbol
    of :data:`OP_LAMBDA_FUNCTIONS`, a string activation only one of :data:`ACTIVATIONS`; a field that
    carries code (``function_type``...) is refused wherever it stands.

    Raises:
        ExportError: the first field that is not allowed (its value shortened).
    """
    if not (isinstance(config, dict) and config.get("class_name") in ("Functional", "Model", "Sequential")):
        raise ExportError(f"{source}: malformed model config (not a tf-keras model)")
    stack: list[tuple[Any, str | None]] = [(config, None)]
    while stack:  # iterative: a config may nest as deep as its JSON reader allows
        node, owner = stack.pop()
        if isinstance(node, list):
            stack.extend((value, None) for value in node)
        elif isinstance(node, dict):
            _check_fields(node, owner, source)
            cls_name = _check_object(node, source) if any(k in node for k in _PICKERS) else None
            stack.extend((value, cls_name if key == "config" else None) for key, value in node.items())


def _read_config(path: Path) -> Any:
    """The model config of a ``.keras`` (after :func:`check_archive`) or ``.h5`` file, read within its limit."""
    try:
        if path.suffix == ".keras":
            return jsonio.loads(check_archive(path), f"{path}:config.json")
        with h5py.File(path, "r") as f:
            if "model_config" not in f.attrs:
                raise ExportError(f"{path} holds no model config")
            size = f.attrs.get_id("model_config").get_storage_size()
            if size > jsonio.MAX_JSON_BYTES:
                raise ExportError(f"{path}: a model config of {size} bytes, over {jsonio.MAX_JSON_BYTES}")
            return jsonio.loads(f.attrs.get("model_config"), f"{path}:model_config")
    except ExportError:
        raise
    except Exception as e:  # zip, h5 and JSON errors alike mean "not a model file"
        raise ExportError(f"{path} is not a readable Keras model file: {type(e).__name__}: {_short(str(e))}") from e


def check_archive(path: Path) -> bytes:
    """Check a ``.keras`` archive before tf-keras opens it; its ``config.json``.

    Only the members tf-keras writes (:data:`MAX_ARCHIVE_MEMBERS`) may be there, each stored or
    deflated, its declared size within its limit; every one is inflated here
    (:class:`policy.zipio.Archive`) in chunks that stop at that limit and at its declared size
    (which can lie), its CRC checked, so nothing tf-keras reads afterwards inflates past it.

    Raises:
        ExportError: a link or not a regular file, another member, a member over its limit (declared
            or inflated), a damaged archive.
    """
    archive = Archive(path, str(path), allowed=lambda name: name in MAX_ARCHIVE_MEMBERS,
                      max_members=len(MAX_ARCHIVE_MEMBERS), limit=MAX_ARCHIVE_MEMBERS.__getitem__,
                      total=sum(MAX_ARCHIVE_MEMBERS.values()), error=ExportError)
    with archive:
        if "config.json" not in archive:
            raise ExportError(f"{path}: members {_short(sorted(archive.names))}; a Keras file holds config.json "
                              f"and only {', '.join(n for n in MAX_ARCHIVE_MEMBERS if n != 'config.json')} besides")
        for name in archive.names:
            if name != "config.json":
                archive.check(name)
        return archive.read("config.json")


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
