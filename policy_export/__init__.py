"""policy-export: export a TF graph-mode reinforcement-learning policy to every serving format.

The public API, imported lazily so that ``import policy_export`` does not load TensorFlow::

    from policy_export import TFPolicy, load_spec, export_policy

    policy = TFPolicy.from_spec(load_spec("fixtures/cartpole_mlp"))
    result = export_policy(policy, "out/cartpole_mlp")

Sub-packages: ``policy_export.policy`` (spaces, spec file, models, TFPolicy),
``policy_export.signatures`` (SignatureDef and the I/O contract) and ``policy_export.exporter``
(the pipelines, sources, formats, parity and the command line); ``policy_export.errors`` is the
one error hierarchy.
"""

from importlib import import_module

__version__ = "0.3.0"

_EXPORTS = {
    "policy_export.errors": (
        "CheckFailedError", "DeviceError", "ExportBusyError", "ExportError", "ExportExistsError",
        "EnvironmentMismatchError", "InputError", "PolicyExportError", "SpecError", "UnsupportedSpaceError",
        "WeightsError", "ParityFailedError", "UnsafeModelError", "RunTimeoutError", "DeclaredSizeError",
        "ConversionError", "UnsafeCheckpointError",
    ),
    "policy_export.policy.spec": (
        "LstmConfig", "ModelConfig", "PolicySpec", "load_spec", "spec_from_json", "write_spec",
    ),
    "policy_export.policy.tf_policy": ("ActionResult", "TFPolicy"),
    "policy_export.policy.template": ("weight_shapes", "write_weights_template"),
    "policy_export.exporter.sources.rllib": ("from_rllib",),
    "policy_export.exporter.export": ("export_policy", "ExportResult"),
    "policy_export.exporter.pipeline": ("export_source", "sign_verified"),
    "policy_export.exporter.signing": ("sign_export", "verify_signature"),
    "policy_export.exporter.inspection": ("inspect_path", "diff_exports"),
    "policy_export.exporter.rollout": ("rollout",),
    "policy_export.exporter.serve.server": ("TritonServer",),
    "policy_export.exporter.example": ("write_example",),
    "policy_export.exporter.docs": ("read_docs",),
    "policy_export.exporter.verify": ("verify_export", "VerifyResult"),
    "policy_export.exporter.foreign": ("verify_reference",),
    "policy_export.exporter.foreign.export": ("export_model",),
    "policy_export.exporter.options": ("ExportOptions", "VerifyOptions", "RolloutOptions", "ALL_FORMATS"),
    "policy_export.exporter.convert": ("export_spec", "convert_saved_model", "convert_checkpoint",
                                       "convert_checkpoint_policies"),
    "policy_export.exporter.sources.checkpoint": ("read_checkpoint",),
    "policy_export.exporter.many": ("export_many", "verify_many", "ManyResult"),
    "policy_export.exporter.parity.compare": ("ParityReport", "Tolerance", "Tolerances"),
    "policy_export.signatures": ("Contract", "TensorSpec", "build_signature"),
    "policy_export.exporter.quiet": ("show_library_logs",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE) + ["__version__"]


# the first API call that imports TensorFlow loads it quietly (policy_export.exporter.quiet);
# importing the package imports nothing heavy and changes no environment variable
import_module("policy_export.exporter.quiet").install()


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'policy_export' has no attribute {name!r}")


def __dir__():
    return __all__
