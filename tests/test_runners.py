"""Every runner gives the same bytes: threads (default), a process pool, Dask (a real LocalCluster)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest

from examples.samples import capture_rows, corpus_records, jsonl_bytes
from rollout_capture import CaptureStore
from rollout_capture.filesystem import absolute_location
from rollout_capture.flows import enrich_rollouts
from rollout_capture.names import jsonl_name

from .conftest import S3
from .support.prefect_api import running_task_runs, state_history, task_runs

pytestmark = pytest.mark.usefixtures("prefect_api")
T = TypeVar("T")


def write_run(folder: Path, corpus_dir: Path) -> Path:
    """40 real rollouts with their captures in ``folder/caps``, and one line that is not a record."""
    captures = folder / "caps"
    captures.mkdir(parents=True)
    lines = []
    for index, record in enumerate(corpus_records(corpus_dir)[:40]):
        record = {**record, "_ng_task_index": index, "_ng_rollout_index": 0}
        rows = capture_rows(record, f"{index}-0", dialect=("responses", "chat", "messages")[index % 3])
        (captures / jsonl_name(f"{index}-0")).write_bytes(jsonl_bytes(rows))
        lines.append(orjson.dumps(record))
    lines.insert(7, b"<PLACEHOLDER ROW>")
    (folder / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return folder


@pytest.fixture
def run_dir(tmp_path: Path, corpus_dir: Path) -> Path:
    return write_run(tmp_path, corpus_dir)


def enrich(run_dir: Path, name: str, **options: object) -> bytes:
    output = run_dir / f"{name}.jsonl"
    state = enrich_rollouts(
        str(run_dir / "rollouts.jsonl"),
        str(run_dir / "caps"),
        output=str(output),
        batch_size=7,
        return_state=True,
        **options,
    )
    summary = state.result()
    assert summary.batches == 6 and [p.line for p in summary.stats.problems] == [8]
    # Batches ran elsewhere, yet their task runs are in this flow run's API (the UI).
    merged = eventually(
        lambda: task_runs(state.state_details.flow_run_id, "merge_batch", at_least=6),
        lambda runs: len(runs) == 6 and all(run.state_name == "Completed" for run in runs),
    )
    assert len(merged) == 6 and all(run.state_name == "Completed" for run in merged)
    return output.read_bytes()


def eventually(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 30.0) -> T:
    """What ``read`` gives once ``done`` (or at the deadline): task run states reach the API as
    events, a moment after the flow saw them."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = read()
        if done(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_process_pool_matches_threads(run_dir: Path) -> None:
    assert enrich(run_dir, "processes", runner="processes", max_workers=2) == enrich(run_dir, "threads")


def test_dask_local_cluster_matches_threads(run_dir: Path) -> None:
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        dask = enrich(run_dir, "dask", runner="dask", dask_address=cluster.scheduler_address)
    assert dask == enrich(run_dir, "threads")


def test_process_pool_waits_for_claims_in_a_visible_task(run_dir: Path) -> None:
    store = CaptureStore(run_dir / "caps")
    claim = store.claim("3-0")
    claim.__enter__()
    stop = threading.Event()
    since = datetime.now(UTC)

    def write_once_the_flow_waits() -> None:
        # The row lands only once the flow is visibly waiting: a flow that did not wait
        # would finish first and report the rollout pending.
        while not stop.is_set() and not running_task_runs("await_quiescence", since):
            stop.wait(0.05)
        store.record("3-0", {"model_call_id": "late", "dialect": "chat"})
        claim.__exit__(None, None, None)

    writer = threading.Thread(target=write_once_the_flow_waits)
    writer.start()
    try:
        state = enrich_rollouts(
            str(run_dir / "rollouts.jsonl"),
            str(run_dir / "caps"),
            output=str(run_dir / "out.jsonl"),
            runner="processes",
            max_workers=2,
            quiescence_timeout_s=120,
            return_state=True,
        )
    finally:
        stop.set()
        writer.join(30)
    summary = state.result()
    assert summary.stats.waited_for == 1 and "model_call_capture_pending" not in summary.stats.gaps
    (waited,) = task_runs(state.state_details.flow_run_id, "await_quiescence")
    assert waited.state_name == "Completed"
    record = orjson.loads((run_dir / "out.jsonl").read_bytes().splitlines()[3])
    assert record["ng_model_call_capture"]["calls"][-1]["model_call_id"] == "late"


def test_a_storage_outage_inside_a_worker_process_is_retried(
    tmp_path: Path, flaky_s3: tuple[S3, Any], corpus_dir: Path
) -> None:
    """The worker's S3 read fails (the endpoint is down): the fault crosses the process boundary
    as a transient one, the task retries, and nothing is lost."""
    via, proxy = flaky_s3
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    lines = []
    for index, record in enumerate(corpus_records(corpus_dir)[:6]):
        record = {**record, "_ng_task_index": index, "_ng_rollout_index": 0}
        for row in capture_rows(record, f"{index}-0", dialect="chat"):
            store.record(f"{index}-0", row)
        lines.append(orjson.dumps(record))
    (tmp_path / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    proxy.outage_on(b"GET /" + via.bucket.encode() + b"/caps/", seconds=2.5)

    state = enrich_rollouts(
        str(tmp_path / "rollouts.jsonl"),
        via.url("caps"),
        output=str(tmp_path / "out.jsonl"),
        storage_options=via.storage_options,
        runner="processes",
        max_workers=1,
        return_state=True,
    )

    summary = state.result()
    assert proxy.outages == 1 and summary.stats.rollouts == 6 and not summary.stats.gaps
    (merge,) = task_runs(state.state_details.flow_run_id, "merge_batch")
    assert "AwaitingRetry" in state_history(merge.id) and merge.run_count >= 2


def test_a_local_capture_dir_is_made_absolute_before_it_travels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert absolute_location("caps") == str(tmp_path / "caps")
    assert absolute_location("file://caps") == f"file://{tmp_path / 'caps'}"
    assert absolute_location("s3://bucket/caps") == "s3://bucket/caps"
    assert absolute_location(str(tmp_path)) == str(tmp_path)


def test_a_cluster_address_for_another_runner_is_refused(run_dir: Path) -> None:
    with pytest.raises(ValueError, match="ray_address is for runner='ray'; runner is 'dask'"):
        enrich_rollouts(
            str(run_dir / "rollouts.jsonl"), str(run_dir / "caps"), runner="dask", ray_address="h:1"
        )
    for args, message in (
        (["enrich", "r.jsonl", "-c", "caps", "--ray-address", "h:1"], "--ray-address is for --runner ray"),
        (
            ["enrich-runs", ".", "--runner", "ray", "--dask-address", "tcp://h:1"],
            "--dask-address is for --runner dask",
        ),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "rollout_capture.cli", *args],
            cwd=run_dir,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and f"error: {message}; the runner is" in done.stderr, done.stderr


def test_the_scheduled_deployment_takes_a_cluster_address(prefect_api: str, tmp_path: Path) -> None:
    """``deploy --runner ray --ray-address``: every tick's runs go to that cluster (a parameter)."""
    from .test_deployments import deploy, deployments

    done = deploy(
        prefect_api,
        "--runs-root",
        "/data/runs",
        "--runner",
        "ray",
        "--ray-address",
        "head:6379",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    scheduled = deployments()["enrich-completed-runs"]
    assert scheduled.parameters["runner"] == "ray" and scheduled.parameters["ray_address"] == "head:6379"
    schema = scheduled.parameter_openapi_schema["properties"]
    assert {"dask_address", "ray_address"} <= set(schema)
    assert "ray" in schema["runner"]["enum"]
    mixed = deploy(prefect_api, "--runs-root", "/data/runs", "--dask-address", "tcp://s:8786", cwd=tmp_path)
    assert mixed.returncode == 2 and "--dask-address is for --runner dask" in mixed.stderr, mixed.stderr


def test_batches_reading_a_journal_alone_on_a_store_go_two_at_a_time(
    s3: S3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A root holding the journal alone: the first batch reads every commit for all, so the
    threads runner keeps 2 batches in flight, not 8 (as quick, half the memory: docs/benchmarks.md);
    a root with a rollout's own objects, a local disk, or a cluster keeps what it had."""
    from rollout_capture.backends import ListingScope
    from rollout_capture.enrich_options import EnrichOptions
    from rollout_capture.flows.enrich import batches_in_flight
    from rollout_capture.location import Location

    from .support.journal_runs import journal_run

    captures = Location(url=s3.url("caps"), storage_options=s3.storage_options)
    lines = journal_run(CaptureStore(captures.url, storage_options=s3.storage_options), 40, 2)
    threads, dask = EnrichOptions(), EnrichOptions(runner="dask")
    assert batches_in_flight(8, threads, captures, ListingScope("alone", 40)) == 2
    assert batches_in_flight(8, dask, captures, ListingScope("on-a-cluster", 40)) == 8

    (tmp_path / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level("INFO", logger="rollout_capture.flows.enrich"):
        summary = enrich_rollouts(
            str(tmp_path / "rollouts.jsonl"),
            captures.url,
            output=str(tmp_path / "out.jsonl"),
            storage_options=s3.storage_options,
            batch_size=5,
        )
    assert "holds a journal alone: 2 batches in flight" in caplog.text
    records = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert summary.batches == 8 and [len(r["ng_model_call_capture"]["calls"]) for r in records] == [2] * 40

    objects = CaptureStore(captures.url, storage_options=s3.storage_options, layout="objects")
    objects.record("0-0", {"model_call_id": "an object of its own", "dialect": "chat"})
    assert batches_in_flight(8, threads, captures, ListingScope("beside-objects", 40)) == 8
    local = Location(url=str(tmp_path / "local"))
    journal_run(CaptureStore(local.url, layout="journal"), 40, 1)
    assert batches_in_flight(8, threads, local, ListingScope("local", 40)) == 8
