"""The capture proxy as an ASGI app: :class:`CaptureProxy` forwards to one upstream.

For servers you cannot modify and hosted APIs. Headers, query and body pass through
(hop-by-hop headers aside, and captured calls ask for an uncompressed answer); one pooled
upstream client (see ``upstream.py``); a stop lets calls in flight finish and land their rows.
Binding, uvicorn and worker processes are ``server.py``'s (``serve_proxy``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout_capture.producer.asgi import (
    Headers,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
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
from rollout_capture.producer.routing import Route, header
from rollout_capture.producer.settings import ProxySettings
from rollout_capture.producer.unfiled import UnfiledCalls
from rollout_capture.producer.upstream import Upstream, UpstreamError, UpstreamResponse, open_upstream
from rollout_capture.producer.writer import CaptureWriter, writer_for

logger = logging.getLogger("rollout_capture.producer")

# RFC 9110 7.6.1 hop-by-hop headers, plus the Host of the upstream (the client sets it).
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_FORWARDED = _HOP_BY_HOP | {b"host"}
_CAPTURED_NOT_FORWARDED = _NOT_FORWARDED | {b"accept-encoding"}
_CAPTURED_WHOLE_NOT_FORWARDED = _CAPTURED_NOT_FORWARDED | {b"content-length"}


class UpstreamBroken(Exception):
    """The upstream failed after its answer began: the client connection is cut, as it was upstream."""


class _QuietBrokenStreams(logging.Filter):
    """Keeps uvicorn from logging a traceback for a cut we already logged in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, UpstreamBroken)


def _install_log_filter() -> None:
    target = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietBrokenStreams) for f in target.filters):
        target.addFilter(_QuietBrokenStreams())


async def _watch_client(
    receive: Receive, exchange: Exchange, call: asyncio.Task[Any], body_whole: asyncio.Event | None = None
) -> bool:
    """Wait for the client to go away; then cancel its call, unless the answer was complete.

    True when it cancelled. uvicorn also says "disconnect" once the answer is sent: not a leaver.
    ``body_whole``: the request body is still being forwarded; watch once it is all in.
    """
    if body_whole is not None:
        await body_whole.wait()
    while (await receive())["type"] != "http.disconnect":
        pass
    if exchange.finished:
        return False
    exchange.client_left()
    call.cancel()
    return True


def _response_headers(response: UpstreamResponse, *, drop: frozenset[bytes] = frozenset()) -> Headers:
    return [(k, v) for k, v in response.headers if k.lower() not in _HOP_BY_HOP and k.lower() not in drop]


class CaptureProxy:
    """ASGI app: everything to the upstream; calls under ``/ng-rollout/<id>/v1/`` captured on the way."""

    def __init__(self, settings: ProxySettings, *, journal_link: socket.socket | None = None) -> None:
        self.settings = settings
        # Capture off: the prefix is still stripped and every call forwarded; nothing is opened.
        self._writer: CaptureWriter | None = (
            writer_for(settings, journal_link=journal_link) if settings.enabled else None
        )
        self._client: Upstream | None = None
        self.unfiled = UnfiledCalls("capture proxy")
        _install_log_filter()

    # ------------------------------------------------------------------ lifecycle

    def _new_client(self) -> Upstream:
        s = self.settings
        return open_upstream(
            s.upstream_client,
            s.upstream,
            max_connections=s.max_connections,
            connect_timeout_s=s.connect_timeout_s,
            read_timeout_s=s.read_timeout_s,
            write_timeout_s=s.write_timeout_s,
        )

    @property
    def writer(self) -> CaptureWriter:
        """The capture writer (only a proxy that captures has one)."""
        if self._writer is None:
            raise RuntimeError("capture is off (enabled=false): the proxy writes nothing")
        return self._writer

    def close_writer(self) -> None:
        """Stop the capture writer's threads (after the writes in flight), if capture is on."""
        if self._writer is not None:
            self._writer.close()

    @property
    def client(self) -> Upstream:
        """The one pooled upstream client (made on first use when no lifespan ran)."""
        if self._client is None:
            self._client = self._new_client()
        return self._client

    async def aclose(self) -> None:
        """Close the upstream pool and wait for capture writes in flight."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._writer is not None:
            await asyncio.to_thread(self._writer.wait_idle, self.settings.shutdown_grace_s)
            self._writer.close_claims_log()
            self.unfiled.report()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._client = self._new_client()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        found = await route_or_refuse(scope, send, every_path=True)
        if found is None:
            return
        if found.captured and self._writer is not None:
            await self._captured(scope, found, receive, send)
        else:
            if self._writer is not None:
                self.unfiled.saw(scope_method(scope), found)
            await self._passthrough(scope, found, receive, send)

    async def _send(
        self, scope: Scope, found: Route, content: bytes | AsyncIterator[bytes], *, captured: bool
    ) -> UpstreamResponse:
        """The client's request to the upstream: its headers as sent, minus hop-by-hop ones."""
        if captured:
            # A body read whole may have been rewritten (usage asked for): the client sets its length.
            dropped = _CAPTURED_WHOLE_NOT_FORWARDED if isinstance(content, bytes) else _CAPTURED_NOT_FORWARDED
            sent = [(k, v) for k, v in scope_headers(scope) if k.lower() not in dropped]
            sent.append((b"accept-encoding", b"identity"))  # the row needs readable bytes
        else:
            sent = [(k, v) for k, v in scope_headers(scope) if k.lower() not in _NOT_FORWARDED]
        query: bytes = scope.get("query_string") or b""
        target = found.raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        return await self.client.send(scope_method(scope), target, sent, content, decode=captured)

    async def _passthrough(self, scope: Scope, found: Route, receive: Receive, send: Send) -> None:
        headers = scope_headers(scope)
        streamed = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers)
        content: bytes | _BodyStream
        if streamed:
            content = _BodyStream(b"", receive)
        else:
            content, _, _ = await read_body(receive, 1 << 62)
        try:
            response = await self._send(scope, found, content, captured=False)
        except (UpstreamError, ClientLeft) as exc:
            if isinstance(content, _BodyStream) and content.left:
                logger.info(
                    "a client left mid-body: its request to the upstream was aborted (%s)", found.path
                )
            elif isinstance(exc, UpstreamError):
                await _send_upstream_error(send, exc)
            return
        if not is_valid_status(response.status):
            await response.aclose()
            logger.warning(
                "upstream answered status %d to %s %s", response.status, scope_method(scope), found.path
            )
            await send_json_error(send, 502, invalid_status_message(response.status), INVALID_STATUS_KIND)
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": _response_headers(response),
                }
            )
            async for chunk in response.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as exc:
            logger.warning("upstream broke off %s %s: %s", scope_method(scope), found.path, exc.kind)
            raise UpstreamBroken(exc.kind) from None
        finally:
            await response.aclose()

    async def _captured(self, scope: Scope, found: Route, receive: Receive, send: Send) -> None:
        started = await start_exchange(scope, found, receive, self.settings)
        if started is None:
            return  # the client left before its request was whole: no call was made
        exchange, forward, whole, _ = started
        body_whole: asyncio.Event | None = None  # set once a body forwarded as it arrives is all in
        content: bytes | _BodyStream = forward
        if not whole:
            body_whole = asyncio.Event()
            content = _BodyStream(
                forward,
                receive,
                on_leave=lambda: exchange.failed(ErrorCategory.CANCELLED),
                on_end=body_whole.set,
            )
        await exchange.claim(self.writer)
        answer = exchange.to_client(send)  # held until the claim is durable; the upstream read on
        try:
            # The call runs in this task; a watcher cancels it if the client goes away
            # (no second task per call). _forward then stops the upstream call, keeps what it
            # said so far and writes the row before the cancellation goes on. While a body is
            # still being received, the body stream reads the client's messages: the watcher
            # waits for its end (a client that leaves before it is seen by the body stream).
            task = asyncio.current_task()
            assert task is not None
            watch = asyncio.get_running_loop().create_task(_watch_client(receive, exchange, task, body_whole))
            try:
                await self._forward(scope, found, exchange, content, answer)
            except asyncio.CancelledError:
                exchange.answer_dropped()
                if watch.done() and not watch.cancelled() and watch.result() and task.uncancel() == 0:
                    return  # only the watcher cancelled: the client left, nothing to answer
                raise
            finally:
                watch.cancel()
        finally:
            await exchange.close(self.writer)  # the row of a call that did not end normally
            await exchange.answer_settled()  # an answer broken off: the client gets what came

    async def _forward(
        self,
        scope: Scope,
        found: Route,
        exchange: Exchange,
        content: bytes | AsyncIterator[bytes],
        send: Send,
    ) -> None:
        """One upstream exchange; the caller writes the row of one that does not end normally."""
        try:
            exchange.forwarding()
            exchange.forwarded_upstream()
            try:
                response = await self._send(scope, found, content, captured=True)
            except (UpstreamError, ClientLeft) as exc:  # httpx hands the body's own ClientLeft back
                if isinstance(content, _BodyStream) and content.left:  # the row says cancelled
                    logger.warning(
                        "a client of rollout %s left mid-body: its upstream request was aborted",
                        exchange.rollout_id,
                    )
                    await exchange.write_row(self.writer)
                    return
                assert isinstance(exc, UpstreamError)
                exchange.failed(ErrorCategory.TIMEOUT if exc.timed_out else ErrorCategory.CONNECTION)
                exchange.answered_locally(_error_kind(exc))
                await exchange.write_row(self.writer)  # before the client's last byte
                await _send_upstream_error(send, exc)
                return
            try:
                await self._relay(exchange, response, send)
            finally:
                await response.aclose()
        except asyncio.CancelledError:
            if not exchange.broken:  # a stream its client cut keeps its own end (client_left)
                exchange.failed(ErrorCategory.CANCELLED)
            raise
        except UpstreamBroken:
            raise
        except Exception:
            logger.exception("capture proxy failed on a call of rollout %s", exchange.rollout_id)
            exchange.failed(ErrorCategory.EXCEPTION)
            raise

    async def _relay(self, exchange: Exchange, response: UpstreamResponse, send: Send) -> None:
        exchange.response_started(response.status, response.headers)
        if not is_valid_status(response.status):
            await self._refuse_status(exchange, response, send)
            return
        drop = {b"content-length"} if exchange.streaming else set()
        encoding = header(response.headers, b"content-encoding")
        if encoding is not None and encoding.strip().lower() != b"identity":
            # Asked for identity but compressed anyway: forwarded decoded, as captured.
            drop |= {b"content-encoding", b"content-length"}
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": _response_headers(response, drop=frozenset(drop)),
            }
        )
        try:
            async for chunk in response.chunks():
                now = exchange.body(chunk)
                if now:
                    await send({"type": "http.response.body", "body": now, "more_body": True})
        except UpstreamError as exc:  # the row is written on the way out, then the connection is cut
            exchange.broke_off(timed_out=exc.timed_out)
            logger.warning("upstream broke off a call of rollout %s: %s", exchange.rollout_id, exc.kind)
            raise UpstreamBroken(exc.kind) from None
        held = await exchange.complete(self.writer)  # durable before the client's last byte
        await send({"type": "http.response.body", "body": held, "more_body": False})

    async def _refuse_status(self, exchange: Exchange, response: UpstreamResponse, send: Send) -> None:
        """A status no HTTP server can send (999): the row keeps it and the body (up to the cap),
        the client gets a 502 naming it."""
        logger.warning(
            "upstream answered status %d to a call of rollout %s: answered 502",
            response.status,
            exchange.rollout_id,
        )
        exchange.answered_locally(INVALID_STATUS_KIND)
        read = 0
        try:
            async for chunk in response.chunks():
                exchange.body(chunk)  # not forwarded
                read += len(chunk)
                if read > exchange.max_body_bytes:
                    exchange.broke_off()  # enough for the row: the rest is not waited for
                    break
        except UpstreamError as exc:
            exchange.broke_off(timed_out=exc.timed_out)
        if exchange.broken:
            exchange.end()
            await exchange.write_row(self.writer)
        else:
            await exchange.complete(self.writer)
        await send_json_error(send, 502, invalid_status_message(response.status), INVALID_STATUS_KIND)


def _error_kind(exc: UpstreamError) -> str:
    """The ``type`` of the error the proxy answers for an upstream it could not get an answer from
    (also the row's ``local_response_reason``)."""
    return "upstream_timeout" if exc.timed_out else "upstream_connection_error"


async def _send_upstream_error(send: Send, exc: UpstreamError) -> None:
    if exc.timed_out:
        await send_json_error(send, 504, f"upstream timed out: {exc.kind}", _error_kind(exc))
    else:
        await send_json_error(send, 502, f"upstream unreachable: {exc.kind}", _error_kind(exc))


class ClientLeft(Exception):
    """The client went away before its request body was whole (or sent one uvicorn could not parse)."""


class _BodyStream:
    """The request body forwarded as it arrives: ``first``, then whatever the client still sends.

    A client that goes away mid-body ends it with :class:`ClientLeft`, never a clean end: the
    upstream client then aborts the request instead of closing it as if it were whole (a
    chunked body would get its last chunk, a cut body would reach the model as a request).
    """

    __slots__ = ("_done", "_first", "_on_end", "_on_leave", "_receive", "left")

    def __init__(
        self,
        first: bytes,
        receive: Receive,
        *,
        on_leave: Callable[[], None] | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._first = first
        self._receive = receive
        self._on_leave = on_leave
        self._on_end = on_end
        self._done = False
        self.left = False

    def __aiter__(self) -> _BodyStream:
        return self

    async def __anext__(self) -> bytes:
        if self._first:
            first, self._first = self._first, b""
            return first
        while not self._done:
            message: Message = await self._receive()
            if message["type"] == "http.disconnect":
                self._done = self.left = True
                if self._on_leave is not None:
                    self._on_leave()
                raise ClientLeft("the client went away before its request body was whole")
            if not message.get("more_body", False):
                self._done = True
                if self._on_end is not None:
                    self._on_end()
            chunk: bytes = message.get("body", b"")
            if chunk:
                return chunk
        raise StopAsyncIteration
