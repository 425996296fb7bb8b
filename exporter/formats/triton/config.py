"""``config.pbtxt``: Triton's model configuration (a ``ModelConfig`` text proto) for one ONNX model,
written from the model's own inputs and outputs so names, data types and dims agree with it.

With ``max_batch_size > 0`` every input and output is batched on its first dimension and ``dims``
leave it out; a tensor that is ``[batch]`` alone is declared ``dims: [ 1 ]`` with
``reshape: { shape: [ ] }`` (Triton's way to say "one value per request"). In the sampling model,
which does not batch, a tensor that is ``[batch]`` alone is ``dims: [ -1, 1 ]`` with
``reshape: { shape: [ -1 ] }`` (:func:`rows_as_column`), so a client sends and receives it as
``[rows, 1]`` from either model (Triton's core applies the reshape to the request's input and to
the response's output). A scalar of a model that does not batch is ``dims: [ 1 ]`` without a
reshape: Triton's core refuses an empty reshape in a model that does not batch, and its ONNX
Runtime backend accepts ``[ 1 ]`` for a scalar model input and feeds it as one. Implicit state
(``sequence_batching.state``) replaces the state inputs and outputs, which are then not listed as
inputs or outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from policy_export.errors import ConversionError

# ONNX TensorProto element types -> Triton data types
TRITON_TYPES = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 4: "TYPE_UINT16", 5: "TYPE_INT16", 6: "TYPE_INT32",
                7: "TYPE_INT64", 9: "TYPE_BOOL", 10: "TYPE_FP16", 11: "TYPE_FP64", 12: "TYPE_UINT32",
                13: "TYPE_UINT64", 16: "TYPE_BF16"}
MAX_SEQUENCE_IDLE_US = 60_000_000


@dataclass(frozen=True)
class Tensor:
    """A model input or output as the config declares it."""

    name: str
    data_type: str
    dims: tuple[int, ...]  # without the batch dimension when the model batches
    reshape: tuple[int, ...] | None = None
    optional: bool = False


@dataclass(frozen=True)
class ModelConfig:
    name: str
    max_batch_size: int
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    states: tuple[tuple[Tensor, str], ...] = ()  # (state input, its output's name)
    control_start: str | None = None
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 100
    version: int = 1
    notes: Sequence[str] = field(default_factory=tuple)


def value_tensor(value_info, batched: bool, optional: bool = False) -> Tensor:
    """The config entry of an ONNX graph input or output."""
    t = value_info.type.tensor_type
    if t.elem_type not in TRITON_TYPES:
        raise ConversionError(f"{value_info.name!r}: ONNX element type {t.elem_type} has no Triton data type")
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    if batched:
        if not dims:
            raise ConversionError(f"{value_info.name!r} is a scalar; a model that batches needs a batch dimension "
                                  "on every input and output")
        if dims[0] not in (-1,):
            raise ConversionError(f"{value_info.name!r} has a fixed first dimension {dims[0]}; Triton batches on "
                                  "the first dimension, which must be open")
        dims = dims[1:]
    if not dims:  # one value per request: [batch] in a model that batches, a scalar in one that does not
        return Tensor(value_info.name, TRITON_TYPES[t.elem_type], (1,), () if batched else None, optional)
    return Tensor(value_info.name, TRITON_TYPES[t.elem_type], tuple(dims), None, optional)


def _dims(values: Iterable[int]) -> str:
    return "[ " + ", ".join(str(int(v)) for v in values) + " ]"


def _tensor_text(t: Tensor) -> list[str]:
    lines = ["  {", f'    name: "{t.name}"', f"    data_type: {t.data_type}", f"    dims: {_dims(t.dims)}"]
    if t.reshape is not None:
        lines.append(f"    reshape: {{ shape: {_dims(t.reshape)} }}")
    if t.optional:
        lines.append("    optional: true")
    lines.append("  }")
    return lines


def _section(key: str, tensors: Sequence[Tensor]) -> list[str]:
    if not tensors:
        return []
    body = []
    for i, t in enumerate(tensors):
        part = _tensor_text(t)
        if i < len(tensors) - 1:
            part[-1] += ","
        body += part
    return [f"{key} [", *body, "]"]


def _sequence_text(config: ModelConfig) -> list[str]:
    lines = ["sequence_batching {", f"  max_sequence_idle_microseconds: {MAX_SEQUENCE_IDLE_US}"]
    if config.control_start:
        lines += ["  control_input [", "    {", f'      name: "{config.control_start}"',
                  "      control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ]", "    }", "  ]"]
    lines.append("  state [")
    for i, (state, output) in enumerate(config.states):
        lines += ["    {", f'      input_name: "{state.name}"', f'      output_name: "{output}"',
                  f"      data_type: {state.data_type}", f"      dims: {_dims(state.dims)}",
                  "      initial_state: {", f"        data_type: {state.data_type}", f"        dims: {_dims(state.dims)}",
                  "        zero_data: true", '        name: "zero"', "      }",
                  "    }" + ("," if i < len(config.states) - 1 else "")]
    lines += ["  ]", "}"]
    return lines


def render(config: ModelConfig) -> str:
    """The ``config.pbtxt`` text of ``config``."""
    lines = [f"# {note}" for note in config.notes]
    lines += [f'name: "{config.name}"', 'backend: "onnxruntime"', f"max_batch_size: {config.max_batch_size}"]
    lines += _section("input", config.inputs) + _section("output", config.outputs)
    if config.states:
        lines += _sequence_text(config)
    elif config.max_batch_size > 0:
        preferred = f"  preferred_batch_size: {_dims(config.preferred_batch_sizes)}" if config.preferred_batch_sizes else None
        lines += ["dynamic_batching {", *([preferred] if preferred else []),
                  f"  max_queue_delay_microseconds: {config.max_queue_delay_us}", "}"]
    lines += ["instance_group [ { kind: KIND_CPU, count: 1 } ]",
              f"version_policy: {{ specific: {{ versions: [ {config.version} ] }} }}"]
    return "\n".join(lines) + "\n"


SCHEMA_FILE = Path(__file__).with_name("model_config.binpb")  # see write_schema.py
SCHEMA_SOURCE = "tritonclient 2.73.0"  # where model_config.binpb was taken from


@functools.lru_cache(maxsize=1)
def model_config_schema():
    """Triton's own ``ModelConfig`` message class and its ``DataType`` enum descriptor, built from
    the shipped schema (:data:`SCHEMA_FILE`, Triton's ``model_config.proto`` as a serialized
    ``FileDescriptorProto``) in a private descriptor pool: no ``tritonclient`` needed, and no clash
    with tritonclient's own classes in protobuf's default pool."""
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(SCHEMA_FILE.read_bytes())
    descriptor = pool.FindMessageTypeByName("inference.ModelConfig")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        cls = message_factory.GetMessageClass(descriptor)
    else:  # pragma: no cover - older protobuf
        cls = message_factory.MessageFactory(pool).GetPrototype(descriptor)
    return cls, pool.FindEnumTypeByName("inference.DataType")


def check_with_triton_schema(text: str, where: str) -> bool:
    """Parse ``text`` with Triton's own ``ModelConfig`` protobuf schema (shipped with the package:
    :func:`model_config_schema`); returns True (it was checked).

    Raises:
        ConversionError: the schema rejects the text.
    """
    from google.protobuf import text_format

    model_config, _ = model_config_schema()
    try:
        text_format.Parse(text, model_config())
    except text_format.ParseError as e:
        raise ConversionError(f"{where}: Triton's ModelConfig schema rejects the config: {e}") from e
    return True


def rows_as_column(entries: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """``entries`` of a model that does not batch with each ``[batch]`` one (``dims: [ -1 ]``) declared
    ``dims: [ -1, 1 ]`` with ``reshape: { shape: [ -1 ] }``: ``[rows, 1]`` to a client, as from a
    model that batches, ``[rows]`` to the model."""
    return tuple(Tensor(t.name, t.data_type, (-1, 1), (-1,), t.optional) if t.dims == (-1,) and t.reshape is None
                 else t for t in entries)


def tensors(values, batched: bool, optional: Mapping[str, bool] | None = None, leave_out=()) -> tuple[Tensor, ...]:
    """Config entries of ONNX value infos, leaving out ``leave_out`` (names)."""
    optional = optional or {}
    return tuple(value_tensor(v, batched, optional.get(v.name, False)) for v in values if v.name not in leave_out)


CONFIG_LIMIT = 1 << 20  # bytes of a config.pbtxt read
_TRITON_NUMPY = {"TYPE_FP32": "float32", "TYPE_FP64": "float64", "TYPE_FP16": "float16", "TYPE_INT64": "int64",
                 "TYPE_INT32": "int32", "TYPE_INT16": "int16", "TYPE_INT8": "int8", "TYPE_UINT8": "uint8",
                 "TYPE_UINT16": "uint16", "TYPE_UINT32": "uint32", "TYPE_UINT64": "uint64", "TYPE_BOOL": "bool"}


def numpy_dtype(data_type: int) -> str:
    """The numpy dtype of a ``DataType`` enum value of Triton's schema.

    Raises:
        InputError: a data type with no numpy dtype (``TYPE_STRING``, ``TYPE_BF16``, an unknown number).
    """
    from policy_export.errors import InputError

    value = model_config_schema()[1].values_by_number.get(data_type)
    name = value.name if value is not None else str(data_type)
    if name not in _TRITON_NUMPY:
        raise InputError(f"Triton data type {name} has no numpy dtype")
    return _TRITON_NUMPY[name]


def triton_contract(model_dir: Path):
    """The interface a Triton model serves, read from its ``config.pbtxt`` with Triton's own schema:
    each input and output with the batch dimension (``None``) first when the model batches, the
    ``reshape`` a client's tensor takes; optional inputs are not required (their default is the
    model's own). Implicit state and sequence controls are not a client's tensors and are left out.

    Raises:
        ExportError: the file cannot be read as a regular file (links are not followed), is over
            :data:`CONFIG_LIMIT`, or is not a valid ModelConfig.
    """
    from google.protobuf import text_format

    from policy_export.errors import ExportError
    from policy_export.policy.files import read_regular
    from policy_export.signatures.contract import Contract, TensorSpec

    model_config, data_types = model_config_schema()
    try:
        raw = read_regular(model_dir / "config.pbtxt", CONFIG_LIMIT)
    except OSError as e:  # a symbolic link (ELOOP), a file that cannot be opened
        raise ExportError(f"{model_dir / 'config.pbtxt'} cannot be read as a regular file "
                          f"(links are not followed): {e.strerror}") from e
    try:
        config = text_format.Parse(raw.decode("utf-8"), model_config())
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise ExportError(f"{model_dir / 'config.pbtxt'} is not a valid Triton ModelConfig: {e}") from e

    def spec(io, optional: bool = False) -> TensorSpec:
        value = data_types.values_by_number.get(io.data_type)
        name = value.name if value is not None else str(io.data_type)
        if name not in _TRITON_NUMPY:
            raise ExportError(f"{model_dir / 'config.pbtxt'}: {io.name!r} has data type {name}, which has no numpy dtype")
        dims = list(io.reshape.shape) if io.HasField("reshape") else list(io.dims)
        shape = ((None,) if config.max_batch_size > 0 else ()) + tuple(None if d < 0 else int(d) for d in dims)
        return TensorSpec(io.name, _TRITON_NUMPY[name], shape, required=not optional)

    return Contract(inputs=tuple(spec(i, i.optional) for i in config.input),
                    outputs=tuple(spec(o) for o in config.output), method="triton", signature_key=config.name)
