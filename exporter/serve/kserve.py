"""The KServe v2 inference requests the ``serve`` front lets through to Triton, checked against the
model they are sent to before the server sees them: :func:`check_infer` raises :class:`Refused`
(400, or 413 for a tensor above :data:`MAX_TENSOR_BYTES`) for anything else.

``tritonserver`` 2.51 allocates an input from the shape and data type a JSON request declares
before it checks them against the model, reads a repeated JSON key by its first value, and answers
several client errors with 500. So the request's JSON header is read strictly (a key repeated in
any object, ``NaN``/``Infinity``, a number that overflows a double, an integer of more than
:data:`MAX_INT_DIGITS` digits, text that is not UTF-8: refused), and then only this passes:

- an object of ``id`` (a string), ``parameters``, ``inputs`` (a non-empty list) and ``outputs``;
- request parameters: Triton's own (:data:`REQUEST_PARAMETERS`, each of its type) and others
  whose values are strings, integers, booleans or finite numbers (at most :data:`MAX_PARAMETERS`);
- each input an object of ``name``, ``shape``, ``datatype``, ``parameters`` and ``data``, named
  once, by an input the model takes, with the model's data type, rank, fixed dimensions and batch
  limit, a shape of at most :data:`MAX_RANK` non-negative integers whose elements the request's
  bytes can carry and whose bytes (elements x the data type's size) are at most
  :data:`MAX_TENSOR_BYTES`; its values either in ``data`` (nested lists holding exactly the
  shape's element count, each of the data type's JSON type and within its range: booleans for
  ``BOOL``, integers for the integer types, finite numbers for the float types) or in binary after
  the JSON header (``binary_data_size``, the shape's bytes exactly, the binary parts filling the
  body after the header; floats finite, booleans 0 or 1); every input the model requires present;
- each requested output an object of ``name`` (an output of the model, once) and ``parameters``
  (``binary_data``, a boolean; ``classification``, a non-negative integer).

:func:`parse_cost` bounds the memory reading a JSON header takes (Python's objects for it), which
the front reserves before it reads one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from policy_export.exporter.serve.http1 import Refused, clip
from policy_export.exporter.serve.models import ServedModel, Wire
from policy_export.policy.jsonio import is_utf8

MAX_RANK = 16
MAX_TENSOR_BYTES = 64 << 20  # one request's tensors, elements x size, as tritonserver allocates them
MAX_INT_DIGITS = 30  # as the package's strict JSON reader (policy/jsonio.py)
MAX_PARAMETERS = 64
MAX_TEXT = 1024  # characters of an id or a string parameter
MAX_NAME = 256
INT64 = (-(1 << 63), (1 << 63) - 1)
# numpy dtype -> (KServe data type, bytes per element); BYTES (strings) is no contract dtype
DATATYPES = {"bool": ("BOOL", 1), "uint8": ("UINT8", 1), "uint16": ("UINT16", 2), "uint32": ("UINT32", 4),
             "uint64": ("UINT64", 8), "int8": ("INT8", 1), "int16": ("INT16", 2), "int32": ("INT32", 4),
             "int64": ("INT64", 8), "float16": ("FP16", 2), "float32": ("FP32", 4), "float64": ("FP64", 8)}
# the smallest magnitude each float type rounds to infinity (max + half an ulp)
FLOAT_OVERFLOW = {"float16": (2 - 2 ** -11) * 2.0 ** 15, "float32": (2 - 2 ** -24) * 2.0 ** 127,
                  "float64": math.inf}
REQUEST_KEYS = ("id", "parameters", "inputs", "outputs")
INPUT_KEYS = ("name", "shape", "datatype", "parameters", "data")
OUTPUT_KEYS = ("name", "parameters")
UINT = "a non-negative integer"
# Triton's own parameters and their types (tritonclient sends these); others are passed on to the model
REQUEST_PARAMETERS = {"sequence_id": "id", "sequence_start": "bool", "sequence_end": "bool", "priority": UINT,
                      "timeout": UINT, "binary_data_output": "bool"}
INPUT_PARAMETERS = {"binary_data_size": UINT}
OUTPUT_PARAMETERS = {"binary_data": "bool", "classification": UINT}
KINDS = {"bool": "a boolean", "id": "a non-negative integer or a string", UINT: UINT,
         None: "a string, an integer, a boolean or a number"}
# parse_cost: bytes of Python objects per byte of JSON text, and per container or key (see the tests)
COST_PER_BYTE = 16  # the text as a str (up to 4 bytes a character), a list slot and a float per 4 bytes
COST_PER_QUOTE = 32  # half a str object
COST_PER_CONTAINER = 200  # a list, or a dict and its key (a pair while it is built)
CHUNK_ELEMENTS = 1 << 20  # binary values checked this many at a time


def parse_cost(body: bytes | bytearray, end: int | None = None) -> int:
    """An upper bound of the memory :func:`check_infer` takes to read the JSON text ``body[:end]``
    (its Python objects: the text, a list slot and a number for each value, a str for each pair of
    quotes, a list or dict for each bracket or key; measured on the worst cases by the tests)."""
    end = len(body) if end is None else end
    containers = sum(body.count(c, 0, end) for c in (b"[", b"{", b":"))
    return COST_PER_BYTE * end + COST_PER_QUOTE * body.count(b'"', 0, end) + COST_PER_CONTAINER * containers


def json_length(header_length: str | None, body_length: int) -> int:
    """The bytes of a body of ``body_length`` that are its JSON header: ``Inference-Header-Content-Length``
    (``header_length``), or the whole body without it.

    Raises:
        Refused: a header length that is not ASCII digits within the body.
    """
    if header_length is None:
        return body_length
    if not re.fullmatch(r"[0-9]{1,19}", header_length) or not 0 < int(header_length) <= body_length:
        raise Refused(400, f"Inference-Header-Content-Length {clip(header_length, 20)} is not within the body's "
                           f"{body_length} bytes")
    return int(header_length)


def split_body(body: bytes | bytearray | memoryview, header_length: str | None) -> tuple[memoryview, memoryview]:
    """The JSON header and the binary data of an inference request's ``body`` (see :func:`json_length`)."""
    view = memoryview(body).cast("B")
    end = json_length(header_length, len(view))
    return view[:end], view[end:]


def check_infer(model: ServedModel, body: bytes | bytearray | memoryview, header_length: str | None) -> None:
    """Raises :class:`Refused` unless ``body`` is an inference request for ``model`` the server may
    be given (see the module's description)."""
    header, binary = split_body(body, header_length)
    doc = decode(header)
    if not isinstance(doc, dict):
        raise Refused(400, "the request has no 'inputs' list")
    _keys(doc, REQUEST_KEYS, "the request")
    if "id" in doc:
        _text(doc["id"], "the request's 'id'")
    _parameters(doc.get("parameters"), REQUEST_PARAMETERS, "the request", custom=True)
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise Refused(400, "the request has no 'inputs' list")
    wires = {w.key: w for w in model.inputs}
    seen: set[str] = set()
    binary_sizes: list[tuple[Wire, int]] = []
    total = 0
    for item in inputs:
        wire, size, nbytes = _input(model, wires, item, len(body), seen, log_request(doc))
        total += nbytes
        if total > MAX_TENSOR_BYTES:
            raise Refused(413, f"the request's inputs are {total} bytes, more than the {MAX_TENSOR_BYTES} served "
                               "in one request")
        if size is not None:
            binary_sizes.append((wire, size))
    missing = [w.key for w in model.inputs if not w.optional and w.key not in seen]
    if missing:
        raise Refused(400, f"model {model.name!r} needs input {', '.join(map(repr, missing))}, which the "
                           "request does not have")
    _outputs(model, doc.get("outputs"))
    _check_binary(binary_sizes, binary)


def decode(text: bytes | memoryview) -> Any:
    """The JSON document ``text``, read strictly (see the module's description).

    Raises:
        Refused: text that is not UTF-8 or not JSON, or that breaks a rule.
    """
    try:
        return _DECODER.decode(str(text, "utf-8"))
    except _Bad as e:
        problem = str(e)
    except UnicodeDecodeError as e:
        problem = f"not UTF-8 text ({e.reason} at byte {e.start})"
    except RecursionError:
        problem = "nested too deeply"
    except ValueError as e:  # json.JSONDecodeError and whatever else the decoder raises on odd text
        problem = str(e)[:120]
    raise Refused(400, f"the request is not a JSON inference request: {problem}")


class _Bad(ValueError):
    """Raised by the decoder's hooks."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Bad(f"the key {clip(key)} appears twice in one object")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise _Bad(f"{name} is not a JSON number")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Bad(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Bad(f"the number {clip(text)} overflows a double")
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_int, parse_float=_float)


def _keys(doc: dict, allowed: Sequence[str], what: str) -> None:
    extra = [k for k in doc if k not in allowed]
    if extra:
        raise Refused(400, f"{what} has the key {clip(extra[0])}; it may have {', '.join(allowed)}")


def _text(value: Any, what: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str) or len(value) > limit or not is_utf8(value):
        raise Refused(400, f"{what} must be UTF-8 text of at most {limit} characters")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parameters(params: Any, known: dict[str, str], what: str, custom: bool = False) -> dict[str, Any]:
    """``params`` (``None`` for none) checked: ``known`` names with their types and, where
    ``custom``, other names whose values are strings, integers, booleans or finite numbers."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise Refused(400, f"{what}'s 'parameters' must be an object")
    if len(params) > MAX_PARAMETERS:
        raise Refused(400, f"{what} has more than {MAX_PARAMETERS} parameters")
    for name, value in params.items():
        kind = known.get(name)
        if kind is None:
            if not custom:
                raise Refused(400, f"{what}: the parameter {clip(name)} is not served here (it may have "
                                   f"{', '.join(known)})")
            _text(name, f"{what}: a parameter's name", MAX_NAME)
            if isinstance(value, str):
                _text(value, f"{what}: the parameter {clip(name)}")
        if not _of_kind(value, kind):
            raise Refused(400, f"{what}: the parameter {clip(name)} must be {KINDS[kind]}")
    return params


def _of_kind(value: Any, kind: str | None) -> bool:
    """Whether a parameter's ``value`` is of ``kind`` (``None``: a custom parameter's types)."""
    if kind == "bool":
        return isinstance(value, bool)
    if kind == UINT:
        return _is_int(value) and 0 <= value <= INT64[1]
    if kind == "id":
        return isinstance(value, str) or _is_int(value) and 0 <= value <= INT64[1]
    return isinstance(value, (bool, float, str)) or _is_int(value) and INT64[0] <= value <= INT64[1]


def log_request(doc: dict) -> str:
    """What tritonserver puts before a request's errors: ``[request id: ID] `` (``<id_unknown>``
    for a request without an ``id``)."""
    return f"[request id: {doc.get('id') or '<id_unknown>'}] "


def _input(model: ServedModel, wires: dict[str, Wire], item: Any, body_bytes: int,
           seen: set[str], prefix: str = "") -> tuple[Wire, int | None, int]:
    """One input checked; returns its wire, its ``binary_data_size`` (``None`` for JSON data) and
    its bytes as the server allocates them. Past the checks of its form, in tritonserver's own
    order and words (``prefix``: :func:`log_request`): a batch dimension, the batch size, the data
    type, the dims."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise Refused(400, "an input of the request is not an object with a name")
    name = item["name"]
    _keys(item, INPUT_KEYS, f"input {clip(name)}")
    shape = item.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_int(d) and d >= 0 for d in shape):
        raise Refused(400, f"input {clip(name)}: 'shape' must be a list of at most {MAX_RANK} non-negative integers")
    wire = wires.get(name)
    if wire is None:
        raise Refused(400, f"unexpected inference input {clip(name)} for model {model.name!r}")
    count = math.prod(shape)
    if count > body_bytes:  # every element takes at least a byte, in JSON or in binary data
        raise Refused(400, f"input {name!r}: shape {shape} declares {count} elements, more than the "
                           f"request's {body_bytes} bytes can carry")
    if name in seen:
        raise Refused(400, f"input {name!r} already exists in request")
    seen.add(name)
    datatype, size = DATATYPES[np.dtype(wire.spec.dtype).name]
    if model.batched:
        if not shape:
            raise Refused(400, f"{prefix}input {name!r} has no shape but model requires batch dimension for "
                               f"{model.name!r}")
        if shape[0] > model.max_batch_size:
            raise Refused(400, f"{prefix}inference request batch-size must be <= {model.max_batch_size} for "
                               f"{model.name!r}")
    if item.get("datatype") != datatype:
        got = item.get("datatype")
        shown = clip(got) if isinstance(got, str) else f"a JSON {type(got).__name__}"
        raise Refused(400, f"{prefix}inference input {name!r} data-type is {shown}, but model {model.name!r} expects "
                           f"{datatype!r}")
    _check_dims(model, name, wire.dims, shape, prefix)
    nbytes = count * size
    if nbytes > MAX_TENSOR_BYTES:
        raise Refused(413, f"input {name!r}: shape {shape} of {datatype} is {nbytes} bytes, more than the "
                           f"{MAX_TENSOR_BYTES} served in one request")
    params = _parameters(item.get("parameters"), INPUT_PARAMETERS, f"input {name!r}")
    if "binary_data_size" in params:
        if "data" in item:
            raise Refused(400, f"input {name!r} has both 'data' and binary data")
        if params["binary_data_size"] != nbytes:
            raise Refused(400, f"input {name!r}: binary_data_size is {params['binary_data_size']}, but shape "
                               f"{shape} of {datatype} is {nbytes} bytes")
        return wire, nbytes, nbytes
    if "data" not in item:
        raise Refused(400, f"input {name!r} has neither 'data' nor binary data")
    _check_data(name, item["data"], np.dtype(wire.spec.dtype).name, datatype, count)
    return wire, None, nbytes


BATCH_NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
              "prepended to each input shape. If you want to specify the full shape including the batch dim in "
              "your input dims config, try setting max_batch_size to zero. See the model configuration docs for "
              "more info on max_batch_size.")


def _dims_text(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in dims) + "]"


def _check_dims(model: ServedModel, name: str, dims: Sequence[int], shape: list[int], prefix: str = "") -> None:
    """The shape of an input ``model`` takes against its declared ``dims``, in tritonserver's words
    (``InferenceRequest::Normalize``)."""
    expected = ([-1] if model.batched else []) + list(dims)
    if len(shape) != len(expected) or any(e >= 0 and d != e for d, e in zip(shape, expected)):
        raise Refused(400, f"{prefix}unexpected shape for input {name!r} for model {model.name!r}. Expected "
                           f"{_dims_text(expected)}, got {_dims_text(shape)}. {BATCH_NOTE if model.batched else ''}")


def _check_data(name: str, data: Any, dtype: str, datatype: str, count: int) -> None:
    """JSON ``data``: nested lists of ``count`` values of ``datatype``'s JSON type and range."""
    if not isinstance(data, list):
        raise Refused(400, f"input {name!r}: 'data' must be a list")
    if datatype in ("FP16", "FP32", "FP64"):
        kinds, bound = {int, float}, FLOAT_OVERFLOW[dtype]  # values must be below it, in magnitude
        low = high = None
        what = f"finite numbers within {datatype}'s range"
    elif datatype == "BOOL":
        kinds, bound, low, high, what = {bool}, None, None, None, "booleans"
    else:
        info = np.iinfo(dtype)
        kinds, bound, low, high = {int}, None, int(info.min), int(info.max)
        what = f"integers within {datatype}'s range ({low}..{high})"
    values, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_RANK:
            raise Refused(400, f"input {name!r}: 'data' is nested more than {MAX_RANK} deep")
        types = set(map(type, node))
        if list in types:
            if len(types) > 1:
                raise Refused(400, f"input {name!r}: 'data' mixes lists and values at one level")
            stack.extend((child, depth + 1) for child in node)
            continue
        values += len(node)
        if not node:
            continue
        if not types <= kinds or (bound is not None and (min(node) <= -bound or max(node) >= bound)) or \
                (low is not None and (min(node) < low or max(node) > high)):
            raise Refused(400, f"input {name!r}: 'data' must hold {what}")
    if values != count:
        raise Refused(400, f"input {name!r}: 'data' holds {values} values, shape declares {count}")


def _outputs(model: ServedModel, outputs: Any) -> None:
    if outputs is None:
        return
    names = [w.key for w in model.outputs]
    if not isinstance(outputs, list):
        raise Refused(400, "the request's 'outputs' must be a list")
    seen: set[str] = set()
    for item in outputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise Refused(400, "an output of the request is not an object with a name")
        name = item["name"]
        _keys(item, OUTPUT_KEYS, f"output {clip(name)}")
        if name not in names:
            raise Refused(400, f"unexpected inference output {clip(name)} for model {model.name!r} (it gives "
                               f"{', '.join(names)})")
        if name in seen:
            raise Refused(400, f"output {name!r} is requested twice")
        seen.add(name)
        _parameters(item.get("parameters"), OUTPUT_PARAMETERS, f"output {name!r}")


def _check_binary(sizes: list[tuple[Wire, int]], binary: memoryview) -> None:
    """The binary parts after the JSON header: exactly the declared sizes, in the inputs' order;
    floats finite, booleans 0 or 1."""
    declared = sum(size for _, size in sizes)
    if declared != len(binary):
        raise Refused(400, f"the request's binary data is {len(binary)} bytes after its JSON header, its inputs "
                           f"declare {declared}")
    offset = 0
    for wire, size in sizes:
        dtype = np.dtype(wire.spec.dtype).newbyteorder("<")
        values = np.frombuffer(binary, dtype=dtype, count=size // dtype.itemsize, offset=offset)
        offset += size
        for start in range(0, len(values), CHUNK_ELEMENTS):
            chunk = values[start:start + CHUNK_ELEMENTS]
            if dtype.kind == "f" and not np.isfinite(chunk).all():
                raise Refused(400, f"input {wire.key!r}: the binary data holds a value that is not finite (NaN or "
                                   "infinity)")
            if dtype.kind == "b" and chunk.view(np.uint8).max(initial=0) > 1:
                raise Refused(400, f"input {wire.key!r}: the binary data holds a boolean other than 0 or 1")
