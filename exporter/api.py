"""The former home of the Python API, kept for one release: import from ``policy_export`` instead.

``policy_export.exporter.api`` re-exports what it held; the pipelines now live in
:mod:`exporter.export` and :mod:`exporter.verify`, the options in :mod:`exporter.options` and
:class:`ParityFailedError` in :mod:`policy_export.errors`.
"""

from policy_export.errors import ParityFailedError  # noqa: F401
from policy_export.exporter.convert import export_spec  # noqa: F401
from policy_export.exporter.export import PARITY_DIR, ExportResult, export_policy  # noqa: F401
from policy_export.exporter.formats.base import ExportContext, FormatRecord  # noqa: F401
from policy_export.exporter.options import (  # noqa: F401
    ALL_FORMATS, DEFAULT_OPSET, ExportOptions, VerifyOptions, check_opset, resolve_formats,
)
from policy_export.exporter.parity.compare import tf32_tolerances  # noqa: F401
from policy_export.exporter.verify import VerifyResult, load_runner, verify_export  # noqa: F401
