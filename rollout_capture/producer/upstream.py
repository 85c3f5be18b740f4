"""The proxy's one pooled upstream client: httpx, on a pool that stays cheap under concurrency.

Each time httpcore assigns a request it walks every pooled connection (quadratically, for
idle ones) and asks each whether the server closed it, through anyio's attribute lookup
(about 50 µs a connection). With 32 calls in flight that is milliseconds a call, most of
a proxy's budget. So the pool is split into a few shards, each call going to the least
busy one, and a connection keeps its raw socket to answer with a single ``poll``.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import typing
from collections.abc import AsyncIterator

import httpcore
import httpx


def _readable(sock: socket.socket | None) -> bool:
    """True when a read would not block (data, or the peer's close): the connection is not idle-clean."""
    if sock is None or sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class _Stream(httpcore.AsyncNetworkStream):
    """An anyio stream that remembers its socket."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._socket: socket.socket | None = inner.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable":
            return _readable(self._socket)
        if info == "socket":
            return self._socket
        return self._inner.get_extra_info(info)


class _Backend(httpcore.AsyncNetworkBackend):
    """httpcore's anyio backend, handing out :class:`_Stream`."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _Stream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class PooledTransport(httpx.AsyncHTTPTransport):
    """httpx's HTTP transport (exception mapping, streaming) on the cheaper pool."""

    def __init__(self, limits: httpx.Limits, ssl_context: ssl.SSLContext | None = None) -> None:
        context = ssl_context or httpx.create_ssl_context()
        super().__init__(limits=limits, verify=context)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )


class _CountedStream(httpx.AsyncByteStream):
    """A response body that tells its shard when the call is over."""

    def __init__(self, inner: httpx.AsyncByteStream, done: typing.Callable[[], None]) -> None:
        self._inner = inner
        self._done: typing.Callable[[], None] | None = done

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            if self._done is not None:
                self._done()
                self._done = None


class ShardedTransport(httpx.AsyncBaseTransport):
    """A few :class:`PooledTransport` shards; each call goes to the one with the fewest in flight."""

    def __init__(self, limits: httpx.Limits, shards: int = 4) -> None:
        total = limits.max_connections or 100
        per = max(1, math.ceil(total / shards))
        shard_limits = httpx.Limits(
            max_connections=per, max_keepalive_connections=per, keepalive_expiry=limits.keepalive_expiry
        )
        context = httpx.create_ssl_context()  # loading CA certificates once is enough
        self._shards = [PooledTransport(shard_limits, context) for _ in range(shards)]
        self._busy = [0] * shards

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        busy = self._busy
        index = busy.index(min(busy))
        busy[index] += 1

        def done() -> None:
            busy[index] -= 1

        try:
            response = await self._shards[index].handle_async_request(request)
        except BaseException:
            done()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _CountedStream(response.stream, done)
        return response

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


def upstream_client(
    *,
    max_connections: int,
    connect_timeout_s: float,
    read_timeout_s: float,
    write_timeout_s: float,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """The client every proxied call goes through (no redirects followed: the client sees them)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=connect_timeout_s, read=read_timeout_s, write=write_timeout_s, pool=None
        ),
        limits=limits,
        follow_redirects=False,
        transport=transport or ShardedTransport(limits),
    )
