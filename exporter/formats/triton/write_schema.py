"""Write ``model_config.binpb``: Triton's ``model_config.proto`` (package ``inference``) as a
serialized ``FileDescriptorProto``, which :mod:`.config` loads into a private descriptor pool to
read and check ``config.pbtxt`` files without ``tritonclient``.

The shipped file was taken from tritonclient 2.73.0 (``tritonclient.grpc.model_config_pb2``,
generated from Triton's ``model_config.proto``); :data:`.config.SCHEMA_SOURCE` names it. To update::

    pip install "tritonclient[grpc]==X.Y.Z"
    python -m policy_export.exporter.formats.triton.write_schema

then set ``SCHEMA_SOURCE`` in ``config.py`` to the version printed.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

SCHEMA_FILE = Path(__file__).with_name("model_config.binpb")


def main() -> int:
    from google.protobuf import descriptor_pb2
    from tritonclient.grpc import model_config_pb2

    data = model_config_pb2.DESCRIPTOR.serialized_pb
    proto = descriptor_pb2.FileDescriptorProto.FromString(data)
    if proto.package != "inference" or proto.dependency:
        print(f"unexpected schema: package {proto.package!r}, imports {list(proto.dependency)}", file=sys.stderr)
        return 1
    SCHEMA_FILE.write_bytes(data)
    print(f"{SCHEMA_FILE}: {len(data)} bytes from tritonclient {metadata.version('tritonclient')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
