"""Writing the ``tf_serving`` layout (see :mod:`.layout`) and checking it before parity runs on it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from policy_export.exporter.formats.base import ExportContext, FormatRecord
from policy_export.exporter.formats.saved_model import TAG, write_saved_model
from policy_export.exporter.formats.tf_serving import golden
from policy_export.exporter.formats.tf_serving.layout import (
    Layout, add_signature_defaults, check_servable, check_version_dir, files_under, write_model_config,
)
from policy_export.errors import ExportError


def write_tf_serving(ctx: ExportContext, target: Path, name: str) -> FormatRecord:
    """Write the SavedModel into ``target/<model_name>/<model_version>/``, ``models.config`` and the
    golden requests, after checking that TF Serving can serve every signature.

    Raises:
        ExportError: the SavedModel cannot be written, a signature is not servable, the version
            directory holds more than the SavedModel, or the golden files do not hold their values.
    """
    from policy_export.signatures.builder import SERVING_KEY

    layout = Layout.of(target, ctx.model_name, ctx.model_version)
    layout.base.mkdir(parents=True, exist_ok=True)
    write_saved_model(ctx, layout.version_dir)  # the saved_model format's own writer
    defaults = add_signature_defaults(layout.version_dir, ctx.signature.contract)
    check_version_dir(layout)
    signatures = check_servable(layout.version_dir)
    write_model_config(layout)
    inputs = golden.golden_inputs(ctx.policy, ctx.signature.contract)
    outputs = _run_signature(layout.version_dir, ctx, inputs)
    requests = golden.write_golden(layout.requests, (layout.name, layout.version, SERVING_KEY), inputs, outputs)
    root = target.parent
    details = _details(layout, root, signatures, requests, inputs)
    details["signature_defaults"] = defaults
    return FormatRecord(name, tuple(files_under(root, target)), details)


def _run_signature(saved_model_dir: Path, ctx: ExportContext,
                   inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The written SavedModel's ``serving_default`` outputs for ``inputs``, in contract order.

    Raises:
        ExportError: ``inputs`` are not the signature's inputs, less those with a default (TF
            Serving would refuse them).
    """
    from policy_export.exporter.formats.tf_runner import TFGraphRunner

    contract = ctx.signature.contract
    with TFGraphRunner.from_saved_model(saved_model_dir, ctx.device, contract=contract) as runner:
        optional = {s.key for s in contract.inputs if not s.required}
        missing, extra = set(runner.inputs) - set(inputs) - optional, set(inputs) - set(runner.inputs)
        if missing or extra:
            raise ExportError(f"tf_serving: the golden request does not feed the signature's required inputs "
                              f"(missing {sorted(missing)}, extra {sorted(extra)}); TF Serving would refuse it")
        values = runner(inputs)
    return {k: values[k] for k in contract.output_keys if k in values}


def _details(layout: Layout, root: Path, signatures: list[str], requests: list[Path],
             inputs: Mapping[str, np.ndarray]) -> dict:
    """The manifest record: where the model is, what serves it, what the golden files hold."""
    rel = {p.name: p.relative_to(root).as_posix() for p in requests}
    base = layout.base.relative_to(root).as_posix()
    batched = [np.shape(v)[0] for v in inputs.values() if np.ndim(v) > 0]
    return {
        "model_name": layout.name,
        "model_version": layout.version,
        "saved_model": layout.version_dir.relative_to(root).as_posix(),
        "tags": [TAG],
        "signature": "serving_default",
        "signatures": signatures,
        "model_config": layout.config.relative_to(root).as_posix(),
        "base_path": layout.container_base_path,
        "mount": {"source": base, "target": layout.container_base_path,
                  "note": "TF Serving needs an absolute base path: models.config names the path the "
                          f"tensorflow/serving image serves ({layout.container_base_path}); mount {base} there "
                          "(or the tf_serving directory at /models), or edit base_path to where it lies"},
        "requests": {"signature": "serving_default", "rows": batched[0] if batched else 1, "seed": golden.SEED,
                     "inputs": sorted(inputs),
                     "explore": "not sent: the signature's default (false), the deterministic action",
                     "rest_request": rel[golden.REQUEST_JSON], "rest_response": rel[golden.RESPONSE_JSON],
                     "grpc_request": rel[golden.REQUEST_PB], "grpc_response": rel[golden.RESPONSE_PB]},
    }
