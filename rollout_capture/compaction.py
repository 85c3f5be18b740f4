"""Compacting a capture root's journal once its run is over (spec 2, extension; issue 48): every
commit becomes a few large parts and a manifest (a generation, :mod:`.journal.compacted`), read
in a handful of requests, then the commits it replaced are removed.

A compaction reads the journal as a reader does (the newest generation, then every commit from its
floors on, filling holes older than the grace), refuses a journal that may still be written (a
commit younger than the quiet period, a live claim, a hole younger than the grace), writes what
the reader holds (each rollout's rows, byte for byte and in order; the open claims; the releases
read early) as generation ``g + 1``, and creates its manifest put-if-absent, last. Only then, and
:data:`~.journal.compacted.DELETE_AFTER_S` later, are the commits below its floors and the older
generations removed (by a later compaction when this one was stopped before, or told to leave
them).

A crash at any point loses and doubles nothing: before the manifest exists nothing a reader reads
has changed (parts without a manifest are litter, removed by the next compaction of that
generation); once it exists, readers read it and the commits at or above its floors, and the
commits below them are ignored until removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Literal

import orjson

from rollout_capture.backends.base import Backend
from rollout_capture.claims import partition
from rollout_capture.journal import FORMAT as JOURNAL_FORMAT
from rollout_capture.journal import STREAMS, JournalReader, Stream
from rollout_capture.journal.clock import REAL_CLOCK, Clock
from rollout_capture.journal.compacted import (
    DELETE_AFTER_S,
    PART_BYTES,
    PART_ENTRIES,
    QUIET_S,
    Manifest,
    OpenClaim,
    Part,
    Placed,
    floors_of,
    manifest_name,
    part_name,
    read_manifest,
)
from rollout_capture.journal.reader import JournalView
from rollout_capture.names import (
    JOURNAL_DIR,
    MANIFEST_NAME,
    Entry,
    compacted_name,
    generation_dir,
    journal_commit,
    journal_numbers,
)

logger = logging.getLogger(__name__)

_VIEW_ROLLOUTS = 1000  # rollouts read at once while writing the parts

Status = Literal["compacted", "already compacted", "no journal", "refused", "raced"]


@dataclass(slots=True)
class Compaction:
    """What one compaction of a capture root did (or why it did not)."""

    capture_dir: str
    status: Status
    reason: str | None = None
    """Why it was refused (a writer may still be running) or lost a race."""
    generation: int | None = None
    floors: dict[Stream, int] = field(default_factory=dict)
    commits: dict[Stream, int] = field(default_factory=dict)
    """Commits of each stream read into the generation (from the floors of the one before)."""
    rollouts: int = 0
    rows: int = 0
    parts: int = 0
    part_bytes: int = 0
    objects_before: int = 0
    """Objects of the journal before (commits, parts, manifests)."""
    objects_after: int | None = None
    """Objects of the journal after the removal (None: not removed yet)."""
    removed: int = 0
    pending_removal: int = 0
    """Objects the generation replaced, left for a later compaction to remove."""

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


class _Refused(Exception):
    """The journal may still be written: not compacted now (``after``: seconds until its quiet
    period is over, when only the age of its last commit stands in the way)."""

    def __init__(self, message: str, after: float | None = None) -> None:
        super().__init__(message)
        self.after = after


def _census(backend: Backend) -> list[tuple[str, Entry]]:
    return backend.list_under(JOURNAL_DIR)


def compact_root(
    backend: Backend,
    *,
    quiet_s: float = QUIET_S,
    part_bytes: int = PART_BYTES,
    remove_after_s: float | None = DELETE_AFTER_S,
    wait_quiet: bool = False,
    now: Callable[[], float] | None = None,
    sleep: Callable[[float], None] | None = None,
    clock: Clock = REAL_CLOCK,
) -> Compaction:
    """Compact the journal of one capture root (see the module docstring).

    ``quiet_s``: refused while a commit is younger than this by the store's clock (or any claim is
    live, or a hole is younger than the grace); ``wait_quiet``: when only the last commit's age
    stands in the way, wait for the quiet period once and look again (a run just finished).
    ``remove_after_s``: the replaced objects are removed this long after the manifest (waited for
    here); ``None`` leaves them to the next compaction (which finds the journal compacted and
    removes them). ``clock``: its reader's and, unless ``now`` and ``sleep`` are given, the
    compaction's (a simulation's, in tests).
    """
    now = clock.time if now is None else now
    sleep = clock.sleep if sleep is None else sleep
    backend.require_put_if_absent()
    url = backend.store_url()
    census = _census(backend)
    listed = journal_numbers(name for name, _ in census)
    result = Compaction(url, "no journal", objects_before=len(census))
    if not any(listed.values()):
        return result
    reader = JournalReader(backend, clock=clock)
    reader.refresh(listed)
    held = reader.generation
    floors: dict[Stream, int] = {"rows": reader.tail("rows"), "claims": reader.tail("claims")}
    base = floors_of(held)
    result.commits = {stream: floors[stream] - base[stream] for stream in STREAMS}
    found = reader.open_claims()
    claims_view = reader.view({rollout_id for rollout_id, _, _, _ in found})  # read once, used twice
    try:
        _check_quiet(reader, claims_view, census, base, quiet_s, now())
    except _Refused as exc:
        if wait_quiet and exc.after is not None:
            sleep(exc.after)
            return compact_root(
                backend,
                quiet_s=quiet_s,
                part_bytes=part_bytes,
                remove_after_s=remove_after_s,
                now=now,
                sleep=sleep,
                clock=clock,
            )
        result.status, result.reason = "refused", f"{url} may still be written: {exc}"
        return result
    if held is not None and floors == base:
        result.status, result.generation, result.floors = "already compacted", held.generation, floors
        result.parts = len(held.parts)
        if remove_after_s is not None:
            _remove(backend, held, result, remove_after_s, now, sleep, census=census)
        return result
    generation = 1 if held is None else held.generation + 1
    nonce = os.urandom(8).hex()
    parts, rows = _write_parts(backend, reader, generation, nonce, part_bytes)
    claims = _open_claims(found, claims_view)
    manifest = Manifest(
        generation=generation,
        floors=floors,
        parts=tuple(parts),
        claims=tuple(claims),
        released=tuple(sorted(reader.early_releases())),
        nonce=nonce,
        stats={
            "commits": result.commits,
            "rows": rows,
            "rollouts": (rollouts := sum(len(p.rollouts) for p in parts)),
            "bytes": (part_bytes_total := sum(p.size for p in parts)),
            "compactor": f"{socket.gethostname()}-{os.getpid()}",
            "created_at": now(),
        },
    )
    result.generation, result.floors = generation, floors
    result.rollouts, result.rows = rollouts, rows
    result.parts, result.part_bytes = len(parts), part_bytes_total
    if not _create_manifest(backend, manifest):
        _drop_parts(backend, generation, parts)
        result.status, result.reason = "raced", f"generation {generation} was created by another compaction"
        return result
    result.status = "compacted"
    logger.info(
        "compacted %s: %d rows of %d rollouts from %d + %d commits into %d part(s), generation %d",
        url,
        rows,
        result.rollouts,
        result.commits["rows"],
        result.commits["claims"],
        len(parts),
        generation,
    )
    if remove_after_s is not None:
        _remove(backend, manifest, result, remove_after_s, now, sleep)
    else:
        result.pending_removal = len(_superseded(_census(backend), manifest))
    return result


def _check_quiet(
    reader: JournalReader,
    claims_view: JournalView,
    census: list[tuple[str, Entry]],
    base: dict[Stream, int],
    quiet_s: float,
    moment: float,
) -> None:
    """Refuse a journal a writer may still write: a hole younger than the grace, a live claim, or
    a commit (at or above the last generation's floors) younger than ``quiet_s``."""
    if reader.holes:
        raise _Refused(f"a writer may be mid-commit: {reader.holes[0]}")
    claims = claims_view.all_claims()
    live = [claim for held in claims.values() for claim in partition(held, moment)[0]]
    if live:
        raise _Refused(
            f"{len(live)} claim(s) are live (a call in flight: its row is still to come); compact once "
            "its writers have stopped"
        )
    if quiet_s <= 0:
        return
    newest: float | None = None
    for relative, entry in census:
        commit = journal_commit(relative)
        if commit is None or commit[1] < base[commit[0]]:  # type: ignore[index]
            continue
        if entry.mtime is None:
            raise _Refused(f"the store gives no time for {entry.path}: its quiet cannot be told")
        newest = entry.mtime if newest is None else max(newest, entry.mtime)
    if newest is not None and moment - newest < quiet_s:
        raise _Refused(
            f"its journal was written {moment - newest:.0f} s ago: a writer may still be running "
            f"(compacted once it has been quiet for {quiet_s:.0f} s)",
            after=quiet_s - (moment - newest),
        )


def _open_claims(found: Sequence[tuple[str, str, int, int]], view: JournalView) -> list[OpenClaim]:
    """The claims open at the floors (``found``, read in ``view``), with the time their commit was
    written (they are judged by it)."""
    out = []
    for rollout_id, claim_id, seq, index in found:
        body, mtime = view.claim_entry(seq, index)
        out.append(OpenClaim(rollout_id, claim_id, seq, index, mtime, body))
    return out


class _PartWriter:
    """One part being written: its rows' lines in a temporary file, its entries and placements."""

    def __init__(self, folder: str) -> None:
        self.body: IO[bytes] = tempfile.NamedTemporaryFile(dir=folder, delete=False)  # noqa: SIM115
        self.size = 0
        self.entries: list[list[str]] = []
        self.placed: list[tuple[str, int, int, int]] = []  # rollout, body offset, length, first entry

    def add(self, rollout_id: str, lines: Sequence[bytes]) -> None:
        data = b"".join(line + b"\n" for line in lines)
        self.placed.append((rollout_id, self.size, len(data), len(self.entries)))
        self.body.write(data)
        self.size += len(data)
        self.entries.extend(["row", rollout_id] for _ in lines)

    def finish(self, generation: int, nonce: str, name: str, folder: str) -> tuple[str, Part]:
        """The part's file (its header, then its rows) and what the manifest says of it."""
        header = (
            orjson.dumps(
                {
                    "journal": JOURNAL_FORMAT,
                    "writer": "compaction",
                    "nonce": nonce,
                    "floor": 0,
                    "compacted": generation,
                    "entries": self.entries,
                }
            )
            + b"\n"
        )
        self.body.close()
        path = os.path.join(folder, name)
        with open(path, "wb") as out, open(self.body.name, "rb") as rows:
            out.write(header)
            shutil.copyfileobj(rows, out, 1 << 20)
        os.unlink(self.body.name)
        placed = tuple(
            Placed(rollout_id, len(header) + offset, length, first + 2)
            for rollout_id, offset, length, first in self.placed
        )
        return path, Part(name, len(header) + self.size, placed)


def _write_parts(
    backend: Backend, reader: JournalReader, generation: int, nonce: str, part_bytes: int
) -> tuple[list[Part], int]:
    """Every rollout's rows as the reader holds them, in parts of about ``part_bytes``, uploaded."""
    parts: list[Part] = []
    rows = 0
    order = reader.in_order()
    with tempfile.TemporaryDirectory(prefix="rollout-capture-compaction-") as folder:
        current: _PartWriter | None = None

        def upload(part: _PartWriter) -> None:
            name = part_name(len(parts), nonce)
            path, described = part.finish(generation, nonce, name, folder)
            backend.upload(backend.path(f"{generation_dir(generation)}/{name}"), path)
            os.unlink(path)
            parts.append(described)

        try:
            for start in range(0, len(order), _VIEW_ROLLOUTS):
                chunk = order[start : start + _VIEW_ROLLOUTS]
                view = reader.view(chunk)
                for rollout_id in chunk:
                    lines = []
                    for line, source, number in view.lines_of(rollout_id):
                        if line is None:
                            raise OSError(f"{source}:{number} could not be read while compacting")
                        lines.append(line)
                    if not lines:
                        continue
                    if (
                        current is not None
                        and current.entries
                        and (current.size >= part_bytes or len(current.entries) + len(lines) > PART_ENTRIES)
                    ):
                        upload(current)
                        current = None
                    if current is None:
                        current = _PartWriter(folder)
                    current.add(rollout_id, lines)
                    rows += len(lines)
            if current is not None:
                upload(current)
                current = None
        except BaseException:
            if current is not None:
                current.body.close()
            _drop_parts(backend, generation, parts)
            raise
    return parts, rows


def _create_manifest(backend: Backend, manifest: Manifest) -> bool:
    """Create the manifest put-if-absent: False when another compaction's is there."""
    path = backend.path(manifest_name(manifest.generation))
    try:
        backend.create(path, manifest.encode())
    except FileExistsError:
        found = read_manifest(backend, manifest.generation)
        return found is not None and found.nonce == manifest.nonce  # ours, landed before a retry
    return True


def _drop_parts(backend: Backend, generation: int, parts: Sequence[Part]) -> None:
    with contextlib.suppress(Exception):  # litter otherwise: the next compaction removes it
        backend.remove([backend.path(f"{generation_dir(generation)}/{part.name}") for part in parts])


def _superseded(census: list[tuple[str, Entry]], manifest: Manifest) -> list[Entry]:
    """What a generation replaced: commits below its floors, older generations, and files of its
    own folder its manifest does not name (a stopped or beaten compaction's parts)."""
    named = {part.name for part in manifest.parts}
    out = []
    for relative, entry in census:
        commit = journal_commit(relative)
        if commit is not None:
            if commit[1] < manifest.floors[commit[0]]:  # type: ignore[index]
                out.append(entry)
            continue
        compacted = compacted_name(relative)
        if compacted is None:
            continue
        generation, name = compacted
        if generation < manifest.generation or (
            generation == manifest.generation and name not in named and name != MANIFEST_NAME
        ):
            out.append(entry)
    return out


def _remove(
    backend: Backend,
    manifest: Manifest,
    result: Compaction,
    remove_after_s: float,
    now: Callable[[], float],
    sleep: Callable[[float], None],
    census: list[tuple[str, Entry]] | None = None,
) -> None:
    """Remove what ``manifest`` replaced, once it is ``remove_after_s`` old by the store's clock."""
    census = _census(backend) if census is None else census
    path = backend.path(manifest_name(manifest.generation))
    written = next((entry.mtime for _, entry in census if entry.path == path), None)
    age = 0.0 if written is None else now() - written
    if age < remove_after_s:
        sleep(remove_after_s - age)
        census = _census(backend)
    doomed = _superseded(census, manifest)
    backend.remove([entry.path for entry in doomed])
    result.removed = len(doomed)
    result.pending_removal = 0
    result.objects_after = len(census) - len(doomed)
