"""The journal committers a proxy's workers share (issue 48): every worker's entries land through
the parent's one writer a stream, paced by the busiest worker; a worker whose parent is gone
commits on its own (what was in flight there fails, what was not sent lands)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.journal import JournalWriter, row_entry
from rollout_capture.producer.shared_journal import JournalHost, SharedJournal, SharedJournalError

from .conftest import S3, wait_for
from .support.fault_proxy import FaultProxy
from .support.producer_calls import DIALECTS, sdk_call
from .support.scripted_upstream import chat_events
from .test_proxy import Spawned, stream_in_background

ROW = {"kind": "model_call", "dialect": "chat"}


class Parent:
    """A parent's store and journal host, and its workers' stores sharing it (one process here)."""

    def __init__(self) -> None:
        self.url = f"memory://shared-{uuid.uuid4().hex}"
        self.store = CaptureStore(self.url, layout="journal")
        self.host = JournalHost(self.store)
        self.workers = 0

    def worker(self) -> tuple[CaptureStore, SharedJournal]:
        store = CaptureStore(self.url, layout="journal")
        shared = SharedJournal(self.host.link(self.workers))
        self.host.handed(self.workers)
        self.workers += 1
        store.commit_journal_through(shared.committer)
        return store, shared

    def writers(self) -> list[str]:
        """The writer of each commit of the rows stream, in order."""
        fs = fsspec.filesystem("memory")
        root = self.url.removeprefix("memory://")
        names = sorted(n for n in fs.find(f"/{root}/_journal") if "/claims/" not in n)
        return [str(orjson.loads(fs.cat(n).split(b"\n", 1)[0])["writer"]) for n in names]

    def writer_id(self) -> str:
        """The parent's writer of the rows stream."""
        writer = self.store.journal_writer_of("rows")
        assert isinstance(writer, JournalWriter)
        return writer.writer_id


@pytest.fixture
def parent() -> Iterator[Parent]:
    made = Parent()
    try:
        yield made
    finally:
        made.host.close()


def submit_row(store: CaptureStore, rollout_id: str, call: str) -> concurrent.futures.Future[int]:
    return store.journal_writer_of("rows").submit([row_entry(rollout_id, {**ROW, "model_call_id": call})])


def test_every_workers_rows_land_through_the_parents_one_writer(parent: Parent) -> None:
    workers = [parent.worker()[0], parent.worker()[0]]
    looks = [store.journal_writer_of("rows").look() for store in workers]
    futures = []
    for n in range(24):
        rows = workers[n % 2].journal_writer_of("rows")
        entry = row_entry(f"r-{n % 3}", {**ROW, "model_call_id": f"c{n}"})
        futures.append(rows.submit([entry], look=looks[n % 2]))
    claims = [workers[0].claim("r-0", "held").start(), workers[1].claim("r-1", "held-too").start()]
    assert all(isinstance(f.result(timeout=30), int) for f in [*futures, *claims, *looks])
    assert set(parent.writers()) == {parent.writer_id()}  # no worker wrote a commit of its own
    reader = CaptureStore(parent.url)
    for rollout in range(3):
        calls = [row["model_call_id"] for row in reader.read(f"r-{rollout}")]
        assert sorted(calls) == sorted(f"c{n}" for n in range(24) if n % 3 == rollout)
        for worker in range(2):  # each worker's in the order it submitted them
            mine = [f"c{n}" for n in range(24) if n % 3 == rollout and n % 2 == worker]
            assert [c for c in calls if c in mine] == mine
    assert {c.model_call_id for c in reader.live_claims("r-0") + reader.live_claims("r-1")} == {
        "held",
        "held-too",
    }


def test_the_parent_paces_its_writers_by_the_busiest_worker(parent: Parent) -> None:
    (a, _), (b, _) = parent.worker(), parent.worker()
    claims = parent.store.journal_writer_of("claims")
    for store, in_flight in ((a, 4), (b, 1)):
        store.journal_writer_of("claims").in_flight = in_flight
        store.journal_writer_of("rows").look_delay_s = 0.0 if in_flight == 4 else 0.06
    submit_row(a, "r-0", "x").result(timeout=30)  # every message before it was taken
    submit_row(b, "r-0", "y").result(timeout=30)
    assert (claims.in_flight, parent.store.journal_writer_of("rows").look_delay_s) == (4, 0.0)
    a.journal_writer_of("claims").in_flight = 2
    submit_row(a, "r-0", "z").result(timeout=30)
    assert claims.in_flight == 2


def test_a_row_that_cannot_be_built_fails_its_own_call_only(parent: Parent) -> None:
    store, _ = parent.worker()

    def broken() -> dict[str, Any]:
        raise ValueError("no row")

    rows = store.journal_writer_of("rows")
    bad = rows.submit([row_entry("r-0", broken)])
    good = submit_row(store, "r-0", "fine")
    assert isinstance(good.result(timeout=30), int)
    with pytest.raises(ValueError, match="no row"):
        bad.result(timeout=30)


def test_a_worker_whose_parent_is_gone_commits_on_its_own(
    parent: Parent, caplog: pytest.LogCaptureFixture
) -> None:
    store, _ = parent.worker()
    assert isinstance(submit_row(store, "r-0", "before").result(timeout=30), int)
    look = store.journal_writer_of("rows").look()
    look.result(timeout=30)
    parent.host.close()  # the parent's end goes, as when it is killed
    racing = {f"racing-{n}": submit_row(store, "r-0", f"racing-{n}") for n in range(3)}
    answered = set()
    for call, future in racing.items():  # sent before the worker saw its parent gone: they may
        with contextlib.suppress(SharedJournalError):  # fail (landed or not), never hang
            assert isinstance(future.result(timeout=30), int)
            answered.add(call)
    said = "this worker commits its journal entries itself"
    wait_for(lambda: said in caplog.text, 30, "the worker to see its parent gone")
    assert isinstance(submit_row(store, "r-0", "after").result(timeout=30), int)  # its own writer's
    later = store.journal_writer_of("rows").submit(
        [row_entry("r-0", {**ROW, "model_call_id": "later"})],
        look=look,  # a look the parent took
    )
    assert isinstance(later.result(timeout=30), int)
    calls = [row["model_call_id"] for row in CaptureStore(parent.url).read("r-0")]
    assert len(calls) == len(set(calls))  # nothing landed twice
    # what was answered is in the order it was answered; an entry that failed may still land,
    # at any time after (the parent's writer had it in flight): its rollout is marked incomplete
    acknowledged = [call for call in calls if call in {"before", "after", "later", *answered}]
    assert acknowledged[0] == "before" and acknowledged[-2:] == ["after", "later"]
    # what was answered landed; what failed may or may not have: nothing else is there
    assert answered <= set(calls) <= {"before", "after", "later", *racing}
    writers = parent.writers()
    assert writers[0] == parent.writer_id() != writers[-1]  # the worker's own writer took over


# ---------------------------------------------------------------- a proxy's workers on S3


def journal_writers(s3: S3, root: str) -> dict[str, set[str]]:
    """The writers of each stream's commits under ``root``."""
    fs = s3.fs()
    out: dict[str, set[str]] = {"rows": set(), "claims": set()}
    for name in fs.find(f"{s3.bucket}/{root}/_journal"):
        head = orjson.loads(fs.cat(name).split(b"\n", 1)[0])
        out["claims" if "/claims/" in name else "rows"].add(head["writer"])
    return out


def two_workers_on(s3: S3, upstream: str, root: str) -> Spawned:
    options = json.dumps(s3.storage_options)
    return Spawned(upstream, s3.url(root), "--workers", "2", "--storage-options", options)  # type: ignore[arg-type]


def test_two_workers_on_s3_commit_through_one_writer_and_race_for_no_number(
    flaky_s3: tuple[S3, FaultProxy], scripted_upstream: tuple[str, Any]
) -> None:
    """Calls of one rollout held open in both workers at once, then calls of others: every row
    lands once, each stream's commits are one writer's (the parent's) and no create is refused."""
    s3, wire = flaky_s3
    spawned = two_workers_on(s3, scripted_upstream[0], "caps")
    store = CaptureStore(s3.url("caps"), storage_options=s3.storage_options)
    rollout_id, gate, streams = "sh-0", "shared-2w", 8
    try:
        wait_for(lambda: len(spawned.workers()) == 2)
        held = [
            stream_in_background(spawned.url, rollout_id, f"scripted-gated-{gate}") for _ in range(streams)
        ]
        wait_for(lambda: len(store.live_claims(rollout_id)) == streams)
        assert len({claim.pid for claim in store.live_claims(rollout_id)}) == 2  # both workers hold calls
        for n in range(6):
            sdk_call(spawned.url, f"sh-{1 + n % 3}", DIALECTS[n % 3], stream=n % 2 == 1)
        scripted_upstream[1].gate(gate).set()
        for thread, _ in held:
            thread.join(30)
    finally:
        scripted_upstream[1].gate(gate).set()
        spawned.stop()
    assert all(outcome.get("body") == b"".join(chat_events(include_usage=False)) for _, outcome in held)
    rows = store.read(rollout_id)
    assert len({row["model_call_id"] for row in rows}) == len(rows) == streams
    assert [len(store.read(f"sh-{n}")) for n in (1, 2, 3)] == [2, 2, 2]
    assert store.claims([rollout_id, "sh-1", "sh-2", "sh-3"]) == {}
    writers = journal_writers(s3, "caps")
    assert [len(writers["rows"]), len(writers["claims"])] == [1, 1]
    # The three processes' startup proofs (a second create of one probe, refused), no commit's:
    # no create found its number taken.
    assert wire.statuses.get(412) == 3


def test_workers_whose_parent_is_killed_commit_their_rows_themselves(
    s3: S3, scripted_upstream: tuple[str, Any]
) -> None:
    spawned = two_workers_on(s3, scripted_upstream[0], "orphans")
    store = CaptureStore(s3.url("orphans"), storage_options=s3.storage_options)
    try:
        thread, outcome = stream_in_background(spawned.url, "11-0", "scripted-gated-orphaned-s3")
        wait_for(lambda: store.live_claims("11-0"))  # claimed through the parent's writer
        spawned.proc.send_signal(signal.SIGKILL)
        spawned.proc.wait(10)
        wait_for(lambda: any("commits its journal entries itself" in line for line in spawned.log))
        scripted_upstream[1].gate("orphaned-s3").set()
        thread.join(30)
    finally:
        scripted_upstream[1].gate("orphaned-s3").set()
        spawned.stop()
    assert outcome.get("body") == b"".join(chat_events(include_usage=False))
    (row,) = store.read("11-0")
    assert (row["status_code"], row["error_category"]) == (200, None)
    assert store.claims(["11-0"]) == {} and not store.snapshot("11-0").incomplete
    writers = journal_writers(s3, "orphans")
    assert len(writers["rows"]) == 1 and writers["rows"] != writers["claims"]  # the worker's own


def test_a_killed_worker_on_s3_leaves_its_claim_and_the_others_commit_through_the_parent(
    s3: S3, scripted_upstream: tuple[str, Any]
) -> None:
    """SIGKILL the worker streaming a held call: its client sees the connection die, its claim stays
    (to expire as abandoned), and the calls after it, through the other worker and the one that
    replaces it, land through the parent's one writer a stream."""
    spawned = two_workers_on(s3, scripted_upstream[0], "killed-worker")
    store = CaptureStore(s3.url("killed-worker"), storage_options=s3.storage_options)
    gate = "worker-killed-s3"
    try:
        wait_for(lambda: len(spawned.workers()) == 2)
        thread, outcome = stream_in_background(spawned.url, "12-0", f"scripted-gated-{gate}")
        (claim,) = wait_for(lambda: store.live_claims("12-0"))
        assert claim.pid in spawned.workers()
        os.kill(claim.pid, signal.SIGKILL)
        thread.join(30)
        wait_for(lambda: any("died (signal SIGKILL)" in line for line in spawned.log))
        wait_for(lambda: len(spawned.workers()) == 2 and claim.pid not in spawned.workers())
        for n in range(6):  # fresh connections, whichever worker takes them
            sdk_call(spawned.url, "12-1", DIALECTS[n % 3], stream=n % 2 == 1)
    finally:
        scripted_upstream[1].gate(gate).set()
        spawned.stop()
    assert "error" in outcome  # the client saw its connection die
    assert store.read("12-0") == [] and [c.pid for c in store.claims(["12-0"])["12-0"]] == [claim.pid]
    rows = store.read("12-1")
    assert len({row["model_call_id"] for row in rows}) == len(rows) == 6
    assert store.claims(["12-1"]) == {}
    writers = journal_writers(s3, "killed-worker")
    assert [len(writers["rows"]), len(writers["claims"])] == [1, 1]  # the parent's, before and after
