"""Runners: one lifecycle for every runtime that runs an exported policy.

A runner is what a format's ``open`` returns. It runs the model by signature key::

    with fmt.open(path, manifest, device) as runner:
        runner.inputs["observations"]      # TensorMeta(key, dtype, shape) as the model declares it
        outputs = runner({"observations": obs})

Before running, the feeds are checked: a key the model does not take, or (with the export's
contract) an array whose dtype or shape the contract does not allow, is an :class:`InputError`
naming the input; nothing is run. Leaving the ``with`` block closes the runtime's session.

Every call into the runtime goes through :meth:`Runner.stoppable` (:mod:`exporter.watchdog`): it
is limited to the run limit in force (:func:`exporter.watchdog.run_limit`, 600 s by default, or the
runner's own ``run_timeout``), and SIGINT/SIGTERM stop it although the runtime is in native code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_export.exporter.watchdog import Stoppable
from policy_export.errors import InputError
from policy_export.signatures.contract import Contract


def with_defaults(label: str, metas: Mapping[str, "TensorMeta"], feeds: Mapping[str, Any],
                  defaults: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A contiguous array for each of ``metas`` (key -> TensorMeta) in its dtype: the fed value, else
    its default (for runtimes whose every input must be fed).

    Raises:
        InputError: an input without a default is not fed.
    """
    arrays = {}
    for key, meta in metas.items():
        if key in feeds:
            value = feeds[key]
        elif key in defaults:
            value = defaults[key]
        else:
            raise InputError(f"{label}: required input {key!r} is missing")
        # np.asarray keeps a scalar a scalar (np.ascontiguousarray makes it [1])
        arrays[key] = np.asarray(value, dtype=np.dtype(meta.dtype) if meta.dtype else None, order="C")
    return arrays


class HeadUnavailable(Exception):
    """The action head reads more than the distribution inputs and ``explore``."""


@dataclass(frozen=True)
class TensorMeta:
    """An input or output as the runtime declares it; ``None`` for a dimension or dtype it leaves open."""

    key: str
    dtype: str | None
    shape: tuple[int | None, ...] | None

    def describe(self) -> str:
        shape = "?" if self.shape is None else "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"
        return f"{self.key}: {self.dtype or '?'} {shape}"


class Runner:
    """Base of every runner: feed checks, metadata, and closing as a context manager.

    Subclasses set ``label`` (what the errors call the model), ``inputs`` and ``outputs`` (key ->
    :class:`TensorMeta`), optionally ``accepted`` (input keys it may be fed although the model
    dropped them, e.g. inputs that freezing pruned), and implement :meth:`_run` and :meth:`_close`.
    """

    label = "model"
    inputs: dict[str, TensorMeta]
    outputs: dict[str, TensorMeta]
    contract: Contract | None = None
    accepted: frozenset[str] = frozenset()
    run_timeout: float | None = None  # seconds per runtime call; None: the run limit in force
    _closed = False
    _watch: Stoppable | None = None

    def __call__(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check ``feeds`` (see :meth:`check_feeds`) and run; outputs keyed by signature key."""
        arrays = self.check_feeds(feeds)
        return self._run(arrays)

    def check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The feeds as arrays, after checking keys, and dtypes and shapes against the contract.

        Raises:
            InputError: a key the model does not take, or a dtype or shape the contract does not allow.
        """
        if self._closed:
            raise InputError(f"{self.label} is closed")
        unknown = sorted(set(feeds) - set(self.inputs) - set(self.accepted))
        if unknown:
            raise InputError(f"{self.label} has no input(s) {unknown}; it takes {sorted(self.inputs)}")
        arrays = {k: np.asarray(v) for k, v in feeds.items()}
        if self.contract is not None:
            specs = {s.key: s for s in self.contract.inputs}
            for key, value in arrays.items():
                spec = specs.get(key)
                if spec is None:
                    continue
                try:
                    spec.assert_array(value)
                except ValueError as e:
                    raise InputError(f"{self.label}: input {e}") from None
        return arrays

    def head(self):
        """The runtime's own action head: a callable taking ``action_dist_inputs`` and ``explore``
        and returning the sampled actions (and ``action_logp``), run without the network; ``None``
        when the model cannot be cut there. It raises :class:`HeadUnavailable` when it turns out to
        need other inputs. Exploration parity draws through it, so that its cost does not grow with
        the network (see :func:`exporter.parity.exploration.draw`)."""
        return None

    def device_info(self) -> dict[str, Any]:
        """What the runtime runs on, for reports (e.g. ONNX Runtime's providers)."""
        return {}

    def stoppable(self, call, stop=None):
        """The result of ``call()`` (one call into the runtime), run so that the run limit holds and
        signals stop it; ``stop`` tells the runtime to abandon the call (see
        :meth:`exporter.watchdog.Stoppable.run`).

        Raises:
            RunTimeoutError: the call took longer than the run limit (it was stopped).
            KeyboardInterrupt: a signal arrived meanwhile (the call was stopped first).
        """
        if self._watch is None:
            self._watch = Stoppable(self.label)
        return self._watch.run(call, stop, self.run_timeout)

    @property
    def stuck(self) -> bool:
        """A call was told to stop and did not: the runtime may still be busy in its thread."""
        return self._watch is not None and self._watch.stuck

    def close(self) -> None:
        """Close the runtime's session (left to the process's exit while a stopped call still runs in it)."""
        if not self._closed:
            self._closed = True
            if self.stuck:
                return
            self._close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _close(self) -> None:
        pass

