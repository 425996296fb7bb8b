"""One report over many policies: JSON, JUnit (a test suite per policy, a test case per format and
output), a Markdown summary, and a terminal table."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

SHOWN_FAILURES = 3


def summary(results: Sequence[Mapping[str, Any]], seconds: float) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    failed = [r["name"] for r in results if r["status"] not in ("passed", "skipped")]
    return {"policies": len(results), "counts": counts, "failed": failed, "seconds": round(seconds, 3),
            "passed": not failed}


def to_json(results: Sequence[Mapping[str, Any]], seconds: float, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The report as JSON: the summary and each policy's result (its JUnit text left out)."""
    return {**dict(extra), "summary": summary(results, seconds),
            "policies": [{k: v for k, v in r.items() if k not in ("junit", "traceback")} for r in results]}


def _suite_of(result: Mapping[str, Any]) -> ET.Element:
    """The policy's test suite: its own JUnit cases where it ran, else one case saying what
    happened; and a ``signature`` case where its export was signed or its signature checked."""
    suite = None
    text = result.get("junit")
    if isinstance(text, str):
        suite = ET.fromstring(text).find("testsuite")  # written by this package's worker
    if suite is not None:
        suite.set("name", result["name"])
    else:
        suite = ET.Element("testsuite", name=result["name"])
        _case(suite, result, "skipped" if result["status"] == "skipped" else "run")
    if result.get("signature"):
        from policy_export.exporter.reports import signature_case

        suite.append(signature_case(result["name"], result["signature"]))
    if result["status"] not in ("passed", "skipped") and result.get("failures") \
            and not suite.findall("testcase/failure"):
        _case(suite, result, "run")
    # the policy's whole time: its process (the export or verify) and, for export-many, its signing
    seconds = float(result.get("seconds") or 0) + float((result.get("signature") or {}).get("seconds") or 0) \
        if result.get("kind") != "verify" else float(result.get("seconds") or 0)
    suite.set("time", f"{seconds:.6f}")
    return suite


def _case(suite: ET.Element, result: Mapping[str, Any], name: str) -> None:
    case = ET.SubElement(suite, "testcase", classname=f"{result['name']}.policy", name=name,
                         time=f"{float(result.get('seconds') or 0):.6f}")
    if result["status"] == "skipped":
        ET.SubElement(case, "skipped", message=str(result.get("note", "current")))
    elif result["status"] != "passed":
        message = "; ".join(result.get("failures") or [result["status"]])
        ET.SubElement(case, "failure", message=message, type=result["status"]).text = message


def junit(results: Sequence[Mapping[str, Any]]) -> str:
    root = ET.Element("testsuites")
    tests = failures = 0
    for result in results:
        suite = _suite_of(result)
        cases = suite.findall("testcase")
        failed = sum(1 for c in cases if c.find("failure") is not None)
        suite.set("tests", str(len(cases)))
        suite.set("failures", str(failed))
        suite.set("skipped", str(sum(1 for c in cases if c.find("skipped") is not None)))
        tests, failures = tests + len(cases), failures + failed
        root.append(suite)
    root.set("tests", str(tests))
    root.set("failures", str(failures))
    root.set("time", f"{sum(float(t.get('time', 0)) for t in root.findall('testsuite')):.6f}")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _err(value: Any) -> str:
    return "-" if value is None else f"{value:.2e}"


def _mem(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}"


def _what(result: Mapping[str, Any]) -> str:
    failures = result.get("failures") or []
    shown = "; ".join(str(f) for f in failures[:SHOWN_FAILURES])
    return shown + (f" (+{len(failures) - SHOWN_FAILURES} more)" if len(failures) > SHOWN_FAILURES else "")


def rows(results: Sequence[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """Per policy: name, status, seconds, peak MiB, largest parity error, what failed."""
    return [(r["name"], r["status"], f"{r.get('seconds') or 0:.1f}", _mem(r.get("peak_rss_mb")),
             _err(r.get("max_error")), _what(r)) for r in results]


HEADERS = ("policy", "status", "time s", "peak MiB", "max parity err", "what failed")


def markdown(results: Sequence[Mapping[str, Any]], title: str, seconds: float) -> str:
    s = summary(results, seconds)
    status = "passed" if s["passed"] else f"FAILED ({', '.join(s['failed'])})"
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items()))
    lines = [f"### {title}: {status}", "", f"{s['policies']} policies ({counts}) in {seconds:.1f} s", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows(results)]
    signed = [r for r in results if r.get("signature")]
    if signed:
        from policy_export.exporter.reports import signature_line

        lines += [""] + [f"- {r['name']}: {signature_line(r['signature'])}" for r in signed]
    return "\n".join(lines) + "\n"


def table(results: Sequence[Mapping[str, Any]], title: str, width: int = 200):
    """The terminal table at ``width`` (see :func:`print_report`, which prints it fitted)."""
    from policy_export.exporter.screen import table as fitted

    return fitted(_columns(), [row[:-1] for row in rows(results)], width)[0]


def _columns():
    from policy_export.exporter.screen import Column

    return [Column("policy"), Column("status"), Column("time s", keep=3, justify="right", wraps=False),
            Column("peak MiB", keep=1, justify="right", wraps=False),
            Column("max parity err", keep=2, justify="right", wraps=False)]


def print_report(console, results: Sequence[Mapping[str, Any]], title: str) -> None:
    """``title``, one row per policy fitted to the console's width (policy, status, time, peak
    memory, largest parity error), then what failed, one note per failed policy wrapped at the
    width, and whose signatures were checked or made."""
    from policy_export.exporter.screen import note, print_table, say

    print_table(console, title, _columns(), [row[:-1] for row in rows(results)], more="--report-json")
    for r in results:
        if r["status"] not in ("passed", "skipped") and r.get("failures"):
            note(console, f"{r['name']} {r['status']}", _what(r))
    signed = [r for r in results if r.get("signature")]
    if signed:
        good = [r for r in signed if r["signature"].get("passed")]
        signers = sorted({str(r["signature"].get("signer") or "") for r in good} - {""})
        by = f" (signed by {'; '.join(signers)})" if signers else ""
        if signed[0].get("kind") == "verify":
            say(console, f"signatures checked: {len(good)} of {len(signed)} match{by}")
        else:
            say(console, f"signed: {len(good)} of {len(signed)} exports{by}")


def write(path, text: str) -> None:
    from pathlib import Path

    Path(path).write_text(text, encoding="utf-8")


def dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"
