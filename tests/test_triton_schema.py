"""Triton's ``ModelConfig`` schema as the package ships it (``model_config.binpb``, loaded into a
private protobuf descriptor pool): it accepts and rejects what ``tritonclient``'s own
``model_config_pb2`` does, and ``inspect`` reads a Triton model without ``tritonclient``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from policy_export.exporter.formats.triton import config as tc

T = tc.Tensor
WRITTEN = {
    "batched": tc.ModelConfig("m", 8, (T("obs", "TYPE_FP32", (4,)), T("flag", "TYPE_BOOL", (1,), (), optional=True)),
                              (T("actions", "TYPE_INT64", (1,), ()), T("logp", "TYPE_FP32", (1,), ())),
                              preferred_batch_sizes=(4, 8), version=3, notes=("written by policy-export",)),
    "unbatched": tc.ModelConfig("m_explore", 0, (T("obs", "TYPE_UINT8", (2, 84, 84, 3)), T("t", "TYPE_INT64", (1,))),
                                (T("a", "TYPE_FP64", (-1, 2)),)),
    "sequence": tc.ModelConfig("lstm", 1, (T("obs", "TYPE_FP32", (4,)), T("prev_reward", "TYPE_FP32", (1,), ())),
                               (T("actions", "TYPE_INT64", (1,), ()),),
                               states=((T("state_in_0", "TYPE_FP32", (64,)), "state_out_0"),
                                       (T("state_in_1", "TYPE_FP32", (64,)), "state_out_1")),
                               control_start="seq_start"),
}
INVALID = {
    "unknown field": 'name: "x"\nno_such_field: 1\n',
    "unknown enum value": 'name: "x"\ninput [ { name: "a" data_type: TYPE_FLOAT32 dims: [ 1 ] } ]\n',
    "string for an integer": 'name: "x"\nmax_batch_size: "eight"\n',
    "unknown nested field": 'name: "x"\ndynamic_batching { max_delay: 5 }\n',
    "not text format": '{"name": "x"}\n',
    "unclosed message": 'name: "x"\ninstance_group [ { kind: KIND_CPU\n',
    "integer out of range": 'name: "x"\nmax_batch_size: 99999999999\n',
}


def _tritonclient_schema():
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        pytest.skip(f"tritonclient[grpc] is not installed (the serving extra), nothing to compare with: {e}")
    return model_config_pb2


def _verdict(message_class, text: str):
    """The parsed message (as its canonical serialization) or the parse error's text."""
    from google.protobuf import text_format

    try:
        return "ok", text_format.Parse(text, message_class()).SerializeToString(deterministic=True)
    except text_format.ParseError as e:
        return "rejected", str(e)


@pytest.mark.parametrize("text", [tc.render(c) for c in WRITTEN.values()] + list(INVALID.values()),
                         ids=[f"written-{k}" for k in WRITTEN] + [f"invalid-{k}" for k in INVALID])
def test_the_shipped_schema_accepts_and_rejects_what_tritonclients_does(text):
    ours, _ = tc.model_config_schema()
    theirs = _tritonclient_schema().ModelConfig
    assert _verdict(ours, text) == _verdict(theirs, text)


def test_configs_the_package_writes_pass_and_invalid_ones_fail_without_tritonclient():
    from policy_export.errors import ConversionError

    for config in WRITTEN.values():
        assert tc.check_with_triton_schema(tc.render(config), config.name) is True
    for what, text in INVALID.items():
        with pytest.raises(ConversionError, match="Triton's ModelConfig schema rejects the config"):
            tc.check_with_triton_schema(text, what)


def test_the_descriptor_is_tritons_model_config():
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.FileDescriptorProto.FromString(tc.SCHEMA_FILE.read_bytes())
    assert (proto.name, proto.package, proto.syntax, list(proto.dependency)) == (
        "model_config.proto", "inference", "proto3", [])
    model_config, data_types = tc.model_config_schema()
    assert model_config.DESCRIPTOR.full_name == "inference.ModelConfig"
    assert data_types.full_name == "inference.DataType"
    assert {"TYPE_FP32", "TYPE_BOOL", "TYPE_BF16", "TYPE_STRING"} <= set(data_types.values_by_name)
    fields = set(model_config.DESCRIPTOR.fields_by_name)
    assert {"name", "backend", "max_batch_size", "input", "output", "dynamic_batching", "sequence_batching",
            "instance_group", "version_policy"} <= fields
    assert set(tc.TRITON_TYPES.values()) <= set(data_types.values_by_name)


def test_the_shipped_schema_is_the_one_its_tritonclient_version_generates():
    from importlib import metadata

    pb = _tritonclient_schema()
    version = metadata.version("tritonclient")
    if tc.SCHEMA_SOURCE != f"tritonclient {version}":
        pytest.skip(f"tritonclient {version} is installed; the schema was taken from {tc.SCHEMA_SOURCE}")
    assert tc.SCHEMA_FILE.read_bytes() == pb.DESCRIPTOR.serialized_pb


BLOCK = """
import sys
class _NoTritonclient:
    def find_spec(self, name, path=None, target=None):
        if name == "tritonclient" or name.startswith("tritonclient."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _NoTritonclient())
try:
    import tritonclient.grpc  # noqa: F401
    raise SystemExit("tritonclient was not blocked")
except ImportError:
    pass
from policy_export.exporter.cli import main
code = main(sys.argv[1:])
assert not any(m.split(".")[0] == "tritonclient" for m in sys.modules)
sys.exit(code)
"""


def test_inspect_reads_a_triton_model_without_tritonclient(tmp_path):
    model = tmp_path / "m"
    (model / "3").mkdir(parents=True)
    (model / "config.pbtxt").write_text(tc.render(WRITTEN["batched"]))
    done = subprocess.run([sys.executable, "-c", BLOCK, "inspect", str(model), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    assert doc["kind"] == "triton" and doc["signature_key"] == "m"
    assert [(i["key"], i["dtype"], i["shape"]) for i in doc["inputs"]] == [
        ("obs", "float32", [None, 4]), ("flag", "bool", [None])]
    assert [(o["key"], o["dtype"], o["shape"]) for o in doc["outputs"]] == [
        ("actions", "int64", [None]), ("logp", "float32", [None])]
    (model / "config.pbtxt").write_text('name: "m"\nplatform: 7 7\n')
    done = subprocess.run([sys.executable, "-c", BLOCK, "inspect", str(model)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "not a valid Triton ModelConfig" in done.stderr, done.stderr[-2000:]


def test_a_linked_or_oversized_config_is_refused(tmp_path, monkeypatch):
    from policy_export.errors import ExportError

    real = tmp_path / "real.pbtxt"
    real.write_text(tc.render(WRITTEN["batched"]))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.pbtxt").symlink_to(real)
    with pytest.raises(ExportError, match="links are not followed"):
        tc.triton_contract(model)
    (model / "config.pbtxt").unlink()
    (model / "config.pbtxt").write_text(real.read_text())
    assert tc.triton_contract(model).signature_key == "m"
    monkeypatch.setattr(tc, "CONFIG_LIMIT", 64)
    with pytest.raises(ExportError, match="over 64 bytes"):
        tc.triton_contract(model)


def test_older_protobufs_message_factory_builds_the_same_class():
    """protobuf < 4.22 has no ``GetMessageClass``: ``MessageFactory(pool).GetPrototype``, which
    :func:`model_config_schema` uses there, builds a class that parses alike (where it still exists)."""
    import warnings

    from google.protobuf import descriptor_pool, message_factory

    if not hasattr(message_factory.MessageFactory, "GetPrototype"):
        pytest.skip("this protobuf has no MessageFactory.GetPrototype (removed in protobuf 5)")
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(tc.SCHEMA_FILE.read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        older = message_factory.MessageFactory(pool).GetPrototype(pool.FindMessageTypeByName("inference.ModelConfig"))
    newer, _ = tc.model_config_schema()
    for text in [tc.render(c) for c in WRITTEN.values()] + list(INVALID.values()):
        assert _verdict(older, text) == _verdict(newer, text)
