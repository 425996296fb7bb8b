"""The ops a TensorFlow graph may hold before the package lets TensorFlow see it.

:data:`ALLOWED_OPS` is an explicit list, grown on purpose: it holds what the package's own
exports (every bundled fixture in every TF format), the serving subgraphs of the RLlib fixtures
and what ``convert`` writes for them need, and nothing that takes a file name, an address or a
serialised graph. Checkpoint ops (``SaveV2``, ``RestoreV2``...) are not on it: :mod:`exporter.trust`
allows them only in the saver's own save and restore paths.

When a new kind of graph needs an op, collect what it uses and what is missing::

    python -m policy_export.exporter.allowed_ops --collect path/to/saved_model path/to/frozen_graph.pb
    python -m policy_export.exporter.allowed_ops --collect --serving path/to/rllib/saved_model

(``--serving``: only what the signature, the restore op and the init op need, as ``convert`` and
``inspect`` see it). Add an op only after checking what it does.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ALLOWED_OPS = frozenset({
    # further pure computation policies of the same kinds use (other activations, math, pooling, layouts,
    # TF 2.15's Keras LSTM with its cuDNN branch, RLlib's DQN/SAC heads); none reads or writes outside tensors
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atan2", "Atanh", "AvgPool", "BatchMatMul", "BatchMatMulV2",
    "BatchMatMulV3", "BroadcastArgs", "BroadcastTo", "Ceil", "CheckNumerics", "ClipByValue", "Cos", "Cosh",
    "CudnnRNN", "CudnnRNNBackprop", "CudnnRNNBackpropV2", "CudnnRNNV2", "Cumsum", "DepthwiseConv2dNative",
    "Digamma", "DivNoNan", "Einsum", "EluGrad", "EnsureShape", "Erf", "Erfc", "Expm1", "Floor", "GatherNd",
    "Identity", "IsFinite", "IsInf", "IsNan", "LeakyRelu", "LeakyReluGrad", "Lgamma", "Log", "Log1p",
    "LogicalOr", "MatrixBandPart", "MatrixDiag", "MatrixDiagV3", "MaxPool", "Mean", "Min", "MirrorPad", "Mod",
    "MulNoNan", "NotEqual", "Pad", "PadV2", "Pow", "PreventGradient", "Rank", "Reciprocal", "Relu6",
    "Relu6Grad", "ReluGrad", "ReverseV2", "Rint", "Round", "Rsqrt", "ScatterNd", "Selu", "SeluGrad",
    "ShapeN", "Sin", "Sinh", "Size", "Softmax", "SoftplusGrad", "Softsign", "Sqrt", "SquaredDifference",
    "StopGradient", "Tan", "TopKV2", "TruncateDiv", "Where", "Xlogy", "Xdivy", "LessEqual", "Cumprod",
    "ArgMin", "Bucketize", "ClipByValue", "Softmax",
    # graph structure: inputs, constants, identities, no-ops
    "Const", "Identity", "IdentityN", "NoOp", "Placeholder", "PlaceholderWithDefault",
    # function calls and functional control flow (the called functions are checked too)
    "PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While", "StatelessWhile",
    # TF1 control flow (tf.cond / tf.while_loop in graph mode)
    "Enter", "Exit", "LoopCond", "Merge", "NextIteration", "Switch",
    # variables (resource and reference) and their initialisation
    "VarHandleOp", "ReadVariableOp", "AssignVariableOp", "VarIsInitializedOp", "DisableCopyOnRead",
    "VariableV2", "Assign", "IsVariableInitialized",
    # checkpoint file names (pure string computation for the saver; the file ops are checked apart)
    "ShardedFilename", "StringJoin", "StaticRegexFullMatch",
    # element-wise arithmetic and math
    "AddN", "AddV2", "Cast", "Elu", "Equal", "Exp", "FloorDiv", "FloorMod", "Greater", "GreaterEqual", "Less",
    "LogicalAnd", "LogicalNot", "Maximum", "Minimum", "Mul", "Neg", "RealDiv", "Relu", "Select", "SelectV2",
    "Sigmoid", "Sign", "Softplus", "Square", "Sub", "Tanh",
    # reductions, arg-reductions and softmax
    "All", "Any", "ArgMax", "LogSoftmax", "Max", "Prod", "Sum",
    # linear algebra and neural-network layers
    "BiasAdd", "Conv2D", "CudnnRNNV3", "DiagPart", "MatMul", "Qr", "SparseSoftmaxCrossEntropyWithLogits",
    # shapes, indexing and layout
    "ConcatOffset", "ConcatV2", "ExpandDims", "Fill", "GatherV2", "InvertPermutation", "OneHot", "OnesLike",
    "Pack", "Range", "Reshape", "Shape", "Slice", "Split", "SplitV", "Squeeze", "StridedSlice", "Tile",
    "Transpose", "Unpack", "ZerosLike",
    # gradients inside Keras layer functions (kept in the library of a Keras SavedModel; never run by serving)
    "BiasAddGrad", "BroadcastGradientArgs", "CudnnRNNBackpropV3", "SigmoidGrad", "StridedSliceGrad", "TanhGrad",
    # tensor lists, tensor arrays and optionals (recurrent loops)
    "EmptyTensorList", "TensorListElementShape", "TensorListFromTensor", "TensorListGetItem", "TensorListLength",
    "TensorListPopBack", "TensorListPushBack", "TensorListReserve", "TensorListSetItem", "TensorListStack",
    "TensorArrayGatherV3", "TensorArrayReadV3", "TensorArrayScatterV3", "TensorArrayV3", "TensorArrayWriteV3",
    "OptionalFromValue", "OptionalGetValue", "OptionalNone",
    # sampling the package emits (actions, exploration noise) and random initial values
    "Multinomial", "RandomStandardNormal", "RandomUniform", "RandomUniformInt",
    "StatelessRandomGetKeyCounter", "StatelessRandomNormalV2", "StatelessRandomUniformV2",
})


def graph_ops(path: str | Path, serving: bool = False, signature_key: str = "serving_default",
              ) -> dict[str, set[str]]:
    """The ops of the graphs at ``path``, each with where it occurs (``graph`` or ``function NAME``).

    ``path`` is a SavedModel directory (every meta graph, every library function; with
    ``serving``, only what :func:`exporter.trust.prune_to_serving` keeps for ``signature_key``)
    or a frozen ``GraphDef`` file. Nothing is loaded into TensorFlow.

    Returns:
        op name -> places it occurs; library function names used as ops are not listed.
    Raises:
        ExportError: ``path`` cannot be read.
    """
    from policy_export.exporter import trust

    path = Path(path)
    if path.is_dir():
        metas = trust.read_saved_model(path).meta_graphs
        graphs = [(trust.prune_to_serving(m, signature_key, str(path)) if serving else m).graph_def for m in metas]
    else:
        graphs = [trust.read_graph_def(path)]
    return ops_of(graphs)


def ops_of(graph_defs: Iterable) -> dict[str, set[str]]:
    """Op name -> where it occurs, over the main graphs and every library function of ``graph_defs``."""
    out: dict[str, set[str]] = defaultdict(set)
    for graph_def in graph_defs:
        functions = {f.signature.name for f in graph_def.library.function}
        for node in graph_def.node:
            if node.op not in functions:
                out[node.op].add("graph")
        for fn in graph_def.library.function:
            for node in fn.node_def:
                if node.op not in functions:
                    out[node.op].add(f"function {fn.signature.name}")
    return dict(out)


def missing(ops: Iterable[str]) -> list[str]:
    """The ops of ``ops`` that are neither on :data:`ALLOWED_OPS` nor checkpoint ops (which
    :mod:`exporter.trust` checks by where they are), sorted."""
    from policy_export.exporter.trust import RESTORE_OPS, SAVE_OPS

    return sorted(set(ops) - ALLOWED_OPS - SAVE_OPS - RESTORE_OPS)


def main(argv: list[str] | None = None) -> int:
    """``--collect PATH...``: print every op of the graphs with its use count, then the ones the
    list lacks. Returns 1 when some are missing, else 0."""
    parser = argparse.ArgumentParser(prog="python -m policy_export.exporter.allowed_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", nargs="+", metavar="PATH", required=True,
                        help="SavedModel directories or frozen graph files")
    parser.add_argument("--serving", action="store_true", help="only the serving subgraph of each SavedModel")
    parser.add_argument("--signature", default="serving_default")
    args = parser.parse_args(argv)
    found: dict[str, set[str]] = defaultdict(set)
    for path in args.collect:
        for op, places in graph_ops(path, args.serving, args.signature).items():
            found[op].update(f"{path}: {p}" for p in places)
    for op in sorted(found):
        mark = "" if op not in missing([op]) else "   <- NOT ALLOWED"
        sys.stdout.write(f"{op}  ({len(found[op])} places){mark}\n")
    lacking = missing(found)
    for op in lacking:
        sys.stdout.write(f"missing: {op}  e.g. {sorted(found[op])[0]}\n")
    return 1 if lacking else 0


if __name__ == "__main__":
    sys.exit(main())
