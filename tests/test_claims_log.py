"""The claims log (spec 3 and 11, extension): a producer's claims on a local disk appended to a log
of its own, with every promise of claim files kept. Real processes, killed for real."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import (
    CaptureStore,
    await_model_call_capture_quiescence,
    clear_model_call_captures_for_rollouts,
    merge_model_call_capture_into_record,
)
from rollout_capture.claims import Claim, new_claim
from rollout_capture.claims_log import ClaimsLogReader, ClaimsLogWriter
from rollout_capture.names import CLAIMS_LOG_DIR

from .conftest import Clock, wait_for, wait_ready
from .support.scripted_upstream import ScriptedUpstream

ROW = {"model_call_id": "m", "status_code": 200}


def logs(root: Path) -> list[str]:
    folder = root / CLAIMS_LOG_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def gaps(store: CaptureStore, rollout_id: str) -> list[dict[str, str]]:
    attached = merge_model_call_capture_into_record({"_ng_rollout_id": rollout_id}, [store])
    found: list[dict[str, str]] = attached["ng_model_call_capture"].get("gaps", [])
    return found


# ---------------------------------------------------------------- in one process


def test_a_claim_is_seen_by_another_reader_until_its_release(tmp_path: Path) -> None:
    writer = CaptureStore(tmp_path, claims="log")
    reader = CaptureStore(tmp_path)  # readers need no option
    with writer.claim("1-0", "a") as claim:
        assert [c.claim_id for c in reader.live_claims("1-0")] == [claim.claim_id]
        assert reader.has_any("1-0") and reader.listing("1-0").found
        assert gaps(reader, "1-0")[-1] == {"code": "model_call_capture_pending", "detail": "count=1"}
        assert not (tmp_path / "1-0.capture.claims").exists()  # no file per call
        writer.record("1-0", ROW)
    assert reader.claims(["1-0"]) == {} and reader.read("1-0") == [ROW]
    assert len(logs(tmp_path)) == 1  # the writer's log stays while it lives
    writer.close_claims_log()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1-0.capture.jsonl"]


def test_claim_files_of_old_producers_are_read_beside_the_log(tmp_path: Path) -> None:
    old, new = CaptureStore(tmp_path, claims="files"), CaptureStore(tmp_path, claims="log")
    reader = CaptureStore(tmp_path)
    with old.claim("2-0", "file"), new.claim("2-0", "logged"):
        assert (tmp_path / "2-0.capture.claims").is_dir() and logs(tmp_path)
        assert sorted(c.model_call_id or "" for c in reader.live_claims("2-0")) == ["file", "logged"]
        assert {"code": "model_call_capture_pending", "detail": "count=2"} in gaps(reader, "2-0")
    assert reader.claims(["2-0"]) == {}


def test_the_claims_log_is_for_local_disks(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from rollout_capture.producer.settings import ProducerSettings

    with pytest.raises(ValueError, match="claims log needs a local disk"):
        CaptureStore("memory://no-log", claims="log")
    with pytest.raises(ValidationError, match=r"claims=log \(ROLLOUT_CAPTURE_CLAIMS\) needs a local disk"):
        ProducerSettings(capture_dir="s3://bucket/caps", claims="log")
    assert ProducerSettings(capture_dir="s3://bucket/caps").claims == "auto"  # claim files or the journal
    with pytest.raises(ValueError, match="claims must be 'files' or 'log'"):
        CaptureStore(tmp_path, claims="both")  # type: ignore[arg-type]


def test_a_log_grown_past_its_size_is_replaced_and_the_old_goes_once_nothing_is_open(tmp_path: Path) -> None:
    writer = ClaimsLogWriter(str(tmp_path), max_bytes=600)
    reader = ClaimsLogReader(str(tmp_path))
    made: list[tuple[str, str, str]] = []  # (rollout, claim id, the log it went to)
    for n in range(8):  # past 600 bytes: later claims go to a fresh log, the old one still open
        claim = new_claim(f"c{n}", 60)
        writer.claim(f"r-{n}", claim)
        made.append((f"r-{n}", claim.claim_id, writer.log_names[-1]))
        if n == 0:
            reader.refresh()  # a reader that read the first log before it was replaced
    old, fresh = made[0][2], made[-1][2]
    assert old != fresh and writer.log_names == [old, fresh] and logs(tmp_path) == sorted([old, fresh])
    reader.refresh()
    assert reader.rollout_ids() == {f"r-{n}" for n in range(8)}  # read across both, nothing lost
    in_old = [(r, c) for r, c, log in made if log == old]
    for rollout_id, claim_id in in_old:
        assert old in logs(tmp_path)  # removed only once nothing in it is open
        writer.release(rollout_id, claim_id)
    assert logs(tmp_path) == [fresh]
    reader.refresh()
    assert reader.rollout_ids() == {r for r, _, log in made if log == fresh}
    for rollout_id, claim_id, log in made:
        if log == fresh:
            writer.release(rollout_id, claim_id)
    reader.refresh()
    assert reader.rollout_ids() == set() and logs(tmp_path) == [fresh]  # the current log stays
    writer.close()
    assert not (tmp_path / CLAIMS_LOG_DIR).exists()


def test_a_log_replaced_or_truncated_under_its_name_is_read_again_whole(tmp_path: Path) -> None:
    folder = tmp_path / CLAIMS_LOG_DIR
    folder.mkdir()
    body = {"claim_id": "a", "claimed_at": 1.0, "ttl_s": 1e12}
    log = folder / "h-1-x.jsonl"
    log.write_bytes(
        orjson.dumps(["claim", "t-0", body]) + b"\n" + orjson.dumps(["claim", "t-1", body]) + b"\n"
    )
    reader = ClaimsLogReader(str(tmp_path))
    reader.refresh()
    assert reader.rollout_ids() == {"t-0", "t-1"}
    log.write_bytes(orjson.dumps(["claim", "t-2", body]) + b"\n")  # shorter: not what was read
    reader.refresh()
    assert reader.rollout_ids() == {"t-2"}
    replacement = folder / ".swap"
    replacement.write_bytes(orjson.dumps(["claim", "t-3", {**body, "claim_id": "b"}]) + b"\n" * 40)
    os.replace(replacement, log)  # another file under the same name, longer than what was read
    reader.refresh()
    assert reader.rollout_ids() == {"t-3"}


def test_a_torn_or_foreign_line_is_skipped_and_a_clear_after_it_still_counts(tmp_path: Path) -> None:
    folder = tmp_path / CLAIMS_LOG_DIR
    folder.mkdir()
    body = {"claim_id": "a", "claimed_at": 1.0, "ttl_s": 1e12}
    (folder / "h-2-y.jsonl").write_bytes(
        orjson.dumps(["claim", "u-0", body]) + b"\nnot json\n[1]\n" + b'["claim","u-1",{"cla'
    )
    store = CaptureStore(tmp_path)
    (claim,) = store.claims(["u-0"])["u-0"]
    assert claim.claim_id == "a" and claim.expires_at is not None  # a dead writer's: abandoned at once
    assert store.expired_claims("u-0") == [claim] and store.claims(["u-1"]) == {}
    store.clear(["u-0"])  # appended on a fresh line: the torn one stays the only damage
    assert store.claims(["u-0"]) == {}
    assert logs(tmp_path) == []  # dead, nothing open: removed


def test_a_line_after_a_short_write_starts_on_a_fresh_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim's ``write`` cut short (a full disk) leaves a torn line; the next claim and its
    release start on a fresh line, so they are read, not lost inside the torn one."""
    writer = ClaimsLogWriter(str(tmp_path))
    reader = ClaimsLogReader(str(tmp_path))
    first, second = new_claim("cut", 60), new_claim("next", 60)
    real_write = os.write

    def short_once(fd: int, data: bytes) -> int:
        monkeypatch.setattr(os, "write", real_write)
        return real_write(fd, data[: len(data) // 2])

    monkeypatch.setattr(os, "write", short_once)
    with pytest.raises(OSError, match="cut short"):
        writer.claim("c-0", first)
    monkeypatch.setattr(os, "write", real_write)
    writer.claim("c-1", second)
    reader.refresh()
    assert reader.rollout_ids() == {"c-1"}  # the torn claim is no claim; the next one is whole
    writer.release("c-1", second.claim_id)
    reader.refresh()
    assert reader.rollout_ids() == set()
    writer.close()


# ---------------------------------------------------------------- writer processes, killed


def _claim_then_hang(url: str, ready: Any, go_on: Any, done: Any) -> None:
    store = CaptureStore(url, claims="log")
    store.record("k-0", {**ROW, "model_call_id": "before"})
    context = store.claim("k-0", "during", ttl_s=300)
    context.__enter__()  # a call in flight
    ready.set()
    if go_on.wait(120):  # cleared meanwhile; its release still lands, then a fresh claim
        context.__exit__(None, None, None)
        store.claim("k-0", "fresh", ttl_s=300).__enter__()
        done.set()
        threading.Event().wait(120)


def _spawn_claimer(url: str) -> tuple[Any, Any, Any, Any]:
    context = multiprocessing.get_context("spawn")
    ready, go_on, done = context.Event(), context.Event(), context.Event()
    process = context.Process(target=_claim_then_hang, args=(url, ready, go_on, done))
    process.start()
    wait_ready(ready, process)
    return process, go_on, done, ready


async def test_a_killed_writer_leaves_its_rows_and_a_claim_pending_then_abandoned(tmp_path: Path) -> None:
    url = str(tmp_path / "caps")
    process, _, _, _ = _spawn_claimer(url)
    store = CaptureStore(url)
    try:
        (claim,) = store.live_claims("k-0")  # its writer lives: pending, for as long as its TTL
        assert claim.model_call_id == "during"
        assert {"code": "model_call_capture_pending", "detail": "count=1"} in gaps(store, "k-0")
        assert not await await_model_call_capture_quiescence("k-0", [store], timeout_s=0.1)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
    # Its log's lock is free: nobody can release the claim any more, so it is abandoned now,
    # not after its TTL (300 s), and the rows written before the kill are read.
    assert await await_model_call_capture_quiescence("k-0", [store], timeout_s=30)
    assert [row["model_call_id"] for row in store.read("k-0")] == ["before"]
    assert store.expired_claims("k-0")[0].model_call_id == "during"
    assert {"code": "model_call_capture_claim_abandoned", "detail": "count=1"} in gaps(store, "k-0")
    assert len(logs(tmp_path / "caps")) == 1  # kept: it holds the abandoned claim
    clear_model_call_captures_for_rollouts([{"_ng_rollout_id": "k-0"}], [store])
    assert store.claims(["k-0"]) == {} and not store.has_any("k-0")
    assert logs(tmp_path / "caps") == []  # cleared, dead, nothing open: removed


def test_clearing_voids_a_live_writers_claims_and_later_ones_count(tmp_path: Path) -> None:
    url = str(tmp_path / "caps")
    process, go_on, done, _ = _spawn_claimer(url)
    store = CaptureStore(url)
    try:
        assert len(store.live_claims("k-0")) == 1
        store.clear(["k-0"])  # a fresh run never sees the old attempt's claims
        assert store.claims(["k-0"]) == {} and not store.has_any("k-0")
        go_on.set()  # the old call releases (a claim already void), then a new call claims
        wait_ready(done, process, "the old call's release and a fresh claim")
        (fresh,) = store.live_claims("k-0")
        assert fresh.model_call_id == "fresh"
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)


def _claim_behind_then_hang(url: str, ttl_s: float, ready: Any) -> None:
    """A producer whose clock is two TTLs behind: its claim says it lapsed long ago."""
    import time

    from rollout_capture.claims import clock_set

    store = CaptureStore(url, claims="log")
    with clock_set(lambda: time.time() - 2 * ttl_s):
        store.claim("s-0", "skewed", ttl_s=ttl_s).__enter__()  # a call in flight, never released
    ready.set()
    threading.Event().wait(120)


@pytest.mark.parametrize("reader_ahead_s", [0.0, 3600.0])
async def test_a_live_writers_claims_are_live_whatever_the_clocks_say(
    tmp_path: Path, clock: Clock, reader_ahead_s: float
) -> None:
    """Its log's lock says the writer lives: its open claim is pending, though its claimed_at is
    two TTLs back by the reader's clock (and an hour more with the reader's clock ahead); once
    the writer is killed the claim is abandoned at once, even by a reader whose clock is behind."""
    url, ttl_s = str(tmp_path / "caps"), 30.0
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_claim_behind_then_hang, args=(url, ttl_s, ready))
    process.start()
    store = CaptureStore(url)
    try:
        wait_ready(ready, process)
        clock.advance(reader_ahead_s)
        (claim,) = store.live_claims("s-0")
        assert claim.model_call_id == "skewed"
        assert claim.claimed_at + claim.ttl_s < clock.now  # lapsed, by the clocks
        assert store.expired_claims("s-0") == []
        assert {"code": "model_call_capture_pending", "detail": "count=1"} in gaps(store, "s-0")
        assert not await await_model_call_capture_quiescence("s-0", [store], timeout_s=0.1, poll_s=0.02)
    finally:
        os.kill(process.pid or 0, signal.SIGKILL)
        process.join(30)
    clock.advance(-2 * 3600.0)  # a reader whose clock is now behind the writer's claim
    assert await await_model_call_capture_quiescence("s-0", [store], timeout_s=5, poll_s=0.02)
    assert [c.model_call_id for c in store.expired_claims("s-0")] == ["skewed"]
    assert {"code": "model_call_capture_claim_abandoned", "detail": "count=1"} in gaps(store, "s-0")


def _race_writer(url: str, claims: str, writer: int, calls: int, published: Any, max_bytes: int) -> None:
    """Threads making calls in the producer's order: claim, publish, row written, fsync, release,
    row lock let go; the log replaced every few calls (``max_bytes``) while claims are open."""
    import rollout_capture.claims_log as claims_log

    claims_log.MAX_LOG_BYTES = max_bytes
    store = CaptureStore(url, claims=claims)  # type: ignore[arg-type]

    def calls_of(thread: int) -> None:
        for n in range(calls):
            rollout_id = f"w{writer}-{thread}-{n}"
            context = store.claim(rollout_id, f"{n}")
            context.__enter__()
            published[thread] = n + 1  # every call below this one has claimed
            blocking, finish = store.record_staged(rollout_id, {**ROW, "n": n})
            blocking()
            context.__exit__(None, None, None)
            finish()

    threads = [threading.Thread(target=calls_of, args=(t,)) for t in range(len(published))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close_claims_log()


@pytest.mark.parametrize("claims", ["log", "files"])
def test_a_reader_racing_writers_never_finds_neither_claim_nor_row(tmp_path: Path, claims: str) -> None:
    """For a call that has claimed, a reader that reads claims and then rows finds one or the other."""
    url = str(tmp_path / "caps")
    context = multiprocessing.get_context("spawn")
    writers, threads, calls = 2, 3, 60
    published = [context.Array("i", threads) for _ in range(writers)]
    processes = [
        context.Process(target=_race_writer, args=(url, claims, w, calls, published[w], 700))
        for w in range(writers)
    ]
    for process in processes:
        process.start()
    store = CaptureStore(url)
    checked, violations, claimed_seen = 0, [], 0
    while any(p.is_alive() for p in processes) or not checked:
        started = [
            f"w{w}-{t}-{n}"
            for w in range(writers)
            for t in range(threads)
            for n in range(max(0, published[w][t] - 4), published[w][t])  # the calls maybe in flight
        ]
        held = store.claims(started)  # claims first ...
        claimed_seen += len(held)
        for rollout_id in started:
            if rollout_id not in held and not store.read(rollout_id):  # ... then rows
                violations.append(rollout_id)
        checked += len(started)
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    assert violations == [] and checked
    every = [f"w{w}-{t}-{n}" for w in range(writers) for t in range(threads) for n in range(calls)]
    assert store.claims(every) == {}
    assert all(len(store.read(r)) == 1 for r in every)
    assert logs(tmp_path / "caps") == []  # each writer removed its logs, nothing open in them


# ---------------------------------------------------------------- the producers


async def test_the_middleware_claims_in_the_log_before_the_app_answers(tmp_path: Path) -> None:
    """The claim is visible (to another process's reader) before the first byte of the answer."""
    from rollout_capture.producer.middleware import CaptureMiddleware

    from .test_middleware import post

    seen: list[Any] = []
    reader = CaptureStore(tmp_path)
    upstream = ScriptedUpstream()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":  # before anything is sent: the claim is there
            seen.append(reader.live_claims("v-0"))
        await upstream(scope, receive, send)

    middleware = CaptureMiddleware(app, capture_dir=str(tmp_path))
    assert middleware.writer is not None and middleware.writer.store.claims_mode == "log"
    answer = await post(middleware, "/ng-rollout/v-0/v1/chat/completions", {"model": "scripted"})
    assert answer.status_code == 200
    assert len(seen) == 1 and len(seen[0]) == 1 and not (tmp_path / "v-0.capture.claims").exists()
    assert reader.claims(["v-0"]) == {} and len(reader.read("v-0")) == 1
    middleware.close()
    assert logs(tmp_path) == []
    from rollout_capture.producer.settings import ProducerSettings

    told = ProducerSettings(capture_dir=str(tmp_path / "files"), claims="files")
    files = CaptureMiddleware(app, settings=told)
    assert files.writer is not None and files.writer.store.claims_mode == "files"


async def test_a_killed_proxy_leaves_its_claim_in_its_log_abandoned_at_once(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    from .test_proxy import kill_mid_stream, spawn_proxy

    proc, url = spawn_proxy(scripted_upstream[0], tmp_path)  # the default: the claims log
    store = CaptureStore(tmp_path)

    def in_the_log_alone(claims: list[Claim]) -> None:
        (claim,) = claims
        assert claim.ttl_s == 300 and logs(tmp_path) and not (tmp_path / "7-0.capture.claims").exists()

    outcome = kill_mid_stream(scripted_upstream, proc, url, store, "log-killed", in_the_log_alone)
    assert "error" in outcome
    assert await await_model_call_capture_quiescence("7-0", [store], timeout_s=15)
    assert {"code": "model_call_capture_claim_abandoned", "detail": "count=1"} in gaps(store, "7-0")


def test_a_proxy_told_files_writes_claim_files(scripted_upstream: tuple[str, Any], tmp_path: Path) -> None:
    from .test_proxy import spawn_proxy, stream_in_background

    proc, url = spawn_proxy(scripted_upstream[0], tmp_path, "--claims", "files")
    store = CaptureStore(tmp_path)
    try:
        thread, _ = stream_in_background(url, "8-0", "scripted-gated-files")
        wait_for(lambda: store.live_claims("8-0"))
        assert (tmp_path / "8-0.capture.claims").is_dir() and logs(tmp_path) == []
        scripted_upstream[1].gate("files").set()
        thread.join(30)
        wait_for(lambda: store.read("8-0"))
        assert store.claims(["8-0"]) == {}
    finally:
        scripted_upstream[1].gate("files").set()
        proc.terminate()
        proc.wait(30)
