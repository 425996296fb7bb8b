"""The one door for an ONNX file this package did not just write: a candidate (``verify
--candidate``), an export's models replayed by ``verify`` (whose manifest an attacker may have
rewritten), ``inspect model.onnx``, the ONNX a framework exported (``verify MODEL.onnx
--reference``). Nothing hands such a file to onnx's loaders, its checker or ONNX Runtime before
:func:`check_file` has passed it:

- the model is a regular file, opened without following a symbolic link, of at most
  :data:`MODEL_LIMIT` bytes, parsed from the bytes read (without its external data);
- every tensor kept as external data names a plain file beside the model (no separator, no
  ``..``, not absolute) that is a regular file, not a link and not a hard link to another name
  (``st_nlink`` 1), with only the keys ONNX defines (``location``, ``offset``, ``length``,
  ``checksum``) and an offset and length inside that file;
- what every tensor declares (dims x element size, the main graph, every subgraph and every
  function, ``ConstantOfShape``/``Expand`` of constant shapes) fits what the files hold
  (:func:`check_declared_sizes`);
- the graph has at most :data:`NODE_LIMIT` nodes, subgraphs nested at most
  :data:`SUBGRAPH_DEPTH` deep, and :data:`FUNCTION_LIMIT` functions;
- then onnx's checker runs on the file, whose every external data location was checked.

The onnx releases before 1.21 follow a symbolic link out of the model's folder when they load or
check external data themselves (CVE-2026-27489; also CVE-2026-34445, -34446, -28500); the checks
above are this package's own and run first whatever the release. Where the installed TensorFlow
allows onnx 1.21 (its ml_dtypes pin allows 0.5, TensorFlow 2.19 and later) and an older onnx is
installed, no ONNX file is opened: the error names the upgrade (:func:`check_onnx_release`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import DeclaredSizeError, ExportError
from policy_export.exporter.compat import import_onnx

onnx = import_onnx()
from onnx import helper, numpy_helper  # noqa: E402

MODEL_LIMIT = 2 << 30  # bytes of one model file (protobuf's own limit)
NODE_LIMIT = 1 << 20  # nodes of the main graph, its subgraphs and its functions together
SUBGRAPH_DEPTH = 32  # Loop/If/Scan bodies nested in bodies
FUNCTION_LIMIT = 4096  # functions a model defines
EXTERNAL_KEYS = ("location", "offset", "length", "checksum")  # what ONNX's external data defines
SAFE_ONNX = (1, 21)  # the first onnx release with CVE-2026-27489, -34445, -34446 and -28500 fixed


def check_file(path: Path, inspect=None):
    """Check a model file before anything else reads it (see the module's description) and
    return ``inspect(model)`` (a function of the parsed model, without its external data; None
    when not given).

    Raises:
        ExportError: the file is missing, a link, too large, not a valid ONNX model, or keeps
            external data anywhere but in a plain file beside it; onnx is older than 1.21 where
            the installed stack allows 1.21.
        DeclaredSizeError: a tensor's declared size disagrees with its data or exceeds the
            files' budget, or the graph exceeds the node budget.
    """
    path = Path(path)
    check_onnx_release()
    model = read_model(path)
    check_external_data(model, path)
    check_declared_sizes(model, path)
    check_graph_size(model, path)
    result = inspect(model) if inspect is not None else None
    del model
    try:  # by its path: the checker resolves external data beside the model (given a parsed model, it
        # would look in the working directory); every location it reads was checked above
        onnx.checker.check_model(str(path))
    except Exception as e:  # ValidationError and friends
        raise ExportError(f"{path} is not a valid ONNX model: {str(e)[:300]}") from e
    return result


def read_model(path: Path) -> "onnx.ModelProto":
    """The model at ``path`` parsed from its bytes, without its external data: a regular file,
    opened without following a symbolic link, of at most :data:`MODEL_LIMIT` bytes.

    Raises:
        ExportError: missing, a link, not a regular file, too large, or not a valid ONNX model.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ExportError(f"{path} does not exist") from None
    except OSError as e:
        reason = "is a symbolic link; refusing to follow it" if os.path.islink(path) else f"cannot be read: {e.strerror}"
        raise ExportError(f"{path} {reason}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ExportError(f"{path} is not a regular file")
        if info.st_size > MODEL_LIMIT:
            raise ExportError(f"{path} is {info.st_size} bytes, more than an ONNX model file holds "
                              f"({MODEL_LIMIT >> 30} GiB; larger weights are external data)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MODEL_LIMIT + 1)
    finally:
        os.close(fd)
    try:
        return onnx.load_model_from_string(data)
    except Exception as e:  # DecodeError and friends
        raise ExportError(f"{path} is not a valid ONNX model: {str(e)[:200]}") from None



def load_checked(path: Path) -> "onnx.ModelProto":
    """The model at ``path`` with its external data, once :func:`check_file` has passed it (every
    location was checked there; the data is read from the model's folder alone).

    Raises:
        ExportError, DeclaredSizeError: as :func:`check_file`.
    """
    from onnx.external_data_helper import load_external_data_for_model

    path = Path(path)
    check_file(path)
    model = read_model(path)
    check_external_data(model, path)  # read again: the file may have changed since it was checked
    try:
        load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: its external data cannot be read: {str(e)[:200]}") from e
    for tensor in _all_tensor_protos(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise ExportError(f"{path}: tensor {tensor.name[:80]!r} keeps external data onnx did not load")
    return model

def check_external_data(model: "onnx.ModelProto | Path", path: Path | None = None) -> "onnx.ModelProto":
    """Every tensor ``model`` (read from ``path``) keeps as external data names a plain file beside
    it that is a regular file, no link and no second name of another file, with only ONNX's keys
    and a range inside the file; returns the model. Given a path alone, the model is read first
    (:func:`read_model`).

    Raises:
        ExportError: naming the tensor and what is wrong.
    """
    if path is None:
        path, model = Path(model), read_model(Path(model))
    sizes: dict[str, int] = {}
    for tensor in _all_tensor_protos(model):
        if tensor.data_location != onnx.TensorProto.EXTERNAL and not len(tensor.external_data):
            continue
        name = tensor.name[:80]
        info: dict[str, str] = {}
        for entry in tensor.external_data:
            if entry.key not in EXTERNAL_KEYS or entry.key in info:
                raise ExportError(f"{path}: tensor {name!r} has external data key {entry.key[:40]!r} "
                                  f"{'twice' if entry.key in info else 'that ONNX does not define'}; refusing "
                                  "to read it")
            info[entry.key] = entry.value
        location = info.get("location", "")
        if not location or location != os.path.basename(location) or location in (".", "..") \
                or "\\" in location or "\0" in location:
            raise ExportError(f"{path}: tensor {name!r} keeps its data at {location[:120]!r}, not in a file "
                              "beside the model; refusing to read it")
        if location not in sizes:
            sizes[location] = _data_file_size(path, location, name)
        try:
            offset, length = int(info.get("offset", "0")), int(info.get("length", "0"))
        except ValueError:
            raise ExportError(f"{path}: tensor {name!r} has an external data offset or length that is not "
                              "a number") from None
        if offset < 0 or length < 0 or offset + length > sizes[location]:
            raise DeclaredSizeError(f"{path}: tensor {name!r} reads {length} bytes at offset {offset}, beyond "
                                    f"the end of {location!r} ({sizes[location]} bytes); refusing to load it")
    return model


def _data_file_size(path: Path, location: str, name: str) -> int:
    data = path.parent / location
    try:
        info = os.lstat(data)
    except OSError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode):
        raise ExportError(f"{path}: external data file {location} of tensor {name!r} is missing or not a regular "
                          "file (a symbolic link is not followed)")
    if info.st_nlink != 1:
        raise ExportError(f"{path}: external data file {location} of tensor {name!r} has {info.st_nlink} names "
                          "(a hard link may be another file's data); refusing to read it")
    return info.st_size


def check_graph_size(model: "onnx.ModelProto", path: Path) -> int:
    """The nodes of ``model`` (main graph, subgraphs, functions), within the node, depth and
    function budgets; returns their count.

    Raises:
        DeclaredSizeError: over a budget, naming it.
    """
    if len(model.functions) > FUNCTION_LIMIT:
        raise DeclaredSizeError(f"{path}: {len(model.functions)} functions, more than {FUNCTION_LIMIT}; refusing "
                                "to load it")
    count = 0
    todo = [(model.graph, 0)] + [(f, 0) for f in model.functions]
    while todo:
        graph, depth = todo.pop()
        if depth > SUBGRAPH_DEPTH:
            raise DeclaredSizeError(f"{path}: subgraphs nested more than {SUBGRAPH_DEPTH} deep; refusing to load it")
        count += len(graph.node)
        if count > NODE_LIMIT:
            raise DeclaredSizeError(f"{path}: more than {NODE_LIMIT} nodes; refusing to load it")
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    todo.append((attr.g, depth + 1))
                todo.extend((g, depth + 1) for g in attr.graphs)
    return count


def onnx_release() -> tuple[int, ...]:
    parts = []
    for part in onnx.__version__.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def stack_allows_safe_onnx() -> bool:
    """Whether the installed TensorFlow allows onnx 1.21 (its ml_dtypes pin allows 0.5: TF >= 2.19)."""
    from importlib import metadata

    try:
        version = metadata.version("tensorflow")
    except metadata.PackageNotFoundError:
        return True
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2])
    return (major, minor) >= (2, 19)


def check_onnx_release() -> None:
    """Refuse to open an ONNX file with an onnx older than 1.21 where the installed stack allows 1.21.

    Raises:
        ExportError: naming the release, the advisories and the upgrade.
    """
    if onnx_release() >= SAFE_ONNX or not stack_allows_safe_onnx():
        return
    raise ExportError(f"onnx {onnx.__version__} is older than 1.21, which fixes CVE-2026-27489 (external data "
                      "through a symbolic link), -34445, -34446 and -28500, and this TensorFlow allows it; "
                      "upgrade it: pip install 'onnx>=1.21'")


DECLARED_ALLOWANCE = 16 << 20  # bytes beyond the files' own sizes that declared tensors may take
_PACKED_4BIT = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4, getattr(onnx.TensorProto, "FLOAT4E2M1", -1)}
_SHAPED_NODES = {"ConstantOfShape": 0, "Expand": 1}  # op -> input holding the output's shape


def _element_bytes(data_type: int) -> float:
    if data_type in _PACKED_4BIT:
        return 0.5
    if data_type == onnx.TensorProto.STRING:
        return 0.0  # strings are counted by the bytes they hold
    try:
        return float(np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize)
    except Exception as e:  # KeyError/TypeError/ValueError: a data type onnx does not know
        raise DeclaredSizeError(f"unknown tensor data type {data_type}") from e


def _elements(dims) -> int:
    count = 1
    for d in dims:
        if d < 0:
            raise DeclaredSizeError(f"negative dimension {d}")
        count *= int(d)
    return count


def _tensor_bytes(tensor: "onnx.TensorProto", where: str, data_sizes: Mapping[str, int]) -> int:
    """The bytes ``tensor`` declares (dims x element size), checked against the data it holds."""
    try:
        count = _elements(tensor.dims)
        size = _element_bytes(tensor.data_type)
    except DeclaredSizeError as e:
        raise DeclaredSizeError(f"{where}: tensor {tensor.name!r}: {e}") from None
    declared = int(np.ceil(count * size))
    held, what = None, ""
    if tensor.data_type == onnx.TensorProto.STRING:
        if len(tensor.string_data) != count:
            raise DeclaredSizeError(f"{where}: tensor {tensor.name!r} declares {count} strings (dims "
                                    f"{list(tensor.dims)}) but holds {len(tensor.string_data)}")
        return sum(len(v) for v in tensor.string_data)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in tensor.external_data}
        try:
            offset, length = int(info.get("offset", 0)), info.get("length")
            length = None if length is None else int(length)
        except ValueError:
            raise DeclaredSizeError(f"{where}: tensor {tensor.name!r} has a malformed external data "
                                    "offset or length") from None
        available = data_sizes.get(info.get("location", ""), 0) - offset
        held, what = (available if length is None else length), "bytes of external data"
        if length is not None and length > available:
            raise DeclaredSizeError(f"{where}: tensor {tensor.name!r} reads {length} bytes at offset {offset}, "
                                    f"beyond the end of {info.get('location')!r}")
        mismatch = held < declared if length is None else held != declared  # without a length: the rest of the file
        if mismatch:
            raise DeclaredSizeError(f"{where}: tensor {tensor.name!r} declares {declared} bytes (dims "
                                    f"{list(tensor.dims)}) but has {held} {what}")
        return declared
    if tensor.HasField("raw_data"):
        held, what = len(tensor.raw_data), "bytes of raw data"
        expected = declared
    else:
        fields = [f for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")
                  if len(getattr(tensor, f))]
        held = sum(len(getattr(tensor, f)) for f in fields)
        what = f"values in {'/'.join(fields) or 'no data field'}"
        expected = count
        if tensor.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
            expected = 2 * count
        elif tensor.data_type in _PACKED_4BIT:
            expected = (count + 1) // 2
    if held != expected:
        raise DeclaredSizeError(f"{where}: tensor {tensor.name!r} declares {declared} bytes (dims "
                                f"{list(tensor.dims)}) but holds {held} {what}")
    return declared


def _walk_graph(graph: "onnx.GraphProto", where: str, visit_tensor, visit_sparse, visit_node) -> None:
    for tensor in graph.initializer:
        visit_tensor(tensor, f"{where} initializer")
    for sparse in graph.sparse_initializer:
        visit_sparse(sparse, f"{where} sparse initializer")
    _walk_nodes(graph.node, where, visit_tensor, visit_sparse, visit_node)


def _walk_nodes(nodes, where: str, visit_tensor, visit_sparse, visit_node) -> None:
    A = onnx.AttributeProto
    for node in nodes:
        at = f"{where} node {node.name or node.op_type!r}"
        visit_node(node, at)
        for attr in node.attribute:
            label = f"{at} attribute {attr.name!r}"
            if attr.type == A.TENSOR or attr.HasField("t"):
                visit_tensor(attr.t, label)
            for t in attr.tensors:
                visit_tensor(t, label)
            if attr.type == A.SPARSE_TENSOR or attr.HasField("sparse_tensor"):
                visit_sparse(attr.sparse_tensor, label)
            for t in attr.sparse_tensors:
                visit_sparse(t, label)
            if attr.type == A.GRAPH or attr.HasField("g"):
                _walk_graph(attr.g, f"{label} subgraph", visit_tensor, visit_sparse, visit_node)
            for g in attr.graphs:
                _walk_graph(g, f"{label} subgraph", visit_tensor, visit_sparse, visit_node)


def check_declared_sizes(model: "onnx.ModelProto", path: Path, allowance: int = DECLARED_ALLOWANCE) -> int:
    """Check the sizes every tensor of ``model`` declares, before any runtime materialises them;
    returns the bytes they declare together.

    Every initializer, sparse initializer and tensor attribute (``Constant`` values and the like)
    of the main graph, of every subgraph (``Loop``/``If``/``Scan`` bodies) and of every function is
    counted at its declared size, dims x element size (a sparse tensor at its dense size, as a
    runtime expands it). Each tensor's data must match its dims, and the total may not exceed the
    model file's size plus its external data files' sizes plus ``allowance`` bytes. The shape a
    ``ConstantOfShape`` or ``Expand`` node is given as a constant is held to the same budget.
    ``model`` is parsed without its external data (their files' sizes are read, not their bytes).

    Raises:
        DeclaredSizeError: naming the tensor (or node), its declared size and the budget.
    """
    budget = _SizeBudget(model, path, allowance)
    _walk_graph(model.graph, "main graph", budget.visit_tensor, budget.visit_sparse, budget.visit_node)
    for function in model.functions:
        _walk_nodes(function.node, f"function {function.name!r}", budget.visit_tensor, budget.visit_sparse,
                    budget.visit_node)
    budget.check_shaped()
    return budget.total


class _SizeBudget:
    """What :func:`check_declared_sizes` counts as it walks a model: the total declared, the small
    int64 constants that may be shapes, and the nodes whose output size such a shape sets."""

    def __init__(self, model, path: Path, allowance: int):
        self.path, self.allowance = path, allowance
        self.data_sizes: dict[str, int] = {}
        for tensor in _all_tensor_protos(model):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                location = next((e.value for e in tensor.external_data if e.key == "location"), "")
                if location and location not in self.data_sizes:
                    self.data_sizes[location] = os.lstat(path.parent / location).st_size
        self.budget = os.lstat(path).st_size + allowance + sum(self.data_sizes.values())
        self.total = 0
        self.constants: dict[str, "onnx.TensorProto"] = {}
        self.shaped: list[tuple[Any, str]] = []

    def refuse(self, name: str, where: str, size: int, what: str) -> None:
        raise DeclaredSizeError(f"{self.path}: {where}: {what} {name!r} declares {size} bytes, beyond the "
                                f"{self.budget} bytes this model's files can account for (their size plus "
                                f"{self.allowance >> 20} MiB); refusing to load it")

    def visit_tensor(self, tensor, where: str) -> None:
        try:
            size = _tensor_bytes(tensor, where, self.data_sizes)
        except DeclaredSizeError as e:
            raise DeclaredSizeError(f"{self.path}: {e}; refusing to load it") from None
        self.total += size
        if self.total > self.budget:
            self.refuse(tensor.name, where, size, "tensor")
        if tensor.name and len(tensor.dims) <= 1 and tensor.data_type == onnx.TensorProto.INT64 and size <= 1024:
            self.constants[tensor.name] = tensor

    def visit_sparse(self, sparse, where: str) -> None:
        self.visit_tensor(sparse.values, f"{where} values")
        self.visit_tensor(sparse.indices, f"{where} indices")
        try:
            dense = int(np.ceil(_elements(sparse.dims) * _element_bytes(sparse.values.data_type)))
        except DeclaredSizeError as e:
            raise DeclaredSizeError(f"{self.path}: {where}: sparse tensor {sparse.values.name!r}: {e}") from None
        self.total += dense
        if self.total > self.budget:
            self.refuse(sparse.values.name, where, dense, "sparse tensor")

    def visit_node(self, node, where: str) -> None:
        if node.op_type == "Constant" and node.output:  # small int64 constants may be shapes
            for attr in node.attribute:
                value = None
                if attr.name == "value" and attr.t.data_type == onnx.TensorProto.INT64 and attr.t.ByteSize() <= 1024:
                    value = numpy_helper.to_array(attr.t)
                elif attr.name == "value_ints" and len(attr.ints) <= 64:
                    value = np.asarray(attr.ints, np.int64)
                if value is not None:
                    self.constants.setdefault(node.output[0], numpy_helper.from_array(value, node.output[0]))
        if node.op_type in _SHAPED_NODES and node.domain in ("", "ai.onnx"):
            self.shaped.append((node, where))

    def check_shaped(self) -> None:
        """``ConstantOfShape``/``Expand`` outputs of constant shapes, held to the budget."""
        for node, where in self.shaped:
            index = _SHAPED_NODES[node.op_type]
            shape = self.constants.get(node.input[index]) if len(node.input) > index else None
            if shape is None:
                continue
            dims = [int(d) for d in numpy_helper.to_array(shape).reshape(-1)]
            element = 4.0
            if node.op_type == "ConstantOfShape":
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                element = _element_bytes(value.data_type) if value is not None else 4.0
            elif node.input[0] in self.constants:
                element = _element_bytes(self.constants[node.input[0]].data_type)
            size = int(np.ceil(_elements(max(d, 0) for d in dims) * element))
            if size > self.budget:
                self.refuse(node.output[0] if node.output else node.op_type, where, size, f"{node.op_type} output")


def _all_tensor_protos(model: "onnx.ModelProto"):
    """Every TensorProto of ``model`` (initializers, sparse tensors' parts, attributes, subgraphs, functions)."""
    found = []

    def tensor(t, _where):
        found.append(t)

    def sparse(s, _where):
        found.extend((s.values, s.indices))

    _walk_graph(model.graph, "", tensor, sparse, lambda n, w: None)
    for function in model.functions:
        _walk_nodes(function.node, "", tensor, sparse, lambda n, w: None)
    return found


