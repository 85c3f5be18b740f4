"""The answer held for its claim on an object store (spec 11, issues 26 and 27), both producers.

A real proxy and a real middleware writing the journal to moto through tests/support/fault_proxy.py,
which holds the call's claim commit on the wire: the client gets no byte before the claim is
durable, the upstream's answer is read (and timed) meanwhile, so the row's ``latency_ttft_ms`` and
``latency_ms`` are the upstream's own figures (its ``sent`` timestamps are the truth), the hold is
recorded apart as ``capture_hold_ms``, and a call cancelled while its claim is on the wire still
releases it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.producer import CaptureMiddleware, ProducerSettings
from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings

from .conftest import S3, wait_for
from .support.fault_proxy import FaultProxy
from .support.producer_calls import body_then_silence, post_scope
from .support.scripted_upstream import ScriptedUpstream
from .support.servers import ThreadedServer

HELD_S = 0.4  # how long the claim stays on the wire after the upstream's answer is all sent
SLACK_S = HELD_S / 2  # what the producer may take to see an upstream event: well below the hold


class Producer:
    """A proxy (in front of its own scripted upstream) or the middleware (around it), writing the
    journal to the bucket behind ``via``; ``app`` is the upstream whose ``sent`` times are truth."""

    def __init__(
        self,
        kind: str,
        via: S3,
        prefix: str,
        *,
        upstream: str | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.app = ScriptedUpstream()
        self.capture_dir = via.url(prefix)
        self.upstream: ThreadedServer | None = None
        common: dict[str, Any] = {"capture_dir": self.capture_dir, "storage_options": via.storage_options}
        if max_body_bytes is not None:
            common["max_body_bytes"] = max_body_bytes
        served: Any
        if kind == "proxy":
            self.upstream = ThreadedServer(self.app)
            served = CaptureProxy(ProxySettings(upstream=upstream or self.upstream.url, **common))
        else:
            served = CaptureMiddleware(self.app, settings=ProducerSettings(**common))
        self.writer = served.writer
        self.server = ThreadedServer(served)
        self.url = self.server.url
        self.store = CaptureStore(self.capture_dir, storage_options=via.storage_options)

    def sent(self, tag: str) -> dict[str, float]:
        """The upstream's own times for the call whose request carried ``tag``."""
        for seen in self.app.seen:
            if isinstance(seen["body"], dict) and seen["body"].get("user") == tag:
                return seen["sent"]  # type: ignore[no-any-return]
        return {}  # not reached the upstream yet

    def stop(self) -> None:
        self.server.stop()
        if self.upstream is not None:
            self.upstream.stop()


@pytest.fixture(params=["proxy", "middleware"])
def producer(
    request: pytest.FixtureRequest, flaky_s3: tuple[S3, FaultProxy]
) -> Iterator[tuple[Producer, FaultProxy]]:
    via, wire = flaky_s3
    cap = request.node.get_closest_marker("body_cap")  # a test's own body cap, in bytes
    served = Producer(request.param, via, "caps", max_body_bytes=cap.args[0] if cap is not None else None)
    try:
        with httpx.Client(base_url=served.url) as client:  # the journal's first commits, out of the way
            client.post("/ng-rollout/warm-0/v1/chat/completions", json={"model": "scripted"}).read()
        yield served, wire
    finally:
        wire.release_held()
        served.stop()


def _hold_claims(wire: FaultProxy, producer: Producer) -> None:
    """Hold the next claim commit unforwarded (the store has not seen it, so it is not durable)."""
    bucket_path = producer.capture_dir.removeprefix("s3://")
    wire.hold_on(f"PUT /{bucket_path}/_journal/claims/".encode())


class Client:
    """One call in a thread: when its first byte arrived (the test's clock) and what came."""

    def __init__(self, url: str, rollout_id: str, tag: str, *, stream: bool) -> None:
        self.first_byte: float | None = None
        self.body = b""
        self.status: int | None = None
        self.error: BaseException | None = None
        request = {"model": "scripted", "messages": [], "stream": stream, "user": tag}
        self._args = (url, f"/ng-rollout/{rollout_id}/v1/chat/completions", request)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        url, path, request = self._args
        try:
            with (
                httpx.Client(base_url=url, timeout=30) as client,
                client.stream("POST", path, json=request) as answer,
            ):
                for chunk in answer.iter_raw():
                    if chunk and self.first_byte is None:
                        self.first_byte = time.time()
                    self.body += chunk
                self.status = answer.status_code
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_answer_waits_for_its_claim_and_is_timed_at_the_upstream(
    producer: tuple[Producer, FaultProxy], stream: bool
) -> None:
    served, wire = producer
    tag = uuid.uuid4().hex
    _hold_claims(wire, served)
    client = Client(served.url, "held-1", tag, stream=stream)
    wait_for(lambda: wire.held == 1, 10, "the claim commit held on the wire")
    # The upstream answers whole while the claim is not durable: nothing holds it back.
    wait_for(lambda: "last" in served.sent(tag), 5, "the upstream's whole answer while the claim is held")
    sent = served.sent(tag)
    time.sleep(HELD_S)  # the claim stays on the wire well past the upstream's last byte
    assert client.first_byte is None and client.body == b""  # not one byte before the claim is durable
    released = time.time()
    wire.release_held()
    client.thread.join(30)
    assert client.error is None and client.status == 200 and client.first_byte is not None
    assert client.first_byte >= released  # the claim had to land first
    assert client.body.endswith(b"data: [DONE]\n\n") if stream else orjson.loads(client.body)["choices"]

    (row,) = wait_for(lambda: served.store.read("held-1"), 10, "the row")
    assert row["status_code"] == 200 and row["error_category"] is None
    forwarded = row["completed_at"] - row["latency_ms"] / 1000.0
    first_byte = forwarded + row["latency_ttft_ms"] / 1000.0
    # The upstream's own clock is the truth: each event seen when it left, not when the hold let it go.
    assert sent["first"] - 0.002 <= first_byte <= sent["first"] + SLACK_S
    assert sent["last"] - 0.002 <= row["completed_at"] <= sent["last"] + SLACK_S
    # The hold is apart: at least from the answer's last byte until the claim could land.
    hold_s = row["capture_hold_ms"] / 1000.0
    assert hold_s >= released - row["completed_at"] - 0.002
    assert row["latency_ttft_ms"] < row["capture_hold_ms"]
    assert served.store.claims(["held-1"]) == {}


@pytest.mark.body_cap(256)
def test_an_answer_past_the_body_cap_is_timed_at_the_upstream_not_the_hold(
    producer: tuple[Producer, FaultProxy],
) -> None:
    """Past the body cap the answer no longer waits in memory: the upstream goes unread until the
    claim is durable. That wait is ours, not the model's: ``latency_ms`` (and ``completed_at``)
    leave it out, and the hold is recorded apart (issue 37: 2962 ms recorded, 2958 of it the hold)."""
    served, wire = producer
    tag = uuid.uuid4().hex
    _hold_claims(wire, served)
    request = {"model": "scripted-slow-0.01", "messages": [], "stream": True, "user": tag}
    done: dict[str, Any] = {}

    def call() -> None:
        with httpx.Client(base_url=served.url, timeout=30) as client:
            done["answer"] = client.post("/ng-rollout/capped-1/v1/chat/completions", json=request)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    wait_for(lambda: wire.held == 1, 10, "the claim commit held on the wire")
    wait_for(lambda: "first" in served.sent(tag), 5, "the upstream's answer begun while the claim is held")
    time.sleep(HELD_S)  # the claim stays on the wire: the answer is past the cap, the upstream unread
    released = time.time()
    wire.release_held()
    thread.join(30)
    assert done["answer"].status_code == 200 and done["answer"].text.endswith("data: [DONE]\n\n")
    (row,) = wait_for(lambda: served.store.read("capped-1"), 10, "the row")
    assert row["error_category"] is None and row["capture_hold_ms"] / 1000.0 >= HELD_S
    # What the row says ends before the claim was let go: the hold is not in the answer's time
    # (the upstream's 13 events 10 ms apart, against a hold of HELD_S).
    assert row["completed_at"] < released
    assert row["latency_ms"] < row["capture_hold_ms"]
    # What the connection buffered meanwhile is timed as read, less the hold: a lower bound of
    # the upstream's own end, short by at most the hold (contract section 11).
    last, hold_s = served.sent(tag)["last"], row["capture_hold_ms"] / 1000.0
    assert last - hold_s - 0.002 <= row["completed_at"] <= last + SLACK_S


def _free_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("upstream", ["unreachable", "mid-stream"])
def test_a_proxy_call_whose_client_leaves_while_its_claim_is_on_the_wire_still_releases_it(
    flaky_s3: tuple[S3, FaultProxy], upstream: str
) -> None:
    """Spec 3: the client leaves (the call is cancelled) while the claim is on the wire, waiting for
    it to write its row (the upstream refused) or mid-stream; once the claim lands, the row releases
    it at once, not after its TTL (the rollout would wait out the quiescence timeout)."""
    via, wire = flaky_s3
    refused = None if upstream == "mid-stream" else f"http://127.0.0.1:{_free_port()}"
    served = Producer("proxy", via, "left", upstream=refused)
    tag = uuid.uuid4().hex
    try:
        with httpx.Client(base_url=served.url) as client:  # the journal's first commits, out of the way
            client.post("/ng-rollout/warm-0/v1/chat/completions", json={"model": "scripted"}).read()
        _hold_claims(wire, served)
        request = {"model": f"scripted-gated-{tag}", "messages": [], "stream": True, "user": tag}
        body = orjson.dumps(request)
        head = b"POST /ng-rollout/left-1/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        with socket.create_connection(("127.0.0.1", served.server.port), timeout=30) as sock:
            sock.sendall(head + body)  # no client library: it would wait for the (held) headers
            wait_for(lambda: wire.held == 1, 10, "the claim commit held on the wire")
            if refused is None:
                wait_for(lambda: "first" in served.sent(tag), 5, "the upstream's first event")
            else:
                time.sleep(0.2)  # refused at once: the call now waits for its claim to write its row
        # the client is gone (its connection closed) while the claim is still on the wire
        wait_for(lambda: not served.server.server.server_state.connections, 10, "the proxy to see it")
        time.sleep(0.05)  # its disconnect handled (the call cancelled) before the claim may land
        wire.release_held()
        (row,) = wait_for(lambda: served.store.read("left-1"), 10, "the row")
        wait_for(lambda: served.store.claims(["left-1"]) == {}, 10, "the claim released")
        # A stream its client left is cancelled, as NeMo Gym's model servers record it (issue 34).
        assert row["error_category"] == ("cancelled" if refused is None else "connection")
    finally:
        served.app.gate(tag).set()
        wire.release_held()
        served.stop()


async def test_a_middleware_call_cancelled_while_its_claim_is_on_the_wire_still_releases_it(
    flaky_s3: tuple[S3, FaultProxy],
) -> None:
    """The server cancels the call (a stop, a server that cancels on disconnect) while its journal
    claim is held on the wire: once the claim lands, the call's row releases it."""
    via, wire = flaky_s3
    capture_dir = via.url("mw-cancel")
    middleware = CaptureMiddleware(
        ScriptedUpstream(),
        settings=ProducerSettings(capture_dir=capture_dir, storage_options=via.storage_options),
    )
    wire.hold_on(f"PUT /{capture_dir.removeprefix('s3://')}/_journal/claims/".encode())
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        scope = post_scope("/ng-rollout/mw-c/v1/chat/completions")
        call = asyncio.ensure_future(middleware(scope, body_then_silence(), send))
        await asyncio.to_thread(wait_for, lambda: wire.held == 1, 10, "the claim commit held")
        for _ in range(20):  # the app answers whole meanwhile; its row waits for the claim
            await asyncio.sleep(0.01)
        call.cancel()
        await asyncio.sleep(0.05)
        assert not call.done()  # the row is still to be written: it waits for the claim
        wire.release_held()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 10)
        store = CaptureStore(capture_dir, storage_options=via.storage_options)
        assert len(store.read("mw-c")) == 1 and store.claims(["mw-c"]) == {}
    finally:
        wire.release_held()
        await asyncio.to_thread(middleware.close)


def test_a_claim_is_put_while_another_calls_claim_is_on_the_wire(
    producer: tuple[Producer, FaultProxy],
) -> None:
    """The hold is one claim commit, not a queue of them: while answers wait for their claims, a
    call's claim goes on the wire while another call's claim commit is still there (producers
    keep up to 4 in flight), not after it lands."""
    served, wire = producer
    _hold_claims(wire, served)
    first = Client(served.url, "queue-a", uuid.uuid4().hex, stream=False)
    wait_for(lambda: wire.held == 1, 10, "the first call's claim commit held on the wire")
    before = wire.requests.get("PUT", 0)
    second = Client(served.url, "queue-b", uuid.uuid4().hex, stream=False)
    wait_for(lambda: wire.requests.get("PUT", 0) > before, 10, "the second call's claim put meanwhile")
    wire.release_held()
    for client in (first, second):
        client.thread.join(30)
        assert client.error is None and client.status == 200


def test_claims_are_grouped_while_answers_do_not_wait_for_them(flaky_s3: tuple[S3, FaultProxy]) -> None:
    """Claims pacing (issues 37, 48): while almost no answer waits for its claim (the upstream
    slower than a claim commit), claims (and rows) keep one commit in flight, so the claims of calls
    that start while one is on the wire ride in one put; once answers wait long beside the
    upstream's time (a slow store), they go at once again (up to 4 claims, 2 rows, two looks); while
    they wait less, 2 claims commits and a second look only while rows wait for theirs."""
    from rollout_capture.journal.writer import ROWS_WAIT_SHARE
    from rollout_capture.producer.writer import CaptureWriter

    via, wire = flaky_s3
    store = CaptureStore(via.url("paced"), storage_options=via.storage_options, layout="journal")
    writer = CaptureWriter(store, claim_ttl_s=60.0)
    claims = store.journal_writer_of("claims")
    store.claim("warm-0", "m").start().result(30)  # type: ignore[union-attr]
    bucket_path = via.url("paced").removeprefix("s3://")

    def claim_puts_while_one_is_held(calls: int) -> int:
        before, held = wire.requests.get("PUT", 0), wire.held
        wire.hold_on(f"PUT /{bucket_path}/_journal/claims/".encode())
        first = store.claim("paced-0", "m").start()
        wait_for(lambda: wire.held == held + 1, 10, "the first claim commit held on the wire")
        rest = []
        for n in range(1, calls):
            rest.append(store.claim(f"paced-{n}", "m").start())
            if claims.in_flight > 1:  # it goes at once: on the wire before the next starts
                wait_for(lambda n=n: wire.requests.get("PUT", 0) >= before + n, 10, f"claim {n} put")
        wire.release_held()
        for future in [first, *rest]:
            assert future is not None
            future.result(30)
        return wire.requests.get("PUT", 0) - before

    rows = store.journal_writer_of("rows")
    assert (claims.in_flight, rows.rows_wait_share) == (4, -1.0)  # until answers show otherwise
    for _ in range(200):
        writer.answer_held(0.0, 0.02)
    assert claims.in_flight == 1 and rows.in_flight == 1 and rows.look_delay_s > 0  # grouped, shared
    assert claim_puts_while_one_is_held(4) == 2  # the held one; the three that started meanwhile: one
    for _ in range(10):
        writer.answer_held(0.5, 0.02)  # the store far slower than the upstream
    assert claims.in_flight == 4 and rows.in_flight == 2  # at once, beside those on the wire
    assert (rows.look_delay_s, rows.look_in_flight, rows.rows_wait_share) == (0, 2, -1.0)  # looks at once
    assert claim_puts_while_one_is_held(4) == 4  # each at once, beside the one on the wire
    for _ in range(100):
        writer.answer_held(0.01, 0.02)  # answers wait, less than the upstream's time
    assert claims.in_flight == 2 and rows.in_flight == 2
    # a second look only while rows wait for theirs: tests/test_journal.py
    assert (rows.look_delay_s, rows.look_in_flight, rows.rows_wait_share) == (0, 2, ROWS_WAIT_SHARE)
    writer.close()


BIG = 8_000_000  # the answer's padding: 8 MB, handed over at once


def _slow_client(port: int, rollout_id: str, tag: str) -> socket.socket:
    """A client that asks for a big plain answer and reads nothing yet (a small receive buffer)."""
    request = orjson.dumps({"model": f"scripted-big-{BIG}", "messages": [], "user": tag})
    head = f"POST /ng-rollout/{rollout_id}/v1/chat/completions HTTP/1.1\r\nhost: x\r\n".encode()
    head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(request)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + request)
    return sock


def _read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """The whole answer: its head and its body (by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:]
    )
    while len(body) < length:
        chunk = sock.recv(1 << 20)
        assert chunk, "the answer was cut short"
        body += chunk
    return head, body


@pytest.mark.parametrize("cap", [None, 1 << 20], ids=["within-the-cap", "past-the-cap"])
@pytest.mark.parametrize("kind", ["proxy", "middleware"])
def test_a_client_slower_than_the_upstream_is_not_in_the_answers_time_on_a_local_disk(
    tmp_path: Path, kind: str, cap: int | None
) -> None:
    """Issue 46 (9): on a local disk a client reading an 8 MB plain answer slowly had 3,182 ms
    recorded, the upstream having sent it at once. The answer waits for the client in the producer,
    up to the body cap, while the upstream is read on: the row is written (before the client's last
    byte) at the upstream's own end, before the client has read a byte. Past the cap the producer
    waits for the client, and leaves that wait out: the figures end before the client read on."""
    app = ScriptedUpstream()
    upstream = ThreadedServer(app) if kind == "proxy" else None
    common: dict[str, Any] = {"capture_dir": str(tmp_path)}
    if cap is not None:
        common["max_body_bytes"] = cap
    served: Any
    if upstream is not None:
        served = CaptureProxy(ProxySettings(upstream=upstream.url, **common))
    else:
        served = CaptureMiddleware(app, settings=ProducerSettings(**common))
    server = ThreadedServer(served)
    store = CaptureStore(tmp_path)
    tag = uuid.uuid4().hex
    try:
        with _slow_client(server.port, "slow-1", tag) as sock:
            if cap is None:  # all of it waits in the producer: the row lands before a byte is read
                wait_for(lambda: store.read("slow-1"), 30, "the row, the client having read nothing")
            else:  # past the cap the producer waits for the client, which does not read yet
                wait_for(
                    lambda: "first" in next((s["sent"] for s in app.seen if _tagged(s, tag)), {}),
                    30,
                    "the answer",
                )
                time.sleep(HELD_S)
            released = time.time()
            head, body = _read_answer(sock)
        assert head.startswith(b"HTTP/1.1 200") and len(orjson.loads(body)["padding"]) == BIG
        (row,) = wait_for(lambda: store.read("slow-1"), 10, "the row")
        assert row["status_code"] == 200 and row["error_category"] is None
        assert row["completed_at"] < released  # the client's pace is not the model's
        sent = next(s["sent"] for s in app.seen if _tagged(s, tag))
        if cap is None:
            assert sent["first"] - 0.002 <= row["completed_at"] <= sent["last"] + SLACK_S
        else:
            assert row["completed_at"] - row["latency_ms"] / 1000.0 <= sent["first"]
    finally:
        server.stop()
        if upstream is not None:
            upstream.stop()


def _tagged(seen: dict[str, Any], tag: str) -> bool:
    return isinstance(seen["body"], dict) and seen["body"].get("user") == tag
