"""Runs enriched in batches: a failed run fails neither its neighbours nor its batch, a transient
fault retries the batch without redoing its finished runs, and two ticks at once never enrich a
run twice (each run's lease decides)."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_completed_runs
from rollout_capture.flows.enrich_runs import RunsFailed, RunsSummary
from rollout_capture.flows.enrich_runs import _batches as cut_into_batches
from rollout_capture.flows.events import COMPLETED, FAILED, RESOURCE_PREFIX
from rollout_capture.flows.report import artifact_key, task_run_link
from rollout_capture.run_folders import RunFolder, RunsRoot

from .conftest import S3, wait_for
from .support.prefect_api import (
    artifacts,
    events,
    logs,
    run_rows,
    state_history,
    task_runs,
    wait_for_events,
)
from .support.runs_helpers import make_run
from .support.spawned import run_tick_reporting


def _batches(flow_run_id: Any) -> list[Any]:
    return task_runs(flow_run_id, "enrich_runs ")


@pytest.mark.parametrize(
    ("runs", "per_batch", "parallel", "sizes"),
    [
        (5, 50, 2, [3, 2]),  # rounded up: two batches share them, never a third
        (4, 50, 2, [2, 2]),
        (7, 50, 3, [3, 3, 1]),
        (1, 50, 4, [1]),
        (5, 50, 8, [1, 1, 1, 1, 1]),  # more workers than runs: one run a batch
        (10, 3, 2, [3, 3, 3, 1]),  # never more than runs_per_batch
        (0, 50, 2, []),
    ],
)
def test_the_ready_runs_are_cut_into_batches_the_parallel_ones_share(
    runs: int, per_batch: int, parallel: int, sizes: list[int]
) -> None:
    """``max_parallel_runs`` batches share the ready runs, at most ``runs_per_batch`` a batch, in order."""
    ready = [RunFolder(name=f"r{i}", url=f"/runs/r{i}", finished=True, enriched=False) for i in range(runs)]
    batches = cut_into_batches(ready, per_batch, parallel)
    assert [len(batch) for batch in batches] == sizes
    assert [run for batch in batches for run in batch] == ready


@pytest.mark.usefixtures("prefect_api")
def test_a_failed_run_fails_neither_its_neighbours_nor_its_batch(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for name in ("a", "broken", "c"):
        make_run(root, name, finished=True)
    for path in (root / "broken" / "captures").iterdir():
        path.unlink()
    (root / "broken" / "captures").rmdir()

    state = enrich_completed_runs(str(root), max_parallel_runs=1, return_state=True)  # one batch of three

    assert state.is_failed()
    with pytest.raises(RunsFailed, match=r"1 run\(s\) failed: .*broken.*capture dir .* does not exist"):
        state.result()
    (batch,) = _batches(state.state_details.flow_run_id)
    assert batch.name == "enrich_runs a .. c (3 runs)"
    assert batch.state is not None and batch.state.is_completed() and batch.run_count == 1  # not retried
    for name in ("a", "c"):
        assert (root / name / "_ENRICHED").exists()
        assert len((root / name / "rollouts.enriched.jsonl").read_bytes().splitlines()) == 3
    broken = root / "broken"
    assert not (broken / "_ENRICHED").exists() and not (broken / "rollouts.enriched.jsonl").exists()
    leases = [orjson.loads(p.read_bytes()) for p in broken.iterdir() if p.name.startswith("_ENRICHING")]
    assert leases and all(lease["released"] for lease in leases)  # given back: the next tick takes it

    rows = run_rows(state.state_details.flow_run_id)  # the batch's table: each run, and why one failed
    assert [(name, rows[name]["status"]) for name in ("a", "broken", "c")] == [
        ("a", "enriched"),
        ("broken", "failed"),
        ("c", "enriched"),
    ]
    assert rows["broken"]["error"].startswith("RunRefused: capture dir") and rows["a"]["error"] is None
    assert rows["broken"]["task_run_id"] == batch.id
    filed = {a.key: a for a in artifacts(state.state_details.flow_run_id) if a.key}
    tick = filed[artifact_key("enriched-runs", str(root))].data  # the tick's summary names it
    assert "| broken | failed |" in tick and "capture dir" in tick and "| a | enriched" not in tick
    assert f"[logs]({task_run_link(batch.id)})" in tick
    (failed,) = wait_for_events(FAILED, RESOURCE_PREFIX + str(broken / "rollouts.enriched.jsonl"))
    assert failed.payload["error"] == "RunRefused"  # a FileNotFoundError: the run's own input, held
    for name in ("a", "c"):
        wait_for_events(COMPLETED, RESOURCE_PREFIX + str(root / name / "rollouts.enriched.jsonl"))


@pytest.mark.usefixtures("prefect_api")
def test_a_transient_fault_retries_the_batch_and_not_its_finished_runs(
    flaky_s3: tuple[S3, Any], tmp_path: Path
) -> None:
    """The endpoint goes down as run b takes its lease: b (and c, tried meanwhile) fail on a fault
    that heals; the batch is retried once a is done, and the retry enriches b and c, not a again."""
    via, proxy = flaky_s3
    for name in ("a", "b", "c"):
        local = make_run(tmp_path, name, finished=True)
        via.fs().put(str(local), f"{via.bucket}/runs/{name}", recursive=True)
    proxy.outage_on(b"/runs/b/_ENRICHING", seconds=2.5)

    state = enrich_completed_runs(
        via.url("runs"), storage_options=via.storage_options, max_parallel_runs=1, return_state=True
    )

    assert state.is_completed(), state.message
    summary: RunsSummary = state.result()
    assert summary.enriched == ["a", "b", "c"] and proxy.outages == 1
    (batch,) = _batches(state.state_details.flow_run_id)
    history = state_history(batch.id)
    assert "AwaitingRetry" in history and "Retrying" in history and history[-1] == "Completed"
    markers = {n: orjson.loads(via.fs().cat_file(f"{via.bucket}/runs/{n}/_ENRICHED")) for n in "abc"}
    assert len({marker["enriched_by"] for marker in markers.values()}) == 1  # the batch, in each try
    for name in "bc":
        output = via.fs().cat_file(f"{via.bucket}/runs/{name}/rollouts.enriched.jsonl").splitlines()
        assert [orjson.loads(line)["ng_model_call_capture"]["metrics"]["num_calls"] for line in output] == [
            1,
            1,
            1,
        ]
    assert batch.run_count >= 2
    assert any("run b: a storage fault that may heal" in m for m in logs(state.state_details.flow_run_id))
    output = f"{RESOURCE_PREFIX}{via.url('runs')}/a/rollouts.enriched.jsonl"
    wait_for_events(COMPLETED, f"{RESOURCE_PREFIX}{via.url('runs')}/c/rollouts.enriched.jsonl")
    assert len(events(COMPLETED, output)) == 1  # a was enriched in the first try only


@pytest.mark.usefixtures("prefect_api")
def test_a_batchs_last_try_runs_and_only_a_failure_in_it_is_final(
    flaky_s3: tuple[S3, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three tries (two retries): every answer to the run's rollouts is lost (a fault that heals)
    until Prefect decides the second retry, the last try. No try before it reports the fault as
    final (no ``failed`` event, no failed run); the last try runs and enriches the run."""
    import s3fs

    from rollout_capture.flows import enrich_runs
    from rollout_capture.tasks.retry import retry_on_transient

    via, proxy = flaky_s3
    local = make_run(tmp_path, "b", finished=True)
    via.fs().put(str(local), f"{via.bucket}/runs/b", recursive=True)
    proxy.lose_answer_on(f"GET /{via.bucket}/runs/b/rollouts.jsonl".encode(), times=1_000_000)
    # s3fs retries a ranged read 5 x 5 times (nested), 25 s a try here: the fault lasts until the
    # last try whatever s3fs does, so one attempt a level is enough
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)

    def healed_before_the_last_try(task: Any, task_run: Any, state: Any) -> bool:
        """The shipped condition; the fault heals once the last try is decided (before it runs)."""
        retried = retry_on_transient(task, task_run, state)
        if retried and task_run.run_count == task.retries:
            proxy.lose_answer_on(b"", times=0)
        return retried

    three_tries = enrich_runs.enrich_runs_batch.with_options(
        retries=2, retry_delay_seconds=0, retry_condition_fn=healed_before_the_last_try
    )
    monkeypatch.setattr(enrich_runs, "enrich_runs_batch", three_tries)

    state = enrich_completed_runs(via.url("runs"), storage_options=via.storage_options, return_state=True)

    assert state.is_completed(), state.message
    assert state.result().enriched == ["b"] and proxy.lost >= 2
    (batch,) = _batches(state.state_details.flow_run_id)
    assert batch.run_count == 3 and state_history(batch.id).count("Retrying") == 2
    output = f"{RESOURCE_PREFIX}{via.url('runs')}/b/rollouts.enriched.jsonl"
    wait_for_events(COMPLETED, output)
    assert events(FAILED, output) == []  # automations heard of no failure


def test_two_ticks_at_once_enrich_each_run_once(prefect_api: str, tmp_path: Path) -> None:
    """A tick that outlives its schedule meets the next one: every run is enriched by exactly one."""
    root = tmp_path / "runs"
    names = [f"run-{i}" for i in range(8)]
    claims = []
    for name in names:
        make_run(root, name, finished=True)
        claim = CaptureStore(root / name / "captures").claim("1-0", ttl_s=600)  # still being written
        claim.__enter__()
        claims.append(claim)
    runs = RunsRoot(str(root))

    def leases() -> int:
        return sum(runs.current_lease(run) is not None for run in runs.runs())

    report = tmp_path / "other.json"
    other = multiprocessing.get_context("spawn").Process(
        target=run_tick_reporting, args=(prefect_api, str(root), 30.0, str(report))
    )
    other.start()
    mine: dict[str, Any] = {}
    try:
        wait_for(lambda: leases() >= 2, 120, "the other tick's leases")  # it holds two runs
        tick = threading.Thread(
            target=lambda: mine.update(
                summary=enrich_completed_runs(
                    str(root), lease_s=30.0, quiescence_timeout_s=600.0, max_parallel_runs=2
                )
            )
        )
        tick.start()
        wait_for(lambda: leases() >= 4, 120, "this tick's leases beside them")
    finally:
        for claim in claims:
            claim.__exit__(None, None, None)
    other.join(300)
    tick.join(300)
    assert other.exitcode == 0
    theirs = RunsSummary.model_validate_json(report.read_text())
    ours: RunsSummary = mine["summary"]
    assert not set(ours.enriched) & set(theirs.enriched)
    assert sorted(ours.enriched + theirs.enriched) == names
    assert ours.busy  # it started while the other held two runs, and let them be
    # the other found ours held, or done by the time it got there (ours may finish first)
    assert set(ours.enriched) == set(theirs.busy) | set(theirs.already_enriched)
    assert set(theirs.enriched) == set(ours.busy) | set(ours.already_enriched)
    owners = {orjson.loads((root / n / "_ENRICHED").read_bytes())["enriched_by"] for n in names}
    assert len(owners) >= 2  # batches of both ticks
    for name in names:
        assert len((root / name / "rollouts.enriched.jsonl").read_bytes().splitlines()) == 3
        assert not [p for p in (root / name).iterdir() if p.name.startswith("_ENRICHING")]


@pytest.mark.usefixtures("prefect_api")
def test_a_run_of_many_batches_runs_them_as_tasks_inside_its_batch(tmp_path: Path) -> None:
    """A run longer than ``batch_size`` lines gets its batches as tasks (the runner's, retried
    alone); a shorter one beside it in the same batch of runs is merged in the batch's task."""
    root = tmp_path / "runs"
    make_run(root, "long", finished=True, rollouts=5)
    make_run(root, "short", finished=True, rollouts=2)

    state = enrich_completed_runs(str(root), batch_size=2, max_parallel_runs=1, return_state=True)

    summary: RunsSummary = state.result()
    assert summary.enriched == ["long", "short"]
    (batch,) = _batches(state.state_details.flow_run_id)
    merges = task_runs(state.state_details.flow_run_id, "merge_batch", at_least=3)
    assert sorted(m.name for m in merges) == [
        "merge_batch lines 1-2",
        "merge_batch lines 3-4",
        "merge_batch lines 5-5",
    ]  # the long run's alone
    for name, count in (("long", 5), ("short", 2)):
        out = [orjson.loads(x) for x in (root / name / "rollouts.enriched.jsonl").read_bytes().splitlines()]
        assert [r["ng_model_call_capture"]["metrics"]["num_calls"] for r in out] == [1] * count
        marker = orjson.loads((root / name / "_ENRICHED").read_bytes())
        assert marker["stats"]["rollouts"] == count and marker["batches"] == (3 if name == "long" else 1)
    assert summary.outcomes["long"].rollouts == 5 and summary.outcomes["long"].task_run_id == batch.id
