"""Render parity reports: a rich table, JSON, JUnit XML, and a Markdown summary."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from policy_export.exporter.parity.compare import OutputParity, ParityReport


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.2e}"


def _tolerance(r: OutputParity) -> str:
    return "exact" if r.exact else f"{r.atol:g}/{r.rtol:g}"


def parity_table(report: ParityReport, title: str):
    """A rich Table with one row per format and output."""
    from rich.table import Table
    from rich.text import Text

    def plain(value: object) -> Text:  # user-derived text (keys, formats) is never read as markup
        return Text(_one_line(value))

    table = Table(title=title, title_justify="left")
    for column in ("format", "output", "dtype", "shape", "max abs", "mean abs", "p99 abs", "max rel", "atol/rtol",
                   "min atol", "result"):
        table.add_column(column, justify="right" if column.startswith(("max", "min", "mean", "p99")) else "left",
                         no_wrap=True)
    for r in report.records:
        result = "[green]pass[/green]" if r.passed else "[bold red]FAIL[/bold red]"
        shape = "x".join(str(d) for d in r.shape)
        table.add_row(plain(r.format), plain(r.key), plain(r.dtype), shape, _fmt(r.max_abs_err), _fmt(r.mean_abs_err),
                      _fmt(r.p99_abs_err), _fmt(r.max_rel_err), _tolerance(r),
                      "-" if r.exact else _fmt(r.min_atol_to_pass), result)
    for (fmt, key), checks in _group_exploration(report).items():
        worst = min(checks, key=lambda c: c.p_value)
        ok = all(c.passed for c in checks)
        table.add_row(plain(f"{fmt} (explore)"), plain(key), "samples", f"{len(checks)} tests x {worst.samples}",
                      f"p {worst.p_value:.2g}", "", "", "", f"p >= {worst.threshold:.1e}", "",
                      "[green]pass[/green]" if ok else "[bold red]FAIL[/bold red]")
    for c in report.behaviour:  # lossy formats: behavioural parity
        table.add_row(plain(c.format), plain(c.key), c.metric, str(c.samples), _fmt(c.max_abs_err),
                      _fmt(c.mean_abs_err), _fmt(c.p99_abs_err), "", _behaviour_bound(c), _behaviour_value(c),
                      "[green]pass[/green]" if c.passed else "[bold red]FAIL[/bold red]")
    return table


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


def junit_xml(report: ParityReport, suite: str, file_problems: Sequence[str] = ()) -> str:
    """JUnit XML: one test case per format and output (plus one for the file hashes, if checked)."""
    cases = []
    for r in report.records:
        case = ET.Element("testcase", classname=f"{suite}.{r.format}", name=r.key, time="0")
        if not r.passed:
            failure = ET.SubElement(case, "failure", message=r.describe(), type="ParityMismatch")
            failure.text = r.describe()
        cases.append(case)
    for c in report.exploration:
        case = ET.Element("testcase", classname=f"{suite}.{c.format}.explore", name=c.key, time="0")
        if not c.passed:
            ET.SubElement(case, "failure", message=c.describe(), type="DistributionMismatch").text = c.describe()
        cases.append(case)
    for c in report.behaviour:
        case = ET.Element("testcase", classname=f"{suite}.{c.format}.behaviour", name=c.key, time="0")
        if not c.passed:
            ET.SubElement(case, "failure", message=c.describe(), type="BehaviourMismatch").text = c.describe()
        cases.append(case)
    for fmt, message in report.errors.items():
        case = ET.Element("testcase", classname=f"{suite}.{fmt}", name="load", time="0")
        ET.SubElement(case, "failure", message=message, type="LoadError").text = message
        cases.append(case)
    if suite.startswith("verify"):
        case = ET.Element("testcase", classname=f"{suite}.files", name="sha256", time="0")
        if file_problems:
            failure = ET.SubElement(case, "failure", message="; ".join(file_problems), type="FileMismatch")
            failure.text = "\n".join(file_problems)
        cases.append(case)
    failures = sum(1 for c in cases if c.find("failure") is not None)
    root = ET.Element("testsuites", tests=str(len(cases)), failures=str(failures))
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)), failures=str(failures),
                       errors="0", skipped="0", time="0")
    props = ET.SubElement(ts, "properties")
    for key, value in report.devices.items():
        ET.SubElement(props, "property", name=f"device.{key}", value=str(value))
    ts.extend(cases)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def junit_many(reports_by_suite: Mapping[str, ParityReport]) -> str:
    """JUnit XML with one test suite per report (``suite name -> report``), as :func:`junit_xml` writes each."""
    root = ET.Element("testsuites")
    tests = failures = 0
    for suite, report in reports_by_suite.items():
        one = ET.fromstring(junit_xml(report, suite).split("?>", 1)[1])
        tests, failures = tests + int(one.get("tests", 0)), failures + int(one.get("failures", 0))
        root.extend(one.findall("testsuite"))
    root.set("tests", str(tests))
    root.set("failures", str(failures))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def markdown_summary(report: ParityReport, title: str, file_problems: Sequence[str] = ()) -> str:
    """A Markdown table for CI job summaries (e.g. ``$GITHUB_STEP_SUMMARY``)."""
    status = "passed" if report.passed and not file_problems else "FAILED"
    lines = [f"### {title}: {status}", ""]
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
