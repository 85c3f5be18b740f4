"""Typed call records and metrics of one rollout, for library users and inspection.

The strict reader raises on the first damaged row (naming file and line); the lenient
one counts damage and returns the rest.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from rollout_capture.call_records import ModelCallRecord, build_model_call_record
from rollout_capture.evidence import rollout_evidence
from rollout_capture.metrics import aggregate_call_dicts
from rollout_capture.rows import CaptureRowError
from rollout_capture.snapshot import RolloutSnapshot
from rollout_capture.store import CaptureDir, CaptureStore, as_store


def _store_with_rows(
    rollout_id: str, capture_dirs: Sequence[CaptureDir] | CaptureDir
) -> RolloutSnapshot | None:
    dirs = [capture_dirs] if isinstance(capture_dirs, (CaptureStore, str, os.PathLike)) else capture_dirs
    evidence = rollout_evidence(rollout_id, [as_store(d) for d in dirs])
    return evidence.snapshot


def read_model_call_records(
    capture_dirs: Sequence[CaptureDir] | CaptureDir, rollout_id: str
) -> list[ModelCallRecord]:
    """The rollout's call records in order; raises on the first damaged row (naming it)."""
    snap = _store_with_rows(rollout_id, capture_dirs)
    if snap is None:
        return []
    if snap.damaged:
        raise CaptureRowError(snap.damaged[0])
    return [
        build_model_call_record(row, call_index=index)
        for index, row in snap.rows
        if row.get("kind") in (None, "model_call")
    ]


def read_available_model_call_records(
    capture_dirs: Sequence[CaptureDir] | CaptureDir, rollout_id: str
) -> tuple[list[ModelCallRecord], int]:
    """Readable call records, and how many rows were damaged (unreadable or invalid)."""
    snap = _store_with_rows(rollout_id, capture_dirs)
    if snap is None:
        return [], 0
    damaged = len(snap.damaged)
    calls: list[ModelCallRecord] = []
    for index, row in snap.rows:
        if row.get("kind") not in (None, "model_call"):
            continue
        try:
            calls.append(build_model_call_record(row, call_index=index))
        except ValidationError:
            damaged += 1
    return calls, damaged


def aggregate_model_call_records(calls: Iterable[ModelCallRecord]) -> dict[str, Any]:
    """Metrics (spec section 6) of typed call records."""
    return aggregate_call_dicts(call.model_dump() for call in calls)


def aggregate_model_call_metrics(
    capture_dirs: Sequence[CaptureDir] | CaptureDir, rollout_id: str
) -> dict[str, Any]:
    """Metrics of one rollout's readable calls."""
    return aggregate_model_call_records(read_available_model_call_records(capture_dirs, rollout_id)[0])
