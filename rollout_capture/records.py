"""Capture rows to call records (spec sections 4 and 5).

The pydantic models are the contract. Building them is the hot path of a merge, so
:func:`call_record_dict` builds the dumped form directly when every typed field already
has its canonical type, and defers to pydantic otherwise: same output, same errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

PAYLOAD_FIELDS = ("request", "response", "request_raw", "response_raw")


class ModelServerRef(BaseModel):
    """Which model server answered a call."""

    type: Literal["responses_api_models"]
    name: str


class VerifierRef(BaseModel):
    """Which resources server verified a rollout."""

    type: Literal["resources_servers"]
    name: str


class ModelCallRecord(BaseModel):
    """One captured model-server exchange, normalized across the three dialects."""

    model_call_id: str | None = None
    response_id: str | None = None
    client_session_id: str | None = None
    call_index: int
    model_ref: ModelServerRef | None = None
    model: str | None = None
    dialect: str | None = None
    status_code: int | None = None
    response_status: str | None = None
    finish_reason: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    tokens_reasoning: int | None = None
    tokens_total: int | None = None
    request: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    request_raw: str | None = None
    response_raw: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None
    cache_hit: bool | None = None
    cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    error_category: str | None = None
    latency_total_ms: float | None = None
    latency_ttft_ms: float | None = None
    verifier_invocation_id: str | None = None


class VerifierInvocation(BaseModel):
    """One call of a rollout's verifier, and the judge-model calls it made."""

    verifier_invocation_id: str
    call_index: int
    verifier_ref: VerifierRef | None = None
    started_at: float | None = None
    completed_at: float | None = None
    latency_ms: float | None = None
    status_code: int | None = None
    error_category: str | None = None
    reward: float | None = None
    request: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    model_call_ids: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------- normalization


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _detail_count(usage: Mapping[str, Any], groups: tuple[str, ...], names: tuple[str, ...]) -> int | None:
    for group in groups:
        details = usage.get(group)
        if isinstance(details, Mapping):
            for name in names:
                value = _count(details.get(name))
                if value is not None:
                    return value
    return None


def extract_token_stats(usage: Any) -> dict[str, int | None]:
    """Token counts from Responses, Chat Completions or Anthropic usage.

    Counts are never invented: only non-negative ints count, and null means unknown.
    Anthropic's ``input_tokens`` excludes cached tokens, so cache reads and writes are
    folded into ``tokens_in``; OpenAI usage already includes them and is left alone.
    """
    if not isinstance(usage, Mapping):
        return {
            "tokens_in": None,
            "tokens_out": None,
            "tokens_reasoning": None,
            "tokens_total": None,
            "cache_creation_tokens": None,
        }
    tokens_in = _count(usage.get("input_tokens"))
    if tokens_in is None:
        tokens_in = _count(usage.get("prompt_tokens"))
    tokens_out = _count(usage.get("output_tokens"))
    if tokens_out is None:
        tokens_out = _count(usage.get("completion_tokens"))
    cache_read = _count(usage.get("cache_read_input_tokens"))
    cache_creation = _count(usage.get("cache_creation_input_tokens"))
    if cache_read is not None or cache_creation is not None:
        cached = (cache_read or 0) + (cache_creation or 0)
        if tokens_in is not None or cached > 0:
            tokens_in = (tokens_in or 0) + cached
    tokens_total = _count(usage.get("total_tokens"))
    if tokens_total is None and tokens_in is not None and tokens_out is not None:
        tokens_total = tokens_in + tokens_out
    reasoning = _detail_count(
        usage, ("output_tokens_details", "completion_tokens_details"), ("reasoning_tokens",)
    )
    if reasoning is None:
        reasoning = _count(usage.get("reasoning_output_tokens"))
    return {
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "tokens_reasoning": reasoning,
        "tokens_total": tokens_total,
        "cache_creation_tokens": cache_creation,
    }


def cache_signal(usage: Any) -> tuple[bool | None, int | None]:
    """``(cache_hit, cached_tokens)``; both null when the usage does not say."""
    if not isinstance(usage, Mapping):
        return None, None
    cached = _detail_count(
        usage, ("prompt_tokens_details", "input_tokens_details"), ("cached_tokens", "cached_input_tokens")
    )
    if cached is None:
        cached = _count(usage.get("cache_read_input_tokens"))
    if cached is None:
        cached = _count(usage.get("cached_input_tokens"))
    if cached is None:
        return None, None
    return cached > 0, cached


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as data: JSON strings parsed, else ``{"_raw": s}``; non-objects ``{}``."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            # orjson is stricter than the json module (NaN, lone surrogates, huge ints).
            try:
                return json.loads(arguments)
            except (ValueError, RecursionError):
                return {"_raw": arguments}
    return {}


def tool_calls_and_reasoning(response: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Tool calls and reasoning text from the first response shape present."""
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    output = response.get("output")
    if isinstance(output, list):  # Responses
        for item in output:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "function_call":
                calls.append(
                    {
                        "call_id": item.get("call_id") or item.get("id"),
                        "name": item.get("name"),
                        "arguments": parse_arguments(item.get("arguments")),
                    }
                )
            elif kind == "reasoning":
                for summary in item.get("summary") or ():
                    text = summary.get("text") if isinstance(summary, dict) else None
                    if isinstance(text, str) and text:
                        reasoning.append(text)
        return calls, "\n".join(reasoning) or None
    choices = response.get("choices")
    if isinstance(choices, list):  # Chat Completions
        for choice in choices:
            message = choice.get("message") if isinstance(choice, dict) else None
            if not isinstance(message, dict):
                continue
            for tool_call in message.get("tool_calls") or ():
                if not isinstance(tool_call, dict):
                    continue
                function = tool_call.get("function")
                if not isinstance(function, dict):
                    function = {}
                calls.append(
                    {
                        "call_id": tool_call.get("id"),
                        "name": function.get("name"),
                        "arguments": parse_arguments(function.get("arguments")),
                    }
                )
            text = message.get("reasoning_content") or message.get("reasoning")
            if isinstance(text, str) and text:
                reasoning.append(text)
        return calls, "\n".join(reasoning) or None
    content = response.get("content")
    if isinstance(content, list):  # Anthropic Messages
        for block in content:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "tool_use":
                calls.append(
                    {
                        "call_id": block.get("id"),
                        "name": block.get("name"),
                        "arguments": parse_arguments(block.get("input")),
                    }
                )
            elif kind in ("thinking", "redacted_thinking") and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        return calls, "\n".join(reasoning) or None
    return calls, None


def _finish_reason(response: Mapping[str, Any]) -> str | None:
    choices = response.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    details = response.get("incomplete_details")
    if not isinstance(details, dict):
        details = {}
    for value in (response.get("stop_reason"), first.get("finish_reason"), details.get("reason")):
        if isinstance(value, str):
            return value
    return None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _raw_fields(row: Mapping[str, Any], call_index: int) -> dict[str, Any]:
    """The call record's fields before typing: what pydantic would be handed."""
    raw_response = row.get("response")
    response = raw_response if isinstance(raw_response, dict) else {}
    raw_request = row.get("request")
    request = raw_request if isinstance(raw_request, dict) else {}
    usage = response.get("usage")
    tokens = extract_token_stats(usage)
    cache_hit, cached_tokens = cache_signal(usage)
    tool_calls, reasoning = tool_calls_and_reasoning(response)
    model = response.get("model") or request.get("model")
    return {
        "model_call_id": row.get("model_call_id"),
        "response_id": _str_or_none(response.get("id")),
        "client_session_id": _str_or_none(row.get("client_session_id")),
        "call_index": call_index,
        "model_ref": row.get("model_ref"),
        "model": _str_or_none(model),
        "dialect": row.get("dialect"),
        "status_code": row.get("status_code"),
        "response_status": _str_or_none(response.get("status")),
        "finish_reason": _finish_reason(response),
        "started_at": row.get("started_at"),
        "completed_at": row.get("completed_at"),
        "tokens_in": tokens["tokens_in"],
        "tokens_out": tokens["tokens_out"],
        "tokens_reasoning": tokens["tokens_reasoning"],
        "tokens_total": tokens["tokens_total"],
        "request": raw_request if isinstance(raw_request, dict) else None,
        "response": raw_response if isinstance(raw_response, dict) else None,
        "request_raw": _str_or_none(row.get("request_raw")),
        "response_raw": _str_or_none(row.get("response_raw")),
        "tool_calls": tool_calls,
        "reasoning_content": reasoning,
        "cache_hit": cache_hit,
        "cached_tokens": cached_tokens,
        "cache_creation_tokens": tokens["cache_creation_tokens"],
        "error_category": row.get("error_category"),
        "latency_total_ms": row.get("latency_ms"),
        "latency_ttft_ms": row.get("latency_ttft_ms"),
        "verifier_invocation_id": row.get("verifier_invocation_id"),
    }


def build_model_call_record(row: Mapping[str, Any], *, call_index: int) -> ModelCallRecord:
    """The typed call record of one model-call row; raises ``ValidationError`` on bad fields."""
    return ModelCallRecord.model_validate(_raw_fields(row, call_index))


# Fields whose raw value comes straight from the row, by the type pydantic would give them.
_STR_FIELDS = ("model_call_id", "dialect", "error_category", "verifier_invocation_id")
_FLOAT_FIELDS = ("started_at", "completed_at", "latency_total_ms", "latency_ttft_ms")


def _canonical(fields: dict[str, Any]) -> bool:
    """True when pydantic would return every row-supplied field unchanged (or int to float)."""
    for name in _STR_FIELDS:
        value = fields[name]
        if value is not None and type(value) is not str:
            return False
    for name in _FLOAT_FIELDS:
        value = fields[name]
        if value is None or type(value) is float:
            continue
        if type(value) is int:
            fields[name] = float(value)
            continue
        return False
    status = fields["status_code"]
    if status is not None and type(status) is not int:
        return False
    ref = fields["model_ref"]
    if ref is not None:
        if not (
            type(ref) is dict
            and len(ref) == 2
            and ref.get("type") == "responses_api_models"
            and type(ref.get("name")) is str
        ):
            return False
        fields["model_ref"] = {"type": ref["type"], "name": ref["name"]}
    return True


def call_record_dict(
    row: Mapping[str, Any], call_index: int, *, include_payloads: bool = True
) -> dict[str, Any]:
    """``build_model_call_record(row).model_dump()``, built directly when possible.

    Payload fields are dropped unless ``include_payloads``. Raises ``ValidationError``
    exactly when :func:`build_model_call_record` does.
    """
    fields = _raw_fields(row, call_index)
    if not _canonical(fields):
        fields = ModelCallRecord.model_validate(fields).model_dump()
    if not include_payloads:
        for name in PAYLOAD_FIELDS:
            del fields[name]
    return fields


def verifier_invocation_dict(
    row: Mapping[str, Any], call_index: int, *, include_payloads: bool
) -> dict[str, Any]:
    """The dumped :class:`VerifierInvocation` of one verifier row (``model_call_ids`` filled later)."""
    raw_request = row.get("request")
    raw_response = row.get("response")
    record = VerifierInvocation.model_validate(
        {
            "verifier_invocation_id": row.get("verifier_invocation_id"),
            "call_index": call_index,
            "verifier_ref": row.get("verifier_ref"),
            "started_at": row.get("started_at"),
            "completed_at": row.get("completed_at"),
            "latency_ms": row.get("latency_ms"),
            "status_code": row.get("status_code"),
            "error_category": row.get("error_category"),
            "reward": row.get("reward"),
            "request": raw_request if isinstance(raw_request, dict) else None,
            "response": raw_response if isinstance(raw_response, dict) else None,
        }
    )
    return record.model_dump(exclude=None if include_payloads else {"request", "response"})
