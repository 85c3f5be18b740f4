"""What a listing of a capture root says each rollout holds.

One listing answers every question a reader has (which files, their sizes, claims and
markers), so a batch of rollouts costs one flat listing plus one GET per file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout_capture.layout import parse_capture_name


@dataclass(frozen=True, slots=True)
class Entry:
    """One file: full path as the filesystem names it, size, modification time (epoch s)."""

    path: str
    size: int | None = None
    mtime: float | None = None


@dataclass(slots=True)
class RolloutListing:
    """Everything one store holds for one rollout, by part."""

    jsonl: Entry | None = None
    marker: Entry | None = None
    objects: list[tuple[int, Entry]] = field(default_factory=list)
    claims: list[tuple[str, Entry]] = field(default_factory=list)

    @property
    def found(self) -> bool:
        """True when the store holds anything for the rollout (rows, objects, marker or claims)."""
        return bool(self.jsonl or self.marker or self.objects or self.claims)

    def paths(self) -> list[str]:
        """Every path of the rollout, for clearing."""
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
