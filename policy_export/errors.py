"""The package's exception hierarchy: one base, a few structured subclasses.

Every error the package raises on purpose derives from :class:`PolicyExportError`.
``exit_code`` is what the command line returns for it: 2 for bad input or usage (a file that is
not what it claims, or that a check refuses before anything runs, is bad input), 1 for a check
that ran and failed. Anything else that escapes a command is a bug in the package: exit code 3.

    PolicyExportError (2)
    |-- SpecError, UnsupportedSpaceError, WeightsError, InputError, DeviceError,
    |   EnvironmentMismatchError, JSONError (policy_export.policy.jsonio)
    |-- ExportError: ExportExistsError, ExportBusyError, UnsafeModelError, UnsafeCheckpointError,
    |   DeclaredSizeError
    `-- CheckFailedError (1): ParityFailedError, RunTimeoutError

A converter (tf2onnx, the TFLite converter) that cannot convert a policy's graph raises an
:class:`ExportError` naming the format and the converter's error: the graph is the input that
format cannot be made from (exit 2), not a check that ran and failed, and not a bug of this package.
"""

from __future__ import annotations

from collections.abc import Sequence


class PolicyExportError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = 2


class SpecError(PolicyExportError):
    """A policy spec file is malformed; ``problems`` lists ``(json_path, message)``."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]):
        self.source = source
        self.problems = list(problems)
        lines = [f"{path}: {msg}" for path, msg in self.problems]
        super().__init__(f"invalid policy spec {source}: " + "; ".join(lines))


class UnsupportedSpaceError(PolicyExportError):
    """A gymnasium space type that the package cannot export."""

    def __init__(self, space_type: str, where: str, supported: Sequence[str]):
        self.space_type = space_type
        self.where = where
        self.supported = tuple(supported)
        super().__init__(
            f"{where}: space type {space_type!r} is not supported; "
            f"supported types are {', '.join(self.supported)}"
        )


class WeightsError(PolicyExportError):
    """Weights cannot be read or do not fit the policy; ``problems`` names each one."""

    def __init__(self, source: str, problems: Sequence[str]):
        self.source = source
        self.problems = list(problems)
        super().__init__(f"cannot use weights from {source}: " + "; ".join(self.problems))


class InputError(PolicyExportError):
    """Arrays given to the Python API do not match the policy's inputs."""


class ExportError(PolicyExportError):
    """A format could not be written, or the output location cannot be used."""


class ConversionError(ExportError):
    """A converter cannot make one format of this policy (tf2onnx fails on an op, the ONNX checker
    refuses the model...). The export still writes and proves the other formats and records this
    one under ``missing`` in the manifest."""


class ExportExistsError(ExportError):
    """The output directory already holds an export and overwriting was not asked for."""


class ExportBusyError(ExportError):
    """Another export to the same output path is in progress."""


class DeviceError(PolicyExportError):
    """The requested device is not available."""


class CheckFailedError(PolicyExportError):
    """A check ran and failed (parity, file hashes, contract compatibility)."""

    exit_code = 1


class EnvironmentMismatchError(PolicyExportError):
    """Installed libraries that cannot work together; the message names the versions and the fix."""


class UnsafeModelError(ExportError):
    """A graph holds an op that loading or serving it must not run; ``op`` and ``node`` name it."""

    def __init__(self, path: str, op: str, node: str, reason: str):
        self.op, self.node = op, node
        super().__init__(f"refusing to load SavedModel {path}: op {op!r} (node {node!r}) {reason}")


class UnsafeCheckpointError(ExportError):
    """A checkpoint file references code, or holds what it cannot, or points outside its
    directory; nothing from it was run (exit code 2)."""


class DeclaredSizeError(ExportError):
    """An ONNX tensor declares more data than it holds, or than the file can account for (exit code 2)."""


class ParityFailedError(CheckFailedError):
    """Parity or file checks failed; ``report`` holds every record (a ``ParityReport``), ``problems``
    the file issues."""

    def __init__(self, message: str, report=None, problems: Sequence[str] = ()):
        super().__init__(message)
        self.report = report
        self.problems = list(problems)


class RunTimeoutError(CheckFailedError):
    """One call into a runtime took longer than the run limit (a failed check: exit code 1)."""

    def __init__(self, label: str, limit: float):
        self.label, self.limit = label, limit
        super().__init__(f"{label} did not finish one run within the limit of {limit:g} s (--run-timeout); "
                         "the run was stopped: the model loops or computes far beyond what a policy needs")
