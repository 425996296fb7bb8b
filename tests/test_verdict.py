"""The verdict ``export`` and ``verify`` print: one line per format, its worst output against its
bound, that fits 80 and 120 columns with nothing cut; ``--verbose`` adds the full table."""

from __future__ import annotations

import io
import json
import math
import re

import pytest

from conftest import FIXTURES_DIR
from helpers import cli, messages

# the groups a format's records are labelled with besides the space's samples
GROUP = re.compile(r" \((explore|recorded|stepped \d+|stepped \d+ vs sequences)\)$")
QUICK = ("--samples", "50", "--explore-samples", "200", "-q")
CASES = {"mlp": ("cartpole_mlp", ["onnx", "onnx_int8"]), "lstm": ("cartpole_lstm", ["onnx", "onnx_int8", "keras"])}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(case)`` -> the ExportResult of an export of CASES[case] (on CPU, few samples)."""
    from policy_export.exporter import export_spec

    base, cache = tmp_path_factory.mktemp("verdict"), {}

    def get(case: str):
        if case not in cache:
            fixture, formats = CASES[case]
            cache[case] = export_spec(FIXTURES_DIR / fixture, base / case, device="cpu", formats=formats,
                                      samples=50, explore_samples=200)
        return cache[case]

    return get


@pytest.fixture(scope="module")
def reports(exported):
    """``reports(case)`` -> the ParityReport of ``exported(case)``."""
    return lambda case: exported(case).parity


def render(renderable, width: int) -> list[str]:
    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text().splitlines()


def own_format(label: str) -> str:
    return GROUP.sub("", label)


def formats_of(report) -> list[str]:
    labels = [r.format for r in report.records] + [c.format for c in report.exploration + report.behaviour]
    return list(dict.fromkeys(own_format(label) for label in labels))


def rows(lines: list[str]) -> list[str]:
    """The table's rows: the lines after the header's rule."""
    (rule,) = [i for i, line in enumerate(lines) if set(line.strip()) == {"─"}]
    return lines[rule + 1:]


def worst_shown(report, fmt: str) -> tuple[str, str]:
    """(output, error as printed) of the check of ``fmt`` with the least margin to its bound: float
    records by the atol they need against their atol (then their max abs error against it), an
    agreement by the share of differing actions against the share allowed, exploration by the
    threshold against the p-value."""
    candidates = []
    for r in report.records:
        if own_format(r.format) == fmt and r.exact:
            candidates.append(((math.inf if r.mismatches else 0.0, 0.0), r.key, f"{r.mismatches} differ"
                               if r.mismatches else "0"))
        elif own_format(r.format) == fmt:
            need = (r.min_atol_to_pass / r.atol, r.max_abs_err / r.atol)
            candidates.append((need, r.key, f"{r.max_abs_err:.2e}" if r.max_abs_err else "0"))
    for c in report.behaviour:
        if own_format(c.format) == fmt and c.metric == "agreement":
            share = (1 - c.value) / (1 - c.threshold)
            candidates.append(((share, share), c.key, f"agree {c.value:.2%}"))
    for c in report.exploration:
        if c.format == fmt:
            share = c.threshold / c.p_value
            candidates.append(((share, share), c.key.split("[")[0], f"p {c.p_value:.2g}"))
    _, key, shown = max(candidates, key=lambda c: c[0])
    return key, shown


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("case", list(CASES))
def test_one_line_per_format_fits_the_width_with_nothing_cut(reports, case, width):
    from policy_export.exporter.reports import verdict_table

    report = reports(case)
    assert report.passed
    lines = render(verdict_table(report), width)
    assert all(len(line) <= width for line in lines), lines
    assert "…" not in "\n".join(lines)
    assert lines[0].split() == ["format", "worst", "output", "error", "tolerance", "result"]
    body = rows(lines)
    assert [line.split()[0] for line in body] == formats_of(report)  # one line each, in the report's order
    assert all(line.split()[-1] == "pass" for line in body)
    if case == "lstm":  # the recurrent groups are folded into their format's line
        assert len(formats_of(report)) < len({r.format for r in report.records} | {c.format for c in report.behaviour})


@pytest.mark.parametrize("case", list(CASES))
def test_each_line_shows_its_formats_worst_error(reports, case):
    from policy_export.exporter.reports import verdict_table

    report = reports(case)
    for line in rows(render(verdict_table(report), 80)):
        fmt = line.split()[0]
        key, shown = worst_shown(report, fmt)
        assert line.split()[1] == key and f" {shown} " in line, (line, key, shown)


def test_a_narrow_console_wraps_at_spaces_and_cuts_nothing(reports):
    """Narrower than the verdict's narrowest layout (48 columns), the table keeps every name whole
    (it is then wider than the console: a name is never cut to fit)."""
    from rich.console import Console

    from policy_export.exporter.reports import print_verdict

    console = Console(width=48, file=io.StringIO(), record=True)
    print_verdict(console, reports("lstm"), "parity")
    lines = console.export_text().splitlines()
    words = {w for line in lines for w in line.split()}
    assert set(formats_of(reports("lstm"))) <= words and "…" not in "\n".join(lines)
    assert sum(line.split()[-1] == "pass" for line in lines if line.split()) == len(formats_of(reports("lstm")))
    assert all(len(line) <= 72 for line in lines) and not any(line.endswith(" ") for line in lines)


def test_a_failed_format_is_failed_on_its_line(tmp_path):
    from policy_export.errors import ParityFailedError
    from policy_export.exporter import export_spec
    from policy_export.exporter.parity.compare import Tolerance, Tolerances
    from policy_export.exporter.reports import verdict_table, verdicts

    with pytest.raises(ParityFailedError) as failed:
        export_spec(FIXTURES_DIR / "cartpole_mlp", tmp_path / "o", device="cpu", formats=["onnx", "onnx_int8"],
                    samples=50, explore_samples=0, tolerances=Tolerances(Tolerance(1e-9, 0.0)))
    report = failed.value.report
    shown = {v.format: v for v in verdicts(report)}
    failing = {r.key for r in report.records if r.format == "onnx" and not r.passed}
    assert not shown["onnx"].passed and shown["onnx"].output in failing and shown["onnx"].ratio > 1
    assert f"onnx/{shown['onnx'].output}" in str(failed.value)  # the error line names it too
    assert shown["onnx_int8"].passed
    lines = {line.split()[0]: line.split()[-1] for line in rows(render(verdict_table(report), 80))}
    assert lines == {"onnx": "FAIL", "onnx_int8": "pass"}


def test_ratios_of_each_kind_of_check():
    from policy_export.exporter.parity.behaviour import BehaviourCheck
    from policy_export.exporter.parity.compare import OutputParity, ParityReport
    from policy_export.exporter.parity.exploration import ExplorationCheck
    from policy_export.exporter.reports import split_label, verdicts

    def record(label, key, need, passed=True, exact=False, mismatches=0):
        return OutputParity(label, key, "float32", (4,), exact, need * 2, 0.0, 1e-5, 1e-5, mismatches, need, passed)

    report = ParityReport("session", 4, 0, {}, records=[
        record("onnx", "a", 5e-6), record("onnx (stepped 200)", "state_out_0", 8e-6),
        record("onnx (recorded)", "b", 1e-6), record("tflite", "actions_0", 0.0, False, True, 3)],
        exploration=[ExplorationCheck("onnx", "actions_0[obs 1]", "ks", 0.1, 1e-3, 1e-4, 50, 0.0, 0.0, True)],
        behaviour=[BehaviourCheck("onnx_int8", "actions_0", "agreement", 0.995, 0.99, True, 200),
                   BehaviourCheck("onnx_int8 (stepped 200)", "actions_0", "agreement", 0.9925, 0.99, True, 800),
                   BehaviourCheck("onnx_fp16", "actions_0", "box_error", 0.03, 0.02, False, 200),
                   BehaviourCheck("onnx_fp16", "state_out_0", "error", 0.5, None, True, 200, 9.0)],
        errors={"keras": "cannot load"})
    shown = {v.format: v for v in verdicts(report)}
    assert list(shown) == ["onnx", "tflite", "onnx_int8", "onnx_fp16", "keras"]
    assert (shown["onnx"].output, shown["onnx"].error, shown["onnx"].passed) == ("state_out_0 (stepped 200)",
                                                                               "1.60e-05", True)
    assert math.isclose(shown["onnx"].ratio, 0.8) and shown["onnx"].checks == 4
    assert (shown["tflite"].error, shown["tflite"].bound, shown["tflite"].passed) == ("3 differ", "exact", False)
    assert shown["onnx_int8"].output == "actions_0 (stepped 200)" and shown["onnx_int8"].error == "agree 99.25%"
    assert (shown["onnx_fp16"].error, shown["onnx_fp16"].bound, shown["onnx_fp16"].passed) == ("err 3.000%",
                                                                                             "<= 2.00%", False)
    assert (shown["keras"].error, shown["keras"].passed) == ("not run", False)
    assert split_label("onnx vs saved_model (recorded)") == ("onnx vs saved_model", "recorded")
    assert split_label("onnx (stepped 200 vs sequences)") == ("onnx", "stepped 200 vs sequences")


def test_export_through_a_pipe_prints_80_columns_and_the_full_table_when_verbose(tmp_path):
    args = ("export", str(FIXTURES_DIR / "cartpole_mlp"), "--formats", "onnx,onnx_int8", *QUICK)
    short = cli(*args, "--out", "o", cwd=tmp_path, narrow=True)  # a process whose stdout is a pipe
    assert short.returncode == 0, short.stderr
    lines, out = short.stdout.splitlines(), tmp_path / "o"
    # every line fits, but those naming the export: a path is kept whole (copied from the log)
    assert all(len(line) <= 80 for line in lines if str(out) not in line), short.stdout
    assert "…" not in short.stdout and "┏" not in short.stdout and "max abs" not in short.stdout
    assert lines[0].startswith("parity: 50 samples vs the TF session (")
    assert [line.split()[0] for line in rows(lines)[:2]] == ["onnx", "onnx_int8"]
    assert "full table: --verbose, or o/parity/report.json" in lines  # the path as typed
    stored = json.loads((tmp_path / "o" / "parity" / "report.json").read_text())
    assert {r["format"] for r in stored["records"]} >= {"onnx", "onnx (explore)"}

    full = cli(*args, "--out", "v", "--verbose", cwd=tmp_path, narrow=True)
    assert full.returncode == 0, full.stderr
    assert "max abs" in full.stdout and "onnx (explore)" in full.stdout
    assert all(len(line) <= 80 for line in full.stdout.splitlines())  # the full table too, its columns chosen
    assert "left out: " in full.stdout  # ... and the columns left out at 80 named
    assert "full table:" not in full.stdout and "worst output" in full.stdout


def test_verify_prints_the_verdict_and_names_the_report(exported, tmp_path):
    out = exported("mlp").path
    done = cli("verify", str(out), "-q", narrow=True)
    assert done.returncode == 0, done.stderr
    verdict = rows(done.stdout.split("plan: ")[0].splitlines())
    assert [line.split()[0] for line in verdict] == ["onnx", "onnx_int8"]
    assert all(len(line) <= 80 for line in verdict) and "max abs" not in done.stdout
    assert "full table: --verbose, or --report-json FILE" in done.stdout
    report = tmp_path / "verify.json"
    done = cli("verify", str(out), "-q", "--verbose", "--report-json", str(report), narrow=True)
    assert done.returncode == 0 and "max abs" in done.stdout and "full table:" not in done.stdout
    assert messages(done.stdout)[-1].startswith(f"verified {out}")
