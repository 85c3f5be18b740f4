"""Scheduled enrichment of run folders: finished runs only, once, never two at a time."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import orjson
import pytest

from flows import enrich_completed_runs
from rollout_capture import CaptureStore
from rollout_capture.run_folders import RunsRoot

from .conftest import S3
from .spawned import take_lease

ROW = {"model_call_id": "c", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}


def make_run(root: Path, name: str, *, finished: bool, rollouts: int = 3) -> Path:
    run = root / name
    (run / "captures").mkdir(parents=True)
    store = CaptureStore(run / "captures")
    lines = []
    for task in range(rollouts):
        store.record(f"{task}-0", ROW)
        lines.append(orjson.dumps({"_ng_task_index": task, "_ng_rollout_index": 0}))
    (run / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    if finished:
        (run / "_SUCCESS").write_bytes(b"")
    return run


@pytest.mark.usefixtures("prefect_api")
def test_only_finished_runs_are_enriched_and_only_once(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    done = make_run(root, "2026-11-01-a", finished=True)
    make_run(root, "2026-11-01-b", finished=False)
    busy = make_run(root, "2026-11-01-c", finished=True)
    (root / "not-a-run").mkdir()
    runs = RunsRoot(str(root))
    lease = runs.acquire(next(r for r in runs.runs() if r.name == busy.name))  # another schedule holds it
    assert lease is not None

    first = enrich_completed_runs(str(root))

    assert (
        first.enriched == [done.name] and first.unfinished == ["2026-11-01-b"] and first.busy == [busy.name]
    )
    out = (done / "rollouts.enriched.jsonl").read_bytes().splitlines()
    assert len(out) == 3 and all(
        orjson.loads(x)["ng_model_call_capture"]["metrics"]["num_calls"] == 1 for x in out
    )
    marker = orjson.loads((done / "_ENRICHED").read_bytes())
    assert marker["stats"]["rollouts"] == 3 and marker["output"].endswith("rollouts.enriched.jsonl")
    assert not list(done.glob("_ENRICHING*"))  # the lease was given back
    assert not (root / "2026-11-01-b" / "rollouts.enriched.jsonl").exists()

    second = enrich_completed_runs(str(root))
    assert second.enriched == [] and second.already_enriched == [done.name]


@pytest.mark.usefixtures("prefect_api")
def test_runs_on_s3(s3: S3, tmp_path: Path) -> None:
    local = make_run(tmp_path, "run-1", finished=True)
    s3.fs().put(str(local), f"{s3.bucket}/runs/run-1", recursive=True)
    summary = enrich_completed_runs(s3.url("runs"), storage_options=s3.storage_options)
    assert summary.enriched == ["run-1"]
    assert s3.fs().exists(f"{s3.bucket}/runs/run-1/_ENRICHED")
    assert len(s3.fs().cat_file(f"{s3.bucket}/runs/run-1/rollouts.enriched.jsonl").splitlines()) == 3


def test_lease_expires_and_only_one_breaker_wins(tmp_path: Path) -> None:
    make_run(tmp_path, "r", finished=True)
    runs = RunsRoot(str(tmp_path))
    (run,) = runs.runs()
    stale = runs.acquire(run, lease_s=0.05)
    assert stale is not None and runs.acquire(run) is None  # live: nobody else gets it
    time.sleep(0.1)
    context = multiprocessing.get_context("spawn")
    go, results = context.Event(), context.Queue()
    racers = [context.Process(target=take_lease, args=(str(tmp_path), "r", go, results)) for _ in range(4)]
    for racer in racers:
        racer.start()
    go.set()
    for racer in racers:
        racer.join(60)
    assert sorted(results.get(timeout=10) for _ in racers) == [False, False, False, True]
