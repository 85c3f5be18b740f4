"""Claims and rows for the calls a producer sees, never waiting on a disk or a network on the
event loop and never failing a call.

On a local disk a claim, the write of a row and the release are page-cache work done on the
loop itself (a few syscalls, tens of µs); only the row's fsync, the step that waits on the
disk, goes to a thread: one hop per call. Every extra hop and every syscall made on a thread
costs the GIL changing hands, which is what made writes cost more CPU than the HTTP they
capture. On object stores, and once a local write proved slow, everything goes to the threads:
the producer's own, not the host loop's default executor, which a server may size for other
work. A cancelled request still lands its row and releases its claim, then the cancellation
goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import queue
import resource
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rollout_capture.backends import capabilities_of
from rollout_capture.journal import in_flight_setting
from rollout_capture.journal.writer import LOOK_DELAY_S, ROWS_WAIT_SHARE
from rollout_capture.layouts import ClaimsMode, producer_layout
from rollout_capture.producer.settings import ProducerSettings
from rollout_capture.store import CaptureStore, ClaimContext, finish_shielded

logger = logging.getLogger("rollout_capture.producer")

T = TypeVar("T")

HELD_SHARE = 0.05
"""Claims pacing (journal layout): while more than this share of recent answers waited for their
claim, claims keep several commits in flight (a claim goes at once beside one on the wire: see
:data:`SLOW_STORE`); below it a claim waits for the commit on the wire and rides in the next (fewer
puts): the upstream hides it."""
_HELD_WEIGHT = 1 / 32  # how much one call moves the recent share and waits
SLOW_STORE = 2.0
"""Claims pacing: while answers wait for their claims, on average, more than this many times the
upstream's own time to the answer (a store much slower than the upstream), every claims commit in
flight allowed goes at once and looks go two at a time: the answer's latency is the store's. Below
it :data:`CLAIMS_WAITED` commits and a second look only while rows wait for theirs (or looks go
unshared) cost fewer puts and listings, their wait mostly behind the upstream's (issue 48: 0.38-0.46
store requests a call against 0.55-0.65 on an agent's calls at 20 ms a request, a lower p99; behind
a 120 ms store that pace doubled the claim's hold, so there it is not taken)."""
CLAIMS_WAITED = 2
LOOKS_WAITED = 2
"""Looks in flight while answers wait for the store: one more beside the one on the wire, so a
call starting meanwhile rarely waits for two; more cost listings that queue the store's
connections (measured: 4 put 0.3 listings a call at 32 clients on a 120 ms store)."""
# Work on the loop that takes longer than this (a slow or network disk) moves to threads.
INLINE_LIMIT_S = 0.05
# ...for this long, then it is tried on the loop again (a busy moment passes: each thread hop
# costs CPU per call); each move within RETRY_RESET_S of the last return doubles the wait.
RETRY_INLINE_S = 30.0
RETRY_INLINE_MAX_S = 3600.0
RETRY_RESET_S = 600.0
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)  # Linux
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _context_switches() -> tuple[int, int] | None:
    """This thread's (voluntary, involuntary) context switches so far; None where not told."""
    if _RUSAGE_THREAD is None:
        return None
    usage = resource.getrusage(_RUSAGE_THREAD)
    return usage.ru_nvcsw, usage.ru_nivcsw


def _only_preempted(before: tuple[int, int] | None) -> bool:
    """Whether, since ``before``, this thread was only preempted (the machine's other work took
    its core) and never waited itself (a disk that blocks it is a voluntary switch)."""
    after = _context_switches()
    if before is None or after is None:
        return False
    return after[0] == before[0] and after[1] > before[1]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _Threads:
    """Daemon threads running blocking calls for event loops.

    A cheaper hop than ``run_in_executor``: one loop future, a put on a C queue, one wake-up
    of the loop when done.
    """

    def __init__(self, count: int, name: str) -> None:
        self._count = count
        self._name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on a thread; the returned future of the running loop has its outcome."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args))  # queued before a close's stop: it still runs
        if len(self._threads) < self._count:
            self._start()
        return future

    def _start(self) -> None:
        with self._lock:  # after a close (a lifespan that ended, then more calls): threads again
            while len(self._threads) < self._count:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            loop, future, fn, args = job
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(_settle, future, result, error)
            del job, future, result, error

    @property
    def running(self) -> int:
        """How many threads are started (none before the first call, none after :meth:`close`)."""
        return len(self._threads)

    def close(self) -> None:
        """Finish every call already submitted, then stop the threads (a later call starts them
        again: a capture never fails because its producer's lifespan ended first)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join()


class _Wakes:
    """Journal acknowledgements handed to one event loop in batches: a commit resolves the
    futures of every call riding in it on a journal thread, and each ``asyncio.wrap_future``
    would wake the loop on its own (a self-pipe write and a loop pass per call); here the first
    one wakes it and the rest ride along."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._ready: list[tuple[asyncio.Future[Any], concurrent.futures.Future[Any]]] = []
        self._lock = threading.Lock()

    def watch(self, future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
        """A future of this loop with ``future``'s outcome (call on the loop)."""
        waiter: asyncio.Future[T] = self.loop.create_future()
        future.add_done_callback(lambda done: self._done(waiter, done))
        return waiter

    def _done(self, waiter: asyncio.Future[Any], future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._ready.append((waiter, future))
            if len(self._ready) > 1:  # a wake-up is already on its way
                return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for waiter, future in ready:
            if waiter.done():
                continue
            if future.cancelled():
                waiter.cancel()
            elif (error := future.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(future.result())


class CaptureWriter:
    """Claims, rows and incomplete markers of one capture root, for one producer."""

    def __init__(self, store: CaptureStore, *, claim_ttl_s: float, io_threads: int = 32) -> None:
        self.store = store
        self.claim_ttl_s = claim_ttl_s
        self._local = store.writes_in_place
        self._retry_wait_s = RETRY_INLINE_S
        self._retry_at: float | None = None  # when writes moved to threads go back on the loop
        self._returned_at = -math.inf
        self._journal = store.layout_strategy.submits  # claims and rows acknowledged by futures
        # Claims pacing: commits in flight as recent answers need (None: fixed by the environment).
        self._claims_top: int | None = None
        self._rows_top = 1
        if self._journal and in_flight_setting() is None and not store.writes_in_place:
            self._claims_top = store.journal_writer_of("claims").in_flight
            self._rows_top = store.journal_writer_of("rows").in_flight
        self._held_share = 1.0  # until answers show otherwise, claims go at once
        self._hold_s: float | None = None  # an answer's recent wait for its claim, on average
        self._upstream_s: float | None = None  # and the upstream's time to it
        self._pace = 0
        if self._claims_top is not None:
            self._paced(self._claims_top)
        self._threads = _Threads(io_threads, "rollout-capture")
        self._wakes: _Wakes | None = None  # the serving loop's (journal acknowledgements)
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    async def _shielded(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the writer's threads; finish it even if the caller is cancelled."""
        return await self._in_flight(self._threads.submit(fn, *args))

    async def _in_flight(self, future: asyncio.Future[T]) -> T:
        """Wait for a write, counted as in flight (:meth:`wait_idle`), finished even if cancelled."""
        with self._lock:
            self._pending += 1
        try:
            return await finish_shielded(future)
        finally:
            with self._lock:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()

    def _claim(self, context: ClaimContext, rollout_id: str, model_call_id: str) -> ClaimContext | None:
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
        staged = None
        try:
            staged = self._stage(rollout_id, row)
            return staged is not None and self._durable(staged[0])
        finally:  # the claim, then the lock (see record)
            if claim is not None:
                self._release(claim)
            if staged is not None:
                self._finish(staged[1])

    def _stage(
        self, rollout_id: str, row: Mapping[str, Any] | Callable[[], Mapping[str, Any]]
    ) -> tuple[Callable[[], None], Callable[[], None]] | None:
        """The row built and staged (:meth:`CaptureStore.record_staged`); None (logged) on failure."""
        try:
            built = row() if callable(row) else row
            if not isinstance(built, Mapping):
                raise TypeError(f"a capture row must be a mapping; got {type(built).__name__}")
        except Exception:
            logger.warning(
                "a capture row of rollout %s could not be built; the rollout is marked incomplete",
                rollout_id,
                exc_info=True,
            )
            self._mark(rollout_id)  # the store never saw it
            return None
        try:
            return self.store.record_staged(rollout_id, built)
        except Exception:  # the store logged it and marked the rollout incomplete
            return None

    @staticmethod
    def _durable(blocking: Callable[[], None]) -> bool:
        """Run the row's blocking step; False when it failed."""
        try:
            blocking()
        except Exception:  # the store logged it and marked the rollout incomplete
            return False
        return True

    @staticmethod
    def _finish(finish: Callable[[], None]) -> None:
        try:
            finish()
        except Exception:
            logger.warning("could not close a capture file", exc_info=True)

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

    def _inline(self, started: float, switches: tuple[int, int] | None) -> None:
        """After work done on the loop: a disk that makes it slow sends all of it to threads.

        ``switches`` (:func:`_context_switches` before the work) tells a slow disk from a busy
        machine: a loop thread only preempted meanwhile (no wait of its own) met no slow disk.
        """
        took = time.perf_counter() - started
        if took > INLINE_LIMIT_S and self._local and not _only_preempted(switches):
            now = time.monotonic()
            if now - self._returned_at < RETRY_RESET_S:  # slow again soon after: wait longer
                self._retry_wait_s = min(self._retry_wait_s * 2, RETRY_INLINE_MAX_S)
            else:
                self._retry_wait_s = RETRY_INLINE_S
            self._local = False
            self._retry_at = now + self._retry_wait_s
            logger.warning(
                "a capture write on the event loop took %.1f ms; claims and rows go to threads "
                "for the next %.0f s",
                took * 1000.0,
                self._retry_wait_s,
            )

    def _retry_inline(self) -> None:
        """Writes moved to threads go back on the loop once their wait is over (a local disk only)."""
        if self._retry_at is not None and time.monotonic() >= self._retry_at:
            self._retry_at = None
            self._returned_at = time.monotonic()
            self._local = self.store.writes_in_place

    @property
    def claims_in_background(self) -> bool:
        """Whether a claim takes a store round trip (object stores): then a call is forwarded
        while its claim is written, and only the answer's first byte waits for it (spec 11)."""
        return not self._local

    def answer_held(self, hold_s: float, upstream_s: float) -> None:
        """An answer's first message was ready ``upstream_s`` after its call was forwarded and went
        to the client ``hold_s`` later, once its claim was durable (0: it was already). Claims and
        rows are grouped (one commit in flight each) while almost no answer waits
        (:data:`HELD_SHARE`); while answers wait, but for less than :data:`SLOW_STORE` times the
        upstream's own time, claims keep :data:`CLAIMS_WAITED` commits in flight and a second look
        goes only while rows wait for theirs or looks go unshared (fewer puts and listings, the wait
        mostly behind the upstream); while they wait longer, every commit and look in flight allowed
        goes at once."""
        top = self._claims_top
        if top is None:
            return
        self._held_share += ((1.0 if hold_s > 0 else 0.0) - self._held_share) * _HELD_WEIGHT
        if self._hold_s is None or self._upstream_s is None:
            self._hold_s, self._upstream_s = hold_s, upstream_s
        else:
            self._hold_s += (hold_s - self._hold_s) * _HELD_WEIGHT
            self._upstream_s += (upstream_s - self._upstream_s) * _HELD_WEIGHT
        if self._held_share <= HELD_SHARE:
            pace = 1
        elif self._hold_s > SLOW_STORE * self._upstream_s:
            pace = top
        else:
            pace = min(CLAIMS_WAITED, top)
        if pace != self._pace:
            self._paced(pace)

    def _paced(self, pace: int) -> None:
        """Claims commits in flight at ``pace``, the rows' commits and looks with them."""
        self._pace = pace
        top = self._claims_top
        self.store.journal_writer_of("claims").in_flight = pace
        rows = self.store.journal_writer_of("rows")
        # Rows alike: one commit in flight while the store is quick beside the upstream (a row then
        # rarely finds one on the wire, and the rest ride together: fewer puts).
        rows.in_flight = 1 if pace == 1 else self._rows_top
        # Answers that wait for the store would wait for a row's look too: looks then go at once,
        # unshared by calls starting just after; a second beside one on the wire always behind a
        # slow store, else only while rows wait for theirs or looks go unshared (journal.writer).
        rows.look_delay_s, rows.look_in_flight = (LOOK_DELAY_S, 1) if pace == 1 else (0.0, LOOKS_WAITED)
        rows.rows_wait_share = -1.0 if pace == top else ROWS_WAIT_SHARE

    async def _committed(self, future: concurrent.futures.Future[int]) -> None:
        """Wait for a journal submission (a write in flight like any other)."""
        loop = asyncio.get_running_loop()
        wakes = self._wakes
        if wakes is None or wakes.loop is not loop:
            wakes = self._wakes = _Wakes(loop)
        await self._in_flight(wakes.watch(future))

    async def _mark_later(self, rollout_id: str) -> None:
        await self._shielded(self._mark, rollout_id)

    async def _journal_claim(
        self, context: ClaimContext, rollout_id: str, model_call_id: str
    ) -> ClaimContext | None:
        try:
            future = context.start()
            assert future is not None
            await self._committed(future)
        except asyncio.CancelledError:
            await self.release(context)
            raise
        except Exception:
            logger.warning("could not claim rollout %s for call %s", rollout_id, model_call_id, exc_info=True)
            context.claim = None  # never landed: nothing to release
            await self._mark_later(rollout_id)
            return None
        return context

    async def claim(self, rollout_id: str, model_call_id: str) -> ClaimContext | None:
        """Claim the rollout for one call; None (logged, marker written) when the claim failed.

        A caller cancelled while the claim is written on a thread gets no context to release:
        the claim that landed is released here before the cancellation goes on (spec 3).
        """
        context = self.store.claim(rollout_id, model_call_id, ttl_s=self.claim_ttl_s)
        if self._journal:
            return await self._journal_claim(context, rollout_id, model_call_id)
        if self._retry_at is not None:
            self._retry_inline()
        if self._local:
            switches, started = _context_switches(), time.perf_counter()
            try:
                return self._claim(context, rollout_id, model_call_id)
            finally:
                self._inline(started, switches)
        try:
            return await self._shielded(self._claim, context, rollout_id, model_call_id)
        except asyncio.CancelledError:
            await self.release(context)
            raise

    async def record(
        self,
        rollout_id: str,
        row: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        release: ClaimContext | None = None,
    ) -> bool:
        """Write the row durably, then release ``release``; False (logged, marker written) on failure.

        ``row`` may be a function building it (on object stores it is built off the loop).
        """
        if self._journal:
            try:
                await self._committed(self.store.journal_record(rollout_id, row, release=release))
            except Exception:
                logger.warning(
                    "capture write failed for rollout %s; marking it incomplete", rollout_id, exc_info=True
                )
                await self._mark_later(rollout_id)
                return False
            return True
        if self._retry_at is not None:
            self._retry_inline()
        if not self._local:
            return await self._shielded(self._record, rollout_id, row, release)
        staged = None
        try:
            switches, started = _context_switches(), time.perf_counter()
            staged = self._stage(rollout_id, row)
            self._inline(started, switches)
            if staged is None:
                return False
            return await self._shielded(self._durable, staged[0])  # the fsync: one hop
        finally:  # after the fsync, even if cancelled meanwhile (the hop is shielded)
            # The claim goes before the lock: a reader that sees no claim and then reads
            # (under the shared lock) finds the row; no await between the two.
            if release is not None:
                self._release(release)
            if staged is not None:
                self._finish(staged[1])

    async def release(self, context: ClaimContext | None) -> None:
        """Release a claim taken by :meth:`claim` (after the row, or after the marker)."""
        if context is not None and context.claim is not None:  # not released with its row yet
            if self._journal:
                future = self.store.layout_strategy.submit_release(context.rollout_id, context.claim.claim_id)
                assert future is not None  # the journal's releases are submitted
                context.claim = None
                try:
                    await self._committed(future)
                except Exception:
                    logger.warning(
                        "could not release a claim of rollout %s", context.rollout_id, exc_info=True
                    )
            elif self._local:
                self._release(context)
            else:
                await self._shielded(self._release, context)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no write is in flight; False when ``timeout_s`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    @property
    def threads_running(self) -> int:
        """How many writer threads are started now."""
        return self._threads.running

    def close(self) -> None:
        """Finish every write already started, then stop the threads (and remove this process's
        claims log if nothing is open in it)."""
        self._threads.close()
        self.close_claims_log()

    def close_claims_log(self) -> None:
        """Remove this process's claims log if nothing is open in it (a producer that stops: its
        log would otherwise stay until a reader found it dead)."""
        try:
            self.store.close_claims_log()
        except Exception:
            logger.warning("could not remove the claims log", exc_info=True)


def writer_for(settings: ProducerSettings, *, journal_link: socket.socket | None = None) -> CaptureWriter:
    """The writer of the settings' capture root (its store, claim TTL and threads).

    ``auto`` writes JSONL on a local disk (NeMo Gym's layout) and the journal on object stores,
    where a request per call is what a run costs (spec 2); claims go to this process's claims
    log on a local disk unless told ``files`` (spec 3). ``journal_link``: a proxy worker's link to
    its parent, whose journal committers it shares (``shared_journal``).
    """
    local = capabilities_of(settings.root).local
    layout = producer_layout(settings.layout, local=local)
    if layout == "journal":
        in_flight_setting()  # a malformed ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT refused at startup, not per call
    claims: ClaimsMode = "log" if local and settings.claims != "files" else "files"
    store = CaptureStore(
        settings.root, storage_options=settings.storage_options, layout=layout, claims=claims
    )
    if journal_link is not None and store.layout == "journal":
        from rollout_capture.producer.shared_journal import SharedJournal

        store.commit_journal_through(SharedJournal(journal_link).committer)
    store.refuse_unsafe_writes()  # at startup, not as a logged failure at every call
    store.prove_writable()  # unwritable, or no put-if-absent: refused before any call is served
    return CaptureWriter(store, claim_ttl_s=settings.claim_ttl_s, io_threads=settings.io_threads)
