"""Evidence wired into the flows (issue 16): counts in artifacts, events, the run's state and
the scheduled tick's table; the report written beside each output with its link artifact;
orphan captures counted from the listing the run already has.

The corpus is the hand-built one of test_report (100 calls with known latencies, 10 failed),
written as real capture rows and enriched by the real flows against a real Prefect API.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_completed_runs, enrich_rollouts
from rollout_capture.flows.events import COMPLETED, FAILED_CALLS_EXCEEDED, RESOURCE_PREFIX
from rollout_capture.flows.report import artifact_key, task_run_link

from .conftest import S3
from .support.prefect_api import artifacts, flow_run, run_rows, task_runs, wait_for_events, wait_for_logs
from .test_report import _row

pytestmark = pytest.mark.usefixtures("prefect_api")


def write_run(root: Path, *, poor: bool, rollouts: int = 20) -> tuple[Path, Path]:
    """``root/captures`` and ``root/rollouts.jsonl``: ``rollouts`` rollouts of 5 calls each.

    Poor: calls 7, 17, .., 57 answered 500, 66 and 76 rate limited, 86 no answer, 96 a truncated
    stream (10 failed of 100); ``r-3`` torn; ``r-20`` and ``24-1-a1`` without captures; ``24-1``
    an orphan capture (the harness dropped the attempt suffix).
    """
    captures = root / "captures"
    store = CaptureStore(captures)
    lines = []
    for k in range(rollouts):
        for i in range(5 * k, 5 * k + 5):
            store.record(f"r-{k}", _row(i, poor))
        lines.append({"_ng_rollout_id": f"r-{k}", "reward": float(k % 2)})
    if poor:
        store.mark_incomplete("r-3")
        store.record("24-1", _row(0, poor))
        lines.append({"_ng_rollout_id": "r-20", "reward": 0.0})
        lines.append({"_ng_task_index": 24, "_ng_rollout_index": 1, "_ng_attempt_index": 1, "reward": 1.0})
    source = root / "rollouts.jsonl"
    source.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return captures, source


def _levels(flow_run_id: Any) -> list[tuple[str, str]]:
    with get_client(sync_client=True) as client:
        found = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [(str(entry.level), entry.message) for entry in found]


def test_a_poor_run_completes_named_poor_with_every_count_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    captures, source = write_run(tmp_path, poor=True)
    monkeypatch.chdir(tmp_path)

    state = enrich_rollouts(
        "rollouts.jsonl", "captures", max_gap_share=0.1, max_failed_share=0.05, return_state=True
    )

    assert state.is_completed() and state.name == "Completed with gaps and failed calls"
    assert "10 of 100 calls failed (10.0% > 5.0%)" in (state.message or "")
    run_id = state.state_details.flow_run_id
    assert flow_run(run_id).state.name == "Completed with gaps and failed calls"  # what the UI shows
    assert flow_run(run_id).name == f"enrich {source}"  # absolute, though given relative
    (check,) = task_runs(run_id, "check_capture_dir")
    assert check.name == f"check_capture_dir {captures}"
    (read,) = task_runs(run_id, "read_rollouts")
    assert read.name == "read_rollouts rollouts.jsonl"  # named after its input, as given
    (merge,) = task_runs(run_id, "merge_batch")
    delay = merge.empirical_policy.retry_delay
    assert isinstance(delay, int | float) and delay > 0  # one number: the UI shows a list as "NaNs"

    summary = state.result()
    evidence = summary.stats.evidence
    assert evidence.failed_calls == 10
    assert evidence.calls_by_status_class == {"2xx": 91, "5xx": 6, "4xx": 2, "no status": 1}
    assert evidence.calls_by_error_category == {
        "upstream_error": 6,
        "rate_limit": 2,
        "connection": 1,
        "stream_truncated": 1,
    }
    assert evidence.latency_ms.percentiles() == {"p50": 500, "p90": 900, "p99": 990}
    assert evidence.ttft_ms.percentiles() == {"p50": 50, "p90": 90, "p99": 99}
    assert {name: m.calls for name, m in evidence.models.items()} == {"model-a": 60, "model-b": 40}
    assert evidence.gap_examples["model_call_capture_no_records"] == ["r-20", "24-1-a1"]
    assert evidence.gap_examples["model_call_capture_incomplete"] == ["r-3"]
    assert (evidence.orphan_captures, evidence.orphan_examples) == (1, ["24-1"])
    assert evidence.orphan_near == {"24-1": "24-1-a1"}

    # The report, beside the output, drawn from the same numbers, and linked.
    output = tmp_path / "rollouts.enriched.jsonl"
    report = tmp_path / "rollouts.enriched.report.html"
    assert summary.report == "rollouts.enriched.report.html"  # beside the output, named as it is
    html = report.read_text()
    assert "24-1" in html and "upstream_error" in html
    published = {a.key: a for a in artifacts(run_id) if a.key}
    link = published[artifact_key("evidence-report", str(output))]
    assert f"file://{report}" in link.data
    table = {
        row["measure"]: row["value"]
        for row in orjson.loads(published[artifact_key("enrichment", str(output))].data)
    }
    assert table["failed calls"] == 10
    assert table["calls by error category: upstream_error"] == 6
    assert table["latency (ms): p99"] == 990 and table["TTFT (ms): p50"] == 50
    assert table["orphan captures: count"] == 1
    markdown = published[artifact_key("enrichment-summary", str(output))].data
    assert "| upstream_error | 6 |" in markdown and "r-20, 24-1-a1" in markdown

    # The summary is a WARNING, naming why.
    wait_for_logs(run_id, "poor evidence (")
    warnings = [message for level, message in _levels(run_id) if level == "30"]
    assert any(m.startswith("poor evidence (") and "10 failed" in m for m in warnings)

    resource = RESOURCE_PREFIX + str(output)
    (completed,) = wait_for_events(COMPLETED, resource)
    payload = completed.payload
    assert payload["failed_calls"] == 10 and payload["calls_by_status_class"]["5xx"] == 6
    assert payload["latency_ms"] == {"p50": 500, "p90": 900, "p99": 990}
    assert payload["tokens_per_rollout"] == {"p50": 550, "p99": 1100}
    assert payload["models"]["model-b"]["calls"] == 40
    assert payload["gap_examples"]["model_call_capture_incomplete"] == ["r-3"]
    assert payload["orphan_examples"] == ["24-1"]
    (exceeded,) = wait_for_events(FAILED_CALLS_EXCEEDED, resource)
    assert exceeded.payload["max_failed_share"] == 0.05


def test_a_clean_run_is_plainly_completed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    captures, source = write_run(tmp_path, poor=False)
    caplog.set_level(logging.INFO, logger="prefect.flow_runs")

    state = enrich_rollouts(
        str(source), str(captures), max_gap_share=0.1, max_failed_share=0.05, return_state=True
    )

    assert state.name == "Completed"
    summary = state.result()
    assert summary.stats.evidence.failed_calls == 0 and summary.stats.evidence.orphan_captures == 0
    (line,) = [r for r in caplog.records if r.getMessage().startswith("enriched 20 rollout(s)")]
    assert line.levelno == logging.INFO  # nothing poor: not a warning
    assert (tmp_path / "rollouts.enriched.report.html").is_file()


def test_the_tick_tables_each_run_and_names_its_tasks(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for name, poor in (("bad", True), ("good", False)):
        write_run(runs / name, poor=poor)
        (runs / name / "_SUCCESS").touch()

    state = enrich_completed_runs(str(runs), max_gap_share=0.1, max_failed_share=0.05, return_state=True)

    summary = state.result()
    assert sorted(summary.enriched) == ["bad", "good"]
    run_id = state.state_details.flow_run_id
    batches = {batch.name: batch for batch in task_runs(run_id, "enrich_runs ", at_least=2)}
    assert sorted(batches) == ["enrich_runs bad", "enrich_runs good"]  # two runs: a batch each, at once
    batch = batches["enrich_runs bad"]
    rows = run_rows(run_id)  # each run a row of its batch's table
    bad, good = rows["bad"], rows["good"]
    assert bad["status"] == "enriched (Completed with gaps and failed calls)" and good["status"] == "enriched"
    assert (bad["rollouts"], bad["calls"], bad["failed_calls"], bad["gap_share"]) == (22, 100, 10, "13.6%")
    assert (good["rollouts"], good["failed_calls"], good["gap_share"]) == (20, 0, "0.0%")
    assert summary.outcomes["bad"].task_run_id == batch.id == bad["task_run_id"]
    assert summary.outcomes["bad"].state_name == "Completed with gaps and failed calls"
    published = {a.key: a for a in artifacts(run_id) if a.key}
    tick = published[artifact_key("enriched-runs", str(runs))].data  # the tick's summary
    assert (
        f"[logs]({task_run_link(batch.id)})" in tick
        and "| bad | enriched (" in tick
        and "| good | enriched" not in tick
    )
    assert any(m.startswith("bad: poor evidence (") for m in wait_for_logs(run_id, "bad: poor evidence ("))
    marker = orjson.loads((runs / "bad" / "_ENRICHED").read_bytes())
    assert marker["evidence"]["failed_calls"] == 10 and marker["evidence"]["orphan_examples"] == ["24-1"]
    assert (runs / "bad" / "rollouts.enriched.report.html").is_file()


def test_on_an_object_store_orphans_come_from_the_shared_listing_and_the_report_is_an_object(
    tmp_path: Path, s3: S3
) -> None:
    local_captures, source = write_run(tmp_path, poor=True, rollouts=40)  # enough for one flat listing
    fs = s3.fs()
    fs.put(str(local_captures), f"{s3.bucket}/caps", recursive=True)
    fs.put_file(str(source), f"{s3.bucket}/run/rollouts.jsonl")
    output = s3.url("run/rollouts.enriched.jsonl")

    summary = enrich_rollouts(
        s3.url("run/rollouts.jsonl"), s3.url("caps"), output=output, storage_options=s3.storage_options
    )

    assert (summary.stats.evidence.orphan_captures, summary.stats.evidence.orphan_examples) == (1, ["24-1"])
    assert summary.report == s3.url("run/rollouts.enriched.report.html")
    html = fs.cat_file(f"{s3.bucket}/run/rollouts.enriched.report.html").decode()
    assert html.startswith("<!DOCTYPE html>") and "24-1" in html


@pytest.mark.parametrize(
    "path",
    ["//ng-rollout/{id}/v1/chat/completions", "/ng-rollout/{id}//v1/chat/completions"],
    ids=["root-slash", "prefix-slash"],
)
def test_a_base_url_ending_in_a_slash_is_routed_like_one_without(
    path: str, scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    """``http://proxy/`` + ``/ng-rollout/..``, or ``../ng-rollout/<id>/`` + ``/v1/..``: captured, and
    the claims folder made for the call is gone once the call is done."""
    import httpx

    from .test_proxy import Proxy

    served = Proxy(scripted_upstream[0], str(tmp_path / "caps"))
    try:
        answer = httpx.post(
            served.url + path.format(id="slash-1"),
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        (row,) = served.wait_rows("slash-1")
        assert row["dialect"] == "chat" and row["status_code"] == 200
    finally:
        served.server.stop()
    assert sorted(p.name for p in (tmp_path / "caps").iterdir()) == ["slash-1.capture.jsonl"]


def test_a_claims_folder_is_removed_with_its_last_claim(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    folder = tmp_path / "7-1.capture.claims"
    with store.claim("7-1", model_call_id="a"):
        with store.claim("7-1", model_call_id="b"):
            assert len(list(folder.iterdir())) == 2
        assert len(list(folder.iterdir())) == 1  # another claim is live: the folder stays
        assert store.live_claims("7-1")
    assert not folder.exists()
    with store.claim("7-1", model_call_id="c"):  # made again for the next call
        assert len(list(folder.iterdir())) == 1
    assert list(tmp_path.iterdir()) == []
