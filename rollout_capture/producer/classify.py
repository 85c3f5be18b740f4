"""Error categories a producer writes into a row (spec 5), from a status or what went wrong."""

from __future__ import annotations

import asyncio
from enum import StrEnum
from typing import Any


class ErrorCategory(StrEnum):
    """Every ``error_category`` a producer writes; null means the call succeeded."""

    TIMEOUT = "timeout"
    RATE_LIMIT = "rate_limit"
    AUTH = "auth"
    NOT_FOUND = "not_found"
    CLIENT_ERROR = "client_error"
    UPSTREAM_ERROR = "upstream_error"
    CANCELLED = "cancelled"
    CONNECTION = "connection"
    EXCEPTION = "exception"
    INCOMPLETE = "incomplete"
    STREAM_TRUNCATED = "stream_truncated"
    CAPTURE_PARSE_ERROR = "capture_parse_error"


def is_valid_status(status: int) -> bool:
    """RFC 9110 15: a status is three digits from 100 to 599. ASGI servers know no others
    (uvicorn fails on the status line of 999): the producers answer 502 in its place."""
    return 100 <= status <= 599


def invalid_status_message(status: int) -> str:
    """The 502's message, naming the status the model server answered."""
    return f"the model server answered HTTP status {status}, which is not a valid status (100-599)"


INVALID_STATUS_KIND = "upstream_invalid_status"


def category_for_status(status: int | None) -> ErrorCategory | None:
    """Spec 5: <400 null; 408/504 timeout; 429 rate_limit; 401/403 auth; 404 not_found;
    other 4xx client_error; >=500 upstream_error."""
    if status is None or status < 400:
        return None
    if status in (408, 504):
        return ErrorCategory.TIMEOUT
    if status == 429:
        return ErrorCategory.RATE_LIMIT
    if status in (401, 403):
        return ErrorCategory.AUTH
    if status == 404:
        return ErrorCategory.NOT_FOUND
    if status < 500:
        return ErrorCategory.CLIENT_ERROR
    return ErrorCategory.UPSTREAM_ERROR


# Error types named inside streamed error events (Anthropic's, OpenAI-compatible servers').
def category_for_stream_error(error: Any) -> ErrorCategory:
    """The category of an error reported inside a 200 stream: ``upstream_error``, whatever its
    type or code says (a rate limit, overloaded...), as NeMo Gym 0.7.0's capture reads it (its
    terminal ``error`` event, a chat chunk carrying ``error``, ``response.failed``), so a stream
    reads the same whichever producer recorded it. ``error`` is kept for the record's sake."""
    del error
    return ErrorCategory.UPSTREAM_ERROR


def category_for_exception(exc: BaseException) -> ErrorCategory:
    """The category of an exception the model server raised, by NeMo Gym's rule (so that the same
    failure reads the same whichever capture recorded it): a cancel is ``cancelled``; a
    ``TimeoutError`` or a type whose name says ``timeout`` (httpx's ``ReadTimeout``, aiohttp's
    ``ServerTimeoutError``, openai's ``APITimeoutError``) is ``timeout``; a type whose name says
    ``conn`` (``ConnectionError``, httpx's ``ConnectError``, aiohttp's ``ClientConnectorError``) is
    ``connection``; anything else ``exception``."""
    if isinstance(exc, asyncio.CancelledError):
        return ErrorCategory.CANCELLED
    if isinstance(exc, TimeoutError):
        return ErrorCategory.TIMEOUT
    name = type(exc).__name__.lower()
    if "timeout" in name:
        return ErrorCategory.TIMEOUT
    if "conn" in name:
        return ErrorCategory.CONNECTION
    return ErrorCategory.EXCEPTION


def _attribute(value: Any, name: str) -> Any:
    """``value.name``, or None when reading it fails (a lazy response may raise when touched)."""
    try:
        return getattr(value, name, None)
    except Exception:
        return None


def exception_http_answer(exc: BaseException) -> tuple[int | None, bytes]:
    """The HTTP answer an exception carries, as NeMo Gym reads it: ``(status, body)``.

    SDK status errors (openai's ``APIStatusError``, httpx's ``HTTPStatusError``, aiohttp's
    ``ClientResponseError``) carry the status another upstream answered the server, as ``status``,
    ``status_code`` or ``response.status_code``; the body as ``response_content``,
    ``response.content`` or ``response.text``. Never raises: what cannot be read is left out
    ``(None, b"")`` and the exception is then classified by its type alone.
    """
    response = _attribute(exc, "response")
    status = _attribute(exc, "status")
    if not _is_status(status):
        status = _attribute(exc, "status_code")
    if not _is_status(status) and response is not None:
        status = _attribute(response, "status_code")
    body = _attribute(exc, "response_content")
    if body is None and response is not None:
        body = _attribute(response, "content")
        if body is None:
            body = _attribute(response, "text")
    if isinstance(body, str):
        body = body.encode("utf-8", "replace")
    return (
        status if _is_status(status) else None,
        bytes(body) if isinstance(body, bytes | bytearray) else b"",
    )


def _is_status(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
