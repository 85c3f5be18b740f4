"""One captured call, from the client's request to its row (spec 4 and 11).

Shared by the middleware and the proxy: they move bytes, this decides what the row says and
keeps its lifecycle (claim, durable row, release). Bodies are kept up to a cap; past it the
row keeps the first bytes and says it was cut.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
import types
from collections.abc import Awaitable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from rollout_capture.producer.asgi import Message, Receive, Scope, Send, read_body
from rollout_capture.producer.classify import (
    ErrorCategory,
    category_for_exception,
    category_for_status,
    exception_http_answer,
)
from rollout_capture.producer.routing import VERIFIER_HEADER, Dialect, Route, header
from rollout_capture.producer.settings import ProducerSettings
from rollout_capture.producer.streams import JsonObject, StreamRelay
from rollout_capture.store import ClaimContext, finish_shielded

if TYPE_CHECKING:
    from rollout_capture.producer.writer import CaptureWriter

MODEL_REF_TYPE = "responses_api_models"
_ASK_USAGE = b'{"stream_options":{"include_usage":true},'
_RAW_STREAM_KEEP = 64 * 1024  # raw stream bytes kept for a row whose stream could not be read
_EXECUTION_KEYS = ("upstream_attempted", "response_source", "upstream_status_code", "local_response_reason")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""A model server's local answer to a prompt past the context (NeMo Gym's vLLM server): the
row's ``error_category`` too, as NeMo Gym writes it."""


def _decode(body: bytes) -> str:
    return body.decode("utf-8", "replace")


def _is_event_stream(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    kind = header(headers, b"content-type")
    return kind is not None and kind.lower().startswith(b"text/event-stream")


class Exchange:
    """What a producer learns about one call, and the row it makes of it."""

    def __init__(
        self,
        rollout_id: str,
        dialect: Dialect,
        *,
        server_name: str | None,
        max_body_bytes: int,
        verifier_invocation_id: str | None = None,
        client_session_id: str | None = None,
    ) -> None:
        self.rollout_id = rollout_id
        self.dialect = dialect
        self.server_name = server_name
        self.max_body_bytes = max_body_bytes
        self.verifier_invocation_id = verifier_invocation_id
        self.client_session_id = client_session_id
        self.model_call_id = os.urandom(16).hex()  # 32 hex digits, as uuid4().hex without its cost
        self.started_at = time.time()
        self._arrived = time.perf_counter()
        self._forwarded: float | None = None
        self._first_byte: float | None = None
        self._ended: float | None = None
        self.request: JsonObject | None = None
        self.request_raw: str | None = None
        self.request_cut = False
        self.hide_usage = False  # we asked a chat stream for usage its client did not want
        self.status_code: int | None = None
        self.fault: ErrorCategory | None = None
        self.broken = False  # the upstream's answer stopped before its end
        self._timed_out = False
        self.relay: StreamRelay | None = None
        self._body = bytearray()
        self._body_size = 0
        self._held = b""
        self.finished = False  # the upstream's answer ended normally
        self.row_written = False
        self._claim: ClaimContext | None = None  # released together with the row
        self._claiming: asyncio.Future[ClaimContext | None] | None = None  # a claim written meanwhile
        self._gated = False  # the answer's first byte waits for a claim written meanwhile (spec 11)
        self._answer_ready: float | None = None  # when the answer's first message was ready to go
        self._paused = 0.0  # seconds the upstream went unread, its answer past the cap waiting for the claim
        self._paused_at_first = 0.0  # of which before its first byte
        self._writer: CaptureWriter | None = None  # whose claim pacing hears if the answer waited
        self._claim_settled: float | None = None  # when the claim written meanwhile was durable
        self._claim_began = 0.0  # when it was submitted (the call forwarded meanwhile)
        self._raw_too = False  # an answer an exception carried: its body kept as text besides
        self._answer: HeldAnswer | None = None  # the client's side, when it waits for the claim
        # Who answered (NeMo Gym 0.7's execution facts, spec 5): said by the proxy, which knows,
        # or by the app under the middleware (NeMo Gym's request state); None: not said.
        self.execution: dict[str, Any] | None = None
        self._app_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ request

    def prepare_request(self, body: bytes, *, whole: bool) -> bytes:
        """Keep the client's request for the row; return the body to forward.

        ``whole`` is False when the producer stopped reading at the cap. A body over the
        cap is forwarded as it is and the row keeps its first bytes. A chat stream whose
        client did not ask for usage is asked for it.
        """
        if not whole or len(body) > self.max_body_bytes:
            self.request_cut = True
            self.request_raw = _decode(body[: self.max_body_bytes])
            return body
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            self.request_raw = _decode(body)
            return body
        self.request = parsed
        if self.dialect == "chat" and parsed.get("stream") is True:
            options = parsed.get("stream_options")
            options = options if isinstance(options, dict) else {}
            if options.get("include_usage") is not True:
                self.hide_usage = True
                opening = body.lstrip()
                if "stream_options" not in parsed and opening[:1] == b"{":
                    # Added in front of the client's own bytes: no second serialization of
                    # the whole request (the object has "stream", so a comma follows).
                    return _ASK_USAGE + opening[1:]
                asked = {**parsed, "stream_options": {**options, "include_usage": True}}
                return orjson.dumps(asked)
        return body

    # ------------------------------------------------------------------ response

    def forwarding(self) -> None:
        """The request is leaving for the upstream now (latencies count from here)."""
        self._forwarded = time.perf_counter()

    def response_started(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """The upstream answered with a status and headers."""
        self.status_code = status
        if self.execution is not None and self.execution["response_source"] is None:
            self.execution["response_source"] = "upstream"
            if status >= 400:  # NeMo Gym's vllm_model keeps only an error status (its ClientResponseError's)
                self.execution["upstream_status_code"] = status
        if _is_event_stream(headers):
            self.relay = StreamRelay(
                self.dialect,
                hide_usage=self.hide_usage,
                max_bytes=self.max_body_bytes,
                label=f"rollout {self.rollout_id}",
            )

    @property
    def streaming(self) -> bool:
        """Whether the answer is an event stream."""
        return self.relay is not None

    def body(self, chunk: bytes) -> bytes:
        """Take upstream body bytes; return what may go to the client now."""
        if not chunk:
            return b""
        if self._first_byte is None:
            self._first_byte = time.perf_counter()
            self._paused_at_first = self._paused
        self._body_size += len(chunk)
        if self.relay is not None:
            if self.relay.bytes_seen < _RAW_STREAM_KEEP:
                self._body += chunk[: _RAW_STREAM_KEEP - self.relay.bytes_seen]
            return self.relay.feed(chunk)
        room = self.max_body_bytes - len(self._body)
        if room > 0:
            self._body += chunk[:room]
        # One chunk stays behind: with a Content-Length, the client would otherwise hold
        # the whole body before the row is written.
        previous, self._held = self._held, chunk
        return previous

    def end(self) -> bytes:
        """The upstream's answer is over; return what was held back for after the row."""
        if self._ended is None:
            self._ended = time.perf_counter()
        if self.relay is not None:
            return self.relay.finish()
        held, self._held = self._held, b""
        return held

    def failed(self, category: ErrorCategory) -> None:
        """Something other than the upstream's answer decided the call's fate (the client left,
        no answer came, the producer failed): it wins over what the answer says."""
        if self.fault is None:
            self.fault = category
        if self._ended is None:
            self._ended = time.perf_counter()

    def forwarded_upstream(self) -> None:
        """The proxy sends this call to its upstream: it will say who answered (spec 5, 11)."""
        self.execution = {
            "upstream_attempted": True,
            "response_source": None,
            "upstream_status_code": None,
            "local_response_reason": None,
        }

    def answered_locally(self, reason: str) -> None:
        """The producer answers the client itself (an upstream unreachable, silent, or answering a
        status no server can send): ``reason`` is the kind of its error answer."""
        if self.execution is not None:
            self.execution["response_source"] = "local"
            self.execution["local_response_reason"] = reason

    def app_says(self, state: dict[str, Any]) -> None:
        """The app under the middleware may say who answered, as NeMo Gym's model servers say it
        (``request.state.nemo_gym_model_execution``, in the scope's ``state``): read when the row
        is made, its four facts as they are."""
        self._app_state = state

    def _app_execution(self) -> None:
        facts = self._app_state.get("nemo_gym_model_execution") if self._app_state is not None else None
        if isinstance(facts, dict):
            self.execution = {key: facts.get(key) for key in _EXECUTION_KEYS}

    def client_left(self) -> None:
        """The client went away before the answer was complete, and the call is stopped: ``cancelled``,
        a stream begun too, as NeMo Gym's model servers record it (their
        ``ClientDisconnectCancellationMiddleware`` cancels the call; an error status still decides
        first, spec 5). A stream keeps what came of it."""
        if self.relay is not None and self.status_code is not None:
            self.broke_off()
        self.failed(category_for_status(self.status_code) or ErrorCategory.CANCELLED)

    def broke_off(self, *, timed_out: bool = False) -> None:
        """The upstream's answer stopped before its end (dropped, fell silent, or the app raised or
        returned early). The row still classifies it like any answer (see :meth:`_category`)."""
        self.broken = True
        self._timed_out = self._timed_out or timed_out
        if self._ended is None:
            self._ended = time.perf_counter()

    def server_failed(self, exc: BaseException) -> None:
        """The server raised, before its answer began or in its middle: classified as NeMo Gym does.

        The status of the answer begun, else the one the exception carries (an SDK status error
        the server let through), decides by spec 5's rules; below 400 the exception's type does
        (``timeout``, ``connection``, else ``exception``). An answer begun keeps what came (a
        stream its partial response); one the exception carries is the row's response.
        """
        if self.status_code is None:
            status, body = exception_http_answer(exc)
            if status is not None:
                self.status_code = status
                if body:
                    self._body_size = len(body)
                    self._body[:] = body[: self.max_body_bytes]
                    self._raw_too = True  # the answer as it came, JSON or not (NeMo Gym's row)
        else:
            self.broken = True  # a body cut short is no JSON to read
        self.failed(category_for_status(self.status_code) or category_for_exception(exc))

    # ------------------------------------------------------------------ lifecycle (spec 3, 11)

    async def claim(self, writer: CaptureWriter) -> None:
        """Claim the rollout before the call is forwarded (a failed claim is logged, not raised).

        Where a claim takes a store round trip it is written while the call is forwarded: the
        answer's first byte then waits until it is durable (:meth:`to_client`, spec 11).
        """
        if writer.claims_in_background:
            self._gated = True
            self._writer = writer
            self._claim_began = time.perf_counter()
            self._claiming = asyncio.ensure_future(writer.claim(self.rollout_id, self.model_call_id))
            self._claiming.add_done_callback(self._settled)
        else:
            self._claim = await writer.claim(self.rollout_id, self.model_call_id)

    def _settled(self, _: asyncio.Future[ClaimContext | None]) -> None:
        self._claim_settled = time.perf_counter()
        self._tell_hold()

    def _tell_hold(self) -> None:
        """Once both are known (asked at each, on the loop: the second tells), the claims pacing
        hears how long the answer waited for its claim, beside the upstream's time to it."""
        ready, settled = self._answer_ready, self._claim_settled
        if self._writer is not None and ready is not None and settled is not None:
            self._writer.answer_held(max(0.0, settled - ready), ready - self._claim_began)

    @property
    def claim_pending(self) -> bool:
        """Whether a claim written in the background is not durable (nor failed) yet."""
        return self._claiming is not None and not self._claiming.done()

    def answer_ready(self) -> None:
        """The answer's first message is ready for the client (what waits from here is the hold)."""
        if self._answer_ready is None:
            self._answer_ready = time.perf_counter()
            self._tell_hold()

    def paused(self, seconds: float) -> None:
        """The upstream went unread this long (what came past the body cap waited for the claim, or
        for a client slower than the upstream): our wait, left out of the answer's times (spec 11:
        the figures are the model's)."""
        if self._ended is None:
            self._paused += seconds

    def to_client(self, send: Send) -> Send:
        """``send`` as this call's answer must go: held until the claim is durable, and paced by
        the client without holding the upstream back, up to the body cap (spec 11)."""
        self._answer = HeldAnswer(self, send)
        return self._answer

    async def answer_settled(self) -> None:
        """After the call: what of the answer still waits for the claim goes to the client."""
        if self._answer is not None:
            await self._answer.settle()

    def answer_dropped(self) -> None:
        """The call was cancelled: what of the answer still waits is dropped."""
        if self._answer is not None:
            self._answer.cancel()

    async def claim_settled(self) -> None:
        """Wait until the claim written meanwhile is durable (or failed, logged), taking nothing:
        the row alone takes the claim to release (:meth:`claimed`), cancelled or not."""
        if self._claiming is not None:
            await asyncio.wait([self._claiming])  # a cancel of the waiter leaves the claim alone

    async def claimed(self) -> None:
        """Wait until the claim is durable (or failed, logged) and take it, to be released with the row."""
        claiming = self._claiming
        if claiming is None:
            return
        try:
            self._claim = await finish_shielded(claiming)
        except asyncio.CancelledError:
            if claiming.done() and not claiming.cancelled():
                self._claim = claiming.result()  # landed: released with the row that still follows
            raise
        finally:
            self._claiming = None

    async def write_row(self, writer: CaptureWriter) -> None:
        """Write the row durably, then release the claim (both shielded from cancellation)."""
        self.row_written = True
        try:
            await self.claimed()
        finally:  # cancelled meanwhile, the claim is settled even so: the row still lands
            await writer.record(self.rollout_id, self.row, release=self._claim)

    async def complete(self, writer: CaptureWriter) -> bytes:
        """The upstream's answer ended normally: write its row, then return what was held back
        (the client's last bytes go after the row)."""
        held = self.end()
        self.finished = True
        await self.write_row(writer)
        return held

    async def close(self, writer: CaptureWriter) -> None:
        """Last, in every outcome: a call whose row is not written yet did not end normally; its
        row keeps what came so far (and releases the claim)."""
        if self.row_written:
            return
        if self.fault is None:
            self.broke_off()
        self.end()
        await self.write_row(writer)

    # ------------------------------------------------------------------ row

    def _response(self) -> tuple[JsonObject | None, str | None, bool, ErrorCategory | None]:
        """(response, response_raw, cut, what reading it showed) from the upstream's body."""
        if self.relay is not None:
            # NeMo Gym's order: an error the stream reported (even as its first event, before any
            # response object), then a missing terminal event, then a stream that could not be
            # rebuilt (a chat stream of no chat chunk), then events that could not be read.
            response = self.relay.response()
            raw = _decode(bytes(self._body)) if response is None and self._body else None
            if self.relay.assembler.error is not None:
                return response, raw, self.relay.cut, self.relay.assembler.error
            if not self.relay.complete:
                return response, raw, self.relay.cut, ErrorCategory.STREAM_TRUNCATED
            if response is None or self.relay.unparsed_events:  # the response lacks what they said
                return response, raw, self.relay.cut, ErrorCategory.CAPTURE_PARSE_ERROR
            return response, raw, self.relay.cut, None
        if self.broken:  # a body cut short is no JSON to read
            return None, _decode(bytes(self._body)) if self._body else None, False, ErrorCategory.INCOMPLETE
        if not self._body_size:
            return None, None, False, None
        if self._body_size > len(self._body):
            # Past the cap: the call's own outcome stands (its status decides); the row says
            # it keeps only the first bytes (``response_truncated``), never that the call failed.
            return None, _decode(bytes(self._body)), True, None
        try:
            parsed = orjson.loads(self._body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed, _decode(bytes(self._body)) if self._raw_too else None, False, None
        return None, _decode(bytes(self._body)), False, ErrorCategory.CAPTURE_PARSE_ERROR

    def _category(self, reading: ErrorCategory | None) -> ErrorCategory | None:
        """Spec 5 and 11, for both producers: a fault outside the answer, else the upstream's error
        status as it is, else a timeout that cut the answer, else what reading the answer showed
        (``stream_truncated`` for a stream without its terminal event, ``incomplete`` for a body)."""
        if self.fault is not None:
            return self.fault
        timed_out = ErrorCategory.TIMEOUT if self._timed_out else None
        return category_for_status(self.status_code) or timed_out or reading

    def row(self) -> dict[str, Any]:
        """The row of spec 4 for this call."""
        now = time.perf_counter()
        ended = self._ended if self._ended is not None else now
        forwarded = self._forwarded if self._forwarded is not None else self._arrived
        response, response_raw, cut, reading = self._response()
        category = self._category(reading)
        row: dict[str, Any] = {
            "model_call_id": self.model_call_id,
            "dialect": self.dialect,
            "model_ref": (
                {"type": MODEL_REF_TYPE, "name": self.server_name} if self.server_name is not None else None
            ),
            "started_at": self.started_at,
            "completed_at": self.started_at + (ended - self._paused - self._arrived),
            "latency_ms": round((ended - self._paused - forwarded) * 1000.0, 3),
            "latency_ttft_ms": (
                round((self._first_byte - self._paused_at_first - forwarded) * 1000.0, 3)
                if self._first_byte is not None
                else None
            ),
            "status_code": self.status_code,
            "error_category": None if category is None else str(category),
            "request": self.request,
            "response": response,
        }
        if self.client_session_id is not None:
            row["client_session_id"] = self.client_session_id
        self._app_execution()
        if self.execution is not None:
            row.update(self.execution)
            if self.execution.get("local_response_reason") == CONTEXT_LENGTH_EXCEEDED:
                row["error_category"] = CONTEXT_LENGTH_EXCEEDED  # NeMo Gym's rule for this answer
        if self.request_raw is not None:
            row["request_raw"] = self.request_raw
        if response_raw is not None:
            row["response_raw"] = response_raw
        if self.verifier_invocation_id is not None:
            row["verifier_invocation_id"] = self.verifier_invocation_id
        if self.request_cut:
            row["request_truncated"] = True
        if cut:
            row["response_truncated"] = True
        if self.relay is not None and self.relay.unparsed_events:
            row["stream_events_unparsed"] = self.relay.unparsed_events
        hold = self.capture_hold_ms()
        if hold is not None:
            row["capture_hold_ms"] = hold
        return row

    def capture_hold_ms(self) -> float | None:
        """How long the answer's first byte waited for the claim (spec 11); None where the producer
        never holds an answer (the claim was written before forwarding) or none was sent."""
        if not self._gated or self._answer_ready is None or self._claim_settled is None:
            return None
        return round(max(0.0, self._claim_settled - self._answer_ready) * 1000.0, 3)


class HeldAnswer:
    """The client's ``send`` of a captured call (spec 11).

    The answer's messages wait, in order, while the claim written meanwhile is not durable (object
    stores) or the client has not yet taken the messages before them (a client slower than the
    upstream), and ``send`` returns at once: the producer reads on from the upstream (or the app runs
    on), so its answer is timed as it arrives, not as the hold or the client lets it go. Up to the
    body cap waits; past it the sender waits until what waits has gone (left out of the answer's
    times: :meth:`Exchange.paused`), and the last message goes after all of it. A message the client
    takes at once costs no task (:func:`_begun`).
    """

    __slots__ = ("_begun", "_dropped", "_exchange", "_flush", "_queue", "_queued", "_send")

    def __init__(self, exchange: Exchange, send: Send) -> None:
        self._exchange = exchange
        self._send = send
        self._queue: collections.deque[Message] = collections.deque()
        self._queued = 0
        self._flush: asyncio.Future[None] | None = None  # what waits, going to the client
        self._begun = False
        self._dropped = False

    async def __call__(self, message: Message) -> None:
        if self._flush is None and self._begun and message.get("more_body", False):
            rest = _begun(self._send(message))  # nothing waits: the common case, a body part
            if rest is not None:  # the client is slower: what comes meanwhile waits behind it
                self._flush = asyncio.ensure_future(self._flushing(rest))
            return
        exchange = self._exchange
        kind = message["type"]
        part = kind == "http.response.start" or (
            kind == "http.response.body" and message.get("more_body", False)
        )
        if not self._begun:
            self._begun = True
            exchange.answer_ready()
            if exchange.claim_pending:  # the answer waits for the claim, in order
                self._hold(message)
                self._flush = asyncio.ensure_future(self._flushing(None))
                return
        flush = self._flush
        if flush is not None:
            if not flush.done():
                if part and self._queued < exchange.max_body_bytes:
                    self._hold(message)
                    return
                waited = time.perf_counter()  # past the cap: the upstream goes unread meanwhile
                try:
                    await flush  # what waited goes first (and what went wrong sending it is raised here)
                finally:
                    exchange.paused(time.perf_counter() - waited)
            else:
                await flush
            self._flush = None
        if not part:  # the last message: after everything else, as it comes
            await self._send(message)
            return
        rest = _begun(self._send(message))
        if rest is not None:  # the client is slower: what comes meanwhile waits behind it
            self._flush = asyncio.ensure_future(self._flushing(rest))

    def _hold(self, message: Message) -> None:
        self._queue.append(message)
        self._queued += len(message.get("body", b""))

    async def _flushing(self, first: Awaitable[None] | None) -> None:
        """What waits, to the client: after the claim (None) or the send it was slow to take."""
        await (self._exchange.claim_settled() if first is None else first)
        while self._queue:
            message = self._queue.popleft()
            self._queued -= len(message.get("body", b""))
            await self._send(message)

    async def settle(self) -> None:
        """After the call: what still waits goes to the client (an answer cut short still gets what
        came), its errors left out (the call's own outcome is already decided)."""
        flush = self._flush
        if flush is None or self._dropped:
            return
        if not flush.done():
            with contextlib.suppress(Exception):  # the client is gone: nothing more to give it
                await flush
        elif not flush.cancelled():
            flush.exception()  # taken: what sending met is no news once the call is over

    def cancel(self) -> None:
        """The call was cancelled (its client is gone): what waits is dropped."""
        self._dropped = True
        if self._flush is not None and not self._flush.done():
            self._flush.cancel()


def _begun(sending: Awaitable[None]) -> Awaitable[None] | None:
    """``sending`` run at once until it first waits: None when it ended without waiting (a send the
    client took at once: no task, no turn of the loop), else an awaitable that goes on with it, as
    awaiting it would have (Python 3.12's eager tasks do this; 3.11 has none). What it raises before
    waiting is raised here."""
    steps = sending.__await__()
    try:
        waiting = steps.send(None)
    except StopIteration:
        return None
    return _going_on(steps, waiting)


@types.coroutine
def _going_on(steps: Generator[Any, Any, None], waiting: Any) -> Generator[Any, Any, None]:
    """``yield from steps`` for steps already waiting on ``waiting`` (what they yielded: the
    awaiting task waits on it as they would have); what is thrown in (a cancel) goes on into them."""
    while True:
        try:
            sent = yield waiting
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:
            try:
                waiting = steps.throw(exc)
            except StopIteration:
                return
        else:
            try:
                waiting = steps.send(sent)
            except StopIteration:
                return


SESSION_HEADER = b"x-session-id"
"""The header by which NeMo Gym 0.7's agents name the session (the invocation) a call belongs to."""


def session_of(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The call's ``client_session_id``: its one ``X-Session-Id`` value, as NeMo Gym 0.7.0's capture
    takes it (none when absent, empty or given twice with different values)."""
    values = {value.decode("latin-1") for key, value in headers if key.lower() == SESSION_HEADER and value}
    return values.pop() if len(values) == 1 else None


async def start_exchange(
    scope: Scope, found: Route, receive: Receive, settings: ProducerSettings
) -> tuple[Exchange, bytes, bool, bytes] | None:
    """A captured call's exchange and its request: ``(exchange, body to forward, whole, body read)``.

    The body is read up to the cap (``whole`` False: the rest is still to come); None when the
    client left before its request was whole, so no call was made and nothing is written.
    """
    assert found.rollout_id is not None and found.dialect is not None
    headers = scope.get("headers") or ()
    verifier = header(headers, VERIFIER_HEADER)
    exchange = Exchange(
        found.rollout_id,
        found.dialect,
        server_name=settings.server_name,
        max_body_bytes=settings.max_body_bytes,
        verifier_invocation_id=None if verifier is None else verifier.decode("latin-1"),
        client_session_id=session_of(headers),
    )
    body, whole, gone = await read_body(receive, settings.max_body_bytes)
    if gone:
        return None
    return exchange, exchange.prepare_request(body, whole=whole), whole, body
