"""Scheduled enrichment of run folders: finished runs only, once, never two at a time; a backlog
in parallel; a tick that outlives its lease keeps its run, a crashed one is taken over."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_completed_runs
from rollout_capture.flows.enrich_runs import RunsSummary
from rollout_capture.flows.report import artifact_key
from rollout_capture.run_folders import BEATS_PER_LEASE, Lease, RunsRoot

from .conftest import S3, Clock, wait_for
from .support.prefect_api import artifacts, flow_runs_under, run_rows, task_runs
from .support.runs_helpers import ROW, Where, make_run
from .support.spawned import run_tick, take_lease


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


@pytest.mark.parametrize("where", ["local", "s3"], indirect=True)
def test_lease_expires_and_only_one_breaker_wins(where: Where, clock: Clock) -> None:
    """Four processes break the same stale lease at once: exactly one wins, on disk and on S3."""
    where.make_run("r")
    runs = where.root()
    run = where.run("r")
    stale = runs.acquire(run, lease_s=60.0)
    assert stale is not None and runs.acquire(run) is None  # live: nobody else gets it
    lapsed = runs.current_lease(run)  # as a taker judges it: on S3 from the object's own time
    assert lapsed is not None
    clock.set(lapsed.expires_at - 0.001)
    assert runs.acquire(run) is None  # still live an instant before
    context = multiprocessing.get_context("spawn")
    go, results = context.Event(), context.Queue()
    racers = [  # they race at the instant it lapses
        context.Process(
            target=take_lease, args=(where.url, "r", go, results, where.options, lapsed.expires_at)
        )
        for _ in range(4)
    ]
    for racer in racers:
        racer.start()
    go.set()
    for racer in racers:
        racer.join(60)
    assert sorted(results.get(timeout=10) for _ in racers) == [False, False, False, True]


@pytest.fixture
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    s3: S3 | None = request.getfixturevalue("s3") if request.param == "s3" else None
    return Where(tmp_path, s3)


def leased(root: Path, names: list[str]) -> list[str]:
    return [n for n in names if any(p.name.startswith("_ENRICHING") for p in (root / n).iterdir())]


def in_thread(tick: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(state=tick()))
    thread.start()
    return thread, out


@pytest.mark.usefixtures("prefect_api")
def test_backlog_drains_in_parallel_batches_each_run_under_its_own_lease(tmp_path: Path) -> None:
    """Three waiting runs in two batches run at once, each run holding its lease well past ``lease_s``."""
    root = tmp_path / "runs"
    names = [f"run-{i}" for i in range(3)]
    claims = []
    for name in names:
        make_run(root, name, finished=True)
        claim = CaptureStore(root / name / "captures").claim("0-0", ttl_s=600)  # a call still in flight
        claim.__enter__()
        claims.append(claim)
    tick, out = in_thread(
        lambda: enrich_completed_runs(
            str(root), max_parallel_runs=2, lease_s=1.0, quiescence_timeout_s=600.0, return_state=True
        )
    )
    try:
        started = wait_for(lambda: len(leased(root, names)) >= 2 and leased(root, names), 120, "two leases")
        assert started == ["run-0", "run-2"]  # the first run of each batch: runs [0, 1] and [2]
        runs = RunsRoot(str(root))
        for name in started:  # renewed past their lease period while they wait
            run = next(r for r in runs.runs() if r.name == name)
            wait_for(
                lambda run=run: (
                    (runs.current_lease(run) or Lease.model_construct(generation=0)).generation
                    > BEATS_PER_LEASE
                ),
                120,
                "renewals past the lease period",
            )
    finally:
        for claim in claims:
            claim.__exit__(None, None, None)
        tick.join(120)
    state = out["state"]
    summary: RunsSummary = state.result()
    assert summary.enriched == names and not summary.busy and not summary.lost
    for name in names:
        assert len((root / name / "rollouts.enriched.jsonl").read_bytes().splitlines()) == 3
        assert not [p for p in (root / name).iterdir() if p.name.startswith("_ENRICHING")]

    parent = state.state_details.flow_run_id
    batches = task_runs(parent, "enrich_runs ", at_least=2)
    assert sorted(b.name for b in batches) == ["enrich_runs run-0 .. run-1 (2 runs)", "enrich_runs run-2"]
    assert {summary.outcomes[n].task_run_id for n in names} == {b.id for b in batches}
    assert all(b.state is not None and b.state.is_completed() and b.run_count == 1 for b in batches)
    assert not flow_runs_under(parent)  # no subflow per run
    rows = run_rows(parent)  # each batch's table, filed under its task run
    assert [(rows[n]["status"], rows[n]["rollouts"]) for n in names] == [("enriched", 3)] * 3
    assert {rows[n]["task_run_id"] for n in names} == {b.id for b in batches}
    filed = [a for a in artifacts(parent) if a.type != "progress"]
    assert len(filed) == 3  # the two batches' tables and the tick's summary: nothing per run
    summary_md = next(a.data for a in filed if a.key == artifact_key("enriched-runs", str(root)))
    assert "3 run(s) tried in 2 batch(es): enriched 3 run(s)" in summary_md
    spans = [(b.start_time, b.end_time) for b in batches]
    assert spans[0][0] is not None and spans[1][0] is not None
    assert max(s for s, _ in spans) < min(e for _, e in spans if e is not None)  # the batches overlapped


@pytest.mark.usefixtures("prefect_api")
def test_a_holder_whose_lease_is_taken_stops_and_publishes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_run(root, "r", finished=True)
    claim = CaptureStore(root / "r" / "captures").claim("0-0", ttl_s=600)
    claim.__enter__()
    tick, out = in_thread(lambda: enrich_completed_runs(str(root), lease_s=1.0, quiescence_timeout_s=600.0))
    runs = RunsRoot(str(root))
    try:
        (run,) = runs.runs()
        wait_for(lambda: runs.current_lease(run), 120, "the tick's lease")
        while True:  # another holder creates the generation the tick's next renewal needs
            current = runs.current_lease(run)
            assert current is not None
            thief = Lease(owner="thief", generation=current.generation + 1, acquired_at=0, expires_at=0)
            try:
                runs.backend.create(runs._lease_path(run, thief.generation), orjson.dumps(thief.model_dump()))
                break
            except FileExistsError:
                continue
    finally:
        claim.__exit__(None, None, None)
        tick.join(120)
    summary: RunsSummary = out["state"]
    assert (summary.lost, summary.enriched, summary.failed) == (["r"], [], {}), summary.outcomes
    assert "thief" in (summary.outcomes["r"].error or "")
    assert not (root / "r" / "rollouts.enriched.jsonl").exists() and not (root / "r" / "_ENRICHED").exists()
    assert (root / "r" / f"_ENRICHING.{thief.generation:06d}").exists()  # the new holder's lease untouched


def test_a_tick_past_its_lease_keeps_its_run_and_a_killed_one_is_taken_over(
    prefect_api: str, tmp_path: Path, s3: S3, clock: Clock
) -> None:
    """On a local disk and on S3, side by side: a tick in its own process waits on a live
    claim well past ``lease_s``, and a second tick skips the run as busy. Then it is
    SIGKILLed: once its lease lapses the next tick completes the run, and ``_ENRICHED``
    is written once."""
    wheres = {"local": Where(tmp_path / "disk", None), "s3": Where(tmp_path / "objects", s3)}
    lease_s = {"local": 3.0, "s3": 4.0}  # object stores date leases to the second
    context = multiprocessing.get_context("spawn")
    claims: dict[str, tuple[CaptureStore, Any]] = {}
    ticks: dict[str, Any] = {}
    held: dict[str, Lease] = {}
    for backend, where in wheres.items():
        where.make_run("r")
        store = where.capture_store("r")
        claim = store.claim("0-0", ttl_s=600)
        claim.__enter__()
        claims[backend] = (store, claim)
        ticks[backend] = context.Process(
            target=run_tick, args=(prefect_api, where.url, where.options, lease_s[backend])
        )
        ticks[backend].start()
    try:
        for backend, where in wheres.items():
            runs, run = where.root(), where.run("r")
            held[backend] = wait_for(
                lambda runs=runs, run=run: (
                    (lease := runs.current_lease(run)) and lease.generation > BEATS_PER_LEASE and lease
                ),
                120,
                f"the {backend} tick's renewals",
            )
            assert f":{ticks[backend].pid}:" in held[backend].owner  # renewed past its lease period
            busy = enrich_completed_runs(where.url, lease_s=lease_s[backend], storage_options=where.options)
            assert busy.busy == ["r"] and not busy.enriched, backend
        for tick in ticks.values():
            os.kill(tick.pid, signal.SIGKILL)
        for tick in ticks.values():
            tick.join(30)
    finally:
        for tick in ticks.values():
            if tick.is_alive():
                tick.kill()
        for store, claim in claims.values():
            store.record("0-0", {**ROW, "model_call_id": "late"})
            claim.__exit__(None, None, None)

    for backend, where in wheres.items():
        assert "_ENRICHED" not in where.names("r"), backend
        runs, run = where.root(), where.run("r")
        current = runs.current_lease(run)
        assert current is not None and current.owner == held[backend].owner  # the dead tick's
        clock.set(current.expires_at)  # the instant it lapses (ticks in this process judge by it)
        after = enrich_completed_runs(where.url, lease_s=lease_s[backend], storage_options=where.options)
        assert after.enriched == ["r"], backend
        out = [orjson.loads(line) for line in where.read("r", "rollouts.enriched.jsonl").splitlines()]
        assert [r["ng_model_call_capture"]["metrics"]["num_calls"] for r in out] == [2, 1, 1]  # complete
        marker = where.read("r", "_ENRICHED")
        assert f":{os.getpid()}:" in orjson.loads(marker)["enriched_by"]
        assert not [n for n in where.names("r") if n.startswith("_ENRICHING")]
        assert runs.take(run) == "enriched" and where.read("r", "_ENRICHED") == marker  # never again


@pytest.mark.usefixtures("prefect_api")
def test_a_failing_run_fails_the_tick_but_not_the_others(tmp_path: Path) -> None:
    """One run's capture dir is missing: that run fails (named, its lease given back, no
    _ENRICHED, held from then on: its own input, not a fault to retry every tick); the other run
    is enriched; the tick fails, saying which. Rechecked, it is taken again."""
    from rollout_capture.flows.enrich_runs import RunsFailed

    root = tmp_path / "runs"
    good = make_run(root, "good", finished=True)
    broken = make_run(root, "broken", finished=True)
    for path in (broken / "captures").iterdir():
        path.unlink()
    (broken / "captures").rmdir()

    state = enrich_completed_runs(str(root), return_state=True)

    assert state.is_failed()
    with pytest.raises(RunsFailed, match=r"1 run\(s\) failed: .*broken.*capture dir .* does not exist"):
        state.result()
    assert (good / "_ENRICHED").exists() and not (broken / "_ENRICHED").exists()
    assert not (broken / "rollouts.enriched.jsonl").exists()
    assert not [
        p for p in broken.iterdir() if p.name.startswith("_ENRICHING") and "released" not in p.read_text()
    ]
    held = enrich_completed_runs(str(root), allow_empty=True)  # the next tick names it, and passes
    assert held.enriched == [] and list(held.held) == ["broken"]
    again = enrich_completed_runs(str(root), allow_empty=True, recheck=["broken"])
    assert again.enriched == ["broken"] and again.already_enriched == ["good"]


@pytest.mark.parametrize("where", ["local", "s3"], indirect=True)
@pytest.mark.usefixtures("prefect_api")
def test_a_run_deleted_and_made_again_under_its_name_is_enriched_once_finished(where: Where) -> None:
    """The index of enriched runs remembers the first ``r1``; finishing the second one (what
    ``finish`` does) tells the next tick to look at it again, so it is enriched, not skipped as
    ``already_enriched``."""
    from rollout_capture.run_folders import mark_finished

    where.make_run("r1")
    assert enrich_completed_runs(where.url, storage_options=where.options).enriched == ["r1"]
    where.delete_run("r1")
    where.make_run("r1", finished=False, rollouts=2)  # made again: other rollouts
    mark_finished(f"{where.url}/r1", where.options)

    tick = enrich_completed_runs(where.url, storage_options=where.options)

    assert tick.enriched == ["r1"] and tick.already_enriched == []
    assert "_ENRICHED" in where.names("r1")
    assert len(where.read("r1", "rollouts.enriched.jsonl").splitlines()) == 2
    assert enrich_completed_runs(where.url, storage_options=where.options).already_enriched == ["r1"]
