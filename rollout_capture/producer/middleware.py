"""``CaptureMiddleware``: pure ASGI, mounts on any ASGI model server and writes its captures.

``app.add_middleware(CaptureMiddleware, capture_dir="s3://bucket/captures")``, or with no
arguments (vLLM's ``--middleware rollout_capture.producer.CaptureMiddleware``) configured
from ``ROLLOUT_CAPTURE_*`` variables. Calls under ``/ng-rollout/<id>/v1/...`` reach the app
with the prefix stripped; the three model endpoints are claimed and captured.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollout_capture.producer.asgi import (
    ASGIApp,
    Headers,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
    replace_header,
    route_or_refuse,
    scope_headers,
    scope_method,
    send_json_error,
)
from rollout_capture.producer.classify import (
    INVALID_STATUS_KIND,
    ErrorCategory,
    invalid_status_message,
    is_valid_status,
)
from rollout_capture.producer.exchange import Exchange, start_exchange
from rollout_capture.producer.routing import VERIFIER_HEADER, Route, header
from rollout_capture.producer.settings import ProducerSettings
from rollout_capture.producer.unfiled import UnfiledCalls
from rollout_capture.producer.verifier import (
    VerifierCall,
    VerifierExchange,
    new_invocation_id,
    reset_verifier_call,
    rollout_of_verify_body,
    set_verifier_call,
)
from rollout_capture.producer.writer import CaptureWriter, writer_for

logger = logging.getLogger("rollout_capture.producer")

_DRAIN_ON_SHUTDOWN_S = 30.0


class CaptureMiddleware:
    """Capture every model call under ``/ng-rollout/<rollout_id>/v1/`` of the wrapped app.

    Arguments left out (None) come from the environment (see :class:`ProducerSettings`);
    ``settings`` replaces them all. The model call itself never fails because of a capture.
    ``strip_prefix=False`` hands the app the path as the client sent it, for an app that reads
    the prefix itself (NeMo Gym's model servers: :mod:`rollout_capture.producer.nemo_gym`).
    """

    def __init__(
        self,
        app: ASGIApp,
        capture_dir: str | None = None,
        *,
        server_name: str | None = None,
        claim_ttl_s: float | None = None,
        max_body_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        layout: str | None = None,
        io_threads: int | None = None,
        enabled: bool | None = None,
        settings: ProducerSettings | None = None,
        strip_prefix: bool = True,
    ) -> None:
        self.app = app
        if settings is None:
            settings = ProducerSettings.from_env(
                capture_dir=capture_dir,
                server_name=server_name,
                claim_ttl_s=claim_ttl_s,
                max_body_bytes=max_body_bytes,
                storage_options=storage_options,
                layout=layout,
                io_threads=io_threads,
                enabled=enabled,
            )
        self.settings = settings
        # Capture off: the prefix is still stripped and the call forwarded; nothing is opened.
        self.writer: CaptureWriter | None = writer_for(settings) if settings.enabled else None
        self._verify_paths = settings.verify_paths if settings.enabled else ()
        self._strip = strip_prefix
        self.unfiled = UnfiledCalls(f"capture middleware of {settings.server_name or 'a server'}")

    def close(self) -> None:
        """Finish the capture writes in flight, then stop the writer's threads (a lifespan
        shutdown does this too; a later call starts them again)."""
        if self.writer is not None:
            self.writer.wait_idle(_DRAIN_ON_SHUTDOWN_S)
            self.writer.close()
            self.unfiled.report()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
            return
        if kind != "http":
            await self.app(scope, receive, send)
            return
        found = await route_or_refuse(scope, send, verify_paths=self._verify_paths)
        if found is None:
            return
        if found.rollout_id is None and not found.verify:
            if self.writer is not None:
                self.unfiled.saw(scope_method(scope), found)
            await self.app(scope, receive, send)
            return
        stripped = found.rollout_id is not None and self._strip
        inner = {**scope, "path": found.path, "raw_path": found.raw_path} if stripped else scope
        if self.writer is None or not (found.captured or found.verify):
            await self.app(inner, receive, send)
            return
        if found.verify:
            await self._verify(inner, found, receive, send, self.writer)
            return
        started = await start_exchange(inner, found, receive, self.settings)
        if started is None:
            return  # the client left before its request was whole: no call was made
        await self._captured(inner, receive, send, self.writer, *started)

    def _lifespan_send(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete" and self.writer is not None:
                # Rows of calls cut by the stop land first; then the writer's threads stop.
                await asyncio.to_thread(self.close)
            await send(message)

        return wrapped

    async def _verify(
        self, scope: Scope, found: Route, receive: Receive, send: Send, writer: CaptureWriter
    ) -> None:
        """A verify call: recorded as a ``verifier_invocation`` row of the rollout it grades."""
        body, whole, gone = await read_body(receive, self.settings.max_body_bytes)
        if gone:
            return
        rollout_id = found.rollout_id or rollout_of_verify_body(body, whole)
        headers = scope_headers(scope)
        if rollout_id is None:  # no rollout to file it under: forwarded as it came
            await self.app(scope, _replay(body, whole, receive), send)
            return
        given = header(headers, VERIFIER_HEADER)
        invocation_id = given.decode("latin-1") if given else new_invocation_id()
        exchange = VerifierExchange(
            rollout_id,
            invocation_id,
            server_name=self.settings.server_name,
            max_body_bytes=self.settings.max_body_bytes,
        )
        forward = exchange.prepare_request(body, whole=whole)
        scope = {
            **scope,
            "headers": replace_header(headers, VERIFIER_HEADER, invocation_id.encode("latin-1")),
        }
        token = set_verifier_call(VerifierCall(rollout_id, invocation_id))
        try:
            await self._captured(scope, receive, send, writer, exchange, forward, whole, body)
        finally:
            reset_verifier_call(token)

    async def _captured(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        writer: CaptureWriter,
        exchange: Exchange,
        forward: bytes,
        whole: bool,
        body: bytes,
    ) -> None:
        """Run the app on a claimed call, its answer relayed to the client and into the row."""
        headers: Headers = scope_headers(scope)
        if forward is not body:
            headers = replace_header(headers, b"content-length", str(len(forward)).encode())
        # The app is asked for an uncompressed answer: the row needs readable bytes.
        scope["headers"] = replace_header(headers, b"accept-encoding", b"identity")
        await exchange.claim(writer)
        relay = _Relay(exchange, writer, receive, send, forward, whole)
        exchange.app_says(scope.setdefault("state", {}))  # where NeMo Gym's servers say who answered
        try:
            exchange.forwarding()
            await self.app(scope, relay.receive, relay.send)
        except asyncio.CancelledError:
            exchange.failed(ErrorCategory.CANCELLED)
            exchange.answer_dropped()
            raise
        except Exception as exc:
            if relay.client_gone:
                exchange.failed(ErrorCategory.CANCELLED)
            else:
                exchange.server_failed(exc)
            raise
        finally:
            # An app that returned early (its client gone or not): its answer broke off, and how it
            # ended decides, as NeMo Gym's capture decides (a stream without its end is
            # stream_truncated); an app cancelled or failing on a gone client is cancelled (above).
            await exchange.close(writer)
            await exchange.answer_settled()  # what it sent before goes to the client
            if relay.refused is not None and not relay.answered and not relay.client_gone:
                await relay.refuse()


class _Relay:
    """One captured call between the app and the client: the app's ``receive`` (the body
    already read handed out first) and ``send`` (each message to the row, and to the client
    once the claim is held), and what the call's end needs to know of them."""

    __slots__ = (
        "_forward",
        "_forward_send",
        "_receive",
        "_send",
        "_writer",
        "answered",
        "body_whole",
        "client_gone",
        "exchange",
        "refused",
        "replayed",
        "whole",
    )

    def __init__(
        self,
        exchange: Exchange,
        writer: CaptureWriter,
        receive: Receive,
        send: Send,
        forward: bytes,
        whole: bool,
    ) -> None:
        self.exchange, self._writer, self._receive, self._send = exchange, writer, receive, send
        self._forward, self.whole, self.body_whole = forward, whole, whole
        self.replayed = False
        self.client_gone = False
        self.refused: int | None = None  # a status no server can send: the client gets a 502 instead
        self.answered = False
        # The first byte waits for the claim (spec 3, 11); the app runs on meanwhile.
        self._forward_send = exchange.to_client(self._to_client)

    async def receive(self) -> Message:
        if not self.replayed:
            self.replayed = True
            return {"type": "http.request", "body": self._forward, "more_body": not self.whole}
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.client_gone = True
            if not self.body_whole:  # the app got a cut body: whatever it answers, the call was cancelled
                self.exchange.failed(ErrorCategory.CANCELLED)
        elif not message.get("more_body", False):
            self.body_whole = True
        return message

    async def _to_client(self, message: Message) -> None:
        try:
            await self._send(message)
        except OSError:
            self.client_gone = True
            raise

    async def refuse(self) -> None:
        """The client's 502 for a status no server can send (after the row, as for any answer)."""
        self.answered = True
        assert self.refused is not None
        await send_json_error(
            self._forward_send, 502, invalid_status_message(self.refused), INVALID_STATUS_KIND
        )

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if self.refused is not None:  # the app's answer goes to the row only
            await self._to_row_only(message)
            return
        exchange = self.exchange
        if kind == "http.response.start":
            exchange.response_started(message["status"], message.get("headers") or [])
            if not is_valid_status(message["status"]):
                self._refuse_status(message["status"])
                return
            if exchange.streaming:  # events may be held or hidden: the length is not the app's
                message = {
                    **message,
                    "headers": replace_header(list(message["headers"]), b"content-length", None),
                }
            await self._forward_send(message)
        elif kind == "http.response.body":
            now = exchange.body(message.get("body", b""))
            if message.get("more_body", False):
                if now:
                    await self._forward_send({"type": "http.response.body", "body": now, "more_body": True})
                return
            held = await exchange.complete(self._writer)  # durable before the client's last byte
            await self._forward_send({"type": "http.response.body", "body": now + held, "more_body": False})
        else:
            await self._forward_send(message)

    def _refuse_status(self, status: int) -> None:
        self.refused = status
        logger.warning(
            "the app answered status %d to a call of rollout %s: answered 502",
            status,
            self.exchange.rollout_id,
        )

    async def _to_row_only(self, message: Message) -> None:
        """A refused answer's body: into the row; the client's 502 once it is whole."""
        if message["type"] == "http.response.body":
            self.exchange.body(message.get("body", b""))
            if not message.get("more_body", False) and not self.answered:
                await self.exchange.complete(self._writer)
                await self.refuse()


def _replay(body: bytes, whole: bool, receive: Receive) -> Receive:
    """``receive`` with the body already read handed out first."""
    replayed = False

    async def inner() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": not whole}
        return await receive()

    return inner
