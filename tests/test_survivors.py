"""Promises that small mutations of the code once broke with the whole suite green.

Each test here was checked against its mutation (applied by hand, seen to fail, reverted):
the local append's fsync removed; a failed fsync no longer marking the rollout incomplete; a
claim live one TTL too long; ``_ENRICHED`` written
before the run's output is published; a ref whose ``model_call_id`` matches but whose
``model_ref`` disagrees, accepted. Issue 38's audit added seven: a call cancelled while its
journal claim is in flight on a local disk never releasing it; a claims commit holding a clear
put without the look above its number; ``capture_hold_ms`` counted from the call's arrival; a
negative ``latency_ttft_ms`` alone left without a gap; a deployment's trigger matching the runs
of a sibling root (``<root>*``); ``mark_run_finished`` naming a relative run as given; 503 no
longer retried by the trace export. Issue 49's seven are tested beside their modules' tests: an
upstream 400 kept as ``upstream_status_code`` (test_producer_exchange, test_proxy), a trace name of
exactly 512 characters (test_traces), a two-span batch split on 413 (test_traces_endpoint), a
batch's last try counted right (test_run_batches), a stopped serve disabling only its own triggers
and deploy refusing a deployment on no work pool (test_deployments), a journal row's one write
with several writers (test_journal).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.run_folders import RunsRoot

from .conftest import S3, SAMPLE, Clock, wait_for
from .support.otlp_receiver import OtlpReceiver
from .support.producer_calls import body_then_silence, post_scope
from .support.runs_helpers import ROW, Where, make_run
from .support.scripted_upstream import ScriptedUpstream
from .support.spawned import run_tick

# ----------------------------------------------------------------------------- durability

_RECORDS = """
import asyncio, sys
from rollout_capture import CaptureStore
store = CaptureStore(sys.argv[1])
store.record("1-0", {"model_call_id": "sync", "dialect": "chat"})
asyncio.run(store.record_async("1-0", {"model_call_id": "async", "dialect": "chat"}))
store.record("2-0", {"model_call_id": "other", "dialect": "chat"})
"""


# Run before _RECORDS in the writing process: every open of a capture file, write, fsync and
# close on a descriptor is noted in order (the calls as the code makes them, no strace needed).
_TRACED = """
import atexit, os, sys, threading
_trace, _guard = [], threading.Lock()
_real = {n: getattr(os, n) for n in ("open", "write", "fsync", "fdatasync", "close")}
def _note(*event):
    with _guard:
        _trace.append(" ".join(map(str, event)))
def _open(path, *args, **kwargs):
    fd = _real["open"](path, *args, **kwargs)
    if os.fspath(path).endswith(".capture.jsonl"):
        _note("open", fd, os.path.join(sys.argv[1], os.path.basename(os.fspath(path))))
    return fd
def _write(fd, data):
    written = _real["write"](fd, data)
    _note("write", fd, written)
    return written
def _sync(name):
    def sync(fd):
        _real[name](fd)
        _note("fsync", fd if isinstance(fd, int) else fd.fileno())
    return sync
def _close(fd):
    _note("close", fd)
    _real["close"](fd)
os.open, os.write, os.close = _open, _write, _close
os.fsync, os.fdatasync = _sync("fsync"), _sync("fdatasync")
atexit.register(lambda: open(sys.argv[2], "w").write("\\n".join(_trace)))
"""


def test_every_local_append_is_fsynced_after_its_write_before_record_returns(tmp_path: Path) -> None:
    """Each row's write to its capture file is followed by an fsync of that file's descriptor
    (no close in between), so a row is durable once recorded: the writing process notes its
    own ``os`` calls in order (a removed or misplaced fsync fails this; no strace needed)."""
    trace = tmp_path / "trace"
    done = subprocess.run(
        [sys.executable, "-c", _TRACED + _RECORDS, str(tmp_path / "caps"), str(trace)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]

    files: dict[str, str] = {}  # fd -> capture file it holds
    pending: dict[str, int] = {}  # capture file -> rows written, not yet fsynced
    durable: dict[str, int] = {}
    for line in trace.read_text().splitlines():
        call, fd, *rest = line.split(" ", 2)
        if call == "open":
            files[fd] = rest[0]
        elif call == "write" and (path := files.get(fd)) is not None:
            pending[path] = pending.get(path, 0) + 1
        elif call == "fsync" and (path := files.get(fd)) is not None and pending.get(path):
            durable[path] = durable.get(path, 0) + pending.pop(path)
        elif call == "close" and (path := files.pop(fd, None)) is not None:
            assert not pending.get(path), f"{path} closed with a row written but never fsynced"
    first, second = str(tmp_path / "caps" / "1-0.capture.jsonl"), str(tmp_path / "caps" / "2-0.capture.jsonl")
    assert not any(pending.values()), f"rows never fsynced: {pending}"
    assert durable == {first: 2, second: 1}
    assert [r["model_call_id"] for r in CaptureStore(tmp_path / "caps").read("1-0")] == ["sync", "async"]


@pytest.mark.parametrize("how", ["record", "record_async", "record_staged"])
async def test_a_failed_fsync_of_a_local_row_marks_the_rollout_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The disk refuses the row's fsync (EIO, once): the write raises, the row is cut back (it is
    not known durable) and the rollout carries ``model_call_capture_incomplete``; rows after it
    land as usual."""
    import errno

    store = CaptureStore(tmp_path)
    store.record("1-0", {**ROW, "model_call_id": "before"})
    real_fsync = os.fsync

    def failing_once(fd: int) -> None:
        monkeypatch.setattr(os, "fsync", real_fsync)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_once)
    row = {**ROW, "model_call_id": "lost"}
    with pytest.raises(OSError, match="Input/output error"):
        if how == "record":
            store.record("1-0", row)
        elif how == "record_async":
            await store.record_async("1-0", row)
        else:
            blocking, finish = store.record_staged("1-0", row)
            try:
                blocking()
            finally:
                finish()
    assert os.fsync is real_fsync  # the fsync was reached, and failed
    store.record("1-0", {**ROW, "model_call_id": "after"})
    assert [r["model_call_id"] for r in store.read("1-0")] == ["before", "after"]
    record = merge_model_call_capture_into_record({"_ng_rollout_id": "1-0"}, [tmp_path])
    assert {"code": "model_call_capture_incomplete"} in record["ng_model_call_capture"]["gaps"]


# ----------------------------------------------------------------------------- the claim boundary


def test_a_local_claim_is_live_until_exactly_its_ttl(tmp_path: Path, clock: Clock) -> None:
    store = CaptureStore(tmp_path)
    made = clock.now
    with store.claim("1-0", ttl_s=10):
        clock.set(made + 10 - 0.001)
        assert len(store.live_claims("1-0")) == 1 and store.expired_claims("1-0") == []
        clock.set(made + 10)
        assert store.live_claims("1-0") == [] and len(store.expired_claims("1-0")) == 1
        # Asked with an explicit moment, the same on both sides.
        assert len(store.live_claims("1-0", now=made + 9.999)) == 1
        assert store.live_claims("1-0", now=made + 10) == []


def test_an_object_store_claim_is_live_until_its_objects_time_plus_ttl(s3: S3, clock: Clock) -> None:
    """On an object store expiry counts from the object's own modification time."""
    store = CaptureStore(s3.url("caps"), storage_options=s3.storage_options)
    with store.claim("1-0", ttl_s=10):
        (path,) = [p for p in s3.fs().find(f"{s3.bucket}/caps") if ".capture.claims" in p]
        stored_at = s3.fs().info(path)["LastModified"].timestamp()
        clock.set(stored_at + 10 - 0.001)
        assert len(store.live_claims("1-0")) == 1
        clock.set(stored_at + 10)
        assert store.live_claims("1-0") == [] and len(store.expired_claims("1-0")) == 1


# ----------------------------------------------------------------------------- publish order


def _names(s3: S3) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in s3.fs().ls(f"{s3.bucket}/runs/r", detail=False)}


@pytest.mark.usefixtures("prefect_api")
def test_a_failed_publish_leaves_no_enriched_marker(flaky_s3: tuple[S3, Any], s3: S3, tmp_path: Path) -> None:
    """The store refuses the output's PUT: the run fails and ``_ENRICHED`` is not there (it
    would say an output exists that no one can read); the next tick enriches it."""
    from rollout_capture.flows import enrich_completed_runs

    via, proxy = flaky_s3
    Where(tmp_path, s3).make_run("r")
    proxy.deny_on(f"PUT /{s3.bucket}/runs/r/rollouts.enriched.jsonl ".encode())
    state = enrich_completed_runs(via.url("runs"), storage_options=via.storage_options, return_state=True)
    assert proxy.denied >= 1 and state.is_failed()
    assert "_ENRICHED" not in _names(s3) and "rollouts.enriched.jsonl" not in _names(s3)
    proxy.deny_on(None)
    again = enrich_completed_runs(via.url("runs"), storage_options=via.storage_options)
    assert again.enriched == ["r"] and "_ENRICHED" in _names(s3)


def test_a_holder_killed_between_its_output_and_its_marker_left_the_whole_output(
    prefect_api: str, flaky_s3: tuple[S3, Any], s3: S3, tmp_path: Path, clock: Clock
) -> None:
    """The endpoint dies under the marker's PUT and the holder is SIGKILLed while it retries:
    by then its output is published in full, and ``_ENRICHED`` is not there. The next tick,
    once the lease lapses, enriches the run and writes the marker once."""
    from rollout_capture.flows import enrich_completed_runs

    via, proxy = flaky_s3
    where = Where(tmp_path, s3)
    where.make_run("r")
    proxy.outage_on(f"PUT /{s3.bucket}/runs/r/_ENRICHED ".encode(), 3600)
    tick = multiprocessing.get_context("spawn").Process(
        target=run_tick, args=(prefect_api, via.url("runs"), via.storage_options, 30.0)
    )
    tick.start()
    try:
        wait_for(lambda: proxy.outages >= 1 or not tick.is_alive(), 180, "the holder to write its marker")
        assert tick.is_alive(), "the tick ended before it wrote its marker"
        os.kill(tick.pid or 0, signal.SIGKILL)
        tick.join(30)
    finally:
        if tick.is_alive():
            tick.kill()
    proxy.up()
    assert "_ENRICHED" not in _names(s3)
    out = s3.fs().cat_file(f"{s3.bucket}/runs/r/rollouts.enriched.jsonl").splitlines()
    assert [orjson.loads(line)["ng_model_call_capture"]["metrics"]["num_calls"] for line in out] == [1, 1, 1]

    runs = RunsRoot(s3.url("runs"), s3.storage_options)
    (run,) = runs.runs()
    dead = runs.current_lease(run)
    assert dead is not None and f":{tick.pid}:" in dead.owner
    clock.set(dead.expires_at)  # the dead holder's lease lapses
    after = enrich_completed_runs(s3.url("runs"), storage_options=s3.storage_options)
    assert after.enriched == ["r"] and "_ENRICHED" in _names(s3)
    marker = orjson.loads(s3.fs().cat_file(f"{s3.bucket}/runs/r/_ENRICHED"))
    assert f":{os.getpid()}:" in marker["enriched_by"]


# ----------------------------------------------------------------------------- ownership refs

POLICY = {"type": "responses_api_models", "name": "policy"}
OTHER = {"type": "responses_api_models", "name": "other"}


def test_a_ref_whose_call_id_matches_but_whose_model_ref_disagrees_is_unmatched(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    for call_id in ("c0", "c1"):
        store.record(
            "1-0", {**ROW, "model_call_id": call_id, "model_ref": POLICY, "response": {"id": call_id}}
        )
    refs = [{"model_call_id": "c0", "model_ref": OTHER}, {"model_call_id": "c1", "model_ref": POLICY}]
    record = {
        "_ng_task_index": 1,
        "_ng_rollout_index": 0,
        "ng_agent_observations": {"invocations": [{"invocation_id": "main", "model_calls": refs}]},
    }
    result = merge_model_call_capture_into_record(record, [tmp_path])["ng_agent_observations"]
    (main,) = result["invocations"]
    assert main["model_calls"][0] == {"model_call_id": "c0", "model_ref": OTHER}  # left as it was
    assert main["model_calls"][1] == {"model_call_id": "c1", "model_ref": POLICY, "response_id": "c1"}
    assert {"code": "model_call_reference_unmatched", "invocation_id": "main", "detail": "c0"} in result[
        "gaps"
    ]
    assert {"code": "model_call_ownership_unavailable", "detail": "capture:c0:call_index=0"} in result["gaps"]


# ----------------------------------------------------------------------------- journal claims


@pytest.mark.parametrize("producer", ["middleware", "proxy"])
async def test_a_call_cancelled_while_its_journal_claim_is_in_flight_on_a_local_disk_releases_it(
    producer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spec 3: on a local disk the call waits for its journal claim before it is forwarded; a
    cancel meanwhile (the client left) must release the claim that lands after it, or the rollout
    would wait a whole TTL for a call that is gone."""
    from rollout_capture.producer import CaptureMiddleware
    from rollout_capture.producer.proxy import CaptureProxy
    from rollout_capture.producer.settings import ProxySettings

    capture_dir = str(tmp_path / "caps")
    app: Any
    if producer == "middleware":
        app = CaptureMiddleware(ScriptedUpstream(), capture_dir=capture_dir, layout="journal")
    else:  # the upstream is never reached: the call is cancelled before it is forwarded
        app = CaptureProxy(
            ProxySettings(capture_dir=capture_dir, upstream="http://127.0.0.1:9", layout="journal")
        )
    store = app.writer.store
    assert store.writes_in_place and not app.writer.claims_in_background
    entered, gate = threading.Event(), threading.Event()
    create = store._backend.create

    def held_claim_commit(path: str, data: bytes) -> None:
        if "/claims/" in path:  # the claims stream's commit: held until the call is cancelled
            entered.set()
            assert gate.wait(30)
        create(path, data)

    monkeypatch.setattr(store._backend, "create", held_claim_commit)

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing is answered: {message}")

    call = asyncio.ensure_future(
        app(post_scope("/ng-rollout/r1/v1/chat/completions"), body_then_silence(), send)
    )
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        call.cancel()
        gate.set()  # the claim lands after the cancel
        with pytest.raises(asyncio.CancelledError):
            await call
        assert store.claims(["r1"]) == {}
        assert store.read("r1") == []  # cancelled before it was forwarded: no call to record
    finally:
        gate.set()
        await asyncio.to_thread(app.writer.close)


def test_a_claims_commit_holding_a_clear_goes_above_a_dead_writers_commit(tmp_path: Path) -> None:
    """A commit of claims alone may land in a hole (its number orders nothing); one that also
    holds a clear may not: a dead writer's claim commit above the hole existed before the clear,
    so the clear lands above it and the hole is filled with a tombstone (spec 2, "never below an
    existing commit"). Below it, the clear would read as older than that claim."""
    from rollout_capture.claims import claim_body, new_claim
    from rollout_capture.journal import clear_entry, commit_name, decode_commit, encode_commit
    from rollout_capture.journal.commits import claim_entry

    store = CaptureStore(str(tmp_path), layout="journal")
    backend = store._backend
    claims = store.journal_writer_of("claims")
    assert claims.write([claim_entry("w-0", new_claim("first", 600.0))]) == 0
    dead = new_claim("dead", 600.0)
    body = encode_commit("dead", "n2", [["claim", "q-0", dead.claim_id]], [claim_body(dead)], floor=1)
    backend.create(backend.path(commit_name(2, "claims")), body)  # its commit 1 never landed
    assert claims.write([claim_entry("w-1", new_claim("mine", 600.0)), clear_entry("q-0")]) == 3
    hole = backend.read_many([backend.path(commit_name(1, "claims"))])[0]
    assert hole is not None and decode_commit(1, hole).headers == []  # a tombstone, not the clear
    assert claims.skips == 1


# ----------------------------------------------------------------------------- call records


async def test_an_answer_never_held_reports_a_hold_of_exactly_zero() -> None:
    """Spec 11: ``capture_hold_ms`` is the wait from the answer's first message being ready to
    the claim being durable; an app that answers only once the claim is durable was never held,
    whatever the claim took."""
    from rollout_capture.producer import CaptureMiddleware

    capture_dir = f"memory://held-{uuid.uuid4().hex}"
    store = CaptureStore(capture_dir)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        # The claim visible, then its writer idle: the producer has taken its claim as durable.
        await asyncio.to_thread(wait_for, lambda: store.claims(["h-0"]), 30, "the claim")
        assert await asyncio.to_thread(middleware.writer.wait_idle, 30)
        await asyncio.sleep(0)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"id": "x", "choices": []}'})

    middleware = CaptureMiddleware(app, capture_dir=capture_dir, layout="journal")
    assert middleware.writer.claims_in_background  # an object store: answers are held
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        await middleware(post_scope("/ng-rollout/h-0/v1/chat/completions"), body_then_silence(), send)
    finally:
        await asyncio.to_thread(middleware.close)
    (row,) = store.read("h-0")
    assert sent[0]["status"] == 200 and row["capture_hold_ms"] == 0


def test_a_negative_time_to_first_token_alone_is_an_impossible_timing_gap() -> None:
    """Every other value of the call is possible: its ``latency_ttft_ms`` alone names it."""
    from .test_call_records_fast import BASE, both_ways

    line = orjson.dumps(BASE | {"model_call_id": "t1", "latency_ms": 500, "latency_ttft_ms": -1.5})
    full, typed, _ = both_ways([line])
    assert typed == full
    assert orjson.loads(full).get("gaps") == [
        {"code": "model_call_timing_impossible", "detail": "capture:t1:call_index=0: latency_ttft_ms=-1.5"}
    ]


# ----------------------------------------------------------------------------- finished runs


def _trigger(runs_root: str) -> Any:
    """The scheduled deployment's run-finished trigger, as the Prefect server evaluates it."""
    from prefect.server.events.schemas.automations import EventTrigger

    from rollout_capture.deployments.shipped import shipped_deployments

    scheduled = shipped_deployments(runs_root)[0]
    (trigger,) = scheduled.triggers
    trigger.set_deployment_id(uuid.uuid4())
    return EventTrigger.model_validate(trigger.as_automation().trigger.model_dump(mode="json"))


def _finished(run: str) -> Any:
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.types._datetime import now

    from rollout_capture.flows.events import RUN_FINISHED, run_resource

    return ReceivedEvent(id=uuid.uuid4(), event=RUN_FINISHED, resource=run_resource(run), occurred=now("UTC"))


def test_a_deployments_trigger_matches_the_runs_under_its_root_and_no_sibling_roots(tmp_path: Path) -> None:
    """A run under ``/runs/ab`` is not under ``/runs/a``: that deployment is not triggered."""
    a, ab = _trigger(str(tmp_path / "a")), _trigger(str(tmp_path / "ab"))
    under_a, under_ab = _finished(str(tmp_path / "a" / "r1")), _finished(str(tmp_path / "ab" / "r1"))
    assert a.covers(under_a) and ab.covers(under_ab)
    assert not a.covers(under_ab) and not ab.covers(under_a)
    assert _trigger(f"{tmp_path / 'a'}/").covers(under_a)  # a root given with its trailing slash


def test_a_run_finished_by_a_relative_path_triggers_its_roots_deployment(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mark_run_finished("runs/r/")`` from the runs' parent folder: the event the server stores
    names the run as every worker does (absolute, no trailing slash), so the trigger of the
    deployment registered for the absolute runs root matches it."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.events.worker import EventsWorker
    from prefect.server.events.schemas.events import ReceivedEvent

    from rollout_capture.flows.events import RUN_FINISHED, RUN_PREFIX, mark_run_finished

    name = f"r-{uuid.uuid4().hex[:12]}"
    make_run(tmp_path / "runs", name, finished=False)
    monkeypatch.chdir(tmp_path)
    assert mark_run_finished(f"runs/{name}/") == str(tmp_path / "runs" / name)

    def stored() -> list[Any]:
        EventsWorker.drain_all()
        wanted = EventFilter(
            event=EventNameFilter(name=[RUN_FINISHED]), resource=EventResourceFilter(id_prefix=[RUN_PREFIX])
        )
        with get_client(sync_client=True) as client:
            return [e for e in client.read_events(filter=wanted, limit=50).events if name in e.resource.id]

    (event,) = wait_for(stored, 30, "the run's finished event", poll_s=0.2)
    received = ReceivedEvent.model_validate(event.model_dump(mode="json"))
    assert _trigger(str(tmp_path / "runs")).covers(received), event.resource.id


# ----------------------------------------------------------------------------- trace export


def test_a_batch_refused_with_503_again_and_again_is_sent_again_within_patience(tmp_path: Path) -> None:
    """Phoenix answers 503 while its ingestion queue is full. The export sends the batch again
    (here at once: ``Retry-After: 0``) for up to ``patience_s`` instead of failing, however many
    times it is refused (seven: more than OpenTelemetry's own exporter, once used, tried), and
    every span lands once."""
    from rollout_capture.traces.exporter import export_traces

    captures = tmp_path / "captures"
    shutil.copytree(SAMPLE / "captures", captures)
    lines = [line for line in (SAMPLE / "rollouts.jsonl").read_bytes().splitlines() if line.strip()][:3]
    enriched = tmp_path / "rollouts.enriched.jsonl"
    merged = [merge_model_call_capture_into_record(orjson.loads(line), [captures]) for line in lines]
    enriched.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in merged))
    busy = OtlpReceiver(then=[503] * 7, retry_after="0")
    try:
        counts = export_traces(enriched, busy.url, patience_s=60)
        assert counts.spans > 0 and len({bytes(s.span_id) for s in busy.spans()}) == counts.spans
        assert len(busy.received) == 1 + 8  # the probe, 7 refusals of the one batch, then it landed
    finally:
        busy.stop()
