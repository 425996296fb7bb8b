"""The exporter: the export, verify and convert pipelines, the formats, parity and the command line.

    cli.py, options.py                the command line; every cheap check of the options, once
    pipeline.py the one pipeline from any source to its exports (export SOURCE, convert,
                export-many, the API); convert.py its Python API per source
    export.py, verify.py  exporting a loaded policy; verifying an export
    sources/    what comes in, as plugins found by a registry: a spec directory, an RLlib
                checkpoint (the safe reader, the networks rebuilt from their config), a SavedModel
                (a TF1 policy graph, RLlib <= 2.0; a Keras base model, RLlib >= 2.1); a live RLlib
                policy (from_rllib)
    formats/    one plugin per format: its writer, its runner, its checks
    parity/     the parity plan, its replay, comparison, exploration, stepped and behavioural
                parity, localisation
    tfgraph.py, trust.py, oplist.py   TF1 graph surgery; the safe reader and the op allowlist
    manifest.py, staging.py, reports.py, inspection.py, rollout.py, progress.py, devices.py, ...

Imports are lazy so that the command line starts without loading TensorFlow.
"""

from importlib import import_module

_WHERE = {
    "export_policy": "policy_export.exporter.export", "export_spec": "policy_export.exporter.convert",
    "ExportResult": "policy_export.exporter.export", "verify_export": "policy_export.exporter.verify",
    "VerifyResult": "policy_export.exporter.verify", "ParityFailedError": "policy_export.errors",
    "ExportOptions": "policy_export.exporter.options", "VerifyOptions": "policy_export.exporter.options",
    "ALL_FORMATS": "policy_export.exporter.options", "ParityReport": "policy_export.exporter.parity.compare",
    "Tolerance": "policy_export.exporter.parity.compare", "Tolerances": "policy_export.exporter.parity.compare",
    "plan_devices": "policy_export.exporter.devices", "convert_saved_model": "policy_export.exporter.convert",
    "convert_checkpoint": "policy_export.exporter.convert",
    "convert_checkpoint_policies": "policy_export.exporter.convert",
    "export_source": "policy_export.exporter.pipeline",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'policy_export.exporter' has no attribute {name!r}")
