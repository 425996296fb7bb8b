"""``manifest.json``: versions, spaces, contract, tolerances, files with sha256, parity summary."""

from __future__ import annotations

import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from policy_export.policy.errors import ExportError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
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
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_records(root: Path) -> list[dict[str, Any]]:
    """Every file under ``root`` except the manifest: relative path, size, sha256 (sorted by path)."""
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        out.append({"path": rel, "size": path.stat().st_size, "sha256": sha256(path)})
    return out


def check_files(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems with the files of an export: changed, missing or extra, each named."""
    listed = {f["path"]: f for f in manifest.get("files", [])}
    actual = {f["path"]: f for f in file_records(root)}
    problems = []
    for path in sorted(listed.keys() - actual.keys()):
        problems.append(f"missing file {path}")
    for path in sorted(actual.keys() - listed.keys()):
        problems.append(f"extra file {path} (not in the manifest)")
    for path in sorted(listed.keys() & actual.keys()):
        if listed[path]["sha256"] != actual[path]["sha256"]:
            problems.append(f"changed file {path} (sha256 differs from the manifest)")
    return problems


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    path = root / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of an export directory.

    Raises:
        ExportError: no such directory or manifest, not JSON, or not a manifest of this package.
    """
    path = Path(root) / MANIFEST
    if not Path(root).is_dir():
        raise ExportError(f"{root} is not a directory")
    if not path.is_file():
        raise ExportError(f"{root} is not an export: it has no {MANIFEST}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON: {e}") from e
    required = ("manifest_version", "contract", "files", "formats", "tensor_names", "tolerances")
    missing = [k for k in required if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise ExportError(f"{path} is not a policy-export manifest (missing {', '.join(missing)})")
    if obj["manifest_version"] != MANIFEST_VERSION:
        raise ExportError(f"{path}: manifest_version {obj['manifest_version']!r} is not supported (expected {MANIFEST_VERSION})")
    return obj
