"""``tf_serving``: a TF Serving model base path, its ``models.config`` and golden predict requests.

The SavedModel of the ``saved_model`` format (same writer, same ``serving_default`` signature)
goes to ``tf_serving/<model_name>/<model_version>/``; ``tf_serving/models.config`` serves that
version from ``/models/<model_name>``, where the tensorflow/serving image looks for models, so
``tf_serving/<model_name>`` is mounted there (or ``tf_serving/`` at ``/models``, with
``--model_config_file=/models/models.config``). Every signature must pass TensorFlow's own
servability check. ``tf_serving/<model_name>/requests/`` holds a golden request and the response
TF Serving must give, as REST JSON and as serialised ``PredictRequest``/``PredictResponse``
(:mod:`.golden`). Parity runs on the SavedModel of the version directory, as for ``saved_model``.
The model name and version come from ``--model-name``/``--model-version``. Opt-in (``--formats``).
"""

from __future__ import annotations

from pathlib import Path

from policy_export.exporter.formats.base import SERVED_MODEL_OPTIONS, Capabilities, Format, FormatRecord
from policy_export.errors import InputError


class TFServingFormat(Format):
    name = "tf_serving"
    options = SERVED_MODEL_OPTIONS
    path = "tf_serving"
    order = 72  # with the other serving targets, after the edge formats
    is_directory = True
    capabilities = Capabilities(default=False)

    def write(self, ctx, target: Path) -> FormatRecord:
        from policy_export.exporter.formats.tf_serving.write import write_tf_serving

        return write_tf_serving(ctx, target, self.name)

    def open(self, path: Path, manifest, device):
        from policy_export.exporter.formats.tf_runner import TFGraphRunner
        from policy_export.exporter.formats.tf_serving.layout import Layout
        from policy_export.signatures.contract import Contract

        info = (manifest.get("formats") or {}).get(self.name) or {}
        layout = Layout.of(path, info.get("model_name"), info.get("model_version"))
        return TFGraphRunner.from_saved_model(layout.version_dir, device,
                                              contract=Contract.from_json(manifest["contract"]))

    inspect_order = 20
    inspect_description = "a TF Serving base path"
    serving_layout = True
    inspect_needs_tensorflow = True

    def find_model(self, path: Path) -> Path | None:
        from policy_export.exporter.formats.tf_serving.layout import newest_version

        return newest_version(path) if path.is_dir() else None

    def read_contract(self, found: Path, signature_key: str = "serving_default", tag: str = "serve"):
        from policy_export.exporter.formats.saved_model import saved_model_contract

        return saved_model_contract(found, signature_key, tag)

    def check_candidate(self, path: Path) -> None:
        from policy_export.exporter.formats.tf_serving.layout import CONFIG_FILE

        if not path.is_dir() or not (path / CONFIG_FILE).is_file():
            raise InputError(f"candidate {self.name}={path}: not a TF Serving layout (a directory holding "
                             f"{CONFIG_FILE} and <model_name>/<version>/saved_model.pb)")
        from policy_export.exporter.formats.base import refuse_links

        refuse_links(self.name, path)


FORMAT = TFServingFormat()
