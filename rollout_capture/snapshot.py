"""Everything a store holds for some rollouts at one moment: rows, damage, marker, claims.

Built from a listing and the bytes read for it, so a batch can be fetched in one
concurrent pass and parsed one rollout at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_capture.claims import Claim, read_claim
from rollout_capture.names import RolloutListing
from rollout_capture.rows import Damage, ParsedRows, Row, add_jsonl, add_object, new_parsed_rows


@dataclass(slots=True)
class RolloutSnapshot:
    """One rollout's capture in one store."""

    rollout_id: str
    found: bool
    parsed: ParsedRows = field(default_factory=new_parsed_rows)
    incomplete: bool = False
    claims: list[Claim] = field(default_factory=list)
    holes: list[str] = field(default_factory=list)  # journal holes its reader could not fill (pending)

    @property
    def rows(self) -> list[tuple[int, Row]]:
        return self.parsed.rows

    @property
    def damaged(self) -> list[Damage]:
        return self.parsed.damaged

    def record_rows(self, include_payloads: bool) -> tuple[list[tuple[int, Any]], list[Damage]]:
        """``(rows, damaged)`` to build call records from (typed without payloads, see rows)."""
        return self.parsed.record_rows(include_payloads)


def listed_paths(listing: RolloutListing, *, rows: bool = True) -> list[str]:
    """The files of a listing that a snapshot reads: rows (unless ``rows=False``), then claims."""
    paths = []
    if rows:
        if listing.jsonl is not None:
            paths.append(listing.jsonl.path)
        paths.extend(entry.path for _, entry in listing.objects)
    paths.extend(entry.path for _, entry in listing.claims)
    return paths


def parse_snapshot(
    rollout_id: str, listing: RolloutListing, bodies: Mapping[str, bytes | None], *, trust_mtime: bool
) -> RolloutSnapshot:
    """Build a rollout's snapshot from its listing and the bytes read for it."""
    snap = RolloutSnapshot(rollout_id, found=listing.found, incomplete=listing.marker is not None)
    if listing.jsonl is not None:
        data = bodies.get(listing.jsonl.path)
        if data:
            add_jsonl(snap.parsed, data, listing.jsonl.path)
    for _, entry in listing.objects:
        data = bodies.get(entry.path)
        if data is not None:  # None: deleted between listing and reading, not a row any more
            add_object(snap.parsed, data, entry.path)
    snap.claims = _claims(listing, bodies, trust_mtime)
    return snap


def _claims(listing: RolloutListing, bodies: Mapping[str, bytes | None], trust_mtime: bool) -> list[Claim]:
    return [
        read_claim(claim_id, body, entry.mtime, trust_mtime=trust_mtime)
        for claim_id, entry in listing.claims
        if (body := bodies.get(entry.path)) is not None  # None: released between listing and reading
    ]


def claims_of(
    listings: Mapping[str, RolloutListing], bodies: Mapping[str, bytes | None], *, trust_mtime: bool
) -> dict[str, list[Claim]]:
    """The claims of each listed rollout that has any, from the bytes read for them."""
    out: dict[str, list[Claim]] = {}
    for rollout_id, listing in listings.items():
        found = _claims(listing, bodies, trust_mtime)
        if found:
            out[rollout_id] = found
    return out
