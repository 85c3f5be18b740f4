"""Fast path of :func:`call_records.call_record_dict` (the reference); tests/test_call_records_fast.py.

That test proves the two equal on any row. Capture rows are read by a typed decoder that
skips what a call record does not use. A merge without payloads needs a dozen scalars of a
row and a few parts of its response
(id, model, status, usage, finish reason, tool calls, reasoning), never the request's
conversation nor the response's text. msgspec decodes just those into typed structs,
skipping the rest unbuilt; the record is built from them. Same output as the full path
(``orjson`` rows, :func:`rollout_capture.call_records.call_record_dict`), which stays
for payloads and for every row the typed path does not take:

- a row whose values have another type or shape than the structs below (msgspec refuses
  it; the full path decides, coercing or counting damage as it always has);
- a row orjson would refuse although msgspec reads it: invalid UTF-8 in a skipped string,
  or nesting as deep as orjson's limit (skipped parts are not checked for them);
- a tool call whose arguments orjson cannot read.

Integers are bounded to int64 and floats to finite doubles: outside, orjson reads them
otherwise (a float, or an error), so the full path decides. The one difference left: a
number beyond double range in a part that is skipped (valid JSON, which orjson refuses)
does not make the row unreadable here.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

import msgspec
import orjson
from msgspec import Raw

from rollout_capture.call_records import BuiltCall, call_record_fields_template, parse_arguments

Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
"""The integers orjson reads as ints (it reads larger ones as floats)."""
Scalar = str | Int | float | bool | None
"""Any JSON scalar; an array or object in its place sends the row to the full path."""

ORJSON_MAX_DEPTH = 1024
"""orjson refuses documents nested deeper than this; msgspec may read them."""


# The parts of a response that call records read; keys they do not read are skipped.
# Every field defaults to None, as ``dict.get`` gives for a missing key.
class _Details(msgspec.Struct, gc=False):
    reasoning_tokens: Scalar = None
    cached_tokens: Scalar = None
    cached_input_tokens: Scalar = None


_AnyDetails = _Details | Scalar


class _Usage(msgspec.Struct, gc=False):
    input_tokens: Scalar = None
    prompt_tokens: Scalar = None
    output_tokens: Scalar = None
    completion_tokens: Scalar = None
    cache_read_input_tokens: Scalar = None
    cache_creation_input_tokens: Scalar = None
    total_tokens: Scalar = None
    reasoning_output_tokens: Scalar = None
    cached_input_tokens: Scalar = None
    output_tokens_details: _AnyDetails = None
    completion_tokens_details: _AnyDetails = None
    prompt_tokens_details: _AnyDetails = None
    input_tokens_details: _AnyDetails = None


class _Summary(msgspec.Struct, gc=False):
    text: Scalar = None


class _OutputItem(msgspec.Struct, gc=False):
    type: Scalar = None
    call_id: Scalar = None
    id: Scalar = None
    name: Scalar = None
    arguments: Raw = None  # type: ignore[assignment]  # None: absent
    summary: list[_Summary | Scalar] | Scalar = None


class _Function(msgspec.Struct, gc=False):
    name: Scalar = None
    arguments: Raw = None  # type: ignore[assignment]


class _ToolCall(msgspec.Struct, gc=False):
    id: Scalar = None
    function: _Function | Scalar = None


class _Message(msgspec.Struct, gc=False):
    tool_calls: list[_ToolCall | Scalar] | Scalar = None
    reasoning_content: Scalar = None
    reasoning: Scalar = None


class _Choice(msgspec.Struct, gc=False):
    message: _Message | Scalar = None
    finish_reason: Scalar = None


class _Block(msgspec.Struct, gc=False):
    type: Scalar = None
    id: Scalar = None
    name: Scalar = None
    input: Raw = None  # type: ignore[assignment]
    thinking: Scalar = None


class _Incomplete(msgspec.Struct, gc=False):
    reason: Scalar = None


class _Response(msgspec.Struct, gc=False):
    id: Scalar = None
    model: Scalar = None
    status: Scalar = None
    stop_reason: Scalar = None
    usage: _Usage | Scalar = None
    incomplete_details: _Incomplete | Scalar = None
    output: list[_OutputItem | Scalar] | Scalar = None
    choices: list[_Choice | Scalar] | Scalar = None
    content: list[_Block | Scalar] | Scalar = None


class _Request(msgspec.Struct, gc=False):
    model: Scalar = None


class _ModelRef(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    type: Literal["responses_api_models"]
    name: str


class _Row(msgspec.Struct, gc=False):
    """A capture row's fields with the types a call record takes as they are (all the fast path reads)."""

    kind: str | None = None
    model_call_id: str | None = None
    dialect: str | None = None
    error_category: str | None = None
    verifier_invocation_id: str | None = None
    client_session_id: Scalar = None
    status_code: Int | None = None
    started_at: float | None = None
    completed_at: float | None = None
    latency_ms: float | None = None
    latency_ttft_ms: float | None = None
    capture_hold_ms: float | None = None
    upstream_attempted: bool | None = None
    response_source: Literal["upstream", "local"] | None = None
    upstream_status_code: Int | None = None
    local_response_reason: str | None = None
    model_ref: _ModelRef | None = None
    request: _Request | None = None
    response: _Response | None = None
    # verifier rows
    verifier_ref: dict[str, Scalar] | Scalar = None
    reward: Scalar = None


_decode = msgspec.json.Decoder(_Row).decode
typed_decode = _decode
"""A capture line as a typed row (raises ``msgspec.DecodeError``, ``RecursionError``)."""
_FIELDS = call_record_fields_template()
_REF_KIND = "responses_api_models"


class Untyped(Exception):
    """The fast path does not take this row: read it the reference way (the full orjson path)."""


_probe = msgspec.json.Decoder().decode
_guarded_at: tuple[int, bool] | None = None


def _depth_needs_a_check() -> bool:
    """Whether msgspec could read nesting orjson refuses, in this interpreter as set now.

    Up to Python 3.11 msgspec's depth is bounded by the recursion limit; later ones bound
    it by a C limit of their own, so it is tried once per recursion limit.
    """
    global _guarded_at
    limit = sys.getrecursionlimit()
    if _guarded_at is None or _guarded_at[0] != limit:
        if sys.version_info < (3, 12):
            needed = limit > ORJSON_MAX_DEPTH
        else:
            try:
                _probe(b"[" * ORJSON_MAX_DEPTH + b"]" * ORJSON_MAX_DEPTH)
                needed = True
            except RecursionError:
                needed = False
        _guarded_at = (limit, needed)
    return _guarded_at[1]


def orjson_reads(line: bytes) -> bool:
    """Whether orjson would read what msgspec read: its checks that skipping leaves out.

    UTF-8 only matters past ASCII; depth only where msgspec could go that deep and the
    line holds enough brackets for it.
    """
    if not line.isascii():
        try:
            line.decode()
        except UnicodeDecodeError:
            return False
    return not (
        len(line) >= 2 * ORJSON_MAX_DEPTH
        and _depth_needs_a_check()
        and line.count(b"[") + line.count(b"{") >= ORJSON_MAX_DEPTH
    )


def typed_row(line: bytes, call_index: int, *, checked: bool = False) -> BuiltCall | dict[str, Any]:
    """Fast path of ``call_record_dict(orjson.loads(line))`` (the reference); tests/test_call_records_fast.py.

    The row of one capture line as the typed path reads it, or :class:`Untyped`. A model call
    comes back as its built record; any other kind as the fields its reader uses (a verifier
    row) or just its kind. ``checked``: :func:`orjson_reads` already
    holds for bytes holding this line.
    """
    try:
        row = _decode(line)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        raise Untyped from None
    if not (checked or orjson_reads(line)):
        raise Untyped
    return typed_of(row, call_index)


def typed_of(row: _Row, call_index: int) -> BuiltCall | dict[str, Any]:
    """Fast path of :func:`call_record_dict` (the reference); tests/test_call_records_fast.py.

    :func:`typed_row` of a row already decoded (and checked).
    """
    kind = row.kind
    if kind is None or kind == "model_call":
        try:
            return BuiltCall(typed_record(row, call_index))
        except orjson.JSONDecodeError:  # a tool call's arguments orjson cannot read
            raise Untyped from None
    if kind == "verifier_invocation":
        return {
            "kind": kind,
            "verifier_invocation_id": row.verifier_invocation_id,
            "verifier_ref": row.verifier_ref,
            "status_code": row.status_code,
            "error_category": row.error_category,
            "started_at": row.started_at,
            "completed_at": row.completed_at,
            "latency_ms": row.latency_ms,
            "reward": row.reward,
        }
    return {"kind": kind}


# The normalization of rollout_capture.call_records over the typed parts, step for step:
# attributes for keys, a struct's type for "is a dict". tests/test_call_records_fast.py pins the
# two to each other.

_NO_USAGE = (None, None, None, None, None, None, None)


def _cached_count(details: _Details) -> int | None:
    """Fast path of :func:`call_records._detail_count` (the reference); tests/test_call_records_fast.py.

    The first valid count among a details group's ``cached_tokens`` and ``cached_input_tokens``.
    """
    value = details.cached_tokens
    if type(value) is int and value >= 0:
        return value
    value = details.cached_input_tokens
    if type(value) is int and value >= 0:
        return value
    return None


def _reasoning_count(details: _Details) -> int | None:
    """Fast path of ``call_records._detail_count(details, "reasoning_tokens")`` (the reference)."""
    value = details.reasoning_tokens
    return value if type(value) is int and value >= 0 else None


def _usage_stats(
    usage: Any,
) -> tuple[int | None, int | None, int | None, int | None, int | None, bool | None, int | None]:
    """Fast path of :func:`call_records.usage_stats` (the reference); tests/test_call_records_fast.py.

    The same counts of a typed usage, step for step.
    """
    if type(usage) is not _Usage:
        return _NO_USAGE
    tokens_in: Any = usage.input_tokens
    if type(tokens_in) is not int or tokens_in < 0:
        tokens_in = usage.prompt_tokens
        if type(tokens_in) is not int or tokens_in < 0:
            tokens_in = None
    tokens_out: Any = usage.output_tokens
    if type(tokens_out) is not int or tokens_out < 0:
        tokens_out = usage.completion_tokens
        if type(tokens_out) is not int or tokens_out < 0:
            tokens_out = None
    cache_read: Any = usage.cache_read_input_tokens
    if type(cache_read) is not int or cache_read < 0:
        cache_read = None
    cache_creation: Any = usage.cache_creation_input_tokens
    if type(cache_creation) is not int or cache_creation < 0:
        cache_creation = None
    if cache_read is not None or cache_creation is not None:
        cached = (cache_read or 0) + (cache_creation or 0)
        if tokens_in is not None or cached > 0:
            tokens_in = (tokens_in or 0) + cached
    tokens_total: Any = usage.total_tokens
    if type(tokens_total) is not int or tokens_total < 0:
        tokens_total = None if tokens_in is None or tokens_out is None else tokens_in + tokens_out
    # A details group is looked into only where there is one.
    details: Any = usage.output_tokens_details
    reasoning: Any = _reasoning_count(details) if type(details) is _Details else None
    if reasoning is None:
        details = usage.completion_tokens_details
        reasoning = _reasoning_count(details) if type(details) is _Details else None
        if reasoning is None:
            reasoning = usage.reasoning_output_tokens
            if type(reasoning) is not int or reasoning < 0:
                reasoning = None
    cached_tokens: Any = None
    details = usage.prompt_tokens_details
    if type(details) is _Details:
        cached_tokens = _cached_count(details)
    if cached_tokens is None:
        details = usage.input_tokens_details
        if type(details) is _Details:
            cached_tokens = _cached_count(details)
        if cached_tokens is None:
            cached_tokens = cache_read
            if cached_tokens is None:
                cached_tokens = usage.cached_input_tokens
                if type(cached_tokens) is not int or cached_tokens < 0:
                    return tokens_in, tokens_out, reasoning, tokens_total, cache_creation, None, None
    return tokens_in, tokens_out, reasoning, tokens_total, cache_creation, cached_tokens > 0, cached_tokens


def _calls_and_reasoning(response: _Response) -> tuple[list[dict[str, Any]], str | None]:
    """Fast path of :func:`call_records.calls_and_reasoning` (the reference); tests/test_call_records_fast.py.

    Tool calls and reasoning text of a typed response, dialect by dialect as the reference.
    """
    output = response.output
    if type(output) is list:
        return _responses_calls(output)
    choices = response.choices
    if type(choices) is list:
        return _chat_calls(choices)
    content = response.content
    if type(content) is list:
        return _messages_calls(content)
    return [], None


def _responses_calls(output: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Fast path of :func:`call_records._responses_calls` (the reference) over typed items."""
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for item in output:
        if type(item) is not _OutputItem:
            continue
        kind = item.type
        if kind == "function_call":
            calls.append(
                {
                    "call_id": item.call_id or item.id,
                    "name": item.name,
                    "arguments": parse_arguments(item.arguments),
                }
            )
        elif kind == "reasoning":
            summaries = item.summary
            for summary in summaries if type(summaries) is list else ():
                text = summary.text if type(summary) is _Summary else None
                if type(text) is str and text:
                    reasoning.append(text)
    return calls, "\n".join(reasoning) or None


def _chat_calls(choices: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Fast path of :func:`call_records._chat_calls` (the reference) over typed choices."""
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for choice in choices:
        message = choice.message if type(choice) is _Choice else None
        if type(message) is not _Message:
            continue
        tool_calls = message.tool_calls
        for tool_call in tool_calls if type(tool_calls) is list else ():
            if type(tool_call) is not _ToolCall:
                continue
            function = tool_call.function
            name, arguments = (
                (function.name, function.arguments) if type(function) is _Function else (None, None)
            )
            calls.append({"call_id": tool_call.id, "name": name, "arguments": parse_arguments(arguments)})
        text = message.reasoning_content or message.reasoning
        if type(text) is str and text:
            reasoning.append(text)
    return calls, "\n".join(reasoning) or None


def _messages_calls(content: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Fast path of :func:`call_records._messages_calls` (the reference) over typed blocks."""
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        if type(block) is not _Block:
            continue
        kind = block.type
        if kind == "tool_use":
            calls.append({"call_id": block.id, "name": block.name, "arguments": parse_arguments(block.input)})
        elif (kind == "thinking" or kind == "redacted_thinking") and type(block.thinking) is str:
            reasoning.append(block.thinking)
    return calls, "\n".join(reasoning) or None


def _fill_from_response(fields: dict[str, Any], response: _Response, request: _Request | None) -> Any:
    """Fast path of :func:`call_records._fill_from_response` (the reference); returns the model."""
    (
        fields["tokens_in"],
        fields["tokens_out"],
        fields["tokens_reasoning"],
        fields["tokens_total"],
        fields["cache_creation_tokens"],
        fields["cache_hit"],
        fields["cached_tokens"],
    ) = _usage_stats(response.usage)
    fields["tool_calls"], fields["reasoning_content"] = _calls_and_reasoning(response)
    value = response.id
    if type(value) is str:
        fields["response_id"] = value
    value = response.status
    if type(value) is str:
        fields["response_status"] = value
    # finish_reason: the first string among stop_reason, choices[0].finish_reason and
    # incomplete_details.reason (spec section 5; the reference's _finish_reason, written out).
    finish = response.stop_reason
    if type(finish) is not str:
        finish = None
        choices = response.choices
        if type(choices) is list and choices and type(choices[0]) is _Choice:
            finish = choices[0].finish_reason
            if type(finish) is not str:
                finish = None
        if finish is None:
            details = response.incomplete_details
            if type(details) is _Incomplete:
                finish = details.reason
                if type(finish) is not str:
                    finish = None
    fields["finish_reason"] = finish
    return response.model or (None if request is None else request.model)


def typed_record(row: _Row, call_index: int) -> dict[str, Any]:
    """Fast path of :func:`call_record_dict` (the reference); tests/test_call_records_fast.py proves it.

    ``call_record_dict(row, call_index, include_payloads=False)`` of a typed row.
    Every typed field already has its record type, so nothing is validated here; the
    rest follows :func:`rollout_capture.call_records._raw_fields` step for step.
    """
    response, request = row.response, row.request
    fields = _FIELDS.copy()
    if response is None:
        model: Any = None if request is None else request.model
        fields["tool_calls"] = []
    else:
        model = _fill_from_response(fields, response, request)
    ref = row.model_ref
    session = row.client_session_id
    fields["model_call_id"] = row.model_call_id
    if type(session) is str:
        fields["client_session_id"] = session
    fields["call_index"] = call_index
    if ref is not None:
        fields["model_ref"] = {"type": _REF_KIND, "name": ref.name}
    if type(model) is str:
        fields["model"] = model
    fields["dialect"] = row.dialect
    fields["status_code"] = row.status_code
    fields["started_at"] = row.started_at
    fields["completed_at"] = row.completed_at
    fields["error_category"] = row.error_category
    fields["latency_total_ms"] = row.latency_ms
    fields["latency_ttft_ms"] = row.latency_ttft_ms
    fields["verifier_invocation_id"] = row.verifier_invocation_id
    if row.upstream_attempted is not None or row.response_source is not None:  # NeMo Gym 0.7's servers
        fields["upstream_attempted"] = row.upstream_attempted
        fields["response_source"] = row.response_source
    if row.upstream_status_code is not None or row.local_response_reason is not None:
        fields["upstream_status_code"] = row.upstream_status_code
        fields["local_response_reason"] = row.local_response_reason
    if row.capture_hold_ms is not None:  # only when the row carries it, as the full path
        fields["capture_hold_ms"] = row.capture_hold_ms
    return fields
