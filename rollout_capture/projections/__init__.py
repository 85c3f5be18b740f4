"""NeMo Gym 0.7.0's projections of a rollout (``ng_trajectory``, ``ng_perf``), kept true to our evidence.

NeMo Gym's collection builds both from the capture it attaches; a record enriched from our
captures gets them rebuilt from ours, as that collection would have built them, so its health
checks, ``perf_summary`` and exporters read our evidence and never a projection of another
capture (docs/contract.md, section 14). Where a projection cannot be rebuilt it is removed, and a
gap says why: never our calls beside a projection that contradicts them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from rollout_capture.projections.perf import LATENCY_KEY, PERF_KEY, build_perf
from rollout_capture.projections.trajectory import TRAJECTORY_KEY, build_trajectory, producer_part

logger = logging.getLogger(__name__)

__all__ = [
    "GAP_PERF_UNAVAILABLE",
    "GAP_PROJECTION_FAILED",
    "PERF_KEY",
    "TRAJECTORY_KEY",
    "carries_projection",
    "payloads_wanted",
    "reproject",
]

GAP_PROJECTION_FAILED = "trajectory_projection_failed"
"""NeMo Gym's gap for a trajectory it could not build (the record then has none)."""
GAP_PERF_UNAVAILABLE = "ng_perf_unavailable"
"""Ours: the record's ``ng_perf`` was removed, its detail saying why (it cannot be rebuilt)."""
GAP_MULTIMODAL_REDACTED = "multimodal_history_redacted"
_PAYLOADS = ("request", "response", "request_raw", "response_raw")


def carries_projection(record: Mapping[str, Any]) -> bool:
    """Whether the record holds a NeMo Gym projection that enrichment must keep true."""
    return TRAJECTORY_KEY in record or PERF_KEY in record


def _has_gap(value: Any, code: str) -> bool:
    gaps = value.get("gaps") if isinstance(value, Mapping) else None
    return isinstance(gaps, list) and any(isinstance(g, Mapping) and g.get("code") == code for g in gaps)


def payloads_wanted(record: Mapping[str, Any]) -> bool:
    """Whether the record's calls must be read with payloads for its trajectory: NeMo Gym's
    collection puts them there, but for a rollout whose agent redacted a multimodal history."""
    return TRAJECTORY_KEY in record and not any(
        _has_gap(record.get(key), GAP_MULTIMODAL_REDACTED)
        for key in (TRAJECTORY_KEY, "ng_agent_observations")
    )


def _ids(attachment: Any) -> set[str]:
    calls = attachment.get("calls") if isinstance(attachment, Mapping) else None
    return {
        call["model_call_id"]
        for call in calls or []
        if isinstance(call, Mapping) and isinstance(call.get("model_call_id"), str)
    }


def _gaps(attachment: Any) -> list[Any]:
    gaps = attachment.get("gaps") if isinstance(attachment, Mapping) else None
    return gaps if isinstance(gaps, list) else []


def reproject(
    record: dict[str, Any],
    attachment: dict[str, Any],
    *,
    previous: Any,
    observations_before: Any,
    add_gap: Callable[[dict[str, str]], None],
) -> None:
    """Rebuild the record's ``ng_trajectory`` and ``ng_perf`` from ``attachment`` (our calls, read
    with payloads where :func:`payloads_wanted` says so), in place.

    ``previous`` is the ``ng_model_call_capture`` the record held before (the capture the old
    projection was built from), ``observations_before`` its ``ng_agent_observations`` before the
    ownership join (the record holds them joined); ``add_gap(gap)`` puts a gap on the attachment.
    After a rebuilt trajectory the calls' payloads live in it alone, as NeMo Gym's collection
    leaves them; when it cannot be rebuilt they stay on the calls (its fallback).
    """
    calls = attachment.get("calls") or []
    if TRAJECTORY_KEY in record:
        old = record[TRAJECTORY_KEY]
        with_payloads = payloads_wanted(record)
        try:
            if not isinstance(old, Mapping):
                raise ValueError(f"ng_trajectory is not an object ({type(old).__name__})")
            task_id, rollout_id = old.get("task_id"), old.get("rollout_id")
            if not isinstance(task_id, str) or not isinstance(rollout_id, str):
                raise ValueError("ng_trajectory has no task_id and rollout_id")
            before, ours = _ids(previous), _ids(attachment)
            producer = producer_part(old, before | ours, before - ours, _gaps(previous), observations_before)
            read = calls if with_payloads else [_without_payloads(call) for call in calls]
            record[TRAJECTORY_KEY] = build_trajectory(
                task_id,
                rollout_id,
                producer,
                record.get("ng_agent_observations"),
                read,
                _gaps(attachment),
                record.get("resolved"),
            )
        except Exception as exc:  # NeMo Gym's collection catches any: the record keeps its calls
            logger.warning("could not rebuild ng_trajectory of %s: %s", attachment.get("rollout_id"), exc)
            del record[TRAJECTORY_KEY]
            add_gap({"code": GAP_PROJECTION_FAILED, "detail": type(exc).__name__})
        else:
            if with_payloads:
                for call in calls:
                    for key in _PAYLOADS:
                        call.pop(key, None)
    if PERF_KEY in record:
        before = record[PERF_KEY]
        latency = before.get(LATENCY_KEY) if isinstance(before, Mapping) else None
        trajectory = record.get(TRAJECTORY_KEY)
        perf = build_perf(trajectory, latency) if isinstance(trajectory, Mapping) else None
        if perf is None:
            del record[PERF_KEY]
            why = (
                "no ng_trajectory to build it from"
                if trajectory is None
                else "ng_trajectory has no invocation"
            )
            add_gap({"code": GAP_PERF_UNAVAILABLE, "detail": why})
        else:
            record[PERF_KEY] = perf


def _without_payloads(call: Any) -> Any:
    return {k: v for k, v in call.items() if k not in _PAYLOADS} if isinstance(call, Mapping) else call
