"""Check a SavedModel's graphs before anything loads it: no op may touch files, run Python or
reach other processes, and the ops run at load time may do nothing but initialise and restore.

Loading a SavedModel runs graph ops from the file: the variable restore op, the init/main op
(``saved_model_main_op``, ``legacy_init_op``, ``__saved_model_init_op``) and, when served, whatever
its signatures depend on. :func:`check_saved_model` reads ``saved_model.pb`` as a protobuf (no
op runs) and refuses, naming the op and node:

- anywhere in any meta graph or its function library, an op of :data:`DENIED_OPS` (file system,
  Python, summary writers, file-reading datasets, debuggers, remote calls, ...) or an op unknown
  to this TensorFlow;
- a checkpoint op (``SaveV2``, ``RestoreV2``, ``MergeV2Checkpoints``, ...) that a signature or an
  init op depends on, a save op the restore op depends on, and a restore op outside a function
  whose file prefix is not the saver's filename tensor (which the loader feeds with the
  SavedModel's own ``variables/``);
- an init op (or the restore op) that depends on a stateful op other than variable and table
  initialisation, random initial values and function calls.

Training ops (optimizers, gradients, summaries as strings) are allowed: a whole RLlib training
graph passes.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from policy_export.policy.errors import ExportError

MAX_SAVED_MODEL_BYTES = 1 << 30

DENIED_OPS = frozenset({
    # files
    "WriteFile", "ReadFile", "MatchingFiles", "ImmutableConst", "FileSystemSetConfiguration",
    "InitializeTableFromTextFile", "InitializeTableFromTextFileV2", "GenerateVocabRemap", "LoadAndRemapMatrix",
    "WholeFileReader", "WholeFileReaderV2", "TextLineReader", "TextLineReaderV2", "FixedLengthRecordReader",
    "FixedLengthRecordReaderV2", "TFRecordReader", "TFRecordReaderV2", "LMDBReader", "IdentityReader",
    "IdentityReaderV2", "ReaderRead", "ReaderReadV2", "ReaderReadUpTo", "ReaderReadUpToV2",
    "ReaderRestoreState", "ReaderRestoreStateV2", "DecodeProtoV2", "EncodeProto",
    # datasets that read or write files
    "TFRecordDataset", "TFRecordDatasetV2", "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2",
    "TextLineDataset", "CSVDataset", "CSVDatasetV2", "ExperimentalCSVDataset", "MatchingFilesDataset",
    "ExperimentalMatchingFilesDataset", "SqlDataset", "ExperimentalSqlDataset", "LMDBDataset",
    "ExperimentalLMDBDataset", "SaveDataset", "SaveDatasetV2", "LoadDataset", "DatasetToTFRecord",
    "ExperimentalDatasetToTFRecord", "SnapshotDataset", "SnapshotDatasetV2", "SnapshotDatasetReader",
    "SnapshotNestedDatasetReader", "CacheDataset", "CacheDatasetV2", "DataServiceDataset",
    "DataServiceDatasetV2", "DataServiceDatasetV3", "DataServiceDatasetV4", "DistributedSave",
    # summary writers and event files
    "WriteSummary", "WriteRawProtoSummary", "WriteScalarSummary", "WriteHistogramSummary", "WriteImageSummary",
    "WriteAudioSummary", "WriteGraphSummary", "ImportEvent", "CreateSummaryFileWriter", "CreateSummaryDbWriter",
    "FlushSummaryWriter", "CloseSummaryWriter", "SummaryWriter",
    # Python and arbitrary code
    "PyFunc", "PyFuncStateless", "EagerPyFunc", "MlirPassthroughOp",
    # printing, debugging (debug URLs write files or reach servers)
    "Print", "PrintV2", "DebugIdentity", "DebugIdentityV2", "DebugIdentityV3", "DebugNanCount",
    "DebugNumericSummary", "DebugNumericSummaryV2", "Copy", "CopyHost",
    # other processes
    "RemoteCall", "RemoteFusedGraphExecute", "_Send", "_Recv", "_HostSend", "_HostRecv", "Send", "Recv",
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveReduceScatterV2",
    "CollectiveGather", "CollectiveGatherV2", "CollectiveBcastSend", "CollectiveBcastRecv",
    "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveAllToAllV2", "CollectiveAllToAllV3",
    "CollectiveInitializeCommunicator", "CollectiveAssignGroupV2", "NcclAllReduce", "NcclBroadcast",
    "NcclReduce",
})
SAVE_OPS = frozenset({"SaveV2", "Save", "SaveSlices", "MergeV2Checkpoints"})
RESTORE_OPS = frozenset({"RestoreV2", "Restore", "RestoreSlice"})
# stateful ops an init op (or the variable restore) may run: variables, tables, random initial values
INIT_STATEFUL_OK = frozenset({
    "VariableV2", "Variable", "VarHandleOp", "Assign", "AssignVariableOp", "AssignAdd", "AssignSub",
    "AssignAddVariableOp", "AssignSubVariableOp", "ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized",
    "DestroyResourceOp", "HashTable", "HashTableV2", "MutableHashTable", "MutableHashTableV2",
    "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2", "MutableDenseHashTable", "MutableDenseHashTableV2",
    "InitializeTable", "InitializeTableV2", "LookupTableImport", "LookupTableImportV2", "LookupTableInsert",
    "LookupTableInsertV2", "AnonymousHashTable", "AnonymousMutableHashTable", "RandomUniform", "RandomUniformInt",
    "RandomStandardNormal", "TruncatedNormal", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "Multinomial", "ParameterizedTruncatedNormal", "NoOp", "PartitionedCall", "StatefulPartitionedCall", "If",
    "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
})
INIT_COLLECTIONS = ("saved_model_main_op", "legacy_init_op")
INIT_SIGNATURE = "__saved_model_init_op"


class UnsafeModelError(ExportError):
    """A SavedModel holds an op that loading or serving it must not run; ``op`` and ``node`` name it."""

    def __init__(self, path: str, op: str, node: str, reason: str):
        self.op, self.node = op, node
        super().__init__(f"refusing to load SavedModel {path}: op {op!r} (node {node!r}) {reason}")


def check_saved_model(path: str | Path) -> None:
    """Check every meta graph of the SavedModel directory ``path`` before it is loaded.

    Raises:
        UnsafeModelError: an op named in the message may not be loaded (see the module docstring).
        ExportError: ``path`` holds no readable ``saved_model.pb``/``saved_model.pbtxt``.
    """
    proto = _read(Path(path))
    for meta in proto.meta_graphs:
        _check_meta_graph(meta, str(path))


def _read(path: Path):
    from google.protobuf import text_format
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    for name, binary in (("saved_model.pb", True), ("saved_model.pbtxt", False)):
        file = path / name
        if not (file.exists() or file.is_symlink()):
            continue
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                info = os.fstat(f.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise ExportError(f"{file} is not a regular file")
                if info.st_size > MAX_SAVED_MODEL_BYTES:
                    raise ExportError(f"{file} is larger than the {MAX_SAVED_MODEL_BYTES >> 20} MiB limit")
                data = f.read()
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


@dataclass
class _Closure:
    """Main-graph nodes and library functions that running some roots may execute."""

    nodes: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)


def check_graph_def(graph_def, where: str) -> None:
    """Check a GraphDef that will be imported and run (a frozen graph): no denied or unknown op,
    and no checkpoint op (a frozen graph has no variables to restore).

    Raises:
        UnsafeModelError: naming the op and node.
    """
    graph = _Graph(graph_def, where)
    _check_denied(graph, where)
    for fn, node in graph.all_nodes():
        if node.op in SAVE_OPS | RESTORE_OPS:
            raise UnsafeModelError(where, node.op, _label(fn, node), "reads or writes checkpoint files; a frozen "
                                   "graph has no variables")


class _Graph:
    def __init__(self, graph_def, where: str):
        self.where = where
        self.nodes = {n.name: n for n in graph_def.node}
        self.functions = {f.signature.name: f for f in graph_def.library.function}

    def called(self, node) -> Iterable[str]:
        """Library functions a node calls (as its op, or through any function-valued attribute)."""
        if node.op in self.functions:
            yield node.op
        for value in node.attr.values():
            if value.HasField("func"):
                yield value.func.name
            if value.HasField("list"):
                yield from (f.name for f in value.list.func)

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
            for node in self.functions[fn].node_def:
                fn_stack.extend(self.called(node))
        return out

    def all_nodes(self) -> Iterable[tuple[str | None, object]]:
        """``(function name or None for the main graph, node)`` for every node."""
        for node in self.nodes.values():
            yield None, node
        for name, fn in self.functions.items():
            for node in fn.node_def:
                yield name, node


def _node_name(tensor: str) -> str:
    return tensor.lstrip("^").split(":")[0]


def _label(fn: str | None, node) -> str:
    return node.name if fn is None else f"{fn}/{node.name}"


def _check_denied(graph: _Graph, path: str) -> None:
    from tensorflow.python.framework import op_def_registry

    for fn, node in graph.all_nodes():
        if node.op in DENIED_OPS:
            raise UnsafeModelError(path, node.op, _label(fn, node), "touches files, runs code or reaches other "
                                   "processes; a policy never needs it")
        if node.op not in graph.functions and op_def_registry.get(node.op) is None:
            raise UnsafeModelError(path, node.op, _label(fn, node), "is not an op known to this TensorFlow")


def _check_meta_graph(meta, path: str) -> None:
    graph = _Graph(meta.graph_def, path)
    _check_denied(graph, path)
    init_roots = _init_roots(meta)
    run_roots = [t.name for key, sig in meta.signature_def.items() if key != INIT_SIGNATURE
                 for t in (*sig.inputs.values(), *sig.outputs.values())]
    saver = meta.saver_def if meta.HasField("saver_def") else None
    run = graph.closure(run_roots + init_roots)
    restore = graph.closure([saver.restore_op_name] if saver else [])
    _check_checkpoint_ops(graph, run, restore, saver, path)
    _check_stateful(graph, graph.closure(init_roots), path, "the init op", frozenset())
    _check_stateful(graph, restore, path, "the variable restore op", RESTORE_OPS)


def _init_roots(meta) -> list[str]:
    roots = []
    for key in INIT_COLLECTIONS:
        if key in meta.collection_def:
            roots.extend(meta.collection_def[key].node_list.value)
    if INIT_SIGNATURE in meta.signature_def:
        roots.extend(t.name for t in meta.signature_def[INIT_SIGNATURE].outputs.values())
    return roots


def _check_checkpoint_ops(graph: _Graph, run: _Closure, restore: _Closure, saver, path: str) -> None:
    filename = _node_name(saver.filename_tensor_name) if saver else None
    for fn, node in graph.all_nodes():
        if node.op not in SAVE_OPS | RESTORE_OPS:
            continue
        in_run = node.name in run.nodes if fn is None else fn in run.functions
        in_restore = node.name in restore.nodes if fn is None else fn in restore.functions
        if in_run:
            raise UnsafeModelError(path, node.op, _label(fn, node), "runs when the model is loaded or served; "
                                   "only the standard variable restore may use checkpoint files")
        if node.op in SAVE_OPS and in_restore:
            raise UnsafeModelError(path, node.op, _label(fn, node), "writes files during the variable restore")
        if node.op in RESTORE_OPS and in_restore and fn is None and _source(graph, node.input[0]) != filename:
            raise UnsafeModelError(path, node.op, _label(fn, node), "restores from a path other than the "
                                   "SavedModel's own variables")


def _source(graph: _Graph, tensor: str) -> str:
    """The node a tensor comes from, looking through ``Identity`` nodes."""
    name = _node_name(tensor)
    for _ in range(100):
        node = graph.nodes.get(name)
        if node is None or node.op != "Identity" or not node.input:
            break
        name = _node_name(node.input[0])
    return name


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
