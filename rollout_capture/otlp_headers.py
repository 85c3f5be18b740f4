"""OTLP request headers (an API key) from where a user may keep them: ``--otlp-header "Name: value"``,
the ``ROLLOUT_CAPTURE_OTLP_HEADERS`` variable (``Name=value,...`` as ``OTEL_EXPORTER_OTLP_HEADERS``)
or a Prefect ``Secret`` block. A value never appears in an error: only its header's name, or
its position, does; what is returned is an :class:`~rollout_capture.traces.exporter.OtlpHeaders`,
whose repr hides the values too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

from rollout_capture.traces.exporter import OtlpHeaders

HEADERS_ENV = "ROLLOUT_CAPTURE_OTLP_HEADERS"
"""Comma-separated ``Name=value`` pairs: keeps a key out of ``ps`` and shell history."""

_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP header name (RFC 9110 token)


class HeaderError(ValueError):
    """A malformed header: the message names where it came from and its name, never its value."""


def _checked(name: str, value: str, where: str) -> tuple[str, str]:
    name, value = name.strip(), value.strip()
    if not _TOKEN.match(name):
        # Not shown: a name that is no token may hold part of the value ("Bearer sk-...: x").
        raise HeaderError(f"{where}: a header name must be an HTTP token (letters, digits, -_.); not shown")
    if not value:
        raise HeaderError(f"{where}: header {name!r} has an empty value")
    if any(c in value for c in "\r\n\0"):
        raise HeaderError(f"{where}: header {name!r} has a line break or NUL in its value")
    return name, value


def parse_header(text: str, where: str = "--otlp-header") -> tuple[str, str]:
    """``"Name: value"`` as ``(name, value)``; refused naming the header, never showing the value."""
    name, sep, value = text.partition(":")
    if not sep:
        raise HeaderError(f"{where}: expected 'Name: value' (no ':' found; the value is not shown)")
    return _checked(name, value, where)


def parse_header_list(text: str, where: str = HEADERS_ENV) -> dict[str, str]:
    """``Name=value,Name2=value2`` (values percent-decoded, as the OpenTelemetry variable is)."""
    headers: dict[str, str] = {}
    for position, piece in enumerate(text.split(","), start=1):
        if not piece.strip():
            continue
        name, sep, value = piece.partition("=")
        if not sep:
            raise HeaderError(f"{where}: pair {position} is not 'Name=value' (the value is not shown)")
        key, decoded = _checked(name, unquote(value), where)
        headers[key] = decoded
    return headers


def _from_text(text: str, where: str) -> dict[str, str]:
    """Lines of ``Name: value``, or of comma-separated ``Name=value`` pairs (told apart per line:
    a colon form's name, before its ``:``, holds no ``=``)."""
    headers: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, _ = line.partition(":")
        if sep and _TOKEN.match(name.strip()):
            key, value = parse_header(line, where)
            headers[key] = value
        else:
            headers.update(parse_header_list(line, where))
    return headers


def otlp_headers(cli_headers: Iterable[str] = (), env: Mapping[str, str] | None = None) -> OtlpHeaders:
    """The CLI's headers: the variable's first (when set in ``env``), then each ``--otlp-header``."""
    headers: dict[str, str] = {}
    from_env = (env or {}).get(HEADERS_ENV)
    if from_env:
        headers.update(parse_header_list(from_env))
    for text in cli_headers:
        name, value = parse_header(text)
        headers[name] = value
    return OtlpHeaders(headers)


def headers_of_secret(value: Any, block: str) -> OtlpHeaders:
    """The headers a ``Secret`` block holds: a dict of name to value, or a string of ``Name: value``
    lines or ``Name=value,...`` pairs."""
    where = f"Secret block {block!r}"
    if isinstance(value, Mapping):
        return OtlpHeaders(dict(_checked(str(k), str(v), where) for k, v in value.items()))
    if isinstance(value, str):
        return OtlpHeaders(_from_text(value, where))
    raise HeaderError(
        f"{where}: expected a dict of headers or a 'Name: value' string, got a {type(value).__name__}"
    )
