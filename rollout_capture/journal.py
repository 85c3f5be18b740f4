"""The journal layout (spec 2, 3 and 11, extension): many calls' claims, rows and releases in one
object, written put-if-absent, so an object store sees a request per group of calls, not several
per call.

``_journal/{seq:012d}.jsonl`` under the capture root holds one *commit*: a header line naming each
entry (``[op, rollout_id]`` or ``[op, rollout_id, claim_id]``), then one line per entry (a row, a
claim body, or ``null``). Commits form one sequence for the whole root, with no gaps: a writer
creates commit ``s`` only once it knows ``s - 1`` exists (its own last commit, or one it found
taken), so every commit is numbered above every commit that existed when it was written. A
rollout's rows are in commit order, then line order: one total order across hosts, with no
clock, that respects which call finished first. A lost acknowledgement is told by the
commit's nonce, as for row objects.

A writer keeps one commit in flight; whatever is submitted meanwhile goes into the next one
(group commit). Readers read commits in order from where they stopped (no listing: the first
missing number is the end), index each rollout's entries by their header alone and keep a
bounded cache of bodies, so a rollout's rows cost one GET per commit holding them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
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
from rollout_capture.sequence import create_numbered, first_absent
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


def encode_commit(writer_id: str, nonce: str, headers: list[list[str]], lines: list[bytes]) -> bytes:
    head = orjson.dumps({"journal": FORMAT, "writer": writer_id, "nonce": nonce, "entries": headers})
    return b"\n".join([head, *lines]) + b"\n"


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
    return Commit(seq, nonce if isinstance(nonce, str) else "", headers, body, spans)


def _nonce_of(body: bytes) -> str | None:
    try:
        return decode_commit(0, body).nonce
    except BadCommit:
        return None


# ---------------------------------------------------------------------------- writing


@dataclass(slots=True)
class _Submission:
    entries: list[Entry]
    future: concurrent.futures.Future[int]


class JournalWriter:
    """Group commit for one capture root in this process: one commit in flight at a time, and
    everything submitted while it is goes into the next one.

    ``submit`` never blocks on the store; its future resolves to the commit's number once the
    entries are durable (or raises the store's error: the caller marks the rollout incomplete).
    The thread starts with the first submission, so a forked child gets its own.
    """

    def __init__(
        self, backend: Backend, stream: Stream = "rows", *, tail_hint: Callable[[], int] | None = None
    ) -> None:
        self._backend = backend
        self.stream: Stream = stream
        self._tail_hint = tail_hint
        self.writer_id = os.urandom(8).hex()
        self._queue: list[_Submission] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._next: int | None = None  # the number the next commit tries first
        self.commits = 0
        self.tries = 0

    def submit(self, entries: Sequence[Entry]) -> concurrent.futures.Future[int]:
        """Queue entries to land together in one commit; the future has the commit's number."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        submission = _Submission(list(entries), future)
        with self._cond:
            if self._pid != os.getpid():  # a forked child: its parent's thread is not here
                self._pid, self._thread, self._queue, self._next = os.getpid(), None, [], None
            self._queue.append(submission)
            self._cond.notify()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rollout-capture-journal", daemon=True)
                self._thread.start()
        return future

    def write(self, entries: Sequence[Entry]) -> int:
        """Submit and wait: the entries are durable when this returns."""
        return self.submit(entries).result()

    def _take(self) -> list[_Submission] | None:
        with self._cond:
            if not self._queue and not self._cond.wait_for(lambda: bool(self._queue), timeout=30.0):
                self._thread = None  # idle: a later submission starts a fresh thread
                return None
            taken: list[_Submission] = []
            entries = 0
            while self._queue and (not taken or entries + len(self._queue[0].entries) <= MAX_COMMIT_ENTRIES):
                submission = self._queue.pop(0)
                taken.append(submission)
                entries += len(submission.entries)
            return taken

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            headers: list[list[str]] = []
            lines: list[bytes] = []
            ready: list[_Submission] = []
            size = 0
            for submission in taken:
                try:
                    built = [e.line() if callable(e.line) else e.line for e in submission.entries]
                except Exception as exc:  # a row that cannot be written fails its own call only
                    submission.future.set_exception(exc)
                    continue
                if ready and size + sum(map(len, built)) > MAX_COMMIT_BYTES:
                    with self._cond:  # too big to ride along: first in line for the next commit
                        self._queue.insert(0, submission)
                    continue
                size += sum(map(len, built))
                headers.extend(e.header() for e in submission.entries)
                lines.extend(built)
                ready.append(submission)
            if not ready:
                continue
            try:
                seq = self._commit(headers, lines)
            except BaseException as exc:
                for submission in ready:
                    submission.future.set_exception(exc)
            else:
                for submission in ready:
                    submission.future.set_result(seq)

    def _commit(self, headers: list[list[str]], lines: list[bytes]) -> int:
        nonce = os.urandom(16).hex()
        body = encode_commit(self.writer_id, nonce, headers, lines)
        if self._next is None:
            self._next = self._tail()
        taken = 0

        def after_taken(seq: int) -> int:
            # Another writer's: the next number (commits have no gaps, so this stays above
            # everything that existed), or, after several, the tail looked up.
            nonlocal taken
            taken += 1
            self.tries += 1
            self._next = seq + 1 if taken < _LINEAR_TRIES else first_free(self._backend, seq + 1, self.stream)
            return self._next  # a failed try is retried here, never past it (no gap)

        self.tries += 1
        seq = create_numbered(
            self._backend,
            lambda n: commit_name(n, self.stream),
            self._next,
            body,
            lambda existing: _nonce_of(existing) == nonce,
            after_taken,
        )
        self._next = seq + 1
        self.commits += 1
        return seq

    def _tail(self) -> int:
        hint = self._tail_hint() if self._tail_hint is not None else 0
        return first_free(self._backend, hint, self.stream)


def first_free(backend: Backend, start: int = 0, stream: Stream = "rows") -> int:
    """The first commit number at or above ``start`` that does not exist (taken ones form a prefix)."""
    return first_absent(lambda seq: backend.exists(backend.path(commit_name(seq, stream))), start)


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
            for seq, body in zip(seqs, bodies, strict=True):
                if body is None:
                    self._window[stream] = max(1, seq - start)  # about what came since the last look
                    last = path(commit_name(start - 1, stream))
                    if seq == start and start and not self._backend.exists(last):
                        self._restart()
                        return True
                    return False
                self._apply(stream, seq, body)
                self._next[stream] = seq + 1
            self._window[stream] = min(_READ_WINDOW, window * 2)

    def _restart(self) -> None:
        """Forget everything read: commits this reader read are gone (deleted from outside)."""
        logger.warning(
            "the journal under %s was deleted since it was read: reading it afresh", self._backend.root
        )
        self._next = {"claims": 0, "rows": 0}
        self._window = {"claims": 1, "rows": 1}
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
