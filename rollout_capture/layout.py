"""Names under a capture root (spec section 2), in both directions.

Every name is built from a validated rollout id, and listings are parsed back with
exact suffix matching, so rollout ``1-1`` never claims the files of ``1-10`` or ``1-1-a1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollout_capture.identity import validate_rollout_id

JSONL_SUFFIX = ".capture.jsonl"
MARKER_SUFFIX = ".capture.incomplete"
OBJECTS_SUFFIX = ".capture"
CLAIMS_SUFFIX = ".capture.claims"
SEQ_WIDTH = 12


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
