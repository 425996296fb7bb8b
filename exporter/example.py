"""``policy-export example DIR``: the CartPole spec the wheel carries (``policy_export/data``:
``policy.json`` and its ``weights.h5``, the repository's ``fixtures/cartpole_mlp``) written to a
directory of the user's, ready for ``policy-export export DIR --out OUT``. No TensorFlow."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
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
    one must be an empty directory, not a symbolic link) and return its path. The files are
    written to a new folder beside it, which is then renamed into place: a failure leaves
    nothing, and nothing is written through a link.

    Raises:
        InputError: ``directory`` is a file, a link, a directory that is not empty, or cannot be written.
    """
    target = Path(directory)
    if target.is_symlink():
        raise InputError(f"{target}: is a symbolic link; refusing to write through it (nothing was written)")
    if target.exists():
        if not target.is_dir():
            raise InputError(f"{target}: exists and is not a directory")
        if any(target.iterdir()):
            raise InputError(f"{target}: is not empty; give a new or empty directory (nothing was written)")
    files = example_files()
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".pe-example-", dir=target.parent))
        for name, data in files.items():
            with open(staging / name, "xb") as f:
                f.write(data)
        os.chmod(staging, 0o777 & ~_umask())
        os.rename(staging, target)  # over an empty directory only; never through a link
        staging = None
    except OSError as e:
        reason = "it is no longer an empty directory" if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR) \
            else e.strerror or str(e)
        raise InputError(f"{target}: cannot write the example: {reason} (nothing was written)") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
