"""Run an OpenVINO IR by signature key on the CPU, at a pinned inference precision.

Before OpenVINO reads anything, the directory is checked: it holds ``model.xml`` and ``model.bin``
and nothing else, each a regular file (no symbolic link) within its size limit, read once here
and handed to OpenVINO as bytes (what was checked is what is loaded). The XML is refused if it
declares a DOCTYPE or an ENTITY (found by a byte scan before anything parses it), or does not
start as an IR ``<net>`` document.

The model is compiled with ``INFERENCE_PRECISION_HINT`` set explicitly (``f32`` for ``openvino``:
OpenVINO's CPU plugin otherwise computes in bfloat16 on CPUs with BF16 support);
:meth:`OpenVinoRunner.device_info` reports the precision the compiled model says is in force, and
whether a requested ``bf16`` fell back to ``f32`` on a CPU without BF16.

Optional inputs left out are fed the contract's defaults (OpenVINO inputs have none); contract
inputs the IR does not take may be fed their defaults only.
"""

from __future__ import annotations

import os
import re
import stat
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policy_export.errors import ExportError, InputError
from policy_export.exporter.formats.openvino.names import BIN_NAME, XML_NAME
from policy_export.exporter.formats.runner import Runner, TensorMeta, with_defaults
from policy_export.policy.files import read_regular
from policy_export.signatures.contract import Contract

MAX_XML_BYTES = 16 << 20
MAX_BIN_BYTES = 1 << 30
IR_ALLOWANCE = 16 << 20  # bytes one tensor may take beyond the IR's weights
MAX_ERROR_TEXT = 2000
_DECLARATIONS = re.compile(rb"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)
_START = re.compile(rb"^(\xef\xbb\xbf)?\s*(<\?xml[^>]*\?>\s*)?(<!--.*?-->\s*)*<net[\s>]", re.DOTALL)


def read_ir(path: Path) -> tuple[bytes, bytes]:
    """The bytes of ``model.xml`` and ``model.bin`` in the IR directory ``path``, checked.

    Raises:
        ExportError: not a directory (or a symbolic link), another file in it, a file missing, not
            regular or over its limit, or XML that declares a DOCTYPE/ENTITY or is not an IR.
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise ExportError(f"{path} is not an OpenVINO IR directory (a directory, not a symbolic link)")
    names = sorted(p.name for p in path.iterdir())
    extra = [n for n in names if n not in (XML_NAME, BIN_NAME)]
    if extra:
        raise ExportError(f"{path} holds {extra} beside {XML_NAME} and {BIN_NAME}; refusing to load it")
    missing = [n for n in (XML_NAME, BIN_NAME) if n not in names]
    if missing:
        raise ExportError(f"{path} has no {', '.join(missing)}")
    try:
        xml = read_regular(path / XML_NAME, MAX_XML_BYTES)
    except OSError as e:  # a symbolic link (ELOOP), a file that cannot be opened
        raise ExportError(f"{path}: cannot read the IR files without following links: {e}") from e
    if _DECLARATIONS.search(xml):
        raise ExportError(f"{path / XML_NAME} declares a DOCTYPE or ENTITY; an OpenVINO IR has none: refusing to parse it")
    if not _START.match(xml[:4096]):
        raise ExportError(f"{path / XML_NAME} is not an OpenVINO IR (no <net> element at its start)")
    needed = _constants_end(xml, path / XML_NAME)
    try:
        info = os.lstat(path / BIN_NAME)
        if stat.S_ISREG(info.st_mode) and info.st_size != needed:
            raise ExportError(f"{path / BIN_NAME} holds {info.st_size} bytes; the constants of {XML_NAME} take "
                              f"{needed}: refusing to load it")
        weights = read_regular(path / BIN_NAME, needed)
    except OSError as e:
        raise ExportError(f"{path}: cannot read the IR files without following links: {e}") from e
    if len(weights) != needed:
        raise ExportError(f"{path / BIN_NAME} holds {len(weights)} bytes; the constants of {XML_NAME} take "
                          f"{needed}: refusing to load it")
    return xml, weights


def _constants_end(xml: bytes, where: Path) -> int:
    """The end of the last weight range the IR's layers take in ``model.bin`` (checked to lie
    within the limit). The XML has no DOCTYPE (checked first), so the parser expands nothing."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        raise ExportError(f"{where} is not well-formed XML: {e}") from e
    end = 0
    for layer in root.iter("layer"):  # If/Loop bodies included
        data = layer.find("data")
        if data is None or (data.get("offset") is None and data.get("size") is None):
            continue
        try:
            offset, size = int(data.get("offset")), int(data.get("size"))
        except (TypeError, ValueError) as e:
            raise ExportError(f"{where}: layer {layer.get('name', '')[:100]!r} has no integer offset/size") from e
        if offset < 0 or size < 0 or offset + size > MAX_BIN_BYTES:
            raise ExportError(f"{where}: layer {layer.get('name', '')[:100]!r} takes weight bytes "
                              f"{offset}..{offset + size}, outside 0..{MAX_BIN_BYTES}")
        end = max(end, offset + size)
    return end


def _bodies(op) -> list:
    kind = op.get_type_name()
    if kind == "If":
        return [op.get_then_body(), op.get_else_body()]
    return [op.get_function(0)] if kind in ("Loop", "TensorIterator") else []


def check_ir_budget(model, weights: int, label: str) -> None:
    """Refuse an IR whose ops make a tensor of fixed shape larger than its weights and an allowance
    (a few bytes of weights folded into a huge constant when compiled).

    Raises:
        ExportError: naming the op and the size.
    """
    budget, stack = weights + IR_ALLOWANCE, [model]
    while stack:
        for op in stack.pop().get_ordered_ops():
            stack.extend(_bodies(op))
            for out in op.outputs():
                shape = out.get_partial_shape()
                if shape.rank.is_dynamic:
                    continue
                n = 1
                for d in shape:
                    n *= d.get_length() if d.is_static else 1
                nbytes = n * out.get_element_type().size
                if nbytes > budget:
                    raise ExportError(f"{label}: op {op.get_friendly_name()[:100]!r} ({op.get_type_name()}) makes a "
                                      f"{nbytes}-byte tensor, over the {budget}-byte budget of an IR with {weights} "
                                      "bytes of weights: refusing to compile it")


def _clipped(error: Exception) -> str:
    text = str(error)
    return text if len(text) <= MAX_ERROR_TEXT else f"{text[:MAX_ERROR_TEXT]}... ({len(text) - MAX_ERROR_TEXT} more characters)"


def cpu_supports_bf16(core) -> bool:
    """Whether OpenVINO's CPU plugin lists ``BF16`` among its optimisation capabilities."""
    return "BF16" in [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def precision_name(value: Any) -> str:
    """An OpenVINO element type (or its string) as ``f32``/``bf16``/``f16``."""
    text = str(getattr(value, "get_type_name", lambda: value)())
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(text, text)


def _meta(key: str, port) -> TensorMeta:
    shape = port.get_partial_shape()
    dims = None
    if shape.rank.is_static:
        dims = tuple(d.get_length() if d.is_static else None for d in shape)
    return TensorMeta(key, np.dtype(port.get_element_type().to_dtype()).name, dims)


def _port_name(port, keys: set[str]) -> str:
    """The port's contract key where one of its tensor names is one (a graph input whose first op
    OpenVINO folded away keeps that op's output name too), else any of its names."""
    names = sorted(port.get_names() & keys)
    return names[0] if names else port.get_any_name()


class OpenVinoRunner(Runner):
    """An OpenVINO compiled model (CPU) over one IR directory, run by signature key."""

    def __init__(self, path: Path, contract: Contract | None = None, precision: str = "f32", threads: int | None = 1):
        import openvino as ov

        xml, weights = read_ir(path)
        self.label = f"OpenVINO model {path}"
        self.contract = contract
        self.requested = precision
        core = ov.Core()
        self.bf16_supported = cpu_supports_bf16(core)
        config = {"INFERENCE_PRECISION_HINT": precision}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        try:
            model = core.read_model(xml, weights)
            size = len(weights)
            del xml, weights
        except Exception as e:  # OpenVINO raises RuntimeError and its own types on a bad model
            raise ExportError(f"{self.label} does not load: {type(e).__name__}: {_clipped(e)}") from e
        check_ir_budget(model, size, self.label)
        try:
            self.compiled = core.compile_model(model, "CPU", config)
        except Exception as e:  # noqa: BLE001
            raise ExportError(f"{self.label} does not load: {type(e).__name__}: {_clipped(e)}") from e
        self.precision = precision_name(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        self.version = ov.__version__
        self.request = self.compiled.create_infer_request()
        keys = set(contract.input_keys + contract.output_keys) if contract is not None else set()
        self._names = {p: _port_name(p, keys) for p in (*self.compiled.inputs, *self.compiled.outputs)}
        self.inputs = {self._names[p]: _meta(self._names[p], p) for p in self.compiled.inputs}
        self.outputs = {self._names[p]: _meta(self._names[p], p) for p in self.compiled.outputs}
        specs = contract.inputs if contract is not None else ()
        self.defaults = {s.key: np.asarray(s.default, np.dtype(s.dtype)) for s in specs if not s.required}
        self.accepted = frozenset(s.key for s in specs if s.key not in self.inputs)

    def _feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        for key in self.accepted & feeds.keys():
            default = self.defaults.get(key)
            if default is None or not np.array_equal(feeds[key], default):
                raise InputError(f"{self.label} does not take input {key!r}; it may be fed only its default")
        return with_defaults(self.label, self.inputs, feeds, self.defaults)

    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = self._feeds(feeds)
        request = self.request
        # at the run limit or on a signal the request is cancelled (OpenVINO stops between kernels)
        results = self.stoppable(lambda: request.infer(arrays), request.cancel)
        return {self._names[port]: np.array(results[port], copy=True) for port in self.compiled.outputs}

    def device_info(self) -> dict[str, Any]:
        """The OpenVINO version and the precision in force (keys named by the precision asked
        for, so that both IR formats of one report keep their own)."""
        prefix = "openvino" if self.requested == "f32" else f"openvino_{self.requested}"
        info = {"openvino": self.version, f"{prefix}_inference_precision": self.precision}
        if self.requested == "bf16" and self.precision != "bf16":
            info[f"{prefix}_precision_fallback"] = (f"bf16 requested, {self.precision} in force: the CPU has "
                                                    f"{'no ' if not self.bf16_supported else ''}BF16 support")
        return info

    def _close(self) -> None:
        self.request = None
        self.compiled = None
