"""Keep TensorFlow's, tf2onnx's, ONNX Runtime's and LiteRT's log noise away from users.

The command line calls :func:`quiet_libraries` before its heavy work (``--debug`` leaves the
libraries' output alone). The Python API loads TensorFlow quietly too, but only when one of its
calls is what first imports TensorFlow in the process: ``import policy_export`` changes no
environment variable and imports nothing heavy; it puts a finder on ``sys.meta_path`` that acts
once, on the first ``import tensorflow``. If that import comes from the package's own code (an
API call, or a name such as ``policy_export.TFPolicy`` whose module imports TensorFlow), it:

- sets ``TF_CPP_MIN_LOG_LEVEL=3`` and ``GRPC_VERBOSITY=ERROR`` unless they are set already;
- keeps the lines TensorFlow's C++ libraries write to file descriptor 2 while they load off stderr
  (all of them are written again, before the error propagates, if the import fails);
- puts the ``tensorflow`` Python logger at ERROR;
- keeps LiteRT's ``INFO:`` lines (``Created TensorFlow Lite XNNPACK delegate for CPU.``) off
  stderr when an interpreter is created, and TensorFlow 2.15's converter summary when a model is
  converted (:func:`library_output`; the command line without ``--debug`` does the same).

It does nothing when TensorFlow was imported before ``policy_export`` or by the user's own code
first, when ``TF_CPP_MIN_LOG_LEVEL`` is set below 3 (the user asked for TensorFlow's logs), after
:func:`show_library_logs`, and under the command line (which decides with ``--debug``).
Exceptions are never swallowed: a TensorFlow error raised while a library's output is held back
propagates as it would have, and file descriptor 2 is put back first.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator

_state = {
    "show": False,  # show_library_logs(): the API leaves the libraries' output alone
    "hide_runtime": False,  # LiteRT's INFO lines held back when an interpreter is created
    "tf_level": None,  # the tensorflow logger's level before the quiet load put it at ERROR
}


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


def _flush_stderr() -> None:
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stderr.flush()


def _write_fd2(text: str) -> None:
    data = text.encode("utf-8", errors="replace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data):]


@contextlib.contextmanager
def held_stderr(keep: Callable[[list[str]], list[str]] = lambda lines: []) -> Iterator[None]:
    """File descriptor 2 into a temporary file while the block runs (what C++ code writes there
    included); then the lines ``keep`` returns are written to stderr, or every line if the block
    raised (they may explain the error, which propagates unchanged). Descriptor 2 is always put
    back before anything else happens."""
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2: nothing to hold back
        yield
        return
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            failed = True
            try:
                yield
                failed = False
            finally:
                _flush_stderr()
                os.dup2(saved, 2)
                held.seek(0)
                lines = held.read().decode("utf-8", errors="replace").splitlines(keepends=True)
                _write_fd2("".join(lines if failed else keep(lines)))
    finally:
        os.close(saved)


def without_litert_info(lines: list[str]) -> list[str]:
    """``lines`` without LiteRT's informational ones (``INFO: Created TensorFlow Lite XNNPACK
    delegate for CPU.``); its warnings and errors kept."""
    return [line for line in lines if not line.startswith("INFO: ")]


def without_converter_summary(lines: list[str]) -> list[str]:
    """``lines`` without the TFLite converter's "Summary on the non-converted ops" block (which
    TensorFlow 2.15's converter prints after every conversion) and LiteRT's ``INFO:`` lines."""
    kept, in_summary = [], False
    for line in without_litert_info(lines):
        if line.startswith("Summary on the non-converted ops:"):
            in_summary = True
        elif not (in_summary and (not line.strip() or line.lstrip().startswith(("-", "*", "(")))):
            in_summary = False
            kept.append(line)
    return kept


@contextlib.contextmanager
def library_output(keep: Callable[[list[str]], list[str]] = without_litert_info) -> Iterator[None]:
    """Around a call into LiteRT or the TFLite converter: what its C++ code writes to descriptor 2
    is filtered by ``keep`` (by default LiteRT's ``INFO:`` lines, the XNNPACK delegate's, are
    dropped) when the libraries were loaded quietly (the command line without ``--debug``, the
    API's quiet load); everything is written if the call raises."""
    if not _state["hide_runtime"]:
        yield
        return
    with held_stderr(keep):
        yield


def quiet_libraries(debug: bool = False) -> None:
    """Import TensorFlow, tf2onnx and ONNX Runtime with their logging at error level.

    With ``debug`` the libraries' own output is left alone.
    """
    _uninstall()  # the caller decides; the API's finder steps aside
    _state["hide_runtime"] = not debug
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


def show_library_logs(show: bool = True) -> None:
    """Let TensorFlow and LiteRT write their own logs when the Python API loads them.

    By default the first API call that imports TensorFlow in the process loads it quietly (see
    :mod:`policy_export.exporter.quiet`); call this before that call to see TensorFlow's startup
    lines, its C++ logs and LiteRT's ``INFO:`` lines. Called later, it puts the ``tensorflow``
    logger back at its level and shows LiteRT's lines again, but TensorFlow's C++ log level was
    fixed when it loaded. ``show_library_logs(False)`` restores the default. Setting
    ``TF_CPP_MIN_LOG_LEVEL`` below 3 before the first call does the same as ``show_library_logs()``.
    """
    _state["show"] = bool(show)
    if show:
        _state["hide_runtime"] = False
        if _state["tf_level"] is not None:
            logging.getLogger("tensorflow").setLevel(_state["tf_level"])
            _state["tf_level"] = None


def _logs_wanted() -> bool:
    """Whether the user asked for TensorFlow's logs: :func:`show_library_logs`, or a
    ``TF_CPP_MIN_LOG_LEVEL`` below 3 (TensorFlow reads a value that is no number as 0)."""
    if _state["show"]:
        return True
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    if level is None:
        return False
    try:
        return int(level.strip()) < 3
    except ValueError:
        return True


def _from_the_api() -> bool:
    """Whether the import under way was started by the package's code, not by the command line
    (which quiets the libraries itself) and not by the user's."""
    frame, ours = sys._getframe(1), False
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name == "policy_export.exporter.cli":
            return False
        if name == "policy_export" or name.startswith("policy_export."):
            ours = ours or name != __name__
        frame = frame.f_back
    return ours


def _load_quietly(load: Callable[[], None]) -> None:
    """``load()`` (TensorFlow's import) with TensorFlow's C++ logging at error level and what it
    writes to descriptor 2 while it loads held back (written out if it fails)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    with held_stderr():
        load()
    _state["hide_runtime"] = True
    tf_logger = logging.getLogger("tensorflow")
    _state["tf_level"] = tf_logger.level
    tf_logger.setLevel(logging.ERROR)


class _QuietLoader(importlib.abc.Loader):
    """TensorFlow's own loader, run by :func:`_load_quietly`; it puts the real loader back on the
    module before TensorFlow's code runs."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        _load_quietly(lambda: self.loader.exec_module(module))


class _FirstTensorFlowImport(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` from ``import policy_export`` until the first ``import tensorflow``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow":
            return None
        _uninstall()  # once, whoever imports it
        if _logs_wanted() or not _from_the_api():
            return None
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _QuietLoader(spec.loader)
        return spec


def install() -> None:
    """Put the finder of the API's quiet load on ``sys.meta_path`` (once; not when TensorFlow is
    already imported)."""
    if "tensorflow" in sys.modules or any(isinstance(f, _FirstTensorFlowImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _FirstTensorFlowImport())


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FirstTensorFlowImport)]
