"""The ops a TensorFlow graph may hold before the package lets TensorFlow see it.

:data:`ALLOWED_OPS` is an explicit list, grown on purpose: it holds what the package's own
exports (every bundled fixture in every TF format), the serving subgraphs of the RLlib fixtures
and what ``convert`` writes for them need, and nothing that takes a file name, an address or a
serialised graph. Checkpoint ops (``SaveV2``, ``RestoreV2``...) are not on it: :mod:`exporter.trust`
allows them only in the saver's own save and restore paths.

This module is the list alone (:mod:`exporter.trust` checks graphs against it). When a new kind of
graph needs an op, collect what it uses and what is missing (:mod:`exporter.allowed_ops`)::

    python -m policy_export.exporter.allowed_ops --collect path/to/saved_model path/to/frozen_graph.pb
    python -m policy_export.exporter.allowed_ops --collect --serving path/to/rllib/saved_model

(``--serving``: only what the signature, the restore op and the init op need, as ``convert`` and
``inspect`` see it). Add an op only after checking what it does.
"""

from __future__ import annotations

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
    "VarHandleOp", "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "VarIsInitializedOp", "DisableCopyOnRead",
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
