"""The op allowlist, checkpoint-op rules, declared-size budget and prune-before-load of exporter.trust."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR, splice_into_serving_path
from policy_export.exporter import allowed_ops, trust

LEGACY = FIXTURES_DIR / "rllib" / "legacy"


def _saved_model(path: Path, body) -> None:
    import tensorflow as tf

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), tf1.Session(graph=graph) as sess:
        x = tf1.placeholder(tf.float32, [None, 4], name="obs")
        w = tf1.get_variable("w", [4, 2])
        y = body(tf.matmul(x, w))
        sess.run(tf1.global_variables_initializer())
        sig = tf1.saved_model.predict_signature_def({"observations": x}, {"actions": y})
        builder = tf1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map={"serving_default": sig})
        builder.save()


def _write_file(victim, a):
    import tensorflow as tf

    tf.io.write_file(str(victim), "pwned")


def _save_v2(victim, a):
    import tensorflow as tf

    tf.raw_ops.SaveV2(prefix=str(victim), tensor_names=["a"], shape_and_slices=[""], tensors=[a])


@pytest.mark.parametrize("payload, op, message", [
    (_write_file, "WriteFile", "is not on the list of ops"),
    (_save_v2, "SaveV2", "runs when the model is loaded or served"),
])
def test_a_payload_two_functions_deep_is_refused_naming_op_and_function(tmp_path, payload, op, message):
    """A signature calls a tf.function that calls the one holding the payload."""
    import tensorflow as tf

    victim = tmp_path / "pwned"

    @tf.function
    def inner(a):
        payload(victim, a)
        return a

    @tf.function
    def outer(a):
        return inner(a)

    _saved_model(tmp_path / "sm", outer)
    with pytest.raises(trust.UnsafeModelError) as info:
        trust.check_saved_model(tmp_path / "sm")
    assert info.value.op == op and "inner" in info.value.node
    assert message in str(info.value) and not victim.exists()


def test_a_splat_constant_frozen_graph_is_refused_quickly_naming_node_and_size():
    from tensorflow.core.framework import graph_pb2

    graph_def = graph_pb2.GraphDef()
    node = graph_def.node.add(name="splat", op="Const")
    node.attr["dtype"].type = 1
    tensor = node.attr["value"].tensor
    tensor.dtype = 1
    tensor.tensor_shape.dim.add(size=10**9)
    tensor.float_val.append(1.0)
    assert graph_def.ByteSize() < 6000
    start = time.perf_counter()
    with pytest.raises(trust.UnsafeModelError) as info:
        trust.check_graph_def(graph_def, "evil.pb")
    assert time.perf_counter() - start < 10
    assert info.value.node == "splat" and "4000000000 bytes" in str(info.value)


def test_every_fixture_export_needs_only_allowed_ops(exports):
    _, out = exports("cartpole_mlp")
    for path in (out / "saved_model", out / "keras" / "saved_model", out / "frozen_graph.pb"):
        lacking = allowed_ops.missing(allowed_ops.graph_ops(path))
        assert not lacking, f"{path} needs ops not on ALLOWED_OPS: {lacking}"
    for path in sorted(p.parent for p in (FIXTURES_DIR / "rllib").glob("*/*/*/saved_model.pb")):
        lacking = allowed_ops.missing(allowed_ops.graph_ops(path, serving=True))
        assert not lacking, f"{path} (serving subgraph) needs ops not on ALLOWED_OPS: {lacking}"


def test_convert_of_a_legacy_model_loads_no_training_op(tmp_path):
    from policy_export.exporter.sources.legacy import load_saved_model_policy

    policy, _ = load_saved_model_policy(LEGACY / "cartpole_ff" / "saved_model", device="cpu")
    try:
        ops = {op.type for op in policy.session.graph.get_operations()}
    finally:
        policy.close()
    assert not ops & {"ResourceApplyAdam", "ApplyAdam", "BroadcastGradientArgs", "Log", "Mean"}
    assert "SaveV2" not in ops and "RestoreV2" not in ops


# ------------------------------------------------------------------ hostile ops crafted into real graphs

HOSTILE_OPS = ("DatasetFromGraph", "DumpTensor", "RpcClient", "CalibrationStatisticsSaver", "RecordInput",
               "SnapshotChunkDataset", "ListSnapshotChunksDataset", "RegisterDataset", "DTensorRestoreV2",
               "WriteFile", "ImmutableConst", "PyFunc")


def _with_hostile_node(pb: Path, op: str, where: str, victim: Path) -> None:
    """Rewrite ``saved_model.pb`` at ``pb`` with one ``op`` node: in the serving path of the main graph, or
    inside a library function the serving path calls through another function."""
    from tensorflow.core.framework import function_pb2, node_def_pb2
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString(pb.read_bytes())
    meta = proto.meta_graphs[0]
    graph = meta.graph_def
    payload = node_def_pb2.NodeDef(name="payload", op=op)
    payload.attr["file_name"].s = str(victim).encode()
    output = next(iter(meta.signature_def["serving_default"].outputs.values())).name.split(":")[0]
    if where == "main":
        graph.node.append(payload)
    else:
        inner = function_pb2.FunctionDef()
        inner.signature.name = "inner_payload"
        inner.node_def.append(payload)
        outer = function_pb2.FunctionDef()
        outer.signature.name = "outer_payload"
        outer.node_def.append(node_def_pb2.NodeDef(name="call", op="inner_payload"))
        graph.library.function.extend([inner, outer])
        graph.node.append(node_def_pb2.NodeDef(name="payload", op="outer_payload"))
    node = next(n for n in graph.node if n.name == output)
    node.input.append("^payload")
    pb.write_bytes(proto.SerializeToString())


@pytest.mark.parametrize("op", HOSTILE_OPS)
def test_a_hostile_op_in_a_candidate_saved_model_fails_verify_and_never_runs(exports, tmp_path, op):
    import json
    import shutil

    from helpers import cli

    _, out = exports("cartpole_mlp")
    candidate, victim = tmp_path / "evil", tmp_path / "pwned"
    shutil.copytree(out / "saved_model", candidate)
    where = "main" if HOSTILE_OPS.index(op) % 2 else "nested"
    _with_hostile_node(candidate / "saved_model.pb", op, where, victim)
    proc = cli("verify", str(out), "--candidate", f"saved_model={candidate}", "-q",
               "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr
    error = json.loads((tmp_path / "r.json").read_text())["errors"]
    message = next(iter(error.values()))
    assert f"op '{op}'" in message and "refusing to load SavedModel" in message
    assert ("inner_payload/payload" if where == "nested" else "node 'payload'") in message
    assert not victim.exists()


@pytest.mark.parametrize("op", ["DumpTensor", "WriteFile", "RpcClient"])
def test_a_hostile_op_in_a_frozen_graph_is_refused(exports, op):
    from tensorflow.core.framework import node_def_pb2

    _, out = exports("cartpole_mlp")
    graph_def = trust.read_graph_def(out / "frozen_graph.pb")
    graph_def.node.append(node_def_pb2.NodeDef(name="payload", op=op))
    with pytest.raises(trust.UnsafeModelError, match=f"op '{op}' \\(node 'payload'\\)"):
        trust.check_graph_def(graph_def, "frozen_graph.pb")


def test_a_restore_from_a_host_path_inside_a_function_is_refused(exports, tmp_path):
    """The restore op calls a function whose RestoreV2 reads a host checkpoint, not the model's variables."""
    import tensorflow as tf
    from tensorflow.core.framework import function_pb2, node_def_pb2
    from tensorflow.core.protobuf import saved_model_pb2

    host = tmp_path / "host"
    tf.train.Checkpoint(v=tf.Variable([1.0])).write(str(host / "ckpt"))
    _, out = exports("cartpole_mlp")
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((out / "saved_model" / "saved_model.pb").read_bytes())
    meta = proto.meta_graphs[0]
    fn = function_pb2.FunctionDef()
    fn.signature.name = "host_restore"
    prefix = node_def_pb2.NodeDef(name="prefix", op="Const")
    prefix.attr["dtype"].type = tf.string.as_datatype_enum
    prefix.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(str(host / "ckpt")))
    fn.node_def.extend([prefix, node_def_pb2.NodeDef(name="restore", op="RestoreV2",
                                                     input=["prefix:output:0", "prefix:output:0", "prefix:output:0"])])
    meta.graph_def.library.function.append(fn)
    meta.graph_def.node.append(node_def_pb2.NodeDef(name="host_call", op="host_restore"))
    restore = meta.saver_def.restore_op_name.split(":")[0]
    next(n for n in meta.graph_def.node if n.name == restore).input.append("^host_call")
    candidate = tmp_path / "sm"
    candidate.mkdir()
    (candidate / "saved_model.pb").write_bytes(proto.SerializeToString())
    with pytest.raises(trust.UnsafeModelError, match=r"op 'RestoreV2' \(node 'host_restore/restore'\).*other than"):
        trust.check_saved_model(candidate)


def test_convert_prunes_a_hostile_op_in_the_unused_training_graph_and_refuses_it_in_the_serving_path(tmp_path):
    import shutil

    from tensorflow.core.framework import node_def_pb2
    from tensorflow.core.protobuf import saved_model_pb2

    from helpers import cli

    victim = tmp_path / "pwned"
    for case in ("unused", "serving"):
        model = tmp_path / case
        shutil.copytree(LEGACY / "cartpole_ff" / "saved_model", model)
        proto = saved_model_pb2.SavedModel()
        proto.ParseFromString((model / "saved_model.pb").read_bytes())
        meta = proto.meta_graphs[0]
        meta.graph_def.node.append(node_def_pb2.NodeDef(name="payload", op="WriteFile"))
        if case == "serving":
            output = next(iter(meta.signature_def["serving_default"].outputs.values())).name.split(":")[0]
            next(n for n in meta.graph_def.node if n.name == output).input.append("^payload")
        (model / "saved_model.pb").write_bytes(proto.SerializeToString())
        proc = cli("convert", str(model), "--out", str(tmp_path / f"out_{case}"), "--samples", "8", "-q")
        if case == "unused":
            assert proc.returncode == 0, proc.stderr
            assert b"WriteFile" not in (tmp_path / "out_unused" / "saved_model" / "saved_model.pb").read_bytes()
        else:
            assert proc.returncode == 2, proc.stderr
            from helpers import messages

            assert len(messages(proc.stderr)) == 1 and "op 'WriteFile' (node 'payload')" in " ".join(proc.stderr.split())
            assert not (tmp_path / "out_serving").exists()
    assert not victim.exists()


def _real_dataset_payload(pb: Path, victim: Path) -> None:
    """Splice TF's own DatasetFromGraph, fed a serialised dataset graph whose map fn writes ``victim``,
    into the serving path of the SavedModel at ``pb`` (the output waits on the dataset's one element)."""
    import tensorflow as tf

    def write_then(x):
        with tf.control_dependencies([tf.io.write_file(str(victim), "pwned")]):
            return tf.identity(x)

    dataset = tf.data.Dataset.from_tensors(tf.constant(0)).map(write_then)
    serialised = tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor).numpy()
    assert b"WriteFile" in serialised
    def build(obs):
        # chosen by a test on the observations (always true for finite ones), so that no optimiser folds it
        graph_def = tf.where(tf.reduce_all(tf.math.is_finite(obs)), tf.constant(serialised), tf.constant(b""),
                             name="payload_graph")
        variant = tf.raw_ops.DatasetFromGraph(graph_def=graph_def, name="payload_dataset")
        tf.raw_ops.DatasetToSingleElement(dataset=variant, output_types=[tf.int32], output_shapes=[[]],
                                          name="payload")
        return "payload"

    splice_into_serving_path(pb, build)


def test_a_real_dataset_graph_payload_writes_under_tensorflow_and_never_under_verify(exports, tmp_path):
    """The issue's first attack, with TF's own ops: loaded by TF's loader the payload writes the file;
    verify refuses the candidate before TensorFlow sees it and the file is never written."""
    import json
    import shutil
    import subprocess
    import sys

    from helpers import cli

    _, out = exports("cartpole_mlp")
    candidate, victim = tmp_path / "evil", tmp_path / "pwned"
    shutil.copytree(out / "saved_model", candidate)
    _real_dataset_payload(candidate / "saved_model.pb", victim)
    # the payload is live: TensorFlow's own loader, run unchecked in a child, writes the file
    run = ("import sys, numpy as np, tensorflow as tf\n"
           "tf1 = tf.compat.v1\n"
           "with tf1.Session(graph=tf.Graph()) as s:\n"
           "    m = tf1.saved_model.loader.load(s, ['serve'], sys.argv[1])\n"
           "    sig = m.signature_def['serving_default']\n"
           "    obs = sig.inputs['observations']\n"
           "    feed = {obs.name: np.zeros([1] + [d.size for d in obs.tensor_shape.dim[1:]], np.float32)}\n"
           "    s.run([v.name for v in sig.outputs.values()], feed)\n")
    child = subprocess.run([sys.executable, "-c", run, str(candidate)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert victim.read_text() == "pwned"
    victim.unlink()
    proc = cli("verify", str(out), "--candidate", f"saved_model={candidate}", "-q",
               "--report-json", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr
    message = next(iter(json.loads((tmp_path / "r.json").read_text())["errors"].values()))
    assert "op 'DatasetFromGraph'" in message and "node 'payload_dataset'" in message
    assert not victim.exists()
