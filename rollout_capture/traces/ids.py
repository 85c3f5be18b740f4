"""Trace and span ids derived from the evidence's own ids and the run it belongs to, so an export
is idempotent and two runs never share a trace.

A backend that keys spans by id (Phoenix does, across all its projects) then holds one trace per
rollout of a run however often that run is exported, while another run whose rollout ids
coincide (NeMo Gym's ``0-0``, ``1-0``... repeat in every run) gets traces of its own.

- trace id: the first 16 bytes of ``sha256("rollout-capture/trace\\0" + project + "\\0" + run
  + "\\0" + rollout_id)``;
- span id: the first 8 bytes of ``sha256("rollout-capture/span\\0" + project + "\\0" + run + "\\0"
  + rollout_id + "\\0" + kind + "\\0" + key)``, ``kind`` one of :data:`KINDS` and ``key`` the
  call's ``model_call_id`` (else ``call_index:<n>``), the invocation's id, or empty for the
  rollout itself.

``project`` and ``run`` are a :class:`RunScope` (empty when not given); what names a run is
:mod:`.runs`'s to say. An all-zero id is invalid in OpenTelemetry; the one-in-2^64 hash that
gives one is replaced by 1.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

SpanKindKey = Literal["rollout", "call", "agent", "verifier"]
KINDS: tuple[SpanKindKey, ...] = ("rollout", "call", "agent", "verifier")
"""What a span stands for; part of its id so a call and an invocation sharing a key differ."""


@dataclass(frozen=True, slots=True)
class RunScope:
    """What a rollout's trace belongs to besides its rollout id: the project it is sent to and the
    run it is part of (both part of every id, both empty when not given)."""

    project: str = ""
    run: str = ""


NO_SCOPE = RunScope()


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).digest()


def _nonzero(value: int) -> int:
    return value or 1


def trace_id(rollout_id: str, scope: RunScope = NO_SCOPE) -> int:
    """The 128-bit trace id of a rollout of ``scope``'s run (never 0)."""
    digest = _digest("rollout-capture/trace", scope.project, scope.run, rollout_id)
    return _nonzero(int.from_bytes(digest[:16], "big"))


def span_id(rollout_id: str, kind: SpanKindKey, key: str = "", scope: RunScope = NO_SCOPE) -> int:
    """The 64-bit span id of the rollout itself, one of its calls or one of its invocations (never 0)."""
    if kind not in KINDS:
        raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
    digest = _digest("rollout-capture/span", scope.project, scope.run, rollout_id, kind, key)
    return _nonzero(int.from_bytes(digest[:8], "big"))


def call_key(model_call_id: str | None, call_index: int | None, position: int) -> str:
    """The key of a call's span: its ``model_call_id``, else its ``call_index``, else its position."""
    if model_call_id:
        return model_call_id
    return f"call_index:{call_index if call_index is not None else f'position:{position}'}"
