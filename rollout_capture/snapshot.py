"""Everything a store holds for some rollouts at one moment: rows, damage, marker, claims.

All the files of all the rollouts asked for are read in one concurrent pass, so a
batch of rollouts on an object store costs its GETs in parallel, not in sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rollout_capture.backends import Backend
from rollout_capture.claims import Claim, read_claim
from rollout_capture.listing import RolloutListing
from rollout_capture.rows import Damage, ParsedRows, Row, add_jsonl, add_object, new_parsed_rows


@dataclass(slots=True)
class RolloutSnapshot:
    """One rollout's capture in one store."""

    rollout_id: str
    found: bool
    parsed: ParsedRows = field(default_factory=new_parsed_rows)
    incomplete: bool = False
    claims: list[Claim] = field(default_factory=list)

    @property
    def rows(self) -> list[tuple[int, Row]]:
        return self.parsed.rows

    @property
    def damaged(self) -> list[Damage]:
        return self.parsed.damaged

    def live_claims(self, now: float) -> list[Claim]:
        return [c for c in self.claims if c.is_live(now)]

    def expired_claims(self, now: float) -> list[Claim]:
        return [c for c in self.claims if not c.is_live(now)]


def read_snapshots(
    backend: Backend, listings: Mapping[str, RolloutListing], *, with_claims: bool = True
) -> dict[str, RolloutSnapshot]:
    """Read every listed file of the given rollouts and parse them."""
    paths: list[str] = []
    for listing in listings.values():
        if listing.jsonl is not None:
            paths.append(listing.jsonl.path)
        paths.extend(entry.path for _, entry in listing.objects)
        if with_claims:
            paths.extend(entry.path for _, entry in listing.claims)
    bodies = dict(zip(paths, backend.read_many(paths), strict=True))

    out: dict[str, RolloutSnapshot] = {}
    for rollout_id, listing in listings.items():
        snap = RolloutSnapshot(rollout_id, found=listing.found, incomplete=listing.marker is not None)
        if listing.jsonl is not None:
            data = bodies[listing.jsonl.path]
            if data:
                add_jsonl(snap.parsed, data, listing.jsonl.path)
        for _, entry in listing.objects:
            data = bodies[entry.path]
            if data is None:  # deleted between listing and reading: not a row any more
                continue
            add_object(snap.parsed, data, entry.path)
        if with_claims:
            for claim_id, entry in listing.claims:
                body = bodies[entry.path]
                if body is None:  # released between listing and reading
                    continue
                snap.claims.append(read_claim(claim_id, body, entry.mtime, trust_mtime=backend.trust_mtime))
        out[rollout_id] = snap
    return out
