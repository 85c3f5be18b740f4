"""Which store speaks for a rollout, and what it holds (spec section 7, "the store used").

The first store holding anything for an id wins. A batch is prefetched as bytes (one
listing and concurrent GETs per object store, nothing on local disks) and parsed one
rollout at a time, so memory holds one rollout's parsed rows, never the batch's.
Transient storage faults are raised so the caller can retry; a store unreadable for any
other reason marks its rollouts ``unreadable``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from rollout_capture.backends import ListingScope, ReadBatch
from rollout_capture.claims import live_ids
from rollout_capture.faults import is_transient_storage_error
from rollout_capture.snapshot import RolloutSnapshot
from rollout_capture.store import CaptureStore

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Evidence:
    """What the stores say about one rollout: its snapshot, or that it could not be read."""

    snapshot: RolloutSnapshot | None
    unreadable: bool = False


class _Unreadable(Exception):
    pass


def _guard(store: CaptureStore, action: Callable[..., T], *args: str) -> T:
    """Run a store read; transient faults propagate, anything else marks the store unreadable."""
    try:
        return action(*args)
    except Exception as exc:
        if is_transient_storage_error(exc):
            raise
        logger.warning("could not read captures in %s: %s", store.url, exc)
        raise _Unreadable from exc


class EvidenceReader:
    """The evidence of a batch of rollouts across capture dirs, read rollout by rollout."""

    def __init__(
        self, rollout_ids: Sequence[str], stores: Sequence[CaptureStore], *, scope: ListingScope | None = None
    ) -> None:
        self._stores = list(stores)
        self._scope = scope
        self._fetched: list[ReadBatch | None] = [None] * len(self._stores)
        self._broken: set[int] = set()
        self._fetch(list(dict.fromkeys(rollout_ids)))

    def _fetch(self, ids: list[str]) -> None:
        last = len(self._stores) - 1
        for index, store in enumerate(self._stores):
            if not ids or index in self._broken:
                continue
            current = self._fetched[index]
            try:
                if current is None:
                    current = _guard(store, partial(store.prefetch, ids, scope=self._scope))
                    self._fetched[index] = current
                else:
                    _guard(store, partial(current.refresh, ids))
            except _Unreadable:
                self._broken.add(index)
                return
            if index < last:  # what this store lacks, the next one may hold
                ids = [r for r in ids if not current.found(r)]

    def refresh(self, rollout_ids: Sequence[str]) -> None:
        """Fetch these rollouts again (their rows may have landed since)."""
        self._fetch(list(dict.fromkeys(rollout_ids)))

    def evidence(self, rollout_id: str) -> Evidence:
        """The snapshot from the first store holding anything for the id."""
        broken = self._broken
        for index, (store, fetched) in enumerate(zip(self._stores, self._fetched, strict=True)):
            if broken and index in broken:
                return Evidence(None, unreadable=True)
            try:  # _guard's rule, written out: this runs once per rollout
                snap = store.snapshot(rollout_id) if fetched is None else fetched.snapshot(rollout_id)
            except Exception as exc:
                if is_transient_storage_error(exc):
                    raise
                logger.warning("could not read captures in %s: %s", store.url, exc)
                return Evidence(None, unreadable=True)
            if snap.found:
                return Evidence(snap)
        return Evidence(None)

    def live_claimed(self, rollout_ids: Sequence[str], now: float | None = None) -> set[str]:
        """Ids holding a live claim in a store that was asked for them (a spare wait is only slower)."""
        moment = time.time() if now is None else now
        wanted = set(rollout_ids)
        out: set[str] = set()
        for fetched in self._fetched:
            if fetched is not None:  # None: broken, or every id was found in an earlier store
                out |= live_ids(fetched.claims(), moment) & wanted
        return out


def gather_evidence(rollout_ids: Sequence[str], stores: Sequence[CaptureStore]) -> dict[str, Evidence]:
    """Evidence for each id (parsed all at once: for small sets; batches use the reader)."""
    if len(rollout_ids) == 1:  # the per-record API's case: no batch to prefetch
        return {rollout_ids[0]: rollout_evidence(rollout_ids[0], stores)}
    reader = EvidenceReader(rollout_ids, stores)
    return {r: reader.evidence(r) for r in dict.fromkeys(rollout_ids)}


def rollout_evidence(rollout_id: str, stores: Sequence[CaptureStore]) -> Evidence:
    """Fast path of :class:`EvidenceReader` for one rollout (the reference); tests/test_evidence.py.

    That test proves them equal. The reader's rule (the first store holding anything wins;
    transient faults raised, any other marks it unreadable), each store read once, no batch set up.
    """
    for store in stores:
        try:
            snap = store.snapshot(rollout_id)
        except Exception as exc:
            if is_transient_storage_error(exc):
                raise
            logger.warning("could not read captures in %s: %s", store.url, exc)
            return Evidence(None, unreadable=True)
        if snap.found:
            return Evidence(snap)
    return Evidence(None)
