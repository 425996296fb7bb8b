"""Check a graph before TensorFlow sees it: only ops on an explicit allowlist, checkpoint ops only
where the standard saver puts them, and no constant that expands past what the file can hold.

Loading a SavedModel runs graph ops from the file: the variable restore op, the init/main op
(``saved_model_main_op``, ``legacy_init_op``, ``__saved_model_init_op``) and, when served, whatever
its signatures depend on. Every check here reads protobufs only (no op runs) and refuses with
:class:`UnsafeModelError`, naming the op and the node (``function/node`` inside a function):

- every node of the main graph and of EVERY function in the library (reachable or not) must run
  an op of :data:`exporter.oplist.ALLOWED_OPS` (pure computation, control flow, variables,
  the restore/init machinery, sampling) or call a library function; anything else -- an op that
  takes a file name, an address or a serialised graph, runs Python, or is unknown to this
  TensorFlow -- is refused. A library function may not carry the name of a registered op, and a
  function-valued attribute must name a function of the library;
- restore ops (``RestoreV2``, ``Restore``, ``RestoreSlice``) only in what the saver's restore op
  runs, reading the saver's filename tensor (which the loader feeds with the SavedModel's own
  ``variables/``): the prefix is traced through ``Identity`` nodes and through function
  arguments to every call site;
- save ops (``SaveV2``, ``MergeV2Checkpoints``, ...) only in the saver's save path, which no
  command of the package runs; never in what a signature, an init op or the restore op runs;
- an init op (or the restore op) may run no stateful op other than variable and table
  initialisation, random initial values and function calls;
- the declared size of every tensor-valued attribute (``Const`` values) summed over the graph and
  its functions may not exceed a budget derived from the file's size plus
  :data:`SPLAT_ALLOWANCE` bytes, and no such tensor may declare a negative or absurd dimension.

Commands that need only a signature (``convert``, ``inspect``) cut it out first with
:func:`prune_to_serving` and check that alone, so a training graph in the same file is never
checked, nor handed to TensorFlow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_export.exporter.oplist import ALLOWED_OPS
from policy_export.policy.files import read_regular  # noqa: F401 (re-exported: the readers' one door)
from policy_export.errors import ExportError, PolicyExportError, UnsafeModelError  # noqa: F401 (UnsafeModelError: raised here)

log = logging.getLogger(__name__)

MAX_SAVED_MODEL_BYTES = 1 << 30
MAX_GRAPH_DEF_BYTES = (2 << 30) - 1  # protobuf cannot parse more
SPLAT_ALLOWANCE = 16 << 20  # constants may declare this much more than the file holds
MAX_RANK = 254  # TensorFlow's own limit
SAVE_OPS = frozenset({"SaveV2", "Save", "SaveSlices", "MergeV2Checkpoints"})
RESTORE_OPS = frozenset({"RestoreV2", "Restore", "RestoreSlice"})
CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# stateful ops an init op (or the variable restore) may run: variables, tables, random initial values
INIT_STATEFUL_OK = frozenset({
    "VariableV2", "Variable", "VarHandleOp", "Assign", "AssignVariableOp", "AssignAdd", "AssignSub",
    "AssignAddVariableOp", "AssignSubVariableOp", "ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized",
    "DestroyResourceOp", "DisableCopyOnRead", "HashTable", "HashTableV2", "MutableHashTable", "MutableHashTableV2",
    "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2", "MutableDenseHashTable", "MutableDenseHashTableV2",
    "InitializeTable", "InitializeTableV2", "LookupTableImport", "LookupTableImportV2", "LookupTableInsert",
    "LookupTableInsertV2", "AnonymousHashTable", "AnonymousMutableHashTable", "RandomUniform", "RandomUniformInt",
    "RandomStandardNormal", "TruncatedNormal", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "Multinomial", "ParameterizedTruncatedNormal", "NoOp", "PartitionedCall", "StatefulPartitionedCall", "If",
    "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
})
INIT_COLLECTIONS = ("saved_model_main_op", "legacy_init_op")
INIT_SIGNATURE = "__saved_model_init_op"
VARIABLE_COLLECTIONS = ("variables", "trainable_variables", "local_variables", "model_variables")
# bytes per element of each DataType enum; strings are counted by their bytes (+ STRING_OVERHEAD each)
DTYPE_BYTES = {1: 4, 2: 8, 3: 4, 4: 1, 5: 2, 6: 1, 8: 8, 9: 8, 10: 1, 11: 1, 12: 1, 13: 4, 14: 2, 15: 2,
               16: 2, 17: 2, 18: 16, 19: 2, 20: 64, 21: 64, 22: 4, 23: 8, 24: 1, 25: 1, 26: 1, 27: 1, 28: 1,
               29: 1, 30: 1}
STRING_OVERHEAD = 8


# ---------------------------------------------------------------------------------------- reading


def read_saved_model(path: str | Path):
    """The ``SavedModel`` proto of the directory ``path`` (``saved_model.pb``, else ``.pbtxt``),
    read without following symbolic links, from a regular file of at most
    :data:`MAX_SAVED_MODEL_BYTES`. Nothing of it runs.

    Returns:
        a ``saved_model_pb2.SavedModel``.
    Raises:
        ExportError: no such file, not a regular file, too large, or not a SavedModel proto.
    """
    from google.protobuf import text_format
    from tensorflow.core.protobuf import saved_model_pb2

    path = Path(path)
    proto = saved_model_pb2.SavedModel()
    for name, binary in (("saved_model.pb", True), ("saved_model.pbtxt", False)):
        file = path / name
        if not (file.exists() or file.is_symlink()):
            continue
        try:
            data = read_regular(file, MAX_SAVED_MODEL_BYTES)
            if binary:
                proto.ParseFromString(data)
            else:
                text_format.Parse(data.decode("utf-8"), proto)
        except ExportError:
            raise
        except Exception as e:  # OSError, protobuf DecodeError / ParseError, UnicodeDecodeError
            raise ExportError(f"{file} is not a SavedModel (cannot be read or parsed): {e}") from e
        return proto
    raise ExportError(f"{path} is not a SavedModel directory (no saved_model.pb)")


def read_graph_def(path: str | Path):
    """A serialised ``GraphDef`` (a frozen graph) read like :func:`read_saved_model`: no symbolic
    link, a regular file, its size checked against :data:`MAX_GRAPH_DEF_BYTES` before parsing.

    Raises:
        ExportError: the file cannot be read, is too large or is not a GraphDef.
    """
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    try:
        graph_def.ParseFromString(read_regular(Path(path), MAX_GRAPH_DEF_BYTES))
    except ExportError:
        raise
    except Exception as e:  # OSError, protobuf DecodeError
        raise ExportError(f"{path} is not a serialized GraphDef: {e}") from e
    return graph_def


def saved_model_budget(path: str | Path) -> int:
    """Bytes the constants of the SavedModel at ``path`` may declare: the size of its
    ``saved_model.pb`` (or ``.pbtxt``) plus its ``variables/`` files (links not followed) plus
    :data:`SPLAT_ALLOWANCE`."""
    path = Path(path)
    total = SPLAT_ALLOWANCE
    for name in ("saved_model.pb", "saved_model.pbtxt"):
        try:
            info = os.lstat(path / name)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            total += info.st_size
            break
    variables = path / "variables"
    if variables.is_dir() and not variables.is_symlink():
        for entry in os.scandir(variables):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def select_meta_graph(proto, tag: str, where: str):
    """The meta graph of ``proto`` whose tags include ``tag`` (one tagged ``[tag]`` alone first).

    Raises:
        ExportError: no meta graph has that tag (the message lists the tags there are).
    """
    tagged = [m for m in proto.meta_graphs if tag in m.meta_info_def.tags]
    if not tagged:
        have = [list(m.meta_info_def.tags) for m in proto.meta_graphs]
        raise ExportError(f"{where} has no meta graph with tag {tag!r}; its tags are {have}")
    exact = [m for m in tagged if list(m.meta_info_def.tags) == [tag]]
    return (exact or tagged)[0]


# ---------------------------------------------------------------------------------------- checks


def check_saved_model(path: str | Path, *, proto=None) -> None:
    """Check every meta graph of the SavedModel directory ``path`` (all of it: the loader imports
    it whole) before it is loaded. ``proto`` is its already-read :func:`read_saved_model`.

    Raises:
        UnsafeModelError: an op named in the message may not be loaded (see the module docstring).
        ExportError: ``path`` holds no readable ``saved_model.pb``/``saved_model.pbtxt``.
    """
    proto = read_saved_model(path) if proto is None else proto
    budget = saved_model_budget(path)
    for meta in proto.meta_graphs:
        check_meta_graph(meta, str(path), budget=budget)


def check_meta_graph(meta, where: str, *, budget: int) -> None:
    """Check one MetaGraphDef (see the module docstring); ``budget`` bounds its declared constants
    (:func:`saved_model_budget`).

    Raises:
        UnsafeModelError: naming the op and node.
    """
    graph = _Graph(meta.graph_def)
    _check_allowed(graph, where)
    _check_sizes(graph, where, budget)
    inits = init_roots(meta)
    run_roots = [t.name for key, sig in meta.signature_def.items() if key != INIT_SIGNATURE
                 for t in (*sig.inputs.values(), *sig.outputs.values())]
    saver = meta.saver_def if meta.HasField("saver_def") else None
    run = graph.closure(run_roots + inits)
    restore = graph.closure([saver.restore_op_name] if saver else [])
    save = graph.closure([saver.save_tensor_name] if saver else [])
    _check_checkpoint_ops(graph, run, restore, save, saver, where)
    _check_stateful(graph, graph.closure(inits), where, "the init op", frozenset())
    _check_stateful(graph, restore, where, "the variable restore op", RESTORE_OPS)


def check_graph_def(graph_def, where: str, *, budget: int | None = None) -> None:
    """Check a GraphDef that will be imported and run (a frozen graph): every op allowed, no
    checkpoint op (a frozen graph has no variables), constants within ``budget`` bytes (default:
    the GraphDef's serialised size plus :data:`SPLAT_ALLOWANCE`).

    Raises:
        UnsafeModelError: naming the op and node.
    """
    graph = _Graph(graph_def)
    _check_allowed(graph, where)
    for fn, node in graph.all_nodes():
        if node.op in SAVE_OPS | RESTORE_OPS:
            raise UnsafeModelError(where, node.op, _label(fn, node), "reads or writes checkpoint files; a frozen "
                                   "graph has no variables")
    _check_sizes(graph, where, graph_def.ByteSize() + SPLAT_ALLOWANCE if budget is None else budget)


# ---------------------------------------------------------------------------------------- pruning


def prune_to_serving(meta, signature_key: str = "serving_default", where: str = "the SavedModel", *,
                     restore: str = "saver"):
    """A copy of ``meta`` holding only what ``signature_key`` and the variables' restore need:
    main-graph nodes by input closure (control inputs included), library functions by
    reachability; that signature and the variable collections (filtered to kept variables) are
    kept, everything else dropped. ``restore`` says how the loader gives variables their values:

    - ``"saver"``: the saver's restore op, then the init op (what TensorFlow's loader runs): both
      are kept, with the saver definition and the init signature/collections, and each kept
      resource variable's own read (what freezing its value fetches);
    - ``"initializers"``: values fed into each variable's initializer (a loader that reads the
      variables itself): each kept variable's initializer and snapshot are kept, and neither the
      saver nor the init op.

    Returns:
        a new ``MetaGraphDef``; the input is not changed.
    Raises:
        ExportError: the meta graph has no such signature.
    """
    from tensorflow.core.protobuf import meta_graph_pb2

    from policy_export.signatures.builder import find_signature

    if restore not in ("saver", "initializers"):
        raise ValueError(f"restore must be 'saver' or 'initializers', got {restore!r}")
    by_saver = restore == "saver"
    sig = find_signature(meta, signature_key, where)
    roots = [t.name for t in (*sig.inputs.values(), *sig.outputs.values())]
    if by_saver:
        roots += init_roots(meta)
        if meta.HasField("saver_def"):
            roots += [meta.saver_def.restore_op_name, meta.saver_def.filename_tensor_name]
    out = meta_graph_pb2.MetaGraphDef()
    out.meta_info_def.CopyFrom(meta.meta_info_def)
    kept = prune_graph_def(meta.graph_def, roots)
    if by_saver:  # each kept resource variable's own read (what freezing its value fetches)
        present = {n.name for n in meta.graph_def.node}
        reads = [f"{n.name}/Read/ReadVariableOp" for n in kept.node if n.op == "VarHandleOp"]
        extra = [r for r in reads if r in present]
    else:  # what tf1.train.import_meta_graph rebuilds each kept variable from
        extra = _variable_initializers(meta, {n.name for n in kept.node})
    kept = prune_graph_def(meta.graph_def, roots + extra)
    out.graph_def.CopyFrom(kept)
    out.signature_def[signature_key].CopyFrom(sig)
    if by_saver:
        if meta.HasField("saver_def"):
            out.saver_def.CopyFrom(meta.saver_def)
        if INIT_SIGNATURE in meta.signature_def:
            out.signature_def[INIT_SIGNATURE].CopyFrom(meta.signature_def[INIT_SIGNATURE])
        for name in INIT_COLLECTIONS:
            if name in meta.collection_def:
                out.collection_def[name].CopyFrom(meta.collection_def[name])
    kept = {n.name for n in out.graph_def.node}
    for name in VARIABLE_COLLECTIONS:
        if name in meta.collection_def:
            keep = [b for b in meta.collection_def[name].bytes_list.value if _variable_node(b) in kept]
            if keep:
                out.collection_def[name].bytes_list.value.extend(keep)
    return out


def _variable_initializers(meta, kept: set[str]) -> list[str]:
    """The initializer and snapshot nodes of the variables of ``meta``'s collections among ``kept``."""
    from tensorflow.core.framework import variable_pb2

    out = []
    for name in VARIABLE_COLLECTIONS:
        for data in meta.collection_def[name].bytes_list.value if name in meta.collection_def else ():
            var = variable_pb2.VariableDef()
            var.ParseFromString(data)
            if _node_name(var.variable_name) in kept:
                out += [n for n in (var.initializer_name, var.snapshot_name) if n]
    return out


def prune_graph_def(graph_def, roots: Iterable[str]):
    """A copy of ``graph_def`` with the nodes ``roots`` (node or tensor names) depend on and the
    library functions they reach (through call ops and function-valued attributes, recursively).

    Returns:
        a new ``GraphDef``.
    """
    from tensorflow.core.framework import graph_pb2

    graph = _Graph(graph_def)
    closure = graph.closure(roots)
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.node.extend(n for n in graph_def.node if n.name in closure.nodes)
    prune_library(out, graph_def.library, closure.functions)
    return out


def prune_library(graph_def, library=None, keep: set[str] | None = None) -> None:
    """Keep in ``graph_def.library`` (or copy from ``library``) only the functions ``keep``
    (default: those its nodes reach) and the gradients between kept functions. Changes
    ``graph_def`` in place."""
    library = graph_def.library if library is None else library
    if keep is None:
        graph = _Graph(graph_def)
        graph.functions = {f.signature.name: f for f in library.function}
        keep = graph.closure(n.name for n in graph_def.node).functions
    functions = [f for f in library.function if f.signature.name in keep]
    gradients = [g for g in library.gradient if g.function_name in keep and g.gradient_func in keep]
    registered = list(library.registered_gradients)
    graph_def.ClearField("library")
    graph_def.library.function.extend(functions)
    graph_def.library.gradient.extend(gradients)
    graph_def.library.registered_gradients.extend(r for r in registered if r.gradient_func in keep)


def _variable_node(data: bytes) -> str:
    from tensorflow.core.framework import variable_pb2

    var = variable_pb2.VariableDef()
    var.ParseFromString(data)
    return _node_name(var.variable_name)


# ---------------------------------------------------------------------------------------- graphs


@dataclass
class _Closure:
    """Main-graph nodes and library functions that running some roots may execute."""

    nodes: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)


def _attr_functions(value) -> Iterator[str]:
    """Function names an AttrValue refers to, at any depth (a function's own attrs included)."""
    if value.HasField("func"):
        yield value.func.name
        for inner in value.func.attr.values():
            yield from _attr_functions(inner)
    if value.HasField("list"):
        for func in value.list.func:
            yield func.name
            for inner in func.attr.values():
                yield from _attr_functions(inner)


def _attr_tensors(value) -> Iterator[object]:
    """TensorProtos an AttrValue holds, at any depth."""
    if value.HasField("tensor"):
        yield value.tensor
    if value.HasField("list"):
        yield from value.list.tensor
        for func in value.list.func:
            for inner in func.attr.values():
                yield from _attr_tensors(inner)
    if value.HasField("func"):
        for inner in value.func.attr.values():
            yield from _attr_tensors(inner)


class _Graph:
    def __init__(self, graph_def):
        self.nodes = {n.name: n for n in graph_def.node}
        self.functions = {f.signature.name: f for f in graph_def.library.function}
        self._local: dict[str, dict] = {}

    def called(self, node) -> Iterator[str]:
        """Functions a node calls: as its op, or through any function-valued attribute."""
        if node.op in self.functions:
            yield node.op
        for value in node.attr.values():
            yield from _attr_functions(value)

    def function_refs(self, fn_def) -> Iterator[str]:
        """Functions a function refers to: its nodes' calls and its own attributes."""
        for node in fn_def.node_def:
            yield from self.called(node)
        for value in fn_def.attr.values():
            yield from _attr_functions(value)

    def closure(self, roots: Iterable[str]) -> _Closure:
        out = _Closure()
        stack = [_node_name(r) for r in roots if r]
        fn_stack: list[str] = []
        while stack:
            name = stack.pop()
            if name in out.nodes or name not in self.nodes:
                continue
            out.nodes.add(name)
            node = self.nodes[name]
            stack.extend(_node_name(i) for i in node.input)
            fn_stack.extend(self.called(node))
        while fn_stack:
            fn = fn_stack.pop()
            if fn in out.functions or fn not in self.functions:
                continue
            out.functions.add(fn)
            fn_stack.extend(self.function_refs(self.functions[fn]))
        return out

    def all_nodes(self) -> Iterator[tuple[str | None, object]]:
        """``(function name or None for the main graph, node)`` for every node."""
        for node in self.nodes.values():
            yield None, node
        for name, fn in self.functions.items():
            for node in fn.node_def:
                yield name, node

    def local_nodes(self, fn: str) -> dict:
        if fn not in self._local:
            self._local[fn] = {n.name: n for n in self.functions[fn].node_def}
        return self._local[fn]

    def callers(self, fn: str) -> Iterator[tuple[str | None, object, bool]]:
        """``(caller function or None, node, direct)`` for every node referring to ``fn``;
        ``direct`` when its data inputs are ``fn``'s arguments in order (a call)."""
        for caller, node in self.all_nodes():
            refs = list(self.called(node))
            if fn not in refs:
                continue
            direct = (node.op == fn and refs.count(fn) == 1) or (
                node.op in CALL_OPS and node.attr["f"].func.name == fn and refs == [fn])
            yield caller, node, direct
        for name, fn_def in self.functions.items():
            if any(fn in _attr_functions(v) for v in fn_def.attr.values()):
                yield name, fn_def.signature, False  # referred to by an attribute: no call site


def _node_name(tensor: str) -> str:
    return tensor.lstrip("^").split(":")[0]


def _label(fn: str | None, node) -> str:
    return node.name if fn is None else f"{fn}/{node.name}"


def _check_allowed(graph: _Graph, path: str) -> None:
    from tensorflow.python.framework import op_def_registry

    for name in sorted(graph.functions):
        if op_def_registry.get(name) is not None:
            raise UnsafeModelError(path, name, name, "is a library function named like a TensorFlow op; a call to "
                                   "it would be ambiguous")
    for fn, node in graph.all_nodes():
        for called in graph.called(node):
            if called not in graph.functions:
                raise UnsafeModelError(path, node.op, _label(fn, node), f"refers to function {called!r}, which is "
                                       "not in the graph's library")
        if node.op in graph.functions:
            continue
        known = op_def_registry.get(node.op) is not None
        if not known:
            raise UnsafeModelError(path, node.op, _label(fn, node), "is not an op known to this TensorFlow")
        if node.op not in ALLOWED_OPS and node.op not in SAVE_OPS | RESTORE_OPS:
            raise UnsafeModelError(path, node.op, _label(fn, node), "is not on the list of ops a policy graph may "
                                   "hold (computation, control flow, variables, restore); it may touch files, run "
                                   "code or reach other processes")
    for name, fn_def in graph.functions.items():
        for value in fn_def.attr.values():
            for called in _attr_functions(value):
                if called not in graph.functions:
                    raise UnsafeModelError(path, name, name, f"refers to function {called!r}, which is not in the "
                                           "graph's library")


def _declared_bytes(tensor, budget: int) -> tuple[int, str]:
    """``(bytes, shape text)`` a TensorProto expands to, or raises ValueError for a bad shape."""
    shape = tensor.tensor_shape
    if shape.unknown_rank:
        raise ValueError("has an unknown rank")
    if len(shape.dim) > MAX_RANK:
        raise ValueError(f"has rank {len(shape.dim)}")
    count = 1
    for d in shape.dim:
        if d.size < 0:
            raise ValueError(f"has a negative dimension {d.size}")
        count *= d.size
        if count > budget:  # no need to multiply further; also keeps the number small
            break
    text = "[" + ", ".join(str(d.size) for d in shape.dim) + "]"
    if tensor.dtype == 7:  # DT_STRING
        values = list(tensor.string_val)
        stored = sum(len(v) for v in values)
        missing = max(count - len(values), 0)
        return stored + missing * (len(values[-1]) if values else 0) + count * STRING_OVERHEAD, text
    return count * DTYPE_BYTES.get(tensor.dtype % 100, 8), text


def _check_sizes(graph: _Graph, path: str, budget: int) -> None:
    """Refuse tensor attributes with a bad shape, or whose declared sizes total more than ``budget``."""
    total = 0
    for fn, node in graph.all_nodes():
        for value in node.attr.values():
            for tensor in _attr_tensors(value):
                try:
                    size, shape = _declared_bytes(tensor, budget)
                except ValueError as e:
                    raise UnsafeModelError(path, node.op, _label(fn, node), f"declares a tensor that {e}") from e
                total += size
                if total > budget:
                    raise UnsafeModelError(path, node.op, _label(fn, node), f"declares a tensor of shape {shape} "
                                           f"({size} bytes once expanded); the graph's constants would exceed "
                                           f"{budget} bytes, far more than its file holds")


def init_roots(meta) -> list[str]:
    """Node or tensor names of the init op(s) a loader runs after the restore: the main op and
    legacy init collections and the ``__saved_model_init_op`` signature's outputs."""
    roots = []
    for key in INIT_COLLECTIONS:
        if key in meta.collection_def:
            roots.extend(meta.collection_def[key].node_list.value)
    if INIT_SIGNATURE in meta.signature_def:
        roots.extend(t.name for t in meta.signature_def[INIT_SIGNATURE].outputs.values())
    return roots


def _in(closure: _Closure, fn: str | None, node) -> bool:
    return node.name in closure.nodes if fn is None else fn in closure.functions


def _check_checkpoint_ops(graph: _Graph, run: _Closure, restore: _Closure, save: _Closure, saver,
                          path: str) -> None:
    filename = _node_name(saver.filename_tensor_name) if saver else None
    for fn, node in graph.all_nodes():
        if node.op not in SAVE_OPS | RESTORE_OPS:
            continue
        label = _label(fn, node)
        if _in(run, fn, node):
            raise UnsafeModelError(path, node.op, label, "runs when the model is loaded or served; only the "
                                   "standard variable restore may use checkpoint files")
        if node.op in SAVE_OPS:
            if _in(restore, fn, node):
                raise UnsafeModelError(path, node.op, label, "writes files during the variable restore")
            continue  # reached by nothing the tool runs (the signature, the init op, the restore op)
        if not _in(restore, fn, node):
            continue  # reached by nothing the tool runs
        if filename is None or not node.input or not _traces_to(graph, fn, node.input[0], filename, set()):
            raise UnsafeModelError(path, node.op, label, "restores from a path other than the SavedModel's own "
                                   "variables (its prefix is not the saver's filename tensor)")


def _traces_to(graph: _Graph, fn: str | None, tensor: str, target: str, seen: set) -> bool:
    """Whether ``tensor`` (in function ``fn``, or the main graph) is ``target`` through ``Identity``
    nodes and, inside a function, through its arguments at every call site."""
    if (fn, tensor) in seen or len(seen) > 1000:
        return False
    seen.add((fn, tensor))
    nodes = graph.nodes if fn is None else graph.local_nodes(fn)
    name = _node_name(tensor)
    for _ in range(100):
        node = nodes.get(name)
        if node is None or node.op != "Identity" or not node.input:
            break
        name = _node_name(node.input[0])
    if fn is None:
        return name == target
    if name in nodes:  # computed inside the function, not an argument
        return False
    args = [a.name for a in graph.functions[fn].signature.input_arg]
    if name not in args:
        return False
    index = args.index(name)
    callers = list(graph.callers(fn))
    if not callers:
        return False
    for caller, node, direct in callers:
        data = [i for i in node.input if not i.startswith("^")] if direct else []
        if not direct or index >= len(data) or not _traces_to(graph, caller, data[index], target, seen):
            return False
    return True


def _check_stateful(graph: _Graph, closure: _Closure, path: str, what: str, extra: frozenset[str]) -> None:
    """Refuse a stateful op in ``closure`` other than variable/table initialisation (and ``extra``)."""
    from tensorflow.python.framework import op_def_registry

    units = [(None, graph.nodes[n]) for n in sorted(closure.nodes)]
    units += [(fn, node) for fn in sorted(closure.functions) for node in graph.functions[fn].node_def]
    for fn, node in units:
        if node.op in graph.functions or node.op in INIT_STATEFUL_OK or node.op in extra:
            continue
        op_def = op_def_registry.get(node.op)
        if op_def is not None and op_def.is_stateful:
            raise UnsafeModelError(path, node.op, _label(fn, node), f"is a stateful op in {what}, which may only "
                                   "initialise variables and tables")


# ---------------------------------------------------------------------------------------- loading


_GLOB_CHARS = frozenset("*?[]{}\\")


@contextlib.contextmanager
def glob_free_path(path: Path) -> Iterator[Path]:
    """``path``, or while in use a symbolic link to it without glob characters.

    TensorFlow looks checkpoints up by glob pattern, so a SavedModel under a directory named like
    ``exp_[1]`` would not load from its own path.
    """
    path = Path(path).absolute()
    if not _GLOB_CHARS & set(str(path)):
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="policy-export-load-"))
    try:
        link = tmp / "model"
        link.symlink_to(path, target_is_directory=True)
        yield link
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class LoadedGraph:
    """A SavedModel's graph in its own session (:func:`open_saved_model`).

    ``session`` is a :func:`exporter.watchdog.stoppable_session`: every later run of the file's
    graph keeps the run limit and stops on signals too. ``meta`` is the (pruned) meta graph that
    was checked and imported; ``restored`` what a ``restore`` callable returned.
    """

    session: Any
    meta: Any
    restored: Any = None

    @property
    def graph(self):
        return self.session.graph


def open_saved_model(path: str | Path, *, tag: str = "serve", signature_key: str | None = None,
                     device: str | None = None, proto=None, meta=None,
                     restore: Callable[[Any], Any] | None = None, config=None) -> LoadedGraph:
    """The one way the graph of a SavedModel reaches TensorFlow, for every route that loads one
    (``convert`` of an RLlib export or a Keras base model, verify of the SavedModel, TF Serving and
    Keras formats).

    In order: the file is read once (:func:`read_saved_model`, or the already-read ``proto``); the
    meta graph with ``tag`` is cut to what ``signature_key`` needs (:func:`prune_to_serving`;
    ``None``: every signature), or ``meta`` is taken as already cut; it is checked
    (:func:`check_meta_graph`) before any of its ops can run; it is imported into a new graph
    whose session is a stoppable one (the run limit of :func:`exporter.watchdog.run_limit` and
    SIGINT/SIGTERM hold on every run); then the variables are restored and the init op runs, as
    ``tf1.saved_model.loader.load`` would: the saver's own restore op reading
    ``path/variables/variables`` and the init op, or ``restore(session)`` instead of both.
    ``device``: the TF device the graph is placed on (``None``: TensorFlow's choice); with a
    ``restore`` callable the file's own device placements are cleared on import.

    Raises:
        UnsafeModelError: an op that may not be loaded (nothing was run).
        RunTimeoutError: the restore or init op did not finish within the run limit.
        ExportError: not a SavedModel with ``tag``, or its variables cannot be restored.
    """
    import tensorflow as tf
    from tensorflow.python.framework import meta_graph as meta_graph_lib

    from policy_export.exporter.watchdog import stoppable_session
    from policy_export.policy.graph import session_config

    path = Path(path)
    if meta is None:
        proto = read_saved_model(path) if proto is None else proto
        meta = select_meta_graph(proto, tag, str(path))
        meta = prune_to_serving(meta, signature_key, str(path)) if signature_key is not None else meta
    check_meta_graph(meta, str(path), budget=saved_model_budget(path))  # before any of its ops can run
    graph = tf.Graph()
    session = stoppable_session(graph, config if config is not None else session_config(device),
                                f"SavedModel {path}")
    restored = None
    try:
        with graph.as_default(), tf.device(device), glob_free_path(path) as alias:
            meta_graph_lib.import_scoped_meta_graph(meta, clear_devices=restore is not None)
            if restore is not None:
                restored = restore(session)
            else:
                if meta.HasField("saver_def"):
                    session.run(meta.saver_def.restore_op_name,
                                {meta.saver_def.filename_tensor_name: str(alias / "variables" / "variables")})
                init = init_roots(meta)
                if init:
                    session.run([graph.as_graph_element(n) for n in init])
    except (OSError, RuntimeError, ValueError, KeyError, tf.errors.OpError) as e:
        session.close()
        if isinstance(e, PolicyExportError):
            raise
        raise ExportError(f"{path} is not a loadable SavedModel with tag {tag!r}: {e}") from e
    except BaseException:
        session.close()
        raise
    return LoadedGraph(session, meta, restored)
