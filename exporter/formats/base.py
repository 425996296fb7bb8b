"""What a format plugin declares and does (see :mod:`exporter.formats`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy_export.errors import InputError
from policy_export.exporter.declared import Option
from policy_export.exporter.defaults import DEFAULT_EXTERNAL_DATA_THRESHOLD, DEFAULT_OPSET
from policy_export.exporter.devices import DevicePlan

if TYPE_CHECKING:  # pragma: no cover
    from policy_export.exporter.formats.runner import Runner
    from policy_export.signatures.contract import Contract


@dataclass(frozen=True)
class Capabilities:
    """What a format can do; export, verify, rollouts and localisation go by these alone.

    - ``signature``: runs the policy's serving signature by key (the Keras files run the base
      model alone, so they are checked on its inputs and outputs instead);
    - ``explores``: samples actions when fed ``explore`` (exploration parity applies);
    - ``steps_state``: carries recurrent state in and out (stepped parity applies);
    - ``reference``: TensorFlow itself runs it, so fresh samples are compared against it;
    - ``onnx``: an ONNX model, localised against the frozen graph when it fails;
    - ``localises``: the TF graph ONNX models are localised against (the frozen graph; one
      format has it, :func:`exporter.formats.localisation_graph`);
    - ``needs_frozen_graph``: writing it uses the frozen graph;
    - ``default``: written when no formats are chosen;
    - ``lossy``: computes an approximation of the policy (quantised, float16), so it is held to
      behavioural thresholds (action agreement, Box error as a share of the range; see
      :mod:`exporter.parity.behaviour`) instead of value-by-value tolerances;
    - ``from_onnx``: can be written from an ONNX model alone, without TensorFlow: the export of a
      policy exported elsewhere (``export MODEL.onnx --reference REF.npz``) writes it from that
      model (:attr:`ExportContext.model_file`); the formats without it are made from the TF graph;
    - ``base_model``: writes the policy's Keras base model, so a policy without one (every source
      but a spec) cannot have it: named in ``--formats`` for such a source, it is refused before
      TensorFlow loads.
    """

    signature: bool = True
    explores: bool = True
    steps_state: bool = True
    reference: bool = False
    onnx: bool = False
    localises: bool = False
    needs_frozen_graph: bool = False
    default: bool = True
    lossy: bool = False
    from_onnx: bool = False
    base_model: bool = False


# the options of the formats that put the policy on a model server (triton, tf_serving): declared
# once here, each such format lists them; the values reach the writer through ExportContext (and
# ExportOptions checks them: a legal model name, a version of 1 or more)
SERVED_MODEL_OPTIONS = (
    Option("model_name", "the model's name on a model server (default: the policy's name, with other characters "
           "than letters, digits, _ . - made _)", None, metavar="NAME"),
    Option("model_version", "the model version directory of the layout (default 1)", 1, type=int, metavar="N"),
)


class Format:
    """One export format. Subclasses set ``name``, ``path``, ``order``, ``capabilities`` and
    implement :meth:`write` and :meth:`open`; the rest has defaults that suit most formats."""

    name: str = ""
    path: str = ""  # inside the export: a file, or a directory for SavedModels
    order: int = 100  # position in export order
    capabilities: Capabilities = Capabilities()
    is_directory: bool = False
    # ``verify --candidate NAME=PATH`` also where the export did not write this format: its runner
    # needs nothing from the export's own file of it (the contract and the parity plan suffice)
    candidate_without_export: bool = False
    # the modules writing or running the format imports, and the extra that installs them
    requires: tuple[str, ...] = ()
    extra: str | None = None
    # the options the format owns (declared once; several formats may share one declaration):
    # ``export --help`` lists them in a group of their owners, and giving one with none of its
    # owners chosen is refused
    options: tuple[Option, ...] = ()

    def check_installed(self) -> None:
        """Raises InputError naming the extra when a module the format needs is not installed."""
        if self.requires:
            from policy_export.exporter.compat import require

            require(self.requires, self.extra or self.name, f"format {self.name!r}")

    def skip_reason(self, policy: Any) -> str | None:
        """Why this format cannot be written for ``policy`` (it is then skipped), or ``None``."""
        return None

    def write(self, ctx: "ExportContext", target: Path) -> "FormatRecord":
        """Write the format to ``target`` (``export_root / self.path``) and describe what was written."""
        raise NotImplementedError

    def open(self, path: Path, manifest: Mapping[str, Any], device: Any) -> "Runner":
        """A :class:`~exporter.formats.runner.Runner` over the model at ``path`` (checked before any
        runtime loads it). ``manifest`` is the export's manifest (``tensor_names``, ``contract``,
        ``formats``)."""
        raise NotImplementedError(f"the {self.name} format has no runner")

    def output_keys(self, contract: "Contract", info: Mapping[str, Any] | None) -> list[str]:
        """The contract outputs this format computes (``info``: its manifest record)."""
        return list(contract.output_keys)

    def explores(self, info: Mapping[str, Any] | None) -> bool:
        """Whether this export's file of the format samples when fed ``explore`` (its capability,
        unless its manifest record says the explore path was left out)."""
        return self.capabilities.explores and (info or {}).get("explores", True) is not False

    def files(self, info: Mapping[str, Any] | None) -> set[str]:
        """Every path the format owns inside an export, by its manifest record."""
        listed = (info or {}).get("files", [])
        return {self.path, *(p for p in listed if isinstance(p, str))} if isinstance(listed, list) else {self.path}

    def check_candidate(self, path: Path) -> None:
        """Raises InputError when ``path`` cannot hold this format (a file is expected by default)."""
        kind = "directory" if self.is_directory else "file"
        ok = path.is_dir() if self.is_directory else path.is_file()
        if not ok:
            raise InputError(f"candidate {self.name}={path}: no such {kind}")

    def check_model(self, path: Path) -> None:
        """Check a model file of this format before anything but this format's own runner parses it
        (localisation reads ONNX models itself). Default: nothing to check.

        Raises:
            ExportError (or a subclass): the file is refused."""

    # ``inspect`` and ``diff`` on this format's own files (outside an export): ``inspect_order``
    # None means they do not read it alone; a ``serving_layout`` is also found one directory down
    # (a repository or ``tf_serving/`` holding one model); ``inspect_needs_tensorflow``: reading
    # its contract imports TensorFlow
    inspect_order: int | None = None
    inspect_description: str = ""  # what ``inspect`` reads of it, for help texts: "a .onnx file"
    serving_layout: bool = False
    inspect_needs_tensorflow: bool = False

    def find_model(self, path: Path) -> Path | None:
        """Where ``path`` holds a model of this format for ``inspect``/``diff`` (``path`` itself or
        a directory in it), or ``None`` when it is not this format's.

        Raises:
            ExportError: ``path`` is this format's but cannot be read as it (a layout without a version...).
        """
        return None

    def read_contract(self, found: Path, signature_key: str = "serving_default", tag: str = "serve") -> "Contract":
        """The interface the model :meth:`find_model` found serves, read from its files (nothing runs).

        Raises:
            ExportError: the files are not a valid model of the format, or fail its checks.
        """
        raise NotImplementedError(f"the {self.name} format cannot be inspected on its own")

    def reference_passes(self, policy: Any) -> int:
        """How many extra passes over the golden inputs :meth:`reference_outputs` makes on the
        session (for progress): 0 when the format checks the signature's outputs only."""
        return 0

    def reference_outputs(self, policy: Any, batched: Any) -> dict[str, Any]:
        """Golden values this format is checked on besides the signature's outputs, computed by the
        policy's session: ``batched(fn)`` runs ``fn(feeds) -> {key: array}`` over the golden inputs
        in batches (counting the rows) and concatenates its outputs."""
        return {}

    def check(self, label: str, path: Path, manifest: Mapping[str, Any], device: Any, replay: Any,
              report: Any) -> None:
        """Replay the parity plan on this format: open, run golden/exploration/stepped, close.

        ``replay`` is the :class:`exporter.parity.replay.Replay` and ``report`` the
        :class:`exporter.parity.compare.ParityReport` (not imported here: formats sit below parity)."""
        with self.open(path, manifest, device) as runner:
            for key, value in runner.device_info().items():
                report.devices.setdefault(key, value)
            replay.check_runner(label, self, runner, report)

    def __repr__(self) -> str:
        return f"<format {self.name}: {self.path}>"


def refuse_links(name: str, path: Path) -> None:
    """Raises InputError when the candidate directory ``path`` holds a link, FIFO, device or socket."""
    from policy_export.exporter.manifest import scan

    special = scan(path).special
    if special:
        rel, kind = sorted(special.items())[0]
        raise InputError(f"candidate {name}={path}: {rel} is a {kind}; a candidate directory holds regular "
                         "files and directories only (links are not followed)")


@dataclass(frozen=True)
class FormatRecord:
    """What one format writer wrote: paths relative to the export root, and format details."""

    format: str
    files: tuple[str, ...]
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExportContext:
    """Inputs to every format writer. The frozen graph is made once, on first use.

    For a policy exported elsewhere there is no policy, no signature and no graph:
    ``model_file`` is its ONNX model (passed through the ONNX door already), ``own_contract`` the
    contract read from it and ``state_pairs`` its recurrent state (input, output fed back), and
    only the formats of capability ``from_onnx`` are written."""

    policy: Any  # policy.TFPolicy
    signature: Any  # signatures.Signature
    device: DevicePlan
    opset: int = DEFAULT_OPSET
    inputs_as_nchw: bool = False
    external_data_threshold: int = DEFAULT_EXTERNAL_DATA_THRESHOLD
    model_name: str = "policy"  # what model servers call it (Triton, TF Serving): a legal name
    model_version: int = 1
    model_file: Path | None = None
    own_contract: "Contract | None" = None
    state_pairs: tuple[tuple[str, str], ...] = ()
    _frozen: Any = None
    _cache: dict = field(default_factory=dict)

    @property
    def contract(self) -> "Contract":
        """The I/O contract the formats serve: the signature's, or the model file's."""
        return self.own_contract if self.own_contract is not None else self.signature.contract

    def frozen_graph_def(self):
        """The frozen inference GraphDef holding every signature output (cached)."""
        if self._frozen is None:
            from policy_export.exporter import tfgraph

            self._frozen = tfgraph.freeze(self.policy, self.signature)
        return self._frozen

    def cached(self, key: str, make):
        """``make()``, made once per export and kept until :meth:`release` (e.g. both ONNX models
        from one conversion, which several formats share)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def release(self) -> None:
        """Drop the cached frozen graph and everything :meth:`cached` holds (their weights) once written."""
        self._frozen = None
        self._cache.clear()
