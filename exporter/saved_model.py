"""TF SavedModel (tag ``serve``, signature ``serving_default``) of the policy session.

It is run by :class:`exporter.tf_runner.TFGraphRunner`."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from policy_export.exporter.context import ExportContext, FormatRecord
from policy_export.policy.errors import ExportError
from policy_export.signatures.builder import SERVING_KEY

tf1 = tf.compat.v1
TAG = tf1.saved_model.tag_constants.SERVING
DIRNAME = "saved_model"


def write(ctx: ExportContext, target: Path) -> FormatRecord:
    """Write the policy's graph and variables with the ``serving_default`` signature to ``target``."""
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
