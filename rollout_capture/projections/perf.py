"""``ng_perf``: NeMo Gym 0.7.0's per-rollout performance summary, built from ``ng_trajectory``.

As its collection builds it (``rollout_collection._build_ng_perf``): turns, tool calls and the
tokens of the calls the agent's invocations own, and ``token_observability_coverage``, the share
of turns whose call was found; ``total_latency_ms`` is the collection's own clock around the
rollout, which only NeMo Gym measured, so a rebuild keeps the value it had.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from rollout_capture.projections.models import ModelCallRef, TrajectoryModelCall, TrajectoryRecord

PERF_KEY = "ng_perf"
LATENCY_KEY = "total_latency_ms"

_TOKEN_FIELDS = (
    ("prompt_tokens", "prompt_tokens"),
    ("cached_prompt_tokens", "cached_tokens"),
    ("completion_tokens", "completion_tokens"),
    ("reasoning_tokens", "reasoning_tokens"),
)


def build_perf(trajectory: Mapping[str, Any], rollout_latency_ms: Any) -> dict[str, Any] | None:
    """``ng_perf`` from a dumped ``ng_trajectory``; None where NeMo Gym leaves it absent (no
    invocation, or a trajectory it cannot read)."""
    try:
        record = TrajectoryRecord.model_validate(trajectory)
    except ValueError:
        return None
    if not record.invocations:
        return None
    by_id: dict[str, list[int]] = {}
    by_response: dict[tuple[str, str, str], list[int]] = {}
    for index, call in enumerate(record.model_calls):
        if call.model_call_id:
            by_id.setdefault(call.model_call_id, []).append(index)
        server, response_id = call.response_metadata.model_ref, call.response_metadata.response_id
        if server is not None and response_id:
            by_response.setdefault((server.type, server.name, response_id), []).append(index)

    def matched(ref: ModelCallRef) -> int | None:
        if ref.model_call_id:
            candidates = [
                index
                for index in by_id.get(ref.model_call_id, [])
                if (
                    ref.model_ref is None
                    or ref.model_ref == record.model_calls[index].response_metadata.model_ref
                )
                and (
                    ref.response_id is None
                    or ref.response_id == record.model_calls[index].response_metadata.response_id
                )
            ]
        elif ref.model_ref is not None and ref.response_id:
            candidates = by_response.get((ref.model_ref.type, ref.model_ref.name, ref.response_id), [])
        else:
            candidates = []
        return candidates[0] if len(candidates) == 1 else None

    # One call is owned once, whichever invocations name it (a call is told by its position).
    seen: set[int] = set()
    owned: list[TrajectoryModelCall] = []
    owned_by_invocation: Counter[str] = Counter()
    for invocation in record.invocations:
        for ref in invocation.model_calls:
            found = matched(ref)
            if found is None or found in seen:
                continue
            seen.add(found)
            owned.append(record.model_calls[found])
            owned_by_invocation[invocation.invocation_id] += 1
    tools_by_invocation = Counter(tool.invocation_id for tool in record.tool_calls)
    turns_by_invocation = Counter(turn.invocation_id for turn in record.turns)
    num_turns = sum(
        turns_by_invocation.get(i.invocation_id, 0) or owned_by_invocation.get(i.invocation_id, 0) or 1
        for i in record.invocations
    )
    perf: dict[str, Any] = {
        "num_turns": num_turns,
        "num_tool_calls": sum(tools_by_invocation.get(i.invocation_id, 0) for i in record.invocations),
        "token_observability_coverage": min(1.0, len(owned) / num_turns),
    }
    for key, attribute in _TOKEN_FIELDS:
        values = [
            getattr(c.token_stats, attribute) for c in owned if getattr(c.token_stats, attribute) is not None
        ]
        if values:
            perf[key] = sum(values)
    if isinstance(rollout_latency_ms, (int, float)):  # as NeMo Gym reads it
        perf[LATENCY_KEY] = rollout_latency_ms
    return perf
