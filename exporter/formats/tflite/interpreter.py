"""Which LiteRT interpreter this machine has: the one place both the writer (which loads each
model once to resolve its ops) and the runner pick it, so neither imports the other."""

from __future__ import annotations

from typing import Any


def interpreter_class() -> tuple[Any, str]:
    """The interpreter class and its origin: ``ai_edge_litert`` if importable, else ``tf.lite``."""
    try:
        from ai_edge_litert.interpreter import Interpreter

        return Interpreter, "ai_edge_litert"
    except ImportError:
        import tensorflow as tf

        return tf.lite.Interpreter, "tensorflow.lite"


def create_interpreter(cls: Any, *, strict: bool = True, **kwargs: Any) -> Any:
    """``cls(**kwargs)`` with its tensors allocated, which applies LiteRT's default delegate; the
    ``INFO:`` line that writes to file descriptor 2 (``Created TensorFlow Lite XNNPACK delegate for
    CPU.``) is kept off stderr unless the libraries' logs are shown (the command line's ``--debug``,
    :func:`policy_export.show_library_logs`). Its other lines are written as usual.

    Raises:
        RuntimeError, ValueError: what the interpreter raises on a model it cannot load, or (with
            ``strict``) cannot allocate; without ``strict`` an allocation error is left to the
            first run of a signature, which allocates its own subgraph and raises it there.
    """
    from policy_export.exporter.quiet import library_output

    with library_output():
        interpreter = cls(**kwargs)
        try:
            interpreter.allocate_tensors()
        except (RuntimeError, ValueError):
            if strict:
                raise
    return interpreter
