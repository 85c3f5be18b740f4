"""A compacted journal (spec 2, extension): a root's journal below two *floors* (one a stream) as
a few large objects, so a finished run costs a handful of requests to read and a few objects to
keep, not one a commit.

A *generation* ``g`` is the folder ``_journal/compact/{g:012d}/``: parts
``part-NNNNN-<nonce>.jsonl`` (uploaded whole, names of their own: no two compactors ever write one
object) and, created put-if-absent and last, ``manifest.json``. A part is in the commit format (a
header naming each entry, then a line each): row entries only, each row's line exactly as it was
committed, grouped by rollout, a rollout's rows in their order (commit, then line). The manifest
says where each rollout's rows are (part, offset, length, the line of its first row), the floors,
the claims still open at the floors (with the time their claims commit was written, by which
they are judged) and the releases read before their claim. So a generation is exactly what a
reader of the journal holds once it has read every commit below the floors: readers load it in
place of those commits, then read the commits at or above the floors as ever.

Invariants (what makes this safe beside writers, readers and crashes; contract section 2):

- a generation without a manifest does not exist for readers (a crash left it: its parts are
  litter the next compaction removes); generation ``g + 1``'s manifest is created only by a
  compactor that read generation ``g`` (or none) and every commit from its floors to the new ones;
- commits below a generation's floors, and older generations, are removed only once its
  manifest exists (after :data:`DELETE_AFTER_S`, so a writer that looked for a generation just
  before it appeared has found its number above the floors meanwhile); readers never read a
  commit below the floors of the generation they hold, and read either commits or a generation,
  never both, so no row is read twice or missed;
- writers never take a number below the newest generation's floors: a writer looks the floors
  up with the tail (``rollout_capture.layouts.journal``), and one idle for
  ``writer.RELOOK_IDLE_S`` looks the tail up again before its next commit; a root is compacted
  only when no commit is younger than the quiet period and no claim is live, longer than that.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_capture.backends.base import Backend
from rollout_capture.journal.commits import Stream
from rollout_capture.names import COMPACT_DIR, MANIFEST_NAME, generation_dir

logger = logging.getLogger(__name__)

FORMAT = 1
PART_BYTES = 128 << 20
"""A part's size at most (unless one rollout's rows alone are larger): large enough that a run is
a handful of objects, small enough that a reader fetches one in a few ranged GETs."""
PART_ENTRIES = 1 << 20
"""Rows in one part at most (a reader indexes a part's header in memory)."""
QUIET_S = 120.0
"""A root is compacted only once no commit of it is younger than this by the store's clock (and
no claim of it is live): every writer of it has been idle longer than :data:`WRITER_RELOOK_S`, and
every reader refreshing more often than :data:`CHECK_AFTER_S` has read its last commit."""
WRITER_RELOOK_S = 30.0
"""A journal writer idle this long looks its stream's tail (and the newest generation's floors) up
again before its next commit, so one that outlived a compaction never numbers below its floors."""
CHECK_AFTER_S = 60.0
"""A reader without a listing looks for a newer generation at the end of a refresh when its last
refresh began this long ago or more (else a commit removed under it would be younger than
:data:`QUIET_S` less the hole grace: none is). What is left between the two is the clocks'
margin: a store's, a compactor's and a reader's may disagree by up to 25 s."""
DELETE_AFTER_S = 30.0
"""How long after its manifest a generation's superseded objects (commits below its floors, older
generations) may be removed: a writer that looked for the newest generation just before this one
appeared has numbered its commit above the floors by then (a lookup is a few requests)."""


class BadManifest(ValueError):
    """A manifest that cannot be read: its generation is not used (an older one, or the commits, are)."""


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one rollout's rows are in a part: ``offset`` and ``length`` of its lines (each ending
    in a newline) and the line number (1 = the header) of its first row."""

    rollout_id: str
    offset: int
    length: int
    first_line: int


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    size: int
    rollouts: tuple[Placed, ...]


@dataclass(frozen=True, slots=True)
class OpenClaim:
    """A claim still open at the floors: where it was committed (claims commit, entry), when that
    commit was written by the store's clock (claims are judged by it there), and its body."""

    rollout_id: str
    claim_id: str
    seq: int
    index: int
    mtime: float | None
    body: bytes


@dataclass(frozen=True, slots=True)
class Manifest:
    """One generation: what a reader holds once it has read every commit below ``floors``."""

    generation: int
    floors: Mapping[Stream, int]
    parts: tuple[Part, ...]
    claims: tuple[OpenClaim, ...] = ()
    released: tuple[tuple[str, str], ...] = ()
    nonce: str = ""
    """Its compactor's: a create whose answer was lost tells its own manifest by it."""
    stats: Mapping[str, Any] = field(default_factory=dict)
    """What was compacted (commits of each stream, rows, rollouts, bytes): for people, not readers."""

    def part_path(self, backend: Backend, index: int) -> str:
        return backend.path(f"{generation_dir(self.generation)}/{self.parts[index].name}")

    def encode(self) -> bytes:
        claims = []
        for claim in self.claims:
            try:
                body: Any = orjson.loads(claim.body) if claim.body else None
            except orjson.JSONDecodeError:  # unreadable: read as such again (judged by its mtime)
                body = None
            claims.append(
                {
                    "rollout_id": claim.rollout_id,
                    "claim_id": claim.claim_id,
                    "at": [claim.seq, claim.index],
                    "mtime": claim.mtime,
                    "body": body,
                }
            )
        return orjson.dumps(
            {
                "format": FORMAT,
                "generation": self.generation,
                "floors": dict(self.floors),
                "parts": [
                    {
                        "name": part.name,
                        "size": part.size,
                        "rollouts": [[p.rollout_id, p.offset, p.length, p.first_line] for p in part.rollouts],
                    }
                    for part in self.parts
                ],
                "claims": claims,
                "released": [list(pair) for pair in self.released],
                "nonce": self.nonce,
                "stats": dict(self.stats),
            }
        )


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadManifest(f"{what} is not a count")
    return value


def decode_manifest(data: bytes) -> Manifest:
    """A manifest's bytes read back, checked (``BadManifest`` naming what is wrong)."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise BadManifest("not JSON") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise BadManifest(f"not a format-{FORMAT} manifest")
    floors = raw.get("floors")
    if not isinstance(floors, dict):
        raise BadManifest("no floors")
    parts = []
    for number, part in enumerate(raw.get("parts") or []):
        if not isinstance(part, dict) or not isinstance(part.get("name"), str) or "/" in part["name"]:
            raise BadManifest(f"part {number} is malformed")
        placed = []
        for item in part.get("rollouts") or []:
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)):
                raise BadManifest(f"a rollout of part {number} is malformed")
            placed.append(
                Placed(
                    item[0], _int(item[1], "an offset"), _int(item[2], "a length"), _int(item[3], "a line")
                )
            )
        parts.append(Part(part["name"], _int(part.get("size"), "a part's size"), tuple(placed)))
    claims = []
    for item in raw.get("claims") or []:
        at = item.get("at") if isinstance(item, dict) else None
        if not (isinstance(at, list) and len(at) == 2 and isinstance(item.get("claim_id"), str)):
            raise BadManifest("a claim is malformed")
        mtime = item.get("mtime")
        body = item.get("body")
        claims.append(
            OpenClaim(
                str(item.get("rollout_id")),
                item["claim_id"],
                _int(at[0], "a claim's commit"),
                _int(at[1], "a claim's entry"),
                float(mtime) if isinstance(mtime, (int, float)) and not isinstance(mtime, bool) else None,
                b"" if body is None else orjson.dumps(body),
            )
        )
    released = tuple(
        (str(pair[0]), str(pair[1]))
        for pair in raw.get("released") or []
        if isinstance(pair, list) and len(pair) == 2
    )
    return Manifest(
        generation=_int(raw.get("generation"), "the generation"),
        floors={
            "rows": _int(floors.get("rows"), "the rows floor"),
            "claims": _int(floors.get("claims"), "the claims floor"),
        },
        parts=tuple(parts),
        claims=tuple(claims),
        released=released,
        nonce=str(raw.get("nonce") or ""),
        stats=stats if isinstance(stats := raw.get("stats"), dict) else {},
    )


def manifest_name(generation: int) -> str:
    """The manifest of a generation, relative to the root."""
    return f"{generation_dir(generation)}/{MANIFEST_NAME}"


def part_name(index: int, nonce: str) -> str:
    """A part's file name in its generation's folder (the nonce: its compactor's own)."""
    return f"part-{index:05d}-{nonce}.jsonl"


def read_manifest(backend: Backend, generation: int) -> Manifest | None:
    """A generation's manifest, ``None`` when it has none (being written, or crashed) or is gone."""
    path = backend.path(manifest_name(generation))
    data = backend.read_many([path])[0]
    if data is None:
        return None
    manifest = decode_manifest(data)
    if manifest.generation != generation:
        raise BadManifest(f"{path} names generation {manifest.generation}")
    return manifest


def newest_manifest(backend: Backend, *, known: Manifest | None = None) -> Manifest | None:
    """The newest generation with a manifest (its folders listed now, newest first), ``known`` when
    that is the one already held (no GET); ``None`` when none has one. A manifest that cannot be
    read is logged and passed over (the one below it, or the commits)."""
    found = backend.list_names([backend.path(COMPACT_DIR)])[0]
    listed = (int(name) for name, entry in found.items() if entry.folder and name.isdigit())
    for generation in sorted(listed, reverse=True):
        if known is not None and generation == known.generation:
            return known
        try:
            manifest = read_manifest(backend, generation)
        except BadManifest as exc:
            logger.warning(
                "compacted generation %s cannot be read (%s): not used",
                backend.path(manifest_name(generation)),
                exc,
            )
            continue
        if manifest is not None:
            return manifest
    return None


def floors_of(manifest: Manifest | None) -> dict[Stream, int]:
    """The floors a generation sets (0s for none): no commit below them is read or written."""
    if manifest is None:
        return {"rows": 0, "claims": 0}
    return {"rows": int(manifest.floors["rows"]), "claims": int(manifest.floors["claims"])}
