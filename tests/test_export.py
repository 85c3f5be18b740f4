"""The Parquet export and the report read an enriched file, and refuse what they cannot read
truthfully (issue 27): a line carrying an attachment that is not JSON, a count that is not whole
or does not fit its column, a file with no attachment at all; each by file, line and field,
exit 2 on the command line. The corpus is test_report's hand-built one, enriched by the real merge.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from rollout_capture.cli.app import app
from rollout_capture.summary import EvidenceShapeError, summarize_file

from .test_report import build_corpus


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, Path]:
    return build_corpus(tmp_path / "bad")


def test_export_tables_read_back_with_pyarrow(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from rollout_capture.export import calls_schema, export_tables, rollouts_schema

    _, enriched = corpus
    calls_path, rollouts_path = tmp_path / "calls.parquet", tmp_path / "rollouts.parquet"
    counts = export_tables(enriched, calls_path, rollouts_path)
    assert (counts.calls, counts.rollouts, counts.lines_skipped) == (100, 22, 2)

    calls = pq.read_table(calls_path)
    rollouts = pq.read_table(rollouts_path)
    assert calls.schema.equals(calls_schema()) and rollouts.schema.equals(rollouts_schema())
    assert calls.num_rows == 100 and rollouts.num_rows == 22

    summary = summarize_file(enriched)[0]
    per_model = calls.group_by("model").aggregate(
        [
            ("model", "count"),
            ("failed", "sum"),
            ("tokens_in", "sum"),
            ("tokens_out", "sum"),
            ("tokens_total", "sum"),
        ]
    )
    got = {
        row["model"]: (
            row["model_count"],
            row["failed_sum"],
            row["tokens_in_sum"],
            row["tokens_out_sum"],
            row["tokens_total_sum"],
        )
        for row in per_model.to_pylist()
    }
    assert got == {
        name: (m.calls, m.failed_calls, m.tokens_in, m.tokens_out, m.tokens_total)
        for name, m in summary.models.items()
    }
    by_category = calls.group_by("error_category").aggregate([("error_category", "count")]).to_pylist()
    assert {r["error_category"]: r["error_category_count"] for r in by_category if r["error_category"]} == (
        summary.calls_by_error_category
    )
    owned = calls.filter(pa.compute.is_valid(calls["owner_invocation_id"])).to_pylist()
    assert [(r["rollout_id"], r["owner_invocation_id"], r["call_index"]) for r in owned] == [
        ("r-5", "inv-1", 0)
    ]

    by_id = {r["rollout_id"]: r for r in rollouts.to_pylist()}
    assert by_id["r-3"]["gap_codes"] == ["model_call_capture_incomplete"]
    assert by_id["r-5"]["observation_gap_codes"] == ["model_call_ownership_unavailable"]
    assert by_id["24-1-a1"]["num_calls"] == 0 and by_id["24-1-a1"]["tokens_total"] is None
    assert by_id["r-1"]["failed_calls"] == 1 and by_id["r-1"]["reward"] == 1.0
    assert pa.compute.sum(rollouts["num_calls"]).as_py() == summary.calls


def test_a_malformed_line_stops_the_export_and_leaves_no_table(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow")
    from rollout_capture.export import export_tables

    _, enriched = corpus
    bad = tmp_path / "bad.jsonl"
    lines = enriched.read_bytes().splitlines(keepends=True)
    record = orjson.loads(lines[2])
    record["ng_model_call_capture"]["calls"][1]["status_code"] = "500"
    bad.write_bytes(b"".join([*lines[:2], orjson.dumps(record) + b"\n", *lines[3:]]))
    out = tmp_path / "out"
    with pytest.raises(
        EvidenceShapeError, match=r"bad\.jsonl:3: ng_model_call_capture\.calls\[1\]\.status_code"
    ):
        export_tables(bad, out / "calls.parquet", out / "rollouts.parquet")
    assert list(out.iterdir()) == []  # neither table, nor a temporary file


def test_export_without_pyarrow_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from rollout_capture.export import export_tables, ExportUnavailable\n"
        "try:\n    export_tables('x.jsonl', 'c.parquet')\n"
        "except ExportUnavailable as exc:\n    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert "pip install 'rollout-capture[export]'" in out.stdout


def test_completed_at_is_the_calls_own_end(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    """Each call's ``completed_at`` is its own (call i ends (i + 1) / 100 s after it started)."""
    pq = pytest.importorskip("pyarrow.parquet")
    from rollout_capture.export import export_tables

    export_tables(corpus[1], tmp_path / "calls.parquet")
    rows = pq.read_table(tmp_path / "calls.parquet").to_pylist()
    took = {
        (r["rollout_id"], r["call_index"]): (r["completed_at"] - r["started_at"]).total_seconds()
        for r in rows
    }
    assert took[("r-0", 0)] == pytest.approx(0.01) and took[("r-19", 4)] == pytest.approx(1.0)
    assert all(seconds > 0 for seconds in took.values())


def test_who_answered_each_call_is_exported_and_unknown_stays_null(tmp_path: Path) -> None:
    """NeMo Gym 0.7's execution facts (issue 34): a local answer, a forwarded one, and a call of a
    producer that says neither, whose four columns stay null, never false or 0."""
    pq = pytest.importorskip("pyarrow.parquet")
    from rollout_capture.export import export_tables

    facts = [
        {
            "upstream_attempted": True,
            "response_source": "local",
            "local_response_reason": "context_length_exceeded",
        },
        {"upstream_attempted": True, "response_source": "upstream", "upstream_status_code": 429},
        {},
    ]
    calls = [{"call_index": i, "status_code": 200, **fact} for i, fact in enumerate(facts)]
    enriched = tmp_path / "e.jsonl"
    enriched.write_bytes(
        orjson.dumps({"ng_model_call_capture": {"rollout_id": "x", "metrics": {}, "calls": calls}}) + b"\n"
    )
    export_tables(enriched, tmp_path / "calls.parquet")
    names = ("upstream_attempted", "response_source", "upstream_status_code", "local_response_reason")
    got = [tuple(r[n] for n in names) for r in pq.read_table(tmp_path / "calls.parquet").to_pylist()]
    assert got == [
        (True, "local", None, "context_length_exceeded"),
        (True, "upstream", 429, None),
        (None, None, None, None),
    ]


def _line(call: dict[str, Any]) -> bytes:
    """A line carrying one call, as any writer may put it (json: integers of any size)."""
    attachment = {"rollout_id": "x", "metrics": {}, "calls": [call]}
    return json.dumps({"ng_model_call_capture": attachment}).encode()


MALFORMED = {
    "nan reward": (b'{"reward": NaN, "ng_model_call_capture": {"rollout_id": "x", "calls": []}}', "reward"),
    "lone surrogate": (b'{"ng_model_call_capture": {"rollout_id": "\\ud800", "calls": []}}', "rollout_id"),
    "torn": (b'{"ng_model_call_capture": {"rollout_id": "x", "calls": [{"tokens_in": 3', "tokens_in"),
    "huge tokens": (_line({"tokens_in": 10**30}), r"calls\[0\]\.tokens_in: 1e\+30 does not fit"),
    "fractional tokens": (_line({"tokens_out": 3.7}), r"calls\[0\]\.tokens_out: expected a whole number"),
    "huge status": (_line({"status_code": 2**40}), r"calls\[0\]\.status_code: .* does not fit a 32-bit"),
    "time past the column": (_line({"started_at": 1e300}), r"calls\[0\]\.started_at: .* is not a time"),
    "attempted not a flag": (
        _line({"upstream_attempted": "yes"}),
        r"calls\[0\]\.upstream_attempted: expected true, false or null",
    ),
}


EXPORT_ONLY = {"huge status", "time past the column", "attempted not a flag"}
"""Fields the report does not read (a status of 2^40 is a status class; no time is shown)."""


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_line_is_refused_naming_file_line_and_field(
    corpus: tuple[Path, Path], tmp_path: Path, case: str
) -> None:
    """The line's calls never vanish as "without an attachment", nor are cut (3.7 -> 3) or
    overflow: export and report both stop, naming file, line and field."""
    pytest.importorskip("pyarrow")
    from rollout_capture.export import export_tables

    line, field = MALFORMED[case]
    lines = corpus[1].read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join([*lines[:3], line + b"\n", *lines[3:]]))
    out = tmp_path / "out"
    expected = rf"bad\.jsonl:4: .*{field}"
    with pytest.raises(EvidenceShapeError, match=expected):
        export_tables(bad, out / "calls.parquet", out / "rollouts.parquet")
    assert not out.exists() or list(out.iterdir()) == []  # neither table, nor a temporary file
    commands = [["export", str(bad), "--calls", str(out / "c.parquet")]]
    if case not in EXPORT_ONLY:  # the report reads that field too
        with pytest.raises(EvidenceShapeError, match=expected):
            summarize_file(bad)
        commands.append(["report", str(bad)])
    for command in commands:
        done = CliRunner().invoke(app, command)
        assert done.exit_code == 2 and f"{bad}:4:" in done.output, done.output
        assert "Traceback" not in done.output


def test_a_passed_through_line_without_an_attachment_is_skipped_and_counted(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    """Enrichment passes a line that is not JSON through as it came: it held no calls."""
    pytest.importorskip("pyarrow")
    from rollout_capture.export import export_tables

    counts = export_tables(corpus[1], tmp_path / "calls.parquet")
    assert (counts.calls, counts.lines_skipped) == (100, 2)  # "<not json>" and the record without an id


def test_a_file_without_any_attachment_is_refused_by_report_and_export(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    plain = tmp_path / "rollouts.jsonl"  # the input, not the enriched output
    plain.write_bytes(b'{"_ng_rollout_id": "r-1", "reward": 1.0}\n<not json>\n')
    for command in (
        ["report", str(plain), "-o", str(tmp_path / "r.html")],
        ["export", str(plain), "--calls", str(tmp_path / "c.parquet")],
    ):
        done = CliRunner().invoke(app, command)
        assert done.exit_code == 2, done.output
        assert f"{plain}: no line carries an ng_model_call_capture attachment" in done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl"]  # nothing written


def test_the_report_command_says_the_tokens_and_what_it_skipped(
    corpus: tuple[Path, Path], tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow")
    done = CliRunner().invoke(app, ["report", str(corpus[1]), "-o", str(tmp_path / "r.html")])
    assert done.exit_code == 0 and "100 call(s), 10 failed, 3 with gaps, 15,400 tokens" in done.output
    done = CliRunner().invoke(app, ["export", str(corpus[1]), "--calls", str(tmp_path / "c.parquet")])
    assert done.exit_code == 0 and "2 line(s) without a capture attachment skipped" in done.output
