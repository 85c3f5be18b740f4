"""Error categories a producer writes into a row (spec 5), from a status or what went wrong."""

from __future__ import annotations

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
_STREAM_ERROR_TYPES: dict[str, ErrorCategory] = {
    "rate_limit_error": ErrorCategory.RATE_LIMIT,
    "authentication_error": ErrorCategory.AUTH,
    "permission_error": ErrorCategory.AUTH,
    "not_found_error": ErrorCategory.NOT_FOUND,
    "invalid_request_error": ErrorCategory.CLIENT_ERROR,
    "request_too_large": ErrorCategory.CLIENT_ERROR,
    "timeout_error": ErrorCategory.TIMEOUT,
}


def category_for_stream_error(error: Any) -> ErrorCategory:
    """The category of an error reported inside a 200 stream (overloaded, api_error...)."""
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code")
        if isinstance(kind, str) and kind in _STREAM_ERROR_TYPES:
            return _STREAM_ERROR_TYPES[kind]
        code = error.get("code")
        if isinstance(code, int) and not isinstance(code, bool):
            return category_for_status(code) or ErrorCategory.UPSTREAM_ERROR
    return ErrorCategory.UPSTREAM_ERROR
