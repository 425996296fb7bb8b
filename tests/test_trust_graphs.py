"""The op allowlist, checkpoint-op rules, declared-size budget and prune-before-load of exporter.trust."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import FIXTURES_DIR
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


def test_write_file_in_a_nested_function_is_refused_naming_op_and_function(tmp_path):
    import tensorflow as tf

    victim = tmp_path / "pwned"

    @tf.function
    def inner(a):
        tf.io.write_file(str(victim), "pwned")
        return a

    @tf.function
    def outer(a):
        return inner(a)

    _saved_model(tmp_path / "sm", outer)
    with pytest.raises(trust.UnsafeModelError) as info:
        trust.check_saved_model(tmp_path / "sm")
    assert info.value.op == "WriteFile" and "inner" in info.value.node
    assert "is not on the list of ops" in str(info.value) and not victim.exists()


def test_save_v2_reached_through_nested_functions_from_a_signature_is_refused(tmp_path):
    import tensorflow as tf

    victim = tmp_path / "pwned"

    @tf.function
    def inner(a):
        tf.raw_ops.SaveV2(prefix=str(victim), tensor_names=["a"], shape_and_slices=[""], tensors=[a])
        return a

    @tf.function
    def outer(a):
        return inner(a)

    _saved_model(tmp_path / "sm", outer)
    with pytest.raises(trust.UnsafeModelError) as info:
        trust.check_saved_model(tmp_path / "sm")
    assert info.value.op == "SaveV2" and "runs when the model is loaded or served" in str(info.value)
    assert not victim.exists()


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
    from policy_export.exporter.convert import load_saved_model_policy

    policy, _ = load_saved_model_policy(LEGACY / "cartpole_ff" / "saved_model", device="cpu")
    try:
        ops = {op.type for op in policy.session.graph.get_operations()}
    finally:
        policy.close()
    assert not ops & {"ResourceApplyAdam", "ApplyAdam", "BroadcastGradientArgs", "Log", "Mean"}
    assert "SaveV2" not in ops and "RestoreV2" not in ops
