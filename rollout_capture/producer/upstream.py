"""The proxy's one pooled upstream client, behind a small seam: ``send`` a request, iterate its answer.

Two implementations. ``aiohttp`` (the default): C-accelerated response parsing and an O(1)
connection pool; it hands over whatever bytes have arrived, so a burst of stream events
costs one relay step, not one per event. ``httpx``: the project's first client, kept for
comparison; its pool is split into shards because httpcore walks every pooled connection
on each request (quadratically for idle ones) and asks each whether the server closed it
through anyio (about 50 µs a connection), and a connection keeps its raw socket to answer
with a single ``poll``. Measured per proxied call (benchmarks/bench_proxy.py): aiohttp
costs about a quarter of httpx's CPU.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import typing
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol

import aiohttp
import httpcore
import httpx
import yarl

Headers = list[tuple[bytes, bytes]]
ClientKind = Literal["aiohttp", "httpx"]
_URL_CACHE_SIZE = 1024
U = typing.TypeVar("U")


class UrlCache(typing.Generic[U]):
    """Upstream URLs parsed once per request target (a URL parser costs ~0.1 ms a call)."""

    def __init__(self, base_url: str, parse: typing.Callable[[str], U]) -> None:
        self._base, self._parse = base_url, parse
        self._urls: dict[str, U] = {}

    def __call__(self, target: str) -> U:
        url = self._urls.get(target)
        if url is None:
            if len(self._urls) >= _URL_CACHE_SIZE:
                self._urls.clear()
            url = self._urls[target] = self._parse(self._base + target)
        return url


class UpstreamError(Exception):
    """The upstream could not be reached, broke off, or stayed silent too long (``timed_out``)."""

    def __init__(self, kind: str, *, timed_out: bool) -> None:
        super().__init__(kind)
        self.kind = kind
        self.timed_out = timed_out


class UpstreamResponse(Protocol):
    """An answer whose status and headers arrived; its body is read with :meth:`chunks`."""

    status: int
    headers: Sequence[tuple[bytes, bytes]]
    """As the upstream sent them (names in its case)."""

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises :class:`UpstreamError` when the upstream breaks off."""
        ...

    async def aclose(self) -> None:
        """Give the connection back (or drop it when the body was not read to its end)."""
        ...


class Upstream(Protocol):
    """One pooled client for one upstream base URL."""

    async def send(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: bytes | AsyncIterator[bytes],
        *,
        decode: bool,
    ) -> UpstreamResponse:
        """Send a request (``target``: raw path and query); return once the answer's head is in.

        Only the given headers go (plus Host and the body's framing). ``decode``: a body the
        upstream compressed is handed over decompressed. Raises :class:`UpstreamError`.
        """
        ...

    async def aclose(self) -> None:
        """Close the pool."""
        ...


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


class _HttpxResponse:
    def __init__(self, response: httpx.Response, decode: bool) -> None:
        self._response = response
        self.status = response.status_code
        self.headers: Sequence[tuple[bytes, bytes]] = response.headers.raw
        encoded = response.headers.get("content-encoding", "identity").lower() != "identity"
        self._decode = decode and encoded

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_bytes() if self._decode else self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamError(
                type(exc).__name__, timed_out=isinstance(exc, httpx.TimeoutException)
            ) from None

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """httpx on the sharded pool; requests are built directly (the client would add headers)."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        write_timeout_s: float,
    ) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        timeout = httpx.Timeout(
            connect=connect_timeout_s, read=read_timeout_s, write=write_timeout_s, pool=None
        )
        self._timeouts = timeout.as_dict()
        self._client = httpx.AsyncClient(
            timeout=timeout,
            limits=limits,
            follow_redirects=False,  # the client sees redirects
            transport=ShardedTransport(limits),
        )
        self._url = UrlCache(base_url, httpx.URL)

    async def send(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: bytes | AsyncIterator[bytes],
        *,
        decode: bool,
    ) -> UpstreamResponse:
        request = httpx.Request(
            method, self._url(target), headers=headers, content=body, extensions={"timeout": self._timeouts}
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamError(
                type(exc).__name__, timed_out=isinstance(exc, httpx.TimeoutException)
            ) from None
        return _HttpxResponse(response, decode)

    async def aclose(self) -> None:
        await self._client.aclose()


class _AiohttpResponse:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Sequence[tuple[bytes, bytes]] = response.raw_headers
        self._whole = False

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(type(exc).__name__, timed_out=isinstance(exc, TimeoutError)) from None
        self._whole = True

    async def aclose(self) -> None:
        if self._whole:
            self._response.release()
        else:
            self._response.close()


class AiohttpUpstream:
    """aiohttp with no cookie jar, no added headers and no redirects: the request goes as given.

    aiohttp has no write timeout: an upstream that stops reading a request body is cut by
    the read timeout instead.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        self._session = aiohttp.ClientSession(
            # httpx's context (certifi's CA bundle): the same trust as the former client.
            connector=aiohttp.TCPConnector(
                limit=max_connections, limit_per_host=0, ssl=httpx.create_ssl_context()
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
            ),
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            auto_decompress=False,
            trust_env=False,
        )
        # Kept exactly as the client encoded it.
        self._url = UrlCache(base_url, lambda url: yarl.URL(url, encoded=True))

    async def send(
        self,
        method: str,
        target: str,
        headers: Headers,
        body: bytes | AsyncIterator[bytes],
        *,
        decode: bool,
    ) -> UpstreamResponse:
        sent = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            response = await self._session.request(
                method,
                self._url(target),
                headers=sent,
                data=body,
                allow_redirects=False,
                auto_decompress=decode,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(type(exc).__name__, timed_out=isinstance(exc, TimeoutError)) from None
        return _AiohttpResponse(response)

    async def aclose(self) -> None:
        await self._session.close()


def open_upstream(
    kind: ClientKind,
    base_url: str,
    *,
    max_connections: int,
    connect_timeout_s: float,
    read_timeout_s: float,
    write_timeout_s: float,
) -> Upstream:
    """The client every proxied call goes through; call inside the event loop that will use it."""
    if kind == "httpx":
        return HttpxUpstream(
            base_url,
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            write_timeout_s=write_timeout_s,
        )
    return AiohttpUpstream(
        base_url,
        max_connections=max_connections,
        connect_timeout_s=connect_timeout_s,
        read_timeout_s=read_timeout_s,
    )
