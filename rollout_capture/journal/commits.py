"""The journal's format and protocol constants: what a commit is on the store, and what every
writer and reader of one capture root must agree on (numbering, holes, the grace before a hole is
filled). Written by :mod:`.writer`, read by :mod:`.reader`; nothing here does I/O."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from rollout_capture.claims import Claim, claim_body
from rollout_capture.identity import validate_rollout_id
from rollout_capture.names import JOURNAL_DIR

SEQ_WIDTH = 12
FORMAT = 1
Op = Literal["claim", "row", "release", "clear"]
_OPS = frozenset({"claim", "row", "release", "clear"})

MAX_COMMIT_ENTRIES = 1024
"""Entries in one commit at most (a larger group waits for the next)."""
MAX_COMMIT_BYTES = 8 << 20
"""Bytes of one commit at most, unless a single submission is larger."""
LOOK_AHEAD = 4
"""Commits a writer keeps in flight per stream at most, so how far above a missing number a dead
writer's commits can stand: writers look that far above a number before putting a commit there,
readers that far past a stream's stop for a hole."""
HOLE_GRACE_S = 5.0
"""How long a missing number below an existing commit may stay missing before a writer or reader
fills it with an empty tombstone (a writer in flight takes a round trip; one that died, forever).
Filling early is safe (the late put is renumbered), only wasteful."""


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


def encode_commit(
    writer_id: str,
    nonce: str,
    headers: list[list[str]],
    lines: list[bytes],
    *,
    floor: int = 0,
    tombstone: bool = False,
) -> bytes:
    """A commit's bytes. ``floor``: every number below it existed when this was written (a
    writer joining learns from it how far down it need not look); a tombstone is marked so."""
    head: dict[str, Any] = {"journal": FORMAT, "writer": writer_id, "nonce": nonce, "floor": floor}
    if tombstone:
        head["tombstone"] = True
    head["entries"] = headers
    return b"\n".join([orjson.dumps(head), *lines]) + b"\n"


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
    floor: int | None = None

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
    floor = head.get("floor")
    return Commit(
        seq,
        nonce if isinstance(nonce, str) else "",
        headers,
        body,
        spans,
        floor if isinstance(floor, int) and not isinstance(floor, bool) and floor >= 0 else None,
    )


def nonce_of(body: bytes) -> str | None:
    try:
        return decode_commit(0, body).nonce
    except BadCommit:
        return None


def floor_of(seq: int, body: bytes | None) -> int:
    """Below which number every commit existed when ``seq`` was written: its header's ``floor``;
    ``seq`` for a header without one (a one-in-flight writer, which created ``seq`` only once
    ``seq - 1`` existed); nothing known (0) for a body that cannot be read."""
    if body is None:
        return 0
    try:
        commit = decode_commit(seq, body)
    except BadCommit:
        return 0
    return seq if commit.floor is None else min(commit.floor, seq)


def tombstone_body(writer_id: str, floor: int) -> bytes:
    """An empty commit filling a number a writer left missing below later commits."""
    return encode_commit(writer_id, os.urandom(16).hex(), [], [], floor=floor, tombstone=True)
