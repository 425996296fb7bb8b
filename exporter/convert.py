"""The Python API of the sources: a spec, a SavedModel someone else wrote, an RLlib checkpoint,
each into a full export, through the one pipeline (:mod:`exporter.pipeline`).

Each function here is :func:`exporter.pipeline.export_source` with its source fixed, kept for the
API's users: ``export_spec`` (a spec directory or a :class:`policy.PolicySpec`),
``convert_saved_model``, ``convert_keras_model``, ``convert_checkpoint`` and
``convert_checkpoint_policies``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy_export.exporter import sources
from policy_export.exporter.options import ExportOptions
from policy_export.exporter.pipeline import export_options, plan_source, run_source, split_options

if TYPE_CHECKING:
    from policy_export.exporter.export import ExportResult


def _one(results: dict[str | None, ExportResult]) -> ExportResult:
    (result,) = results.values()
    return result


def _run(opened: sources.Opened, out: str | Path, rest: dict[str, Any], device: Any) -> dict:
    opts = export_options(rest, device)
    return run_source(opened, plan_source(opened, out, opts), opts)


def _opened(kind: str | tuple[str, ...], path: Any, own: dict[str, Any], what: str = "source") -> sources.Opened:
    """``path`` opened as the source ``kind`` (a name, or the names it may be: the registry tells
    which it is), with its own options ``own``.

    Raises:
        InputError: no such path, or not a source of ``kind`` (naming what it would have to be).
    """
    from policy_export.exporter.pipeline import refuse_foreign

    if isinstance(kind, tuple):
        source = sources.detect(path, kind, what)
    else:
        source = sources.get(kind)
    refuse_foreign(own, source)
    return source.open(path, own)


CHECKPOINTS = ("rlmodule", "checkpoint")  # RLlib's new API stack, its old one


def _checkpoint(checkpoint: Any, own: dict[str, Any]) -> sources.Opened:
    """An RLlib checkpoint of either API stack opened (a :class:`~exporter.sources.checkpoint.Checkpoint`
    already read is the old stack's)."""
    from policy_export.exporter.sources.checkpoint import Checkpoint

    if isinstance(checkpoint, Checkpoint):
        return _opened("checkpoint", checkpoint, own)
    return _opened(CHECKPOINTS, Path(checkpoint), own, "checkpoint")


def export_spec(spec, out: str | Path, options: ExportOptions | None = None, **keywords: Any) -> ExportResult:
    """Build the policy of a spec (a :class:`policy.PolicySpec`, or the path of its directory or
    ``policy.json``) and :func:`exporter.export_policy` it; ``options`` as for :func:`exporter.export_policy`.

    Returns:
        The :class:`exporter.ExportResult`.
    Raises:
        SpecError: the spec is not valid; the export's errors (see :func:`exporter.export_policy`).
    """
    from policy_export.policy.spec import PolicySpec

    source = sources.get("spec")
    opened = source.opened(spec, Path(".")) if isinstance(spec, PolicySpec) else source.open(Path(spec), {})
    rest = dict(keywords)
    if options is not None:
        rest["options"] = options
    device = options.device if isinstance(options, ExportOptions) else rest.pop("device", "auto")
    return _one(_run(opened, out, rest, device))


def convert_saved_model(path: str | Path, out: str | Path, *, device: str = "auto", **options: Any) -> ExportResult:
    """Convert the SavedModel at ``path`` into a full export at ``out``.

    ``options``: the SavedModel source's own (``signature_key``, ``tag``, ``state_pairs``,
    ``observation_space``, ``action_space``, ``dist_inputs``, ``weights``); the rest go to
    :func:`exporter.export_policy` (``opset``, ``samples``, ``overwrite``, ``progress``..., or
    ``options``, an :class:`~exporter.options.ExportOptions`). Loading the SavedModel is a progress
    stage of its own.

    Returns:
        The :class:`exporter.ExportResult`; its manifest's ``source`` records the conversion.
    Raises:
        ExportError, InputError: the model cannot be read or converted (see
            :func:`exporter.sources.legacy.load_saved_model_policy` and
            :func:`exporter.sources.keras.load_keras_policy`); ParityFailedError when a format
            does not match the source session (nothing is written then).
    """
    own, rest = split_options(options)
    return _one(_run(_opened("saved_model", Path(path), own), out, rest, device))


def convert_keras_model(path: str | Path, out: str | Path, *, device: str = "auto", proto: Any = None,
                        **options: Any) -> ExportResult:
    """Convert the Keras base-model SavedModel at ``path`` (``action_space`` required) into a full
    export at ``out``; ``options`` as for :func:`convert_saved_model` (``proto``, the SavedModel
    already read, is accepted and read again). The Keras formats are left out (the model is served
    through the policy graph)."""
    return convert_saved_model(path, out, device=device, **options)


def convert_checkpoint(checkpoint: Any, out: str | Path, *, policy_id: str | None = None, use_filter: bool = True,
                       actions: str = "environment", device: str = "auto", filter_agent: Any = None,
                       **options: Any) -> ExportResult:
    """Convert one policy of an RLlib checkpoint into a full export at ``out``: the old API stack's
    (ray 2.1-2.9, framework "tf") or the new one's (ray 2.40-2.60, torch RLModules), whichever
    ``checkpoint`` is.

    ``checkpoint``: the checkpoint directory (or a :class:`~exporter.sources.checkpoint.Checkpoint`
    already read by :func:`read_checkpoint`). Neither ray nor torch nor any pickled code is run:
    see :mod:`exporter.sources.checkpoint` and :mod:`exporter.sources.rlmodule`. ``policy_id``:
    which policy (the new stack: which module; default: the only one). ``use_filter`` false leaves
    RLlib's observation filter out of the graph; ``actions`` is ``"environment"`` (unsquashed/clipped
    as ``compute_single_action`` does) or ``"policy"`` (as ``policy.compute_actions`` returns them);
    ``filter_agent`` (the new stack) names the agent whose filter statistics a per-agent filter
    uses. ``options`` go to :func:`exporter.export_policy`.

    Example::

        convert_checkpoint("checkpoints/ppo_000100", "out/ppo", policy_id="default_policy")

    Returns:
        The :class:`exporter.ExportResult`; its manifest's ``source`` records the checkpoint, the
        rebuilt network and the weights it used, and its contract the filter and the actions.
    Raises:
        InputError: no such directory, or not an RLlib checkpoint of either stack; ``filter_agent``
            for an old-stack checkpoint.
        UnsafeCheckpointError: the checkpoint is refused by the safe reader (a pickle that names
            code, a file that leaves the directory...; see :func:`read_checkpoint`).
        ExportError: no such policy id, or a policy the package does not rebuild.
        WeightsError: weights that do not fit the config. ParityFailedError: a format differs.
    """
    own = {"policy_id": policy_id, "use_filter": use_filter, "actions": actions}
    opened = _checkpoint(checkpoint, {**own, **({"filter_agent": filter_agent} if filter_agent is not None else {})})
    return _one(_run(opened, out, dict(options), device))


def convert_checkpoint_policies(checkpoint: Any, out: str | Path, *, use_filter: bool = True,
                                actions: str = "environment", device: str = "auto", **options: Any) -> dict[str, Any]:
    """Every policy of an RLlib checkpoint (either API stack: the new one's modules), one export each
    at ``out/<policy id>/``, each with its own parity.

    Arguments as for :func:`convert_checkpoint`. Every target is checked before the first export;
    when one policy fails, the exports this call wrote are removed again and the error is raised.

    Returns:
        policy id -> :class:`exporter.ExportResult`, in the checkpoint's order.
    """
    own = {"all_policies": True, "use_filter": use_filter, "actions": actions}
    return _run(_checkpoint(checkpoint, own), out, dict(options), device)
