"""Following a run while it runs: each record enriched once its captures are quiescent, its line
written to the run's live output in the order the records landed.

The work of a round is :func:`~rollout_capture.batch.enrich_lines` over the lines landed since the
last one, as for every enrichment: what enriching a record does, it does here. Its quiescence wait
is not a wait here: the ids it finds claimed are noted, and the lines from the first of them on wait
for the next polls (a look at those claims alone) until the claims are released or the line's
quiescence timeout has passed since it landed, when it is written with the pending gap, as a
post-run enrichment would write it. Nothing is read twice: the rollouts from where the last read
stopped (:mod:`rollout_capture.rollout_tail`); the live output says how far an earlier follower got
(:mod:`rollout_capture.live_output`). Where the run ends (``_SUCCESS``) this loop ends too, once
every line landed is live; publishing the end is the flows' (post-run enrichment, under the lease).
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import orjson

from rollout_capture.attachment import ATTACHMENT_KEY
from rollout_capture.backends import Backend
from rollout_capture.batch import BatchStats, EnrichedBatch, LineProblem, enrich_lines
from rollout_capture.call_records_fast import Untyped
from rollout_capture.enrich_options import DEFAULT_BATCH_SIZE
from rollout_capture.identity import rollout_id_of
from rollout_capture.identity_fast import identify_line
from rollout_capture.live_output import LiveOutput, LiveOutputBusy
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S, claimed_now
from rollout_capture.rollout_tail import Listing, RolloutsTail
from rollout_capture.run_folders import SUCCESS
from rollout_capture.store import CaptureStore
from rollout_capture.summary import EvidenceShapeError, EvidenceSummary

LOCAL_POLL_S = 0.1
"""How often a follower looks for new lines when its run folder is on a local disk (an ``fstat``)."""
STORE_POLL_S = 0.5
"""How often a follower looks for new lines on an object store (one read of the next part)."""
LOCAL_STATE_S = 1.0
STORE_STATE_S = 2.0
"""How often a follower lists its run folder (has the run finished?): a local disk, an object store."""
MAX_WAITING_BATCHES = 4
"""Lines read ahead of the live output, at most, in batches: memory stays flat behind a held line."""

FollowEnd = Literal["finished", "stopped"]


@dataclass(frozen=True)
class FollowSettings:
    """How a follower enriches and how often it looks."""

    include_payloads: bool = False
    quiescence_timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S
    batch_size: int = DEFAULT_BATCH_SIZE
    poll_s: float = LOCAL_POLL_S
    state_s: float = LOCAL_STATE_S


@dataclass
class FollowProgress:
    """Where a followed run stands: what landed, what is live, what waits, the evidence so far."""

    landed: int = 0
    """Lines of the run's rollouts read."""
    live: int = 0
    """Lines in the live output (this follower's and those it found there)."""
    resumed: int = 0
    """Lines found in the live output when this follower began (an earlier follower's)."""
    waiting_on: list[str] = field(default_factory=list)
    """Rollouts whose live claims the next line waits on (every line behind it waits too)."""
    finished: bool = False
    """The run has finished (``_SUCCESS``) and every line of it is live."""
    rounds: int = 0
    stats: BatchStats = field(default_factory=BatchStats)
    """The live output's evidence so far (re-read from it for an earlier follower's lines)."""
    requests: int = 0
    """Store requests for the rollouts, the run folder and the live output (the captures' aside)."""

    @property
    def waiting(self) -> int:
        """Lines read but not live yet."""
        return self.landed - self.live


@dataclass(slots=True)
class _Landed:
    number: int
    line: bytes
    deadline: float
    """When it is written whatever its claims say (landed + the quiescence timeout)."""


def line_digest(line: bytes) -> int:
    """A line's fingerprint: what a live line is compared to its end's by (late rows)."""
    return int.from_bytes(hashlib.blake2b(line, digest_size=8).digest(), "little")


def _identity(line: bytes) -> str | bytes:
    """What a rollouts line and its enrichment have in common: the rollout id of a record, else the
    line itself (a line enrichment passes through unchanged)."""
    try:
        found = identify_line(line)
        return line if found is None else found[0]
    except Untyped:
        pass
    try:
        record = orjson.loads(line)
        rollout_id = rollout_id_of(record) if isinstance(record, dict) else None
    except (orjson.JSONDecodeError, ValueError):
        rollout_id = None
    return line if rollout_id is None else rollout_id


def stats_of_enriched(lines: Iterable[bytes], first_line: int = 1) -> BatchStats:
    """The counts and evidence of enriched lines already written (a live output found at start)."""
    stats = BatchStats()
    evidence = EvidenceSummary()
    gaps: dict[str, int] = {}
    for number, line in enumerate(lines, first_line):
        stats.lines += 1
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            if line.strip():
                stats.problems.append(LineProblem(line=number, reason="not JSON (passed through)"))
            continue
        attachment = record.get(ATTACHMENT_KEY) if isinstance(record, dict) else None
        if not isinstance(attachment, dict):
            continue
        try:
            evidence.add(record)
        except EvidenceShapeError as exc:  # not ours (then the live output is refused as not this run's)
            stats.problems.append(LineProblem(line=number, reason=str(exc)))
            continue
        stats.rollouts += 1
        stats.calls += int((attachment.get("metrics") or {}).get("num_calls") or 0)
        codes = [gap.get("code") for gap in attachment.get("gaps") or [] if isinstance(gap, dict)]
        if codes:
            stats.rollouts_with_gaps += 1
            for code in codes:
                gaps[str(code)] = gaps.get(str(code), 0) + 1
    stats.gaps = dict(sorted(gaps.items()))
    stats.evidence = evidence
    return stats


class Follower:
    """One run followed until it finishes (or is stopped): reads, enriches and writes in rounds.

    ``stores`` may be a provider, asked every round (credentials renewed during a long run give a
    store of their own); ``check`` is called before every step that writes (a lease's: it raises
    once the lease is lost); ``stop`` ends the loop after the round in hand; ``on_progress`` hears
    after every round and every wait.
    """

    def __init__(
        self,
        folder: Backend,
        tail: RolloutsTail,
        live: LiveOutput,
        stores: Sequence[CaptureStore] | Callable[[], Sequence[CaptureStore]],
        settings: FollowSettings | None = None,
        *,
        check: Callable[[], None] = lambda: None,
        stop: threading.Event | None = None,
        on_progress: Callable[[FollowProgress], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.folder = folder
        self.tail = tail
        self.live = live
        self._stores = stores
        self.settings = settings or FollowSettings()
        self.check = check
        self.stop = stop or threading.Event()
        self.on_progress = on_progress
        self.clock = clock
        self.progress = FollowProgress()
        self.digests: array[int] = array("Q")
        """Each live line's :func:`line_digest`, in order."""
        self._landed: deque[_Landed] = deque()
        self._held: set[str] = set()
        self._names: Listing = {}
        self._folder_requests = 0
        self._finished = False
        self._next_look = 0.0
        self._idle = False

    @property
    def stores(self) -> list[CaptureStore]:
        """The capture stores, as the provider gives them now."""
        return list(self._stores() if callable(self._stores) else self._stores)

    # ------------------------------------------------------------------ the loop

    def run(self) -> FollowEnd:
        """Follow until the run is finished and every line of it is live, or until stopped."""
        self.start()
        while (end := self.step()) is None:
            if self._idle:
                self.stop.wait(self.settings.poll_s)
        return end

    def start(self) -> None:
        """Take the live output and go on from where it stands (what :meth:`run` does first)."""
        self._finished = self._look()
        self._resume(self._finished)
        self._next_look = self.clock() + self.settings.state_s

    def step(self) -> FollowEnd | None:
        """One turn of the loop: look at the run folder when due, read what landed, write a round;
        how it ended, or None while it goes on (``_idle``: nothing to do until the next poll)."""
        self.check()
        if self.stop.is_set():
            return "stopped"
        if self.clock() >= self._next_look:
            self._finished = self._look()
            self._next_look = self.clock() + self.settings.state_s
        more = self._read(self._finished)
        wrote = self._round() if self._landed else False
        self._tell()
        if self._finished and not more and not self._landed:
            self.progress.finished = True
            return "finished"
        self._idle = not (wrote or more)
        return None

    def _look(self) -> bool:
        """List the run folder: whether the run has finished (what was read after this is all of it)."""
        self._names = self.folder.list_names([self.folder.root])[0]
        self._folder_requests += 1
        return SUCCESS in self._names

    def _open_live(self) -> Iterator[bytes]:
        """Take the live output once its lock is free: a follower this one took over from (paused
        past its lease) may hold it still, and lets go at its next step, finding its lease lost."""
        while True:
            try:
                return self.live.open()
            except LiveOutputBusy:
                self.check()
                if self.stop.wait(self.settings.poll_s):
                    raise

    def _resume(self, finished: bool) -> None:
        """Take the live output, and pass over the rollouts an earlier follower enriched into it."""

        def fingerprinted() -> Iterator[bytes]:
            for line in self._open_live():
                self.digests.append(line_digest(line))
                yield line

        last: list[bytes] = []

        def kept_last(lines: Iterator[bytes]) -> Iterator[bytes]:
            for line in lines:
                last[:] = [line]
                yield line

        stats = stats_of_enriched(kept_last(fingerprinted()))  # one pass, a line at a time
        count = len(self.digests)
        if count:
            self.progress.stats = stats
            skipped, rollout = self.tail.skip(count, self._names, finished)
            if skipped < count or rollout is None or _identity(rollout) != _identity(last[0]):
                where = (
                    f"line {count:,} is not the enrichment of theirs"
                    if skipped == count
                    else (f"the rollouts hold only {skipped:,}")
                )
                raise ValueError(
                    f"the live output {self.live.where} holds {count:,} line(s) but {where}: it is not "
                    "this run's, or the run's rollouts were rewritten (remove it to follow the run afresh)"
                )
        self.progress.live = self.progress.landed = self.progress.resumed = count

    def _read(self, finished: bool) -> bool:
        """Take what landed since the last read (bounded); whether more is there already. Once the
        run has finished and all was read, a last line without its newline lands too."""
        limit = MAX_WAITING_BATCHES * self.settings.batch_size
        more = True
        while more and len(self._landed) < limit:
            lines, more = self.tail.read(self._names)
            self._land(lines)
            if not (lines or more):
                break
        if finished and not more:
            self._land(self.tail.rest())
        return more

    def _land(self, lines: list[bytes]) -> None:
        deadline = self.clock() + self.settings.quiescence_timeout_s
        first = self.progress.landed + 1
        self._landed.extend(_Landed(first + offset, line, deadline) for offset, line in enumerate(lines))
        self.progress.landed += len(lines)

    # ------------------------------------------------------------------ a round

    def _round(self) -> bool:
        """Enrich the lines waiting (a batch at most) and write those whose captures are quiescent,
        in order; whether any was written."""
        now = self.clock()
        head = self._landed[0]
        if self._held:  # the head waits on claims: look at those alone until they go or time runs out
            if now < head.deadline and claimed_now(self._held, self.stores):
                return False
            self._held = set()
        batch = [self._landed[i] for i in range(min(self.settings.batch_size, len(self._landed)))]
        noted: set[str] = set()
        enriched = self._enrich(batch, noted)
        if noted:
            held = sorted(
                number
                for rollout_id in noted
                for number in enriched.stats.id_lines.get(rollout_id, [])
                if self._landed[number - head.number].deadline > now
            )
            if held:
                cut = held[0] - head.number
                self._held = {r for r in noted if held[0] in enriched.stats.id_lines.get(r, [])}
                if cut == 0:
                    return False
                batch = batch[:cut]
                enriched = self._enrich(batch, set())  # the quiescent lines before it, alone
        self.check()
        self.live.append(head.number, enriched.lines)
        self.digests.extend(line_digest(line) for line in enriched.lines)
        for _ in batch:
            self._landed.popleft()
        progress = self.progress
        progress.live += len(batch)
        progress.rounds += 1
        enriched.stats.id_lines = {}
        progress.stats = progress.stats + enriched.stats
        return True

    def _enrich(self, batch: list[_Landed], noted: set[str]) -> EnrichedBatch:
        """``enrich_lines`` over the batch; the ids it found claimed are added to ``noted`` (its
        wait returns at once: the loop waits instead, without holding up the lines before them)."""

        def note(claimed: set[str]) -> set[str]:
            noted.update(claimed)
            return claimed

        return enrich_lines(
            [landed.line for landed in batch],
            self.stores,
            first_line=batch[0].number,
            include_payloads=self.settings.include_payloads,
            quiescence_timeout_s=self.settings.quiescence_timeout_s,
            waiter=note,
        )

    def _tell(self) -> None:
        progress = self.progress
        progress.waiting_on = sorted(self._held)
        progress.requests = self._folder_requests + self.tail.requests + getattr(self.live, "requests", 0)
        if self.on_progress is not None:
            self.on_progress(progress)
