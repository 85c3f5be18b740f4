"""Claims (spec section 3): "a row for this rollout is being produced right now".

A claim is live until its expiry; past it, the producer is presumed dead and the claim
is abandoned. On object stores expiry counts from the object's own modification time,
because the writer's clock may be on another host. A claim in a claims log has no TTL
while the log's lock is held (the lock says the writer lives) and expires when the lock
is found free (``rollout_capture.claims_log``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import orjson
from pydantic import BaseModel, ValidationError

DEFAULT_CLAIM_TTL_S = 300.0

Clock = Callable[[], float]
"""Seconds since the epoch, as ``time.time`` gives them."""

_clock: Clock = time.time


def current_time() -> float:
    """The current time by the clock claims and leases are judged by (``time.time`` unless set)."""
    return _clock()


@contextmanager
def clock_set(clock: Clock) -> Iterator[Clock]:
    """Judge claims and leases by ``clock`` inside the block (tests set time instead of sleeping)."""
    global _clock
    before, _clock = _clock, clock
    try:
        yield clock
    finally:
        _clock = before


class Claim(BaseModel):
    """The body of one claim file, plus when it stops counting as live."""

    claim_id: str
    model_call_id: str | None = None
    host: str = ""
    pid: int = -1
    claimed_at: float
    ttl_s: float = DEFAULT_CLAIM_TTL_S
    expires_at: float | None = None

    def is_live(self, now: float) -> bool:
        """Live until ``expires_at`` (or ``claimed_at + ttl_s`` when not set)."""
        deadline = self.expires_at if self.expires_at is not None else self.claimed_at + self.ttl_s
        return now < deadline


_HOST: str | None = None


def _host() -> str:
    global _HOST
    if _HOST is None:
        _HOST = socket.gethostname()
    return _HOST


def new_claim(model_call_id: str | None, ttl_s: float, *, clock: Clock | None = None) -> Claim:
    """A fresh claim for this process, made at ``clock()`` (default :func:`current_time`; built
    unvalidated: every field is ours)."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive; got {ttl_s!r}")
    return Claim.model_construct(
        claim_id=os.urandom(16).hex(),
        model_call_id=model_call_id,
        host=_host(),
        pid=os.getpid(),
        claimed_at=(clock or current_time)(),
        ttl_s=float(ttl_s),
        expires_at=None,
    )


def claim_fields(claim: Claim) -> dict[str, object]:
    """A claim's written fields, without the derived ``expires_at`` (a file's body, a log's line)."""
    return {
        "claim_id": claim.claim_id,
        "model_call_id": claim.model_call_id,
        "host": claim.host,
        "pid": claim.pid,
        "claimed_at": claim.claimed_at,
        "ttl_s": claim.ttl_s,
    }


def claim_body(claim: Claim) -> bytes:
    """Serialized claim, without the derived ``expires_at``."""
    return orjson.dumps(claim_fields(claim))


def read_claim(
    claim_id: str, body: bytes | None, mtime: float | None, *, trust_mtime: bool, clock: Clock | None = None
) -> Claim:
    """Interpret a claim file; an unreadable body still counts, from its mtime.

    ``trust_mtime`` is set for object stores, whose modification time comes from the
    store's clock rather than the writer's.
    """
    claim: Claim | None = None
    if body:
        try:
            claim = Claim.model_validate(orjson.loads(body))
        except (orjson.JSONDecodeError, ValidationError):
            claim = None
    if claim is None:
        claim = Claim(claim_id=claim_id, claimed_at=mtime if mtime is not None else (clock or current_time)())
    claim.expires_at = lapses_at(
        claim.claimed_at + claim.ttl_s, claim.ttl_s, mtime, trust_mtime=trust_mtime, clock=clock
    )
    return claim


def lapses_at(
    deadline: float | None,
    ttl_s: float,
    mtime: float | None,
    *,
    trust_mtime: bool,
    clock: Clock | None = None,
) -> float:
    """When a file that holds while its writer lives (a claim, a run's lease generation) lapses.

    By the store's clock where it keeps one (``mtime + ttl_s``), else by the writer's own
    ``deadline``; one whose body says nothing (``deadline`` None) counts from its mtime
    (from ``clock()``, default :func:`current_time`, when it has none).
    """
    if trust_mtime and mtime is not None:
        return mtime + ttl_s
    if deadline is not None:
        return deadline
    return (mtime if mtime is not None else (clock or current_time)()) + ttl_s


def partition(
    claims: Iterable[Claim], now: float | None = None, *, clock: Clock | None = None
) -> tuple[list[Claim], list[Claim]]:
    """``(live, expired)`` claims at ``now`` (default: ``clock()``, else the claims' clock)."""
    moment = (clock or _clock)() if now is None else now
    live: list[Claim] = []
    expired: list[Claim] = []
    for claim in claims:
        (live if claim.is_live(moment) else expired).append(claim)
    return live, expired


def live_ids(
    claims: Mapping[str, list[Claim]], now: float | None = None, *, clock: Clock | None = None
) -> set[str]:
    """The rollouts among ``claims`` that still hold a live claim."""
    moment = (clock or _clock)() if now is None else now
    return {rollout_id for rollout_id, held in claims.items() if partition(held, moment)[0]}
