"""NeMo Gym 0.7.0's observation contracts (``ng_trajectory``, ``ng_agent_observations``) as data.

The models hold what NeMo Gym's ``nemo_gym.rollout_observability`` declares (fields, defaults,
bounds, ``extra="forbid"``), so a projection validates and dumps what 0.7.0 validates and dumps,
with no ``nemo_gym`` import (NeMo Gym needs Python 3.13; the core runs on 3.11). One deliberate
difference: conversation items, questions and answers stay the JSON they are (NeMo Gym validates
conversation items against its Responses input types; what it wrote already passed that).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_capture.call_records import ModelServerRef


class ObservationModel(BaseModel):
    """Unknown keys are an error, as in NeMo Gym: a record of another shape is not guessed at."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelCallRef(ObservationModel):
    """What names one model call: its ``model_call_id``, or its server and ``response_id``."""

    model_call_id: str | None = None
    model_ref: ModelServerRef | None = None
    response_id: str | None = None

    @model_validator(mode="after")
    def _a_join_key(self) -> ModelCallRef:
        if not self.model_call_id and not (self.model_ref is not None and self.response_id):
            raise ValueError("model_call_id or both model_ref and response_id are required")
        return self


class TrajectoryTokenStats(ObservationModel):
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    reasoning_tokens: int | None = Field(default=None, ge=0)
    total_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)


class TrajectoryResponseMetadata(ObservationModel):
    response_id: str | None = None
    model_ref: ModelServerRef | None = None
    model: str | None = None
    dialect: str | None = None
    status_code: int | None = None
    response_status: str | None = None
    finish_reason: str | None = None
    upstream_attempted: bool | None = None
    response_source: Literal["upstream", "local"] | None = None
    upstream_status_code: int | None = None
    local_response_reason: str | None = None
    error_category: str | None = None
    latency_ttft_ms: float | None = Field(default=None, ge=0)


class TrajectoryModelCall(ObservationModel):
    model_call_id: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    duration_ms: float | None = Field(default=None, ge=0)
    request: Any | None = None
    response: Any | None = None
    response_metadata: TrajectoryResponseMetadata = Field(default_factory=TrajectoryResponseMetadata)
    token_stats: TrajectoryTokenStats = Field(default_factory=TrajectoryTokenStats)


class TrajectoryTurn(ObservationModel):
    invocation_id: str
    task_id: str
    rollout_id: str
    turn_no: int = Field(ge=1)
    timestamp: float
    question: Any | None = None
    answer: Any | None = None
    reasoning_content: Any | None = None
    resolved: bool | None = None
    step_count: int = Field(ge=0)
    model_calls: list[ModelCallRef] = Field(default_factory=list)


class AgentInvocation(ObservationModel):
    kind: Literal["agent_invocation"] = "agent_invocation"
    invocation_id: str
    parent_invocation_id: str | None = None
    spawned_by_tool_call_id: str | None = None
    status: Literal["completed", "failed", "incomplete", "unknown"] = "unknown"
    duration_ms: float | None = Field(default=None, ge=0)
    error_type: str | None = None
    model_calls: list[ModelCallRef] = Field(default_factory=list)
    conversation: list[Any] = Field(default_factory=list)


class ToolCallObservation(ObservationModel):
    kind: Literal["tool_call"] = "tool_call"
    invocation_id: str
    tool_call_id: str
    sandbox_id: str | None = None
    tool_name: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    duration_ms: float | None = Field(default=None, ge=0)
    timing_source: Literal["executor", "artifact", "harness"] | None = None
    status: Literal["completed", "failed", "timeout", "cancelled", "incomplete", "unknown"] = "unknown"
    error_type: str | None = None

    @model_validator(mode="after")
    def _ordered(self) -> ToolCallObservation:
        if (
            self.started_at is not None
            and self.completed_at is not None
            and self.completed_at < self.started_at
        ):
            raise ValueError("completed_at must not precede started_at")
        return self


class TrajectoryToolCall(ToolCallObservation):
    output: Any | None = None


class SandboxObservation(ObservationModel):
    kind: Literal["sandbox"] = "sandbox"
    role: Literal["agent", "verifier", "environment"]
    provider: str | None = None
    sandbox_id: str | None = None
    outcome: Literal["completed", "failed", "timeout", "oom", "sandbox_error", "cancelled", "unknown"] = (
        "unknown"
    )
    exit_code: int | None = None
    wall_time_s: float | None = Field(default=None, ge=0)
    cpu_time_s: float | None = Field(default=None, ge=0)
    peak_memory_mib: float | None = Field(default=None, ge=0)
    resource_usage_source: str | None = None
    error_type: str | None = None


class ContextCompactionObservation(ObservationModel):
    kind: Literal["context_compaction"] = "context_compaction"
    invocation_id: str
    observed_at: float | None = None
    trigger: str | None = None
    tokens_before: int | None = Field(default=None, ge=0)
    tokens_after: int | None = Field(default=None, ge=0)
    outcome: Literal["completed", "failed", "aborted", "unknown"] = "unknown"
    summary: str | None = None
    first_kept_item_id: str | None = None
    before_model_call: ModelCallRef | None = None
    model_calls: list[ModelCallRef] = Field(default_factory=list)
    after_model_call: ModelCallRef | None = None


class ObservationGap(ObservationModel):
    """Something the integration could not observe or join exactly (NeMo Gym's gap)."""

    code: str
    invocation_id: str | None = None
    detail: str | None = None


AgentObservationRecord = Annotated[
    AgentInvocation | ToolCallObservation | ContextCompactionObservation | SandboxObservation,
    Field(discriminator="kind"),
]


class AgentObservationBundle(ObservationModel):
    source: str
    records: list[AgentObservationRecord] = Field(default_factory=list)
    gaps: list[ObservationGap] = Field(default_factory=list)

    @model_validator(mode="after")
    def _identities(self) -> AgentObservationBundle:
        invocations = {r.invocation_id: r for r in self.records if isinstance(r, AgentInvocation)}
        if len(invocations) != sum(isinstance(r, AgentInvocation) for r in self.records):
            raise ValueError("invocation_id must be unique within an observation bundle")
        checked: set[str] = set()
        for invocation_id in invocations:
            chain: set[str] = set()
            current: str | None = invocation_id
            while current is not None and current in invocations and current not in checked:
                if current in chain:
                    raise ValueError("parent_invocation_id must not form a cycle")
                chain.add(current)
                current = invocations[current].parent_invocation_id
            checked.update(chain)
        return self


class TrajectoryRecord(ObservationModel):
    schema_version: Literal["1.0"] = "1.0"
    task_id: str
    rollout_id: str
    invocations: list[AgentInvocation] = Field(default_factory=list)
    turns: list[TrajectoryTurn] = Field(default_factory=list)
    model_calls: list[TrajectoryModelCall] = Field(default_factory=list)
    tool_calls: list[TrajectoryToolCall] = Field(default_factory=list)
    gaps: list[ObservationGap] = Field(default_factory=list)

    @model_validator(mode="after")
    def _identities(self) -> TrajectoryRecord:
        invocation_ids = [invocation.invocation_id for invocation in self.invocations]
        if len(invocation_ids) != len(set(invocation_ids)):
            raise ValueError("invocation_id must be unique within a trajectory")
        call_ids = [call.model_call_id for call in self.model_calls if call.model_call_id]
        if len(call_ids) != len(set(call_ids)):
            raise ValueError("model_call_id must be unique within a trajectory")
        keys: set[tuple[str, int]] = set()
        for turn in self.turns:
            if turn.task_id != self.task_id or turn.rollout_id != self.rollout_id:
                raise ValueError("turn identity must match the trajectory")
            key = (turn.invocation_id, turn.turn_no)
            if key in keys:
                raise ValueError("turn number must be unique within an invocation")
            keys.add(key)
        return self
