"""The proxy's one pooled upstream client, behind a small seam: ``send`` a request, iterate its answer.

aiohttp: C-accelerated response parsing and an O(1) connection pool; it hands over
whatever bytes have arrived, so a burst of stream events costs one relay step, not one
per event. (The former httpx client was removed: measured with benchmarks/bench_proxy.py
it cost about twice the proxy CPU per call, and no setting needed it.)
"""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol

import aiohttp
import httpx
import yarl

Headers = list[tuple[bytes, bytes]]
ClientKind = Literal["aiohttp"]
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
            # httpx's context (certifi's CA bundle), as the project has always trusted.
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
    """The client every proxied call goes through; call inside the event loop that will use it.

    ``write_timeout_s`` is accepted and unused: aiohttp has none (see :class:`AiohttpUpstream`).
    """
    if kind != "aiohttp":
        raise ValueError(f"the upstream client is aiohttp; got {kind!r}")
    return AiohttpUpstream(
        base_url,
        max_connections=max_connections,
        connect_timeout_s=connect_timeout_s,
        read_timeout_s=read_timeout_s,
    )
