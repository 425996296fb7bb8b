"""Render parity reports: the verdict (one line per format), the full rich table, JSON, JUnit XML,
and a Markdown summary."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_export.exporter.parity.compare import OutputParity, ParityReport


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.2e}"


def _tolerance(r: OutputParity) -> str:
    return "exact" if r.exact else f"{r.atol:g}/{r.rtol:g}"


# the full table's columns (``--verbose``): at 80 columns the ones with the lowest ``keep`` are left out
PARITY_COLUMNS = (
    ("format", None, "left"), ("output", None, "left"), ("dtype", 3, "left"), ("shape", 2, "left"),
    ("max abs", None, "right"), ("mean abs", 1, "right"), ("p99 abs", 0, "right"), ("max rel", 4, "right"),
    ("atol/rtol", None, "left"), ("min atol", 5, "right"), ("result", None, "left"),
)


def parity_rows(report: ParityReport) -> list[tuple]:
    """The full table's rows: one per format and output, per exploration test group, per
    behavioural check (texts; the result as a styled Text)."""
    from rich.text import Text

    def result(passed: bool) -> Text:
        return Text("pass", style="green") if passed else Text("FAIL", style="bold red")

    rows: list[tuple] = []
    for r in report.records:
        shape = "x".join(str(d) for d in r.shape)
        rows.append((_one_line(r.format), _one_line(r.key), _one_line(r.dtype), shape, _fmt(r.max_abs_err),
                     _fmt(r.mean_abs_err), _fmt(r.p99_abs_err), _fmt(r.max_rel_err), _tolerance(r),
                     "-" if r.exact else _fmt(r.min_atol_to_pass), result(r.passed)))
    for (fmt, key), checks in _group_exploration(report).items():
        worst = min(checks, key=lambda c: c.p_value)
        rows.append((_one_line(f"{fmt} (explore)"), _one_line(key), "samples", f"{len(checks)} tests x {worst.samples}",
                     f"p {worst.p_value:.2g}", "", "", "", f"p >= {worst.threshold:.1e}", "",
                     result(all(c.passed for c in checks))))
    for c in report.behaviour:  # lossy formats: behavioural parity
        rows.append((_one_line(c.format), _one_line(c.key), c.metric, str(c.samples), _fmt(c.max_abs_err),
                     _fmt(c.mean_abs_err), _fmt(c.p99_abs_err), "", _behaviour_bound(c), _behaviour_value(c),
                     result(c.passed)))
    return rows


def parity_table(report: ParityReport, title: str | None = None, width: int = 200):
    """A rich Table with one row per format and output, fitted to ``width`` (the columns that
    matter least left out first: see :data:`PARITY_COLUMNS`). ``title`` is not drawn (the caller
    prints it above the table); kept for callers that pass one."""
    from policy_export.exporter.screen import table

    return table(_parity_columns(), parity_rows(report), width)[0]


def _parity_columns():
    from policy_export.exporter.screen import Column

    # names wrap at spaces, the output's before the format's; so do the exploration rows' bounds
    return [Column(name, keep, justify, wraps=name in ("format", "output", "atol/rtol"), narrow=int(name == "format"))
            for name, keep, justify in PARITY_COLUMNS]


VERDICT_WIDTH = 80  # the verdict's widest line when stdout is not a terminal (a pipe, a CI log)
_GROUP = re.compile(r" \((explore|recorded(?: stepped \d+)?|stepped \d+(?: vs sequences)?)\)$")


def split_label(label: str) -> tuple[str, str]:
    """A record's format label as (the format's own label, its group): ``"onnx (stepped 200)"`` ->
    ``("onnx", "stepped 200")``; the space's samples are group ``""``."""
    match = _GROUP.search(label)
    return (label[:match.start()], match.group(1)) if match else (label, "")


@dataclass(frozen=True)
class Verdict:
    """One format's line: every record of its label groups (the space's samples, explore, stepped,
    recorded) folded, shown by the worst of them, the one whose error is largest relative to its
    bound (``ratio``: above 1 fails)."""

    format: str
    output: str  # the worst record's output, with its group: "state_out_1 (stepped 200)"
    error: str  # as shown: "3.9e-07", "2 differ", "p 0.23", "agree 99.75%", "err 0.512%"
    bound: str  # "1e-05/1e-05", "exact", "p >= 2.5e-07", ">= 99.00%", "<= 2.00%"
    passed: bool  # every folded record passed (and the format ran)
    ratio: float
    checks: int  # records folded into the line


@dataclass(frozen=True)
class _Check:
    fmt: str
    output: str
    error: str
    bound: str
    passed: bool
    rank: tuple[float, float]


def _ratio(value: float, bound: float) -> float:
    """``value`` relative to ``bound`` (0 / 0 is 0; anything else over 0 is infinite)."""
    if bound > 0:
        return value / bound
    return math.inf if value > 0 else 0.0


def _problem_text(problem: str) -> str:
    for start, text in (("dtype", "dtype differs"), ("shape", "shape differs"), ("the output is missing", "missing")):
        if problem.startswith(start):
            return text
    return "NaN/inf" if "NaN" in problem else "not comparable"


def _record_check(r: OutputParity) -> _Check:
    fmt, group = split_label(r.format)
    output = f"{r.key} ({group})" if group else r.key
    if r.problem:
        return _Check(fmt, output, _problem_text(r.problem), _tolerance(r), r.passed, (math.inf, math.inf))
    if r.exact:
        error = f"{r.mismatches} differ" if r.mismatches else "0"
        return _Check(fmt, output, error, "exact", r.passed, (math.inf if r.mismatches else 0.0, 0.0))
    # the margin: the smallest atol that passes (with this rtol) against atol, then the max abs error
    rank = (_ratio(r.min_atol_to_pass, r.atol), _ratio(r.max_abs_err, r.atol))
    return _Check(fmt, output, _fmt(r.max_abs_err), _tolerance(r), r.passed, rank)


def _behaviour_check(c) -> _Check:
    fmt, group = split_label(c.format)
    output = f"{c.key} ({group})" if group else c.key
    if c.metric == "agreement":
        ratio = _ratio(1 - c.value, 1 - c.threshold)
        return _Check(fmt, output, _behaviour_value(c), _behaviour_bound(c), c.passed, (ratio, ratio))
    if c.metric == "box_error":
        ratio = _ratio(c.value, c.threshold)
        return _Check(fmt, output, _behaviour_value(c), f"<= {c.threshold:.2%}", c.passed, (ratio, ratio))
    if c.metric == "problem":
        problem = _problem_text(str(c.extra.get("problem", "")))
        return _Check(fmt, output, problem, "", c.passed, (math.inf, math.inf))
    return _Check(fmt, output, _fmt(c.max_abs_err), "recorded", c.passed, (-1.0, -1.0))  # not judged


def _checks(report: ParityReport) -> Iterator[_Check]:
    yield from (_record_check(r) for r in report.records)
    for (fmt, key), checks in _group_exploration(report).items():
        worst = min(checks, key=lambda c: c.p_value)
        ratio = _ratio(worst.threshold, worst.p_value)
        passed = all(c.passed for c in checks)
        # a p-value that passes is no error: the line shows it only when the format has nothing else
        rank = (ratio, ratio) if not passed else (-1.0, ratio)
        yield _Check(fmt, f"{key} (explore)", f"p {worst.p_value:.2g}", f"p >= {worst.threshold:.1e}", passed, rank)
    yield from (_behaviour_check(c) for c in report.behaviour)
    for label in report.errors:
        yield _Check(split_label(label)[0], "-", "not run", "", False, (math.inf, math.inf))


def verdicts(report: ParityReport) -> list[Verdict]:
    """One :class:`Verdict` per format (in the report's order): its worst record (a failed one
    first), and whether every record of the format passed."""
    by_format: dict[str, list[_Check]] = {}
    for check in _checks(report):
        by_format.setdefault(check.fmt, []).append(check)
    out = []
    for fmt, checks in by_format.items():
        worst = max(checks, key=lambda c: (not c.passed, *c.rank))
        out.append(Verdict(fmt, worst.output, worst.error, worst.bound, all(c.passed for c in checks),
                           worst.rank[0], len(checks)))
    return out


VERDICT_COLUMNS = ("format", "worst output", "error", "tolerance", "result")


def verdict_rows(report: ParityReport) -> list[tuple]:
    from rich.text import Text

    return [(_one_line(v.format), _one_line(v.output), v.error, v.bound,
             Text("pass", style="green") if v.passed else Text("FAIL", style="bold red")) for v in verdicts(report)]


def _verdict_columns():
    from policy_export.exporter.screen import Column

    # the output's name wraps first, then the format's; the error and bound at their space ("agree 99.75%")
    return [Column(name, wraps=name != "result", narrow={"format": 2, "error": 1, "tolerance": 1}.get(name, 0))
            for name in VERDICT_COLUMNS]


def verdict_table(report: ParityReport, width: int = VERDICT_WIDTH):
    """A rich Table with one line per format (see :func:`verdicts`), fitted to ``width``: a long
    name wraps at a space onto a second line, nothing is cut."""
    from policy_export.exporter.screen import table

    return table(_verdict_columns(), verdict_rows(report), width)[0]


def print_verdict(console, report: ParityReport, heading: str, verbose: bool = False) -> None:
    """``heading`` (plain text) and one line per format on ``console``; with ``verbose`` the full
    table (:func:`parity_table`) first. Everything fits the console's width (80 columns through a
    pipe): long text wraps at spaces, the full table leaves out the columns that matter least
    and says which (``parity/report.json`` holds every one)."""
    from policy_export.exporter.screen import print_table

    if verbose:
        print_table(console, heading, _parity_columns(), parity_rows(report), more="the report JSON holds every column")
    print_table(console, heading, _verdict_columns(), verdict_rows(report))


def _behaviour_value(c) -> str:
    if c.metric == "agreement":
        return f"agree {c.value:.2%}"
    if c.metric == "box_error":
        return f"err {c.value:.3%}"
    return ""


def _behaviour_bound(c) -> str:
    if c.metric == "agreement":
        return f">= {c.threshold:.2%}"
    if c.metric == "box_error":
        return f"<= {c.threshold:.2%} range"
    return "recorded"


def record_problems(report: ParityReport) -> list[str]:
    """One line per failed record whose output could not be compared value by value (dtype, shape, NaN)."""
    return [r.describe() for r in report.records if r.problem and not r.passed]


def _one_line(value: object) -> str:
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(value))


def _md(value: object) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return _one_line(value).replace("|", "\\|")


def _group_exploration(report: ParityReport) -> dict[tuple[str, str], list]:
    """Exploration checks grouped by format and action output (the table shows the worst p-value)."""
    groups: dict[tuple[str, str], list] = {}
    for c in report.exploration:
        groups.setdefault((c.format, c.key.split("[")[0]), []).append(c)
    return groups


def _md_result(r: OutputParity) -> str:
    if r.passed:
        return "pass"
    return f"FAIL: {_md(r.problem)}" if r.problem else "FAIL"


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


SIGNER_FIELDS = ("method", "key_sha256", "subject", "identity", "issuer", "certificate_sha256", "path", "files")


def signature_case(suite: str, entry: Mapping[str, Any]) -> ET.Element:
    """The ``signature`` test case of a report's ``signature`` entry (signed by export, checked by
    verify): who signed and with what as properties (``method`` key, certificate or sigstore; the
    key's sha256, or the certificate's subject, identity and issuer), a failure naming each
    problem, and the seconds it took."""
    case = ET.Element("testcase", classname=f"{suite}.signature", name="signature",
                      time=_seconds(entry.get("seconds")))
    props = ET.SubElement(case, "properties")
    for key in SIGNER_FIELDS:
        if entry.get(key) not in (None, ""):
            ET.SubElement(props, "property", name=f"signature.{key}", value=_one_line(entry[key]))
    problems = [str(p) for p in entry.get("problems") or []]
    if problems or not entry.get("passed", False):
        message = "; ".join(problems) or "the signature was not checked"
        ET.SubElement(case, "failure", message=message, type="SignatureMismatch").text = "\n".join(problems) or message
    return case


def signature_line(entry: Mapping[str, Any]) -> str:
    """The step summary's line on a signature: who signed, or why it fails."""
    if not entry.get("passed"):
        return f"signature FAILED: {_one_line('; '.join(entry.get('problems') or ['not checked']))}"
    what = {"key": f"key sha256:{entry.get('key_sha256', '')}",
            "certificate": f"certificate {entry.get('subject', '')}", "sigstore": "Sigstore"}.get(entry.get("method"), "")
    who = f" ({entry['identity']})" if entry.get("identity") else ""
    return (f"signed by {_one_line(what)}{_one_line(who)} ({entry.get('method', 'unknown')}; "
            f"{entry.get('files', 0)} files)")


def _seconds(value: Any) -> str:
    """A JUnit ``time``: seconds, to the microsecond."""
    try:
        return f"{max(float(value or 0.0), 0.0):.6f}"
    except (TypeError, ValueError):
        return "0.000000"


def junit_xml(report: ParityReport, suite: str, file_problems: Sequence[str] = (),
              signature: Mapping[str, Any] | None = None) -> str:
    """JUnit XML: one test case per format and output (plus one for the file hashes, if checked,
    and one for the signature, if signed or checked: :func:`signature_case`). Each case's ``time``
    is measured: what loading a format and running its checks took (``report.seconds``), shared
    among that format's cases; the file hashes' and the signature's own."""
    cases: list[tuple[ET.Element, str]] = []  # each case and the format label it belongs to
    for r in report.records:
        case = ET.Element("testcase", classname=f"{suite}.{r.format}", name=r.key)
        if not r.passed:
            failure = ET.SubElement(case, "failure", message=r.describe(), type="ParityMismatch")
            failure.text = r.describe()
        cases.append((case, r.format))
    for c in report.exploration:
        case = ET.Element("testcase", classname=f"{suite}.{c.format}.explore", name=c.key)
        if not c.passed:
            ET.SubElement(case, "failure", message=c.describe(), type="DistributionMismatch").text = c.describe()
        cases.append((case, c.format))
    for c in report.behaviour:
        case = ET.Element("testcase", classname=f"{suite}.{c.format}.behaviour", name=c.key)
        if not c.passed:
            ET.SubElement(case, "failure", message=c.describe(), type="BehaviourMismatch").text = c.describe()
        cases.append((case, c.format))
    for fmt, message in report.errors.items():
        case = ET.Element("testcase", classname=f"{suite}.{fmt}", name="load")
        ET.SubElement(case, "failure", message=message, type="LoadError").text = message
        cases.append((case, fmt))
    if suite.startswith("verify"):
        case = ET.Element("testcase", classname=f"{suite}.files", name="sha256")
        if file_problems:
            failure = ET.SubElement(case, "failure", message="; ".join(file_problems), type="FileMismatch")
            failure.text = "\n".join(file_problems)
        cases.append((case, "files"))
    _set_times(cases, report.seconds)
    if signature:
        cases.append((signature_case(suite, signature), "signature"))
    elements = [case for case, _ in cases]
    failures = sum(1 for c in elements if c.find("failure") is not None)
    total = sum(float(c.get("time", 0)) for c in elements)
    root = ET.Element("testsuites", tests=str(len(elements)), failures=str(failures), time=_seconds(total))
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(elements)), failures=str(failures),
                       errors="0", skipped="0", time=_seconds(total))
    props = ET.SubElement(ts, "properties")
    for key, value in report.devices.items():
        ET.SubElement(props, "property", name=f"device.{key}", value=str(value))
    ts.extend(elements)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _timed_label(label: str, seconds: Mapping[str, float]) -> str | None:
    """The measured label a case's format label belongs to: itself, or the longest measured label
    it extends ("onnx (stepped 200)" -> "onnx"; "keras_v3", a file of the format "keras" -> "keras"),
    or None."""
    if label in seconds:
        return label
    found = [k for k in seconds if any(label.startswith(k + sep) for sep in (" ", ".", "_"))]
    return max(found, key=len) if found else None


def _set_times(cases: Sequence[tuple[ET.Element, str]], seconds: Mapping[str, float]) -> None:
    """Each case's ``time``: its measured label's seconds shared evenly among that label's cases."""
    owners = [_timed_label(label, seconds) for _, label in cases]
    counts: dict[str, int] = {}
    for owner in owners:
        if owner is not None:
            counts[owner] = counts.get(owner, 0) + 1
    for (case, _), owner in zip(cases, owners):
        case.set("time", _seconds(seconds[owner] / counts[owner] if owner is not None else 0.0))


def junit_many(reports_by_suite: Mapping[str, ParityReport],
               signatures: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """JUnit XML with one test suite per report (``suite name -> report``), as :func:`junit_xml`
    writes each (``signatures``: suite name -> its ``signature`` entry)."""
    root = ET.Element("testsuites")
    tests = failures = 0
    for suite, report in reports_by_suite.items():
        one = ET.fromstring(junit_xml(report, suite, (), (signatures or {}).get(suite)).split("?>", 1)[1])
        tests, failures = tests + int(one.get("tests", 0)), failures + int(one.get("failures", 0))
        root.extend(one.findall("testsuite"))
    root.set("tests", str(tests))
    root.set("failures", str(failures))
    root.set("time", _seconds(sum(float(t.get("time", 0)) for t in root.findall("testsuite"))))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def markdown_summary(report: ParityReport, title: str, file_problems: Sequence[str] = (),
                     signature: Mapping[str, Any] | None = None) -> str:
    """A Markdown table for CI job summaries (e.g. ``$GITHUB_STEP_SUMMARY``); a line on the
    signature, if signed or checked (:func:`signature_line`)."""
    status = "passed" if report.passed and not file_problems else "FAILED"
    lines = [f"### {title}: {status}", ""]
    if signature:
        lines.append(f"- {signature_line(signature)}")
    lines += [f"- {_one_line(p)}" for p in file_problems]
    lines += [f"- {_one_line(fmt)}: {_one_line(message)}" for fmt, message in report.errors.items()]
    lines += ["", "| format | output | max abs err | mean abs err | p99 abs err | max rel err | tolerance | result |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report.records:
        lines.append(f"| {_md(r.format)} | {_md(r.key)} | {_fmt(r.max_abs_err)} | {_fmt(r.mean_abs_err)} | "
                     f"{_fmt(r.p99_abs_err)} | {_fmt(r.max_rel_err)} | {_tolerance(r)} | "
                     f"{_md_result(r)} |")
    for (fmt, key), checks in _group_exploration(report).items():
        worst = min(checks, key=lambda c: c.p_value)
        lines.append(f"| {_md(fmt)} (explore) | {_md(key)} | min p {worst.p_value:.2g} over {len(checks)} tests | | | | "
                     f"p >= {worst.threshold:.1e} | {'pass' if all(c.passed for c in checks) else 'FAIL'} |")
    for c in report.behaviour:
        lines.append(f"| {_md(c.format)} | {_md(c.key)} | {_fmt(c.max_abs_err)} | {_fmt(c.mean_abs_err)} | "
                     f"{_fmt(c.p99_abs_err)} | {_behaviour_value(c)} | {_behaviour_bound(c)} | "
                     f"{'pass' if c.passed else 'FAIL'} |")
    return "\n".join(lines) + "\n"
