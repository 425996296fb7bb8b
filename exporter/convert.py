"""``convert``: a SavedModel someone else wrote, into a full export.

The SavedModel is read once (:func:`exporter.trust.read_saved_model`) and routed by what it holds:
a Keras base model (RLlib >= 2.1 ``export_model``: the network alone, the action head rebuilt
from ``action_space``; :mod:`exporter.sources.keras`) or a TF1 policy graph (RLlib <= 2.0, whose
signature has ``actions`` outputs; :mod:`exporter.sources.legacy`). The policy it yields is then
exported like any other (:func:`exporter.export.export_policy`), with the manifest's ``source``
recording where every key came from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import gymnasium as gym

from policy_export.errors import InputError
from policy_export.exporter.export import export_policy
from policy_export.exporter.options import ExportOptions, replace
from policy_export.exporter.progress import SILENT
from policy_export.exporter.staging import check_target
from policy_export.exporter.watchdog import run_limit
from policy_export.signatures.keys import EXPLORE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceOptions:
    """How to read the SavedModel: its signature and tag, and what it does not store.

    ``observation_space``/``action_space`` are the spaces the graph sees (default: inferred for a
    TF1 policy graph; ``action_space`` is required for a Keras base model, whose action head is not
    stored); ``state_pairs`` pairs recurrent state inputs with outputs by raw tensor name;
    ``dist_inputs`` names a Keras base model's output that holds the action distribution's inputs.
    """

    signature_key: str = "serving_default"
    tag: str = "serve"
    state_pairs: list[tuple[str, str]] | None = None
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None
    dist_inputs: str | None = None

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple["SourceOptions", dict[str, Any]]:
        """The source options among keyword ``options``, and the rest (for the export)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in names}), {k: v for k, v in options.items()
                                                                           if k not in names}


def convert_saved_model(path: str | Path, out: str | Path, *, device: str = "auto", **options: Any):
    """Convert the SavedModel at ``path`` into a full export at ``out``.

    ``options``: the :class:`SourceOptions` (``signature_key``, ``tag``, ``state_pairs``,
    ``observation_space``, ``action_space``, ``dist_inputs``); the rest go to
    :func:`exporter.export_policy` (``opset``, ``samples``, ``overwrite``, ``progress``..., or
    ``options``, an :class:`~exporter.options.ExportOptions`). Loading
    the SavedModel is a progress stage of its own.

    Returns:
        The :class:`exporter.ExportResult`; its manifest's ``source`` records the conversion.
    Raises:
        ExportError, InputError: the model cannot be read or converted (see
            :func:`exporter.sources.legacy.load_saved_model_policy` and
            :func:`exporter.sources.keras.load_keras_policy`); ParityFailedError when a format
            does not match the source session (nothing is written then).
    """
    from policy_export.exporter.sources.keras import is_keras_base_model
    from policy_export.exporter.trust import read_saved_model

    source, opts = _split(options, device)
    with run_limit(opts.run_timeout):  # loading runs the file's graph too
        proto = read_saved_model(path) if (Path(path) / "saved_model.pb").is_file() else None  # read once
        if is_keras_base_model(path, source.signature_key, source.tag, proto=proto):
            return _convert_keras(path, out, source, proto, opts)
        if source.dist_inputs is not None:
            raise InputError("--dist-inputs applies to Keras base models only; this SavedModel has 'actions' outputs")
        return _convert_legacy(path, out, source, proto, opts)


def convert_keras_model(path: str | Path, out: str | Path, *, device: str = "auto", proto: Any = None,
                        **options: Any):
    """Convert the Keras base-model SavedModel at ``path`` (``action_space`` required) into a full
    export at ``out``; ``proto`` is the SavedModel already read, ``options`` as for
    :func:`convert_saved_model`. The Keras formats are left out (the model is served through the
    policy graph)."""
    source, opts = _split(options, device)
    with run_limit(opts.run_timeout):
        return _convert_keras(path, out, source, proto, opts)


def _split(options: dict[str, Any], device: str) -> tuple[SourceOptions, ExportOptions]:
    """The source options, and the export options (``options=``, or made from the other keywords)
    with ``device``."""
    source, rest = SourceOptions.split(options)
    made = ExportOptions.make(rest.pop("options", None), rest)
    return source, replace(made, device=device)


def _convert_legacy(path, out, source: SourceOptions, proto, opts: ExportOptions):
    from policy_export.exporter.sources.legacy import load_saved_model_policy

    check_target(Path(out).absolute(), opts.overwrite)
    with (opts.progress or SILENT).stage("load SavedModel"):
        policy, record = load_saved_model_policy(path, source.signature_key, source.tag, opts.device, source.state_pairs,
                                                 source.observation_space, source.action_space, proto=proto)
    if EXPLORE in record and "refused" in record[EXPLORE]:
        log.warning("explore refused: %s", record[EXPLORE]["refused"])
    elif EXPLORE in record:
        log.info("the hidden exploration switch %s (default %s) is the 'explore' input, default false",
                 record[EXPLORE]["from"], record[EXPLORE]["original_default"])
    described = {"converted_from": str(Path(path).absolute()), "signature": source.signature_key, "tag": source.tag,
                 **record}
    return _export(policy, out, replace(opts, source=described))


def _convert_keras(path, out, source: SourceOptions, proto, opts: ExportOptions):
    from policy_export.exporter.sources.keras import load_keras_policy
    from policy_export.policy.spaces import space_to_json

    if source.action_space is None:
        raise InputError(f"{path} is a Keras base model (its signature has no 'actions' output): the action head "
                         f"is not stored in it, so --action-space is required, e.g. "
                         f"'{{\"type\": \"Discrete\", \"n\": 2}}'")
    check_target(Path(out).absolute(), opts.overwrite)
    with (opts.progress or SILENT).stage("load SavedModel"):
        policy, mapping = load_keras_policy(path, source.action_space, observation_space=source.observation_space,
                                            dist_inputs=source.dist_inputs, signature_key=source.signature_key,
                                            tag=source.tag, device=opts.device, proto=proto)
    described = {"converted_from": str(Path(path).absolute()), "kind": "keras_base_model",
                 "signature": source.signature_key, "tag": source.tag, "key_mapping": mapping,
                 "action_space": space_to_json(source.action_space)}
    return _export(policy, out, replace(opts, source=described))


def _export(policy, out, opts: ExportOptions):
    try:
        return export_policy(policy, out, opts)
    finally:
        policy.close()
