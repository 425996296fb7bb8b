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
from policy_export.exporter.export import run_export
from policy_export.exporter.options import ExportOptions, checkpoint_target, replace
from policy_export.exporter.progress import SILENT
from policy_export.exporter.watchdog import run_limit
from policy_export.signatures.keys import EXPLORE

log = logging.getLogger(__name__)
VISION_ATOL = 1e-4  # the default parity tolerance of a checkpoint policy with RLlib's vision net


@dataclass(frozen=True)
class SourceOptions:
    """How to read the SavedModel: its signature and tag, and what it does not store.

    ``observation_space``/``action_space`` are the spaces the graph sees (default: inferred for a
    TF1 policy graph; ``action_space`` is required for a Keras base model, whose action head is not
    stored); ``state_pairs`` pairs recurrent state inputs with outputs by raw tensor name;
    ``dist_inputs`` names a Keras base model's output that holds the action distribution's inputs;
    ``weights`` is a TF1 ``Saver`` checkpoint (RLlib <= 2.0's ``export_checkpoint``) whose values
    replace a TF1 policy graph's, by variable name.
    """

    signature_key: str = "serving_default"
    tag: str = "serve"
    state_pairs: list[tuple[str, str]] | None = None
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None
    dist_inputs: str | None = None
    weights: str | Path | None = None

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
    source, opts = _split(options, device, out)
    return run_convert_saved_model(path, out, source, opts)


def run_convert_saved_model(path: str | Path, out: str | Path, source: SourceOptions, opts: ExportOptions):
    """:func:`convert_saved_model` once ``opts`` passed :meth:`ExportOptions.check_export` for
    ``source.observation_space`` and ``out`` (the command line checks before TensorFlow loads)."""
    from policy_export.exporter.sources.keras import is_keras_base_model
    from policy_export.exporter.trust import read_saved_model

    with run_limit(opts.run_timeout):  # loading runs the file's graph too
        proto = read_saved_model(path) if (Path(path) / "saved_model.pb").is_file() else None  # read once
        if is_keras_base_model(path, source.signature_key, source.tag, proto=proto):
            if source.weights is not None:
                raise InputError("--weights applies to TF1 policy SavedModels (RLlib <= 2.0's export_model); this "
                                 "is a Keras base model")
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
    source, opts = _split(options, device, out)
    with run_limit(opts.run_timeout):
        return _convert_keras(path, out, source, proto, opts)


def _split(options: dict[str, Any], device: str, out: str | Path) -> tuple[SourceOptions, ExportOptions]:
    """The source options, and the export options (``options=``, or made from the other keywords)
    with ``device``, checked for ``out`` (:meth:`ExportOptions.check_export`: the sample budgets
    too where ``observation_space`` is given, else once the policy is loaded)."""
    source, rest = SourceOptions.split(options)
    opts = _options(rest, device)
    opts.check_export(source.observation_space, out)
    return source, opts


def _options(keywords: dict[str, Any], device: str) -> ExportOptions:
    """The export options: ``options=`` (an :class:`ExportOptions`) or made from ``keywords``, with ``device``."""
    return replace(ExportOptions.make(keywords.pop("options", None), keywords), device=device)


def _convert_legacy(path, out, source: SourceOptions, proto, opts: ExportOptions):
    from policy_export.exporter.sources.legacy import SavedModelFiles, load_saved_model_policy

    with (opts.progress or SILENT).stage("load SavedModel"):
        policy, record = load_saved_model_policy(path, source.signature_key, source.tag, opts.device, source.state_pairs,
                                                 source.observation_space, source.action_space,
                                                 files=SavedModelFiles(proto=proto, weights=source.weights))
    if EXPLORE in record and "refused" in record[EXPLORE]:
        log.warning("explore refused: %s", record[EXPLORE]["refused"])
    elif EXPLORE in record:
        log.info("the hidden exploration switch %s (default %s) is the 'explore' input, default false",
                 record[EXPLORE]["from"], record[EXPLORE]["original_default"])
    described = {"converted_from": str(Path(path).absolute()), "signature": source.signature_key, "tag": source.tag,
                 **record}
    return _export(policy, out, replace(opts, source=described), source)


def _convert_keras(path, out, source: SourceOptions, proto, opts: ExportOptions):
    from policy_export.exporter.sources.keras import load_keras_policy
    from policy_export.policy.spaces import space_to_json

    if source.action_space is None:
        raise InputError(f"{path} is a Keras base model (its signature has no 'actions' output): the action head "
                         f"is not stored in it, so --action-space is required, e.g. "
                         f"'{{\"type\": \"Discrete\", \"n\": 2}}'")
    with (opts.progress or SILENT).stage("load SavedModel"):
        policy, mapping = load_keras_policy(path, source.action_space, observation_space=source.observation_space,
                                            dist_inputs=source.dist_inputs, signature_key=source.signature_key,
                                            tag=source.tag, device=opts.device, proto=proto)
    described = {"converted_from": str(Path(path).absolute()), "kind": "keras_base_model",
                 "signature": source.signature_key, "tag": source.tag, "key_mapping": mapping,
                 "action_space": space_to_json(source.action_space)}
    return _export(policy, out, replace(opts, source=described), source)


def _export(policy, out, opts: ExportOptions, source: SourceOptions | None = None):
    """Export the loaded ``policy`` (closed after) with ``opts`` checked for it and ``out``; the
    sample budgets of a SavedModel converted without ``source.observation_space`` are checked here."""
    try:
        if source is not None and source.observation_space is None:
            opts.check_policy(policy.observation_space)
        return run_export(policy, out, opts)
    finally:
        policy.close()


# ------------------------------------------------------------------------ RLlib checkpoints

def convert_checkpoint(checkpoint: Any, out: str | Path, *, policy_id: str | None = None, use_filter: bool = True,
                       actions: str = "environment", device: str = "auto", **options: Any):
    """Convert one policy of an RLlib checkpoint (ray 2.1-2.9, old API stack) into a full export at ``out``.

    ``checkpoint``: the checkpoint directory (or a :class:`~exporter.sources.checkpoint.Checkpoint`
    already read). Neither ray nor any pickled code is run: see :mod:`exporter.sources.checkpoint`.
    ``policy_id``: which policy (default: the only one). ``use_filter`` false leaves RLlib's
    observation filter out of the graph; ``actions`` is ``"environment"`` (unsquashed/clipped as
    ``compute_single_action`` does) or ``"policy"`` (as ``policy.compute_actions`` returns them).
    ``options`` go to :func:`exporter.export_policy`.

    Example::

        convert_checkpoint("checkpoints/ppo_000100", "out/ppo", policy_id="default_policy")

    Returns:
        The :class:`exporter.ExportResult`; its manifest's ``source`` records the checkpoint, the
        rebuilt network and the weights it used, and its contract the filter and the actions.
    Raises:
        UnsafeCheckpointError: the checkpoint is refused (see :func:`read_checkpoint`).
        ExportError: no such policy id, or a policy the package does not rebuild.
        WeightsError: weights that do not fit the config. ParityFailedError: a format differs.
    """
    checkpoint = _read(checkpoint)
    policy = checkpoint.policy(policy_id)
    opts = _options(options, device)
    opts.check_checkpoint([policy], out)
    results = run_convert_checkpoint(checkpoint, [policy], out, opts, use_filter=use_filter, actions=actions)
    return results[policy.policy_id]


def convert_checkpoint_policies(checkpoint: Any, out: str | Path, *, use_filter: bool = True,
                                actions: str = "environment", device: str = "auto", **options: Any) -> dict[str, Any]:
    """Every policy of an RLlib checkpoint, one export each at ``out/<policy id>/``, each with its own parity.

    Arguments as for :func:`convert_checkpoint`. Every target is checked before the first export;
    when one policy fails, the exports this call wrote are removed again and the error is raised.

    Returns:
        policy id -> :class:`exporter.ExportResult`, in the checkpoint's order.
    """
    checkpoint = _read(checkpoint)
    policies = list(checkpoint.policies.values())
    opts = _options(options, device)
    opts.check_checkpoint(policies, out, each=True)
    return run_convert_checkpoint(checkpoint, policies, out, opts, each=True, use_filter=use_filter, actions=actions)


def run_convert_checkpoint(checkpoint, policies, out: str | Path, opts: ExportOptions, *, each: bool = False,
                           use_filter: bool = True, actions: str = "environment") -> dict[str, Any]:
    """Convert ``policies`` of ``checkpoint`` (read) to ``out``, each to ``out/<policy id>`` when
    ``each``, once ``opts`` passed :meth:`ExportOptions.check_checkpoint` for them (the command
    line checks before TensorFlow loads); when one fails, the exports this call wrote are removed
    again (and ``out`` when it made it for them) and the error is raised.

    Returns:
        policy id -> :class:`exporter.ExportResult`, in the order of ``policies``.
    """
    import shutil

    targets = {policy.policy_id: checkpoint_target(out, policy.policy_id, each) for policy in policies}
    root = Path(out).absolute()
    created = each and not root.exists()
    done: dict[str, Any] = {}
    try:
        with run_limit(opts.run_timeout):
            for policy in policies:
                done[policy.policy_id] = _convert_checkpoint_policy(checkpoint, policy, targets[policy.policy_id],
                                                                    use_filter, actions, opts)
    except BaseException:
        for pid in done:
            shutil.rmtree(targets[pid], ignore_errors=True)
        if created and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        raise
    return done


def _read(checkpoint: Any):
    from policy_export.exporter.sources.checkpoint import Checkpoint, read_checkpoint

    return checkpoint if isinstance(checkpoint, Checkpoint) else read_checkpoint(checkpoint)


def _convert_checkpoint_policy(checkpoint, policy, out, use_filter: bool, actions: str, opts: ExportOptions):
    from policy_export.exporter.devices import plan_devices
    from policy_export.exporter.sources.checkpoint_policy import load_checkpoint_policy

    if policy.filter is None and policy.filter_note:
        log.warning("policy %r: %s", policy.policy_id, policy.filter_note)
    with (opts.progress or SILENT).stage(f"rebuild policy {policy.policy_id}"):
        tf_policy, record = load_checkpoint_policy(policy, use_filter=use_filter, actions=actions,
                                                   device=plan_devices(opts.device).tf_device)
    if opts.tolerances is None and record["base_network"] == "vision":
        # RLlib's vision nets take raw pixel values (0-255, unscaled): sums of that size differ
        # between runtimes' convolution algorithms by more than 1e-5 in absolute terms
        from policy_export.exporter.parity.compare import Tolerance, Tolerances

        opts = replace(opts, tolerances=Tolerances(Tolerance(atol=VISION_ATOL, rtol=1e-5)))
    described = {"converted_from": str(Path(checkpoint.path).absolute()), "kind": "rllib_checkpoint",
                 "checkpoint_type": checkpoint.type, "checkpoint_format": checkpoint.format,
                 "checkpoint_version": checkpoint.version, "ray_version": checkpoint.ray_version, **record,
                 "contract": {"observation_filter": record["observation_filter"], "actions": actions}}
    return _export(tf_policy, out, replace(opts, source=described))
