"""Export a TF graph-mode policy to every serving format and prove parity.

Imports are lazy so that the command line starts without loading TensorFlow.
"""

from importlib import import_module

_WHERE = {
    "export_policy": "policy_export.exporter.api", "export_spec": "policy_export.exporter.api", "verify_export": "policy_export.exporter.api",
    "ExportResult": "policy_export.exporter.api", "VerifyResult": "policy_export.exporter.api", "ParityFailedError": "policy_export.exporter.api",
    "ALL_FORMATS": "policy_export.exporter.api", "ParityReport": "policy_export.exporter.parity", "Tolerance": "policy_export.exporter.parity",
    "Tolerances": "policy_export.exporter.parity", "plan_devices": "policy_export.exporter.devices",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'exporter' has no attribute {name!r}")
