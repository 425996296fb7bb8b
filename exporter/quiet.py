"""Keep TensorFlow's, tf2onnx's and ONNX Runtime's log noise away from command-line users.

Called by the command line only; importing the library changes no environment variable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def silenced_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null (C++ logging writes there before it can be configured)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def quiet_libraries(debug: bool = False) -> None:
    """Import TensorFlow, tf2onnx and ONNX Runtime with their logging at error level.

    With ``debug`` the libraries' own output is left alone.
    """
    if debug:
        import tensorflow  # noqa: F401
        return
    from policy_export.exporter.compat import check_onnx_environment

    check_onnx_environment()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    warnings.filterwarnings("ignore")
    with silenced_stderr():
        import absl.logging
        import onnxruntime
        import tensorflow as tf
        import tf2onnx  # noqa: F401
    absl.logging.set_verbosity(absl.logging.ERROR)
    tf.get_logger().setLevel(logging.ERROR)
    tf.autograph.set_verbosity(0)
    for name in ("tf2onnx", "tensorflow", "absl", "h5py", "py.warnings"):
        logging.getLogger(name).setLevel(logging.ERROR)
    onnxruntime.set_default_logger_severity(3)
