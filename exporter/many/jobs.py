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

The driver reads names, never a policy's state: what each source's ``policy_ids`` reads (of a
checkpoint only ``rllib_checkpoint.json``, strict JSON, at most 1 MiB, not through a link, and the
entries of its ``policies/`` directory); no state pickle or msgpack file is opened here. Everything else is read by the policy's own process, under its memory and time caps.
The digest hashes the source's files as bytes (:func:`file_digests`), parsing nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter import sources as registry
from policy_export.exporter.options import MODEL_NAME, serving_name
from policy_export.exporter.pipeline import refuse_foreign

STATE_DIR = ".policy-export-many"  # inside ROOT: one record per policy exported
LEAGUE_LIMIT = 1 << 20  # bytes of a league file
HASH_LIMIT = 64 << 30  # bytes of one source's files hashed for the digest
HASH_FILES = 100_000  # files of one source hashed for the digest
POLICY_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.\-]{1,128}")  # a policy id as a plain directory name
RECORD_LIMIT = 64 << 10  # bytes of a record in STATE_DIR
# a league entry may set the core's options declared for it (exporter.core_options, league=True)
# and every option a source or a format declares (league_options), but the policy selection, which
# is the league's own (``policy_id`` of an entry, one job per policy)
SELECTION = ("policy_id", "all_policies")


def _declared() -> list:
    """Every option a source or a format declares (the registries': no source or format module is named)."""
    from policy_export.exporter import formats

    return [o for s in registry.all_sources() for o in s.options] + [o for f in formats.all_formats() for o in f.options]


def league_options() -> dict[str, type | tuple[type, ...]]:
    """Option name -> the JSON type a league entry gives it: the export's own, and every option a
    source or a format declares (made from their declarations)."""
    from policy_export.exporter import core_options

    return {**core_options.league(), **{o.name: o.python_type for o in _declared() if o.name not in SELECTION}}


def _source_option_names() -> set[str]:
    return {o.name for s in registry.all_sources() for o in s.options}


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
    refused: str = ""  # why the driver refused the source: the job fails without running

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "Job":
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})


def _options(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InputError(f"{where}: options must be an object, got {type(raw).__name__}")
    allowed = league_options()
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise InputError(f"{where}: unknown option(s) {unknown}; a league entry may set {sorted(allowed)}")
    for key, value in raw.items():
        want = allowed[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            named = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
            raise InputError(f"{where}: option {key!r} must be {named}, got {value!r:.80}")
    return dict(raw)


def path_options() -> set[str]:
    """The options whose values name files (declared ``path``): the core's, every source's and format's."""
    from policy_export.exporter import core_options

    return {o.name for o in (*core_options.EXPORT, *_declared()) if o.path}


def _rebased(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``options`` with every file they name (an option declared ``path``) taken relative to ``folder``."""
    out = dict(options)
    for name in path_options() & set(out):
        value = out[name]
        if isinstance(value, str):
            out[name] = str(folder / value)
        elif isinstance(value, list):
            out[name] = [str(folder / v) if isinstance(v, str) else v for v in value]
    return out


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
        options = _rebased(_options(entry.get("options"), where), path.parent)
        out.append({"source": (path.parent / entry["source"]), "name": entry.get("name"),
                    "policy_id": entry.get("policy_id"), "options": options})
    return out


def _source_jobs(entry: Mapping[str, Any], path: Path, source) -> list[tuple[str, str | None, str]]:
    """``(name, policy_id, refused)`` for each policy of a source entry, from names alone (the
    source's :meth:`~exporter.sources.base.Source.policy_ids`: of a checkpoint its JSON and the
    listing of ``policies/``, never a state file): one job per policy id; one job for the whole
    source where only its state names them (its process reads them) or where the driver refused
    its listing (that job fails, with the reason, without running).

    Raises:
        InputError: the entry names a policy id the source does not list, or one that is not a plain name.
    """
    from policy_export.errors import PolicyExportError

    base = entry.get("name") or serving_name(source.job_stem(path))
    wanted = entry.get("policy_id")
    if wanted is not None and not POLICY_NAME.fullmatch(wanted):
        raise InputError(f"policy id {wanted[:80]!r} of {path} is not a plain name (letters, digits, '_', '.', '-')")
    if wanted is not None and "policy_id" not in {o.name for o in source.options}:
        raise InputError(f"policy id {wanted!r} of {path}: {source.description} holds one policy")
    try:
        ids = source.policy_ids(path)
    except (PolicyExportError, OSError) as e:
        why = e if isinstance(e, PolicyExportError) else f"{path}: cannot be listed: {e.strerror or e}"
        return [(base, wanted, f"{type(e).__name__}: {str(why)[:400]}")]
    if ids is None:
        return [(base, wanted, "")]
    if wanted is not None:
        if wanted not in ids:
            shown = ", ".join(ids[:20]) + (f" (+{len(ids) - 20} more)" if len(ids) > 20 else "")
            raise InputError(f"checkpoint {path} has no policy {wanted!r}; it has {shown}")
        ids = [wanted]
    if len(ids) == 1:
        return [(base, ids[0], "")]
    return [(f"{base}-{serving_name(pid)}", pid, "") for pid in ids]


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
        source = registry.detect(path)
        if path.is_file():  # a spec's policy.json: its directory
            path = path.parent
        merged = {**options, **entry["options"]}
        refuse_foreign({k: v for k, v in merged.items() if k in _source_option_names()}, source)
        for name, pid, refused in _source_jobs(entry, path, source):
            if not MODEL_NAME.fullmatch(name):  # the name of a directory, as of a served model
                raise InputError(f"policy name {name[:80]!r}: use letters, digits, '_', '.' or '-' "
                                 "(it names ROOT/<name>)")
            jobs.append(Job(name, source.name, str(path), str(root / name), str(root), pid, merged, refused=refused))
    _check_unique(jobs)
    return [j if j.refused else with_digest(j) for j in jobs]


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
    if not root.exists():
        raise InputError(f"verify-many's ROOT {root}: no such directory")
    if not root.is_dir():
        raise InputError(f"verify-many's ROOT {root}: exists and is not a directory")
    outs = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and (p / "manifest.json").is_file())
    if not outs:
        raise InputError(f"{root} holds no export (no <name>/manifest.json)")
    return [Job(p.name, "verify", str(p), str(p), str(root), None, dict(options)) for p in outs]


class _Unhashable(Exception):
    """A source whose files cannot all be hashed: its jobs get no digest and are never skipped."""


def _source_files(path: Path) -> list[tuple[str, str]]:
    """``(relative name, path)`` of the regular files under ``path`` (itself if a file), sorted;
    no symbolic link is followed and nothing but regular files is listed.

    Raises:
        _Unhashable: more than :data:`HASH_FILES` files. OSError: a directory cannot be listed.
    """
    if not path.is_dir():
        return [(path.name, str(path))]
    found: list[tuple[str, str]] = []
    stack = [("", str(path))]
    while stack:
        prefix, directory = stack.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = f"{prefix}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    stack.append((rel + "/", entry.path))
                elif entry.is_file(follow_symlinks=False):
                    found.append((rel, entry.path))
                    if len(found) > HASH_FILES:
                        raise _Unhashable(f"more than {HASH_FILES} files")
    return sorted(found)


def _hash_file(file: str, budget: int) -> tuple[int, str]:
    """``(size, sha256)`` of a regular file, opened without following a link, read as bytes only.

    Raises:
        _Unhashable: not a regular file, or over ``budget`` bytes. OSError: it cannot be read.
    """
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as stream:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Unhashable(f"{file} is not a regular file")
        h, size = hashlib.sha256(), 0
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            size += len(chunk)
            if size > budget:
                raise _Unhashable(f"over {HASH_LIMIT >> 30} GiB of files")
            h.update(chunk)
    return size, h.hexdigest()


def file_digests(path: Path) -> list[tuple[str, int, str]] | None:
    """``(name, size, sha256)`` of each regular file of a source (:func:`_source_files`), hashing
    bytes and parsing nothing; ``None`` where they cannot all be hashed (too many files or bytes,
    a file that cannot be read): such a source is never current, and its own process says what is wrong."""
    try:
        out, total = [], 0
        for rel, file in _source_files(path):
            size, digest = _hash_file(file, HASH_LIMIT - total)
            total += size
            out.append((rel, size, digest))
        return out
    except (_Unhashable, OSError):
        return None


def with_digest(job: Job) -> Job:
    """``job`` with the digest of its source's files, its kind, policy id, options and this
    package's version; an empty digest (never current) where its files cannot be hashed."""
    from policy_export import __version__

    files = file_digests(Path(job.source))
    if files is None:
        return job
    payload = {"files": files, "kind": job.kind, "policy_id": job.policy_id, "options": job.options,
               "version": __version__}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return Job(**{**job.to_json(), "digest": digest})


def state_path(job: Job) -> Path:
    return Path(job.root) / STATE_DIR / f"{job.name}.json"


def record_done(job: Job, result: Mapping[str, Any]) -> None:
    """Record that ``job``'s export is whole and passed (written atomically, after the export); a
    job without a digest is not recorded (it is never current)."""
    if not job.digest:
        return
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
    from policy_export.policy.files import read_regular

    if not job.digest or job.refused:
        return False
    try:
        recorded = json.loads(read_regular(state_path(job), RECORD_LIMIT, ValueError))
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
