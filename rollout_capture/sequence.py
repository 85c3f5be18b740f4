"""Gapless numbered files written put-if-absent (a rollout's row objects, journal commits): one
total order across hosts with no clock, because a number is only ever taken after the one below.

A write that finds its number taken reads the file back: a retried request of its own may have
landed it (its nonce tells); else it moves on to a free number, which stays above everything that
existed when it began.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_capture.backends.base import Backend


def first_absent(exists: Callable[[int], bool], start: int) -> int:
    """The smallest ``n >= start`` for which ``exists(n)`` is false, when the numbers that exist form
    a prefix: doubling, then bisecting (a few requests however long the sequence)."""
    if not exists(start):
        return start
    low, step = start, 1  # low is taken
    while exists(low + step):
        low += step
        step *= 2
    high = low + step  # free
    while high - low > 1:
        mid = (low + high) // 2
        if exists(mid):
            low = mid
        else:
            high = mid
    return high


def create_numbered(
    backend: Backend,
    name: Callable[[int], str],
    start: int,
    body: bytes,
    ours: Callable[[bytes], bool],
    after_taken: Callable[[int], int],
) -> int:
    """Create ``body`` at the first number from ``start`` it can take; the number it landed at.

    ``ours(existing)`` tells this write's own landed body (its nonce); ``after_taken(n)`` is the
    number to try once ``n`` is another writer's. Errors other than a taken number propagate.
    """
    seq = start
    while True:
        path = backend.path(name(seq))
        try:
            backend.create(path, body)
            return seq
        except FileExistsError:
            existing = backend.read_many([path])[0]
            if existing is not None and ours(existing):
                return seq  # our own write, landed before a retried request found it
            seq = after_taken(seq)
