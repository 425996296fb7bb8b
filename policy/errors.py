"""The package's exception hierarchy: one base, a few structured subclasses.

Every error the package raises on purpose derives from :class:`PolicyExportError`.
``exit_code`` is what the command line returns for it: 2 for bad input or usage,
1 for a check that ran and failed.
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
