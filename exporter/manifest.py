"""``manifest.json``: versions, spaces, contract, tolerances, files with sha256, parity summary."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import stat
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from policy_export.policy import jsonio
from policy_export.errors import ExportError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
PARITY_PREFIX = "parity/"
STAGING_MARKER = ".policy-export-staging"  # written by staging.py while an export is built
_PACKAGES = ("policy-export", "tensorflow", "tf-keras", "tf2onnx", "onnx", "onnxruntime", "numpy", "gymnasium", "h5py")


def versions() -> dict[str, str]:
    """Installed versions of the packages an export depends on."""
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name == "onnxruntime":
                try:
                    out[name] = metadata.version("onnxruntime-gpu")
                except metadata.PackageNotFoundError:
                    out[name] = "unknown"
            else:
                out[name] = "unknown"
    return out


def sha256(path: Path) -> str:
    """The sha256 of a regular file, read without following a symbolic link.

    Raises:
        OSError: the path is not a regular file (``EINVAL``), or cannot be read.
    """
    h = hashlib.sha256()
    with _open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _open_regular(path: Path):
    """Open ``path`` for reading only if it is a regular file (no FIFO, device or symbolic link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "rb")


@dataclass
class FileScan:
    """An export directory's entries: regular files (path -> size) and everything else (path -> kind)."""

    files: dict[str, int] = field(default_factory=dict)
    special: dict[str, str] = field(default_factory=dict)


def scan(root: Path, staging: bool = False) -> FileScan:
    """Walk ``root`` without following symbolic links; the manifest (and with ``staging`` the
    staging marker) is left out."""
    skip = {MANIFEST, STAGING_MARKER} if staging else {MANIFEST}
    out = FileScan()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames + filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel in skip:
                continue
            try:
                mode = os.lstat(full).st_mode
            except OSError:
                out.special[rel] = "unreadable entry"
                continue
            if stat.S_ISREG(mode):
                out.files[rel] = os.lstat(full).st_size
            elif not stat.S_ISDIR(mode):
                out.special[rel] = _kind(mode)
    return out


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def file_records(root: Path) -> list[dict[str, Any]]:
    """Every regular file under ``root`` except the manifest: relative path, size, sha256 (sorted by path).

    Raises:
        ExportError: ``root`` holds a symbolic link, FIFO, device or socket.
    """
    found = scan(root, staging=True)
    if found.special:
        rel, kind = next(iter(found.special.items()))
        raise ExportError(f"{root / rel} is a {kind}; an export holds regular files only")
    return [{"path": rel, "size": size, "sha256": sha256(root / rel)} for rel, size in sorted(found.files.items())]


@dataclass
class FileCheck:
    """Result of :func:`check_files`: the problems, and every path that may not be loaded."""

    problems: list[str]
    untrusted: set[str]

    def trusted(self, rel: str) -> bool:
        """Whether ``rel`` (a file or directory of the export), everything under it and every
        directory above it passed the hash check."""
        rel = rel.rstrip("/")
        return not any(p == rel or p.startswith(rel + "/") or rel.startswith(p + "/") for p in self.untrusted)


def check_files(root: Path, manifest: dict[str, Any], format_paths: dict[str, str],
                signature_inside: str | None = None) -> FileCheck:
    """Changed, missing, extra and special files of an export, each named.

    ``signature_inside``: the name of the signature file being checked with the export when it
    lies at the export's top (``model.sig``): the one file the manifest does not list that is not
    an extra file (see :mod:`exporter.signing`).

    Only regular files inside ``root`` are read; a symbolic link, FIFO or device in place of a
    file is a changed file and is never opened. A manifest without formats, or with files that no
    format accounts for (its ``files`` list, or its path in ``format_paths``: format name -> the
    path it writes, as the format registry gives them), is a problem too.
    """
    listed = {f["path"]: f for f in manifest["files"]}
    found = scan(root)
    problems, untrusted = [], set()
    if len(listed) != len(manifest["files"]):
        counts = Counter(f["path"] for f in manifest["files"])
        twice = sorted(path for path, n in counts.items() if n > 1)
        problems += [f"file {path} is listed more than once in the manifest" for path in twice]
        untrusted.update(twice)
    for path, kind in sorted(found.special.items()):
        problems.append(f"changed file {path} (a {kind}, not a regular file)")
        untrusted.add(path)
    for path in sorted(listed.keys() - found.files.keys() - found.special.keys()):
        problems.append(f"missing file {path}")
        untrusted.add(path)
    for path in sorted(found.files.keys() - listed.keys() - {signature_inside}):
        problems.append(f"extra file {path} (not in the manifest)")
        untrusted.add(path)
    for path in sorted(listed.keys() & found.files.keys()):
        try:
            same = (found.files[path] == listed[path]["size"]) and sha256(root / path) == listed[path]["sha256"]
        except OSError as e:
            problems.append(f"changed file {path} (cannot be read: {e.strerror})")
            untrusted.add(path)
            continue
        if not same:
            problems.append(f"changed file {path} (sha256 differs from the manifest)")
            untrusted.add(path)
    problems += _unaccounted(manifest, format_paths)
    return FileCheck(problems, untrusted)


def _unaccounted(manifest: dict[str, Any], format_paths: dict[str, str]) -> list[str]:
    """Problems when the manifest lists no format, or files that none of its formats accounts for."""
    formats = manifest["formats"]
    if not formats:
        return ["the manifest lists no formats: nothing can be checked"]
    owned = [format_paths[f] for f in formats if f in format_paths]
    owned += [p.rstrip("/") for info in formats.values() if isinstance(info.get("files"), list) for p in info["files"]]
    problems = []
    for f in manifest["files"]:
        path = f["path"]
        if path.startswith(PARITY_PREFIX) or any(path == o or path.startswith(o + "/") for o in owned):
            continue
        problems.append(f"file {path} belongs to no format in the manifest")
    return problems


def manifest_sha256(root: Path) -> str:
    """The sha256 of an export's ``manifest.json`` (what ``verify --expect-manifest-sha256`` pins).

    Raises:
        ExportError: the manifest is not a readable regular file.
    """
    try:
        return sha256(Path(root) / MANIFEST)
    except OSError as e:
        raise ExportError(f"{Path(root) / MANIFEST} cannot be read as a regular file: {e.strerror}") from e


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    path = root / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of an export directory, checked field by field.

    Raises:
        ExportError: no such directory or manifest, not a readable regular file, not JSON, or not
            a manifest of this package (each malformed field named).
    """
    path = Path(root) / MANIFEST
    if not Path(root).exists() and not Path(root).is_symlink():
        raise ExportError(f"{root}: no such export directory")
    if not Path(root).is_dir():
        raise ExportError(f"{root} is not a directory")
    if not path.exists() and not path.is_symlink():
        raise ExportError(f"{root} is not an export: it has no {MANIFEST}")
    try:
        with _open_regular(path) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ExportError(f"{path} cannot be read as a regular file: {e.strerror}") from e
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ExportError(f"{path} is larger than the {MAX_MANIFEST_BYTES >> 20} MiB limit for a manifest")
    try:
        obj = jsonio.loads(raw, str(path), MAX_MANIFEST_BYTES)
    except jsonio.JSONError as e:
        raise ExportError(f"{path}: {e.problem}") from e
    required = ("manifest_version", "contract", "files", "formats", "tensor_names", "tolerances")
    missing = [k for k in required if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise ExportError(f"{path} is not a policy-export manifest (missing {', '.join(missing)})")
    if obj["manifest_version"] != MANIFEST_VERSION:
        raise ExportError(f"{path}: manifest_version {obj['manifest_version']!r} is not supported (expected {MANIFEST_VERSION})")
    problems = _field_problems(obj)
    if problems:
        raise ExportError(f"{path} is not a valid policy-export manifest: " + "; ".join(problems[:5]))
    return obj


def _field_problems(obj: dict[str, Any]) -> list[str]:
    problems = []
    files = obj["files"]
    if not isinstance(files, list) or not all(_is_file_record(f) for f in files):
        problems.append("files: expected a list of {path, size, sha256} with normalised relative POSIX paths "
                        "inside the export (no '.', '..', empty parts or backslashes) and 64-digit hex sha256")
    else:
        seen: set[str] = set()
        for f in files:
            if f["path"] in seen:
                problems.append(f"files: {f['path']!r} is listed more than once; each file is listed once")
                break
            seen.add(f["path"])
    formats = obj["formats"]
    if not (isinstance(formats, dict) and all(isinstance(k, str) and isinstance(v, dict) and _is_paths(v.get("files", []))
                                              for k, v in formats.items())):
        problems.append("formats: expected an object of format name -> {files: [paths] or {name: path}, ...} "
                        "with normalised relative POSIX paths")
    if not isinstance(obj["tensor_names"], dict):
        problems.append("tensor_names: expected an object")
    problems += _contract_problems(obj["contract"])
    tol = obj["tolerances"]
    if not (isinstance(tol, dict) and _is_tolerance(tol.get("default"))
            and isinstance(tol.get("per_output", {}), dict)
            and all(_is_tolerance(v) for v in tol.get("per_output", {}).values())
            and isinstance(tol.get("allow_non_finite", []), list)
            and all(isinstance(k, str) for k in tol.get("allow_non_finite", []))):
        problems.append("tolerances: expected {default: {atol, rtol}, per_output: {key: {atol, rtol}}, "
                        "allow_non_finite: [keys] (optional)}")
    spaces = obj.get("spaces", {})
    if not isinstance(spaces, dict) or not all(isinstance(spaces.get(k, {}), dict) for k in ("observation", "action")):
        problems.append("spaces: expected {observation: {...}, action: {...}}")
    return problems


def _is_paths(files: Any) -> bool:
    values = files.values() if isinstance(files, dict) else files
    return isinstance(files, (list, dict)) and all(
        isinstance(p, str) and _is_export_path(p[:-1] if p.endswith("/") else p) for p in values)


def _is_file_record(f: Any) -> bool:
    if not (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("sha256"), str)
            and isinstance(f.get("size"), int) and not isinstance(f.get("size"), bool)):
        return False
    return _is_export_path(f["path"]) and _is_sha256(f["sha256"]) and f["size"] >= 0 and f["path"] != MANIFEST


def _is_export_path(path: str) -> bool:
    """Whether ``path`` is a normalised relative POSIX path inside an export: no leading ``/``,
    no ``.``, ``..`` or empty parts, no backslash and no control characters."""
    parts = path.split("/")
    return bool(path) and all(p not in ("", ".", "..") for p in parts) and "\\" not in path \
        and all(ord(c) >= 32 and c != "\x7f" for c in path)


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _is_tolerance(t: Any) -> bool:
    return isinstance(t, dict) and set(t) <= {"atol", "rtol"} and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in t.values())


def _contract_problems(contract: Any) -> list[str]:
    def spec_ok(s: Any) -> bool:
        return (isinstance(s, dict) and isinstance(s.get("key"), str) and isinstance(s.get("dtype"), str)
                and isinstance(s.get("shape"), list)
                and all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 0) for d in s["shape"]))

    if not (isinstance(contract, dict) and all(isinstance(contract.get(k), list) and all(spec_ok(s) for s in contract[k])
                                               for k in ("inputs", "outputs"))):
        return ["contract: expected {inputs: [...], outputs: [...]} of {key, dtype, shape}"]
    return []


MAX_NPZ_BYTES = 1 << 30


def save_npz(path: Path, arrays: dict[str, Any], compressed: bool = False) -> None:
    """Write ``arrays`` (name -> numeric array) as an ``.npz`` file that :func:`load_npz` reads.

    Raises:
        ExportError: an array holds Python objects (it could only be read back as a pickle).
    """
    import numpy as np

    values = {k: np.asarray(v) for k, v in arrays.items()}
    objects = sorted(k for k, v in values.items() if v.dtype.hasobject)
    if objects:
        raise ExportError(f"{path}: arrays {objects} hold Python objects; an export stores numeric arrays only")
    (np.savez_compressed if compressed else np.savez)(path, **values)


def load_npz(path: Path, max_bytes: int = MAX_NPZ_BYTES) -> dict[str, Any]:
    """The arrays of a regular ``.npz`` file, after checking every header against ``max_bytes``.

    Each member's declared shape x itemsize (and its stored size) is summed before any array is
    read, so a small file that would inflate to gigabytes is refused without allocating; object
    arrays (pickles) are refused.

    Raises:
        ExportError: not a regular readable ``.npz`` file, object arrays, or over the limit.
    """
    import zipfile

    import numpy as np

    try:
        with _open_regular(path) as f, zipfile.ZipFile(f) as z:
            total = 0
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    raise ExportError(f"{path}: member {info.filename!r} is not a .npy array")
                with z.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read_header(member)
                if dtype.hasobject:
                    raise ExportError(f"{path}: member {info.filename!r} holds Python objects; refusing to load it")
                total += max(int(np.prod(shape, dtype=object)) * dtype.itemsize, info.file_size)
                if total > max_bytes:
                    raise ExportError(f"{path} declares more than the {max_bytes >> 20} MiB limit of array data")
            f.seek(0)
            with np.load(f, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
    except ExportError:
        raise
    except Exception as e:  # zipfile, OSError, ValueError: any of them means "not usable"
        raise ExportError(f"{path} is not a readable .npz file: {e}") from e
