"""Names under a capture root (spec section 2), in both directions, and what a listing says.

Every name is built from a validated rollout id, and listings are parsed back with
exact suffix matching, so rollout ``1-1`` never claims the files of ``1-10`` or ``1-1-a1``.
One listing answers every question a reader has (which files, their sizes, claims and
markers), so a batch of rollouts costs one flat listing plus one GET per file.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from rollout_capture.claims import Claim
from rollout_capture.identity import validate_rollout_id

JSONL_SUFFIX = ".capture.jsonl"
MARKER_SUFFIX = ".capture.incomplete"
OBJECTS_SUFFIX = ".capture"
CLAIMS_SUFFIX = ".capture.claims"
SEQ_WIDTH = 12
JOURNAL_DIR = "_journal"
"""The folder of the journal layout's commits (``rollout_capture.journal``): shared by all rollouts."""
COMPACT_DIR = f"{JOURNAL_DIR}/compact"
"""The folder of the journal's compacted generations (``rollout_capture.journal.compacted``): each
``<gen>/`` holds parts (``part-NNNNN-<nonce>.jsonl``) and, once whole, its ``manifest.json``."""
MANIFEST_NAME = "manifest.json"
COMPACTED = "compacted"
"""The key under which a root's listing gives the compacted generations with a manifest (beside the
journal's streams, ``rows`` and ``claims``)."""
CLAIMS_LOG_DIR = "_claims"
"""The folder of the producers' claims logs on a local disk (``rollout_capture.claims_log``)."""
PROBE_PREFIX = "_probe-"
"""A producer's startup probe (created and removed at once): never a rollout's name, since a
rollout id starts with a letter or digit, so no reader takes it for a capture."""


def probe_name() -> str:
    """A fresh probe name under the root, unique to this host, process and moment."""
    return f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{os.urandom(8).hex()}"


def jsonl_name(rollout_id: str) -> str:
    """The JSONL-layout file of a rollout."""
    return validate_rollout_id(rollout_id) + JSONL_SUFFIX


def marker_name(rollout_id: str) -> str:
    """The empty marker saying some row of the rollout could not be written."""
    return validate_rollout_id(rollout_id) + MARKER_SUFFIX


def objects_dir(rollout_id: str) -> str:
    """The folder holding the object-layout rows of a rollout."""
    return validate_rollout_id(rollout_id) + OBJECTS_SUFFIX


def object_name(rollout_id: str, seq: int) -> str:
    """The object holding row ``seq`` of a rollout."""
    return f"{objects_dir(rollout_id)}/{seq:0{SEQ_WIDTH}d}.json"


def claims_dir(rollout_id: str) -> str:
    """The folder holding the claims of a rollout."""
    return validate_rollout_id(rollout_id) + CLAIMS_SUFFIX


def claim_name(rollout_id: str, claim_id: str) -> str:
    """The file of one claim."""
    return f"{claims_dir(rollout_id)}/{validate_rollout_id(claim_id)}.json"


Kind = Literal["jsonl", "marker", "object", "claim"]


@dataclass(frozen=True, slots=True)
class CaptureName:
    """What one relative name under a capture root is: whose, and which part."""

    rollout_id: str
    kind: Kind
    seq: int | None = None
    claim_id: str | None = None


def _valid(rollout_id: str) -> bool:
    try:
        validate_rollout_id(rollout_id)
    except ValueError:
        return False
    return True


def parse_capture_name(relative: str) -> CaptureName | None:
    """Classify a name relative to the capture root; ``None`` for anything foreign."""
    head, sep, tail = relative.partition("/")
    if not sep:
        for suffix, kind in ((JSONL_SUFFIX, "jsonl"), (MARKER_SUFFIX, "marker")):
            if head.endswith(suffix):
                rollout_id = head[: -len(suffix)]
                return CaptureName(rollout_id, kind) if _valid(rollout_id) else None  # type: ignore[arg-type]
        return None
    if "/" in tail or not tail.endswith(".json"):
        return None
    stem = tail[: -len(".json")]
    if head.endswith(CLAIMS_SUFFIX):
        rollout_id = head[: -len(CLAIMS_SUFFIX)]
        if _valid(rollout_id) and _valid(stem):
            return CaptureName(rollout_id, "claim", claim_id=stem)
        return None
    if head.endswith(OBJECTS_SUFFIX):
        rollout_id = head[: -len(OBJECTS_SUFFIX)]
        if _valid(rollout_id) and len(stem) == SEQ_WIDTH and stem.isdigit():
            return CaptureName(rollout_id, "object", seq=int(stem))
    return None


@dataclass(frozen=True, slots=True)
class Entry:
    """One file: full path as the filesystem names it, size, modification time (epoch s)."""

    path: str
    size: int | None = None
    mtime: float | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """An entry of a rollout that is not read: a symbolic link, never followed inside a root
    (it could lead anywhere). Readers count it as one damaged row, naming it."""

    path: str
    reason: str


@dataclass(slots=True)
class RolloutListing:
    """Everything one store holds for one rollout, by part."""

    jsonl: Entry | None = None
    marker: Entry | None = None
    objects: list[tuple[int, Entry]] = field(default_factory=list)
    claims: list[tuple[str, Entry]] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    logged_claims: list[Claim] = field(default_factory=list)
    """Open claims of the rollout in the claims logs of a local disk (no file of their own)."""

    @property
    def found(self) -> bool:
        """True when the store holds anything for the rollout (rows, objects, marker, claims, refused)."""
        return bool(
            self.jsonl or self.marker or self.objects or self.claims or self.refused or self.logged_claims
        )

    def paths(self) -> list[str]:
        """Every readable path of the rollout, for clearing."""
        out = [e.path for e in (self.jsonl, self.marker) if e is not None]
        out.extend(e.path for _, e in self.objects)
        out.extend(e.path for _, e in self.claims)
        return out

    def sort(self) -> None:
        """Objects by seq, claims by id: listings need not arrive ordered."""
        self.objects.sort(key=lambda item: item[0])
        self.claims.sort(key=lambda item: item[0])


def group_entries(
    entries: Iterable[tuple[str, Entry]], wanted: set[str] | None = None
) -> dict[str, RolloutListing]:
    """Group ``(relative name, entry)`` pairs by rollout; foreign names are ignored.

    ``wanted`` limits the result to those rollout ids (a batch), without which a listing
    of a shared root would hold every rollout in it.
    """
    out: dict[str, RolloutListing] = {}
    for relative, entry in entries:
        name = parse_capture_name(relative)
        if name is None or (wanted is not None and name.rollout_id not in wanted):
            continue
        listing = out.get(name.rollout_id)
        if listing is None:
            listing = out[name.rollout_id] = RolloutListing()
        if name.kind == "jsonl":
            listing.jsonl = entry
        elif name.kind == "marker":
            listing.marker = entry
        elif name.kind == "object":
            assert name.seq is not None
            listing.objects.append((name.seq, entry))
        else:
            assert name.claim_id is not None
            listing.claims.append((name.claim_id, entry))
    for listing in out.values():
        listing.sort()
    return out


def journal_commit(relative: str) -> tuple[str, int] | None:
    """``(stream, number)`` of a journal commit's name relative to the root (``_journal/7.jsonl``
    is the rows stream's, ``_journal/claims/7.jsonl`` the claims stream's); ``None`` for any other."""
    folder, _, name = relative.rpartition("/")
    stream = {JOURNAL_DIR: "rows", f"{JOURNAL_DIR}/claims": "claims"}.get(folder)
    stem = name.removesuffix(".jsonl")
    if stream is None or len(stem) != SEQ_WIDTH or not stem.isdigit() or stem == name:
        return None
    return stream, int(stem)


def generation_dir(generation: int) -> str:
    """The folder of one compacted generation relative to the root."""
    return f"{COMPACT_DIR}/{generation:0{SEQ_WIDTH}d}"


def compacted_name(relative: str) -> tuple[int, str] | None:
    """``(generation, file name)`` of a name under the compacted generations' folder (a part or a
    manifest, relative to the root); ``None`` for any other."""
    folder, _, name = relative.rpartition("/")
    head, _, stem = folder.rpartition("/")
    if head != COMPACT_DIR or len(stem) != SEQ_WIDTH or not stem.isdigit() or not name:
        return None
    return int(stem), name


def journal_numbers(relative_names: Iterable[str]) -> dict[str, list[int]]:
    """What a listing of the root (names relative to it) shows of the journal: each stream's commit
    numbers (``rows``, ``claims``), and under :data:`COMPACTED` the generations with a manifest."""
    out: dict[str, list[int]] = {"rows": [], "claims": [], COMPACTED: []}
    for relative in relative_names:
        if not relative.startswith(JOURNAL_DIR):
            continue
        if (commit := journal_commit(relative)) is not None:
            out[commit[0]].append(commit[1])
        elif (compacted := compacted_name(relative)) is not None and compacted[1] == MANIFEST_NAME:
            out[COMPACTED].append(compacted[0])
    return out


_ROOT_SUFFIXES = (".capture.jsonl", ".capture.incomplete", ".capture.claims", ".capture")


def capture_ids_from_root_entries(names: Iterable[str]) -> set[str]:
    """The rollout ids that the entries directly under a local capture root belong to.

    One ``os.scandir`` of the root gives ``<id>.capture.jsonl``, ``<id>.capture.incomplete``,
    ``<id>.capture.claims`` and ``<id>.capture`` (the objects folder); other names are ignored.
    """
    out: set[str] = set()
    for name in names:
        for suffix in _ROOT_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                rollout_id = name[: -len(suffix)]
                if parse_capture_name(rollout_id + ".capture.jsonl") is not None:
                    out.add(rollout_id)
                break
    return out
