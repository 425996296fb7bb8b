"""Recorded observations (``--observations FILE``): what the policy sees in service, as parity rows.

A file is one of:

- ``.npy``: one array, the observations of a policy with one observation input (a Box, say);
- ``.npz``: arrays keyed by the contract's input names (``observations``, ``observations/<key>``
  for a Dict or Tuple space; a recurrent policy's ``state_in_<i>``, ``prev_action``,
  ``prev_reward`` where the file holds them), or a single array for a policy with one
  observation input;
- RLlib's offline JSON (``.json``, one sample batch per line, as the old API stack's JSON writer
  writes it; compressed columns are base64 + LZ4 + a pickle, read with the safe unpickler);
- RLlib's offline Parquet (``.parquet``, as the new API stack writes it).

Every file is checked before TensorFlow loads (:func:`check_paths`: a regular file, not a link,
of a known kind, its arrays' names and shapes readable from their headers, RLlib's files decoded
once), then read once the policy's spaces are known (:func:`read_recorded`): streamed in chunks,
so memory is bounded by the rows kept, not by the file, and what a file may cost to decode is
bounded by :mod:`.budget` (chunks and cells of bounded bytes, checked before they are decoded;
each pass over a file decoding at most a multiple of its bytes on disk, the files of one command
sharing a floor): a bound exceeded is a refusal (``InputError``), never gigabytes or minutes.
Every row is checked against the observation space (the dtype must cast to the space's without
changing kind, the shape must be the space's, NaN is refused, naming the key and row; rows
outside the space's bounds are counted and reported, and kept). When the files
hold more rows than ``limit``, a deterministic sub-sample (``seed``) is kept; the record says
which rows of which file, with each file's sha256. For a recurrent policy whose files give
episodes and no state, a bounded sub-sample of whole episodes is also kept (:mod:`.episodes`),
to be stepped with the state carried.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import InputError
from policy_export.exporter.recorded.columns import Column

SUFFIXES = (".npy", ".npz", ".json", ".parquet")
MAX_FILES = 64


@dataclass
class RecordedFile:
    """A file's columns (the file's own names) and what the record says of it."""

    path: Path
    kind: str
    columns: dict[str, Column]

    @property
    def rows(self) -> int:
        return next(iter(self.columns.values())).rows if self.columns else 0


@dataclass
class Recorded:
    """The kept rows of every input the contract requires, and the record of where they came from."""

    inputs: dict[str, np.ndarray]
    record: dict[str, Any] = field(default_factory=dict)
    indices: list[np.ndarray] = field(default_factory=list)  # the kept rows of each file
    episodes: Any = None  # a recurrent policy's episodes to replay stepped (episodes.Episodes), or None

    @property
    def rows(self) -> int:
        return len(next(iter(self.inputs.values()))) if self.inputs else 0


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InputError(f"--observations {path}: {suffix or 'no suffix'} is not a kind of file read here "
                         f"({', '.join(SUFFIXES)})")
    return suffix[1:]


def _regular(path: Path, directory: bool = False, flag: str = "--observations") -> os.stat_result:
    """``path``'s ``lstat``: a regular file that is not empty (or, with ``directory``, a directory);
    ``flag`` names its option in messages."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise InputError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot be read: {e.strerror}") from None
    if directory and stat.S_ISDIR(info.st_mode):
        return info
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise InputError(f"{flag} {path}: not a regular file (a symbolic link is not followed)")
    if info.st_size == 0:
        raise InputError(f"{flag} {path}: the file is empty")
    return info


def open_file(path: str | Path, policy: str | None = None, share: int = 1) -> RecordedFile:
    """``path`` opened as a recorded file (a directory: RLlib's Parquet output): its columns known,
    their rows counted, nothing kept; ``policy`` picks a multi-agent file's policy by name;
    ``share`` is the number of files read together (they share the floors of :mod:`.budget`).

    Raises:
        InputError: not a file of a known kind, or unreadable (named).
    """
    path = Path(path)
    is_dir = path.is_dir() and not path.is_symlink()
    kind = "parquet" if is_dir else _kind(path)
    _regular(path, directory=is_dir)
    if kind in ("npy", "npz"):
        from policy_export.exporter.recorded import arrays

        columns = arrays.columns(path, kind, share)
    elif kind == "json":
        from policy_export.exporter.recorded import rllib_json

        columns = rllib_json.columns(path, policy, share)
    else:
        from policy_export.exporter.recorded import parquet

        columns = parquet.columns(path, share)
    if not columns:
        raise InputError(f"--observations {path}: holds no arrays")
    rows = {c.rows for c in columns.values()}
    if len(rows) != 1:
        raise InputError(f"--observations {path}: its arrays have different row counts "
                         f"({', '.join(f'{k}: {c.rows}' for k, c in columns.items())})")
    if rows == {0}:
        raise InputError(f"--observations {path}: holds no rows")
    return RecordedFile(path, kind, columns)


def check_paths(paths: Sequence[str | Path] | None) -> list[Path] | None:
    """The ``--observations`` files checked before TensorFlow loads (each opened, its headers read).

    Raises:
        InputError: a file that is missing, not regular, of an unknown kind, or unreadable.
    """
    if paths is None:
        return None
    if isinstance(paths, (str, Path)) or not isinstance(paths, Sequence) or not paths:
        raise InputError("observations (--observations) must be a list of files")
    if len(paths) > MAX_FILES:
        raise InputError(f"observations (--observations): {len(paths)} files, more than {MAX_FILES}")
    for p in paths:
        path = Path(p)
        if path.is_dir() and not path.is_symlink():
            continue  # RLlib's Parquet output: read once the policy is known
        try:
            open_file(path, share=len(paths))
        except InputError as e:
            from policy_export.exporter.recorded.rllib_json import PolicyNotNamed

            if not isinstance(e, PolicyNotNamed):  # a multi-agent file: read once the policy's name is known
                raise
    return [Path(p) for p in paths]


def check_fit(paths: Sequence[str | Path] | None, observation_space) -> None:
    """Before TensorFlow loads: the observations each file holds have the shape the policy's
    ``observation_space`` takes, read from the files' headers (the array a file gives for each
    observation input: the one named as the input, RLlib's ``obs``, or a file's single array);
    what this cannot decide (a multi-agent file, a name it does not know) is left to
    :func:`read_recorded`.

    Raises:
        InputError: a file whose rows have another shape, naming it, the space (``Box(4,)``) and
            the shapes.
    """
    if not paths or observation_space is None:
        return
    from policy_export.exporter.recorded.checks import observation_leaves
    from policy_export.exporter.recorded.rllib_json import PolicyNotNamed
    from policy_export.policy.spaces import leaf_shape, space_text

    leaves = observation_leaves(observation_space)
    for p in paths:
        try:
            file = open_file(Path(p), share=len(paths))
        except PolicyNotNamed:
            continue
        names = [n for n, c in file.columns.items() if not c.optional]
        for key, space in leaves.items():
            column = key if key in file.columns else None
            if column is None and len(leaves) == 1:
                column = "obs" if "obs" in file.columns else (names[0] if len(names) == 1 else None)
            if column is None:
                continue
            have, want = tuple(file.columns[column].shape), tuple(leaf_shape(space))
            if have != want:
                where = "" if column == key or len(file.columns) == 1 else f" ({column})"
                of = "" if len(leaves) == 1 else f" for {key}"
                raise InputError(f"--observations {p}{where}: rows of shape {list(have)}; the observation space"
                                 f"{of} is {space_text(observation_space if len(leaves) == 1 else space)}, "
                                 f"rows of {list(want)}")


# ----------------------------------------------------------------------------- reading


def _sha256(path: Path) -> str:
    """The file's sha256; of a directory (RLlib's Parquet output), the sha256 of its files' list:
    each ``<sha256>  <relative path>`` line, sorted, as ``sha256sum`` prints them."""
    if path.is_dir():
        from policy_export.exporter.recorded.parquet import _files

        lines = sorted(f"{_sha256(f)}  {f.relative_to(path).as_posix()}\n" for f in _files(path))
        return hashlib.sha256("".join(lines).encode()).hexdigest()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _key_map(file: RecordedFile, observation_keys: list[str], input_keys: set[str]) -> dict[str, str]:
    """File column -> contract input: the contract's own names; for a policy with one observation
    input also a file's single array, or RLlib's ``obs`` column."""
    names = [n for n, c in file.columns.items() if not c.optional or n in input_keys]
    if len(observation_keys) == 1:
        obs = observation_keys[0]
        if len(names) == 1:
            return {names[0]: obs}
        if "obs" in names and obs not in names:
            return {n: (obs if n == "obs" else n) for n in names if n == "obs" or n in input_keys} \
                if all(n == "obs" or n in input_keys for n in names) else _refuse(file, names, input_keys)
    unknown = [n for n in names if n not in input_keys]
    if unknown:
        _refuse(file, unknown, input_keys)
    return {n: n for n in names}


def _refuse(file: RecordedFile, names: list[str], input_keys: set[str]):
    unknown = [n for n in names if n not in input_keys and n != "obs"]
    raise InputError(f"--observations {file.path}: {', '.join(unknown)} is not an input of the policy (its "
                     f"inputs: {', '.join(sorted(input_keys))})")


def _plan_rows(counts: list[int], limit: int, seed: int) -> list[np.ndarray]:
    """The rows kept of each file: all of them when they fit in ``limit``, else a deterministic
    sub-sample (``seed``) over all files together, in order."""
    total = sum(counts)
    if total <= limit:
        return [np.arange(n) for n in counts]
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=limit, replace=False))
    starts = np.cumsum([0, *counts])
    return [chosen[(chosen >= a) & (chosen < b)] - a for a, b in zip(starts[:-1], starts[1:])]


def read_recorded(paths: Sequence[Path], observation_space, contract, limit: int, seed: int,
                  policy: str | None = None) -> Recorded:
    """The rows of ``paths`` for the policy (``observation_space``, ``contract``; ``policy``, its
    name, picks its rows of a multi-agent RLlib file), at most ``limit``.

    Raises:
        InputError: a file that does not fit the policy: a missing or unknown key, another shape,
            a dtype of another kind, NaN, naming the file, the key and the row.
    """
    from policy_export.exporter.recorded import checks

    files = [open_file(p, policy, len(paths)) for p in paths]
    leaves = checks.observation_leaves(observation_space)
    keys = set(contract.input_keys)
    maps = [_key_map(f, list(leaves), keys) for f in files]
    for f, mapping in zip(files, maps):
        missing = [k for k in leaves if k not in mapping.values()]
        if missing:
            raise InputError(f"--observations {f.path}: holds no {', '.join(missing)} (it holds "
                             f"{', '.join(f.columns)}); name the arrays as the policy's inputs")
    kept = _plan_rows([f.rows for f in files], limit, seed)
    parts: dict[str, list[np.ndarray]] = {}
    out_of_bounds, described = 0, []
    for f, mapping, rows in zip(files, maps, kept):
        bad_rows = 0
        for column_name, key in mapping.items():
            column = f.columns[column_name]
            spec = contract.input(key)
            space = leaves.get(key)
            taken, outside = checks.take(column, rows, space, spec, f"--observations {f.path}: {column_name}")
            parts.setdefault(key, []).append(taken)
            bad_rows = max(bad_rows, outside)
        out_of_bounds += bad_rows
        described.append({"path": str(f.path), "kind": f.kind, "sha256": _sha256(f.path), "rows": f.rows,
                          "kept": int(len(rows)), "columns": {c: k for c, k in mapping.items()},
                          "out_of_bounds": int(bad_rows)})
    inputs = {k: np.concatenate(v) for k, v in parts.items()}
    filled = checks.fill_required(inputs, contract)
    record = {"files": described, "rows": int(sum(len(r) for r in kept)),
              "sub_sample": None if all(len(r) == f.rows for r, f in zip(kept, files)) else {"seed": seed, "limit": limit},
              "out_of_bounds": int(out_of_bounds), "filled": filled}
    return Recorded(inputs, record, kept, _episodes(files, maps, leaves, contract, seed))


def _episodes(files: list[RecordedFile], maps: list[dict[str, str]], leaves, contract, seed: int):
    """A recurrent policy's episodes to replay stepped (:mod:`.episodes`): when the contract has
    state inputs, no file holds them, and a file gives episodes; else None (each row one step)."""
    from policy_export.signatures.keys import state_in_key

    state = state_in_key(0)
    if state not in contract.input_keys or any(k.startswith(state[:-1]) for m in maps for k in m.values()):
        return None
    from policy_export.exporter.recorded.episodes import read_episodes

    return read_episodes(files, maps, leaves, contract, seed)
