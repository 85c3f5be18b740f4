"""Clearing captures before dispatch (spec section 9): a retry never appends onto an old attempt."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollout_capture.identity import rollout_id_of
from rollout_capture.store import CaptureDir, as_store


def rollout_ids_of(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Validated ids of the records that have one; raises ``ValueError`` naming the record."""
    ids: list[str] = []
    for index, record in enumerate(records):
        try:
            rollout_id = rollout_id_of(record)
        except ValueError as exc:
            raise ValueError(f"record #{index}: {exc}") from None
        if rollout_id is not None:
            ids.append(rollout_id)
    return list(dict.fromkeys(ids))


def clear_model_call_captures_for_rollouts(
    records: Iterable[Mapping[str, Any]], capture_dirs: Sequence[CaptureDir]
) -> list[str]:
    """Remove the captures of the rollouts about to be dispatched; returns their ids.

    Every id is derived and validated first, so one bad record deletes nothing.
    """
    ids = rollout_ids_of(records)
    for directory in capture_dirs:
        as_store(directory).clear(ids)
    return ids
