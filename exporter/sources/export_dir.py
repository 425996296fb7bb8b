"""The export source: an export this package wrote, exported again (to formats it did not hold,
another opset, a Triton repository added later) without the source it was first made from.

Its ``saved_model/`` is the policy: loaded as a TF1 policy SavedModel (:mod:`exporter.sources.legacy`)
with the spaces and contract the manifest records, once every file of it matched the manifest
(the same hash check ``verify`` makes; ``--expect-manifest-sha256`` pins the manifest itself).
The new export's parity runs against that SavedModel's session, and its manifest's ``source``
records the export it came from, with what that export recorded of its own source.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.errors import ExportError, InputError
from policy_export.exporter.sources.base import Loaded, Opened, Option, Source, check_values

SAVED_MODEL = "saved_model"  # the directory of the export's SavedModel, as its manifest lists it
CONTRACT_FIELDS = ("signature_key", "method", "inputs", "outputs")  # the signature's own; the rest a source added


def _pin(value: Any, option: Option) -> str | None:
    text = value.lower() if isinstance(value, str) else value
    if text is not None and not (isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)):
        raise InputError(f"{option.name} ({option.flag}) must be 64 hexadecimal digits, got {value!r:.80}")
    return text


class ExportSource(Source):
    name = "export"
    description = "an export of this package (manifest.json beside saved_model/)"
    order = 25
    stage = "load export"
    reference = "the source export's SavedModel session"
    options = (
        Option("expect_manifest_sha256", "refuse the export unless its manifest.json has this sha256 "
               "(the digest kept outside the export)", None, metavar="HEX", rule=_pin),
    )

    def detect(self, path: Path) -> bool:
        return (path / "manifest.json").is_file() and (path / SAVED_MODEL / "saved_model.pb").is_file()

    def open(self, path: Path, values: Mapping[str, Any]) -> Opened:
        from policy_export.exporter import manifest
        from policy_export.policy.spaces import space_from_json

        checked, root = check_values(self, values), Path(path)
        doc = manifest.read_manifest(root)
        pinned = checked["expect_manifest_sha256"]
        if pinned is not None and manifest.manifest_sha256(root) != pinned:
            raise ExportError(f"{root / 'manifest.json'} does not have the sha256 {pinned}; nothing was loaded")
        if SAVED_MODEL not in doc["formats"]:
            raise ExportError(f"{root} holds no {SAVED_MODEL} format (its formats: {', '.join(doc['formats'])}); "
                              "an export is exported again from its SavedModel")
        check = manifest.check_files(root, doc, {})
        if not check.trusted(SAVED_MODEL):
            first = next((p for p in check.problems if SAVED_MODEL in p), "its files differ from the manifest")
            raise ExportError(f"{root}: {SAVED_MODEL}/ does not match the manifest ({first}); nothing was loaded")
        spaces = doc.get("spaces") or {}
        if not isinstance(spaces, dict) or not {"observation", "action"} <= set(spaces):
            raise ExportError(f"{root / 'manifest.json'} records no observation and action spaces")
        observation = space_from_json(spaces["observation"], "$.spaces.observation", str(root / "manifest.json"))
        action = space_from_json(spaces["action"], "$.spaces.action", str(root / "manifest.json"))
        return Opened(self, root, checked, {None: observation}, {"manifest": doc, "action_space": action,
                                                                "sha256": manifest.manifest_sha256(root)})

    def load(self, opened: Opened, policy_id: str | None, device: Any) -> Loaded:
        from policy_export.exporter.sources.legacy import load_saved_model_policy

        doc = opened.state["manifest"]
        contract = doc["contract"]
        policy, record = load_saved_model_policy(opened.path / SAVED_MODEL, contract.get("signature_key",
                                                 "serving_default"), "serve", device, None,
                                                 opened.policies[None], opened.state["action_space"])
        name = doc.get("name")
        if isinstance(name, str) and name:  # the policy keeps its name (the manifest's, a served model's)
            policy.name = name
        return Loaded(policy, {"converted_from": str(opened.path.absolute()), "kind": "export",
                               "manifest_sha256": opened.state["sha256"], "exported_from": doc.get("source"),
                               **{k: v for k, v in record.items() if k == "key_mapping"}},
                      {k: v for k, v in contract.items() if k not in CONTRACT_FIELDS})

    def summary(self, record: Mapping[str, Any] | None) -> list[str]:
        record = record or {}
        return [f"  from the export {record.get('converted_from')} (manifest sha256 {record.get('manifest_sha256')})"]


SOURCE = ExportSource()
