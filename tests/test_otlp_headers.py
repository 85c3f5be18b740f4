"""OTLP headers from ``--otlp-header``, ``ROLLOUT_CAPTURE_OTLP_HEADERS`` and a Secret block's value
(issue 30): each form parsed, and a malformed one refused without its value in the message."""

from __future__ import annotations

import pytest

from rollout_capture.otlp_headers import (
    HEADERS_ENV,
    HeaderError,
    headers_of_secret,
    otlp_headers,
    parse_header,
    parse_header_list,
)

SECRET = "sk-unit-0123456789"


def test_each_form_parses() -> None:
    assert parse_header(f"api_key: {SECRET}") == ("api_key", SECRET)
    assert parse_header(f"Authorization: Bearer {SECRET}:x") == ("Authorization", f"Bearer {SECRET}:x")
    assert parse_header_list(f"a={SECRET},b=x%2Cy") == {"a": SECRET, "b": "x,y"}
    both = otlp_headers([f"a: {SECRET}"], {HEADERS_ENV: "a=env,b=2"})
    assert dict(both) == {"a": SECRET, "b": "2"}  # --otlp-header wins over the variable
    assert SECRET not in repr(both) and SECRET not in str(both)
    assert dict(headers_of_secret({"api_key": SECRET}, "b")) == {"api_key": SECRET}
    assert dict(headers_of_secret(f"api_key: {SECRET}\nx-org: 7", "b")) == {"api_key": SECRET, "x-org": "7"}
    assert dict(headers_of_secret(f"api_key={SECRET},x-org=7", "b")) == {"api_key": SECRET, "x-org": "7"}


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_header, f"api_key {SECRET}"),
        (parse_header, f"Bearer {SECRET}: x"),
        (parse_header, "api_key: "),
        (parse_header_list, f"api_key {SECRET}"),
        (parse_header_list, f"api key={SECRET}"),
        (lambda text: headers_of_secret(text, "blk"), f"Bearer {SECRET}"),
        (lambda text: headers_of_secret({"bad name": text}, "blk"), SECRET),
        (lambda text: headers_of_secret([text], "blk"), SECRET),
    ],
)
def test_a_malformed_header_is_refused_without_its_value(parse: object, text: str) -> None:
    with pytest.raises(HeaderError) as raised:
        parse(text)  # type: ignore[operator]
    assert SECRET not in str(raised.value)
