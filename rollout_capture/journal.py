"""The journal layout (spec 2, 3 and 11, extension): many calls' claims, rows and releases in one
object, written put-if-absent, so an object store sees a request per group of calls, not several
per call.

``_journal/{seq:012d}.jsonl`` under the capture root holds one *commit*: a header line naming each
entry (``[op, rollout_id]`` or ``[op, rollout_id, claim_id]``), then one line per entry (a row, a
claim body, or ``null``). Commits form one put-if-absent sequence a stream for the whole root. A
rollout's rows are in commit order, then line order: one total order across hosts, with no
clock, that respects which call finished first, because a writer keeps a few commits in flight
(group commit: whatever is submitted meanwhile goes into the next one) under two rules: two
commits in flight never hold one rollout, and a commit is acknowledged only once every number
below it exists, so a later call can only land above it. A lost acknowledgement is told by the
commit's nonce, as for row objects.

A writer killed with commits in flight can leave a number missing below a later commit; a
writer or reader that finds such a hole older than :data:`HOLE_GRACE_S` fills it with an empty
tombstone, put-if-absent (a late put there then lands higher, as any taken number does).
Readers read commits in order from where they stopped (no listing: the first missing number is
the end), index each rollout's entries by their header alone and keep a bounded cache of
bodies, so a rollout's rows cost one GET per commit holding them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from rollout_capture.backends.base import Backend, Fetched
from rollout_capture.claims import Claim, claim_body, read_claim
from rollout_capture.identity import validate_rollout_id
from rollout_capture.layout import JOURNAL_DIR
from rollout_capture.rows import Damage, ParsedRows, add_journal_row
from rollout_capture.sequence import first_absent
from rollout_capture.snapshot import RolloutSnapshot

logger = logging.getLogger(__name__)

SEQ_WIDTH = 12
FORMAT = 1
Op = Literal["claim", "row", "release", "clear"]
_OPS = frozenset({"claim", "row", "release", "clear"})

MAX_COMMIT_ENTRIES = 1024
"""Entries in one commit at most (a larger group waits for the next)."""
MAX_COMMIT_BYTES = 8 << 20
"""Bytes of one commit at most, unless a single submission is larger."""
_LINEAR_TRIES = 8  # commits found taken before the tail is looked up instead of tried one by one
_READ_WINDOW = 64  # commits read at once, at most, while catching up
_BODY_BUDGET = 32 << 20  # bytes of commit bodies a reader keeps
_LOOK_AHEAD = 4  # a stream's stop and the numbers after it looked at for a hole (in flight: 4)
_LOOK_EVERY_S = 1.0  # how often a reader stopped at the same end looks past it again


Stream = Literal["rows", "claims"]
STREAMS: tuple[Stream, ...] = ("claims", "rows")
"""Claims go in a sequence of their own, so a call's row never waits behind other calls' claims;
rows, releases and clears in the main one (a release rides with its row)."""


def commit_name(seq: int, stream: Stream = "rows") -> str:
    """The name of commit ``seq`` of ``stream`` relative to the capture root."""
    folder = JOURNAL_DIR if stream == "rows" else f"{JOURNAL_DIR}/claims"
    return f"{folder}/{seq:0{SEQ_WIDTH}d}.jsonl"


# ---------------------------------------------------------------------------- format


@dataclass(frozen=True, slots=True)
class Entry:
    """One journal entry before it is written: what it is, whose, and its line (or how to build it)."""

    op: Op
    rollout_id: str
    line: bytes | Callable[[], bytes]
    claim_id: str | None = None

    def header(self) -> list[str]:
        return (
            [self.op, self.rollout_id] if self.claim_id is None else [self.op, self.rollout_id, self.claim_id]
        )


def row_entry(rollout_id: str, row: Any) -> Entry:
    """A row (a mapping, or a function building one off the caller's loop)."""
    validate_rollout_id(rollout_id)

    def line() -> bytes:
        built = row() if callable(row) else row
        if not isinstance(built, Mapping):
            raise TypeError(f"a capture row must be a mapping; got {type(built).__name__}")
        return orjson.dumps(built if isinstance(built, dict) else dict(built), default=str)

    return Entry("row", rollout_id, line)


def claim_entry(rollout_id: str, claim: Claim) -> Entry:
    return Entry("claim", validate_rollout_id(rollout_id), claim_body(claim), claim.claim_id)


def release_entry(rollout_id: str, claim_id: str) -> Entry:
    return Entry("release", validate_rollout_id(rollout_id), b"null", claim_id)


def clear_entry(rollout_id: str) -> Entry:
    return Entry("clear", validate_rollout_id(rollout_id), b"null")


def encode_commit(
    writer_id: str,
    nonce: str,
    headers: list[list[str]],
    lines: list[bytes],
    *,
    floor: int = 0,
    tombstone: bool = False,
) -> bytes:
    """A commit's bytes. ``floor``: every number below it existed when this was written (a
    writer joining learns from it how far down it need not look); a tombstone is marked so."""
    head: dict[str, Any] = {"journal": FORMAT, "writer": writer_id, "nonce": nonce, "floor": floor}
    if tombstone:
        head["tombstone"] = True
    head["entries"] = headers
    return b"\n".join([orjson.dumps(head), *lines]) + b"\n"


class BadCommit(ValueError):
    """A commit whose header cannot be read: its entries cannot be told apart."""


@dataclass(slots=True)
class Commit:
    """One commit read back: its entries' headers, and where each entry's line sits in the body."""

    seq: int
    nonce: str
    headers: list[tuple[str, str, str | None]]
    body: bytes
    spans: list[tuple[int, int]]
    floor: int | None = None

    def line(self, index: int) -> bytes:
        start, stop = self.spans[index]
        return self.body[start:stop]


def decode_commit(seq: int, body: bytes) -> Commit:
    """Parse a commit's header and cut its lines (``BadCommit`` naming what is wrong)."""
    stop = body.find(b"\n")
    if stop < 0:
        raise BadCommit("no header line")
    try:
        head = orjson.loads(body[:stop])
    except orjson.JSONDecodeError:
        raise BadCommit("header is not JSON") from None
    if (
        not isinstance(head, dict)
        or head.get("journal") != FORMAT
        or not isinstance(head.get("entries"), list)
    ):
        raise BadCommit(f"not a format-{FORMAT} journal header")
    headers: list[tuple[str, str, str | None]] = []
    for item in head["entries"]:
        if (
            not isinstance(item, list)
            or len(item) not in (2, 3)
            or item[0] not in _OPS
            or not all(isinstance(part, str) for part in item)
        ):
            raise BadCommit(f"entry {len(headers)} of the header is malformed")
        headers.append((item[0], item[1], item[2] if len(item) == 3 else None))
    spans = []
    start, end = stop + 1, len(body)
    for _ in headers:
        stop = body.find(b"\n", start)
        if stop < 0:
            stop = end
        spans.append((start, stop))
        start = min(end, stop + 1)
    if len(spans) < len(headers) or (headers and spans[-1][0] > end):
        raise BadCommit("fewer lines than entries")
    nonce = head.get("nonce")
    floor = head.get("floor")
    return Commit(
        seq,
        nonce if isinstance(nonce, str) else "",
        headers,
        body,
        spans,
        floor if isinstance(floor, int) and not isinstance(floor, bool) and floor >= 0 else None,
    )


def _nonce_of(body: bytes) -> str | None:
    try:
        return decode_commit(0, body).nonce
    except BadCommit:
        return None


def _floor_of(seq: int, body: bytes | None) -> int:
    """Below which number every commit existed when ``seq`` was written: its header's ``floor``;
    ``seq`` for a header without one (a one-in-flight writer, which created ``seq`` only once
    ``seq - 1`` existed); nothing known (0) for a body that cannot be read."""
    if body is None:
        return 0
    try:
        commit = decode_commit(seq, body)
    except BadCommit:
        return 0
    return seq if commit.floor is None else min(commit.floor, seq)


# ---------------------------------------------------------------------------- writing

DEFAULT_IN_FLIGHT: dict[Stream, int] = {"rows": 2, "claims": 1}
"""Commits a writer keeps in flight per stream on object stores (local disks: 1, a commit there is
a quick fsync). Rows: 2, since a row finishing just after a commit started then goes at once
instead of waiting for it, and more only add PUTs that slow the store (measured, see
docs/benchmarks.md); claims: 1, since a claim's latency hides behind the upstream's first byte.
``ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT`` overrides it: ``N`` for both streams, or ``ROWS/CLAIMS``
(each 1-64)."""
IN_FLIGHT_ENV = "ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT"
HOLE_GRACE_S = 5.0
"""How long a missing number below an existing commit may stay missing before a writer or reader
fills it with an empty tombstone (a writer in flight takes a round trip; one that died, forever).
Filling early is safe (the late put is renumbered), only wasteful."""
SETTLE_TIMEOUT_S = 120.0
"""How long a landed commit waits for the numbers below it before its calls are failed."""


def in_flight_setting() -> dict[Stream, int] | None:
    """The environment's commits in flight per stream (``N`` or ``ROWS/CLAIMS``), ``None`` when unset;
    a ``ValueError`` naming the variable when malformed (producers ask at startup)."""
    raw = os.environ.get(IN_FLIGHT_ENV, "").strip()
    if not raw:
        return None
    parts = raw.split("/")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and 1 <= int(p) <= 64 for p in parts):
        raise ValueError(
            f"{IN_FLIGHT_ENV} must be N or ROWS/CLAIMS, each an integer from 1 to 64; got {raw!r}"
        )
    return {"rows": int(parts[0]), "claims": int(parts[-1])}


def in_flight_bound(backend: Backend, stream: Stream = "rows") -> int:
    """Commits in flight for ``stream``: the environment's setting, else the default for the store."""
    setting = in_flight_setting()
    if setting is None:
        return 1 if backend.writes_in_place else DEFAULT_IN_FLIGHT[stream]
    return setting[stream]


@dataclass(slots=True)
class _Submission:
    entries: list[Entry]
    future: concurrent.futures.Future[int]
    rollouts: frozenset[str]


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
    ) -> None:
        self._backend = backend
        self.stream: Stream = stream
        self._tail_hint = tail_hint
        self.in_flight = in_flight if in_flight is not None else in_flight_bound(backend, stream)
        if self.in_flight < 1:
            raise ValueError(f"in_flight must be at least 1; got {self.in_flight}")
        self.writer_id = os.urandom(8).hex()
        self._cond = threading.Condition()
        self._reset()
        self.commits = 0
        self.tries = 0
        self.tombstones = 0
        self.peak_in_flight = 0  # the most commits this writer had in flight at once

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._queue: list[_Submission] = []
        self._workers = 0
        self._idle = 0
        self._busy: set[str] = set()  # rollouts of the commits in flight (not landed yet)
        self._active = 0  # commits taken, not landed or failed yet
        self._landed_any = False
        self._next: int | None = None  # the number handed out next
        self._starting = False  # a thread is looking the tail up
        self._floor = 0  # every number below it exists
        self._known: set[int] = set()  # numbers at or above the floor known to exist
        self._mine: set[int] = set()  # numbers this writer's puts are trying now
        self._debts: set[int] = set()  # our numbers whose put failed with later ones handed out
        self._filling: set[int] = set()  # numbers a thread of ours is resolving now
        self._missing: dict[int, float] = {}  # others' numbers seen missing: since when (monotonic)

    def submit(self, entries: Sequence[Entry]) -> concurrent.futures.Future[int]:
        """Queue entries to land together in one commit; the future has the commit's number."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        listed = list(entries)
        submission = _Submission(listed, future, frozenset(e.rollout_id for e in listed))
        with self._cond:
            if self._pid != os.getpid():  # a forked child: its parent's threads are not here
                self._reset()
            self._queue.append(submission)
            self._cond.notify_all()
            if self._idle == 0 and self._workers < self.in_flight:
                self._workers += 1
                thread = threading.Thread(target=self._run, name="rollout-capture-journal", daemon=True)
                thread.start()
        return future

    def write(self, entries: Sequence[Entry]) -> int:
        """Submit and wait: the entries are durable when this returns."""
        return self.submit(entries).result()

    # -- taking work

    def _group(self) -> list[_Submission]:
        """The submissions for the next commit, in order, none of a rollout in flight (locked)."""
        blocked = set(self._busy)
        taken: list[_Submission] = []
        rest: list[_Submission] = []
        entries = 0
        for submission in self._queue:
            too_many = bool(taken) and entries + len(submission.entries) > MAX_COMMIT_ENTRIES
            if too_many or not submission.rollouts.isdisjoint(blocked):
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
                    taken = self._group() if self._landed_any or not self._active else []
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
                try:
                    seq = self._commit(headers, lines)
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

    def _commit(self, headers: list[list[str]], lines: list[bytes]) -> int:
        """Land one commit and wait until every number below it exists; its number."""
        nonce = os.urandom(16).hex()
        seq = self._numbered(headers)
        taken = 0
        while True:
            self.tries += 1
            body = encode_commit(self.writer_id, nonce, headers, lines, floor=self._floor)
            where = self._backend.path(commit_name(seq, self.stream))
            try:
                try:
                    self._backend.create(where, body)
                    break
                except FileExistsError:
                    existing = self._backend.read_many([where])[0]
                if existing is not None and _nonce_of(existing) == nonce:
                    break  # our own write, landed before a retried request found it
            except BaseException:
                self._failed(seq, headers)
                raise
            with self._cond:  # another writer's: it exists, and its header tells what is below
                self._mine.discard(seq)
            self._learn(seq, existing)
            taken += 1
            seq = self._numbered(headers, jump=taken >= _LINEAR_TRIES)
        # Its number is final: its rollouts may go in the next commit now, before the numbers
        # below it settle (that one is handed out above this one).
        with self._cond:
            self._mine.discard(seq)
            self._known.add(seq)
            self._normalize()
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
            if self._next is not None and not jump:
                seq = self._next
                self._next += 1
                self._mine.add(seq)
                return seq
            self._starting = True
            start = self._next
        try:
            seen: set[int] = set()
            if start is None:
                hint = self._tail_hint() if self._tail_hint is not None else 0
                with self._cond:
                    self._floor = max(self._floor, hint)  # what a reader read exists
                start = hint
            found = first_free(self._backend, start, self.stream, seen=seen)
            below = None
            if found > start:  # the header of the one below tells how far down all exist
                below = self._backend.read_many([self._backend.path(commit_name(found - 1, self.stream))])[0]
        except BaseException:
            with self._cond:
                self._starting = False
                self._cond.notify_all()
            raise
        if below is not None:
            self._learn(found - 1, below)
        with self._cond:
            self._known |= seen
            self._normalize()
            self._next = max(found, self._next or 0)
            self._starting = False
            self._cond.notify_all()
            seq = self._next
            self._next += 1
            self._mine.add(seq)
            return seq

    def _failed(self, seq: int, headers: list[list[str]]) -> None:
        """A put that failed (not taken): its number is tried again by the next commit when
        nothing was handed out above it, else filled with a tombstone (no hole is left)."""
        with self._cond:
            self._busy -= {h[1] for h in headers}
            self._mine.discard(seq)
            if self._next == seq + 1:
                self._next = seq
                while self._next - 1 in self._debts:
                    self._debts.discard(self._next - 1)
                    self._next -= 1
            else:
                self._debts.add(seq)
            self._cond.notify_all()

    def _learn(self, seq: int, body: bytes | None) -> None:
        """``seq`` exists; its header says below which number everything existed when written."""
        floor = _floor_of(seq, body)
        with self._cond:
            self._known.add(seq)
            self._missing.pop(seq, None)
            self._floor = max(self._floor, floor)
            self._normalize()
            self._cond.notify_all()

    def _normalize(self) -> None:
        while self._floor in self._known:
            self._floor += 1
        if self._known and min(self._known) < self._floor:
            self._known = {n for n in self._known if n >= self._floor}
        for n in [n for n in self._missing if n < self._floor]:
            del self._missing[n]

    def _settle(self, seq: int) -> None:
        """Wait until every number below ``seq`` exists: ours land; others' are read, and any
        missing for :data:`HOLE_GRACE_S` (a writer that died mid-commit) filled with a tombstone."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        delay = 0.005
        while True:
            with self._cond:
                if self._floor > seq:
                    return
                if seq - self._floor > _READ_WINDOW:  # joining a long journal: the highest first,
                    unknown = [self._highest_unknown(seq)]  # its header's floor says much of the rest
                else:
                    unknown = [n for n in range(self._floor, seq) if n not in self._known]
                debts = [n for n in unknown if n in self._debts and n not in self._filling]
                others = [
                    n
                    for n in unknown
                    if n not in self._mine and n not in self._debts and n not in self._filling
                ]
                self._filling |= {*debts, *others}
                if not debts and not others:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(self._stuck(seq))
                    self._cond.wait(timeout=min(remaining, 0.5))  # ours in flight, or another thread's
                    continue
            progressed = False
            try:
                for n in debts:
                    progressed |= self._tombstone(n)
                if others:
                    progressed |= self._look(others)
            finally:
                with self._cond:
                    self._filling -= {*debts, *others}
                    self._cond.notify_all()
            if not progressed:
                if time.monotonic() > deadline:
                    raise TimeoutError(self._stuck(seq))
                time.sleep(delay)
                delay = min(delay * 2, 0.25)

    def _highest_unknown(self, seq: int) -> int:
        """The highest number below ``seq`` not known to exist (locked; one exists: the floor)."""
        n = seq - 1
        while n > self._floor and n in self._known:
            n -= 1
        return n

    def _stuck(self, seq: int) -> str:
        return (
            f"journal commit {self._backend.path(commit_name(seq, self.stream))} landed, but number "
            f"{self._floor} below it is still missing after {SETTLE_TIMEOUT_S:.0f} s"
        )

    def _look(self, seqs: list[int]) -> bool:
        """Read others' numbers below ours; fill those missing past the grace. Whether any settled."""
        path = self._backend.path
        bodies = self._backend.read_many([path(commit_name(n, self.stream)) for n in seqs])
        progressed = False
        now = time.monotonic()
        for n, body in zip(seqs, bodies, strict=True):
            if body is not None:
                self._learn(n, body)
                progressed = True
                continue
            with self._cond:
                since = self._missing.setdefault(n, now)
            if now - since >= HOLE_GRACE_S:
                progressed |= self._tombstone(n)
        return progressed

    def _tombstone(self, seq: int) -> bool:
        """Fill ``seq`` with an empty commit, put-if-absent (what is there already counts)."""
        path = self._backend.path(commit_name(seq, self.stream))
        body = tombstone_body(self.writer_id, self._floor)
        try:
            self._backend.create(path, body)
        except FileExistsError:
            existing = self._backend.read_many([path])[0]
            self._learn(seq, existing)
        except Exception:
            logger.warning("could not fill missing journal commit %s", path, exc_info=True)
            return False
        else:
            self.tombstones += 1
            logger.warning("journal commit %s was missing below later ones: filled with a tombstone", path)
            self._learn(seq, body)
        with self._cond:
            self._debts.discard(seq)
        return True


def tombstone_body(writer_id: str, floor: int) -> bytes:
    """An empty commit filling a number a writer left missing below later commits."""
    return encode_commit(writer_id, os.urandom(16).hex(), [], [], floor=floor, tombstone=True)


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


# ---------------------------------------------------------------------------- reading

Loc = tuple[Stream, int]
"""Where a commit is: its stream and number."""


_INDEX_BITS = 20  # entries of one commit: MAX_COMMIT_ENTRIES fits


def _pack(seq: int, index: int) -> int:
    return seq << _INDEX_BITS | index


def _unpack(packed: int) -> tuple[int, int]:
    return packed >> _INDEX_BITS, packed & ((1 << _INDEX_BITS) - 1)


@dataclass(slots=True)
class _Held:
    """What the journal holds for one rollout: its rows (packed commit and line, 8 bytes a row, so
    a reader indexing millions of rows stays small) and open claims, by where they sit."""

    rows: array[int] = field(default_factory=lambda: array("q"))
    claims: dict[str, tuple[int, int]] = field(default_factory=dict)  # claim id -> (claims seq, index)

    def row_places(self) -> list[tuple[int, int]]:
        return [_unpack(packed) for packed in self.rows]


class JournalReader:
    """The journal of one capture root as read so far, caught up by :meth:`refresh`.

    Commits never change once written, so each is read once; a clear entry drops what came
    before it in its stream for its rollout. The claims stream is read first, so a release
    (in the rows stream) nearly always finds its claim; one that does not waits for it.
    Thread-safe: batches of one job share it.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._looked: dict[Stream, float] = {}  # when each stream was last looked past its end
        self._holes: dict[tuple[Stream, int], float] = {}  # missing below later ones: since when
        self._refused: set[tuple[Stream, int]] = set()  # holes this reader could not fill (logged)
        self._next: dict[Stream, int] = {"claims": 0, "rows": 0}
        self._window: dict[Stream, int] = {"claims": 1, "rows": 1}
        self._held: dict[str, _Held] = {}
        self._released: set[tuple[str, str]] = set()  # releases read before their claim
        self._bodies: OrderedDict[Loc, Commit] = OrderedDict()
        self._body_bytes = 0
        self._mtimes: dict[int, float | None] = {}  # of claims commits
        self._lock = threading.Lock()

    def tail(self, stream: Stream = "rows") -> int:
        """The first commit number of ``stream`` not read yet (all below it exist)."""
        return self._next[stream]

    @property
    def exists(self) -> bool:
        """Whether any commit was found."""
        return any(self._next.values())

    def refresh(self) -> None:
        """Read every commit written since the last refresh (a GET per stream when none was, and a
        HEAD of the last one read, so a journal deleted and begun again is never half-read)."""
        with self._lock:
            for stream in STREAMS:
                if self._catch_up(stream):  # begun again: every stream from its start
                    for again in STREAMS:
                        self._catch_up(again)
                    return

    def _catch_up(self, stream: Stream) -> bool:
        """Read ``stream`` on to its end; True when what was read had been deleted (all forgotten)."""
        path = self._backend.path
        while True:
            start, window = self._next[stream], self._window[stream]
            seqs = list(range(start, start + window))
            bodies = self._backend.read_many([path(commit_name(s, stream)) for s in seqs])
            filled = False
            for at, (seq, body) in enumerate(zip(seqs, bodies, strict=True)):
                if body is None:
                    self._window[stream] = max(1, seq - start)  # about what came since the last look
                    last = path(commit_name(start - 1, stream))
                    if seq == start and start and not self._backend.exists(last):
                        self._restart()
                        return True
                    later = [
                        s for s, b in zip(seqs[at + 1 :], bodies[at + 1 :], strict=True) if b is not None
                    ]
                    if not later and seq:  # 0 is never a hole: a writer's first commit is alone
                        later = self._look_ahead(stream, seq, seqs[at + 1 :])
                    if later and self._fill(stream, seq, later[0]):
                        filled = True  # read again from the number filled
                        break
                    return False
                self._apply(stream, seq, body)
                self._next[stream] = seq + 1
            if not filled:
                self._window[stream] = min(_READ_WINDOW, window * 2)

    def _look_ahead(self, stream: Stream, seq: int, read: list[int]) -> list[int]:
        """The numbers just past a missing ``seq`` that exist (a writer that died with commits in
        flight leaves a hole): looked at on a reader's first stop, then at most once a second."""
        now = time.monotonic()
        last = self._looked.get(stream)
        if last is not None and now - last < _LOOK_EVERY_S:
            return []
        self._looked[stream] = now
        ahead = [s for s in range(seq + 1, seq + _LOOK_AHEAD) if s not in read]
        path = self._backend.path
        bodies = self._backend.read_many([path(commit_name(s, stream)) for s in ahead])
        return [s for s, body in zip(ahead, bodies, strict=True) if body is not None]

    def _fill(self, stream: Stream, seq: int, later: int) -> bool:
        """Fill a missing ``seq`` below the existing ``later`` with a tombstone once the hole is old
        (missing for the grace since this reader saw it, or ``later`` that old by the store's clock);
        whether the stream may be read on past it (the tombstone, or whatever was there first)."""
        grace = HOLE_GRACE_S
        key = (stream, seq)
        if len(self._holes) > 1024:
            self._holes.clear()
        first = key not in self._holes
        since = self._holes.setdefault(key, time.monotonic())
        old = time.monotonic() - since >= grace
        path = self._backend.path(commit_name(seq, stream))
        if not old and first and self._backend.trust_mtime:
            written = self._backend.modified([self._backend.path(commit_name(later, stream))])[0]
            old = written is not None and time.time() - written >= grace
        if not old:
            return False
        try:
            self._backend.create(path, tombstone_body("reader", seq))
        except FileExistsError:
            pass  # the late commit, or another's tombstone: read as it is
        except Exception as exc:
            if key not in self._refused:
                self._refused.add(key)
                logger.warning(
                    "journal commit %s is missing below later ones (a writer died mid-commit?) and this "
                    "reader cannot fill it (%s: %s): the commits after it are not read until a writer "
                    "or a reader allowed to write fills it",
                    path,
                    type(exc).__name__,
                    exc,
                )
            return False
        else:
            logger.warning("journal commit %s was missing below later ones: filled with a tombstone", path)
        self._holes.pop(key, None)
        return True

    def _restart(self) -> None:
        """Forget everything read: commits this reader read are gone (deleted from outside)."""
        logger.warning(
            "the journal under %s was deleted since it was read: reading it afresh", self._backend.root
        )
        self._next = {"claims": 0, "rows": 0}
        self._window = {"claims": 1, "rows": 1}
        self._looked.clear()
        self._holes.clear()
        self._held.clear()
        self._released.clear()
        self._bodies.clear()
        self._body_bytes = 0
        self._mtimes.clear()

    def _apply(self, stream: Stream, seq: int, body: bytes) -> None:
        try:
            commit = decode_commit(seq, body)
        except BadCommit as exc:
            path = self._backend.path(commit_name(seq, stream))
            logger.warning(
                "journal commit %s cannot be read (%s): its entries are lost to readers", path, exc
            )
            return
        for index, (op, rollout_id, claim_id) in enumerate(commit.headers):
            held = self._held.get(rollout_id)
            if op == "clear":
                if held is not None:
                    if stream == "rows":
                        del held.rows[:]
                        self._released = {r for r in self._released if r[0] != rollout_id}
                    else:
                        held.claims.clear()
            elif op == "row" and stream == "rows":
                if held is None:
                    held = self._held[rollout_id] = _Held()
                held.rows.append(_pack(seq, index))
            elif op == "claim" and stream == "claims" and claim_id is not None:
                if (rollout_id, claim_id) in self._released:
                    self._released.discard((rollout_id, claim_id))
                    continue
                if held is None:
                    held = self._held[rollout_id] = _Held()
                held.claims[claim_id] = (seq, index)
            elif op == "release" and stream == "rows" and claim_id is not None:
                if held is not None and claim_id in held.claims:
                    del held.claims[claim_id]
                else:
                    self._released.add((rollout_id, claim_id))
            if held is not None and not held.rows and not held.claims:
                del self._held[rollout_id]
        self._keep(stream, commit)

    def _keep(self, stream: Stream, commit: Commit) -> None:
        self._bodies[(stream, commit.seq)] = commit
        self._body_bytes += len(commit.body)
        while self._body_bytes > _BODY_BUDGET and len(self._bodies) > 1:
            _, dropped = self._bodies.popitem(last=False)
            self._body_bytes -= len(dropped.body)

    def holds(self, rollout_id: str) -> bool:
        """Whether the journal has rows or open claims of the rollout."""
        return rollout_id in self._held

    def rollout_ids(self) -> set[str]:
        """Every rollout the journal has rows or open claims of."""
        with self._lock:
            return set(self._held)

    def view(self, rollout_ids: Collection[str]) -> JournalView:
        """What the journal holds for these rollouts, with the bodies it needs read (one pass)."""
        with self._lock:
            held = {
                r: _Held(array("q", h.rows), dict(h.claims)) for r in rollout_ids if (h := self._held.get(r))
            }
            needed: set[Loc] = {("rows", packed >> _INDEX_BITS) for h in held.values() for packed in h.rows}
            needed |= {("claims", seq) for h in held.values() for seq, _ in h.claims.values()}
            commits = {loc: self._bodies[loc] for loc in needed if loc in self._bodies}
            for loc in commits:
                self._bodies.move_to_end(loc)
        missing = sorted(needed - set(commits))
        if missing:
            paths = [self._backend.path(commit_name(seq, stream)) for stream, seq in missing]
            for loc, body in zip(missing, self._backend.read_many(paths), strict=True):
                if body is not None:
                    with contextlib.suppress(BadCommit):
                        commits[loc] = decode_commit(loc[1], body)
        claimed = sorted({seq for h in held.values() for seq, _ in h.claims.values()})
        return JournalView(self._backend, held, commits, self._claim_times(claimed))

    def _claim_times(self, seqs: list[int]) -> dict[int, float | None]:
        """Modification times of the claims commits holding open claims, by the store's clock where
        it keeps one (claims are judged by it there)."""
        if not self._backend.trust_mtime:
            return {}
        unknown = [s for s in seqs if s not in self._mtimes]
        if unknown:
            times = self._backend.modified([self._backend.path(commit_name(s, "claims")) for s in unknown])
            with self._lock:
                self._mtimes.update(zip(unknown, times, strict=True))
        return {s: self._mtimes.get(s) for s in seqs}


class JournalView:
    """The journal's rows and open claims of some rollouts, ready to add to their snapshots."""

    def __init__(
        self,
        backend: Backend,
        held: dict[str, _Held],
        commits: dict[Loc, Commit],
        mtimes: dict[int, float | None],
    ) -> None:
        self._backend = backend
        self._held = held
        self._commits = commits
        self._mtimes = mtimes

    def found(self, rollout_id: str) -> bool:
        return rollout_id in self._held

    def add_rows(self, rollout_id: str, parsed: ParsedRows) -> None:
        """Append the rollout's journal rows, in journal order (after any other layout's)."""
        held = self._held.get(rollout_id)
        if held is None:
            return
        for seq, index in held.row_places():
            source = self._backend.path(commit_name(seq))
            commit = self._commits.get(("rows", seq))
            if commit is None:  # unreadable since its header was read
                parsed.add_damage(Damage(source, index + 2, "journal commit vanished or damaged"))
                continue
            add_journal_row(parsed, commit.line(index), source, index + 2)

    def claims(self, rollout_id: str) -> list[Claim]:
        """The rollout's claims not released yet (live or abandoned)."""
        held = self._held.get(rollout_id)
        if held is None:
            return []
        out = []
        trust = self._backend.trust_mtime
        for claim_id, (seq, index) in held.claims.items():
            commit = self._commits.get(("claims", seq))
            body = commit.line(index) if commit is not None else None
            out.append(read_claim(claim_id, body, self._mtimes.get(seq), trust_mtime=trust))
        return out

    def all_claims(self) -> dict[str, list[Claim]]:
        out = {}
        for rollout_id in self._held:
            found = self.claims(rollout_id)
            if found:
                out[rollout_id] = found
        return out


class JournalFetched(Fetched):
    """A batch fetched from the other layouts, with what the journal holds for it added."""

    def __init__(self, base: Fetched, reader: JournalReader, rollout_ids: Collection[str]) -> None:
        self._base = base
        self._reader = reader
        self._ids = list(rollout_ids)
        self._view = reader.view(self._ids)

    def found(self, rollout_id: str) -> bool:
        return self._view.found(rollout_id) or self._base.found(rollout_id)

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        snap = self._base.snapshot(rollout_id)
        if self._view.found(rollout_id):
            snap.found = True
            self._view.add_rows(rollout_id, snap.parsed)
            snap.claims.extend(self._view.claims(rollout_id))
        return snap

    def claims(self) -> dict[str, list[Claim]]:
        out = self._base.claims()
        for rollout_id, claims in self._view.all_claims().items():
            out[rollout_id] = [*out.get(rollout_id, []), *claims]
        return out

    def refresh(self, rollout_ids: Collection[str]) -> None:
        self._base.refresh(rollout_ids)
        self._reader.refresh()
        self._view = self._reader.view(self._ids)
