"""Trace and span ids derived from the evidence's own ids, so an export is idempotent.

A backend that keys spans by id (Phoenix does) then holds one trace per rollout however often
it is exported, and a re-enriched run's spans land on the same ids instead of beside them.

- trace id: the first 16 bytes of ``sha256("rollout-capture/trace\\0" + rollout_id)``;
- span id: the first 8 bytes of ``sha256("rollout-capture/span\\0" + rollout_id + "\\0" + kind
  + "\\0" + key)``, ``kind`` one of :data:`KINDS` and ``key`` the call's ``model_call_id`` (else
  ``call_index:<n>``), the invocation's id, or empty for the rollout itself.

An all-zero id is invalid in OpenTelemetry; the one-in-2^64 hash that gives one is replaced by 1.
"""

from __future__ import annotations

import hashlib
from typing import Literal

SpanKindKey = Literal["rollout", "call", "agent", "verifier"]
KINDS: tuple[SpanKindKey, ...] = ("rollout", "call", "agent", "verifier")
"""What a span stands for; part of its id so a call and an invocation sharing a key differ."""


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).digest()


def _nonzero(value: int) -> int:
    return value or 1


def trace_id(rollout_id: str) -> int:
    """The 128-bit trace id of a rollout (never 0)."""
    return _nonzero(int.from_bytes(_digest("rollout-capture/trace", rollout_id)[:16], "big"))


def span_id(rollout_id: str, kind: SpanKindKey, key: str = "") -> int:
    """The 64-bit span id of the rollout itself, one of its calls or one of its invocations (never 0)."""
    if kind not in KINDS:
        raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
    return _nonzero(int.from_bytes(_digest("rollout-capture/span", rollout_id, kind, key)[:8], "big"))


def call_key(model_call_id: str | None, call_index: int | None, position: int) -> str:
    """The key of a call's span: its ``model_call_id``, else its ``call_index``, else its position."""
    if model_call_id:
        return model_call_id
    return f"call_index:{call_index if call_index is not None else f'position:{position}'}"
