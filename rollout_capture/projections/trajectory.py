"""``ng_trajectory``: NeMo Gym 0.7.0's projection of a rollout, built as its collection builds it.

NeMo Gym's rollout collection (``rollout_collection._build_trajectory_record``) builds a record's
``ng_trajectory`` from what the agent sent (its own trajectory, its ``ng_agent_observations``)
and the calls its capture attached, payloads included. :func:`build_trajectory` does the same
from our attachment. :func:`producer_part` takes a trajectory NeMo Gym already built back to
what the agent sent, by removing what the capture it had then put there (its calls, the turns
it derived from them, the gaps it and the projection added), so a rebuild from our calls gives
what NeMo Gym would have built from them (docs/contract.md, section 14).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollout_capture.projections.models import (
    AgentInvocation,
    AgentObservationBundle,
    ModelCallRef,
    ObservationGap,
    ToolCallObservation,
    TrajectoryModelCall,
    TrajectoryRecord,
    TrajectoryResponseMetadata,
    TrajectoryTokenStats,
    TrajectoryToolCall,
    TrajectoryTurn,
)

TRAJECTORY_KEY = "ng_trajectory"

GAP_MODEL_CALLS_UNAVAILABLE = "model_calls_unavailable"
GAP_TURNS_UNAVAILABLE = "turns_unavailable"
GAP_CONVERSATION_UNAVAILABLE = "conversation_unavailable"
GAP_PRODUCER_INVALID = "producer_trajectory_invalid"
GAP_OBSERVATIONS_INVALID = "agent_observations_invalid"
GAP_CAPTURE_GAP_INVALID = "model_call_capture_gap_invalid"
GAP_IDENTITY_MISMATCH = "producer_trajectory_identity_mismatch"
PROJECTION_GAPS = frozenset(
    {
        GAP_MODEL_CALLS_UNAVAILABLE,
        GAP_TURNS_UNAVAILABLE,
        GAP_CONVERSATION_UNAVAILABLE,
        GAP_PRODUCER_INVALID,
        GAP_OBSERVATIONS_INVALID,
        GAP_CAPTURE_GAP_INVALID,
    }
)
"""The gaps the projection itself adds, computed again on every build."""

_METADATA_KEYS = (
    "response_id",
    "model_ref",
    "model",
    "dialect",
    "status_code",
    "response_status",
    "finish_reason",
    "upstream_attempted",
    "response_source",
    "upstream_status_code",
    "local_response_reason",
    "error_category",
    "latency_ttft_ms",
)
"""What of a call record goes into its ``response_metadata`` (NeMo Gym 0.7.0's list)."""

_TOKENS = (
    ("prompt_tokens", "tokens_in"),
    ("completion_tokens", "tokens_out"),
    ("reasoning_tokens", "tokens_reasoning"),
    ("total_tokens", "tokens_total"),
    ("cached_tokens", "cached_tokens"),
)


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _gap_key(gap: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return gap.get("code"), gap.get("invocation_id"), gap.get("detail")


def _turn_content(request: Any, response: Any) -> tuple[Any, Any, Any, int]:
    """One captured call as a turn's question, answer, reasoning and tool-call count (Responses
    output items or a chat completion's first message, the two dialects NeMo Gym's servers capture)."""
    question = request.get("input", request.get("messages")) if isinstance(request, dict) else request
    if isinstance(request, dict) and isinstance(request.get("input"), list):
        # Responses input messages may omit `type` ("message" by default); turns state it.
        question = [
            {"type": "message", **item}
            if isinstance(item, dict) and "role" in item and "type" not in item
            else item
            for item in request["input"]
        ]
    if isinstance(response, dict) and isinstance(response.get("output"), list):
        output = [item for item in response["output"] if isinstance(item, dict)]
        reasoning = [item for item in output if item.get("type") == "reasoning"] or None
        answer = [item for item in output if item.get("type") != "reasoning"]
        return question, answer, reasoning, sum(1 for item in answer if item.get("type") == "function_call")
    choices = response.get("choices") if isinstance(response, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message") or {}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        kept = {key: value for key, value in message.items() if key not in ("reasoning_content", "reasoning")}
        return question, kept, reasoning, len(message.get("tool_calls") or [])
    return question, None, None, 0


def _turns_from_model_calls(
    task_id: str,
    rollout_id: str,
    invocations: Sequence[AgentInvocation],
    model_calls: Sequence[TrajectoryModelCall],
    resolved: Any,
) -> list[TrajectoryTurn]:
    """A turn per answered call an invocation references, for an agent that sent no trajectory
    (calls no invocation names, a judge's say, stay calls only)."""
    by_call_id: dict[str, str] = {}
    by_response_id: dict[str, str] = {}
    for invocation in invocations:
        for ref in invocation.model_calls:
            if ref.model_call_id:
                by_call_id[ref.model_call_id] = invocation.invocation_id
            if ref.response_id:
                by_response_id[ref.response_id] = invocation.invocation_id
    turns: list[TrajectoryTurn] = []
    turn_counts: Counter[str] = Counter()
    tool_counts: Counter[str] = Counter()
    for call in model_calls:
        if call.response is None:  # a call that returned nothing is not a model decision
            continue
        metadata = call.response_metadata
        invocation_id = by_call_id.get(call.model_call_id or "") or by_response_id.get(
            metadata.response_id or ""
        )
        if invocation_id is None:
            continue
        question, answer, reasoning, tool_calls = _turn_content(call.request, call.response)
        turn_counts[invocation_id] += 1
        turns.append(
            TrajectoryTurn(
                invocation_id=invocation_id,
                task_id=task_id,
                rollout_id=rollout_id,
                turn_no=turn_counts[invocation_id],
                timestamp=call.started_at or call.completed_at or 0.0,
                question=question,
                answer=answer,
                reasoning_content=reasoning,
                step_count=tool_counts[invocation_id],
                model_calls=[
                    ModelCallRef(
                        model_call_id=call.model_call_id,
                        model_ref=metadata.model_ref,
                        response_id=metadata.response_id,
                    )
                ],
            )
        )
        tool_counts[invocation_id] += tool_calls
    if turns and isinstance(resolved, bool):
        turns[-1] = turns[-1].model_copy(update={"resolved": resolved})
    return turns


def _projected_call(call: Mapping[str, Any]) -> TrajectoryModelCall:
    """One attached call record as a trajectory's model call (payloads where the call has them)."""
    metadata = {key: call[key] for key in _METADATA_KEYS if call.get(key) is not None}
    response = call.get("response")
    if isinstance(response, dict) and isinstance(response.get("status"), str):
        metadata.setdefault("response_status", response["status"])
    request = call.get("request")
    return TrajectoryModelCall(
        model_call_id=call.get("model_call_id"),
        started_at=call.get("started_at"),
        completed_at=call.get("completed_at"),
        duration_ms=call.get("latency_total_ms"),
        request=request if request is not None else call.get("request_raw"),
        response=response if response is not None else call.get("response_raw"),
        response_metadata=TrajectoryResponseMetadata.model_validate(metadata),
        token_stats=TrajectoryTokenStats(**{name: _count(call.get(key)) for name, key in _TOKENS}),
    )


def _merge_tools(
    tools: list[TrajectoryToolCall],
    invocations: Sequence[AgentInvocation],
    observed: Iterable[ToolCallObservation],
) -> None:
    """The agent's tool observations merged into the trajectory's tool calls, by (invocation, call id)."""
    outputs = {
        (invocation.invocation_id, item.get("call_id")): item.get("output")
        for invocation in invocations
        for item in invocation.conversation
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    }
    positions = {(tool.invocation_id, tool.tool_call_id): index for index, tool in enumerate(tools)}
    for observation in observed:
        key = (observation.invocation_id, observation.tool_call_id)
        position = positions.get(key)
        existing = tools[position] if position is not None else None
        merged = existing.model_dump(mode="json") if existing is not None else {}
        update = observation.model_dump(mode="json", exclude_none=True)
        if existing is not None and observation.status == "unknown" and existing.status != "unknown":
            update.pop("status", None)
        merged.update(update)
        if key in outputs:
            merged["output"] = outputs[key]
        projected = TrajectoryToolCall.model_validate(merged)
        if position is None:
            positions[key] = len(tools)
            tools.append(projected)
        else:
            tools[position] = projected


def build_trajectory(
    task_id: str,
    rollout_id: str,
    producer: Mapping[str, Any] | None,
    observations: Any,
    calls: Sequence[Any],
    capture_gaps: Sequence[Any],
    resolved: Any,
) -> dict[str, Any]:
    """``ng_trajectory`` as NeMo Gym 0.7.0's collection builds it, dumped.

    ``producer`` is the trajectory the agent sent (None: it sent none), ``observations`` the
    record's ``ng_agent_observations`` after the ownership join, ``calls`` and ``capture_gaps``
    our attachment's (the calls with payloads where NeMo Gym's collection reads them), ``resolved``
    the record's ``resolved``. Raises where NeMo Gym's projection would fail.
    """
    gaps: list[ObservationGap] = []
    invocations: list[AgentInvocation] = []
    turns: list[TrajectoryTurn] = []
    tools: list[TrajectoryToolCall] = []
    model_calls: list[TrajectoryModelCall] = []
    producer_turns_observed = False
    if producer is not None:
        try:
            trajectory = TrajectoryRecord.model_validate(producer)
            producer_turns_observed = True
            mismatches = [
                field
                for field, given, canonical in (
                    ("task_id", trajectory.task_id, task_id),
                    ("rollout_id", trajectory.rollout_id, rollout_id),
                )
                if given != canonical
            ]
            if mismatches:
                gaps.append(ObservationGap(code=GAP_IDENTITY_MISMATCH, detail=",".join(mismatches)))
                turns = [
                    turn.model_copy(update={"task_id": task_id, "rollout_id": rollout_id})
                    for turn in trajectory.turns
                ]
            else:
                turns = trajectory.turns
            gaps.extend(trajectory.gaps)
            invocations = trajectory.invocations
            tools = trajectory.tool_calls
            model_calls = trajectory.model_calls
        except ValueError as exc:  # pydantic's ValidationError is one
            gaps.append(ObservationGap(code=GAP_PRODUCER_INVALID, detail=type(exc).__name__))

    if observations is not None:
        try:
            bundle = AgentObservationBundle.model_validate(observations)
            gaps.extend(bundle.gaps)
            given = {invocation.invocation_id for invocation in invocations}
            invocations.extend(
                r for r in bundle.records if isinstance(r, AgentInvocation) and r.invocation_id not in given
            )
            observed = [r for r in bundle.records if isinstance(r, ToolCallObservation)]
            if observed:
                _merge_tools(tools, invocations, observed)
        except ValueError as exc:
            gaps.append(ObservationGap(code=GAP_OBSERVATIONS_INVALID, detail=type(exc).__name__))

    turns.sort(key=lambda turn: (turn.timestamp, turn.invocation_id, turn.turn_no))

    positions = {
        call.model_call_id: i for i, call in enumerate(model_calls) if call.model_call_id is not None
    }
    for call in calls:
        if not isinstance(call, dict):
            continue
        projected = _projected_call(call)
        call_id = call.get("model_call_id")
        position = positions.pop(call_id, None) if call_id is not None else None
        if position is None:
            model_calls.append(projected)
            continue
        merged = model_calls[position].model_dump(mode="json")
        update = projected.model_dump(mode="json", exclude_none=True)
        for key in ("response_metadata", "token_stats"):
            merged[key].update(update.pop(key))
        merged.update(update)
        model_calls[position] = TrajectoryModelCall.model_validate(merged)

    for raw_gap in capture_gaps:
        if isinstance(raw_gap, dict):
            try:
                gaps.append(ObservationGap.model_validate(raw_gap))
            except ValueError:
                gaps.append(ObservationGap(code=GAP_CAPTURE_GAP_INVALID))
    if producer is None:
        # An agent that sends its own trajectory owns its turns; otherwise turns come from the
        # calls its invocations reference.
        turns = _turns_from_model_calls(task_id, rollout_id, invocations, model_calls, resolved)
    if not model_calls:
        gaps.append(ObservationGap(code=GAP_MODEL_CALLS_UNAVAILABLE))
    if not turns and not producer_turns_observed:
        gaps.append(ObservationGap(code=GAP_TURNS_UNAVAILABLE))
    if not any(invocation.conversation for invocation in invocations):
        gaps.append(ObservationGap(code=GAP_CONVERSATION_UNAVAILABLE))
    unique = {(gap.code, gap.invocation_id, gap.detail): gap for gap in gaps}
    return TrajectoryRecord(
        task_id=task_id,
        rollout_id=rollout_id,
        invocations=invocations,
        turns=turns,
        model_calls=model_calls,
        tool_calls=tools,
        gaps=list(unique.values()),
    ).model_dump(mode="json")


def _derived_turns(trajectory: Mapping[str, Any], capture_ids: set[str]) -> bool:
    """Whether the trajectory's turns are the projection's own (derived from captured calls, the
    agent sent none) rather than the agent's: it said turns were unavailable, or every turn names
    exactly one captured call by its ``model_call_id``, as derived turns do."""
    gaps = trajectory.get("gaps") or []
    if any(isinstance(gap, dict) and gap.get("code") == GAP_TURNS_UNAVAILABLE for gap in gaps):
        return True
    turns = trajectory.get("turns") or []
    return bool(turns) and all(
        isinstance(turn, dict)
        and isinstance(turn.get("model_calls"), list)
        and len(turn["model_calls"]) == 1
        and isinstance(turn["model_calls"][0], dict)
        and turn["model_calls"][0].get("model_call_id") in capture_ids
        for turn in turns
    )


def producer_part(
    trajectory: Mapping[str, Any],
    capture_ids: set[str],
    stale_ids: set[str],
    capture_gaps: Iterable[Mapping[str, Any]],
    observations: Any,
) -> dict[str, Any] | None:
    """What the agent sent, recovered from a trajectory NeMo Gym's collection built; None when the
    agent sent none (the projection then derives turns from the calls again).

    Removed: the turns derived from captured calls (``capture_ids``: the old attachment's and
    ours), the model calls of the old capture that ours does not hold (``stale_ids``; those ours
    holds stay in place, and the rebuild merges ours into them as NeMo Gym merges a capture into
    an agent's calls), the gaps the capture (``capture_gaps``, or any ``model_call_capture_*``
    gap), the projection and the agent's observations (``observations``, as the record holds
    them) added, and the invocations that came from those observations. What the agent itself
    sent stays, in its order.
    """
    observed_gaps: set[tuple[Any, Any, Any]] = set()
    observed_invocations: list[Any] = []
    if isinstance(observations, Mapping):
        observed_gaps = {_gap_key(g) for g in observations.get("gaps") or [] if isinstance(g, Mapping)}
        observed_invocations = [
            r
            for r in observations.get("records") or []
            if isinstance(r, Mapping) and r.get("kind") == "agent_invocation"
        ]
    capture_gap_keys = {_gap_key(g) for g in capture_gaps if isinstance(g, Mapping)}
    derived = _derived_turns(trajectory, capture_ids)
    kept_gaps = [
        gap
        for gap in trajectory.get("gaps") or []
        if not (
            isinstance(gap, Mapping)
            and (
                gap.get("code") in PROJECTION_GAPS
                or str(gap.get("code")).startswith("model_call_capture_")
                or _gap_key(gap) in capture_gap_keys
                or _gap_key(gap) in observed_gaps
            )
        )
    ]
    if derived:
        return None
    part = dict(trajectory)
    part["gaps"] = kept_gaps
    part["model_calls"] = [
        call
        for call in trajectory.get("model_calls") or []
        if not (isinstance(call, Mapping) and call.get("model_call_id") in stale_ids)
    ]
    part["invocations"] = [
        invocation
        for invocation in trajectory.get("invocations") or []
        if invocation not in observed_invocations
    ]
    return part
