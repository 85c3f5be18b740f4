"""NeMo Gym's URL convention (spec 11): ``/ng-rollout/<rollout_id>/v1/...`` names the rollout.

The id is read from the raw path, so an encoded ``/`` or ``..`` cannot split or escape
it: it is validated as one segment before anything is written. A forwarded path with a dot
segment or an encoded slash is refused too (:func:`check_forward_path`): a server that
resolves it would leave the upstream's base path, or serve another endpoint than the one
captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote, unquote_to_bytes

from rollout_capture.identity import validate_rollout_id

Dialect = Literal["chat", "responses", "messages"]

ROLLOUT_PREFIX = b"/ng-rollout/"
# NeMo Gym's agents with training-token capture on put this segment after the rollout id; it is
# stripped with the prefix (the call is captured as any other; token ids are not recorded apart).
TOKEN_CAPTURE_SEGMENT = b"/training-token-capture"
# NeMo Gym's resources servers answer a verify call here (a POST whose answer carries ``reward``).
VERIFY_PATHS: tuple[str, ...] = ("/verify",)
VERIFIER_HEADER = b"x-rollout-capture-verifier-invocation-id"
CAPTURED_PATHS: dict[str, Dialect] = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


class BadRolloutId(ValueError):
    """The path names a rollout id that fails validation (answered 400, nothing written)."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(f"invalid rollout id {rollout_id!r} in the request path")
        self.rollout_id = rollout_id


class BadPath(ValueError):
    """A path that cannot be forwarded as it is (answered 400, nothing written, nothing forwarded)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"refused request path {path!r}: {why}")
        self.path = path


def check_forward_path(raw: bytes, shown: bytes | None = None) -> None:
    """Refuse a raw path with a ``.`` or ``..`` segment (percent-encoded or not) or an encoded
    ``/`` or a ``\\`` (raw or encoded): a normalizing server would resolve it elsewhere than the
    path says (outside the upstream's base path, or to an endpoint other than the one captured).

    One scan of the path for the usual one (no ``/.``, ``%`` or ``\\``). Raises :class:`BadPath`
    naming ``shown`` (the path as the client sent it), else ``raw``.
    """
    if b"/." not in raw and b"%" not in raw and b"\\" not in raw:
        return
    for segment in raw.split(b"/"):
        decoded = unquote_to_bytes(segment) if b"%" in segment else segment
        if decoded in (b".", b".."):
            raise BadPath((shown or raw).decode("latin-1"), "dot segments are not forwarded")
        if b"/" in decoded or b"\\" in decoded:
            raise BadPath(
                (shown or raw).decode("latin-1"), "an encoded slash or a backslash is not forwarded"
            )


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: the path to forward, and for captured calls whose and which dialect."""

    path: str
    raw_path: bytes
    rollout_id: str | None = None
    dialect: Dialect | None = None
    verify: bool = False
    """A verifier server's verify call (a ``verifier_invocation`` row; the rollout id may come
    from the body when the path has no prefix)."""

    @property
    def captured(self) -> bool:
        """Whether this call gets a claim and a row."""
        return self.dialect is not None


def route(method: str, path: str, raw_path: bytes | None, *, verify_paths: Sequence[str] = ()) -> Route:
    """Strip the rollout prefix (and NeMo Gym's ``/training-token-capture`` segment after it), if
    any, and say whether the call is captured: a model call, or a POST to one of ``verify_paths``.

    Raises :class:`BadRolloutId` when the prefix names an invalid id, :class:`BadPath` when
    the path after it has dot segments or encoded slashes (a path without the prefix is the
    caller's to check: the proxy refuses it the same way, the middleware passes it on).
    """
    raw = raw_path if raw_path is not None else path.encode("utf-8")
    if raw.startswith(b"//"):
        # A client base URL with a trailing slash ("http://proxy:8100/" + "/ng-rollout/..."):
        # routed as the same path with one slash.
        trimmed = b"/" + raw.lstrip(b"/")
        if trimmed.startswith(ROLLOUT_PREFIX):
            raw = trimmed
    if not raw.startswith(ROLLOUT_PREFIX):
        return Route(path, raw, verify=method == "POST" and path in verify_paths)
    segment, slash, tail = raw[len(ROLLOUT_PREFIX) :].partition(b"/")
    text = unquote(segment.decode("latin-1"))
    try:
        rollout_id = validate_rollout_id(text)
    except ValueError:
        raise BadRolloutId(text) from None
    forward_raw = _single_slashes(slash + tail) if slash else b"/"
    if forward_raw == TOKEN_CAPTURE_SEGMENT or forward_raw.startswith(TOKEN_CAPTURE_SEGMENT + b"/"):
        forward_raw = forward_raw[len(TOKEN_CAPTURE_SEGMENT) :] or b"/"
    check_forward_path(forward_raw, raw)
    forward_path = unquote(forward_raw.decode("latin-1"))
    post = method == "POST"
    dialect = CAPTURED_PATHS.get(forward_path) if post else None
    return Route(forward_path, forward_raw, rollout_id, dialect, verify=post and forward_path in verify_paths)


def _single_slashes(raw: bytes) -> bytes:
    """``//v1//chat/completions`` -> ``/v1/chat/completions``: what a base URL ending in a slash
    (``.../ng-rollout/12-3/`` or ``.../v1/``) joined with a path starting with one gives."""
    while b"//" in raw:
        raw = raw.replace(b"//", b"/")
    return raw


def header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (given lower-case; names may come in any case)."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None
