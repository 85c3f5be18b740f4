"""One captured call, from the client's request to its row (spec 4 and 11).

Shared by the middleware and the proxy: they move bytes, this decides what the row says and
keeps its lifecycle (claim, durable row, release). Bodies are kept up to a cap; past it the
row keeps the first bytes and says it was cut.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson

from rollout_capture.producer.asgi import Receive, Scope, read_body
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
    ) -> None:
        self.rollout_id = rollout_id
        self.dialect = dialect
        self.server_name = server_name
        self.max_body_bytes = max_body_bytes
        self.verifier_invocation_id = verifier_invocation_id
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
        else:
            self.broken = True  # a body cut short is no JSON to read
        self.failed(category_for_status(self.status_code) or category_for_exception(exc))

    # ------------------------------------------------------------------ lifecycle (spec 3, 11)

    async def claim(self, writer: CaptureWriter) -> None:
        """Claim the rollout before the call is forwarded (a failed claim is logged, not raised).

        Where a claim takes a store round trip it is written while the call is forwarded:
        :meth:`claimed` then holds the answer's first byte until it is durable (spec 11).
        """
        if writer.claims_in_background:
            self._claiming = asyncio.ensure_future(writer.claim(self.rollout_id, self.model_call_id))
        else:
            self._claim = await writer.claim(self.rollout_id, self.model_call_id)

    @property
    def claim_pending(self) -> bool:
        """Whether a claim written in the background has not been waited for yet."""
        return self._claiming is not None

    async def claimed(self) -> None:
        """Wait until the claim is durable (or failed, logged); before any byte reaches the client."""
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
            return None, _decode(bytes(self._body)), True, ErrorCategory.INCOMPLETE
        try:
            parsed = orjson.loads(self._body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed, None, False, None
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
            "completed_at": self.started_at + (ended - self._arrived),
            "latency_ms": round((ended - forwarded) * 1000.0, 3),
            "latency_ttft_ms": (
                round((self._first_byte - forwarded) * 1000.0, 3) if self._first_byte is not None else None
            ),
            "status_code": self.status_code,
            "error_category": None if category is None else str(category),
            "request": self.request,
            "response": response,
        }
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
        return row


async def start_exchange(
    scope: Scope, found: Route, receive: Receive, settings: ProducerSettings
) -> tuple[Exchange, bytes, bool, bytes] | None:
    """A captured call's exchange and its request: ``(exchange, body to forward, whole, body read)``.

    The body is read up to the cap (``whole`` False: the rest is still to come); None when the
    client left before its request was whole, so no call was made and nothing is written.
    """
    assert found.rollout_id is not None and found.dialect is not None
    verifier = header(scope.get("headers") or (), VERIFIER_HEADER)
    exchange = Exchange(
        found.rollout_id,
        found.dialect,
        server_name=settings.server_name,
        max_body_bytes=settings.max_body_bytes,
        verifier_invocation_id=None if verifier is None else verifier.decode("latin-1"),
    )
    body, whole, gone = await read_body(receive, settings.max_body_bytes)
    if gone:
        return None
    return exchange, exchange.prepare_request(body, whole=whole), whole, body
