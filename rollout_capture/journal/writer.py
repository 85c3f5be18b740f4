"""The journal's group committer: a few commits in flight per stream, never two holding one
rollout, each acknowledged once every number below it exists; holes a dead writer left filled
with tombstones after the grace (see :mod:`.commits`); looks taken at calls' starts, so a row
lands above what existed then with one put (issue 37)."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from rollout_capture.backends.base import Backend
from rollout_capture.journal import commits
from rollout_capture.journal.clock import REAL_CLOCK, Clock
from rollout_capture.journal.commits import (
    MAX_COMMIT_BYTES,
    MAX_COMMIT_ENTRIES,
    Entry,
    Stream,
    commit_name,
    encode_commit,
    floor_of,
    nonce_of,
    tombstone_body,
)
from rollout_capture.journal.compacted import WRITER_RELOOK_S
from rollout_capture.journal.numbering import Numbering
from rollout_capture.sequence import first_absent

logger = logging.getLogger(__name__)

_LINEAR_TRIES = 8  # commits found taken before the tail is looked up instead of tried one by one
_READ_WINDOW = 64  # numbers below a commit read at once, at most, while settling it

DEFAULT_IN_FLIGHT: dict[Stream, int] = {"rows": 2, "claims": 4}
"""Commits a writer keeps in flight per stream on object stores (local disks: 1, a commit there is
a quick fsync). Rows: 2, since a row finishing just after a commit started then goes at once
instead of waiting for it, and more only add PUTs that slow the store (measured, see
docs/benchmarks.md); claims: 4, since the answer's first byte waits for its claim, and a claim
submitted while another's commit is in flight then goes at once: one commit, not a queue of them
(4 measured best of 1, 2, 4, 8 behind a store slower than the upstream; a commit of claims alone
is one put, with no look above it); producers pace claims between 1 and this by how long answers
wait for them (issues 37, 48).
``ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT`` overrides it: ``N`` for both streams, or ``ROWS/CLAIMS``
(each 1 to :data:`~.commits.LOOK_AHEAD`: a dead writer's commits stand at most that far above the
hole it left, and writers and readers look that far)."""
IN_FLIGHT_ENV = "ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT"
SETTLE_TIMEOUT_S = 120.0
"""How long a landed commit waits for the numbers below it before its calls are failed."""


def in_flight_setting() -> dict[Stream, int] | None:
    """The environment's commits in flight per stream (``N`` or ``ROWS/CLAIMS``), ``None`` when unset;
    a ``ValueError`` naming the variable when malformed (producers ask at startup)."""
    raw = os.environ.get(IN_FLIGHT_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split("/")
    top = commits.LOOK_AHEAD
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and 1 <= int(p) <= top for p in parts):
        raise ValueError(
            f"{IN_FLIGHT_ENV} must be N or ROWS/CLAIMS, each an integer from 1 to {top}; got {raw!r}"
        )
    return {"rows": int(parts[0]), "claims": int(parts[-1])}


def in_flight_bound(backend: Backend, stream: Stream = "rows") -> int:
    """Commits in flight for ``stream``: the environment's setting, else the default for the store."""
    setting = in_flight_setting()
    if setting is None:
        return 1 if backend.writes_in_place else DEFAULT_IN_FLIGHT[stream]
    return setting[stream]


LOOK_DELAY_S = 0.06
"""How long a call's look (:meth:`JournalWriter.look`) may wait for others to share it: looks
start one at a time, each serving every call that asked before it started, at the latest this
long after the oldest asked, or at once when a row waits for one (the upstream was quick)."""
ROWS_WAIT_SHARE = 0.5
"""More than one look may be in flight (:attr:`JournalWriter.look_in_flight`) only while rows wait
for their looks, on average, longer than this share of a look's own time: a call starting while a
look is out then waits for two, which a second look spares it (a slow store, few clients: issue
37). Otherwise rows wait for their claims' commits about as long, and a second look would mostly
double the listings (0.17-0.20 a call against 0.12-0.13 on an agent's calls at 32 clients on
a 20 ms store, issue 48)."""
LOOK_SHARED_BY = 2.0
"""...or while recent looks served fewer calls each than this, on average: few calls start while
a look is out (a few clients), so a second look beside it costs hardly a listing the calls would
have shared, and spares a call the wait for two (issue 48: 8-12 ms of the last byte at 4 clients
on a 20 ms store)."""
_WEIGHT = 1 / 16  # how much one row's wait, one look's time or calls move their recent averages
_LOOK_WINDOW = 2 * commits.LOOK_AHEAD  # numbers one look's listing covers


class JournalCommitter(Protocol):
    """What layouts and producers use of one stream's group committer: a :class:`JournalWriter`, or
    a stand-in handing its entries to one in another process (a proxy's workers share their
    parent's: ``rollout_capture.producer.shared_journal``). The pacing knobs are a producer's."""

    stream: Stream
    in_flight: int
    look_delay_s: float
    look_in_flight: int
    rows_wait_share: float

    def submit(
        self, entries: Sequence[Entry], *, look: concurrent.futures.Future[int] | None = None
    ) -> concurrent.futures.Future[int]: ...

    def write(self, entries: Sequence[Entry]) -> int: ...

    def look(self) -> concurrent.futures.Future[int]: ...


@dataclass(slots=True)
class _Submission:
    entries: list[Entry]
    future: concurrent.futures.Future[int]
    rollouts: frozenset[str]
    look: concurrent.futures.Future[int] | None = None

    def above(self) -> int | None:
        """The number this submission must land above, from its call's look; None when it has none
        (or it failed): then its commit looks above its own number before the put."""
        look = self.look
        if look is None or look.cancelled() or look.exception() is not None:
            return None
        return look.result()


class JournalWriter:
    """Group commit for one stream of a capture root in this process: up to ``in_flight`` commits
    in flight at once, and everything submitted meanwhile goes into the next one.

    Two commits in flight at once never hold the same rollout (a submission waits for its
    rollout's commit to land), so a commit renumbered past another cannot reorder a rollout.
    A commit is acknowledged only once every number below it exists (spec 2): a call that
    starts after the acknowledgement can only land above it, on any host.

    ``submit`` never blocks on the store; its future resolves to the commit's number once the
    entries are durable (or raises the store's error: the caller marks the rollout incomplete).
    Threads start with the first submission, so a forked child gets its own.
    """

    def __init__(
        self,
        backend: Backend,
        stream: Stream = "rows",
        *,
        tail_hint: Callable[[], int] | None = None,
        in_flight: int | None = None,
        clock: Clock = REAL_CLOCK,
    ) -> None:
        self._backend = backend
        self._clock = clock
        self.stream: Stream = stream
        self._tail_hint = tail_hint
        self.in_flight = in_flight if in_flight is not None else in_flight_bound(backend, stream)
        if not 1 <= self.in_flight <= commits.LOOK_AHEAD:
            raise ValueError(f"in_flight must be from 1 to {commits.LOOK_AHEAD}; got {self.in_flight}")
        self.writer_id = os.urandom(8).hex()
        self._cond = clock.condition()
        self._reset()
        self.commits = 0
        self.tries = 0
        self.tombstones = 0
        self.skips = 0  # numbers given up because commits existed above them
        self.looks = 0  # looks at calls' starts done (each shared by the calls that asked)
        self.look_delay_s = LOOK_DELAY_S  # producers set 0 while answers wait for the store
        self.look_in_flight = 1  # looks at once at most (producers raise it with the delay at 0)
        self.look_s = 0.0  # a look's recent time, on average
        self.rows_wait_share = ROWS_WAIT_SHARE  # producers set -1 behind a slow store (looks at once)
        self.row_wait_s = 0.0  # a row's recent wait for its look (none: 0), on average
        self.look_calls: float | None = None  # the calls a recent look served, on average
        self.peak_in_flight = 0  # the most commits this writer had in flight at once

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._queue: list[_Submission] = []
        self._workers = 0
        self._idle = 0
        self._busy: set[str] = set()  # rollouts of the commits in flight (not landed yet)
        self._active = 0  # commits taken, not landed or failed yet
        self._looks: list[tuple[concurrent.futures.Future[int], float]] = []  # asked, not started
        self._lookers = 0  # look threads running
        self._looks_idle = 0  # of which waiting for a look to take
        self._looks_active = 0  # looks in progress
        self._look_hurry = False  # a row waits for a look not started yet
        self._landed_any = False
        self._starting = False  # a thread is looking the tail up
        self._numbers = Numbering()  # what is known of the stream's numbers (under the lock)
        self._used_at = self._clock.monotonic()  # a number last handed out or looked above
        self._relook_from = 0  # where a writer that was idle looks its tail up from (at least)

    def _relook_if_idle(self, own: int) -> None:
        """(Locked.) A writer idle for ``WRITER_RELOOK_S``, nothing in flight but ``own`` commits,
        looks its tail up again before it hands a number out: the journal may have been compacted
        meanwhile, and its numbers below the new floors removed (``journal.compacted``)."""
        now = self._clock.monotonic()
        numbers = self._numbers
        if (
            numbers.next is not None
            and now - self._used_at >= WRITER_RELOOK_S
            and self._active <= own
            and not numbers.trying
            and not numbers.debts
        ):
            self._relook_from, numbers.next = numbers.next, None
        self._used_at = now

    def submit(
        self, entries: Sequence[Entry], *, look: concurrent.futures.Future[int] | None = None
    ) -> concurrent.futures.Future[int]:
        """Queue entries to land together in one commit; the future has the commit's number.

        ``look``: the :meth:`look` taken at the call's start. The commit then lands above every
        commit that existed then, with no look of its own (one put); without it the commit looks
        above its number before the put (spec 2: never below an existing commit)."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        listed = list(entries)
        submission = _Submission(listed, future, frozenset(e.rollout_id for e in listed), look)
        with self._cond:
            if self._pid != os.getpid():  # a forked child: its parent's threads are not here
                self._reset()
            self._queue.append(submission)
            if look is not None and not look.done():
                self._look_hurry = True  # the row is ready: its look goes now
                look.add_done_callback(functools.partial(self._looked, self._clock.monotonic()))
            elif look is not None:
                self.row_wait_s -= self.row_wait_s * _WEIGHT  # a row that waits for no look
            self._cond.notify_all()
            if self._idle == 0 and self._workers < self.in_flight:
                self._workers += 1
                self._clock.start_thread(self._run, "rollout-capture-journal")
        return future

    def write(self, entries: Sequence[Entry]) -> int:
        """Submit and wait: the entries are durable when this returns."""
        return self.submit(entries).result()

    # -- looks: what existed at a call's start

    def look(self) -> concurrent.futures.Future[int]:
        """Look at the stream now, at a call's start: the future has the highest commit number
        that existed (or was known to) above this writer's next number, -1 for none. A row
        submitted with it (:meth:`submit`) lands above all of them: a row needs to be above only
        what was durable before its call began, so the look is taken while the upstream answers,
        and shared by the calls that start meanwhile (one listing, :data:`LOOK_DELAY_S`)."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._cond:
            if self._pid != os.getpid():
                self._reset()
            self._looks.append((future, self._clock.monotonic()))
            if self._looks_idle == 0 and self._lookers < self._looks_allowed():
                self._lookers += 1
                self._clock.start_thread(self._look_run, "rollout-capture-journal-look")
            elif self._looks_idle:  # a busy one finds it when done: wake no thread for nothing
                self._cond.notify_all()
        return future

    def _looks_allowed(self) -> int:
        """Looks at once now: :attr:`look_in_flight` while rows wait long for theirs
        (:attr:`rows_wait_share` of a look, :data:`ROWS_WAIT_SHARE`; below 0: always) or while
        looks serve fewer than :data:`LOOK_SHARED_BY` calls each, else one."""
        more = self.rows_wait_share < 0 or self.row_wait_s > self.rows_wait_share * self.look_s
        if not more and self.look_calls is not None and self.look_calls < LOOK_SHARED_BY:
            more = True  # looks are hardly shared: one more costs no listing a call would share
        return self.look_in_flight if more else 1

    def _looked(self, since: float, _: concurrent.futures.Future[int]) -> None:
        with self._cond:
            self.row_wait_s += (self._clock.monotonic() - since - self.row_wait_s) * _WEIGHT
            self._cond.notify_all()  # a row held for its look may go

    def _look_run(self) -> None:
        while True:
            with self._cond:
                self._looks_idle += 1
                try:
                    while True:
                        if not self._looks or self._looks_active >= self._looks_allowed():
                            if not self._cond.wait(timeout=30.0) and not self._looks:
                                self._lookers -= 1  # idle: a later look starts a fresh thread
                                return
                            continue
                        due = self._looks[0][1] + self.look_delay_s
                        now = self._clock.monotonic()
                        if self._look_hurry or now >= due:
                            break
                        self._cond.wait(timeout=due - now)
                finally:
                    self._looks_idle -= 1
                taken, self._looks, self._look_hurry = self._looks, [], False
                shared = self.look_calls
                self.look_calls = len(taken) if shared is None else shared + (len(taken) - shared) * _WEIGHT
                self._looks_active += 1
            started = self._clock.monotonic()
            try:
                mark = self._look_once()
            except Exception as exc:  # the rows commit then looks itself
                for future, _ in taken:
                    future.set_exception(exc)
            else:
                self.looks += 1
                for future, _ in taken:
                    future.set_result(mark)
            finally:
                with self._cond:
                    self.look_s += (self._clock.monotonic() - started - self.look_s) * _WEIGHT
                    self._looks_active -= 1
                    self._cond.notify_all()

    def _look_once(self) -> int:
        """The highest commit at or above this writer's next number (the tail looked up first);
        listings of :data:`_LOOK_WINDOW` numbers, again above the highest found until one finds
        none (a dead writer's commits stand at most :data:`~.commits.LOOK_AHEAD` above its hole)."""
        with self._cond:
            while self._starting:
                self._cond.wait()
            self._relook_if_idle(own=0)
            start = self._numbers.next
            if start is None:
                self._starting = True
        if start is None:
            try:
                found, seen = self._lookup(None)
            finally:
                with self._cond:
                    self._starting = False
                    self._cond.notify_all()
            with self._cond:
                self._numbers.begin_at(found, seen)
            start = found
        mark = -1
        low = start
        while True:
            ahead = list(range(low, low + _LOOK_WINDOW))
            found_there = self._backend.existing(
                [self._backend.path(commit_name(n, self.stream)) for n in ahead]
            )
            there = [n for n, exists in zip(ahead, found_there, strict=True) if exists]
            for n in there:
                self._note_existing(n, None)
            if not there:
                return mark
            mark = max(mark, *there)
            if len(there) == len(ahead):  # a long run: the tail looked up, then listed above it
                seen = set()
                low = first_free(self._backend, mark + 1, self.stream, seen=seen)
                for n in seen:
                    self._note_existing(n, None)
                mark = max(mark, *seen) if seen else mark
            else:
                low = mark + 1

    # -- taking work

    def _group(self) -> list[_Submission]:
        """The submissions for the next commit, in order, none of a rollout in flight (locked)."""
        blocked = set(self._busy)
        taken: list[_Submission] = []
        rest: list[_Submission] = []
        entries = 0
        for submission in self._queue:
            too_many = bool(taken) and entries + len(submission.entries) > MAX_COMMIT_ENTRIES
            looking = submission.look is not None and not submission.look.done()
            if too_many or looking or not submission.rollouts.isdisjoint(blocked):
                blocked |= submission.rollouts  # later ones of these rollouts wait behind it
                rest.append(submission)
                continue
            taken.append(submission)
            entries += len(submission.entries)
        self._queue = rest
        for submission in taken:
            self._busy |= submission.rollouts
        return taken

    def _take(self) -> list[_Submission] | None:
        with self._cond:
            self._idle += 1
            try:
                while True:
                    # Until one commit of this writer has landed it keeps one in flight, so the
                    # first number of a journal is never a hole (readers need not look past it).
                    room = self._active < self.in_flight  # a bound lowered meanwhile holds the rest back
                    taken = self._group() if room and (self._landed_any or not self._active) else []
                    if taken:
                        self._active += 1
                        self.peak_in_flight = max(self.peak_in_flight, self._active)
                        return taken
                    if not self._cond.wait(timeout=30.0) and not self._queue:
                        self._workers -= 1  # idle: a later submission starts a fresh thread
                        return None
            finally:
                self._idle -= 1

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            try:
                ready, held = self._build(taken)
                if not ready:
                    continue
                headers = [e.header() for s in ready for e in s.entries]
                lines = [line for s in ready for line in held[id(s)]]
                marks = [s.above() for s in ready]
                unlooked = any(
                    m is None and any(e.op != "claim" for e in s.entries)
                    for m, s in zip(marks, ready, strict=True)
                )
                above = max((m for m in marks if m is not None), default=-1)
                try:
                    seq = self._commit(headers, lines, above=above, look=unlooked)
                except BaseException as exc:
                    for submission in ready:
                        submission.future.set_exception(exc)
                else:
                    for submission in ready:
                        submission.future.set_result(seq)
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    def _build(self, taken: list[_Submission]) -> tuple[list[_Submission], dict[int, list[bytes]]]:
        """Each submission's lines: those that fit ride, a submission too big waits (first in line,
        with any later one of its rollouts), one whose row cannot be written fails alone."""
        ready: list[_Submission] = []
        held: dict[int, list[bytes]] = {}
        deferred: list[_Submission] = []
        deferred_ids: set[str] = set()
        size = 0
        for submission in taken:
            if not submission.rollouts.isdisjoint(deferred_ids):
                deferred.append(submission)
                deferred_ids |= submission.rollouts
                continue
            try:
                built = [e.line() if callable(e.line) else e.line for e in submission.entries]
            except Exception as exc:  # a row that cannot be written fails its own call only
                submission.future.set_exception(exc)
                continue
            if ready and size + sum(map(len, built)) > MAX_COMMIT_BYTES:
                deferred.append(submission)
                deferred_ids |= submission.rollouts
                continue
            size += sum(map(len, built))
            held[id(submission)] = built
            ready.append(submission)
        if deferred or len(ready) < len(taken):
            with self._cond:
                riding = {r for s in ready for r in s.rollouts}
                self._busy -= {r for s in taken for r in s.rollouts} - riding
                self._queue[:0] = deferred
                self._cond.notify_all()
        return ready, held

    # -- numbers

    def _commit(
        self, headers: list[list[str]], lines: list[bytes], *, above: int = -1, look: bool = True
    ) -> int:
        """Land one commit and wait until every number below it exists; its number. ``above``: a
        number it must land above (its calls' looks); ``look``: look above its number first (some
        entry that orders something came with no look of its call's start)."""
        nonce = os.urandom(16).hex()
        seq = self._numbered(headers)
        ordered = look and any(h[0] != "claim" for h in headers)
        taken = 0
        while True:
            if seq <= above:
                with self._cond:
                    seq = self._numbers.skip(seq, [above])  # ``seq`` ours to fill, unless it exists
                    self.skips += 1
            if ordered:
                seq = self._above_all(seq, headers)
            self.tries += 1
            body = encode_commit(self.writer_id, nonce, headers, lines, floor=self._numbers.floor)
            where = self._backend.path(commit_name(seq, self.stream))
            try:
                try:
                    self._backend.create(where, body)
                    break
                except FileExistsError:
                    existing = self._backend.read_many([where])[0]
                if existing is not None and nonce_of(existing) == nonce:
                    break  # our own write, landed before a retried request found it
            except BaseException:
                self._failed(seq, headers)
                raise
            with self._cond:  # another writer's: it exists, and its header tells what is below
                self._numbers.lost(seq)
            self._note_existing(seq, existing)
            taken += 1
            seq = self._numbered(headers, jump=taken >= _LINEAR_TRIES)
        # Its number is final: its rollouts may go in the next commit now, before the numbers
        # below it settle (that one is handed out above this one).
        with self._cond:
            self._numbers.took(seq)
            self._busy -= {h[1] for h in headers}
            self._landed_any = True
            self._cond.notify_all()
        self.commits += 1
        self._settle(seq)
        return seq

    def _numbered(self, headers: list[list[str]], *, jump: bool = False) -> int:
        """:meth:`_hand_out`, the commit's rollouts freed if no number can be had."""
        try:
            return self._hand_out(jump=jump)
        except BaseException:
            with self._cond:
                self._busy -= {h[1] for h in headers}
                self._cond.notify_all()
            raise

    def _hand_out(self, *, jump: bool = False) -> int:
        """The next number to try: the tail looked up first (and after several taken in a row)."""
        with self._cond:
            while self._starting:
                self._cond.wait()
            self._relook_if_idle(own=1)
            seq = None if jump else self._numbers.take()
            if seq is not None:
                return seq
            self._starting = True
            start = self._numbers.next
        try:
            found, seen = self._lookup(start)
        finally:
            with self._cond:
                self._starting = False
                self._cond.notify_all()
        with self._cond:
            return self._numbers.start_at(found, seen)

    def _lookup(self, start: int | None) -> tuple[int, set[int]]:
        """The stream's tail from ``start`` (None: from the reader's hint): a free number just above
        one that exists, and the numbers seen existing (the caller holds ``_starting``)."""
        seen: set[int] = set()
        if start is None:
            hint = max(self._tail_hint() if self._tail_hint is not None else 0, self._relook_from)
            with self._cond:
                self._numbers.raise_floor(hint)  # what a reader read exists
            start = hint
        found = first_free(self._backend, start, self.stream, seen=seen)
        if found > start:  # the header of the one below tells how far down all exist
            below = self._backend.read_many([self._backend.path(commit_name(found - 1, self.stream))])[0]
            if below is not None:
                self._note_existing(found - 1, below)
        return found, seen

    def _above_all(self, seq: int, headers: list[list[str]]) -> int:
        """A number above every commit that exists near ``seq``, for a commit whose place orders
        something (rows, releases, clears): a commit found up to :data:`~.commits.LOOK_AHEAD` above
        ``seq`` (a dead writer's, above the hole it left) may hold a row durable before these were
        submitted, so they go above it and ``seq`` is filled with a tombstone (spec 2). Claims
        alone skip this look (a claim's number orders nothing), so a claim's wait is one put."""
        while True:
            ahead = list(range(seq + 1, seq + commits.LOOK_AHEAD))
            try:
                found = self._backend.existing(
                    [self._backend.path(commit_name(n, self.stream)) for n in ahead]
                )
            except BaseException:
                self._failed(seq, headers)
                raise
            there = [n for n, exists in zip(ahead, found, strict=True) if exists]
            for n in there:
                self._note_existing(n, None)
            with self._cond:
                others = self._numbers.others_above(seq, there)
                if not others:
                    return seq
                seq = self._numbers.skip(seq, others)  # ``seq`` ours to fill, nothing goes below these
                self.skips += 1

    def _failed(self, seq: int, headers: list[list[str]]) -> None:
        """A put that failed (not taken): its number is tried again by the next commit when
        nothing was handed out above it, else filled with a tombstone (no hole is left)."""
        with self._cond:
            self._busy -= {h[1] for h in headers}
            self._numbers.failed(seq)
            self._cond.notify_all()

    def _note_existing(self, seq: int, body: bytes | None) -> None:
        """``seq`` exists; its header says below which number everything existed when written."""
        floor = floor_of(seq, body)
        with self._cond:
            self._numbers.learn(seq, floor)
            self._cond.notify_all()

    def _settle(self, seq: int) -> None:
        """Wait until every number below ``seq`` exists: ours land; others' are read, and any
        missing for :data:`~.commits.HOLE_GRACE_S` (a writer that died mid-commit) filled with a tombstone."""
        deadline = self._clock.monotonic() + SETTLE_TIMEOUT_S
        delay = 0.005
        while True:
            with self._cond:
                if self._numbers.settled(seq):
                    return
                debts, others = self._numbers.to_resolve(seq, _READ_WINDOW)
                if not debts and not others:
                    remaining = deadline - self._clock.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(self._stuck(seq))
                    self._cond.wait(timeout=min(remaining, 0.5))  # ours in flight, or another thread's
                    continue
            progressed = False
            try:
                for n in debts:
                    progressed |= self._tombstone(n)
                if others:
                    progressed |= self._read_others_below(others)
            finally:
                with self._cond:
                    self._numbers.resolved([*debts, *others])
                    self._cond.notify_all()
            if not progressed:
                if self._clock.monotonic() > deadline:
                    raise TimeoutError(self._stuck(seq))
                self._clock.sleep(delay)
                delay = min(delay * 2, 0.25)

    def _stuck(self, seq: int) -> str:
        return (
            f"journal commit {self._backend.path(commit_name(seq, self.stream))} landed, but number "
            f"{self._numbers.floor} below it is still missing after {SETTLE_TIMEOUT_S:.0f} s"
        )

    def _read_others_below(self, seqs: list[int]) -> bool:
        """Read others' numbers below ours; fill those missing past the grace. Whether any settled."""
        path = self._backend.path
        bodies = self._backend.read_many([path(commit_name(n, self.stream)) for n in seqs])
        progressed = False
        now = self._clock.monotonic()
        for n, body in zip(seqs, bodies, strict=True):
            if body is not None:
                self._note_existing(n, body)
                progressed = True
                continue
            with self._cond:
                since = self._numbers.missing_since(n, now)
            if now - since >= commits.HOLE_GRACE_S:
                progressed |= self._tombstone(n)
        return progressed

    def _tombstone(self, seq: int) -> bool:
        """Fill ``seq`` with an empty commit, put-if-absent (what is there already counts)."""
        path = self._backend.path(commit_name(seq, self.stream))
        body = tombstone_body(self.writer_id, self._numbers.floor)
        try:
            self._backend.create(path, body)
        except FileExistsError:
            existing = self._backend.read_many([path])[0]
            self._note_existing(seq, existing)
        except Exception:
            logger.warning("could not fill missing journal commit %s", path, exc_info=True)
            return False
        else:
            self.tombstones += 1
            logger.warning("journal commit %s was missing below later ones: filled with a tombstone", path)
            self._note_existing(seq, body)
        with self._cond:
            self._numbers.paid(seq)
        return True


def first_free(
    backend: Backend, start: int = 0, stream: Stream = "rows", *, seen: set[int] | None = None
) -> int:
    """A commit number at or above ``start`` that does not exist, just above one that does
    (doubling, then bisecting); ``seen`` collects the numbers found to exist."""

    def exists(seq: int) -> bool:
        found = backend.exists(backend.path(commit_name(seq, stream)))
        if found and seen is not None:
            seen.add(seq)
        return found

    return first_absent(exists, start)
