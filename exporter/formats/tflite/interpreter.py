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
