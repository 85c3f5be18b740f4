"""One OTLP/HTTP request at a time, each bounded whole: the only place this package talks HTTP.

The client is httpx's (a dependency already, Prefect's own), configured as OpenTelemetry's
exporter configured ``requests``; httpx is imported only when a request is made (importing it
loads ``rich``, which the core's modules must not at import), on fsspec's I/O loop thread.

- **A deadline bounds the whole exchange** (connect, send, status line, headers, body): the
  request is cancelled at the deadline, so an endpoint trickling a byte at a time cannot stretch
  it (httpx's own timeouts bound one read, not the answer).
- **Nothing is followed.** A redirect is an :class:`Answer` like any other, its ``Location``
  shown (scheme, host, path): the request and its headers never go to a host the user did not name.
- **The environment is used as OpenTelemetry's exporter used it**: the proxy (``https_proxy``,
  ``http_proxy``, ``all_proxy``, ``no_proxy``; an ``https://`` proxy spoken to over TLS, a proxy
  without a port reached on 80 or 443), the CA bundle (``OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE``
  or ``OTEL_EXPORTER_OTLP_CERTIFICATE``, else ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``, else
  certifi's) and a client certificate for mutual TLS (``OTEL_EXPORTER_OTLP_(TRACES_)CLIENT_CERTIFICATE``
  and ``..._CLIENT_KEY``).
- **A kept-alive connection the server closed costs nothing**: one found closed is not used, and
  one that fails before any answer (closed as the request went out) is opened again and the
  request sent once more at once, not counted as a retry.
- **Answers are read bounded**: at most :data:`MAX_ANSWER_BYTES` of a body (the rest is left
  unread and the connection dropped), a reason phrase or a message shown cut to a line, header
  values (an API key echoed back) masked in anything shown.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fsspec.asyn import get_loop
from fsspec.asyn import sync as fsspec_sync

from rollout_capture.secret_options import bare_url

if TYPE_CHECKING:
    import httpx

MAX_ANSWER_BYTES = 64 * 1024
"""Bytes of an answer's body read at most (an OTLP answer is a few bytes; an error page a few kB)."""
SHOWN_CHARS = 160
"""Characters of an endpoint's own words (reason phrase, message, ``Location``) shown at most."""
_TLS_VARIABLES = {
    "certificate": ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE"),
    "client certificate": (
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    ),
    "client key": ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY"),
}
"""OpenTelemetry's TLS settings, the traces-specific variable first (as its exporter reads them)."""


class NoAnswer(Exception):
    """No complete HTTP answer: refused, reset, unresolved, not HTTP, or past the deadline."""

    def __init__(self, why: str, *, timed_out: bool = False) -> None:
        super().__init__(why)
        self.timed_out = timed_out


class TlsSettingsError(ValueError):
    """An OpenTelemetry TLS variable names a file that cannot be used (missing, not PEM, no key)."""


def shown_location(url: str) -> str:
    """An endpoint or a redirect's target as an error names it: scheme, host and path (no query, no
    userinfo: :func:`~rollout_capture.secret_options.bare_url`), cut to a line."""
    return one_line(bare_url(url) or "(no URL)")


def one_line(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` as one printable line of at most ``limit`` characters (an endpoint's words are input)."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 4]).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint answered, read bounded."""

    status: int
    reason: str
    """The reason phrase, one line, cut."""
    location: str | None
    """A redirect's target as shown (scheme, host, path), else None."""
    body: bytes
    """The body's first :data:`MAX_ANSWER_BYTES` bytes at most."""
    content_type: str
    retry_after_s: float | None
    """``Retry-After`` in seconds when the endpoint gave one (a 429 or 503 asking for a pause)."""

    @property
    def shown(self) -> str:
        """``HTTP 302 Found``: the status and its reason phrase as an error names them."""
        return f"HTTP {self.status}" + (f" {self.reason}" if self.reason else "")


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:  # an HTTP date: not worth parsing, the growing pauses apply
        return None
    return seconds if seconds is not None and 0 <= seconds < 3600 else None


def _tls_setting(what: str) -> tuple[str, str] | None:
    """``(variable, path)`` of an OpenTelemetry TLS setting that is set, else None."""
    for variable in _TLS_VARIABLES[what]:
        value = os.environ.get(variable, "").strip()
        if value:
            return variable, value
    return None


def tls_context() -> ssl.SSLContext | bool:
    """How the endpoint's certificate is checked, and ours shown, as OpenTelemetry's variables say:
    ``True`` (httpx's default: ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``, else certifi's bundle) when none
    is set. Raises :class:`TlsSettingsError` naming the variable and its file when one is unusable."""
    import httpx

    ca, cert = _tls_setting("certificate"), _tls_setting("client certificate")
    key = _tls_setting("client key")
    if ca is None and cert is None:
        return True
    setting = ca
    try:
        context = ssl.create_default_context(cafile=ca[1]) if ca else httpx.create_ssl_context()
        if cert is not None:
            setting = key if key is not None else cert
            context.load_cert_chain(cert[1], key[1] if key else None)
    except (OSError, ssl.SSLError) as exc:
        variable, path = setting or cert or ("?", "?")
        raise TlsSettingsError(
            f"{variable} names {path}, which cannot be used ({type(exc).__name__}: "
            f"{getattr(exc, 'strerror', None) or getattr(exc, 'reason', None) or 'not a PEM file'})"
        ) from None
    return context


class _Opened:
    """Whether a request opened a new connection (httpcore's ``trace`` extension says so): one
    that did not went out on a kept-alive connection."""

    def __init__(self) -> None:
        self.new = False

    async def __call__(self, event: str, info: Mapping[str, Any]) -> None:
        if event.endswith(".connect_tcp.started"):
            self.new = True


class Connection:
    """Requests to one URL over httpx's kept-alive connections (opened again when dropped).

    One thread at a time posts; the exchanges run on fsspec's I/O loop, so the caller's thread
    (a flow's, a sender's) may hold an event loop of its own or none.
    """

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL, got {shown_location(url)}")
        self.url = url
        # identity: a body is read as it comes, bounded, never inflated first
        self.headers = {"Accept-Encoding": "identity", **headers}
        self.verify = tls_context() if parts.scheme == "https" else True
        self._client: httpx.AsyncClient | None = None

    def close(self) -> None:
        """Drop the connections (the next request opens another)."""
        if self._client is not None:
            fsspec_sync(get_loop(), self._drop)

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def post(self, body: bytes, deadline: float, headers: Mapping[str, str] | None = None) -> Answer:
        """POST ``body``; the answer, or :class:`NoAnswer` once ``deadline`` (``time.monotonic``)
        passes or the exchange breaks. Never follows a redirect."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NoAnswer("no time was left to send it", timed_out=True)
        answer: Answer = fsspec_sync(
            get_loop(), self._exchange, body, {**self.headers, **(headers or {})}, remaining
        )
        return answer

    async def _exchange(self, body: bytes, headers: dict[str, str], seconds: float) -> Answer:
        import httpx

        try:
            async with asyncio.timeout(seconds):
                response = await self._send(body, headers)
                try:
                    return await _read(response)
                finally:
                    await response.aclose()
        except TimeoutError:
            await self._drop()
            raise NoAnswer("no complete answer in time", timed_out=True) from None
        except (httpx.HTTPError, OSError, ValueError, ImportError) as exc:
            await self._drop()
            raise NoAnswer(_why(exc)) from None

    async def _send(self, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """The answer's head; a kept-alive connection failing before it is replaced once."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                verify=self.verify, trust_env=True, follow_redirects=False, timeout=None
            )
        client = self._client
        for last in (False, True):
            opened = _Opened()
            request = client.build_request(
                "POST", self.url, content=body, headers=headers, extensions={"trace": opened}
            )
            try:
                return await client.send(request, stream=True)
            except httpx.TransportError:
                if opened.new or last:
                    raise
        raise AssertionError("unreachable")


async def _read(response: httpx.Response) -> Answer:
    """The answer with at most :data:`MAX_ANSWER_BYTES` of its body (the rest left unread: the
    connection is then dropped, never a 400 MB body in memory)."""
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            break
    location = response.headers.get("Location")
    status = response.status_code
    return Answer(
        status=status,
        reason=one_line(response.reason_phrase or "", 60),
        location=shown_location(location) if location and 300 <= status < 400 else None,
        body=b"".join(chunks)[:MAX_ANSWER_BYTES],
        content_type=(response.headers.get("Content-Type") or "").split(";")[0].strip().lower(),
        retry_after_s=_retry_after(response.headers.get("Retry-After")),
    )


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what caused it, depth first (httpx wraps httpcore's, which wraps the socket's;
    anyio gathers every address's refusal in a group)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [c for c in (current.__cause__, current.__context__) if c is not None]
        stack += list(getattr(current, "exceptions", ()))


def _why(exc: BaseException) -> str:
    """Why no answer came, in words (never the exception's text: it may quote the URL's query)."""
    import httpx

    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLError):
            return f"TLS failed ({type(cause).__name__})"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, socket.gaierror):
            return "the host name did not resolve"
    if isinstance(exc, httpx.ProxyError):
        return "the proxy refused to carry the request (ProxyError)"
    if isinstance(exc, httpx.ReadError | httpx.WriteError | httpx.RemoteProtocolError) and any(
        isinstance(c, ConnectionError | EOFError) or "disconnected" in str(c) for c in _causes(exc)
    ):
        return "the connection was closed before an answer"
    if isinstance(exc, httpx.RemoteProtocolError | httpx.DecodingError):
        return f"not an HTTP answer ({type(exc).__name__})"
    if isinstance(exc, ImportError | httpx.UnsupportedProtocol):
        return f"the proxy the environment names cannot be used ({type(exc).__name__})"
    return type(exc).__name__


def masked(text: str, secrets: Any) -> str:
    """``text`` with every header value in ``secrets`` (a mapping of headers) replaced."""
    for value in getattr(secrets, "values", lambda: [])():
        if isinstance(value, str) and len(value) >= 4:
            text = text.replace(value, "<hidden>")
    return text
