"""TF SavedModel (tag ``serve``, signature ``serving_default``) of the policy session."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import tensorflow as tf

from policy_export.exporter.context import ExportContext, FormatRecord
from policy_export.exporter.devices import DevicePlan
from policy_export.exporter.trust import check_saved_model
from policy_export.policy.errors import ExportError, InputError
from policy_export.policy.tf_policy import session_config
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


_GLOB_CHARS = frozenset("*?[]{}\\")


@contextlib.contextmanager
def glob_free_path(path: Path) -> Iterator[Path]:
    """``path``, or while in use a symbolic link to it without glob characters.

    TensorFlow looks checkpoints up by glob pattern, so a SavedModel under a directory named like
    ``exp_[1]`` would not load from its own path.
    """
    path = Path(path).absolute()
    if not _GLOB_CHARS & set(str(path)):
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="policy-export-load-"))
    try:
        link = tmp / "model"
        link.symlink_to(path, target_is_directory=True)
        yield link
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class SavedModelRunner:
    """Loads a SavedModel into a fresh graph and runs its signature by key."""

    def __init__(self, path: Path, device: DevicePlan, signature_key: str = SERVING_KEY, tags=(TAG,)):
        """Check the SavedModel's ops (:func:`exporter.trust.check_saved_model`), then load it.

        Raises:
            UnsafeModelError: the SavedModel holds an op that may not be loaded (nothing is run).
            ExportError: not a loadable SavedModel, or no such signature.
        """
        check_saved_model(path)
        self.graph = tf.Graph()
        self.session = tf1.Session(graph=self.graph, config=session_config(device.tf_device))
        try:
            with self.graph.as_default(), tf.device(device.tf_device), glob_free_path(path) as alias:
                meta = tf1.saved_model.loader.load(self.session, list(tags), str(alias))
        except (OSError, RuntimeError, ValueError, tf.errors.OpError) as e:
            raise ExportError(f"{path} is not a loadable SavedModel with tags {list(tags)}: {e}") from e
        if signature_key not in meta.signature_def:
            raise ExportError(f"{path} has no signature {signature_key!r}; it has {sorted(meta.signature_def)}")
        sig = meta.signature_def[signature_key]
        self.signature_def = sig
        self.inputs = {k: self.graph.get_tensor_by_name(v.name) for k, v in sig.inputs.items()}
        self.outputs = {k: self.graph.get_tensor_by_name(v.name) for k, v in sig.outputs.items()}

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        unknown = sorted(set(feeds) - set(self.inputs))
        if unknown:
            raise InputError(f"SavedModel signature has no input(s) {unknown}")
        values = self.session.run(self.outputs, {self.inputs[k]: v for k, v in feeds.items()})
        return {k: np.asarray(v) for k, v in values.items()}

    def close(self) -> None:
        self.session.close()


def load(export_dir: Path, device: DevicePlan) -> SavedModelRunner:
    """A runner over ``export_dir/saved_model``."""
    return SavedModelRunner(export_dir / DIRNAME, device)
