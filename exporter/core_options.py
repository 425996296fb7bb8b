"""The core's options, declared once (:class:`~exporter.declared.Option`): every flag of every
command that is neither a source's nor a format's, with the keyword of the Python API where it
has one, its type, default, rule and help.

From these declarations come the command line's flags and ``--help`` (:mod:`exporter.cli_args`),
the checks :class:`~exporter.options.ExportOptions`, :class:`~exporter.options.VerifyOptions`
and :class:`~exporter.options.RolloutOptions` run on their fields (a declaration's ``rule``), the
keys a league file may set (``league=True``) and the docs' synopsis. A declaration with
``cli=False`` is a keyword of the Python API only (and of league files); one whose name is no
field of the options it is listed with is a flag the command turns into a field (``--atol``,
``--rtol``, ``--tolerance`` and ``--allow-non-finite`` make ``tolerances``).

No TensorFlow: the command line's ``--help`` imports it.
"""

from __future__ import annotations

import math
from os import PathLike
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policy_export.errors import InputError
from policy_export.exporter import defaults as D
from policy_export.exporter import formats as registry
from policy_export.exporter.declared import Option
from policy_export.exporter.watchdog import check_run_timeout
from policy_export.policy.spaces import MAX_SAMPLES

MAX_SEED = 2**31 - 1
SUPPORTED_OPSETS = range(13, 22)


# ----------------------------------------------------------------------------- rules

def check_count(name: str, value: Any, least: int, most: int | None = None) -> int:
    """``value`` as an integer option of at least ``least`` (and at most ``most``).

    Raises:
        InputError: naming the option as the API and the command line spell it.
    """
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} ({flag}) must be an integer, got {value!r}")
    if value < least:
        raise InputError(f"{name} ({flag}) must be at least {least}, got {value}")
    if most is not None and value > most:
        raise InputError(f"{name} ({flag}) {value} exceeds the limit of {most}")
    return value


def check_opset(opset: int) -> None:
    """Raises InputError for an opset outside :data:`SUPPORTED_OPSETS`."""
    if opset not in SUPPORTED_OPSETS:
        raise InputError(f"opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}")


def check_pin(digest: str | None) -> str | None:
    """An expected manifest sha256 (64 hex digits) in lower case, or ``None``."""
    if digest is None:
        return None
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdefABCDEF" for c in digest)):
        raise InputError(f"expected manifest sha256 must be 64 hexadecimal digits, got {digest!r}")
    return digest.lower()


def resolve_formats(formats: Sequence[str] | None) -> tuple[str, ...]:
    """Validate a format list (``None`` means the default formats) and put it in export order.

    Raises:
        InputError: an empty list, an unknown format, or one whose library is not installed (the
            extra to install named).
    """
    if formats is None:
        return registry.default_names()
    if isinstance(formats, str) or not formats:
        raise InputError("formats (--formats) is empty or not a list; name at least one format, or leave it out "
                         "for the defaults")
    known = registry.names()
    unknown = [f for f in formats if f not in known]
    if unknown:
        raise InputError(f"unknown format(s) {unknown}: choose from {', '.join(known)}{did_you_mean(unknown, known)}")
    for name in formats:  # a format whose library is not installed: the extra that brings it
        registry.get(name).check_installed()
    return tuple(f for f in known if f in formats)


def did_you_mean(unknown: Sequence[str], known: Sequence[str]) -> str:
    """``"; did you mean X?"`` for the closest known name of each unknown one (difflib), or ``""``."""
    import difflib

    close = [m[0] for u in unknown if isinstance(u, str) for m in [difflib.get_close_matches(u, known, 1, 0.6)] if m]
    return f"; did you mean {', '.join(dict.fromkeys(close))}?" if close else ""


def _env_id(value: Any, option: Option) -> str:
    """A gymnasium environment id that is registered (checked before TensorFlow loads)."""
    import gymnasium as gym

    if not isinstance(value, str) or not value:
        raise InputError(f"env (--env) must be a gymnasium environment id, got {value!r:.80}")
    if ":" not in value and value not in gym.registry:  # "module:Env-v0" is registered by importing module
        hint = did_you_mean([value], list(gym.registry))
        raise InputError(f"env (--env) {value!r:.80} is not a registered gymnasium environment{hint} (an environment "
                         "of your own must be registered, e.g. by importing its package, before the command runs)")
    return value


def _counted(least: int, most: int | None = None) -> Callable[[Any, Option], int]:
    return lambda value, option: check_count(option.name, value, least, most)


def _optional(rule: Callable[[Any, Option], Any]) -> Callable[[Any, Option], Any]:
    return lambda value, option: None if value is None else rule(value, option)


def _opset(value: Any, option: Option) -> int:
    check_count(option.name, value, 0)
    check_opset(value)
    return value


def _tolerances(value: Any, option: Option) -> Any:
    from policy_export.exporter.parity.compare import Tolerances

    if value is not None and not isinstance(value, Tolerances):
        raise InputError(f"tolerances must be a Tolerances, got {type(value).__name__}")
    return value


def _server(value: str | None, option: Option) -> str | None:
    if value not in (None, "triton"):
        raise InputError(f"server {value!r} is not one of: triton")
    if value is not None:
        from policy_export.exporter.compat import require

        require(("pytriton", "tritonclient"), "serve", f"verify --server {value}")
    return value


def _return_tolerance(value: Any, option: Option) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InputError(f"return_tolerance (--return-tolerance) must be a finite number >= 0, got {value!r}")
    return value


def _rollout_formats(value: Sequence[str] | None, option: Option) -> Sequence[str] | None:
    if value is not None and (isinstance(value, str) or not value):
        raise InputError("formats (--formats): give two or more formats, e.g. saved_model,onnx, or leave it out "
                         "for saved_model,onnx")
    return value


def _timeout(value: Any, option: Option) -> float | None:
    return check_run_timeout(value)


# ----------------------------------------------------------------------------- declarations

def _rollout_formats_help() -> str:
    playable = [f.name for f in registry.with_capability("signature")]  # what runs the policy's signature
    also = ", ".join(n for n in playable if n not in D.DEFAULT_ROLLOUT_FORMATS)
    return ("comma-separated formats that play, the first is the reference unless it is lossy (the float "
            f"SavedModel is then the reference) (default {','.join(D.DEFAULT_ROLLOUT_FORMATS)}; also {also})")


def _formats_help() -> str:
    default = registry.default_names()
    return (f"comma-separated formats (e.g. saved_model,onnx): of {', '.join(default)} (the default), and the "
            f"opt-in {', '.join(n for n in registry.names() if n not in default)}")


def _lossy_help() -> str:
    lossy = ", ".join(f.name for f in registry.with_capability("lossy"))
    return (f"threshold of a lossy format ({lossy}; without FORMAT: all): min_agreement (default 0.99) or "
            "max_box_error (default 0.02); repeatable")


FORMATS = Option("formats", _formats_help(), metavar="LIST", rule=lambda v, o: resolve_formats(v), league=True,
                 api_type=list)
OPSET = Option("opset", f"ONNX opset (default {D.DEFAULT_OPSET})", D.DEFAULT_OPSET, type=int, metavar="N",
               rule=_opset, league=True)
SEED = Option("seed", f"seed of the parity samples (default {D.EXPORT_SEED})", D.EXPORT_SEED, type=int, metavar="S",
              rule=_counted(0, MAX_SEED), league=True)
OVERWRITE = Option("overwrite", "replace an existing export at OUT", False, kind="flag")
INPUTS_AS_NCHW = Option("inputs_as_nchw", "ONNX model takes rank-4 image inputs as NCHW (other inputs keep their "
                        "layout)", False, kind="flag", league=True)
EXPLORE_SAMPLES = Option("explore_samples", "sampled actions per runtime for exploration parity (default 10000; "
                         "0 skips)", D.DEFAULT_EXPLORE_SAMPLES, type=int, metavar="N",
                         rule=_counted(0, MAX_SAMPLES), league=True)
EXTERNAL_DATA_THRESHOLD = Option(
    "external_data_threshold", "ONNX models whose weights exceed this many bytes keep them in a .data file beside "
    f"the model (default {D.DEFAULT_EXTERNAL_DATA_THRESHOLD}; one protobuf stops at 2 GiB)",
    D.DEFAULT_EXTERNAL_DATA_THRESHOLD, type=int, metavar="BYTES", rule=_counted(0))
SAMPLES = Option("samples", f"observations sampled for parity (default {D.DEFAULT_SAMPLES})", D.DEFAULT_SAMPLES,
                 type=int, metavar="N", rule=_counted(1, MAX_SAMPLES), league=True)
BATCH_SIZE = Option("batch_size", "rows per runtime call during parity", D.DEFAULT_BATCH, type=int,
                    rule=_counted(1), cli=False, league=True)
STEPPED_STEPS = Option("stepped_steps", "consecutive steps of stepped parity (recurrent policies)", D.DEFAULT_STEPS,
                       type=int, rule=_counted(0, MAX_SAMPLES), cli=False, league=True)
def _reference(value: Any, option: Option) -> Any:
    from policy_export.exporter.recorded.reference import check_reference

    return None if value is None else str(check_reference(value))


def _pairs(value: Any, option: Option) -> dict[str, str]:
    """``NAME=NAME`` items (or a mapping) as a mapping, each name given once."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = []
        for item in value:
            left, sep, right = str(item).partition("=")
            if not sep or not left or not right:
                raise InputError(f"{option.flag} {str(item)[:80]!r}: expected {option.metavar}")
            items.append((left, right))
    else:
        raise InputError(f"{option.name} ({option.flag}) must be a list of {option.metavar} or a mapping")
    out: dict[str, str] = {}
    for left, right in items:
        if not isinstance(left, str) or not isinstance(right, str) or left in out:
            raise InputError(f"{option.flag} {str(left)[:80]!r}: named twice, or not a name")
        out[left] = right
    return out


REFERENCE = (
    Option("reference", "a recording of what the training framework computed (an .npz of arrays named as the ONNX "
           "graph's inputs and outputs, one row per step; episode_ids for a recurrent policy), to check "
           "MODEL.onnx against", None, metavar="FILE", rule=_reference, path=True),
    Option("reference_names", "a recorded array's name in the graph, where they differ; repeatable", (),
           kind="list", metavar="RECORDED=GRAPH", rule=_optional(_pairs), flag_name="--reference-name", api_type=(list, dict)),
    Option("reference_state_pairs", "a recurrent graph's state: the input fed back from this output (default: the k-th input "
           "the recording does not hold from the k-th output it does not hold); repeatable", (), kind="list",
           metavar="IN=OUT", rule=_optional(_pairs), flag_name="--state-pair", api_type=(list, dict)),
)


def _contract_file(value: Any, option: Option) -> Any:
    if value is not None and (not isinstance(value, (str, PathLike)) or not str(value)):
        raise InputError(f"{option.name} ({option.flag}) must be a file's path")
    return None if value is None else str(value)  # read (strictly, bounded) with the model, before anything runs


CONTRACT_FILE = Option("contract_file", "MODEL.onnx's contract file: the gymnasium space of a graph input or output, "
                       "and which outputs are actions (JSON; optional)", None, metavar="FILE", rule=_contract_file,
                       flag_name="--contract", path=True)


def _observations(value: Any, option: Option) -> Any:
    from policy_export.exporter.recorded import check_paths

    return check_paths(value)


OBSERVATIONS = Option("observations", "recorded observations to check every format on, besides the space's "
                      "samples: .npy, .npz (arrays named as the policy's inputs), RLlib's offline .json or .parquet; "
                      "repeatable; up to --samples rows are kept (a fixed sub-sample of larger files)", None,
                      kind="list", metavar="FILE", rule=_observations, league=True, api_type=list, path=True)
TOLERANCES = Option("tolerances", "a Tolerances (the command line makes it from --atol, --rtol, --tolerance and "
                    "--allow-non-finite)", rule=_tolerances, cli=False)
ATOL = Option("atol", f"default absolute tolerance ({D.DEFAULT_ATOL:g})", type=float, metavar="X")
RTOL = Option("rtol", f"default relative tolerance ({D.DEFAULT_RTOL:g})", type=float, metavar="X")
TOLERANCE = Option("tolerance", "tolerance for one output; repeatable", (), kind="list", metavar="KEY=ATOL[:RTOL]")
ALLOW_NON_FINITE = Option("allow_non_finite", "output that may hold NaN or infinity (matching the reference's); "
                          "repeatable", (), kind="list", metavar="KEY")
DEVICE = Option("device", "where TF and ONNX Runtime run (default auto: the GPU where one is visible)", "auto",
                kind="choice", choices=("auto", "cpu", "gpu"))
ALLOW_TF32 = Option("allow_tf32", "let GPUs compute float32 matmuls in TF32 (off by default, in TF and ONNX Runtime "
                    "alike); the default tolerance then becomes at least 1e-2", False, kind="flag")
BEHAVIOUR = Option("behaviour", _lossy_help(), (), kind="list", metavar="[FORMAT:]NAME=VALUE")
REPORT_JSON = Option("report_json", "write the parity report as JSON to F", metavar="F")
JUNIT = Option("junit", "write JUnit XML (one test case per format and output) to F", metavar="F")
RUN_TIMEOUT = Option("run_timeout", "longest one call into a runtime (ONNX Runtime, TF, TFLite, Keras) may take "
                     "before it is stopped and fails the check, exit 1 (default 600)", type=float, metavar="SECONDS",
                     rule=_timeout)
ALLOW_PARTIAL = Option("allow_partial", "exit 0 when some formats could not be made (they are listed, and recorded "
                       "under 'missing' in the manifest); by default that is exit 4, so that CI requires every format",
                       False, kind="flag")
QUIET = Option("quiet", "no progress on stderr (by default each stage is shown with its elapsed time: a live display "
               "on a terminal, one line per stage otherwise)", False, kind="flag", short="-q")
VERBOSE = Option("verbose", "print the full parity table (a row per format and output: every error statistic and "
                 "tolerance) besides the line per format", False, kind="flag")

# signed exports (the signing extra, exporter.signing): the signature goes beside the export, OUT.sig by default
# --signature-file: --signature is the SavedModel signature key of export's and inspect's sources
SIGNATURE = Option("signature_file", "the export's signature (default OUT.sig beside the export, else OUT/model.sig; "
                   "inside the export only a .sig file at its top, as model_signing keeps it)",
                   metavar="PATH")
CERTIFICATE_CHAIN = Option("certificate_chain", "certificate chain (PEM) of a certificate signature; repeatable",
                           (), kind="list", metavar="PEM")
# a league entry sets none of them: one run signs with one key (checked, and its password read, once
# before anything runs, in the driver), and signing changes no export, so it is no part of a job
SIGNER = (
    Option("sign_key", "sign the export with this elliptic-curve private key (PEM; the signing extra)",
           metavar="KEY"),
    Option("sign_key_password_env", "the name of an environment variable holding the password of an encrypted "
           "--sign-key (never the password itself; without it a terminal asks, elsewhere an encrypted key is "
           "refused)", metavar="VAR"),
    Option("signing_certificate", "with --sign-key: sign with this certificate (PEM) of the key instead",
           metavar="PEM"),
    CERTIFICATE_CHAIN,
    Option("sign_keyless", "sign through Sigstore's OIDC flow instead of a key (needs the network)", False,
           kind="flag"),
)
SIGN = (*SIGNER, SIGNATURE)
SIGNATURE_CHECKER = (
    Option("public_key", "check the export's signature (OUT.sig, or --signature-file) with this public key (PEM; the "
           "signing extra)", metavar="KEY"),
    CERTIFICATE_CHAIN,
    Option("identity", "check a keyless signature: the signer's identity (e.g. name@example.com; needs the network)",
           metavar="IDENTITY"),
    Option("identity_issuer", "check a keyless signature: the identity's OIDC issuer", metavar="URL"),
)
SIGNATURE_CHECK = (*SIGNATURE_CHECKER, SIGNATURE)

PARITY = (ATOL, RTOL, TOLERANCE, ALLOW_NON_FINITE, DEVICE, ALLOW_TF32, BEHAVIOUR, REPORT_JSON, JUNIT)
EXPORT = (FORMATS, OPSET, SEED, OVERWRITE, INPUTS_AS_NCHW, EXPLORE_SAMPLES, EXTERNAL_DATA_THRESHOLD, SAMPLES,
          OBSERVATIONS, TOLERANCES, BATCH_SIZE, STEPPED_STEPS, *PARITY, RUN_TIMEOUT, ALLOW_PARTIAL, QUIET, VERBOSE,
          *SIGN, *REFERENCE, CONTRACT_FILE)

VERIFY = (
    Option("seed", f"seed of fresh samples (default {D.VERIFY_SEED})", D.VERIFY_SEED, type=int, metavar="S",
           rule=_counted(0, MAX_SEED)),
    Option("expect_manifest_sha256", "fail unless manifest.json has this sha256 (pin the digest kept outside the "
           "export)", metavar="HEX", rule=lambda v, o: check_pin(v)),
    Option("localize", "name the first intermediate tensor where each ONNX model leaves the frozen graph", False,
           kind="flag"),
    Option("candidate", "check a model file transformed downstream (e.g. onnx=model.opt.onnx) against the export's "
           "stored parity plan instead of the export's own formats; repeatable", (), kind="list",
           metavar="FORMAT=PATH"),
    Option("server", "also serve the export with a real Triton server (the serve extra) on free ports of 127.0.0.1 "
           "and check it through Triton's HTTP and gRPC clients, a row per protocol", kind="choice",
           choices=("triton",), rule=_server),
    Option("samples", "observations sampled for parity (default 0: golden inputs only)", 0, type=int, metavar="N",
           rule=_counted(0, MAX_SAMPLES)),
    Option("observations", "recorded observations to check every format on against the SavedModel (besides the "
           "rows the export stored): .npy, .npz, RLlib's offline .json or .parquet; repeatable; up to 1000 rows "
           "kept per run (a fixed sub-sample of larger files)", None, kind="list", metavar="FILE", rule=_observations,
           path=True),
    Option("batch_size", "rows per runtime call during parity", D.DEFAULT_BATCH, type=int, rule=_counted(1),
           cli=False),
    *REFERENCE, TOLERANCES, *PARITY, RUN_TIMEOUT, QUIET, VERBOSE, *SIGNATURE_CHECK)

SERVE = (
    Option("port", f"HTTP port (default {D.SERVE_HTTP_PORT})", D.SERVE_HTTP_PORT, type=int, metavar="N"),
    Option("grpc_port", f"gRPC port (default {D.SERVE_GRPC_PORT})", D.SERVE_GRPC_PORT, type=int, metavar="N"),
    Option("host", "address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)", "127.0.0.1",
           metavar="ADDRESS"),
    Option("model_name", "for an export without the triton format, the name of the repository serve writes (the "
           "sampling model is NAME_explore; default the policy's name); an export's own triton/ is served as written",
           None, metavar="NAME"),
)

JSON = Option("json", "print JSON instead of a table", False, kind="flag")
INSPECT = (Option("signature", "SavedModel signature", "serving_default", metavar="KEY"),
           Option("tag", "SavedModel tag", "serve", metavar="TAG"), JSON)
DIFF = (Option("json", "print JSON instead of a summary", False, kind="flag"),)
DOCS = (Option("write", "write every page and example, with the fixtures the examples run on, to DIR (new or empty), "
               "laid out as the repository is: the README's links work there", metavar="DIR"),)

ROLLOUT_ENV = Option("env", "gymnasium environment id, e.g. CartPole-v1", metavar="ENV_ID", required=True, rule=_env_id)
ROLLOUT = (
    ROLLOUT_ENV,
    Option("episodes", f"episodes (default {D.DEFAULT_EPISODES})", D.DEFAULT_EPISODES, type=int, metavar="N",
           rule=_counted(1, MAX_SAMPLES)),
    Option("seed", "seed of the first episode (default 0)", 0, type=int, metavar="S", rule=_counted(0, MAX_SEED)),
    Option("device", "where TF and ONNX Runtime run (default auto)", "auto", kind="choice",
           choices=("auto", "cpu", "gpu")),
    ALLOW_TF32,
    Option("report_json", "write the rollout report as JSON to F", metavar="F"),
    Option("formats", _rollout_formats_help(), metavar="LIST", rule=_rollout_formats),
    Option("return_tolerance", "lossy formats: largest relative difference of the mean return from the reference's "
           f"(default {D.DEFAULT_RETURN_TOLERANCE})", D.DEFAULT_RETURN_TOLERANCE, type=float, metavar="X",
           rule=_return_tolerance),
    Option("max_steps", "most steps of one episode (default: the environment's own limit)", type=int, metavar="N",
           rule=_optional(_counted(1)), cli=False),
    RUN_TIMEOUT,
)

MANY = (
    Option("jobs", "policies at a time on this machine, each in a process of its own (default: the number of cores)",
           type=int, metavar="N"),
    Option("ray", "run each policy as a Ray task on a running cluster instead ('auto': the cluster this machine is "
           "part of); needs the ray extra", metavar="auto|ADDRESS"),
    Option("memory_mb", "memory cap per policy: a local process over it is killed and its policy fails; on Ray, the "
           "memory each task reserves", type=float, metavar="MB"),
    Option("policy_timeout", "wall-clock time each policy's process may take before it is killed and its policy "
           "fails (default 1800)", type=float, metavar="SECONDS"),
    Option("preload", "start each local process from scratch (it imports TensorFlow itself) instead of forking it "
           "from a process that imported TensorFlow, ONNX Runtime and tf2onnx once", True, kind="flag",
           flag_name="--no-preload"),
    Option("samples", "observations sampled for parity per policy (default: export's and verify's own)", type=int,
           metavar="N"),
    Option("seed", "seed of the parity samples (default: export's and verify's own)", type=int, metavar="S"),
    Option("report_json", "write the report over every policy as JSON", metavar="F"),
    Option("junit", "JUnit XML: a test suite per policy, a test case per format and output", metavar="F"),
    Option("quiet", "no progress lines on stderr", False, kind="flag", short="-q"),
)
EXPORT_MANY = (
    Option("out", "the root: each policy's export goes into ROOT/<name>/", metavar="ROOT", required=True),
    FORMATS,
    Option("explore_samples", "sampled actions per runtime for exploration parity (default 10000; 0 skips)",
           type=int, metavar="N"),
    Option("force", "export every policy again, also those whose export is current", False, kind="flag"),
    *MANY,
    *SIGNER,  # each export signed beside it, ROOT/<name>.sig (one --signature-file cannot name them all)
)
VERIFY_MANY = (*MANY, *SIGNATURE_CHECKER)  # each export's signature: ROOT/<name>.sig


def add(parser: Any, options: Sequence[Option]) -> None:
    """Each declaration of ``options`` made for the command line (not the API-only ones) as a flag
    of ``parser``, its default kept (a command reads every flag)."""
    for option in options:
        if option.cli:
            option.add_to(parser, keep_default=True)


def format_options() -> tuple[Option, ...]:
    """Every option a format declares (each once: triton and tf_serving share theirs)."""
    found: dict[int, Option] = {}
    for fmt in registry.all_formats():
        for option in fmt.options:
            found.setdefault(id(option), option)
    return tuple(found.values())


def from_parsed(cls: type, args: Any, options: Sequence[Option], **made: Any) -> Any:
    """An options object of ``cls`` (``ExportOptions``, ``VerifyOptions``, ``RolloutOptions``) made
    from the parsed command line ``args``: every declaration of ``options`` that is a field of
    ``cls`` takes its flag's value, then ``made`` adds (or replaces) the fields the command line
    makes from several flags or converts (``tolerances`` from ``--atol``, ``--rtol``, ...). A
    declared flag is never copied by hand, so none can be forgotten; the declarations that are no
    field are what the command itself consumes (:data:`exporter.commands.CONSUMED`)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    values = {o.name: getattr(args, o.name) for o in options if o.cli and o.name in fields and hasattr(args, o.name)}
    return cls(**{**values, **made})


def rules(options: Sequence[Option], fields: Sequence[str]) -> dict[str, Callable[[Any], Any]]:
    """The rules of the declarations of ``options`` that are ``fields`` of an options class, in
    the declarations' order: field -> the function that checks a value and returns it as kept."""
    return {o.name: (lambda value, o=o: o.rule(value, o)) for o in options if o.rule is not None and o.name in fields}


def league() -> dict[str, type | tuple[type, ...]]:
    """The keys of the core's options a league entry may set -> their JSON type."""
    return {o.name: o.api_type or o.python_type for o in EXPORT if o.league}
