"""ASGI plumbing shared by the middleware and the proxy: types, routing, reading a body, JSON errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson

from rollout_capture.producer.routing import BadPath, BadRolloutId, Route, check_forward_path, route

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


async def read_body(receive: Receive, limit: int) -> tuple[bytes, bool, bool]:
    """Read the request body up to ``limit`` bytes: ``(bytes, whole, client_gone)``.

    ``whole`` is False when the body outgrew the limit: the rest is still to be received.
    """
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts), False, True
        chunk = message.get("body", b"")
        if chunk:
            parts.append(chunk)
            size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), True, False
        if size > limit:
            return b"".join(parts), False, False


def error_body(status: int, message: str, kind: str) -> bytes:
    """An error both SDKs understand: OpenAI's ``error`` object with Anthropic's ``type``."""
    return orjson.dumps({"type": "error", "error": {"message": message, "type": kind, "code": status}})


async def send_json_error(send: Send, status: int, message: str, kind: str) -> None:
    """Answer with a JSON error (the producer's own, never the upstream's)."""
    body = error_body(status, message, kind)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def scope_method(scope: Scope) -> str:
    """The request's method; a scope without one (NeMo Gym's hand-built test scopes) is taken as
    a POST, as NeMo Gym's capture takes the model paths whatever the method."""
    method = scope.get("method")
    return method if isinstance(method, str) else "POST"


def scope_headers(scope: Scope) -> Headers:
    """The request's headers (none when the scope has no ``headers``)."""
    return list(scope.get("headers") or ())


async def route_or_refuse(
    scope: Scope, send: Send, *, every_path: bool = False, verify_paths: Sequence[str] = ()
) -> Route | None:
    """The route of an HTTP request, or None once a bad rollout id or a path that would not go
    where it says (dot segments, encoded slashes) has been answered with 400.

    ``every_path``: paths without the rollout prefix are checked too (the proxy forwards them
    under its upstream's base path; the middleware hands them to its app untouched).
    """
    try:
        found = route(
            scope_method(scope), scope.get("path") or "/", scope.get("raw_path"), verify_paths=verify_paths
        )
        if every_path and found.rollout_id is None:
            check_forward_path(found.raw_path)
        return found
    except BadRolloutId as exc:
        await send_json_error(send, 400, str(exc), "invalid_rollout_id")
    except BadPath as exc:
        await send_json_error(send, 400, str(exc), "invalid_path")
    return None


def replace_header(headers: Headers, name: bytes, value: bytes | None) -> Headers:
    """``headers`` with every ``name`` header removed, then ``name: value`` added unless None."""
    kept = [(k, v) for k, v in headers if k.lower() != name]
    if value is not None:
        kept.append((name, value))
    return kept
