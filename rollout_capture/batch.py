"""Enrich a batch of rollout lines: the unit of work of every flow.

Each line is parsed once. The batch's evidence is gathered in one pass (one flat listing
on object stores), and only rollouts that still hold live claims are waited for, under
one deadline for the whole batch. Output lines keep input order; a line that is not a
rollout record passes through unchanged and is reported with its line number.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, Field, computed_field

from rollout_capture.attachment import (
    ATTACHMENT_KEY,
    OBSERVATIONS_KEY,
    attach,
    build_attachment,
    payloads_to_read,
)
from rollout_capture.backends import ListingScope
from rollout_capture.call_records_fast import Untyped
from rollout_capture.evidence import EvidenceReader
from rollout_capture.identity import rollout_id_of
from rollout_capture.identity_fast import identify_line
from rollout_capture.projections import carries_projection
from rollout_capture.quiescence import CAPTURE_DRAIN_TIMEOUT_S, DEFAULT_POLL_S, await_quiescence_many
from rollout_capture.rollout_files import split_lines
from rollout_capture.spilled_ids import SpilledIds
from rollout_capture.store import CaptureDir, CaptureStore, as_store
from rollout_capture.summary import AttachmentFold, EvidenceSummary, observation_gap_codes
from rollout_capture.summary.evidence import MAX_EXAMPLES

logger = logging.getLogger(__name__)

_KEY_PREFIX = b',"' + ATTACHMENT_KEY.encode() + b'":'
MAX_LISTED_DUPLICATES = 10
"""Duplicated rollout ids kept (and named) in a summary; all are counted."""
_LINES_PER_DUPLICATE = 5
Waiter = Callable[[set[str]], set[str]]
"""Given the ids holding live claims, wait (bounded) and return those still pending."""


class LineProblem(BaseModel):
    """A line that could not be enriched: where it is and why. It was passed through unchanged."""

    line: int
    reason: str


class DuplicateId(BaseModel):
    """A rollout id on more than one line of one input: every such line got the same calls."""

    rollout_id: str
    lines: list[int]
    """The first few lines holding it."""


class BatchStats(BaseModel):
    """What one batch held and what enrichment found; batches add up with ``+``.

    ``id_lines`` (the lines of each rollout id in this batch, never serialized) lets the
    flow find ids repeated across the batches of one input (:class:`DuplicateIds`).
    """

    lines: int = 0
    rollouts: int = 0
    calls: int = 0
    waited_for: int = 0
    rollouts_with_gaps: int = 0
    gaps: dict[str, int] = Field(default_factory=dict)
    problems: list[LineProblem] = Field(default_factory=list)
    duplicate_id_lines: int = 0
    """Rollout lines whose id an earlier line of the same input already had."""
    duplicate_ids: list[DuplicateId] = Field(default_factory=list)
    """The first few such ids, with their lines."""
    id_lines: dict[str, list[int]] = Field(default_factory=dict, exclude=True, repr=False)
    evidence: EvidenceSummary = Field(default_factory=EvidenceSummary, exclude=True, repr=False)
    """Failed calls, latency, tokens, models, gap examples, summed; not dumped (callers add digest())."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_in(self) -> int | None:
        """The evidence's sum (null when no call reported it: unknown, never 0)."""
        return self.evidence.tokens_in

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_out(self) -> int | None:
        return self.evidence.tokens_out

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_total(self) -> int | None:
        return self.evidence.tokens_total

    @property
    def gap_share(self) -> float:
        """The share of rollouts whose evidence has any gap (0 when there are none)."""
        return self.rollouts_with_gaps / self.rollouts if self.rollouts else 0.0

    def __add__(self, other: BatchStats) -> BatchStats:
        gaps = Counter(self.gaps)
        gaps.update(other.gaps)
        return BatchStats(
            lines=self.lines + other.lines,
            rollouts=self.rollouts + other.rollouts,
            calls=self.calls + other.calls,
            waited_for=self.waited_for + other.waited_for,
            rollouts_with_gaps=self.rollouts_with_gaps + other.rollouts_with_gaps,
            gaps=dict(sorted(gaps.items())),
            problems=[*self.problems, *other.problems],
            duplicate_id_lines=self.duplicate_id_lines + other.duplicate_id_lines,
            duplicate_ids=[*self.duplicate_ids, *other.duplicate_ids][:MAX_LISTED_DUPLICATES],
            evidence=self.evidence + other.evidence,
        )


SPILL_AFTER_IDS = 50_000
"""Rollout ids of one input kept in memory; past them the ids go to the local disk (``SpilledIds``)."""


class DuplicateIds:
    """The rollout ids of one input, gathered batch by batch, to name those on several lines and
    to tell orphan captures from wanted ones.

    Each line with a repeated id gets the same calls attached, which is rarely what was meant (a
    file concatenated twice, ids reused across runs), so the flow warns and counts them. Up to
    ``spill_after`` ids are kept in memory; beyond, every id goes to files on this host's
    temporary disk (:class:`~rollout_capture.spilled_ids.SpilledIds`), so memory stays flat
    however many rollouts the input holds. :meth:`close` removes them.
    """

    def __init__(self, spill_after: int = SPILL_AFTER_IDS) -> None:
        self._lines: dict[str, list[int]] = {}
        self._repeated: dict[str, None] = {}  # in the order first seen repeated
        self.repeated_lines = 0
        self._spill_after = spill_after
        self._spilled: SpilledIds | None = None
        self._order = 0  # what the next id added is keyed by, once spilled

    def add(self, stats: BatchStats) -> None:
        """Take a batch's ids (and drop them from its stats: they were only carried here)."""
        if self._spilled is not None:
            for rollout_id, lines in stats.id_lines.items():
                self._spilled.add(rollout_id, self._order, lines)
                self._order += 1
        else:
            for rollout_id, lines in stats.id_lines.items():
                known = self._lines.get(rollout_id)
                if known is None:
                    known = self._lines[rollout_id] = []
                self.repeated_lines += len(lines) - (0 if known else 1)
                known.extend(lines)
                if len(known) > 1:
                    self._repeated.setdefault(rollout_id, None)
            if len(self._lines) > self._spill_after:
                self._spill()
        stats.id_lines = {}

    def _spill(self) -> None:
        """Move the ids to disk, keyed so that those repeated so far stay first, in their order."""
        spilled = self._spilled = SpilledIds()
        order = {rollout_id: index for index, rollout_id in enumerate(self._repeated)}
        later = len(order)
        for rollout_id, lines in self._lines.items():
            key = order.get(rollout_id)
            if key is None:
                key, later = later, later + 1
            spilled.add(rollout_id, key, lines)
        self._order = later
        self._lines, self._repeated = {}, {}

    def found(self, limit: int | None = None) -> tuple[int, list[DuplicateId]]:
        """``(ids on more than one line, the first ``limit`` of them with their first few lines
        (sorted), first found first)``; every one of them without ``limit``."""
        if self._spilled is not None:
            count, extra, first = self._spilled.repeated(limit or self._order, _LINES_PER_DUPLICATE)
            self.repeated_lines = extra
            return count, [DuplicateId(rollout_id=r, lines=lines) for r, lines in first]
        named = list(self._repeated)[:limit]
        return len(self._repeated), [
            DuplicateId(rollout_id=r, lines=sorted(self._lines[r])[:_LINES_PER_DUPLICATE]) for r in named
        ]

    def set_orphans(self, evidence: EvidenceSummary, listed_ids: Iterable[str]) -> None:
        """Count (into ``evidence``) the ids of a capture root's listing that no line of the input names."""
        if self._spilled is None:
            evidence.set_orphans(listed_ids, self._lines)
            return
        evidence.set_orphan_figures(*self._spilled.orphans(listed_ids, MAX_EXAMPLES))

    def report(self, stats: BatchStats, source: str) -> BatchStats:
        """``stats`` with the duplicates counted and the first few named; warns when there are any."""
        count, named = self.found(MAX_LISTED_DUPLICATES)
        stats.duplicate_id_lines = self.repeated_lines
        stats.duplicate_ids = named
        if count:
            shown = "; ".join(f"{d.rollout_id} (lines {', '.join(map(str, d.lines))})" for d in named)
            more = f"; and {count - len(named)} more id(s)" if count > len(named) else ""
            logger.warning(
                "%s: %d rollout id(s) appear on more than one line, and each such line got the same "
                "calls attached: %s%s",
                source,
                count,
                shown,
                more,
            )
        return stats

    def close(self) -> None:
        """Remove what went to disk (the ids are gone from then on)."""
        if self._spilled is not None:
            self._spilled.close()


@dataclass(slots=True)
class EnrichedBatch:
    """Output lines (no trailing newline), in input order, and the batch's stats."""

    lines: list[bytes]
    stats: BatchStats = field(default_factory=BatchStats)


def splice_attachment(line: bytes, attachment: dict[str, Any]) -> bytes:
    """Fast path of re-serializing the merged record (the reference); tests/test_batch.py proves them equal.

    The line with our key appended: every other key stays byte for byte as written
    (``test_splice_keeps_every_original_byte``). Only for records that do not hold the key
    yet; cheaper than re-serializing them.
    """
    end = len(line)
    while end and line[end - 1] in b" \t\r\n":
        end -= 1
    start = end - 1
    while start > 0 and line[start - 1] in b" \t\r\n":
        start -= 1
    if end == 0 or line[end - 1] != 0x7D or line[start - 1] == 0x7B:  # not "...}", or "{}"
        record = orjson.loads(line)
        record[ATTACHMENT_KEY] = attachment
        return orjson.dumps(record)
    return b"".join((memoryview(line)[:start], _KEY_PREFIX, orjson.dumps(attachment), b"}"))


def _bare(line: bytes) -> bytes:
    """The line without its newline (a passed-through line is otherwise unchanged)."""
    return line[:-1] if line.endswith(b"\n") else line


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic collector while a batch runs: parsed JSON is acyclic, and collecting
    while a batch's objects are alive costs a fifth of the merge. Nested and thread-safe."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


def default_waiter(stores: Sequence[CaptureStore], timeout_s: float, poll_s: float) -> Waiter:
    """Wait in this thread with the core's async poller."""

    def wait(pending: set[str]) -> set[str]:
        return asyncio.run(await_quiescence_many(pending, stores, timeout_s, poll_s))

    return wait


def _identify(line: bytes, number: int, problems: list[LineProblem]) -> tuple[str, bool] | None:
    """``(rollout id, whether merging only adds our key)`` of a line, or None to pass it through.

    The parsed record is dropped at once: a batch holds lines, not parsed records. Most
    lines are read by their identity keys alone (:mod:`rollout_capture.identity_fast`).
    """
    try:
        return identify_line(line)
    except Untyped:
        pass
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        if line.strip():
            problems.append(LineProblem(line=number, reason=f"not JSON ({exc.msg} at column {exc.colno})"))
        return None
    if type(record) is not dict:
        problems.append(LineProblem(line=number, reason=f"not a JSON object ({type(record).__name__})"))
        return None
    try:
        rollout_id = rollout_id_of(record)
    except ValueError as exc:
        problems.append(LineProblem(line=number, reason=str(exc)))
        return None
    if rollout_id is None:
        return None
    return rollout_id, (
        ATTACHMENT_KEY not in record
        and record.get(OBSERVATIONS_KEY) is None
        and not carries_projection(record)
    )


def enrich_lines(
    lines: Sequence[bytes],
    capture_dirs: Sequence[CaptureDir],
    *,
    first_line: int = 1,
    include_payloads: bool = False,
    quiescence_timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
    waiter: Waiter | None = None,
    scope: ListingScope | None = None,
) -> EnrichedBatch:
    """Enrich rollout lines; ``first_line`` numbers them in problems.

    Lines may keep their newline; output lines never carry one. The batches of one
    ``scope`` (a flow run) may share one listing of each capture root.
    """
    with paused_gc():
        return _enrich(
            lines, capture_dirs, first_line, include_payloads, quiescence_timeout_s, poll_s, waiter, scope
        )


def _enrich(
    lines: Sequence[bytes],
    capture_dirs: Sequence[CaptureDir],
    first_line: int,
    include_payloads: bool,
    quiescence_timeout_s: float,
    poll_s: float,
    waiter: Waiter | None,
    scope: ListingScope | None,
) -> EnrichedBatch:
    stores = [as_store(d) for d in capture_dirs]
    problems: list[LineProblem] = []
    identified = [_identify(line, first_line + offset, problems) for offset, line in enumerate(lines)]
    stats = BatchStats(lines=len(lines), problems=problems)
    if not stores:
        return EnrichedBatch([_bare(line) for line in lines], stats)

    ids = [item[0] for item in identified if item is not None]
    reader = EvidenceReader(ids, stores, scope=scope)
    pending = reader.live_claimed(ids)
    if pending and quiescence_timeout_s > 0:
        wait = waiter or default_waiter(stores, quiescence_timeout_s, poll_s)
        stats.waited_for = len(pending)
        wait(pending)
        reader.refresh(sorted(pending))  # rows landed while we waited

    out: list[bytes] = []
    id_lines: dict[str, list[int]] = {}
    gaps: Counter[str] = Counter()
    rollouts = calls = gapped = 0
    fold = AttachmentFold(stats.evidence)  # counted in bulk: see AttachmentFold
    for number, (line, item) in enumerate(zip(lines, identified, strict=True), first_line):
        if item is None:
            out.append(_bare(line))
            continue
        rollout_id, only_added = item
        id_lines.setdefault(rollout_id, []).append(number)
        evidence = reader.evidence(rollout_id)
        if only_added:
            attachment = build_attachment(rollout_id, evidence, include_payloads=include_payloads)
            out.append(splice_attachment(line, attachment))
            fold.add_built_attachment(attachment)  # as built: counted without looking it over
        else:  # our key, agent observations or a NeMo Gym projection are there: merge into it
            record = orjson.loads(line)
            payloads = payloads_to_read(record, include_payloads)
            attachment = build_attachment(rollout_id, evidence, include_payloads=payloads)
            record = attach(record, attachment)
            out.append(orjson.dumps(record))
            fold.add(attachment, observation_gap_codes(record))
        metrics = attachment["metrics"]
        rollouts += 1
        calls += metrics["num_calls"]
        if "gaps" in attachment:
            gapped += 1
            gaps.update(gap["code"] for gap in attachment["gaps"])
    fold.flush()
    stats.rollouts, stats.calls = rollouts, calls
    stats.rollouts_with_gaps = gapped
    stats.gaps = dict(sorted(gaps.items()))
    stats.id_lines = id_lines
    return EnrichedBatch(out, stats)


def enrich_blob(
    blob: bytes,
    capture_dirs: Sequence[CaptureDir],
    *,
    first_line: int = 1,
    include_payloads: bool = False,
    quiescence_timeout_s: float = CAPTURE_DRAIN_TIMEOUT_S,
    waiter: Waiter | None = None,
    scope: ListingScope | None = None,
) -> tuple[bytes, int, BatchStats]:
    """:func:`enrich_lines` over newline-terminated bytes: ``(output bytes, line count, stats)``.

    The form a batch travels in between processes, and is written in: one blob.
    """
    enriched = enrich_lines(
        split_lines(blob),
        capture_dirs,
        first_line=first_line,
        include_payloads=include_payloads,
        quiescence_timeout_s=quiescence_timeout_s,
        waiter=waiter,
        scope=scope,
    )
    lines = enriched.lines
    # An empty last piece gives the trailing newline without copying the joined blob again.
    blob = b"\n".join([*lines, b""]) if lines else b"\n"
    return blob, len(lines), enriched.stats
