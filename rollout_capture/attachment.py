"""The ``ng_model_call_capture`` attachment of one rollout, and putting it on the record.

Every gap in the evidence is stated with its code (spec section 7), never papered over;
the ownership join runs last so its failure is a gap too.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

from pydantic import ValidationError

from rollout_capture.call_records import BuiltCall, call_record_dict, verifier_invocation_dict
from rollout_capture.claims import partition
from rollout_capture.evidence import Evidence
from rollout_capture.metrics import aggregate_call_dicts
from rollout_capture.ownership import join_ownership
from rollout_capture.projections import carries_projection, payloads_wanted, reproject
from rollout_capture.rows import Damage
from rollout_capture.snapshot import RolloutSnapshot

logger = logging.getLogger(__name__)

ATTACHMENT_KEY = "ng_model_call_capture"
OBSERVATIONS_KEY = "ng_agent_observations"
OWNERS_KEY = "metrics_by_owner"

GAP_NO_RECORDS = "model_call_capture_no_records"
GAP_RECORDS_UNREADABLE = "model_call_capture_records_unreadable"
GAP_INCOMPLETE = "model_call_capture_incomplete"
GAP_UNREADABLE = "model_call_capture_unreadable"
GAP_PENDING = "model_call_capture_pending"
GAP_CLAIM_ABANDONED = "model_call_capture_claim_abandoned"
GAP_JOIN_FAILED = "agent_observation_join_failed"
GAP_TIMING_IMPOSSIBLE = "model_call_timing_impossible"


def _gap(code: str, detail: str | None = None) -> dict[str, str]:
    return {"code": code} if detail is None else {"code": code, "detail": detail}


_TIMING = operator.itemgetter("latency_total_ms", "latency_ttft_ms", "started_at", "completed_at")


def impossible_timing_gaps(calls: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A ``model_call_timing_impossible`` gap for each call whose timing cannot be the model's (a
    negative duration, completed before started: a clock step), naming it. Its values stay as
    recorded; the summary leaves negative durations out of percentiles. Valid input gets none."""
    gaps = []
    for index, (latency, ttft, started, completed) in enumerate(map(_TIMING, calls)):  # runs per call
        if (
            (latency is not None and latency < 0)
            or (ttft is not None and ttft < 0)
            or (started is not None and completed is not None and completed < started)
        ):
            gaps.append(_gap(GAP_TIMING_IMPOSSIBLE, _timing_detail(calls[index])))
    return gaps


def _timing_detail(call: dict[str, Any]) -> str:
    """Which call, and which of its values cannot be right."""
    wrong = [
        f"{name}={call[name]!r}"
        for name in ("latency_total_ms", "latency_ttft_ms")
        if call[name] is not None and call[name] < 0
    ]
    started, completed = call["started_at"], call["completed_at"]
    if started is not None and completed is not None and completed < started:
        wrong.append(f"completed_at={completed!r} < started_at={started!r}")
    return f"capture:{call['model_call_id']}:call_index={call['call_index']}: {', '.join(wrong)}"


def build_attachment(
    rollout_id: str,
    evidence: Evidence,
    *,
    include_payloads: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """The ``ng_model_call_capture`` value for one rollout (before the ownership join)."""
    gaps: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    verifiers: dict[str, dict[str, Any]] = {}
    snap = evidence.snapshot
    if evidence.unreadable:
        gaps.append(_gap(GAP_UNREADABLE))
    elif snap is None:
        gaps.append(_gap(GAP_NO_RECORDS))
    else:
        rows, damage = snap.record_rows(include_payloads)
        damaged = len(damage) + _read_rows(rows, include_payloads, calls, verifiers)
        _snapshot_gaps(snap, calls, damaged, now, gaps, [d for d in damage if d.whitespace])
    judged = [call for call in calls if call["verifier_invocation_id"]] if calls else []
    if verifiers:
        _judge_metrics(verifiers, judged)
    attachment: dict[str, Any] = {
        "rollout_id": rollout_id,
        "metrics": aggregate_call_dicts(calls),  # every call, the judges' too: NeMo Gym's metrics
        "calls": calls,
    }
    if gaps:
        attachment["gaps"] = gaps
    if verifiers:
        attachment["verifier_invocations"] = list(verifiers.values())
    if verifiers or judged:
        attachment[OWNERS_KEY] = metrics_by_owner(calls, judged)
    return attachment


def _read_rows(
    rows: list[tuple[int, Any]],
    include_payloads: bool,
    calls: list[dict[str, Any]],
    verifiers: dict[str, dict[str, Any]],
) -> int:
    """Call records into ``calls``, verifier invocations into ``verifiers``; how many rows were unusable."""
    damaged = 0
    for call_index, row in rows:
        if type(row) is BuiltCall:  # read typed: its record is built (call_record_dict's)
            record = row.record
            record["call_index"] = call_index
            calls.append(record)
            continue
        kind = row.get("kind")
        try:
            if kind is None or kind == "model_call":
                calls.append(call_record_dict(row, call_index, include_payloads=include_payloads))
            elif kind == "verifier_invocation":
                invocation = verifier_invocation_dict(row, call_index, include_payloads=include_payloads)
                verifiers.pop(invocation["verifier_invocation_id"], None)  # a retried verify wins
                verifiers[invocation["verifier_invocation_id"]] = invocation
            else:
                damaged += 1  # a row kind this reader does not know: evidence it cannot use
        except ValidationError:
            damaged += 1
    return damaged


def _snapshot_gaps(
    snap: RolloutSnapshot,
    calls: list[dict[str, Any]],
    damaged: int,
    now: float | None,
    gaps: list[dict[str, str]],
    hidden: list[Damage],
) -> None:
    """The gaps a snapshot's evidence has: damage, the marker, no records, claims, holes, timing."""
    if damaged:
        gaps.append(_gap(GAP_RECORDS_UNREADABLE, f"count={damaged}" + _naming(hidden)))
    if snap.incomplete:
        gaps.append(_gap(GAP_INCOMPLETE))
    elif not calls and not damaged:
        gaps.append(_gap(GAP_NO_RECORDS))
    if snap.claims:  # rare on a finished rollout: the clock is read only then
        live, expired = partition(snap.claims, now)
        if live:
            gaps.append(_gap(GAP_PENDING, f"count={len(live)}"))
        elif expired:
            gaps.append(_gap(GAP_CLAIM_ABANDONED, f"count={len(expired)}"))
    for hole in snap.holes:  # rows above a hole this reader may not fill are unread: pending
        gaps.append(_gap(GAP_PENDING, f"journal hole: {hole}"))
    if calls:
        gaps.extend(impossible_timing_gaps(calls))


def _naming(hidden: list[Damage]) -> str:
    """The first damaged whitespace row, named (file, line, why) after the count: NeMo Gym's reader
    skips its line, so nothing else would tell what was lost (spec 7)."""
    if not hidden:
        return ""
    first = hidden[0]
    where = first.source.rsplit("/", 1)[-1] + ("" if first.line is None else f":{first.line}")
    more = f" (and {len(hidden) - 1} more)" if len(hidden) > 1 else ""
    return f"; {where}: {first.reason}{more}"


def _judge_metrics(verifiers: dict[str, dict[str, Any]], judged: list[dict[str, Any]]) -> None:
    """Each verifier invocation's judge-model call ids and the metrics of those calls."""
    by_invocation: dict[str, list[dict[str, Any]]] = {key: [] for key in verifiers}
    for call in judged:
        calls_of = by_invocation.get(call["verifier_invocation_id"])
        if calls_of is not None:
            calls_of.append(call)
            if call["model_call_id"]:
                verifiers[call["verifier_invocation_id"]]["model_call_ids"].append(call["model_call_id"])
    for key, invocation in verifiers.items():
        invocation["metrics"] = aggregate_call_dicts(by_invocation[key])


def metrics_by_owner(calls: list[dict[str, Any]], judged: list[dict[str, Any]]) -> dict[str, Any]:
    """``metrics`` split by whose calls they are: the policy's (no ``verifier_invocation_id``)
    and the verifiers' (their judge-model calls). Each is the rollout's metrics over those calls
    only, so the two add up to ``metrics``; the judge's tokens are not the policy's spend."""
    policy = [call for call in calls if not call["verifier_invocation_id"]]
    return {"policy": aggregate_call_dicts(policy), "verifiers": aggregate_call_dicts(judged)}


def add_gap(attachment: dict[str, Any], gap: dict[str, str]) -> None:
    """Put a gap on the attachment, its key order kept: gaps come before the verifier invocations
    and the owners' metrics (as :func:`build_attachment` writes them)."""
    gaps = attachment.pop("gaps", [])
    gaps.append(gap)
    verifiers = attachment.pop("verifier_invocations", None)
    owners = attachment.pop(OWNERS_KEY, None)
    attachment["gaps"] = gaps
    if verifiers is not None:
        attachment["verifier_invocations"] = verifiers
    if owners is not None:
        attachment[OWNERS_KEY] = owners


def payloads_to_read(record: dict[str, Any], include_payloads: bool) -> bool:
    """Whether a record's calls are read with their payloads: asked for, or wanted by the NeMo Gym
    trajectory it carries (:func:`rollout_capture.projections.payloads_wanted`)."""
    return include_payloads or payloads_wanted(record)


def attach(record: dict[str, Any], attachment: dict[str, Any]) -> dict[str, Any]:
    """Put the attachment on the record, run the ownership join and rebuild the NeMo Gym
    projections it carries (``ng_trajectory``, ``ng_perf``: :mod:`rollout_capture.projections`);
    returns the record. The attachment's calls hold payloads as :func:`payloads_to_read` said."""
    previous = record.get(ATTACHMENT_KEY)
    observations = record.get(OBSERVATIONS_KEY)
    if observations is not None:
        try:
            record[OBSERVATIONS_KEY] = join_ownership(observations, attachment["calls"])
        except Exception as exc:
            logger.warning("could not join agent observations of %s: %s", attachment["rollout_id"], exc)
            add_gap(attachment, _gap(GAP_JOIN_FAILED))
    record[ATTACHMENT_KEY] = attachment
    if carries_projection(record):
        reproject(
            record,
            attachment,
            previous=previous,
            observations_before=observations,
            add_gap=lambda gap: add_gap(attachment, gap),
        )
    return record
