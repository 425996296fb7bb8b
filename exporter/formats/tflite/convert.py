"""TFLite (float32 and dynamic-range int8): conversion, and the file check the runner uses.

The export's frozen serving graph is wrapped as ``tf.function``s whose dict inputs and outputs
are the signature keys (``wrap_function`` + ``prune``), saved as a temporary SavedModel and
converted with ``TFLiteConverter.from_saved_model``, so the file holds named SignatureDefs under
the same keys: ``serving_default`` takes the required inputs alone (optional inputs folded to
their defaults: TFLite has no optional inputs, and a client feeding what the contract calls
required must get the deterministic policy), and ``serving_explore`` (``serving_all_inputs``
without an explore input) takes every input. Only builtin ops are allowed
(``TFLITE_BUILTINS``; no Flex, no custom ops). Seeds of the random ops are zeroed first: TFLite
prepares an ``IF`` branch again on every invoke, so a seeded ``MULTINOMIAL`` inside the explore
branch would return the same draw every call. Where the explore branch does not convert with
builtins, the model is converted with every optional input fixed to its default (the
deterministic path alone) and explore is refused (the format record says so).
"""

from __future__ import annotations

import copy
import itertools
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.errors import ConversionError, ExportError

log = logging.getLogger(__name__)

SIGNATURE_KEY = "serving_default"
EXPLORE_SIGNATURE = "serving_explore"
ALL_INPUTS_SIGNATURE = "serving_all_inputs"
TFLITE_IDENTIFIER = b"TFL3"
_COUNTER = itertools.count()



def strip_seeds(graph_def):
    """A copy of ``graph_def`` with ``seed``/``seed2`` zeroed on every node (graph and function
    library): unseeded random ops draw afresh on every TFLite invoke."""
    import tensorflow as tf

    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    for node in [*out.node, *(n for f in out.library.function for n in f.node_def)]:
        if "seed" in node.attr and "seed2" in node.attr:
            node.attr["seed"].i = 0
            node.attr["seed2"].i = 0
    return out


def _unique_functions(graph_def) -> None:
    """Rename every library function of ``graph_def`` (in place) with a suffix unique in this
    process: importing a GraphDef into the eager context registers its functions, and a second,
    different function of the same name (another export, a seed-stripped copy) is refused."""
    library = {f.signature.name for f in graph_def.library.function}
    if not library:
        return
    suffix = f"_pe{next(_COUNTER)}"

    def fix(attrs) -> None:
        for value in attrs.values():
            if value.HasField("func") and value.func.name in library:
                value.func.name += suffix
            if value.HasField("list"):
                for func in value.list.func:
                    if func.name in library:
                        func.name += suffix

    for node in [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]:
        fix(node.attr)
    for function in graph_def.library.function:
        function.signature.name += suffix
    for grad in graph_def.library.gradient:
        if grad.function_name in library:
            grad.function_name += suffix
        if grad.gradient_func in library:
            grad.gradient_func += suffix


def _concrete_function(graph_def, signature, fix_optional: bool):
    """A concrete function over ``graph_def`` taking and returning dicts keyed by signature keys,
    and the ``tf.Module`` that carries it (so the converter writes a SignatureDef).

    ``fix_optional``: optional inputs become constants holding their defaults (the converter then
    folds the explore branch away); otherwise they are inputs like the required ones.
    """
    import tensorflow as tf

    tf1 = tf.compat.v1
    graph_def = copy.deepcopy(graph_def)
    _unique_functions(graph_def)
    contract = signature.contract
    present = {n.name for n in graph_def.node}
    names = {k: t.name for k, t in signature.inputs.items() if t.op.name in present}
    fixed = {s.key: s for s in contract.inputs if not s.required and s.key in names} if fix_optional else {}

    def imported():
        input_map = {names[k]: tf.constant(np.asarray(s.default, np.dtype(s.dtype))) for k, s in fixed.items()}
        tf1.import_graph_def(graph_def, input_map=input_map, name="")

    wrapped = tf1.wrap_function(imported, [])
    graph = wrapped.graph
    keys = [s.key for s in contract.inputs if s.key in names and s.key not in fixed]
    pruned = wrapped.prune(feeds=[graph.get_tensor_by_name(names[k]) for k in keys],
                           fetches={k: graph.get_tensor_by_name(t.name) for k, t in signature.outputs.items()})
    specs = {s.key: tf.TensorSpec(s.shape, tf.as_dtype(np.dtype(s.dtype)), name=s.key)
             for s in contract.inputs if s.key in keys}

    @tf.function(input_signature=[specs])
    def serving_default(feeds):
        return dict(pruned(*[feeds[k] for k in keys]))

    module = tf.Module()
    module.serving_default = serving_default
    return serving_default.get_concrete_function(), module, sorted(fixed)


def full_signature_key(signature) -> str:
    """The name of the signature that takes every input: ``serving_explore`` where the policy
    has an ``explore`` input, else ``serving_all_inputs``."""
    from policy_export.signatures.keys import EXPLORE

    return EXPLORE_SIGNATURE if EXPLORE in signature.inputs else ALL_INPUTS_SIGNATURE


def convert_tflite(graph_def, signature, *, quantize: bool = False, with_optional: bool = False) -> tuple[bytes, list[str]]:
    """The ``.tflite`` bytes of ``graph_def`` (builtin ops only) and the optional inputs that
    ``serving_default`` fixes to their defaults.

    ``serving_default`` takes the required inputs alone (what the contract promises a client:
    the optional ones hold their defaults, so it is the deterministic path). ``with_optional``
    adds a second signature (:func:`full_signature_key`) taking every input, ``explore`` to
    sample. ``quantize``: dynamic-range int8 (``Optimize.DEFAULT``, no representative data).

    Raises:
        ExportError: the converter fails (an op without a builtin kernel, say).
    """
    import tempfile

    import tensorflow as tf

    from policy_export.exporter.quiet import library_output, without_converter_summary

    try:
        stripped = strip_seeds(graph_def)
        function, module, fixed = _concrete_function(stripped, signature, fix_optional=True)
        functions = {SIGNATURE_KEY: function}
        if with_optional and fixed:
            functions[full_signature_key(signature)] = _concrete_function(stripped, signature, fix_optional=False)[0]
        for name, fn in functions.items():
            setattr(module, name, fn)
        with tempfile.TemporaryDirectory(prefix="policy_export_tflite_") as tmp:
            tf.saved_model.save(module, tmp, signatures=functions)
            converter = tf.lite.TFLiteConverter.from_saved_model(tmp, signature_keys=list(functions))
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
            if quantize:
                converter.optimizations = [tf.lite.Optimize.DEFAULT]
            with library_output(without_converter_summary):
                data = converter.convert()
    except ExportError:
        raise
    except Exception as e:  # the converter raises ConverterError, ValueError, ...
        raise ExportError(f"TFLite conversion (builtin ops only) failed: {type(e).__name__}: {_converter_problem(e)}") from e
    return bytes(data), fixed


def _converter_problem(error: Exception) -> str:
    """The converter's message, first line, with the TensorFlow ops it could not lower (and where
    they sit, as the converter locates them) named."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    ops = sorted(set(re.findall(r"\btf\.([A-Z]\w*)", text)))
    places = sorted(set(re.findall(r'loc\((?:fused\[)?"([^"]+)"', text)))[:5]
    if ops:
        first += f" (ops LiteRT's builtins lack: {', '.join(ops)}" + (f"; at {', '.join(places)}" if places else "") + ")"
    return first


def check_litert_runs(data: bytes, what: str) -> str:
    """Load ``data`` in the LiteRT interpreter this machine has and allocate its tensors, which
    resolves every op against the interpreter's own op resolver; returns the interpreter's origin.

    Raises:
        ConversionError: the interpreter has no kernel for an op of the model (named, with its version).
    """
    from policy_export.exporter.formats.tflite.interpreter import create_interpreter, interpreter_class

    cls, origin = interpreter_class()
    try:
        create_interpreter(cls, model_content=data)
    except (RuntimeError, ValueError) as e:
        found = re.findall(r"[Dd]idn't find (?:op|custom op) for (?:builtin opcode )?'?([\w-]+)'?(?: version '?(\d+)'?)?", str(e))
        named = ", ".join(f"{op} version {v}" if v else op for op, v in found) or str(e).strip().splitlines()[0]
        raise ConversionError(f"{what}: the LiteRT interpreter ({origin}) cannot run it: no kernel for {named}") from e
    return origin


def tflite_ops(data: bytes) -> list[str]:
    """The builtin op names a ``.tflite`` model uses (all subgraphs), sorted."""
    try:
        from tensorflow.lite.python import schema_py_generated as schema
    except ImportError:  # pragma: no cover - layout of older TF builds
        return []
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(data, 0))
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    ops = set()
    for code in model.operatorCodes or []:
        value = max(code.builtinCode, code.deprecatedBuiltinCode)
        ops.add(names.get(value, f"CUSTOM:{code.customCode!r}" if code.customCode else str(value)))
    return sorted(ops)


def write_tflite(ctx: ExportContext, target: Path, name: str, quantize: bool) -> FormatRecord:
    """Write ``model.tflite`` (float32, explore kept where builtins express it) or its
    dynamic-range int8 twin (the deterministic path: optional inputs fixed to their defaults)."""
    graph_def = ctx.frozen_graph_def()
    explore_refused = None
    full = full_signature_key(ctx.signature)
    if quantize:
        data, fixed = convert_tflite(graph_def, ctx.signature, quantize=True)
    else:
        try:
            data, fixed = convert_tflite(graph_def, ctx.signature, with_optional=True)
        except ExportError as e:
            explore_refused = f"sampling is not expressible with TFLite builtin ops ({e})"
            log.warning("%s: %s; writing the deterministic path alone", name, explore_refused)
            data, fixed = convert_tflite(graph_def, ctx.signature)
    interpreter = check_litert_runs(data, f"{name} ({target.name})")
    target.write_bytes(data)
    from policy_export.signatures.keys import EXPLORE

    with_full = not quantize and explore_refused is None and bool(fixed)
    required = [s.key for s in ctx.signature.contract.inputs if s.required]
    details: dict[str, Any] = {
        "signature": SIGNATURE_KEY, "ops": tflite_ops(data), "fixed_inputs": fixed,
        "signatures": {SIGNATURE_KEY: "the required inputs alone; optional inputs hold their defaults "
                                      "(deterministic)" + (f"; {full} takes every input" if with_full else "")},
        "quantization": "dynamic-range int8 weights (tensors of 1024 elements or more)" if quantize else "none (float32)",
        "explores": EXPLORE in ctx.signature.inputs and with_full,
        "required_inputs": required,
        "op_coverage": f"every op resolved by the LiteRT interpreter ({interpreter}) before writing",
    }
    if with_full:
        details["signatures"][full] = "every input, optional ones included" + (
            " (explore true samples)" if EXPLORE in ctx.signature.inputs else "")
    if EXPLORE in ctx.signature.inputs and not with_full:
        details["explore_refused"] = explore_refused or "a lossy format serves the deterministic path alone"
    return FormatRecord(name, (target.name,), details)


def check_tflite_file(path: Path) -> None:
    """Raises ExportError when ``path`` is not a TFLite flatbuffer (checked before any interpreter loads it)."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path} does not exist")
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[4:8] != TFLITE_IDENTIFIER:
        raise ExportError(f"{path} is not a TFLite model (no {TFLITE_IDENTIFIER.decode()} identifier)")
