"""What ``export-many`` and ``verify-many`` run: one :class:`Job` per policy, made from the sources
on the command line or a league file, without TensorFlow (the driver never imports it).

A source is what ``export``/``convert`` take: a spec directory (``policy.json``), a SavedModel
directory, an RLlib checkpoint (every policy id of a multi-agent one, each its own job), or a
league file (``.json``) listing them::

    {"policies": [
        {"name": "alpha", "source": "checkpoints/league", "policy_id": "alpha", "options": {"samples": 500}},
        {"source": "specs/cartpole"}
    ]}

(paths relative to the league file; ``name`` defaults to the source's directory name, with the
policy id appended for a checkpoint holding several policies). Each job carries a digest of its
source's files and options: an export whose recorded digest is the job's, and whose files still
match its manifest, is current and is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter.options import MODEL_NAME, serving_name

STATE_DIR = ".policy-export-many"  # inside ROOT: one record per policy exported
LEAGUE_LIMIT = 1 << 20  # bytes of a league file
HASH_LIMIT = 64 << 30  # bytes of one source's files hashed for the digest
# options a league entry may set (the single commands' keywords)
EXPORT_OPTIONS = {"formats": list, "samples": int, "explore_samples": int, "seed": int, "opset": int,
                  "batch_size": int, "stepped_steps": int, "model_name": str, "model_version": int,
                  "inputs_as_nchw": bool, "use_filter": bool, "actions": str}


@dataclass(frozen=True)
class Job:
    """One policy to export (or verify): plain values, so that it travels to any worker."""

    name: str
    kind: str  # "spec", "saved_model", "checkpoint" (exports) or "verify"
    source: str
    out: str
    root: str
    policy_id: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    digest: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "Job":
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})


def source_kind(path: Path) -> str:
    """``spec``, ``saved_model`` or ``checkpoint`` for a source (:func:`exporter.sources.detect.detect`).

    Raises:
        InputError: ``path`` is none of those.
    """
    from policy_export.exporter.sources.detect import detect

    return detect(path).kind


def _options(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputError(f"{where}: options must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(EXPORT_OPTIONS))
    if unknown:
        raise InputError(f"{where}: unknown option(s) {unknown}; a league entry may set {sorted(EXPORT_OPTIONS)}")
    for key, value in raw.items():
        want = EXPORT_OPTIONS[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise InputError(f"{where}: option {key!r} must be {want.__name__}, got {value!r}")
    return dict(raw)


def read_league(path: Path) -> list[dict[str, Any]]:
    """The entries of a league file: ``{"source": Path, "name", "policy_id", "options"}`` each.

    Raises:
        InputError: not a readable league file (the problem named).
    """
    from policy_export.policy import jsonio
    from policy_export.policy.files import read_regular

    raw = read_regular(path, LEAGUE_LIMIT, InputError)
    doc = jsonio.loads(raw.decode("utf-8", errors="replace"), str(path))
    entries = doc.get("policies") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputError(f"league file {path}: expected {{\"policies\": [...]}} with at least one entry")
    out = []
    for i, entry in enumerate(entries):
        where = f"league file {path}: policies[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("source"), str):
            raise InputError(f"{where}: expected an object with a \"source\" path")
        extra = sorted(set(entry) - {"name", "source", "policy_id", "options"})
        if extra:
            raise InputError(f"{where}: unknown key(s) {extra}")
        for key in ("name", "policy_id"):
            if key in entry and not isinstance(entry[key], str):
                raise InputError(f"{where}: {key!r} must be a string")
        out.append({"source": (path.parent / entry["source"]), "name": entry.get("name"),
                    "policy_id": entry.get("policy_id"), "options": _options(entry.get("options"), where)})
    return out


def _checkpoint_jobs(entry: Mapping[str, Any], path: Path) -> list[tuple[str, str | None]]:
    """``(name, policy_id)`` for each policy of a checkpoint entry (read safely: nothing is run)."""
    from policy_export.exporter.sources.checkpoint import read_checkpoint

    ids = list(read_checkpoint(path).policies)
    if entry.get("policy_id") is not None:
        if entry["policy_id"] not in ids:
            raise InputError(f"checkpoint {path} has no policy {entry['policy_id']!r}; it has {ids}")
        ids = [entry["policy_id"]]
    # RLlib's own directory names say nothing of the run: name it after the directory holding them
    stem = path.parent.name if re.fullmatch(r"checkpoint(_\d+)?", path.name) else path.name
    base = entry.get("name") or serving_name(stem)
    if len(ids) == 1:
        return [(base, ids[0])]
    return [(f"{base}-{serving_name(pid)}", pid) for pid in ids]


def expand(sources: Sequence[str | Path], root: Path, options: Mapping[str, Any]) -> list[Job]:
    """The jobs of ``sources`` (directories or league files), each exported to ``root/<name>``.

    Raises:
        InputError: a source that is none of the kinds, a bad league file, or two jobs with one name.
    """
    entries: list[dict[str, Any]] = []
    for src in sources:
        path = Path(src)
        if path.is_file() and path.suffix == ".json" and path.name != "policy.json":
            entries += read_league(path)
        else:
            entries.append({"source": path, "name": None, "policy_id": None, "options": {}})
    jobs = []
    for entry in entries:
        path = Path(entry["source"]).absolute()
        kind = source_kind(path)
        if kind == "spec" and path.name == "policy.json":
            path = path.parent
        merged = {**options, **entry["options"]}
        named = _checkpoint_jobs(entry, path) if kind == "checkpoint" else [
            (entry.get("name") or serving_name(path.name), None)]
        for name, pid in named:
            if not MODEL_NAME.fullmatch(name):  # the name of a directory, as of a served model
                raise InputError(f"policy name {name!r}: use letters, digits, '_', '.' or '-' (it names ROOT/<name>)")
            jobs.append(Job(name, kind, str(path), str(root / name), str(root), pid, merged))
    _check_unique(jobs)
    return [with_digest(j) for j in jobs]


def _check_unique(jobs: Sequence[Job]) -> None:
    seen: dict[str, str] = {}
    for job in jobs:
        if job.name in seen:
            raise InputError(f"two policies would be exported to {job.name!r} ({seen[job.name]} and {job.source}); "
                             "name them in a league file")
        seen[job.name] = job.source


def verify_jobs(root: Path, options: Mapping[str, Any]) -> list[Job]:
    """One verify job per export directly under ``root`` (a directory holding ``manifest.json``).

    Raises:
        InputError: ``root`` is not a directory, or holds no export.
    """
    if not root.is_dir():
        raise InputError(f"{root}: no such directory")
    outs = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and (p / "manifest.json").is_file())
    if not outs:
        raise InputError(f"{root} holds no export (no <name>/manifest.json)")
    return [Job(p.name, "verify", str(p), str(p), str(root), None, dict(options)) for p in outs]


def _file_digests(path: Path) -> list[tuple[str, int, str]]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    total, out = 0, []
    for f in files:
        size = f.stat().st_size
        total += size
        if total > HASH_LIMIT:
            raise InputError(f"source {path}: over {HASH_LIMIT >> 30} GiB of files to hash")
        h = hashlib.sha256()
        with open(f, "rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                h.update(chunk)
        out.append((f.relative_to(path).as_posix() if path.is_dir() else f.name, size, h.hexdigest()))
    return out


def with_digest(job: Job) -> Job:
    """``job`` with the digest of its source's files, its kind, policy id, options and this package's version."""
    from policy_export import __version__

    payload = {"files": _file_digests(Path(job.source)), "kind": job.kind, "policy_id": job.policy_id,
               "options": job.options, "version": __version__}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return Job(**{**job.to_json(), "digest": digest})


def state_path(job: Job) -> Path:
    return Path(job.root) / STATE_DIR / f"{job.name}.json"


def record_done(job: Job, result: Mapping[str, Any]) -> None:
    """Record that ``job``'s export is whole and passed (written atomically, after the export)."""
    path = state_path(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"digest": job.digest, "source": job.source, "policy_id": job.policy_id,
                               "seconds": result.get("seconds")}, indent=2) + "\n")
    os.replace(tmp, path)


def is_current(job: Job) -> bool:
    """Whether ``job``'s export exists, was made from the same digest, and its files still match
    its manifest (hashes only; nothing is loaded)."""
    from policy_export.exporter import manifest

    try:
        recorded = json.loads(state_path(job).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict) or recorded.get("digest") != job.digest:
        return False
    out = Path(job.out)
    try:
        doc = manifest.read_manifest(out)
        from policy_export.exporter import formats

        return not manifest.check_files(out, doc, formats.paths()).problems
    except Exception:  # noqa: BLE001 - any unreadable export is simply not current
        return False
