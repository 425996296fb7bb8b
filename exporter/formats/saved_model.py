"""``saved_model``: a TF SavedModel (tag ``serve``, signature ``serving_default``) of the policy session."""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import Capabilities, ExportContext, Format, FormatRecord
from policy_export.errors import ExportError, InputError

TAG = "serve"  # tf.saved_model.SERVING


class SavedModelFormat(Format):
    name = "saved_model"
    path = "saved_model"
    order = 10
    is_directory = True
    capabilities = Capabilities(reference=True)

    def write(self, ctx, target: Path):
        return write_saved_model(ctx, target)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.tf_runner import TFGraphRunner
        from policy_export.signatures.contract import Contract

        return TFGraphRunner.from_saved_model(path, device, contract=Contract.from_json(manifest["contract"]))

    def check_candidate(self, path: Path) -> None:
        if not (path / "saved_model.pb").is_file():
            raise InputError(f"candidate {self.name}={path}: not a SavedModel directory (no saved_model.pb)")
        from policy_export.exporter.formats.base import refuse_links

        refuse_links(self.name, path)  # a linked variables/ would be restored from outside the candidate


FORMAT = SavedModelFormat()


def write_saved_model(ctx: ExportContext, target: Path) -> FormatRecord:
    """Write the policy's graph and variables with the ``serving_default`` signature to ``target``
    (tag ``serve``); it is run by :class:`exporter.formats.tf_runner.TFGraphRunner`."""
    import tensorflow as tf

    from policy_export.signatures.builder import SERVING_KEY

    tf1 = tf.compat.v1
    policy = ctx.policy
    try:
        with policy.graph.as_default():
            builder = tf1.saved_model.Builder(str(target))
            builder.add_meta_graph_and_variables(
                policy.session, [TAG], signature_def_map=ctx.signature.signature_def_map(),
                strip_default_attrs=True,
            )
            builder.save()
    except (tf.errors.OpError, OSError, ValueError) as e:
        raise ExportError(f"writing the SavedModel to {target} failed: {e}") from e
    return FormatRecord("saved_model", (target.name,), {"tags": [TAG], "signature": SERVING_KEY})
