"""The graph rewrites made before ONNX conversion compute exactly what they replace
(:func:`policy_export.exporter.tfgraph.converter_rewrites`); RLlib's own graphs are checked in
``tests/test_rllib_algorithms.py``."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from policy_export.exporter import tfgraph

tf1 = tf.compat.v1


def _run(graph_def, fetch: str, feeds: dict) -> np.ndarray:
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf1.Session(graph=graph) as sess:
        return sess.run(fetch, {graph.get_tensor_by_name(k): v for k, v in feeds.items()})


def _onnx(graph_def, inputs: list[str], output: str, feeds: dict) -> np.ndarray:
    import onnxruntime as ort
    import tf2onnx

    model, _ = tf2onnx.convert.from_graph_def(graph_def, input_names=inputs, output_names=[output], opset=17)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("a,b", [([3, 1], [1, 4]), ([2], [5, 2]), ([1, 1, 6], [7, 1])])
def test_broadcast_args_becomes_a_shape_of_broadcast_zeros(a, b):
    graph = tf.Graph()
    with graph.as_default():
        s0 = tf1.placeholder(tf.int32, (None,), name="s0")
        s1 = tf1.placeholder(tf.int32, (None,), name="s1")
        tf.identity(tf.raw_ops.BroadcastArgs(s0=s0, s1=s1), name="shape")
    before = graph.as_graph_def()
    after = tfgraph.converter_rewrites(before)
    assert "BroadcastArgs" not in {n.op for n in after.node}
    feeds = {"s0:0": np.array(a, np.int32), "s1:0": np.array(b, np.int32)}
    want = _run(before, "shape:0", feeds)
    np.testing.assert_array_equal(_run(after, "shape:0", feeds), want)
    got = _onnx(after, ["s0:0", "s1:0"], "shape:0", feeds)
    np.testing.assert_array_equal(got, want)


@pytest.fixture(params=["v1", "v2"])
def loops(request):
    """TF1 while loops (Enter/Exit frames), as RLlib's graphs hold them on TF 2.9 (ray 2.0), or
    functional ``While`` nodes (control flow v2), as they hold them on TF 2.15 (ray 2.9)."""
    was = tf1.control_flow_v2_enabled()
    (tf1.disable_control_flow_v2 if request.param == "v1" else tf1.enable_control_flow_v2)()
    yield request.param
    (tf1.enable_control_flow_v2 if was else tf1.disable_control_flow_v2)()


LOOP_OPS = {"Enter", "Exit", "While", "StatelessWhile"}


def _segment_loop(endpoints: list[int], values: list[float], outside: float):
    """A piecewise-linear schedule looked up with a while loop over (i, t), the way RLlib's
    ``PiecewiseSchedule`` builds it for TF; the graph's ``value:0`` is the schedule's value."""
    graph = tf.Graph()
    with graph.as_default():
        t = tf1.placeholder_with_default(np.int64(0), (), name="timestep")
        ends = tf.cast(tf.stack(endpoints + [-1]), tf.int64)
        results = [v0 + tf.cast(t - e0, tf.float32) / float(e1 - e0) * (v1 - v0)
                   for (e0, v0), (e1, v1) in zip(zip(endpoints, values), zip(endpoints[1:], values[1:]))]
        results = tf.stack(results + [tf.constant(outside)])

        def cond(i, x):
            x = tf.cast(x, tf.int64)
            return tf.logical_not(tf.logical_or(tf.equal(ends[i + 1], -1),
                                                tf.logical_and(ends[i] <= x, x < ends[i + 1])))

        index = tf1.while_loop(cond, lambda i, x: (i + 1, t), [tf.constant(0, tf.int64), t])[0]
        tf.identity(results[index], name="value")
    return graph


def test_a_schedule_loop_becomes_its_closed_form_and_converts(loops):
    graph = _segment_loop([0, 100, 1000], [1.0, 0.5, 0.05], 0.05)
    before = graph.as_graph_def()
    after = tfgraph.converter_rewrites(before)
    assert LOOP_OPS & {n.op for n in before.node}
    pruned = tf1.graph_util.extract_sub_graph(after, ["value"])
    assert not LOOP_OPS & {n.op for n in pruned.node}
    for t in (0, 1, 50, 99, 100, 101, 500, 999, 1000, 1001, 10**7):
        feeds = {"timestep:0": np.int64(t)}
        want = _run(before, "value:0", feeds)
        assert _run(after, "value:0", feeds) == want
        np.testing.assert_allclose(_onnx(pruned, ["timestep:0"], "value:0", {"timestep:0": np.array(t, np.int64)}), want,
                                   rtol=1e-6)


def test_another_loop_is_left_as_it_is(loops):
    graph = tf.Graph()
    with graph.as_default():
        t = tf1.placeholder_with_default(np.int64(3), (), name="timestep")
        tf.identity(tf1.while_loop(lambda i, x: i < x, lambda i, x: (i + 1, x),
                                   [tf.constant(0, tf.int64), t])[0], name="count")
    before = graph.as_graph_def()
    after = tfgraph.converter_rewrites(before)
    assert [n.name for n in after.node] == [n.name for n in before.node]
    assert _run(after, "count:0", {"timestep:0": np.int64(7)}) == 7


def test_a_loop_that_never_ends_is_left_as_it_is_within_the_timeout(loops, monkeypatch):
    """A schedule-shaped loop whose condition never turns false (a hostile file's) is probed
    with a deadline, found not to be a schedule, and left alone: the conversion does not hang."""
    monkeypatch.setattr(tfgraph, "EVALUATE_TIMEOUT_MS", 500)
    graph = tf.Graph()
    with graph.as_default():
        t = tf1.placeholder_with_default(np.int64(0), (), name="timestep")
        ends = tf.cast(tf.stack([0, 100, -1]), tf.int64)
        index = tf1.while_loop(lambda i, x: tf.logical_not(tf.equal(ends[0], -1)) | (i < 0),
                               lambda i, x: (i + 1, t), [tf.constant(0, tf.int64), t])[0]
        tf.identity(index, name="count")
    before = graph.as_graph_def()
    after = tfgraph.converter_rewrites(before)
    assert [n.name for n in after.node] == [n.name for n in before.node]


def _functional_cond_graph():
    """A graph built with TF's v2 control flow (as RLlib's is when TensorFlow was imported before
    it): a two-output ``If`` on ``explore`` whose true branch holds another ``If`` on the same
    switch, and whose false branch returns one argument unchanged."""
    from tensorflow.python.ops import control_flow_util

    graph = tf.Graph()
    enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = True
    try:
        with graph.as_default():
            x = tf1.placeholder(tf.float32, (None, 3), name="x")
            explore = tf1.placeholder_with_default(True, (), name="explore")
            noisy = x + tf.random.normal(tf.shape(x))

            def sampled():
                inner = tf.cond(explore, lambda: noisy * 2.0, lambda: noisy - 1.0)
                return inner, tf.reduce_sum(inner, axis=1)

            a, b = tf.cond(explore, sampled, lambda: (x, tf.reduce_max(x, axis=1)))
            tf.identity(a, name="a")
            tf.identity(b, name="b")
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = enabled
    return graph.as_graph_def()


@pytest.mark.parametrize("value", [False, True])
def test_a_functional_if_on_a_pinned_switch_becomes_its_branch(value):
    graph_def = _functional_cond_graph()
    assert sum(n.op in tfgraph.FUNCTIONAL_IFS for n in graph_def.node) == 1
    tfgraph.pin_bool(graph_def, "explore", value)
    assert tfgraph.fold_constant_switches(graph_def) == (2 if value else 1)  # the inner If too
    assert not any(n.op in tfgraph.FUNCTIONAL_IFS for n in graph_def.node)
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    a, b = _run(graph_def, ["a:0", "b:0"], {"x:0": x})  # one run: one draw of the noise
    if value:  # sampled: noise differs per run, the structure does not
        assert a.shape == (5, 3) and not np.allclose(a, 2 * x)
        np.testing.assert_allclose(b, a.sum(axis=1), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(a, x)
        np.testing.assert_array_equal(b, x.max(axis=1))
        kept = tf1.graph_util.extract_sub_graph(graph_def, ["a", "b"])
        assert not any(n.op == "RandomStandardNormal" for n in kept.node)  # the untaken side is gone


def test_a_functional_if_on_a_runtime_value_is_left_alone():
    graph_def = _functional_cond_graph()
    before = graph_def.SerializeToString()
    assert tfgraph.fold_constant_switches(graph_def) == 0
    assert graph_def.SerializeToString() == before
