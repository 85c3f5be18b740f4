"""Waiting until no claimed capture write is outstanding (spec section 3).

Cancelled model calls finish their rows after the rollout result was handed on, so
enrichment first waits, bounded, for their claims to go. One deadline covers a whole
batch: a batch of stuck rollouts costs one timeout, not one each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence

from rollout_capture.claims import live_ids
from rollout_capture.identity import validate_rollout_id
from rollout_capture.store import CaptureDir, as_store

CAPTURE_DRAIN_TIMEOUT_S = 10.0
DEFAULT_POLL_S = 0.05


def claimed_now(rollout_ids: Iterable[str], capture_dirs: Sequence[CaptureDir]) -> set[str]:
    """The ids that hold a live claim in any dir right now: one look, no wait (a follower looks
    again at its next poll instead of blocking on one rollout)."""
    pending = sorted({validate_rollout_id(r) for r in rollout_ids})
    still: set[str] = set()
    if not pending:
        return still
    now = time.time()
    for store in (as_store(d) for d in capture_dirs):
        still |= live_ids(store.claims(pending), now)
    return still


async def await_quiescence_many(
    rollout_ids: Iterable[str],
    capture_dirs: Sequence[CaptureDir],
    timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
) -> set[str]:
    """Wait until none of the ids has a live claim in any dir; return those still pending.

    Each poll looks only at the ids still claimed after the previous one.
    """
    pending = {validate_rollout_id(r) for r in rollout_ids}
    stores = [as_store(d) for d in capture_dirs]
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        pending = await asyncio.to_thread(claimed_now, pending, stores)
        if not pending:
            return set()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return pending
        await asyncio.sleep(min(poll_s, remaining))


async def await_model_call_capture_quiescence(
    rollout_id: str,
    capture_dirs: Sequence[CaptureDir],
    timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
) -> bool:
    """True as soon as no live claim exists for the id, False when ``timeout_s`` passes first.

    An id with no capture at all is quiescent at once.
    """
    return not await await_quiescence_many([rollout_id], capture_dirs, timeout_s, poll_s)
