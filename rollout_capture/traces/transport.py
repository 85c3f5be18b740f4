"""One OTLP/HTTP request at a time, each bounded whole: the only place this package talks HTTP.

- **A deadline bounds the whole exchange** (connect, send, status line, headers, body): a timer
  shuts the socket at the deadline, so an endpoint trickling a byte at a time cannot stretch a
  request past it (a socket timeout bounds one read, not the answer).
- **Nothing is followed.** A redirect is an :class:`Answer` like any other, its ``Location``
  shown (scheme, host, path): the request and its headers never go to a host the user did not name.
- **The environment's proxy is used** as OpenTelemetry's own exporter used it (``https_proxy`` /
  ``http_proxy``, ``no_proxy``): an https endpoint through a ``CONNECT`` tunnel, an http one
  asked of the proxy by its whole URL.
- **Answers are read bounded**: at most :data:`MAX_ANSWER_BYTES` of a body (the rest is left
  unread and the connection dropped), a reason phrase or a message shown cut to a line, header
  values (an API key echoed back) masked in anything shown.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.request
from base64 import b64encode
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from rollout_capture.secret_options import bare_url

MAX_ANSWER_BYTES = 64 * 1024
"""Bytes of an answer's body read at most (an OTLP answer is a few bytes; an error page a few kB)."""
SHOWN_CHARS = 160
"""Characters of an endpoint's own words (reason phrase, message, ``Location``) shown at most."""


class NoAnswer(Exception):
    """No complete HTTP answer: refused, reset, unresolved, not HTTP, or past the deadline."""

    def __init__(self, why: str, *, timed_out: bool = False) -> None:
        super().__init__(why)
        self.timed_out = timed_out


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


class _Watchdog:
    """Shuts a connection's socket at a deadline (from a timer thread), waking a read blocked in it."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float) -> None:
        self.connection, self.fired = connection, False
        self.timer = threading.Timer(max(seconds, 0.0), self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self.connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # the plain socket's: an SSL socket's would unwrap
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def cancel(self) -> None:
        self.timer.cancel()


@dataclass(frozen=True, slots=True)
class _Proxy:
    """The proxy the environment names for a URL, and its credentials as a header (if any)."""

    host: str
    port: int
    authorization: dict[str, str]

    @classmethod
    def of(cls, scheme: str, host: str) -> _Proxy | None:
        proxy = urllib.request.getproxies().get(scheme)
        if not proxy or urllib.request.proxy_bypass(host):
            return None
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if not parts.hostname:
            return None
        authorization = {}
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            authorization["Proxy-Authorization"] = "Basic " + b64encode(pair).decode()
        return cls(parts.hostname, parts.port or 8080, authorization)


class Connection:
    """Requests to one URL over one kept-alive connection (opened again when dropped)."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL, got {shown_location(url)}")
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port
        self.target = parts.path + (f"?{parts.query}" if parts.query else "")
        self.headers = dict(headers)
        self.proxy = _Proxy.of(parts.scheme, parts.hostname)
        if self.proxy is not None and not self.https:  # a plain proxy is asked for the whole URL
            self.target = urlunsplit(parts._replace(fragment=""))
            self.headers.update(self.proxy.authorization)
        self._connection: http.client.HTTPConnection | None = None

    def _open(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._connection is None:
            host, port = (self.proxy.host, self.proxy.port) if self.proxy else (self.host, self.port)
            if self.https:
                self._connection = http.client.HTTPSConnection(
                    host, port, timeout=timeout_s, context=ssl.create_default_context()
                )
                if self.proxy is not None:
                    self._connection.set_tunnel(self.host, self.port, headers=self.proxy.authorization)
            else:
                self._connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
        return self._connection

    def close(self) -> None:
        """Drop the connection (the next request opens another)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def post(self, body: bytes, deadline: float, headers: Mapping[str, str] | None = None) -> Answer:
        """POST ``body``; the answer, or :class:`NoAnswer` once ``deadline`` (``time.monotonic``)
        passes or the exchange breaks. Never follows a redirect."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NoAnswer("no time was left to send it", timed_out=True)
        connection = self._open(remaining)
        watchdog = _Watchdog(connection, remaining)
        try:
            if connection.sock is None:
                connection.timeout = remaining
                connection.connect()
            else:
                connection.sock.settimeout(remaining)
            if watchdog.fired:
                raise TimeoutError
            connection.request("POST", self.target, body=body, headers={**self.headers, **(headers or {})})
            answer = self._read(connection.getresponse())
            if watchdog.fired:  # the socket was shut mid-answer: what was read is cut short, not an answer
                raise TimeoutError
            return answer
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            if watchdog.fired or isinstance(exc, TimeoutError):
                raise NoAnswer("no complete answer in time", timed_out=True) from None
            raise NoAnswer(_why(exc)) from None
        finally:
            watchdog.cancel()

    def _read(self, answer: http.client.HTTPResponse) -> Answer:
        body = answer.read(MAX_ANSWER_BYTES + 1)
        if len(body) > MAX_ANSWER_BYTES or not answer.isclosed():
            self.close()  # the rest is left unread: never a 400 MB body in memory
            body = body[:MAX_ANSWER_BYTES]
        elif answer.will_close:
            self.close()
        location = answer.getheader("Location")
        return Answer(
            status=answer.status,
            reason=one_line(answer.reason or "", 60),
            location=shown_location(location) if location and 300 <= answer.status < 400 else None,
            body=body,
            content_type=(answer.getheader("Content-Type") or "").split(";")[0].strip().lower(),
            retry_after_s=_retry_after(answer.getheader("Retry-After")),
        )


def _why(exc: BaseException) -> str:
    """Why no answer came, in words (never the exception's text: it may quote the URL's query)."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError | http.client.RemoteDisconnected):
        return "the connection was closed before an answer"
    if isinstance(exc, socket.gaierror):
        return "the host name did not resolve"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({type(exc).__name__})"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP answer ({type(exc).__name__})"
    return type(exc).__name__


def masked(text: str, secrets: Any) -> str:
    """``text`` with every header value in ``secrets`` (a mapping of headers) replaced."""
    for value in getattr(secrets, "values", lambda: [])():
        if isinstance(value, str) and len(value) >= 4:
            text = text.replace(value, "<hidden>")
    return text
