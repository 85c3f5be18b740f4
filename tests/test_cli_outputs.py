"""``report`` and ``export`` (``cli/commands/outputs.py``), on a local file and on S3."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from .conftest import S3
from .support.cli import cli_env, run_at_terminal, run_cli
from .support.otlp_receiver import OtlpReceiver


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


# ---------------------------------------------------------------------- traces (issue 30)

OTLP_SECRET = "sk-cli-0123456789-never-echoed"
ENV_SECRET = "sk-env-9876543210-never-echoed"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    pytest.importorskip("opentelemetry.sdk.trace")
    server = OtlpReceiver()
    try:
        yield server
    finally:
        server.stop()


def _expected_spans(enriched: Path) -> tuple[int, int, int]:
    """``(rollouts, calls, spans)`` as the mapping says (docs/contract.md section 13): a root per
    rollout with an attachment, a span per call, per verifier invocation, per agent invocation."""
    rollouts = calls = spans = 0
    for line in enriched.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        attachment = record.get("ng_model_call_capture") if isinstance(record, dict) else None
        if not isinstance(attachment, dict):
            continue
        observations = record.get("ng_agent_observations") or {}
        invocations = {i["invocation_id"] for i in observations.get("invocations") or []}
        invocations |= {
            r["invocation_id"]
            for r in observations.get("records") or []
            if r.get("kind") == "agent_invocation"
        }
        rollouts += 1
        calls += len(attachment["calls"])
        spans += (
            1
            + len(attachment["calls"])
            + len(attachment.get("verifier_invocations") or [])
            + len(invocations)
        )
    return rollouts, calls, spans


def _unechoed(done: subprocess.CompletedProcess[str]) -> None:
    for secret in (OTLP_SECRET, ENV_SECRET):
        assert secret not in done.stdout and secret not in done.stderr, (done.stdout, done.stderr)


def test_export_sends_every_rollout_as_a_trace_with_the_headers_never_echoed(
    receiver: OtlpReceiver, tmp_path: Path
) -> None:
    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    rollouts, calls, spans = _expected_spans(enriched)
    env = cli_env(ROLLOUT_CAPTURE_OTLP_HEADERS=f"x-env-key={ENV_SECRET}")
    args = ["export", str(enriched), "--otlp", receiver.url, "--otlp-header", f"api_key: {OTLP_SECRET}"]
    done = run_cli(*args, env=env)
    assert done.returncode == 0, done.stderr
    _unechoed(done)
    assert len(receiver.spans()) == spans and spans > rollouts + calls - 1
    # one line, as the flows' summaries say it; the run: the file's own location
    assert (
        f"traces: {rollouts} rollout(s), {calls} call(s) sent as {spans} span(s) in 1 batch(es) to "
        f"{receiver.url}/v1/traces (the default project, run {enriched})\n" in done.stdout
    )
    assert "\x1b[" not in done.stderr  # no progress bar: stderr is not a terminal
    for request in receiver.received:
        assert request.path == "/v1/traces"
        assert request.headers["api_key"] == OTLP_SECRET and request.headers["x-env-key"] == ENV_SECRET

    as_json = run_cli(
        *args, "--otlp-project", "p1", "--otlp-run-name", "exp 7", "--include-payloads", "--json", env=env
    )
    assert as_json.returncode == 0, as_json.stderr
    _unechoed(as_json)
    traces = json.loads(as_json.stdout)["traces"]
    assert traces == {
        "endpoint": f"{receiver.url}/v1/traces",
        "rollouts": rollouts,
        "calls": calls,
        "spans": spans,
        "batches": 1,
        "lines_skipped": traces["lines_skipped"],
        "project": "p1",
        "run": "exp 7",
        "calls_cut": 0,
    }


def test_export_refuses_bad_trace_input_before_anything_is_sent(
    receiver: OtlpReceiver, tmp_path: Path
) -> None:
    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    calls = tmp_path / "calls.parquet"
    unreachable = run_cli(
        "export", str(enriched), "--calls", str(calls), "--otlp", "http://127.0.0.1:9",
        "--otlp-header", f"api_key: {OTLP_SECRET}",
    )  # fmt: skip
    assert unreachable.returncode == 2, unreachable.stderr
    assert "OTLP endpoint http://127.0.0.1:9/v1/traces is unreachable" in unreachable.stderr
    assert not calls.exists()  # checked before the Parquet export too
    _unechoed(unreachable)

    malformed = run_cli(
        "export", str(enriched), "--otlp", receiver.url, "--otlp-header", f"api_key {OTLP_SECRET}"
    )
    assert malformed.returncode == 2 and "--otlp-header: expected 'Name: value'" in malformed.stderr
    _unechoed(malformed)
    env = cli_env(ROLLOUT_CAPTURE_OTLP_HEADERS=f"x-env-key {ENV_SECRET}")
    bad_env = run_cli("export", str(enriched), "--otlp", receiver.url, "--json", env=env)
    assert bad_env.returncode == 2 and "ROLLOUT_CAPTURE_OTLP_HEADERS: pair 1" in bad_env.stderr
    assert json.loads(bad_env.stdout)["exit_code"] == 2
    _unechoed(bad_env)
    assert receiver.received == []

    alone = run_cli(
        "export", str(enriched), "--calls", str(calls), "--otlp-header", f"api_key: {OTLP_SECRET}"
    )
    assert alone.returncode == 2 and "go with --otlp URL" in alone.stderr and not calls.exists()
    _unechoed(alone)
    neither = run_cli("export", str(enriched))
    assert neither.returncode == 2 and "name --calls, --rollouts or both" in neither.stderr
    credentialed = run_cli("export", str(enriched), "--otlp", f"http://user:{OTLP_SECRET}@127.0.0.1:9")
    assert credentialed.returncode == 2
    _unechoed(credentialed)


def test_export_shows_a_progress_bar_on_a_terminal(receiver: OtlpReceiver, tmp_path: Path) -> None:
    """At a TTY, a bar on stderr while the traces go (piped, nothing: the test above)."""
    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    args = ["export", str(enriched), "--otlp", receiver.url, "--otlp-header", f"api_key: {OTLP_SECRET}"]
    code, text = run_at_terminal(*args, env=cli_env(COLUMNS="120"))
    assert code == 0, text[-2000:]
    assert "sending traces to" in text and "━" in text, text[-2000:]
    assert "span(s) in 1 batch(es) to" in text and OTLP_SECRET not in text


def test_export_sends_the_traces_of_an_output_on_s3(s3: S3, receiver: OtlpReceiver, tmp_path: Path) -> None:
    """An S3 run's output goes through the temporary local copy, as the Parquet export reads it."""
    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    _, _, spans = _expected_spans(enriched)
    s3.fs().put_file(str(enriched), f"{s3.bucket}/runs/r1/rollouts.enriched.jsonl")
    url, options = (
        s3.url("runs/r1/rollouts.enriched.jsonl"),
        ["--storage-options", json.dumps(s3.storage_options)],
    )
    done = run_cli("export", url, *options, "--otlp", receiver.url, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["traces"]["spans"] == spans == len(receiver.spans())
    assert json.loads(done.stdout)["traces"]["run"] == url  # the output's URL, never the local copy's


def test_export_without_the_otel_extra_names_it(tmp_path: Path) -> None:
    """No OpenTelemetry installed (its modules hidden): exit 2 naming the extra."""
    code = (
        "import sys; sys.modules['opentelemetry.exporter.otlp.proto.http'] = None; "
        "from rollout_capture.cli.app import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "export", str(tmp_path / "x.jsonl"), "--otlp", "http://127.0.0.1:9"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'rollout-capture[otel]'" in done.stderr
