"""One live target's check inside ``verify``: the plan replayed on it, a server's refusal recorded
as that target's failure rather than stopping the run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_export.exporter.formats.base import Format


def run_target(target: Format, out: Path, doc: Mapping[str, Any], replay, report, device: Any) -> None:
    """Replay the plan on ``target``; an error a server or its client raises (a request the
    server refused, a timeout) fails that target's check with the message instead of stopping verify."""
    from policy_export.errors import PolicyExportError

    try:
        with replay.stage(target.name, target):
            target.check(target.name, out, doc, device, replay, report)
    except (PolicyExportError, OSError) as e:
        report.errors[target.name] = f"{type(e).__name__}: {str(e)[:500]}"
    except Exception as e:  # tritonclient's InferenceServerException and the like
        if type(e).__module__.split(".")[0] not in ("tritonclient", "grpc", "geventhttpclient"):
            raise
        report.errors[target.name] = f"the server answered: {str(e)[:500]}"
