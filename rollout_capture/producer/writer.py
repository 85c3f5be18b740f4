"""Claims and rows for the calls a producer sees, written off the event loop and never failing a call.

Every write runs on the producer's own threads (not the host loop's default executor,
which a server may size for other work) and is shielded: a cancelled request still
lands its row and releases its claim, then the cancellation goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rollout_capture.producer.settings import ProducerSettings
from rollout_capture.store import CaptureStore, ClaimContext

logger = logging.getLogger("rollout_capture.producer")

T = TypeVar("T")


class CaptureWriter:
    """Claims, rows and incomplete markers of one capture root, for one producer."""

    def __init__(self, store: CaptureStore, *, claim_ttl_s: float, io_threads: int = 32) -> None:
        self.store = store
        self.claim_ttl_s = claim_ttl_s
        self._executor = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="rollout-capture")
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    async def _shielded(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the writer's threads; finish it even if the caller is cancelled."""
        with self._lock:
            self._pending += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            cancelled = False
            while True:
                try:
                    result = await asyncio.shield(future)
                    break
                except asyncio.CancelledError:
                    cancelled = True
                    if future.done():
                        result = future.result()
                        break
            if cancelled:
                raise asyncio.CancelledError
            return result
        finally:
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()

    def _claim(self, rollout_id: str, model_call_id: str) -> ClaimContext | None:
        context = self.store.claim(rollout_id, model_call_id, ttl_s=self.claim_ttl_s)
        try:
            context.__enter__()
        except Exception:
            logger.warning("could not claim rollout %s for call %s", rollout_id, model_call_id, exc_info=True)
            self._mark(rollout_id)
            return None
        return context

    def _record(
        self,
        rollout_id: str,
        row: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        claim: ClaimContext | None = None,
    ) -> bool:
        try:
            return self._write_row(rollout_id, row)
        finally:
            if claim is not None:
                self._release(claim)

    def _write_row(self, rollout_id: str, row: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> bool:
        try:
            built = row() if callable(row) else row
            self.store.record(rollout_id, built)  # marks the rollout incomplete itself on failure
        except Exception:
            logger.warning(
                "a capture row of rollout %s was not written; the rollout is marked incomplete",
                rollout_id,
                exc_info=True,
            )
            if callable(row):  # the row could not even be built: the store never saw it
                self._mark(rollout_id)
            return False
        return True

    def _release(self, context: ClaimContext) -> None:
        try:
            context.__exit__(None, None, None)
        except Exception:
            logger.warning("could not release claim %s", context.claim, exc_info=True)

    def _mark(self, rollout_id: str) -> None:
        try:
            self.store.mark_incomplete(rollout_id)
        except Exception:
            logger.warning("could not mark rollout %s incomplete", rollout_id, exc_info=True)

    async def claim(self, rollout_id: str, model_call_id: str) -> ClaimContext | None:
        """Claim the rollout for one call; None (logged, marker written) when the claim failed."""
        return await self._shielded(self._claim, rollout_id, model_call_id)

    async def record(
        self,
        rollout_id: str,
        row: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        release: ClaimContext | None = None,
    ) -> bool:
        """Write the row durably, then release ``release``; False (logged, marker written) on failure.

        ``row`` may be a function building it, so the building happens off the event loop
        too; one trip to a thread writes the row and releases the claim.
        """
        return await self._shielded(self._record, rollout_id, row, release)

    async def release(self, context: ClaimContext | None) -> None:
        """Release a claim taken by :meth:`claim` (after the row, or after the marker)."""
        if context is not None and context.claim is not None:  # not released with its row yet
            await self._shielded(self._release, context)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no write is in flight; False when ``timeout_s`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        """Finish every write already started, then stop the threads."""
        self._executor.shutdown(wait=True)


def writer_for(settings: ProducerSettings) -> CaptureWriter:
    """The writer of the settings' capture root (its store, claim TTL and threads)."""
    store = CaptureStore(
        settings.capture_dir, storage_options=settings.storage_options, layout=settings.layout
    )
    return CaptureWriter(store, claim_ttl_s=settings.claim_ttl_s, io_threads=settings.io_threads)
