"""Flows against a real Prefect API: retries visible in state history, bad input not retried,
artifacts, end to end on S3 through a real outage, clearing before dispatch."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.samples import capture_rows, corpus_records, jsonl_bytes
from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_rollouts, prepare_dispatch
from rollout_capture.flows.report import artifact_key

from .conftest import S3
from .support.prefect_api import artifacts, flow_run, state_history, task_runs, wait_for_logs

pytestmark = pytest.mark.usefixtures("prefect_api")
ROW = {
    "model_call_id": "c",
    "dialect": "chat",
    "response": {"usage": {"prompt_tokens": 3, "completion_tokens": 1}},
}


def write_rollouts(path: Path, count: int, extra: list[bytes] | None = None) -> list[bytes]:
    lines = [orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": 0, "reward": t}) for t in range(count)]
    lines += extra or []
    path.write_bytes(b"\n".join(lines) + b"\n")
    return lines


def test_transient_storage_fault_is_retried_and_visible_in_the_api(
    tmp_path: Path, flaky_s3: tuple[S3, Any]
) -> None:
    via, proxy = flaky_s3
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    for task in range(3):
        store.record(f"{task}-0", ROW)
    rollouts = tmp_path / "rollouts.jsonl"
    write_rollouts(rollouts, 3)
    proxy.outage_on(b"prefix=caps%2F0-0.capture", seconds=2.5)  # the batch lists rollout 0-0: down

    state = enrich_rollouts(
        str(rollouts), via.url("caps"), storage_options=via.storage_options, return_state=True
    )

    assert state.is_completed()
    assert proxy.outages == 1
    (merge,) = task_runs(state.state_details.flow_run_id, "merge_batch")
    history = state_history(merge.id)
    assert "AwaitingRetry" in history and "Retrying" in history
    assert history[-1] == "Completed"
    assert merge.run_count >= 2
    out = [orjson.loads(line) for line in (tmp_path / "rollouts.enriched.jsonl").read_bytes().splitlines()]
    assert [r["ng_model_call_capture"]["metrics"]["num_calls"] for r in out] == [1, 1, 1]  # nothing lost


def test_bad_input_fails_at_once_and_leaves_no_output(tmp_path: Path) -> None:
    CaptureStore(tmp_path / "caps").record("0-0", ROW)
    rollouts = tmp_path / "rollouts.jsonl"
    write_rollouts(rollouts, 2, extra=[b"<PLACEHOLDER ROW>"])

    state = enrich_rollouts(str(rollouts), str(tmp_path / "caps"), strict=True, return_state=True)

    assert state.is_failed()
    with pytest.raises(ValueError, match=rf"{rollouts}:3: not JSON"):
        state.result()
    (merge,) = task_runs(state.state_details.flow_run_id, "merge_batch")
    assert merge.run_count == 1 and "AwaitingRetry" not in state_history(merge.id)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["caps", "rollouts.jsonl"]  # no output, no temp file


def test_missing_rollouts_file_is_named_and_not_retried(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    state = enrich_rollouts(str(missing), str(tmp_path), return_state=True)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        state.result()
    (read,) = task_runs(state.state_details.flow_run_id, "read_rollouts")
    assert read.run_count == 1


def test_secret_storage_options_are_refused_and_never_recorded(tmp_path: Path) -> None:
    state = enrich_rollouts(
        str(tmp_path / "r.jsonl"),
        "s3://bucket/caps",
        storage_options={"client_kwargs": {"endpoint_url": "http://x"}, "secret": "hunter2"},
        return_state=True,
    )
    with pytest.raises(ValueError, match=r"storage_options\.secret looks like a secret"):
        state.result()
    run_id = state.state_details.flow_run_id
    assert "hunter2" not in orjson.dumps(flow_run(run_id).parameters).decode()
    assert flow_run(run_id).parameters["storage_options"]["client_kwargs"] == {"endpoint_url": "http://x"}
    recorded = wait_for_logs(run_id, "looks like a secret")
    assert not any("hunter2" in line for line in recorded)


def test_output_order_count_report_and_artifacts(tmp_path: Path) -> None:
    captures = tmp_path / "caps"
    store = CaptureStore(captures)
    for task in range(0, 7, 2):
        store.record(f"{task}-0", ROW)
    rollouts = tmp_path / "rollouts.jsonl"
    lines = write_rollouts(rollouts, 7, extra=[b"not json", b'{"no": "id"}'])

    state = enrich_rollouts(str(rollouts), str(captures), batch_size=3, max_workers=2, return_state=True)

    summary = state.result()
    out = (tmp_path / "rollouts.enriched.jsonl").read_bytes().splitlines()
    assert len(out) == len(lines) and out[7:] == lines[7:]
    assert [orjson.loads(x)["reward"] for x in out[:7]] == list(range(7))
    assert summary.batches == 3 and summary.stats.rollouts == 7 and summary.stats.calls == 4
    assert summary.stats.gaps == {"model_call_capture_no_records": 3}
    assert [p.line for p in summary.stats.problems] == [8]
    run_id = state.state_details.flow_run_id
    published = {a.key or a.type: a for a in artifacts(run_id)}
    target = str(tmp_path / "rollouts.enriched.jsonl")
    table_key, summary_key, link_key, report_key = (
        artifact_key(kind, target)
        for kind in ("enrichment", "enrichment-summary", "enriched-output", "evidence-report")
    )
    assert set(published) == {"progress", table_key, summary_key, link_key, report_key}
    assert f"file://{tmp_path / 'rollouts.enriched.report.html'}" in published[report_key].data
    assert table_key != artifact_key("enrichment", str(tmp_path / "other.enriched.jsonl"))  # per target
    assert published["progress"].data == 100.0
    table = {row["measure"]: row["value"] for row in orjson.loads(published[table_key].data)}
    assert table["rollouts enriched"] == 7 and table["gap: model_call_capture_no_records"] == 3
    assert table["unparseable lines"] == 1 and table["rollouts with any gap"] == 3
    assert "line 8: not JSON" in published[summary_key].data
    assert f"file://{target}" in published[link_key].data
    assert flow_run(run_id).name == f"enrich {rollouts}"
    names = sorted(run.name for run in task_runs(run_id, "merge_batch", at_least=3))
    assert names == ["merge_batch lines 1-3", "merge_batch lines 4-6", "merge_batch lines 7-9"]


def test_end_to_end_on_s3_survives_an_outage(
    tmp_path: Path, flaky_s3: tuple[S3, Any], corpus_dir: Path
) -> None:
    """Rollouts (gzip), captures and output on S3; the endpoint dies mid-run; nothing is lost."""
    via, proxy = flaky_s3
    records = corpus_records(corpus_dir)[:20]
    remote = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    local = tmp_path / "caps"
    local.mkdir()
    lines = []
    for index, record in enumerate(records):
        record = {**record, "_ng_task_index": index, "_ng_rollout_index": 0}
        rows = capture_rows(record, f"{index}-0", dialect=("responses", "chat", "messages")[index % 3])
        for row in rows:
            remote.record(f"{index}-0", row)
        (local / f"{index}-0.capture.jsonl").write_bytes(jsonl_bytes(rows))
        lines.append(orjson.dumps(record))
    data = b"\n".join(lines) + b"\n"
    via.fs().pipe_file(f"{via.bucket}/in/rollouts.jsonl.gz", gzip.compress(data))
    (tmp_path / "rollouts.jsonl").write_bytes(data)
    expected = enrich_rollouts(str(tmp_path / "rollouts.jsonl"), str(local), batch_size=8)

    proxy.outage_on(b"/caps/", seconds=2.5)
    summary = enrich_rollouts(
        via.url("in/rollouts.jsonl.gz"),
        via.url("caps"),
        output=via.url("out/enriched.jsonl"),
        storage_options=via.storage_options,
        batch_size=8,
    )

    assert proxy.outages == 1
    assert summary.stats == expected.stats
    got = via.fs().cat_file(f"{via.bucket}/out/enriched.jsonl")
    assert got == (tmp_path / "rollouts.enriched.jsonl").read_bytes()
    assert sorted(via.fs().ls(f"{via.bucket}/out")) == [
        f"{via.bucket}/out/enriched.jsonl",
        f"{via.bucket}/out/enriched.report.html",  # the evidence report, beside it
    ]


def test_prepare_dispatch_clears_exactly_the_dispatched(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "caps")
    for rollout_id in ["1-0", "1-1-a1", "1-10", "2-0"]:
        store.record(rollout_id, ROW)
    rollouts = tmp_path / "dispatch.jsonl"
    rollouts.write_bytes(
        b'{"_ng_task_index": 1, "_ng_rollout_index": 0}\n'
        b'{"_ng_task_index": 1, "_ng_rollout_index": 1, "_ng_attempt_index": 1}\n'
    )
    assert prepare_dispatch(str(rollouts), str(tmp_path / "caps")) == 2
    assert not store.has_any("1-0") and not store.has_any("1-1-a1")
    assert store.has_any("1-10") and store.has_any("2-0")
    assert prepare_dispatch([{"_ng_rollout_id": "2-0"}], str(tmp_path / "caps")) == 1
    assert not store.has_any("2-0")


def test_prepare_dispatch_deletes_nothing_when_one_line_is_bad(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "caps")
    store.record("1-0", ROW)
    rollouts = tmp_path / "dispatch.jsonl"
    rollouts.write_bytes(b'{"_ng_task_index": 1, "_ng_rollout_index": 0}\n{"_ng_rollout_id": "../x"}\n')
    with pytest.raises(ValueError, match="invalid rollout id"):
        prepare_dispatch(str(rollouts), str(tmp_path / "caps"))
    assert store.has_any("1-0")
