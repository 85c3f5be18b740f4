"""``rollout_capture.producer.exchange``: what one call's request and answer make of its row
(spec 4, 5, 11), driven as the producers drive it, without a server or a store."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from rollout_capture.producer.classify import ErrorCategory
from rollout_capture.producer.exchange import Exchange
from rollout_capture.producer.routing import Dialect

JSON = [(b"content-type", b"application/json")]


def exchange(dialect: Dialect = "responses", *, cap: int = 10_000, server: str | None = "policy") -> Exchange:
    return Exchange("1-0", dialect, server_name=server, max_body_bytes=cap)


def answered(
    call: Exchange, request: bytes, chunks: list[bytes], status: int = 200
) -> tuple[bytes, dict[str, Any]]:
    """Drive a call through a plain (not streamed) answer: what reached the client, and the row."""
    call.prepare_request(request, whole=True)
    call.forwarding()
    call.response_started(status, JSON)
    sent = b"".join(call.body(chunk) for chunk in chunks)
    sent += call.end()
    return sent, call.row()


def test_a_json_answer_is_the_rows_response_and_reaches_the_client_byte_for_byte() -> None:
    answer = [b'{"id": "resp_1", ', b'"output": []}']
    sent, row = answered(exchange(), b'{"model": "m", "input": "hi"}', answer)
    assert sent == b"".join(answer)
    assert row["request"] == {"model": "m", "input": "hi"} and row["response"] == {
        "id": "resp_1",
        "output": [],
    }
    assert row["status_code"] == 200 and row["error_category"] is None and row["dialect"] == "responses"
    assert row["model_ref"] == {"type": "responses_api_models", "name": "policy"}
    assert len(row["model_call_id"]) == 32 and row["latency_ms"] >= 0 and row["latency_ttft_ms"] is not None


def test_one_chunk_stays_behind_until_the_answer_ends() -> None:
    call = exchange()
    call.prepare_request(b"{}", whole=True)
    call.response_started(200, JSON)
    assert call.body(b'{"a": ') == b""  # held: with a Content-Length the client would wait anyway
    assert call.body(b"1}") == b'{"a": '
    assert call.end() == b"1}"


@pytest.mark.parametrize(
    ("status", "category"), [(429, "rate_limit"), (404, "not_found"), (503, "upstream_error")]
)
def test_an_error_status_is_the_category_and_its_json_the_response(status: int, category: str) -> None:
    _, row = answered(exchange(), b"{}", [b'{"error": {"message": "no"}}'], status=status)
    assert row["status_code"] == status and row["error_category"] == category
    assert row["response"] == {"error": {"message": "no"}}


def test_an_answer_that_is_not_json_is_kept_raw_as_a_parse_error() -> None:
    _, row = answered(exchange(), b"{}", [b"<html>oops</html>"])
    assert row["response"] is None and row["response_raw"] == "<html>oops</html>"
    assert row["error_category"] == "capture_parse_error"


def test_an_answer_past_the_cap_keeps_its_first_bytes_and_its_outcome() -> None:
    body = orjson.dumps({"text": "x" * 100})
    sent, row = answered(exchange(cap=20), b"{}", [body[:50], body[50:]])
    assert sent == body  # the client gets all of it
    assert row["response"] is None and row["response_raw"] == body[:20].decode()
    assert row["response_truncated"] is True and row["error_category"] is None


def test_a_request_over_the_cap_or_not_json_is_kept_raw() -> None:
    call = exchange(cap=5)
    assert call.prepare_request(b'{"model": "m"}', whole=True) == b'{"model": "m"}'
    assert call.request is None and call.request_raw == '{"mod' and call.request_cut
    row = call.row()
    assert row["request_truncated"] is True and row["request_raw"] == '{"mod'
    other = exchange()
    other.prepare_request(b"[1, 2]", whole=True)
    assert other.request is None and other.request_raw == "[1, 2]"


def test_a_chat_stream_is_asked_for_usage_its_client_did_not_ask_for() -> None:
    call = exchange("chat")
    forwarded = call.prepare_request(b'{"stream": true, "messages": []}', whole=True)
    assert orjson.loads(forwarded)["stream_options"] == {"include_usage": True} and call.hide_usage
    asked = exchange("chat")
    body = b'{"stream": true, "stream_options": {"include_usage": true}, "messages": []}'
    assert asked.prepare_request(body, whole=True) == body and not asked.hide_usage
    plain = exchange("chat")
    assert plain.prepare_request(b'{"messages": []}', whole=True) == b'{"messages": []}'


def test_an_answer_broken_off_is_incomplete_or_a_timeout() -> None:
    call = exchange()
    call.prepare_request(b"{}", whole=True)
    call.response_started(200, JSON)
    call.body(b'{"id": "cut')
    call.broke_off()
    row = call.row()
    assert row["error_category"] == "incomplete" and row["response_raw"] == '{"id": "cut'
    silent = exchange()
    silent.prepare_request(b"{}", whole=True)
    silent.response_started(200, JSON)
    silent.broke_off(timed_out=True)
    assert silent.row()["error_category"] == "timeout"


def test_a_fault_outside_the_answer_wins_and_the_first_one_stays() -> None:
    call = exchange()
    call.prepare_request(b"{}", whole=True)
    call.failed(ErrorCategory.CANCELLED)
    call.failed(ErrorCategory.CONNECTION)
    assert call.row()["error_category"] == "cancelled"


def test_a_server_exception_is_classified_by_the_status_it_carries_else_its_type() -> None:
    class StatusError(Exception):
        status_code = 401
        response_content = b'{"error": "key"}'

    call = exchange()
    call.prepare_request(b"{}", whole=True)
    call.server_failed(StatusError())
    row = call.row()
    assert row["status_code"] == 401 and row["error_category"] == "auth"
    assert row["response"] == {"error": "key"} and row["response_raw"] == '{"error": "key"}'
    raised = exchange()
    raised.prepare_request(b"{}", whole=True)
    raised.server_failed(ConnectionResetError())
    assert raised.row()["error_category"] == "connection" and raised.row()["status_code"] is None


def test_a_row_without_a_server_name_has_no_model_ref() -> None:
    _, row = answered(exchange(server=None), b"{}", [b"{}"])
    assert row["model_ref"] is None and "capture_hold_ms" not in row


@pytest.mark.parametrize(
    ("status", "kept"),
    [(200, None), (201, None), (399, None), (400, 400), (401, 401), (422, 422), (429, 429), (500, 500)],
)
def test_the_proxy_keeps_the_upstreams_status_from_400_on(status: int, kept: int | None) -> None:
    """NeMo Gym 0.7.0's execution facts: an upstream's error status is kept, 400 the first of them
    (its vllm_model keeps its ClientResponseError's); a success keeps none (null, never 0)."""
    call = exchange("chat")
    call.forwarded_upstream()
    _, row = answered(
        call, b"{}", [b'{"error": {"message": "no"}}' if status >= 400 else b"{}"], status=status
    )
    assert (row["upstream_attempted"], row["response_source"]) == (True, "upstream")
    assert row["upstream_status_code"] == kept and row["local_response_reason"] is None


class SlowClient:
    """An ASGI ``send`` whose client takes each body message only when let (its ``taken`` in order)."""

    def __init__(self, fail: bool = False) -> None:
        self.taken: list[Any] = []
        self.let = asyncio.Event()
        self.fail = fail

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not self.let.is_set():
            await self.let.wait()
            if self.fail:
                raise OSError("the client is gone")
        self.taken.append(message.get("body", b"start"))


async def turns(n: int = 10) -> None:
    """A few turns of the loop: what can run without the client, has run."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_what_a_slow_client_has_not_taken_waits_in_order_and_the_producer_reads_on() -> None:
    """Spec 11 (issue 46): the answer's messages wait for a client slower than the upstream, up to
    the body cap, ``send`` returning at once, and go in order; past the cap the sender waits, and
    that wait is left out of the answer's times; the last message goes after all of them."""
    call = exchange(cap=10)
    client = SlowClient()
    send = call.to_client(client)
    call.forwarding()
    await send({"type": "http.response.start", "status": 200, "headers": JSON})
    for body in (b"a" * 6, b"b" * 6, b"c" * 6):  # the client takes none of them: each returns at once
        await asyncio.wait_for(send({"type": "http.response.body", "body": body, "more_body": True}), 5)
    assert client.taken == [b"start"]
    past_cap = asyncio.ensure_future(send({"type": "http.response.body", "body": b"d", "more_body": True}))
    await turns()
    assert not past_cap.done()  # 12 bytes wait, past the cap of 10: the sender waits for the client
    client.let.set()
    await asyncio.wait_for(past_cap, 5)
    await send({"type": "http.response.body", "body": b"e", "more_body": False})
    assert client.taken == [b"start", b"a" * 6, b"b" * 6, b"c" * 6, b"d", b"e"]
    assert call._paused > 0  # the wait past the cap, out of the figures


async def test_a_send_that_failed_while_waiting_is_raised_at_the_next_and_a_cancel_drops_the_rest() -> None:
    call = exchange()
    client = SlowClient(fail=True)
    send = call.to_client(client)
    await send({"type": "http.response.start", "status": 200, "headers": JSON})
    await send({"type": "http.response.body", "body": b"a", "more_body": True})  # waits for the client
    client.let.set()
    await turns()
    with pytest.raises(OSError, match="the client is gone"):
        await send({"type": "http.response.body", "body": b"b", "more_body": True})
    held = exchange()
    slow = SlowClient()
    answer = held.to_client(slow)
    await answer({"type": "http.response.start", "status": 200, "headers": JSON})
    await answer({"type": "http.response.body", "body": b"a", "more_body": True})
    await answer({"type": "http.response.body", "body": b"b", "more_body": True})
    held.answer_dropped()
    slow.let.set()
    await held.answer_settled()
    await turns()
    assert slow.taken == [b"start"]  # the call was cancelled: what waited is dropped


class _PacedWriter:
    """What an exchange tells a producer's claims pacing (a CaptureWriter's ``answer_held``), with
    a claim that lands when the test says."""

    claims_in_background = True

    def __init__(self) -> None:
        self.told: list[tuple[float, float]] = []
        self.landed: asyncio.Future[None] | None = None

    async def claim(self, rollout_id: str, model_call_id: str) -> None:
        self.landed = asyncio.get_running_loop().create_future()
        await self.landed

    def answer_held(self, hold_s: float, upstream_s: float) -> None:
        self.told.append((hold_s, upstream_s))


@pytest.mark.parametrize("claim_first", [True, False])
def test_the_pacing_hears_once_how_long_the_answer_waited_for_its_claim(claim_first: bool) -> None:
    """Issue 48: the claims pacing weighs each answer's wait for its claim against the upstream's
    time to it. Told once an answer: at once when the claim landed before the answer was ready
    (a wait of 0), else once the claim lands (the wait it caused), never twice."""

    async def run() -> list[tuple[float, float]]:
        call, writer = exchange(), _PacedWriter()
        await call.claim(writer)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert writer.landed is not None
        if claim_first:
            writer.landed.set_result(None)
            await asyncio.sleep(0.01)
            call.answer_ready()
        else:
            await asyncio.sleep(0.01)
            call.answer_ready()
            assert writer.told == []  # not yet: the answer waits
            await asyncio.sleep(0.02)
            writer.landed.set_result(None)
        await call.claim_settled()
        await asyncio.sleep(0)
        call.answer_ready()  # a later message: nothing more to tell
        return writer.told

    told = asyncio.run(run())
    assert len(told) == 1
    hold_s, upstream_s = told[0]
    assert upstream_s > 0
    assert hold_s == 0.0 if claim_first else hold_s > 0
