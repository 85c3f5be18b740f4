"""``rollout_capture.producer.classify``: the ``error_category`` of a row (spec 5), from a status,
an error inside a stream, or an exception, by NeMo Gym's rules."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rollout_capture.producer.classify import (
    ErrorCategory,
    category_for_exception,
    category_for_status,
    category_for_stream_error,
    exception_http_answer,
    invalid_status_message,
    is_valid_status,
)

C = ErrorCategory


@pytest.mark.parametrize(
    ("status", "category"),
    [
        (None, None),
        (200, None),
        (399, None),
        (400, C.CLIENT_ERROR),
        (401, C.AUTH),
        (403, C.AUTH),
        (404, C.NOT_FOUND),
        (408, C.TIMEOUT),
        (422, C.CLIENT_ERROR),
        (429, C.RATE_LIMIT),
        (500, C.UPSTREAM_ERROR),
        (504, C.TIMEOUT),
        (529, C.UPSTREAM_ERROR),
    ],
)
def test_a_status_has_the_specs_category(status: int | None, category: ErrorCategory | None) -> None:
    assert category_for_status(status) == category


def test_valid_statuses_are_three_digits_from_100_to_599() -> None:
    assert [s for s in (99, 100, 599, 600, 999) if is_valid_status(s)] == [100, 599]
    assert "999" in invalid_status_message(999) and "100-599" in invalid_status_message(999)


@pytest.mark.parametrize(
    "error",
    [
        {"type": "rate_limit_error"},
        {"type": "overloaded_error"},
        {"code": "invalid_request_error"},
        {"type": "permission_error"},
        {"code": 429},
        {"code": 200},
        {"code": True},
        "a bare string",
        None,
    ],
)
def test_an_error_inside_a_stream_is_upstream_error_whatever_it_says(error: object) -> None:
    """NeMo Gym 0.7.0's capture reads any error a 200 stream reports as ``upstream_error`` (its
    status decides first, and a 200 says nothing): ours reads it so too (issue 34)."""
    assert category_for_stream_error(error) == C.UPSTREAM_ERROR


class ReadTimeout(Exception):
    """Named as httpx's: the name decides."""


class ClientConnectorError(Exception):
    """Named as aiohttp's."""


@pytest.mark.parametrize(
    ("exc", "category"),
    [
        (asyncio.CancelledError(), C.CANCELLED),
        (TimeoutError(), C.TIMEOUT),
        (ReadTimeout(), C.TIMEOUT),
        (httpx.ConnectTimeout("connect"), C.TIMEOUT),  # timeout wins over connect
        (ConnectionResetError(), C.CONNECTION),
        (ClientConnectorError(), C.CONNECTION),
        (httpx.ConnectError("refused"), C.CONNECTION),
        (RuntimeError("boom"), C.EXCEPTION),
    ],
    ids=lambda value: type(value).__name__,
)
def test_an_exception_is_read_by_its_type_and_name(exc: BaseException, category: ErrorCategory) -> None:
    assert category_for_exception(exc) == category


def test_an_sdk_status_error_carries_the_status_and_body_it_was_answered() -> None:
    request = httpx.Request("POST", "http://upstream/v1/chat/completions")
    response = httpx.Response(429, content=b'{"error": "slow down"}', request=request)
    exc = httpx.HTTPStatusError("429", request=request, response=response)
    assert exception_http_answer(exc) == (429, b'{"error": "slow down"}')


class _Carrier(Exception):
    def __init__(self, **fields: object) -> None:
        super().__init__("carrier")
        for name, value in fields.items():
            setattr(self, name, value)


class _Exploding:
    """A lazy response that fails when read."""

    @property
    def status_code(self) -> int:
        raise RuntimeError("not loaded")

    @property
    def content(self) -> bytes:
        raise RuntimeError("not loaded")

    text = "fallback text"


def test_the_answer_is_read_from_whatever_fields_the_exception_has_and_never_raises() -> None:
    assert exception_http_answer(_Carrier(status=503, response_content=b"x")) == (503, b"x")
    assert exception_http_answer(_Carrier(status_code=404)) == (404, b"")
    assert exception_http_answer(_Carrier(status=True)) == (None, b"")  # a bool is no status
    # what fails to read is skipped: the status left out, the body from the next field, the text
    assert exception_http_answer(_Carrier(response=_Exploding())) == (None, b"fallback text")
    assert exception_http_answer(RuntimeError("plain")) == (None, b"")
