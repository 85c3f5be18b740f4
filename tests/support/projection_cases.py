"""Rollouts whose NeMo Gym 0.7.0 projections (``ng_trajectory``, ``ng_perf``) NeMo Gym itself built.

Each case is what NeMo Gym's rollout collection has at a rollout's end: the dispatched row, the
agent's result (its own trajectory, its ``ng_agent_observations``), the rows its model servers
captured and the rollout's latency. ``nemo_gym_side.py project`` runs 0.7.0's own merge and
projection on them twice, with the capture and with an empty one (a run whose captures went to
another store), into tests/data/nemo_gym_070_projections.json; tests/test_projections.py holds
ours to those, and the NeMo Gym tier (tests/test_nemo_gym_070.py) proves the file is 0.7.0's.
"""

from __future__ import annotations

from typing import Any

POLICY = {"type": "responses_api_models", "name": "policy_model"}
T0 = 1_790_000_000.0


def _responses_row(
    call_id: str,
    response_id: str,
    at: float,
    *,
    ask: str,
    output: list[dict[str, Any]],
    session: str | None = None,
    latency_ms: float = 120.5,
    status: str = "completed",
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model_call_id": call_id,
        "dialect": "responses",
        "model_ref": POLICY,
        "started_at": at,
        "completed_at": at + latency_ms / 1000,
        "latency_ms": latency_ms,
        "latency_ttft_ms": 40.25,
        "status_code": 200,
        "error_category": None,
        "request": {"input": [{"role": "user", "content": ask}], "tools": []},
        "response": {
            "id": response_id,
            "object": "response",
            "model": "scripted",
            "status": status,
            "output": output,
            "usage": {
                "input_tokens": 100,
                "input_tokens_details": {"cached_tokens": 32},
                "output_tokens": 20,
                "output_tokens_details": {"reasoning_tokens": 5},
                "total_tokens": 120,
            },
        },
        "upstream_attempted": True,
        "response_source": "upstream",
        "upstream_status_code": None,
        "local_response_reason": None,
    }
    if session is not None:
        row["client_session_id"] = session
    return row


def _chat_row(call_id: str, at: float, *, session: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model_call_id": call_id,
        "dialect": "chat_completions",
        "model_ref": POLICY,
        "started_at": at,
        "completed_at": at + 0.2,
        "latency_ms": 200.0,
        "latency_ttft_ms": None,
        "status_code": 200,
        "error_category": None,
        "request": {"messages": [{"role": "user", "content": "and tomorrow?"}]},
        "response": {
            "id": "chatcmpl-7",
            "object": "chat.completion",
            "model": "scripted",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": "look it up",
                        "tool_calls": [
                            {
                                "id": "tc-1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "sf"}'},
                            }
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59},
        },
    }
    if session is not None:
        row["client_session_id"] = session
    return row


def _message(text: str) -> dict[str, Any]:
    return {
        "id": f"msg-{text[:4]}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _call(name: str, call_id: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": '{"city": "sf"}',
        "id": call_id,
    }


def _reasoning() -> dict[str, Any]:
    return {"id": "rs-1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]}


def _simple_agent_trajectory(
    rollout_id: str, task_id: str, *, gaps: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """What NeMo Gym's simple_agent sends: one invocation naming its calls by response id."""
    refs = [{"model_ref": POLICY, "response_id": "resp-1"}, {"model_ref": POLICY, "response_id": "resp-2"}]
    conversation = [{"role": "user", "content": "weather in sf?", "type": "message"}]
    return {
        "task_id": task_id,
        "rollout_id": rollout_id,
        "invocations": [
            {
                "invocation_id": "root",
                "status": "completed",
                "model_calls": refs,
                "conversation": conversation,
            }
        ],
        "turns": [
            {
                "invocation_id": "root",
                "task_id": task_id,
                "rollout_id": rollout_id,
                "turn_no": 1,
                "timestamp": T0 + 1,
                "question": conversation,
                "answer": [_call("get_weather", "c1")],
                "reasoning_content": [_reasoning()],
                "step_count": 1,
                "model_calls": [refs[0]],
            },
            {
                "invocation_id": "root",
                "task_id": task_id,
                "rollout_id": rollout_id,
                "turn_no": 2,
                "timestamp": T0 + 2,
                "question": conversation,
                "answer": [_message("It is sunny.")],
                "step_count": 1,
                "resolved": True,
                "model_calls": [refs[1]],
            },
        ],
        "tool_calls": [
            {
                "invocation_id": "root",
                "tool_call_id": "c1",
                "tool_name": "get_weather",
                "started_at": T0 + 1.5,
                "completed_at": T0 + 1.6,
                "duration_ms": 100.0,
                "timing_source": "executor",
                "status": "completed",
                "output": '{"weather": "sunny"}',
            }
        ],
        "gaps": gaps or [],
    }


def _two_calls(session: str | None = None) -> list[dict[str, Any]]:
    return [
        _responses_row(
            "mc-1",
            "resp-1",
            T0 + 1,
            ask="weather in sf?",
            output=[_reasoning(), _call("get_weather", "c1")],
            session=session,
        ),
        _responses_row(
            "mc-2", "resp-2", T0 + 2, ask="weather in sf?", output=[_message("It is sunny.")], session=session
        ),
    ]


def cases() -> list[dict[str, Any]]:
    """Every case: a name, the dispatched row, the agent's result, the captured rows, the latency."""
    row = {
        "_ng_task_index": 3,
        "_ng_rollout_index": 1,
        "responses_create_params": {"input": "weather in sf?"},
    }
    base = {"_ng_task_index": 3, "_ng_rollout_index": 1, "reward": 1.0, "resolved": True}
    observations = {
        "source": "opencode",
        "records": [
            {
                "kind": "agent_invocation",
                "invocation_id": "root",
                "status": "completed",
                "model_calls": [{"model_call_id": "mc-1"}],
                "conversation": [{"role": "user", "content": "weather in sf?", "type": "message"}],
            },
            {
                "kind": "agent_invocation",
                "invocation_id": "sub",
                "parent_invocation_id": "root",
                "status": "failed",
            },
            {
                "kind": "tool_call",
                "invocation_id": "root",
                "tool_call_id": "c1",
                "tool_name": "get_weather",
                "started_at": T0 + 1.5,
                "completed_at": T0 + 1.7,
                "status": "completed",
            },
        ],
        "gaps": [{"code": "sandbox_unavailable"}],
    }
    observations["records"].append(
        {
            "kind": "context_compaction",
            "invocation_id": "root",
            "observed_at": T0 + 2.5,
            "trigger": "auto",
            "model_calls": [{"model_call_id": "mc-2"}],  # root's by its session
            "before_model_call": {"model_call_id": "mc-1"},
            "after_model_call": {"model_call_id": "mc-3"},  # sub's: a conflict
        }
    )
    agent_call = {
        "model_call_id": "mc-2",
        "request": {"note": "the agent's own view of its call"},
        "response_metadata": {"model": "asked-for-model"},
        "token_stats": {"prompt_tokens": 1},
    }
    with_agent_calls = _simple_agent_trajectory("3-1", "3")
    with_agent_calls["model_calls"] = [agent_call]
    no_turns = _simple_agent_trajectory("3-1", "3")
    no_turns["turns"] = []
    broken_rows = _two_calls()
    broken_rows[1]["latency_ms"] = -5.0  # a clock step: NeMo Gym's projection refuses the call
    return [
        {
            "name": "simple_agent",
            "row": row,
            "result": {
                **base,
                "ng_trajectory": _simple_agent_trajectory(
                    "3-1", "3", gaps=[{"code": "resolution_unavailable", "invocation_id": "root"}]
                ),
            },
            "rows": _two_calls(),
            "latency_ms": 2500.0,
        },
        {
            "name": "observations_only",
            "row": row,
            "result": {**base, "ng_agent_observations": observations},
            "rows": [*_two_calls("root"), _chat_row("mc-3", T0 + 3, session="sub")],
            "latency_ms": 3100.25,
        },
        {
            "name": "capture_only",
            "row": row,
            "result": dict(base),
            "rows": [*_two_calls(), _chat_row("mc-3", T0 + 3)],
            "latency_ms": 1000.0,
        },
        {
            "name": "agent_sends_calls",
            "row": row,
            "result": {**base, "ng_trajectory": with_agent_calls},
            "rows": _two_calls(),
            "latency_ms": 2000.0,
        },
        {
            "name": "identity_mismatch",
            "row": row,
            "result": {**base, "ng_trajectory": _simple_agent_trajectory("9-9", "task-9")},
            "rows": _two_calls(),
            "latency_ms": 900.0,
        },
        {
            "name": "no_producer_turns",
            "row": row,
            "result": {**base, "ng_trajectory": no_turns},
            "rows": _two_calls(),
            "latency_ms": 800.0,
        },
        {
            "name": "multimodal_redacted",
            "row": row,
            "result": {
                **base,
                "ng_trajectory": _simple_agent_trajectory(
                    "3-1", "3", gaps=[{"code": "multimodal_history_redacted"}]
                ),
            },
            "rows": _two_calls(),
            "latency_ms": 700.0,
        },
        {
            "name": "projection_fails",
            "row": row,
            "result": {**base, "ng_trajectory": _simple_agent_trajectory("3-1", "3")},
            "rows": broken_rows,
            "latency_ms": 600.0,
        },
    ]
