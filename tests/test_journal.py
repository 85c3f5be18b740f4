"""The journal layout (spec 2, 3, 11, extension): group commit of claims, rows and releases into
put-if-absent objects, read back as every other layout is."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.batch import enrich_lines
from rollout_capture.journal import JOURNAL_DIR, clear_entry, commit_name, decode_commit, row_entry
from rollout_capture.producer.middleware import CaptureMiddleware

from .conftest import FAST_FAIL, S3, wait_for
from .support.producer_calls import body_then_silence, post_scope
from .support.scripted_upstream import ScriptedUpstream
from .test_concurrency import run_writers

BACKENDS = ["local", "memory", "s3"]
ROW = {"kind": "model_call", "dialect": "chat", "response": {"usage": {"prompt_tokens": 3}}}


@pytest.fixture(params=BACKENDS)
def url_options(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "caps"), {}
    if request.param == "memory":
        return f"memory://journal-{uuid.uuid4().hex}", {}
    s3: S3 = request.getfixturevalue("s3")
    return s3.url("caps"), s3.storage_options


def journal(url: str, options: dict[str, Any]) -> CaptureStore:
    return CaptureStore(url, storage_options=options, layout="journal")


def reader(url: str, options: dict[str, Any]) -> CaptureStore:
    """A store opened as any reader opens one (auto layout): it finds the journal itself."""
    return CaptureStore(url, storage_options=options)


def test_rows_claims_and_clearing_round_trip(url_options: tuple[str, dict[str, Any]]) -> None:
    url, options = url_options
    store = journal(url, options)
    with store.claim("r-1", "a") as claim:
        assert [c.claim_id for c in reader(url, options).live_claims("r-1")] == [claim.claim_id]
        store.record("r-1", {**ROW, "model_call_id": "a"})
    store.record("r-2", {**ROW, "model_call_id": "b"})
    store.record("r-1", {**ROW, "model_call_id": "c"})
    other = reader(url, options)
    assert [row["model_call_id"] for row in other.read("r-1")] == ["a", "c"]
    assert other.live_claims("r-1") == [] and other.has_any("r-2") and not other.has_any("r-3")
    other.clear(["r-1"])
    fresh = reader(url, options)
    assert fresh.read("r-1") == [] and not fresh.has_any("r-1")
    assert [row["model_call_id"] for row in fresh.read("r-2")] == ["b"]  # only the cleared rollout goes
    store.record("r-1", {**ROW, "model_call_id": "d"})  # a call after the clear counts again
    assert [row["model_call_id"] for row in reader(url, options).read("r-1")] == ["d"]


def test_calls_finishing_together_share_one_commit(tmp_path: Path) -> None:
    """Group commit: what is submitted while a commit is in flight lands in the next one."""
    store = journal(str(tmp_path), {})
    writer = store.journal_writer
    futures = [writer.submit([row_entry(f"g-{n}", {**ROW, "model_call_id": f"m{n}"})]) for n in range(200)]
    seqs = {future.result(timeout=30) for future in futures}
    assert len(seqs) < 20 and writer.commits == len(seqs)  # 200 rows, a handful of objects
    written = sorted(p.name for p in (tmp_path / JOURNAL_DIR).glob("*.jsonl"))
    assert written == [commit_name(s).rsplit("/", 1)[-1] for s in sorted(seqs)]
    read = reader(str(tmp_path), {})
    assert all(read.read(f"g-{n}") == [{**ROW, "model_call_id": f"m{n}"}] for n in range(200))


def test_a_third_of_put_answers_lost_loses_and_doubles_nothing(flaky_s3: tuple[S3, Any]) -> None:
    """A commit lands but its answer is lost: the retry meets If-None-Match, reads the commit back and
    knows it by its nonce, so its rows are neither written twice nor moved."""
    via, proxy = flaky_s3
    # A read timeout no loaded machine reaches: every answer missing is one the proxy cut.
    options = {**via.storage_options, "config_kwargs": {**FAST_FAIL["config_kwargs"], "read_timeout": 300}}
    store = journal(via.url("caps"), options)
    pattern = f"PUT /{via.bucket}/caps/{JOURNAL_DIR}/".encode()
    for n in range(30):
        if n % 3 == 0:
            proxy.lose_answer_on(pattern)
        store.record("lost-0", {**ROW, "model_call_id": f"m{n}"})
    assert proxy.lost == 10
    rows = reader(via.url("caps"), options).read("lost-0")
    assert [row["model_call_id"] for row in rows] == [f"m{n}" for n in range(30)]
    names = sorted(via.fs().ls(f"{via.bucket}/caps/{JOURNAL_DIR}", detail=False))
    assert [n.rsplit("/", 1)[-1] for n in names if n.endswith(".jsonl")] == [
        commit_name(s).split("/")[-1] for s in range(30)
    ]  # one commit per write, no hole, none twice


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CREATED = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


@pytest.mark.parametrize(
    "pieces",
    [
        [_CONTINUE, _CONTINUE + _CREATED],  # moto under load: werkzeug's late 100 and the answer at once
        [_CONTINUE + _CONTINUE + _CREATED],
        [_CONTINUE[:11], _CONTINUE[11:] + _CREATED[:10], _CREATED[10:]],
        [_CREATED],
    ],
    ids=["late-continue-with-answer", "one-piece", "split-anywhere", "no-continue"],
)
def test_the_fault_proxy_loses_the_answer_however_its_interim_answers_arrive(pieces: list[bytes]) -> None:
    """moto answers a PUT with two ``100 Continue`` (http.server's, then werkzeug's, the second
    sometimes after the body), and under load the second reached the fault proxy in one piece with
    the answer, which passed as "a 100": a loss armed for a PUT that never fired (issue 38). The
    interim answers get through, the answer never does, and the loss is counted before the client
    sees the connection end."""
    from .support.fault_proxy import FaultProxy

    store = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = store.accept()
        with conn:
            received = b""
            while b"\r\n\r\n" not in received:
                received += conn.recv(65536)
            for piece in pieces:
                conn.sendall(piece)

    threading.Thread(target=answer, daemon=True).start()
    proxy = FaultProxy("127.0.0.1", store.getsockname()[1])
    try:
        proxy.lose_answer_on(b"PUT /b/caps/_journal/")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=300) as client:
            client.sendall(b"PUT /b/caps/_journal/000000000000.jsonl HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            got = b""
            while data := client.recv(65536):
                got += data
            assert proxy.lost == 1
        assert got == b"".join(pieces).partition(b"HTTP/1.1 200")[0]  # every 100, never the answer
    finally:
        proxy.close()
        store.close()


def _commits(store: CaptureStore) -> list[int]:
    seqs = []
    seq = 0
    backend = store._backend
    while backend.read_many([backend.path(commit_name(seq))])[0] is not None:
        seqs.append(seq)
        seq += 1
    return seqs


@pytest.mark.parametrize("where", ["local", "s3"])
def test_writer_processes_share_one_gapless_order(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Four processes write one rollout at once: every row once, each writer's order kept, and the
    commits numbered 0..n-1 with no hole (so a later commit always sorts after an earlier one)."""
    if where == "local":
        url, options = str(tmp_path / "caps"), {}
    else:
        s3: S3 = request.getfixturevalue("s3")
        url, options = s3.url("caps"), s3.storage_options
    writers, count = 4, 25
    run_writers(url, options, "journal", writers, count)
    store = reader(url, options)
    rows, damaged = store.read_available("c-0")
    assert damaged == 0 and len(rows) == writers * count
    for writer in range(writers):
        assert [row["n"] for _, row in rows if row["writer"] == writer] == list(range(count))
    assert len(_commits(store)) == writers * count  # sync writes: one commit each, numbered without a hole
    backend = store._backend
    assert backend.read_many([backend.path(commit_name(writers * count))]) == [None]


def _claim_then_hang(url: str, options: dict[str, Any], ready: Any) -> None:
    store = CaptureStore(url, storage_options=options, layout="journal")
    store.record("k-0", {**ROW, "model_call_id": "before"})
    context = store.claim("k-0", "during", ttl_s=60)
    context.__enter__()  # durable: a call in flight
    ready.set()
    threading.Event().wait(120)


def test_a_killed_producer_leaves_its_rows_and_an_abandoned_claim(tmp_path: Path) -> None:
    url = str(tmp_path / "caps")
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_claim_then_hang, args=(url, {}, ready))
    process.start()
    assert ready.wait(60)
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    store = reader(url, {})
    assert [row["model_call_id"] for row in store.read("k-0")] == ["before"]
    claim = store.claims(["k-0"])["k-0"][0]
    assert claim.model_call_id == "during"
    assert store.live_claims("k-0", now=claim.claimed_at + 59) == [claim]
    assert store.expired_claims("k-0", now=claim.claimed_at + 61) == [claim]  # abandoned after its TTL


def test_the_merge_reads_the_same_whichever_layout_wrote_the_rows(tmp_path: Path) -> None:
    rows = {
        f"{t}-0": [{**ROW, "model_call_id": f"{t}-{n}", "latency_ms": 10.0 + n} for n in range(t % 4)]
        for t in range(12)
    }
    lines = [orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": 0, "reward": 1.0}) for t in range(13)]
    outputs = []
    for layout in ("objects", "journal"):
        store = CaptureStore(tmp_path / layout, layout=layout)  # type: ignore[arg-type]
        for rollout_id, written in rows.items():
            for row in written:
                store.record(rollout_id, row)
        batch = enrich_lines(lines, [CaptureStore(tmp_path / layout)], quiescence_timeout_s=0)
        outputs.append(batch.lines)
    assert outputs[0] == outputs[1]
    assert any(b"model_call" in line or b"calls" in line for line in outputs[1])


def test_a_damaged_commit_is_reported_and_hides_nothing_else(tmp_path: Path, caplog: Any) -> None:
    store = journal(str(tmp_path), {})
    store.record("d-0", {**ROW, "model_call_id": "a"})
    (tmp_path / commit_name(1)).write_bytes(b"not a journal\n")
    store.record("d-0", {**ROW, "model_call_id": "b"})  # finds 1 taken, writes 2
    with caplog.at_level("WARNING"):
        rows = reader(str(tmp_path), {}).read("d-0")
    assert [row["model_call_id"] for row in rows] == ["a", "b"]
    assert commit_name(1) in caplog.text and "cannot be read" in caplog.text
    with pytest.raises(ValueError, match="header is not JSON"):
        decode_commit(1, b"not a journal\n")


async def test_the_answer_waits_for_its_claim_but_the_call_does_not() -> None:
    """Spec 11 (object stores): the call is forwarded while its claim is written; the client's first
    byte waits until the claim is durable."""
    capture_dir = f"memory://claim-first-{uuid.uuid4().hex}"
    upstream = ScriptedUpstream()
    app = CaptureMiddleware(upstream, capture_dir=capture_dir, layout="journal")
    store = app.writer.store
    gate, entered = threading.Event(), threading.Event()
    writer = store.journal_writer_of("claims")
    commit = writer._commit

    def slow_commit(headers: list[list[str]], lines: list[bytes], **how: Any) -> int:
        entered.set()
        gate.wait(10)
        return commit(headers, lines, **how)

    writer._commit = slow_commit  # type: ignore[method-assign]
    sent: list[dict[str, Any]] = []
    forwarded = asyncio.Event()
    body = body_then_silence()

    async def receive() -> dict[str, Any]:
        message = await body()
        forwarded.set()
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = "/ng-rollout/w-0/v1/chat/completions"
    scope = post_scope(path)
    call = asyncio.ensure_future(app(scope, receive, send))
    assert await asyncio.to_thread(entered.wait, 10)
    await asyncio.wait_for(forwarded.wait(), 10)
    for _ in range(50):  # the app has answered by now; nothing may reach the client yet
        await asyncio.sleep(0.01)
    assert upstream.seen and sent == []
    gate.set()
    await asyncio.wait_for(call, 10)
    assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert [row["model_call_id"] for row in store.read("w-0")] and store.claims(["w-0"]) == {}


def test_the_merge_reads_a_journal_in_fewer_larger_gets(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    """1,200 rows written by calls finishing together: the merge reads each commit once (one GET
    a commit, not a row), plus the look past each stream's end."""
    writer = journal(s3.url("caps"), s3.storage_options).journal_writer
    futures = [
        writer.submit([row_entry(f"{r}-0", {**ROW, "model_call_id": f"{r}-{n}"})])
        for r in range(300)
        for n in range(4)
    ]
    commits = len({future.result(timeout=60) for future in futures})
    lines = [orjson.dumps({"_ng_task_index": r, "_ng_rollout_index": 0}) for r in range(300)]
    via, proxy = flaky_s3
    proxy.reset_counts()
    batch = enrich_lines(lines, [CaptureStore(via.url("caps"), storage_options=via.storage_options)])
    assert batch.stats.calls == 1200 and not batch.stats.gaps
    counts = proxy.reset_counts()
    # each commit once, plus the numbers past each stream's end: three a stream (contract 2), so
    # the bound holds however few commits a loaded machine grouped the rows into
    assert commits < 100 and counts["GET"] <= commits + 2 * 3
    assert counts.get("LIST", 0) <= 2 and counts.get("HEAD", 0) <= 2  # (is the last one read still there)


def test_a_journal_deleted_and_begun_again_is_read_afresh(tmp_path: Path) -> None:
    """A long-lived process (a worker enriching run after run) keeps its store of a path; if the
    capture dir is deleted and written again, its reader starts over rather than skip commits."""
    url = str(tmp_path / "caps")
    shared = reader(url, {})
    journal(url, {}).record("again-0", {**ROW, "model_call_id": "old"})
    journal(url, {}).record("again-0", {**ROW, "model_call_id": "old-2"})
    assert len(shared.read("again-0")) == 2
    shutil.rmtree(url)
    journal(url, {}).record("again-0", {**ROW, "model_call_id": "new"})
    assert [row["model_call_id"] for row in shared.read("again-0")] == ["new"]


def test_a_failed_commit_marks_its_rollouts_and_its_number_is_not_skipped(flaky_s3: tuple[S3, Any]) -> None:
    """The store refuses the commit: its rollouts are marked incomplete, the error reaches the caller,
    and the next commit takes the same number (no hole for readers to stop at)."""
    via, proxy = flaky_s3
    store = journal(via.url("caps"), via.storage_options)
    store.record("f-0", {**ROW, "model_call_id": "a"})
    proxy.deny_on(f"PUT /{via.bucket}/caps/{JOURNAL_DIR}/".encode())
    with pytest.raises(OSError):
        store.record("f-1", {**ROW, "model_call_id": "refused"})
    proxy.deny_on(None)
    store.record("f-1", {**ROW, "model_call_id": "b"})
    read = reader(via.url("caps"), via.storage_options)
    assert read.is_incomplete("f-1") and not read.is_incomplete("f-0")
    assert [row["model_call_id"] for row in read.read("f-1")] == ["b"]
    assert _commits(read) == [0, 1]  # the refused write's number went to the next commit


# ---------------------------------------------------------------------------- several commits in flight


def _ids(rows: list[dict[str, Any]]) -> list[str]:
    return [row["model_call_id"] for row in rows]


def _body(s3: S3, seq: int) -> bytes | None:
    path = f"{s3.bucket}/caps/{commit_name(seq)}"
    fs = s3.fs()
    return fs.cat_file(path) if fs.exists(path) else None


def test_lost_answers_with_several_commits_in_flight_lose_move_and_double_nothing(
    flaky_s3: tuple[S3, Any],
) -> None:
    """Eight rollouts written at once, five rows each, never waiting: commits overlap, a third of
    their answers are lost, and every rollout still reads its rows once each, in submission order."""
    via, proxy = flaky_s3
    store = journal(via.url("caps"), via.storage_options)
    writer = store.journal_writer
    assert writer.in_flight == 2  # object stores pipeline rows by default
    writer.in_flight = 4
    pattern = f"PUT /{via.bucket}/caps/{JOURNAL_DIR}/".encode()
    store.record("p-0", {**ROW, "model_call_id": "p0-first"})  # the first commit goes alone
    proxy.lose_every(pattern, 3)
    futures = []
    for n in range(5):
        for r in range(8):
            futures.append(writer.submit([row_entry(f"p-{r}", {**ROW, "model_call_id": f"p{r}-{n}"})]))
            threading.Event().wait(0.004)  # calls finishing one after another, not all at once
    seqs = [future.result(timeout=120) for future in futures]
    proxy.lose_every(None)
    assert proxy.lost >= 2 and proxy.lost * 4 >= writer.tries - 1  # a third of the answers lost
    assert writer.peak_in_flight > 1  # the commits did overlap
    for r in range(8):
        mine = seqs[r::8]
        assert mine == sorted(mine)  # in submission order
    read = reader(via.url("caps"), via.storage_options)
    for r in range(8):
        assert _ids(read.read(f"p-{r}")) == ["p0-first"] * (r == 0) + [f"p{r}-{n}" for n in range(5)]
    assert _commits(read) == list(range(writer.commits))  # no hole, nothing twice, no tombstone
    assert writer.tombstones == 0


def _pipelined_writer(url: str, options: dict[str, Any], k: int, turn: Any, steps: int, writers: int) -> None:
    """Background rollouts of its own written without waiting, while the shared rollout's steps
    go round the writers: step j is written by writer j % writers once step j - 1 is durable."""
    store = CaptureStore(url, storage_options=options, layout="journal")
    writer = store.journal_writer
    futures = []
    for step in range(k, steps, writers):
        while turn.value != step:
            # Keep commits in flight, and holes below them, on every host; bounded, so a slow
            # store is not flooded the longer a turn takes (the load would feed on itself).
            if len(futures) < 240 and sum(not future.done() for future in futures) < 12:
                for r in range(3):
                    futures.append(writer.submit([row_entry(f"bg{k}-{r}", {**ROW, "n": len(futures)})]))
            threading.Event().wait(0.01)
        writer.write([row_entry("s-0", {**ROW, "step": step, "writer": k})])
        with turn.get_lock():
            turn.value += 1
    for future in futures:
        future.result(timeout=120)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_pipelined_writer_processes_keep_each_rollouts_order(
    where: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three processes, four commits in flight each: a step of the shared rollout written after the
    previous one was acknowledged (on another host) reads after it, and every background rollout
    reads its rows once each, in the order its process submitted them."""
    monkeypatch.setenv("ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT", "4")  # more than the default, on disk too
    if where == "local":
        url, options = str(tmp_path / "caps"), {}
    else:
        s3: S3 = request.getfixturevalue("s3")
        url, options = s3.url("caps"), s3.storage_options
    context = multiprocessing.get_context("spawn")
    turn = context.Value("i", 0)
    writers, steps = 3, 18
    processes = [
        context.Process(target=_pipelined_writer, args=(url, options, k, turn, steps, writers))
        for k in range(writers)
    ]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(180)
            assert process.exitcode == 0
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    store = reader(url, options)
    assert [row["step"] for row in store.read("s-0")] == list(range(steps))
    assert [row["writer"] for row in store.read("s-0")] == [s % writers for s in range(steps)]
    for k in range(writers):
        ns = [row["n"] for r in range(3) for row in store.read(f"bg{k}-{r}")]
        assert sorted(ns) == list(range(len(ns))) and ns  # every background row once
        for r in range(3):
            mine = [row["n"] for row in store.read(f"bg{k}-{r}")]
            assert mine == sorted(mine)  # in submission order
    fs, root = fsspec.core.url_to_fs(url, **options)
    listed = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(f"{root}/{JOURNAL_DIR}", detail=False))
    seqs = _commits(store)
    assert [n for n in listed if n.endswith(".jsonl")] == [commit_name(s).rsplit("/", 1)[-1] for s in seqs]


def _hold_a_commit_then_hang(url: str, options: dict[str, Any], ready: Any) -> None:
    """Commit 0 alone, then three rollouts' commits at once; the proxy holds commit 1's put."""
    store = CaptureStore(url, storage_options=options, layout="journal")
    store.record("h-0", {**ROW, "model_call_id": "first"})
    writer = store.journal_writer
    for r in (1, 2, 3):
        writer.submit([row_entry(f"h-{r}", {**ROW, "model_call_id": f"in-flight-{r}"})])
        threading.Event().wait(0.3)  # each in a commit of its own
    ready.set()
    threading.Event().wait(120)


def test_a_writer_killed_with_commits_in_flight_leaves_a_hole_readers_fill(
    flaky_s3: tuple[S3, Any], s3: S3, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """SIGKILL with commit 1 still on the wire and commits 2 and 3 landed: commit 1 never lands,
    readers would stop there forever; an old hole is filled with a tombstone, put-if-absent, and
    every landed row is read."""
    import rollout_capture.journal as journal_module

    via, proxy = flaky_s3
    proxy.hold_on(f"PUT /{via.bucket}/caps/{commit_name(1)}".encode())
    monkeypatch.setenv("ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT", "4")  # the child's: three rows at once
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(
        target=_hold_a_commit_then_hang, args=(via.url("caps"), via.storage_options, ready)
    )
    process.start()
    try:
        assert ready.wait(60)
        for _ in range(300):
            if _body(s3, 2) is not None and _body(s3, 3) is not None:
                break
            threading.Event().wait(0.05)
        assert proxy.held == 1 and _body(s3, 1) is None and _body(s3, 3) is not None
    finally:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        proxy.release_held(drop=True)  # the dead writer's put never arrives
    monkeypatch.setattr(journal_module.commits, "HOLE_GRACE_S", 3600.0)  # however slow this machine is
    young = reader(s3.url("caps"), s3.storage_options)
    assert _ids(young.read("h-0")) == ["first"] and young.read("h-2") == []  # a young hole is waited on
    assert _body(s3, 1) is None
    monkeypatch.setattr(journal_module.commits, "HOLE_GRACE_S", 0.0)  # as if the grace had passed
    with caplog.at_level("WARNING"):
        store = reader(s3.url("caps"), s3.storage_options)
        assert _ids(store.read("h-2")) == ["in-flight-2"] and _ids(store.read("h-3")) == ["in-flight-3"]
    assert store.read("h-1") == [] and _ids(store.read("h-0")) == ["first"]
    tombstone = _body(s3, 1)
    assert tombstone is not None and decode_commit(1, tombstone).headers == []
    assert b'"tombstone":true' in tombstone and "filled with a tombstone" in caplog.text
    assert _ids(young.read("h-3")) == ["in-flight-3"]  # the waiting reader reads on too


def _hole_behind_a_read_only_credential(
    flaky_s3: tuple[S3, Any], s3: S3, monkeypatch: pytest.MonkeyPatch, prefix: str, rollout_id: str
) -> tuple[S3, Any]:
    """Commits 0 and 2 of ``rollout_id`` (rows "a" and "c"), 1 never landed, the hole old; the
    flaky endpoint refuses every PUT under the root (a read-only credential)."""
    import rollout_capture.journal as journal_module

    backend = CaptureStore(s3.url(prefix), storage_options=s3.storage_options)._backend
    backend.create(backend.path(commit_name(0)), _one_row(rollout_id, "a"))
    backend.create(backend.path(commit_name(2)), _one_row(rollout_id, "c"))  # 1 never landed
    monkeypatch.setattr(journal_module.commits, "HOLE_GRACE_S", 0.0)
    via, proxy = flaky_s3
    proxy.deny_on(f"PUT /{via.bucket}/{prefix}/".encode())
    return via, proxy


def test_a_reader_that_may_not_write_reports_the_hole_and_does_not_hang(
    flaky_s3: tuple[S3, Any], s3: S3, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    via, proxy = _hole_behind_a_read_only_credential(flaky_s3, s3, monkeypatch, "caps", "x-0")
    with caplog.at_level("WARNING"):
        assert _ids(reader(via.url("caps"), via.storage_options).read("x-0")) == ["a"]
    assert commit_name(1) in caplog.text and "cannot fill it" in caplog.text
    proxy.deny_on(None)
    assert _ids(reader(via.url("caps"), via.storage_options).read("x-0")) == ["a", "c"]


def test_a_reader_that_may_not_write_gives_the_record_a_pending_gap_naming_the_hole(
    flaky_s3: tuple[S3, Any], s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every PUT refused (403) and commit 1 missing below commit 2: the record has the one call it
    could read and says, as a pending gap naming the hole, that more may stand above it."""
    from rollout_capture import merge_model_call_capture_into_record

    via, proxy = _hole_behind_a_read_only_credential(flaky_s3, s3, monkeypatch, "gapcaps", "4-0")
    try:
        store = reader(via.url("gapcaps"), via.storage_options)
        record = {"_ng_task_index": 4, "_ng_rollout_index": 0}
        attachment = merge_model_call_capture_into_record(record, [store])["ng_model_call_capture"]
    finally:
        proxy.deny_on(None)
    assert attachment["metrics"]["num_calls"] == 1
    pending = [g for g in attachment.get("gaps", []) if g["code"] == "model_call_capture_pending"]
    assert len(pending) == 1 and commit_name(1) in pending[0]["detail"], attachment.get("gaps")
    writable = reader(s3.url("gapcaps"), s3.storage_options)
    again = merge_model_call_capture_into_record(dict(record), [writable])["ng_model_call_capture"]
    assert again["metrics"]["num_calls"] == 2 and "gaps" not in again  # filled: nothing pending


def test_a_row_is_never_put_below_a_commit_that_already_exists(tmp_path: Path) -> None:
    """Writer Y has written commit 0; a dead writer's commit 2 (the rollout's first row) landed
    while its commit 1 never did. Y's next row of the rollout goes above commit 2, not into the
    hole (which Y fills with a tombstone), so the rollout reads in the order its rows were durable."""
    store = journal(str(tmp_path), {})
    store.record("y-0", {**ROW, "model_call_id": "y-first"})
    backend = store._backend
    backend.create(backend.path(commit_name(2)), _one_row("r-0", "dead-writers"))  # 1 never landed
    seq = store.journal_writer.write([row_entry("r-0", {**ROW, "model_call_id": "y-second"})])
    assert seq == 3
    assert _ids(reader(str(tmp_path), {}).read("r-0")) == ["dead-writers", "y-second"]
    hole = backend.read_many([backend.path(commit_name(1))])[0]
    assert hole is not None and decode_commit(1, hole).headers == []  # a tombstone, not a real commit


def test_a_live_claim_below_a_dead_writers_clear_stays_open(tmp_path: Path) -> None:
    """A claim alone is put without looking above its number, so it can land in a hole below a
    clear that a dead writer left above it. The clear drops only the claims below its floor (all
    that existed when it was written): the stale claim goes, the live one stays open."""
    from rollout_capture.claims import claim_body, new_claim
    from rollout_capture.journal import encode_commit

    store = journal(str(tmp_path), {})
    backend = store._backend
    stale, live = new_claim("stale", 600.0), new_claim("live", 600.0)

    def claims_commit(seq: int, headers: list[list[str]], lines: list[bytes], floor: int) -> None:
        body = encode_commit("w", os.urandom(4).hex(), headers, lines, floor=floor)
        backend.create(backend.path(commit_name(seq, "claims")), body)

    claims_commit(0, [["claim", "q-0", stale.claim_id]], [claim_body(stale)], 0)
    claims_commit(2, [["clear", "q-0"]], [b"null"], 1)  # a dead clearer's, above the hole at 1
    claims_commit(1, [["claim", "q-0", live.claim_id]], [claim_body(live)], 1)  # put later, into it
    claims = reader(str(tmp_path), {}).claims(["q-0"])
    assert [c.claim_id for c in claims.get("q-0", [])] == [live.claim_id]


def _one_row(rollout_id: str, call: str) -> bytes:
    from rollout_capture.journal import encode_commit

    line = orjson.dumps({**ROW, "model_call_id": call})
    return encode_commit("test", uuid.uuid4().hex, [["row", rollout_id]], [line])


def test_a_late_put_into_a_tombstoned_number_is_renumbered_not_lost(
    flaky_s3: tuple[S3, Any], s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commit 1 is slow on the wire; commit 2 lands; a reader fills 1 with a tombstone. The late
    put then meets If-None-Match, finds a tombstone (not its nonce) and lands above: its row is
    read once, after everything acknowledged before it."""
    import rollout_capture.journal as journal_module

    via, proxy = flaky_s3
    store = journal(via.url("caps"), via.storage_options)
    writer = store.journal_writer
    store.record("l-0", {**ROW, "model_call_id": "a"})
    proxy.hold_on(f"PUT /{via.bucket}/caps/{commit_name(1)}".encode())
    late = writer.submit([row_entry("l-1", {**ROW, "model_call_id": "late"})])
    for _ in range(200):
        if proxy.held:
            break
        threading.Event().wait(0.02)
    other = writer.submit([row_entry("l-2", {**ROW, "model_call_id": "b"})])
    for _ in range(300):
        if _body(s3, 2) is not None:
            break
        threading.Event().wait(0.02)
    assert not other.done()  # landed at 2, but not acknowledged while 1 is missing
    monkeypatch.setattr(journal_module.commits, "HOLE_GRACE_S", 0.0)
    read = reader(s3.url("caps"), s3.storage_options)
    assert _ids(read.read("l-2")) == ["b"] and read.read("l-1") == []
    proxy.release_held()  # the late put arrives at a number already filled
    assert other.result(timeout=60) == 2
    assert late.result(timeout=60) == 3  # renumbered above, not lost
    assert _ids(read.read("l-1")) == ["late"] and _ids(read.read("l-0")) == ["a"]
    assert _ids(reader(s3.url("caps"), s3.storage_options).read("l-1")) == ["late"]
    tombstone = _body(s3, 1)
    assert tombstone is not None and decode_commit(1, tombstone).headers == []


def test_a_writer_joining_a_long_journal_reads_one_header_not_every_commit(
    flaky_s3: tuple[S3, Any], s3: S3
) -> None:
    """Before its first acknowledgement a writer must know every number below exists: the header
    of the commit below its own says below which number all did (``floor``)."""
    first = journal(s3.url("caps"), s3.storage_options)
    for n in range(40):
        first.record(f"j-{n % 3}", {**ROW, "model_call_id": f"m{n}"})
    via, proxy = flaky_s3
    joining = journal(via.url("caps"), via.storage_options)
    joining.require_put_if_absent()  # the store's proof (once a process), before the counted write
    proxy.reset_counts()
    joining.record("j-0", {**ROW, "model_call_id": "joined"})
    counts = proxy.reset_counts()
    # one header read, not 40, and one LIST of the numbers above its own (spec 2: never below)
    assert counts.get("PUT") == 1 and counts.get("GET", 0) <= 2
    assert counts.get("HEAD", 0) <= 16  # the tail found by doubling and bisecting
    assert _ids(reader(s3.url("caps"), s3.storage_options).read("j-0"))[-1] == "joined"
    assert _commits(joining) == list(range(41))


def test_the_merge_reads_a_pipelined_journal_as_the_objects_layout(tmp_path: Path, s3: S3) -> None:
    """Rows written with four commits in flight on S3 merge byte for byte as the objects layout's."""
    rows = {
        f"{t}-0": [{**ROW, "model_call_id": f"{t}-{n}", "latency_ms": 10.0 + n} for n in range(1 + t % 4)]
        for t in range(12)
    }
    lines = [orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": 0, "reward": 1.0}) for t in range(13)]
    objects = CaptureStore(tmp_path / "objects", layout="objects")
    for rollout_id, written in rows.items():
        for row in written:
            objects.record(rollout_id, row)
    writer = journal(s3.url("caps"), s3.storage_options).journal_writer
    writer.in_flight = 4
    writer.write([clear_entry("12-0")])  # its first commit goes alone: landed before the burst
    futures = []
    for n in range(4):  # every rollout's n-th row, one after another, never waiting
        for rollout_id, written in rows.items():
            if n < len(written):
                futures.append(writer.submit([row_entry(rollout_id, written[n])]))
                threading.Event().wait(0.002)
    for future in futures:
        future.result(timeout=60)
    assert writer.peak_in_flight > 1
    expected = enrich_lines(lines, [CaptureStore(tmp_path / "objects")], quiescence_timeout_s=0).lines
    merged = enrich_lines(
        lines, [CaptureStore(s3.url("caps"), storage_options=s3.storage_options)], quiescence_timeout_s=0
    ).lines
    assert merged == expected


def test_a_writer_fills_a_dead_writers_hole_below_its_commit(
    s3: S3, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Commits 0-9 but 5 (a writer died with 5 in flight): a writer joining lands at 10, and
    before acknowledging it fills 5 with a tombstone, so its row is readable at once."""
    import rollout_capture.journal as journal_module

    store = journal(s3.url("caps"), s3.storage_options)
    backend = store._backend
    for seq in [*range(5), *range(6, 10)]:
        backend.create(backend.path(commit_name(seq)), _one_row("d-0", f"m{seq}"))
    monkeypatch.setattr(journal_module.commits, "HOLE_GRACE_S", 0.0)
    with caplog.at_level("WARNING"):
        store.record("d-0", {**ROW, "model_call_id": "joined"})
    assert store.journal_writer.tombstones == 1 and "filled with a tombstone" in caplog.text
    tombstone = _body(s3, 5)
    assert tombstone is not None and decode_commit(5, tombstone).headers == []
    rows = reader(s3.url("caps"), s3.storage_options).read("d-0")
    assert _ids(rows) == [f"m{seq}" for seq in range(10) if seq != 5] + ["joined"]


@pytest.mark.parametrize("value", ["0", "two", "2/1/1", "65"])
def test_a_malformed_in_flight_setting_is_refused_when_the_producer_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Not at the first call, where a failed write would only be logged and the row lost."""
    from rollout_capture.producer.settings import ProducerSettings
    from rollout_capture.producer.writer import writer_for

    monkeypatch.setenv("ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT", value)
    settings = ProducerSettings(capture_dir=str(tmp_path), layout="journal")
    with pytest.raises(ValueError, match="ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT") as raised:
        writer_for(settings)
    assert repr(value) in str(raised.value)
    assert not (tmp_path / JOURNAL_DIR).exists()  # nothing written


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_row_costs_one_write_when_another_writer_took_the_number_its_look_found(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several writers of one root: writer Y's next number is 1 when writer X's commit lands there.
    Y's next call looks at its start and finds X's commit 1: its row goes to 2 with one put, never
    first trying the very number its look found (a try that fails, a read, then a second put)."""
    url = str(tmp_path / "caps") if where == "local" else f"memory://journal-{uuid.uuid4().hex}"
    y, x = journal(url, {}), journal(url, {})  # two writers, as two producer processes have
    y.record("y-0", {**ROW, "model_call_id": "y-first"})  # commit 0: Y's next is 1
    x.record("x-0", {**ROW, "model_call_id": "x-first"})  # X finds the tail: its commit is 1
    call = y.claim("r-0", "y-second")
    claimed = call.start()  # Y's call begins: its claim and its look
    assert claimed is not None and call.look is not None
    claimed.result(30)
    assert call.look.result(30) == 1  # X's commit, at the very number Y would hand out next
    backend = y._backend
    rows = backend.path(commit_name(0)).rsplit("/", 1)[0] + "/"
    puts: list[str] = []
    real = backend.create
    monkeypatch.setattr(backend, "create", lambda path, *a, **k: puts.append(path) or real(path, *a, **k))
    tries = y.journal_writer.tries
    seq = y.journal_record("r-0", {**ROW, "model_call_id": "y-second"}, release=call).result(30)
    assert seq == 2
    assert [p for p in puts if p.startswith(rows) and "/claims/" not in p] == [backend.path(commit_name(2))]
    assert y.journal_writer.tries - tries == 1  # one write for the row
    assert _ids(reader(url, {}).read("r-0")) == ["y-second"] and reader(url, {}).live_claims("r-0") == []


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A fresh capture root on a local disk, moto, fake-gcs-server or Azurite."""
    if request.param == "local":
        return str(tmp_path / "caps"), {}
    from tests.conftest import open_store

    opened = open_store(request, request.param)
    return opened.url("caps"), opened.storage_options


def test_a_row_lands_above_every_commit_that_existed_at_its_calls_start(
    any_store: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: the look is taken at the call's start, beside its claim. A dead writer's commit 2
    (the rollout's first row) stood above the hole 1 when the call began: the call's row lands
    above it, the hole is filled with a tombstone, and the row's commit looks at nothing once the
    upstream has answered (its look was done while the upstream answered: one put)."""
    url, options = any_store
    store = journal(url, options)
    store.record("y-0", {**ROW, "model_call_id": "y-first"})  # commit 0: the writer's next is 1
    backend = store._backend
    backend.create(backend.path(commit_name(2)), _one_row("r-0", "dead-writers"))  # 1 never landed
    call = store.claim("r-0", "y-second")
    claimed = call.start()  # the call begins: its claim and its look
    assert claimed is not None and call.look is not None
    claimed.result(30)
    assert call.look.result(30) == 2  # what existed above the writer's next number
    looked: list[str] = []
    for name in ("existing", "exists"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _n=name, _real=real: looked.append(_n) or _real(*a))
    seq = store.journal_record("r-0", {**ROW, "model_call_id": "y-second"}, release=call).result(30)
    assert seq == 3 and looked == []  # above the dead writer's commit, with no look after the answer
    assert _ids(reader(url, options).read("r-0")) == ["dead-writers", "y-second"]
    assert reader(url, options).live_claims("r-0") == []  # released with the row
    hole = backend.read_many([backend.path(commit_name(1))])[0]
    assert hole is not None and decode_commit(1, hole).headers == []  # a tombstone, not a real commit


def test_a_hole_in_a_jobs_listing_is_filled_once_old_and_read_past(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read plan (a job's listing of the root showing commits 0 and 2): the missing 1 is waited
    on while young (the record's gap names it), filled with a tombstone once old, and read past."""
    import rollout_capture.journal as journal_module
    from rollout_capture.backends import ListingScope

    backend = CaptureStore(s3.url("caps"), storage_options=s3.storage_options)._backend
    backend.create(backend.path(commit_name(0)), _one_row("x-0", "a"))
    backend.create(backend.path(commit_name(2)), _one_row("x-0", "c"))  # 1 never landed
    lines = [orjson.dumps({"_ng_task_index": "x", "_ng_rollout_index": r}) for r in range(40)]
    monkeypatch.setattr(journal_module.commits, "HOLE_GRACE_S", 3600.0)
    young = reader(s3.url("caps"), s3.storage_options)
    batch = enrich_lines(lines, [young], scope=ListingScope("young", 40), quiescence_timeout_s=0)
    gaps = orjson.loads(batch.lines[0])["ng_model_call_capture"]["gaps"]
    assert any(commit_name(1) in str(gap) for gap in gaps) and backend.read_many(
        [backend.path(commit_name(1))]
    ) == [None]
    monkeypatch.setattr(journal_module.commits, "HOLE_GRACE_S", 0.0)  # as if the grace had passed
    store = reader(s3.url("caps"), s3.storage_options)
    batch = enrich_lines(lines, [store], scope=ListingScope("old", 40), quiescence_timeout_s=0)
    assert orjson.loads(batch.lines[0])["ng_model_call_capture"]["metrics"]["num_calls"] == 2
    assert decode_commit(1, backend.read_many([backend.path(commit_name(1))])[0] or b"").headers == []


def test_a_second_look_goes_beside_one_on_the_wire_only_while_rows_wait_or_looks_are_not_shared(
    flaky_s3: tuple[S3, Any],
) -> None:
    """Two looks at once are allowed (undelayed, as producers set them while answers wait): while
    rows have waited for their looks, a look asked while another's listing is held on the wire goes
    beside it and is answered first; a writer whose rows never waited and whose looks each served
    several calls keeps one listing at a time, the second sent once the first is answered (issue
    48: a second look mostly doubled the listings on an agent's calls at 32 clients); one whose
    looks served a call each (a few clients) sends it beside (it costs no listing a call would
    have shared); producers behind a slow store set ``rows_wait_share`` below 0: two at once
    whatever rows waited."""
    via, wire = flaky_s3
    listing = b"list-type="

    def writer_of(root: str) -> Any:
        writer = journal(via.url(root), via.storage_options).journal_writer_of("rows")
        writer.look_delay_s, writer.look_in_flight = 0.0, 2
        return writer

    def held_look(writer: Any) -> Any:
        held = wire.held
        wire.hold_on(listing)
        first = writer.look()
        wait_for(lambda: wire.held == held + 1, 10, "a look's listing held on the wire")
        return first

    def second_goes_beside(writer: Any) -> None:
        first = held_look(writer)
        second = writer.look()
        wait_for(second.done, 10, "the second look, beside the held one")
        assert not first.done()
        wire.release_held()
        first.result(30)

    waited = writer_of("looks-waited")
    for n in range(4):  # rows submitted as their looks start, the listings held: they wait for them
        wire.hold_on(listing)
        look = waited.look()
        row = waited.submit([row_entry("r-0", {**ROW, "model_call_id": f"c{n}"})], look=look)
        wait_for(lambda n=n: wire.held == n + 1, 10, "a look's listing held on the wire")
        wire.release_held()
        row.result(30)
    second_goes_beside(waited)

    fresh = writer_of("looks-fresh")
    fresh.look().result(30)  # its tail found: a look is one listing from here
    assert fresh.look_calls == 1
    second_goes_beside(fresh)  # a look served one call: the next goes beside it

    fresh.look_calls = 8.0  # looks served 8 calls each, lately (as at 32 clients)
    first = held_look(fresh)
    second = fresh.look()
    lists_when_answered: list[int] = []
    first.add_done_callback(lambda _: lists_when_answered.append(wire.requests.get("LIST", 0)))
    lists = wire.requests.get("LIST", 0)
    wire.release_held()
    first.result(30), second.result(30)
    # The held listing is counted once forwarded: the second's was not sent while it was out.
    assert lists_when_answered == [lists + 1]
    assert wire.requests.get("LIST", 0) == lists + 2

    fresh.rows_wait_share = -1.0
    second_goes_beside(fresh)
