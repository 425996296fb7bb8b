"""``policy-export example DIR``: the CartPole spec the wheel carries (``policy_export/data``:
``policy.json`` and its ``weights.h5``, the repository's ``fixtures/cartpole_mlp``) written to a
directory of the user's, ready for ``policy-export export DIR --out OUT``. No TensorFlow."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from policy_export.errors import InputError

EXAMPLE = "cartpole_mlp"
FILES = ("policy.json", "weights.h5")


def example_files() -> dict[str, bytes]:
    """The bundled spec's files by name."""
    folder = resources.files("policy_export").joinpath("data", EXAMPLE)
    return {name: folder.joinpath(name).read_bytes() for name in FILES}


def write_example(directory: str | os.PathLike) -> Path:
    """Write the bundled CartPole spec to ``directory`` (created with its parents; an existing
    one must be an empty directory) and return its path.

    Raises:
        InputError: ``directory`` is a file, a directory that is not empty, or cannot be written.
    """
    target = Path(directory)
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise InputError(f"{target}: exists and is not a directory")
        if any(target.iterdir()):
            raise InputError(f"{target}: is not empty; give a new or empty directory (nothing was written)")
    files = example_files()
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            with open(target / name, "xb") as f:  # never over a file that appeared meanwhile
                f.write(data)
    except OSError as e:
        raise InputError(f"{target}: cannot write the example: {e.strerror or e}") from e
    return target
