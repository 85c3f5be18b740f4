"""Call records (spec 4, 5): golden rows per dialect, normalization properties, fast path."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollout_capture import ModelCallRecord, build_model_call_record, extract_token_stats
from rollout_capture.call_records import (
    VerifierInvocation,
    call_record_dict,
    parse_arguments,
    verifier_invocation_dict,
)

SPEC_FIELDS = [
    "model_call_id", "response_id", "client_session_id", "call_index", "model_ref", "model", "dialect",
    "status_code", "response_status", "finish_reason", "upstream_attempted", "response_source",
    "upstream_status_code", "local_response_reason", "started_at", "completed_at", "tokens_in",
    "tokens_out", "tokens_reasoning", "tokens_total", "request", "response", "request_raw", "response_raw",
    "tool_calls", "reasoning_content", "cache_hit", "cached_tokens", "cache_creation_tokens",
    "error_category", "latency_total_ms", "latency_ttft_ms", "verifier_invocation_id",
]  # fmt: skip
REF = {"type": "responses_api_models", "name": "policy"}


def responses_row() -> dict[str, Any]:
    return {
        "model_call_id": "a1",
        "dialect": "responses",
        "model_ref": REF,
        "started_at": 100,
        "completed_at": 101.5,
        "latency_ms": 1500,
        "latency_ttft_ms": 120.5,
        "status_code": 200,
        "error_category": None,
        "client_session_id": "sess-1",
        "request": {"model": "req-model", "input": "hi"},
        "response": {
            "id": "resp_1",
            "model": "gpt-x",
            "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [
                {"type": "reasoning", "summary": [{"text": "think 1"}, {"text": ""}, {"text": "think 2"}]},
                {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": '{"q": "x"}'},
                {"type": "function_call", "id": "fc_2", "name": "bad", "arguments": "not json"},
                "junk",
                {"type": "function_call", "call_id": "c3", "name": "n", "arguments": 7},
                {"type": "message", "content": [{"type": "output_text", "text": "done"}]},
            ],
            "usage": {
                "input_tokens": 100,
                "input_tokens_details": {"cached_tokens": 40},
                "output_tokens": 20,
                "output_tokens_details": {"reasoning_tokens": 5},
                "total_tokens": 120,
            },
        },
    }


def test_responses_row_golden() -> None:
    row = responses_row()
    record = call_record_dict(row, 3)
    assert record == {
        "model_call_id": "a1",
        "response_id": "resp_1",
        "client_session_id": "sess-1",
        "call_index": 3,
        "model_ref": REF,
        "model": "gpt-x",
        "dialect": "responses",
        "status_code": 200,
        "response_status": "incomplete",
        "finish_reason": "max_output_tokens",
        "upstream_attempted": None,
        "response_source": None,
        "upstream_status_code": None,
        "local_response_reason": None,
        "started_at": 100.0,
        "completed_at": 101.5,
        "tokens_in": 100,
        "tokens_out": 20,
        "tokens_reasoning": 5,
        "tokens_total": 120,
        "request": row["request"],
        "response": row["response"],
        "request_raw": None,
        "response_raw": None,
        "tool_calls": [
            {"call_id": "call_1", "name": "search", "arguments": {"q": "x"}},
            {"call_id": "fc_2", "name": "bad", "arguments": {"_raw": "not json"}},
            {"call_id": "c3", "name": "n", "arguments": {}},
        ],
        "reasoning_content": "think 1\nthink 2",
        "cache_hit": True,
        "cached_tokens": 40,
        "cache_creation_tokens": None,
        "error_category": None,
        "latency_total_ms": 1500.0,
        "latency_ttft_ms": 120.5,
        "verifier_invocation_id": None,
    }
    assert list(record) == SPEC_FIELDS
    assert type(record["started_at"]) is float  # an int timestamp becomes a float, as pydantic makes it


def test_the_capture_hold_is_carried_only_where_the_row_has_it() -> None:
    """A producer's hold (spec 11) reaches the record as ``capture_hold_ms``; NeMo Gym's rows, which
    never carry it, give NeMo Gym's records exactly (no extra key)."""
    row = responses_row()
    assert "capture_hold_ms" not in call_record_dict(row, 0)
    held = call_record_dict({**row, "capture_hold_ms": 118}, 0)
    assert held["capture_hold_ms"] == 118.0 and type(held["capture_hold_ms"]) is float
    assert list(held) == [*SPEC_FIELDS, "capture_hold_ms"]
    slow = call_record_dict({**row, "capture_hold_ms": 118, "started_at": "100"}, 0)  # pydantic's way
    assert slow["capture_hold_ms"] == 118.0 and list(slow) == list(held)


def test_nemo_gym_07_execution_facts_are_carried_and_null_stays_null() -> None:
    """NeMo Gym 0.7's model servers write whether the upstream was tried and who answered; its
    records carry them (null when a row has none): ours too, in its place (issue 34)."""
    local = {
        **responses_row(),
        "upstream_attempted": True,
        "response_source": "local",
        "upstream_status_code": None,
        "local_response_reason": "context_length_exceeded",
        "error_category": "context_length_exceeded",
    }
    record = call_record_dict(local, 0)
    assert list(record) == SPEC_FIELDS
    assert (
        record["upstream_attempted"],
        record["response_source"],
        record["upstream_status_code"],
        record["local_response_reason"],
    ) == (True, "local", None, "context_length_exceeded")
    forwarded = {**responses_row(), "response_source": "upstream", "upstream_status_code": 429}
    upstream = call_record_dict(forwarded, 0)
    assert (upstream["response_source"], upstream["upstream_status_code"]) == ("upstream", 429)
    plain = call_record_dict(responses_row(), 0)  # rows of older producers: all four null, never dropped
    assert [plain[k] for k in SPEC_FIELDS[10:14]] == [None] * 4
    with pytest.raises(ValidationError):  # NeMo Gym's Literal: another source is a damaged row
        call_record_dict({**responses_row(), "response_source": "cache"}, 0)


def test_chat_row_golden() -> None:
    row = {
        "model_call_id": "c1",
        "dialect": "chat",
        "model_ref": REF,
        "status_code": 200,
        "request": {"model": "req-model", "messages": []},
        "response": {
            "id": "chatcmpl-1",
            "choices": [
                {
                    "finish_reason": "tool_calls",
                    "message": {
                        "content": None,
                        "reasoning_content": "",
                        "reasoning": "vllm reasoning",
                        "tool_calls": [
                            {"id": "t1", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}},
                            {"id": "t2", "function": "not an object"},
                            5,
                        ],
                    },
                },
                {"message": {"reasoning_content": "second choice"}},
            ],
            "usage": {
                "prompt_tokens": 50,
                "completion_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 3},
            },
        },
    }
    record = call_record_dict(row, 0, include_payloads=False)
    assert record["model"] == "req-model"  # the response names none
    assert record["response_id"] == "chatcmpl-1"
    assert record["finish_reason"] == "tool_calls"
    assert record["tool_calls"] == [
        {"call_id": "t1", "name": "f", "arguments": {"a": [1, 2]}},
        {"call_id": "t2", "name": None, "arguments": {}},
    ]
    assert record["reasoning_content"] == "vllm reasoning\nsecond choice"
    assert (record["tokens_in"], record["tokens_out"], record["tokens_total"]) == (50, 10, 60)
    assert (record["tokens_reasoning"], record["cached_tokens"], record["cache_hit"]) == (3, 0, False)
    assert not set(record) & {"request", "response", "request_raw", "response_raw"}


def test_messages_row_folds_anthropic_cache_into_tokens_in() -> None:
    row = {
        "model_call_id": "m1",
        "dialect": "messages",
        "model_ref": REF,
        "response": {
            "id": "msg_1",
            "model": "claude",
            "stop_reason": "tool_use",
            "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "redacted_thinking", "data": "x"},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "tu1", "name": "bash", "input": {"cmd": "ls"}},
                {"type": "tool_use", "id": "tu2", "name": "s", "input": '{"k": 1}'},
            ],
            "usage": {
                "input_tokens": 10,
                "output_tokens": 7,
                "cache_read_input_tokens": 90,
                "cache_creation_input_tokens": 5,
            },
        },
    }
    record = call_record_dict(row, 1)
    assert record["finish_reason"] == "tool_use"
    assert record["reasoning_content"] == "hmm"
    assert record["tool_calls"] == [
        {"call_id": "tu1", "name": "bash", "arguments": {"cmd": "ls"}},
        {"call_id": "tu2", "name": "s", "arguments": {"k": 1}},
    ]
    assert (record["tokens_in"], record["tokens_total"]) == (105, 112)
    assert (record["cached_tokens"], record["cache_hit"], record["cache_creation_tokens"]) == (90, True, 5)


def test_failed_call_row_keeps_raw_bodies_and_category() -> None:
    row = {
        "model_call_id": "e1",
        "dialect": "chat",
        "model_ref": None,
        "status_code": 429,
        "error_category": "rate_limit",
        "request": None,
        "request_raw": "not-json-body",
        "response": None,
        "response_raw": '{"error": "slow down"}',
        "latency_ms": 12.25,
    }
    record = call_record_dict(row, 0)
    assert record["error_category"] == "rate_limit"
    assert record["request"] is None and record["response"] is None
    assert record["request_raw"] == "not-json-body"
    assert record["response_raw"] == '{"error": "slow down"}'
    assert record["tokens_in"] is None and record["tool_calls"] == [] and record["model_ref"] is None


@pytest.mark.parametrize(
    "bad",
    [
        {"model_ref": {"type": "resources_servers", "name": "x"}},
        {"model_ref": "policy"},
        {"started_at": "yesterday"},
        {"status_code": 200.5},
        {"model_call_id": 12},
        {"error_category": ["x"]},
    ],
)
def test_rows_with_invalid_typed_fields_fail_validation(bad: dict[str, Any]) -> None:
    row = {**responses_row(), **bad}
    with pytest.raises(ValidationError):
        call_record_dict(row, 0)
    with pytest.raises(ValidationError):
        build_model_call_record(row, call_index=0)


def test_lax_values_are_coerced_like_pydantic() -> None:
    row = {**responses_row(), "status_code": "200", "started_at": True, "model_ref": {**REF, "extra": 1}}
    record = call_record_dict(row, 0)
    assert record["status_code"] == 200
    assert record["started_at"] == 1.0
    assert record["model_ref"] == REF


def test_arguments_parsing() -> None:
    assert parse_arguments('{"a": 1}') == {"a": 1}
    assert parse_arguments("[1, 2]") == [1, 2]
    assert parse_arguments("NaN") != {"_raw": "NaN"}  # json accepts what orjson refuses
    assert parse_arguments("{oops") == {"_raw": "{oops"}
    assert parse_arguments(None) == {} and parse_arguments(3) == {}
    assert parse_arguments("[" * 100_000) == {"_raw": "[" * 100_000}


# ---------------------------------------------------------------- properties

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=5)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
TOKEN_KEYS = [
    "input_tokens", "prompt_tokens", "output_tokens", "completion_tokens", "total_tokens",
    "cache_read_input_tokens", "cache_creation_input_tokens", "reasoning_output_tokens",
    "cached_input_tokens",
]  # fmt: skip
DETAIL_KEYS = [
    "output_tokens_details",
    "completion_tokens_details",
    "prompt_tokens_details",
    "input_tokens_details",
]
counts = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=False), st.text(max_size=3)
)
usages = st.fixed_dictionaries(
    {},
    optional={
        **{k: counts for k in TOKEN_KEYS},
        **{
            k: st.one_of(
                counts,
                st.fixed_dictionaries(
                    {},
                    optional={
                        "reasoning_tokens": counts,
                        "cached_tokens": counts,
                        "cached_input_tokens": counts,
                    },
                ),
            )
            for k in DETAIL_KEYS
        },
    },
)


openai_counts = st.integers(0, 10**6)
openai_usages = st.builds(
    lambda prompt, cached, out, names, details: {
        names[0]: prompt,
        names[1]: out,
        "total_tokens": prompt + out,
        details: {"cached_tokens": min(cached, prompt)},
    },
    openai_counts,
    openai_counts,
    openai_counts,
    st.sampled_from([("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")]),
    st.sampled_from(["prompt_tokens_details", "input_tokens_details"]),
)
"""OpenAI-shaped usage (Chat Completions or Responses): a prompt size that already includes
its cached tokens, which must never be added again."""


def _valid(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


@given(st.one_of(usages, openai_usages))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_token_counts_are_never_negative_and_never_invented(usage: dict[str, Any]) -> None:
    stats = extract_token_stats(usage)
    for value in stats.values():
        assert value is None or (type(value) is int and value >= 0)
    base_in = _valid(usage.get("input_tokens"))
    if base_in is None:
        base_in = _valid(usage.get("prompt_tokens"))
    cache = [_valid(usage.get("cache_read_input_tokens")), _valid(usage.get("cache_creation_input_tokens"))]
    if all(c is None for c in cache):
        assert stats["tokens_in"] == base_in  # OpenAI usage is never folded
    elif base_in is None and not sum(c or 0 for c in cache):
        assert stats["tokens_in"] is None  # zero cache fields alone do not invent a prompt size
    base_out = _valid(usage.get("output_tokens"))
    assert stats["tokens_out"] == (
        base_out if base_out is not None else _valid(usage.get("completion_tokens"))
    )
    if _valid(usage.get("total_tokens")) is None and (
        stats["tokens_in"] is None or stats["tokens_out"] is None
    ):
        assert stats["tokens_total"] is None  # null stays null
    assert stats["cache_creation_tokens"] == cache[1]


@given(st.one_of(json_scalars, st.lists(json_scalars)))
def test_non_object_usage_gives_all_null(usage: Any) -> None:
    assert all(v is None for v in extract_token_stats(usage).values())


rows = st.fixed_dictionaries(
    {},
    optional={
        "model_call_id": st.one_of(json_values, st.text(max_size=8)),
        "dialect": json_values,
        "model_ref": st.one_of(
            json_values,
            st.just(REF),
            st.fixed_dictionaries(
                {"type": st.sampled_from(["responses_api_models", "x"]), "name": json_values}
            ),
        ),
        "started_at": json_values,
        "completed_at": json_values,
        "latency_ms": json_values,
        "latency_ttft_ms": json_values,
        "status_code": json_values,
        "error_category": json_values,
        "client_session_id": json_values,
        "verifier_invocation_id": json_values,
        "capture_hold_ms": json_values,
        "upstream_attempted": st.one_of(json_values, st.booleans()),
        "response_source": st.one_of(json_values, st.sampled_from(["upstream", "local"])),
        "upstream_status_code": json_values,
        "local_response_reason": json_values,
        "request_raw": json_values,
        "response_raw": json_values,
        "request": st.one_of(json_values, st.fixed_dictionaries({}, optional={"model": json_values})),
        "response": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {},
                optional={
                    "id": json_values,
                    "model": json_values,
                    "status": json_values,
                    "usage": usages,
                    "stop_reason": json_values,
                    "output": st.lists(
                        st.one_of(
                            json_values,
                            st.fixed_dictionaries(
                                {
                                    "type": st.sampled_from(["function_call", "reasoning", "message"]),
                                    "arguments": json_values,
                                    "summary": st.lists(
                                        st.fixed_dictionaries({"text": json_values}), max_size=2
                                    ),
                                }
                            ),
                        ),
                        max_size=3,
                    ),
                },
            ),
        ),
    },
)


@given(rows, st.booleans())
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fast_path_equals_the_pydantic_model(row: dict[str, Any], include_payloads: bool) -> None:
    try:
        expected = build_model_call_record(row, call_index=4).model_dump()
    except ValidationError:
        with pytest.raises(ValidationError):
            call_record_dict(row, 4, include_payloads=include_payloads)
        return
    if not include_payloads:
        for name in ("request", "response", "request_raw", "response_raw"):
            del expected[name]
    if expected["capture_hold_ms"] is None:  # an extension: only where the row carries it
        del expected["capture_hold_ms"]
    got = call_record_dict(row, 4, include_payloads=include_payloads)
    assert got == expected
    assert list(got) == list(expected)
    assert ModelCallRecord.model_validate({**got, "call_index": 4})  # the dumped form is a valid record


number_or_junk = st.one_of(st.none(), st.integers(-5, 10**6), st.floats(allow_nan=False), json_values)
verifier_rows = st.fixed_dictionaries(
    {"verifier_invocation_id": st.one_of(st.text(max_size=8), json_values)},
    optional={
        "kind": st.just("verifier_invocation"),
        "verifier_ref": st.one_of(
            st.none(),
            json_values,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["resources_servers", "responses_api_models"]), "name": json_values}
            ),
            st.fixed_dictionaries(
                {"name": st.text(max_size=3), "type": st.just("resources_servers")},
                optional={"extra": json_values},
            ),
        ),
        "started_at": number_or_junk,
        "completed_at": number_or_junk,
        "latency_ms": number_or_junk,
        "status_code": st.one_of(st.none(), st.integers(100, 599), json_values),
        "error_category": st.one_of(st.none(), st.text(max_size=5), json_values),
        "reward": number_or_junk,
        "request": st.one_of(
            json_values, st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), json_values)
        ),
        "response": st.one_of(json_values, st.dictionaries(st.text(max_size=3), json_values)),
    },
)


@given(verifier_rows, st.booleans())
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_verifier_fast_path_equals_the_pydantic_model(row: dict[str, Any], include_payloads: bool) -> None:
    request, response = row.get("request"), row.get("response")
    fields = {
        "verifier_invocation_id": row.get("verifier_invocation_id"),
        "call_index": 2,
        **{k: row.get(k) for k in ("verifier_ref", "started_at", "completed_at", "latency_ms")},
        **{k: row.get(k) for k in ("status_code", "error_category", "reward")},
        "request": request if isinstance(request, dict) else None,
        "response": response if isinstance(response, dict) else None,
    }
    try:
        expected = VerifierInvocation.model_validate(fields).model_dump()
    except ValidationError:
        with pytest.raises(ValidationError):
            verifier_invocation_dict(row, 2, include_payloads=include_payloads)
        return
    if not include_payloads:
        del expected["request"], expected["response"]
    got = verifier_invocation_dict(row, 2, include_payloads=include_payloads)
    assert got == expected
    assert list(got) == list(expected)
    assert [type(v) for v in got.values()] == [type(v) for v in expected.values()]


def test_list_fields_of_another_shape_hold_no_items() -> None:
    """A reasoning ``summary`` or chat ``tool_calls`` that is not a list is skipped, not a crash."""
    responses = {"output": [{"type": "reasoning", "summary": 5}, {"type": "reasoning", "summary": "text"}]}
    chat = {"choices": [{"message": {"tool_calls": 7, "reasoning_content": "thought"}}]}
    first = build_model_call_record({"dialect": "responses", "response": responses}, call_index=0)
    second = build_model_call_record({"dialect": "chat", "response": chat}, call_index=1)
    assert (first.tool_calls, first.reasoning_content) == ([], None)
    assert (second.tool_calls, second.reasoning_content) == ([], "thought")
