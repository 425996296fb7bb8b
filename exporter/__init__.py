"""Export a TF graph-mode policy to every serving format and prove parity.

Imports are lazy so that the command line starts without loading TensorFlow.
"""

from importlib import import_module

_WHERE = {
    "export_policy": "exporter.api", "export_spec": "exporter.api", "verify_export": "exporter.api",
    "ExportResult": "exporter.api", "VerifyResult": "exporter.api", "ParityFailedError": "exporter.api",
    "ALL_FORMATS": "exporter.api", "ParityReport": "exporter.parity", "Tolerance": "exporter.parity",
    "Tolerances": "exporter.parity", "plan_devices": "exporter.devices",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'exporter' has no attribute {name!r}")
