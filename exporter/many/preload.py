"""Imported once by the local pool's fork server, before any policy's process is forked from it:
TensorFlow, ONNX Runtime, tf2onnx and the package's pipelines (quietly), so that each policy's
fresh process starts with them imported instead of paying the imports again. Nothing is built or
run here: no graph, no session and no runtime's thread pool exists before the fork."""

from policy_export.exporter.quiet import quiet_libraries

quiet_libraries()

from policy_export.exporter import api, convert, verify  # noqa: E402,F401
from policy_export.exporter.many import work  # noqa: E402,F401
