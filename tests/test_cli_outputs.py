"""``report`` and ``export`` (``cli/commands/outputs.py``), on a local file and on S3."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from .conftest import S3
from .support.cli import run_cli


def test_report_and_export_commands(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    done = run_cli("report", str(enriched), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert "100 call(s), 10 failed" in done.stdout
    html = (tmp_path / "r.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "upstream_error" in html
    beside = run_cli("report", str(enriched), "--json")
    assert json.loads(beside.stdout)["report"] == str(tmp_path / "bad" / "enriched.report.html")

    calls, rollouts = tmp_path / "calls.parquet", tmp_path / "rollouts.parquet"
    done = run_cli("export", str(enriched), "--calls", str(calls), "--rollouts", str(rollouts))
    assert done.returncode == 0, done.stderr
    assert pq.read_table(calls).num_rows == 100 and pq.read_table(rollouts).num_rows == 22
    assert f"wrote {calls}: 100 call row(s)" in done.stdout

    missing = run_cli("report", str(tmp_path / "absent.jsonl"))
    assert missing.returncode == 2 and "enriched file not found" in missing.stderr
    neither = run_cli("export", str(enriched))
    assert neither.returncode == 2 and "name --calls, --rollouts or both" in neither.stderr
    bad = tmp_path / "bad.jsonl"
    call = {"latency_total_ms": "slow"}
    bad.write_bytes(orjson.dumps({"ng_model_call_capture": {"rollout_id": "x", "calls": [call]}}) + b"\n")
    broken = run_cli("report", str(bad))
    assert broken.returncode == 2 and f"{bad}:1:" in broken.stderr and "latency_total_ms" in broken.stderr


def test_report_and_export_read_an_output_on_s3(s3: S3, tmp_path: Path) -> None:
    """Where S3 runs write their output: read from the URL, the report written here by default."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    s3.fs().put_file(str(enriched), f"{s3.bucket}/runs/r1/rollouts.enriched.jsonl")
    url, options = (
        s3.url("runs/r1/rollouts.enriched.jsonl"),
        ["--storage-options", json.dumps(s3.storage_options)],
    )
    here = tmp_path / "here"
    here.mkdir()
    done = run_cli("report", url, *options, "--json", cwd=here)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["report"] == "rollouts.enriched.report.html"
    assert (here / "rollouts.enriched.report.html").read_text().startswith("<!DOCTYPE html>")
    calls = tmp_path / "calls.parquet"
    exported = run_cli("export", url, *options, "--calls", str(calls))
    assert exported.returncode == 0 and pq.read_table(calls).num_rows == 100, exported.stderr
    missing = run_cli("report", s3.url("runs/absent.jsonl"), *options)
    assert missing.returncode == 2 and "enriched file not found: s3://" in missing.stderr, missing.stderr


def test_a_bad_enriched_file_on_s3_is_named_by_its_url(s3: S3, tmp_path: Path) -> None:
    """``report`` and ``export`` read a URL through a temporary copy: an error names the URL."""
    pytest.importorskip("pyarrow")
    call = {"latency_total_ms": "slow"}
    line = orjson.dumps({"ng_model_call_capture": {"rollout_id": "x", "calls": [call]}}) + b"\n"
    s3.fs().pipe_file(f"{s3.bucket}/runs/r1/bad.enriched.jsonl", line)
    url, options = s3.url("runs/r1/bad.enriched.jsonl"), ["--storage-options", json.dumps(s3.storage_options)]
    report = ["report", url, "-o", str(tmp_path / "r.html")]
    for command in (report, ["export", url, "--calls", str(tmp_path / "c.parquet")]):
        broken = run_cli(*command, *options)
        assert broken.returncode == 2 and f"{url}:1:" in broken.stderr, broken.stderr
        assert "rollout-capture-" not in broken.stderr  # the temporary copy's folder
