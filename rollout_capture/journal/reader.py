"""The journal's reader: catches up from where it stopped, indexes each rollout's entries by their
header alone and keeps the bodies it read (:mod:`.bodies`), so a commit costs one GET however
many batches read its rows. Given a listing of the root (a job's shared one), it reads exactly
the commits listed and not read yet, pipelined, and nothing past them; without one, the first
missing number is the end.

A compacted generation (:mod:`.compacted`) stands for every commit below its floors: a reader
holding none, or an older one, that finds it (in a listing, or by looking) forgets what it read
and loads the generation instead, then reads the commits from its floors on, so it reads either
the commits or the generation that replaced them, never both. Those commits are removed once the
generation exists, so a reader that finds a commit missing where one was (a listed one, the last
one it read, a hole it would fill) looks for a generation first; and one that reads without a
listing looks at the end of a refresh whenever its last refresh began ``CHECK_AFTER_S`` ago or
more: a commit removed under it is older than the quiet period a root is compacted after
(``QUIET_S``, :mod:`.compacted`), so a reader refreshing more often than that reads nothing a
compaction removes between two of its refreshes (contract section 2)."""

from __future__ import annotations

import contextlib
import logging
import threading
from array import array
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

from rollout_capture.backends.base import Backend, ReadBatch
from rollout_capture.claims import Claim, read_claim
from rollout_capture.journal import commits, compacted
from rollout_capture.journal.bodies import CommitBodies, Loc
from rollout_capture.journal.clock import REAL_CLOCK, Clock
from rollout_capture.journal.commits import (
    LOOK_AHEAD,
    STREAMS,
    BadCommit,
    Commit,
    Stream,
    commit_name,
    decode_commit,
    tombstone_body,
)
from rollout_capture.journal.compacted import BadManifest, Manifest, floors_of, newest_manifest, read_manifest
from rollout_capture.journal.parts import PartsReader
from rollout_capture.names import COMPACTED
from rollout_capture.rows import Damage, ParsedRows, add_journal_row
from rollout_capture.snapshot import RolloutSnapshot

logger = logging.getLogger(__name__)

_READ_WINDOW = 64  # commits read at once, at most, while catching up without a listing
_LOOK_EVERY_S = 1.0  # how often a reader stopped at the same end looks past it again


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
    compacted: tuple[int, int, int, int] | None = None
    """Its rows in the generation held, before those of ``rows``: (part, offset, length, first line)."""

    def row_places(self) -> list[tuple[int, int]]:
        return [_unpack(packed) for packed in self.rows]

    @property
    def empty(self) -> bool:
        return not self.rows and not self.claims and self.compacted is None


def _contiguous(numbers: list[int], start: int) -> list[int]:
    """``start``, ``start + 1``... as long as ``numbers`` (sorted, none below ``start``) has them."""
    length = 0
    while length < len(numbers) and numbers[length] == start + length:
        length += 1
    return numbers[:length]


class JournalReader:
    """The journal of one capture root as read so far, caught up by :meth:`refresh`.

    Commits never change once written, so each is read once, and its body kept until
    :meth:`forget_bodies`; a clear entry drops what came before it in its stream for its
    rollout. The claims stream is read first, so a release (in the rows stream) nearly always
    finds its claim; one that does not waits for it.
    Thread-safe: batches of one job share it.
    """

    def __init__(self, backend: Backend, *, clock: Clock = REAL_CLOCK) -> None:
        self._backend = backend
        self._clock = clock
        self._looked: dict[Stream, float] = {}  # when each stream was last looked past its end
        self._holes: dict[tuple[Stream, int], float] = {}  # missing below later ones: since when
        self._refused: set[tuple[Stream, int]] = set()  # holes this reader could not fill (logged)
        self._stuck: dict[Stream, tuple[int, str]] = {}  # where each stream stops at a hole it cannot fill
        self._next: dict[Stream, int] = {"claims": 0, "rows": 0}
        self._window: dict[Stream, int] = {"claims": 1, "rows": 1}
        self._held: dict[str, _Held] = {}
        self._released: set[tuple[str, str]] = set()  # releases read before their claim
        self._bodies = CommitBodies()
        self._mtimes: dict[int, float | None] = {}  # of claims commits
        self._generation: Manifest | None = None  # the compacted generation held
        self._parts: PartsReader | None = None  # its parts, as read
        self._claim_lines: dict[tuple[int, int], bytes] = {}  # its open claims' bodies, by place
        self._began: float | None = None  # when the last refresh without a listing began (None: look)
        self._lock = threading.RLock()

    def tail(self, stream: Stream = "rows") -> int:
        """The first commit number of ``stream`` not read yet (all below it exist)."""
        return self._next[stream]

    @property
    def exists(self) -> bool:
        """Whether any commit (or a compacted generation) was found."""
        return any(self._next.values()) or self._generation is not None

    @property
    def generation(self) -> Manifest | None:
        """The compacted generation this reader holds (what stands for the commits below its floors)."""
        return self._generation

    def _floor(self, stream: Stream) -> int:
        return floors_of(self._generation)[stream]

    def refresh(self, listed: Mapping[str, Collection[int]] | None = None) -> None:
        """Read every commit written since the last refresh.

        ``listed``: each stream's commit numbers a listing of the whole root showed (and under
        ``compacted`` its generations with a manifest); then exactly those not read yet are read
        (and a hole among them looked into), no number past them. Without it, from where each
        stream stopped to its first missing number (a GET per stream when none was, and a HEAD of
        the last one read, so a journal deleted and begun again is never half-read), then a look
        for a newer generation when the last refresh began long enough ago (module docstring)."""
        with self._lock:
            began = self._clock.monotonic()
            for _ in range(8):  # begun again, or a generation loaded: every stream from its floor
                if listed is not None and self._listed_generation(listed.get(COMPACTED, ())):
                    continue
                if any(
                    self._catch_up_listed(stream, listed.get(stream, ()))
                    if listed is not None
                    else self._catch_up(stream)
                    for stream in STREAMS
                ):
                    continue
                if listed is None:
                    if self._due() and self._check():
                        continue
                    self._began = began
                return
            logger.warning("the journal under %s kept changing while read: read as found", self._backend.root)

    def _due(self) -> bool:
        """Whether a compaction may have removed commits this reader is reading: its last refresh
        without a listing began :data:`~.compacted.CHECK_AFTER_S` ago or more (or never)."""
        last = self._began
        return last is None or self._clock.monotonic() - last >= compacted.CHECK_AFTER_S

    def _listed_generation(self, listed: Collection[int]) -> bool:
        """Load the newest generation a listing showed when it is newer than the one held; True
        when the reader starts over from it. A listing showing none while one is held, or one gone
        by the time it is read: the generations are looked at again."""
        held = self._generation
        if not listed:
            return held is not None and self._check()  # begun again, or a listing older than it
        newest = max(listed)
        if held is not None and newest <= held.generation:
            return False  # the one held, or a listing older than this reader
        try:
            manifest = read_manifest(self._backend, newest)
        except BadManifest:
            manifest = None
        if manifest is None:  # replaced since the listing, or unreadable (logged by the look)
            return self._check()
        self._adopt(manifest)
        return True

    def _check(self) -> bool:
        """Look for the newest compacted generation (one listing of their folder; a GET of its
        manifest when it is new): True when the reader starts over, from it or from nothing (the
        one it held is gone: the journal was deleted and begun again)."""
        held = self._generation
        manifest = newest_manifest(self._backend, known=held)
        if manifest is None:
            if held is None:
                return False
            self._restart()
            return True
        if held is not None and manifest.generation == held.generation:
            return False
        self._adopt(manifest)
        return True

    def _resync(self) -> bool:
        """A commit that was there is missing: removed under a compacted generation (loaded), or
        the journal was deleted and begun again (read afresh). Always True: the reader starts over."""
        if not self._check():
            self._restart()
        return True

    def _catch_up_listed(self, stream: Stream, listed: Collection[int]) -> bool:
        """Read the listed numbers of ``stream`` from where it stopped, in one pipelined pass up to
        the first number not listed, which is the end or a hole (filled once old, as on a read
        stop); True when what was read had been deleted (all forgotten)."""
        known = set(listed)
        start = self._next[stream]
        path = self._backend.path
        if start > self._floor(stream) and (start - 1) not in known and max(known, default=-1) >= start - 1:
            # The listing lacks the last commit read below one it shows: deleted since (begun
            # again, or compacted), or landed after the listing (then the listing is older than
            # this reader)
            if not self._backend.exists(path(commit_name(start - 1, stream))):
                return self._resync()
            return False
        numbers = sorted(n for n in known if n >= start)
        while True:
            start = self._next[stream]
            run = _contiguous(numbers, start)
            with contextlib.closing(
                self._backend.read_iter([path(commit_name(s, stream)) for s in run])
            ) as bodies:
                for seq, body in zip(run, bodies, strict=True):
                    if body is None:  # gone since it was listed: compacted, or begun again
                        self._window[stream] = 1
                        return self._resync()
                    self._read(stream, seq, body)
            numbers = numbers[len(run) :]
            self._window[stream] = 1  # past the end next time: what came since, found one by one
            if not numbers:
                self._looked[stream] = self._clock.monotonic()  # the listing looked past the end
                return False
            if self._due() and self._check():  # a hole may be a compacted commit removed: not filled
                return True
            if not self._fill(stream, self._next[stream], numbers[0]):
                return False
            numbers.insert(0, self._next[stream])  # filled: read what is there now

    def _read(self, stream: Stream, seq: int, body: bytes) -> None:
        """Take commit ``seq`` of ``stream``, the next one of it, into the index."""
        self._apply(stream, seq, body)
        self._next[stream] = seq + 1
        if stream in self._stuck and self._stuck[stream][0] <= seq:
            del self._stuck[stream]  # filled by someone allowed to

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
                    if seq == start and start > self._floor(stream) and not self._backend.exists(last):
                        return self._resync()
                    later = [
                        s for s, b in zip(seqs[at + 1 :], bodies[at + 1 :], strict=True) if b is not None
                    ]
                    if not later and seq:  # 0 is never a hole: a writer's first commit is alone
                        later = self._look_ahead(stream, seq, seqs[at + 1 :])
                    if later and self._due() and self._check():  # a compacted commit removed?
                        return True
                    if later and self._fill(stream, seq, later[0]):
                        filled = True  # read again from the number filled
                        break
                    return False
                self._read(stream, seq, body)
            if not filled:
                self._window[stream] = min(_READ_WINDOW, window * 2)

    def _look_ahead(self, stream: Stream, seq: int, read: list[int]) -> list[int]:
        """The numbers just past a missing ``seq`` that exist (a writer that died with commits in
        flight leaves a hole): looked at on a reader's first stop, then at most once a second."""
        now = self._clock.monotonic()
        last = self._looked.get(stream)
        if last is not None and now - last < _LOOK_EVERY_S:
            return []
        self._looked[stream] = now
        ahead = [s for s in range(seq + 1, seq + LOOK_AHEAD) if s not in read]
        path = self._backend.path
        bodies = self._backend.read_many([path(commit_name(s, stream)) for s in ahead])
        return [s for s, body in zip(ahead, bodies, strict=True) if body is not None]

    def _fill(self, stream: Stream, seq: int, later: int) -> bool:
        """Fill a missing ``seq`` below the existing ``later`` with a tombstone once the hole is old
        (missing for the grace since this reader saw it, or ``later`` that old by the store's clock);
        whether the stream may be read on past it (the tombstone, or whatever was there first)."""
        grace = commits.HOLE_GRACE_S
        key = (stream, seq)
        if len(self._holes) > 1024:
            self._holes.clear()
        first = key not in self._holes
        since = self._holes.setdefault(key, self._clock.monotonic())
        old = self._clock.monotonic() - since >= grace
        path = self._backend.path(commit_name(seq, stream))
        if not old and first and self._backend.trust_mtime:
            written = self._backend.modified([self._backend.path(commit_name(later, stream))])[0]
            old = written is not None and self._clock.time() - written >= grace
        if not old:  # a writer in flight, most likely: what is above is pending, not missing
            self._stuck.setdefault(
                stream, (seq, f"{path} missing below later commits, younger than the grace")
            )
            return False
        try:
            self._backend.create(path, tombstone_body("reader", seq))
        except FileExistsError:
            pass  # the late commit, or another's tombstone: read as it is
        except Exception as exc:
            self._stuck[stream] = (
                seq,
                f"{path} missing below later commits, not filled ({type(exc).__name__})",
            )
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
        self._forget(None)

    def _adopt(self, manifest: Manifest) -> None:
        """Hold a compacted generation in place of everything read: its rollouts' rows (where they
        are in its parts), open claims and early releases, and its floors, from which the streams
        are read on."""
        logger.info(
            "the journal under %s is compacted (generation %d): read from it",
            self._backend.root,
            manifest.generation,
        )
        self._forget(manifest)
        for number, part in enumerate(manifest.parts):
            for placed in part.rollouts:
                self._held[placed.rollout_id] = _Held(
                    compacted=(number, placed.offset, placed.length, placed.first_line)
                )
        for claim in manifest.claims:
            held = self._held.get(claim.rollout_id)
            if held is None:
                held = self._held[claim.rollout_id] = _Held()
            held.claims[claim.claim_id] = (claim.seq, claim.index)
            self._claim_lines[(claim.seq, claim.index)] = claim.body
            self._mtimes[claim.seq] = claim.mtime
        self._released = set(manifest.released)

    def _forget(self, manifest: Manifest | None) -> None:
        if self._parts is not None:
            self._parts.clear()
        self._generation = manifest
        self._parts = None if manifest is None else PartsReader(self._backend, manifest)
        self._claim_lines = {}
        self._began = None  # what comes next is read from a new start: looked at again after
        self._next = floors_of(manifest)
        self._window = {"claims": 1, "rows": 1}
        self._looked.clear()
        self._holes.clear()
        self._stuck.clear()
        self._held.clear()
        self._released.clear()
        self._bodies.clear()
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
                        held.compacted = None
                        self._released = {r for r in self._released if r[0] != rollout_id}
                    else:  # a claim alone is put without a look above it, so a live one may
                        # stand below a clear a dead writer left above a hole: the clear drops only
                        # the claims below its floor (all that existed), and those before it in its
                        # own commit (spec 2)
                        floor = seq if commit.floor is None else min(commit.floor, seq)
                        held.claims = {
                            claim: (at, line)
                            for claim, (at, line) in held.claims.items()
                            if at >= floor and not (at == seq and line < index)
                        }
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
            if held is not None and held.empty:
                del self._held[rollout_id]
        self._keep(stream, commit)

    def _keep(self, stream: Stream, commit: Commit) -> None:
        self._bodies.keep((stream, commit.seq), commit)

    def forget_bodies(self) -> None:
        """Let the bodies read so far go (an enrichment is over); a later view reads what it needs again."""
        self._bodies.clear()
        with self._lock:
            parts = self._parts
        if parts is not None:
            parts.clear()

    def holds(self, rollout_id: str) -> bool:
        """Whether the journal has rows or open claims of the rollout."""
        return rollout_id in self._held

    def rollout_ids(self) -> set[str]:
        """Every rollout the journal has rows or open claims of."""
        with self._lock:
            return set(self._held)

    def in_order(self) -> list[str]:
        """:meth:`rollout_ids` in the order the journal first named them (a compaction's order)."""
        with self._lock:
            return list(self._held)

    def open_claims(self) -> list[tuple[str, str, int, int]]:
        """Every claim not released yet: ``(rollout, claim id, claims commit, entry)``."""
        with self._lock:
            return [
                (rollout_id, claim_id, seq, index)
                for rollout_id, held in self._held.items()
                for claim_id, (seq, index) in held.claims.items()
            ]

    def early_releases(self) -> set[tuple[str, str]]:
        """Releases read before their claim (its claims commit below a hole, say): ``(rollout, claim id)``."""
        with self._lock:
            return set(self._released)

    @property
    def holes(self) -> list[str]:
        """The holes below later commits this reader stopped at and did not fill (too young, or its
        writes refused): any rollout may have entries above one, so each is a pending gap of every
        rollout read."""
        return [detail for _, detail in self._stuck.values()]

    def view(self, rollout_ids: Collection[str], *, again: bool = True) -> JournalView:
        """What the journal holds for these rollouts, with the lines it needs cut from their commits
        and parts (the commits themselves not kept: a batch holds its rows, never every commit it
        touches). A commit or part gone since it was read (a compaction replaced it) is looked
        for in the newest generation: read from there once (``again``)."""
        with self._lock:
            held = {
                r: _Held(array("q", h.rows), dict(h.claims), h.compacted)
                for r in rollout_ids
                if (h := self._held.get(r))
            }
            parts, generation = self._parts, self._generation
            lines: dict[tuple[Stream, int, int], bytes] = {
                ("claims", *place): self._claim_lines[place]
                for h in held.values()
                for place in h.claims.values()
                if place in self._claim_lines
            }
        wanted: dict[Loc, list[int]] = {}
        for h in held.values():
            for packed in h.rows:
                seq, index = _unpack(packed)
                wanted.setdefault(("rows", seq), []).append(index)
            for seq, index in h.claims.values():
                if ("claims", seq, index) not in lines:
                    wanted.setdefault(("claims", seq), []).append(index)

        def cut(loc: Loc, commit: Commit) -> None:
            stream, seq = loc
            for index in wanted[loc]:
                lines[(stream, seq, index)] = commit.line(index)

        missing = []
        for loc in sorted(wanted):
            commit = self._bodies.get(loc)
            if commit is None:
                missing.append(loc)
            else:
                cut(loc, commit)
        gone = False
        if missing:  # bodies let go since they were read (an earlier enrichment's)
            paths = [self._backend.path(commit_name(seq, stream)) for stream, seq in missing]
            with contextlib.closing(self._backend.read_iter(paths)) as bodies:
                for loc, body in zip(missing, bodies, strict=True):
                    gone = gone or body is None
                    if body is not None:
                        with contextlib.suppress(BadCommit):
                            commit = decode_commit(loc[1], body)
                            self._bodies.keep(loc, commit)
                            cut(loc, commit)
        compacted: dict[str, tuple[str, int, bytes | None]] = {}
        placed = [(r, h.compacted) for r, h in held.items() if h.compacted is not None]
        if placed and parts is not None and generation is not None:
            pieces = parts.read([(part, offset, length) for _, (part, offset, length, _) in placed])
            for (rollout_id, (part, _, _, first)), piece in zip(placed, pieces, strict=True):
                compacted[rollout_id] = (generation.part_path(self._backend, part), first, piece)
                gone = gone or piece is None
        if gone and again:
            with self._lock:
                if self._check():  # replaced by a newer generation: read from it
                    self.refresh()
                    return self.view(rollout_ids, again=False)
        claimed = sorted({seq for h in held.values() for seq, _ in h.claims.values()})
        return JournalView(self._backend, held, lines, self._claim_times(claimed), self.holes, compacted)

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
        lines: dict[tuple[Stream, int, int], bytes],
        mtimes: dict[int, float | None],
        holes: list[str] | None = None,
        compacted: dict[str, tuple[str, int, bytes | None]] | None = None,
    ) -> None:
        self._backend = backend
        self._held = held
        self._lines = lines  # (stream, commit, entry) -> its line, for the entries held
        self._mtimes = mtimes
        self.holes = holes or []
        self._compacted = compacted or {}  # rollout -> (its part, the line of its first row, its rows' bytes)

    def found(self, rollout_id: str) -> bool:
        return rollout_id in self._held

    def add_rows(self, rollout_id: str, parsed: ParsedRows) -> None:
        """Append the rollout's journal rows, in journal order (after any other layout's)."""
        for line, source, number in self.lines_of(rollout_id):
            if line is None:
                parsed.add_damage(Damage(source, number, "journal commit vanished or damaged"))
            else:
                add_journal_row(parsed, line, source, number)

    def lines_of(self, rollout_id: str) -> Iterator[tuple[bytes | None, str, int]]:
        """The rollout's rows as committed, in journal order: ``(line, where, its line number)``,
        the line ``None`` where its commit or part could not be read. Its rows in the compacted
        generation come first (they were committed before any commit at or above its floors)."""
        held = self._held.get(rollout_id)
        if held is None:
            return
        if rollout_id in self._compacted:
            source, first, data = self._compacted[rollout_id]
            if data is None:
                yield None, source, first
            else:
                pieces = data.split(b"\n")
                if pieces[-1] == b"":
                    pieces.pop()
                for offset, line in enumerate(pieces):
                    yield line, source, first + offset
        for seq, index in held.row_places():
            yield self._lines.get(("rows", seq, index)), self._backend.path(commit_name(seq)), index + 2

    def claims(self, rollout_id: str) -> list[Claim]:
        """The rollout's claims not released yet (live or abandoned)."""
        held = self._held.get(rollout_id)
        if held is None:
            return []
        out = []
        trust = self._backend.trust_mtime
        for claim_id, (seq, index) in held.claims.items():
            body = self._lines.get(("claims", seq, index))
            out.append(read_claim(claim_id, body, self._mtimes.get(seq), trust_mtime=trust))
        return out

    def claim_entry(self, seq: int, index: int) -> tuple[bytes, float | None]:
        """An open claim's body as committed (entry ``index`` of claims commit ``seq``) and the time
        its commit was written, by the store's clock where it keeps one (what it is judged by)."""
        return self._lines.get(("claims", seq, index)) or b"", self._mtimes.get(seq)

    def all_claims(self) -> dict[str, list[Claim]]:
        out = {}
        for rollout_id in self._held:
            found = self.claims(rollout_id)
            if found:
                out[rollout_id] = found
        return out


class JournalReadBatch(ReadBatch):
    """A batch fetched from the other layouts, with what the journal holds for it added."""

    def __init__(self, base: ReadBatch, reader: JournalReader, rollout_ids: Collection[str]) -> None:
        self._base = base
        self._reader = reader
        self._ids = list(rollout_ids)
        self._view = reader.view(self._ids)

    def found(self, rollout_id: str) -> bool:
        return self._view.found(rollout_id) or self._base.found(rollout_id)

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        snap = self._base.snapshot(rollout_id)
        snap.holes.extend(self._view.holes)
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
