"""The TF graph-mode policy: spaces, spec file, models, distributions and TFPolicy.

Names are imported lazily so that ``policy.errors`` stays light (no TensorFlow import).
"""

from importlib import import_module

_EXPORTS = {
    "policy_export.errors": (
        "CheckFailedError", "DeviceError", "ExportBusyError", "ExportError", "ExportExistsError",
        "EnvironmentMismatchError", "InputError", "PolicyExportError", "SpecError", "UnsupportedSpaceError",
        "WeightsError",
    ),
    "policy_export.policy.spec": ("LstmConfig", "ModelConfig", "PolicySpec", "load_spec", "spec_from_json", "write_spec"),
    "policy_export.policy.tf_policy": ("ActionResult", "TFPolicy"),
    "policy_export.policy.template": ("weight_shapes", "write_weights_template"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'policy' has no attribute {name!r}")
