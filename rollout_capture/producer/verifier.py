"""A verifier server's verify calls, each recorded as a ``verifier_invocation`` row (contract 4).

NeMo Gym's resources servers answer ``POST /verify`` with a ``reward``; mounted on one, the
middleware records each verify call: its id (the ``X-Rollout-Capture-Verifier-Invocation-Id``
header, else generated), the reward its answer carries, latency and status. The rollout is named
by the path's ``/ng-rollout/<id>`` prefix, else by the request body (a NeMo Gym verify request
carries the rollout's ``_ng_task_index`` / ``_ng_rollout_index``). The handler learns the id
from :func:`current_verifier_call` (or the request header, which is set for it) and tags its
judge-model calls with it, so their rows say whose tokens they are.
"""

from __future__ import annotations

import contextvars
import logging
import os
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_capture.identity import maybe_rollout_id_from_run_body, validate_rollout_id
from rollout_capture.producer.exchange import Exchange

logger = logging.getLogger("rollout_capture.producer")

VERIFIER_REF_TYPE = "resources_servers"
VERIFIER_HEADER_NAME = "X-Rollout-Capture-Verifier-Invocation-Id"


@dataclass(frozen=True, slots=True)
class VerifierCall:
    """The verify call being served: the rollout it grades and the id its judge calls carry."""

    rollout_id: str
    verifier_invocation_id: str

    @property
    def headers(self) -> dict[str, str]:
        """The header a judge-model call of this verify call carries (``default_headers=``)."""
        return {VERIFIER_HEADER_NAME: self.verifier_invocation_id}

    def base_url(self, server: str, *, v1: bool = True) -> str:
        """The judge client's base URL on a capturing ``server``: ``<server>/ng-rollout/<id>/v1``."""
        return f"{server.rstrip('/')}/ng-rollout/{self.rollout_id}" + ("/v1" if v1 else "")


_current: contextvars.ContextVar[VerifierCall | None] = contextvars.ContextVar(
    "rollout_capture_verifier_call", default=None
)


def current_verifier_call() -> VerifierCall | None:
    """The verify call the running handler serves (None outside one, or when capture is off)."""
    return _current.get()


def set_verifier_call(call: VerifierCall | None) -> contextvars.Token[VerifierCall | None]:
    """Make ``call`` the current verify call (the middleware does, around its handler)."""
    return _current.set(call)


def reset_verifier_call(token: contextvars.Token[VerifierCall | None]) -> None:
    _current.reset(token)


def rollout_of_verify_body(body: bytes, whole: bool) -> str | None:
    """The rollout a verify request without a path prefix grades, from its body (None: not said,
    or said badly, logged: such a call is forwarded uncaptured)."""
    if not whole or not body:
        return None
    try:
        parsed = orjson.loads(body)
        rollout_id = maybe_rollout_id_from_run_body(parsed) if isinstance(parsed, dict) else None
        return None if rollout_id is None else validate_rollout_id(rollout_id)
    except orjson.JSONDecodeError:
        return None
    except ValueError as exc:
        logger.warning("a verify call names its rollout badly (%s): forwarded uncaptured", exc)
        return None


def new_invocation_id() -> str:
    """A verifier invocation id for a verify call that brought none (32 hex digits)."""
    return os.urandom(16).hex()


class VerifierExchange(Exchange):
    """One verify call: a model call's lifecycle (claim, durable row before the last byte,
    release), its answer kept as a plain body, and a ``verifier_invocation`` row."""

    def __init__(
        self, rollout_id: str, invocation_id: str, *, server_name: str | None, max_body_bytes: int
    ) -> None:
        super().__init__(
            rollout_id,
            "responses",  # unused: a verify answer is never reassembled as a model stream
            server_name=server_name,
            max_body_bytes=max_body_bytes,
            verifier_invocation_id=invocation_id,
        )

    def prepare_request(self, body: bytes, *, whole: bool) -> bytes:
        """Keep the verify request for the row; it is forwarded as it came."""
        if not whole or len(body) > self.max_body_bytes:
            self.request_cut = True
            self.request_raw = body[: self.max_body_bytes].decode("utf-8", "replace")
            return body
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            self.request = parsed
        elif body:
            self.request_raw = body.decode("utf-8", "replace")
        return body

    def response_started(self, status: int, headers: Any) -> None:
        self.status_code = status  # no relay: the answer is kept as a body, whatever its type

    def row(self) -> dict[str, Any]:
        """The ``verifier_invocation`` row (contract 4), ``reward`` read from the answer."""
        call = super().row()
        response = call["response"]
        reward = response.get("reward") if isinstance(response, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            reward = None
        row: dict[str, Any] = {
            "kind": "verifier_invocation",
            "verifier_invocation_id": self.verifier_invocation_id,
            "verifier_ref": (
                {"type": VERIFIER_REF_TYPE, "name": self.server_name}
                if self.server_name is not None
                else None
            ),
            "started_at": call["started_at"],
            "completed_at": call["completed_at"],
            "latency_ms": call["latency_ms"],
            "status_code": call["status_code"],
            "error_category": call["error_category"],
            "reward": reward,
            "request": call["request"],
            "response": response,
        }
        for key in (
            "request_raw",
            "response_raw",
            "request_truncated",
            "response_truncated",
            "capture_hold_ms",
        ):
            if key in call:
                row[key] = call[key]
        return row


__all__ = [
    "VERIFIER_HEADER_NAME",
    "VerifierCall",
    "VerifierExchange",
    "current_verifier_call",
    "new_invocation_id",
    "rollout_of_verify_body",
]
