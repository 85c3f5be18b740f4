"""Capture rows to call records (spec sections 4 and 5).

The pydantic models are the contract. Building them is the hot path of a merge, so
:func:`call_record_dict` builds the dumped form directly when every typed field already
has its canonical type, and defers to pydantic otherwise: same output, same errors.
Rows read by the typed decoder (:mod:`rollout_capture.call_records_fast`) arrive as
:class:`BuiltCall`, their record already built.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping
from typing import Any, Literal

import orjson
from msgspec import Raw
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
    upstream_attempted: bool | None = None
    response_source: Literal["upstream", "local"] | None = None
    upstream_status_code: int | None = None
    local_response_reason: str | None = None
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
    capture_hold_ms: float | None = None
    """(extension) How long the producer held the answer's first byte for the call's claim; in a
    dumped record only when the row carries it (so NeMo Gym's rows give NeMo Gym's records)."""


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


def _detail_count(details: Any, name: str, other: str | None = None) -> int | None:
    """The first valid count among ``details[name]`` and ``details[other]`` (a usage details group)."""
    if not (type(details) is dict or isinstance(details, Mapping)):
        return None
    value = details.get(name)
    if type(value) is int and value >= 0:
        return value
    if other is not None:
        value = details.get(other)
        if type(value) is int and value >= 0:
            return value
    return None


_NO_USAGE = (None, None, None, None, None, None, None)


def usage_stats(
    usage: Any,
) -> tuple[int | None, int | None, int | None, int | None, int | None, bool | None, int | None]:
    """``(in, out, reasoning, total, cache_creation, cache_hit, cached)`` from any usage shape.

    Counts are never invented: only non-negative ints count, and null means unknown. Anthropic's
    ``input_tokens`` excludes cached tokens, so cache reads and writes are folded into ``tokens_in``;
    OpenAI usage already includes them and is left alone. Written out key by key: once per call.
    """
    if type(usage) is not dict and (usage is None or not isinstance(usage, Mapping)):
        return _NO_USAGE
    get = usage.get
    tokens_in = get("input_tokens")
    if type(tokens_in) is not int or tokens_in < 0:
        tokens_in = get("prompt_tokens")
        if type(tokens_in) is not int or tokens_in < 0:
            tokens_in = None
    tokens_out = get("output_tokens")
    if type(tokens_out) is not int or tokens_out < 0:
        tokens_out = get("completion_tokens")
        if type(tokens_out) is not int or tokens_out < 0:
            tokens_out = None
    cache_read = get("cache_read_input_tokens")
    if type(cache_read) is not int or cache_read < 0:
        cache_read = None
    cache_creation = get("cache_creation_input_tokens")
    if type(cache_creation) is not int or cache_creation < 0:
        cache_creation = None
    if cache_read is not None or cache_creation is not None:
        cached = (cache_read or 0) + (cache_creation or 0)
        if tokens_in is not None or cached > 0:
            tokens_in = (tokens_in or 0) + cached
    tokens_total = get("total_tokens")
    if type(tokens_total) is not int or tokens_total < 0:
        tokens_total = None if tokens_in is None or tokens_out is None else tokens_in + tokens_out
    details = get("output_tokens_details")  # a details group is only looked into when present
    reasoning = None if details is None else _detail_count(details, "reasoning_tokens")
    if reasoning is None:
        details = get("completion_tokens_details")
        reasoning = None if details is None else _detail_count(details, "reasoning_tokens")
        if reasoning is None:
            reasoning = get("reasoning_output_tokens")
            if type(reasoning) is not int or reasoning < 0:
                reasoning = None
    cached_tokens = None
    details = get("prompt_tokens_details")
    if details is not None:
        cached_tokens = _detail_count(details, "cached_tokens", "cached_input_tokens")
    if cached_tokens is None:
        details = get("input_tokens_details")
        if details is not None:
            cached_tokens = _detail_count(details, "cached_tokens", "cached_input_tokens")
        if cached_tokens is None:
            cached_tokens = cache_read
            if cached_tokens is None:
                cached_tokens = get("cached_input_tokens")
                if type(cached_tokens) is not int or cached_tokens < 0:
                    return tokens_in, tokens_out, reasoning, tokens_total, cache_creation, None, None
    return tokens_in, tokens_out, reasoning, tokens_total, cache_creation, cached_tokens > 0, cached_tokens


def extract_token_stats(usage: Any) -> dict[str, int | None]:
    """Token counts from Responses, Chat Completions or Anthropic usage (see :func:`usage_stats`)."""
    tokens_in, tokens_out, reasoning, total, creation, _, _ = usage_stats(usage)
    return {
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "tokens_reasoning": reasoning,
        "tokens_total": total,
        "cache_creation_tokens": creation,
    }


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as data: JSON strings parsed, else ``{"_raw": s}``; non-objects ``{}``.

    A typed row holds the value undecoded (``Raw``): it is read here as orjson reads it, and
    an error is the row's own (raised, so the row is read again the full way).
    """
    if isinstance(arguments, dict):
        return arguments
    if type(arguments) is Raw:
        return parse_arguments(orjson.loads(memoryview(arguments)))
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
    return calls_and_reasoning(response.get("output"), response.get("choices"), response.get("content"))


def calls_and_reasoning(output: Any, choices: Any, content: Any) -> tuple[list[dict[str, Any]], str | None]:
    """:func:`tool_calls_and_reasoning` of a response's ``output``, ``choices`` and ``content``."""
    if isinstance(output, list):
        return _responses_calls(output)
    if isinstance(choices, list):
        return _chat_calls(choices)
    if isinstance(content, list):
        return _messages_calls(content)
    return [], None


def _responses_calls(output: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Tool calls and reasoning of a Responses answer's ``output`` items."""
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
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
            summaries = item.get("summary")
            for summary in summaries if type(summaries) is list else ():  # other shapes: no items
                text = summary.get("text") if isinstance(summary, dict) else None
                if isinstance(text, str) and text:
                    reasoning.append(text)
    return calls, "\n".join(reasoning) or None


def _chat_calls(choices: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Tool calls and reasoning of a Chat Completions answer's ``choices``."""
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        tool_calls = message.get("tool_calls")
        for tool_call in tool_calls if type(tool_calls) is list else ():  # other shapes: no items
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


def _messages_calls(content: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Tool calls and thinking of an Anthropic Messages answer's ``content`` blocks."""
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
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


class BuiltCall:
    """A model-call row whose record the typed decoder already built (payloads left out).

    Looks like a row to a reader asking its ``kind`` (a model call); ``record`` is what
    :func:`call_record_dict` returns for it.
    """

    __slots__ = ("record",)

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def get(self, key: str, default: Any = None) -> Any:
        return default


_EMPTY: dict[str, Any] = {}
_ROW_KEYS = operator.itemgetter(
    "response",
    "request",
    "model_call_id",
    "dialect",
    "error_category",
    "status_code",
    "started_at",
    "completed_at",
    "latency_ms",
    "latency_ttft_ms",
    "model_ref",
)
_PAYLOADS = set(PAYLOAD_FIELDS)
_WHEN_GIVEN = "capture_hold_ms"  # in a record only when its row carries it
_FIELDS_WITH_PAYLOADS: dict[str, Any] = dict.fromkeys(
    k for k in ModelCallRecord.model_fields if k != _WHEN_GIVEN
)
_FIELDS: dict[str, Any] = {k: None for k in _FIELDS_WITH_PAYLOADS if k not in _PAYLOADS}


def call_record_fields_template() -> dict[str, Any]:
    """The fields of a record without payloads, in the model's order, all None (to fill)."""
    return _FIELDS.copy()


def _as_float(value: Any) -> tuple[Any, bool]:
    """``(value as pydantic would give it, whether that needed no validation)`` for a float field."""
    kind = type(value)
    if value is None or kind is float:
        return value, True
    if kind is int:
        return float(value), True
    return value, False


def _row_keys_one_by_one(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """What ``_ROW_KEYS(row)`` gives, for a row missing some of those keys (None for each)."""
    get = row.get
    return (
        get("response"),
        get("request"),
        get("model_call_id"),
        get("dialect"),
        get("error_category"),
        get("status_code"),
        get("started_at"),
        get("completed_at"),
        get("latency_ms"),
        get("latency_ttft_ms"),
        get("model_ref"),
    )


_SOURCES = ("upstream", "local")


def _execution(get: Callable[[str], Any]) -> tuple[Any, Any, Any, Any, bool]:
    """A row's ``(upstream_attempted, response_source, upstream_status_code, local_response_reason)``
    as written (NeMo Gym 0.7's model servers write them; null when absent), and whether each
    already has its record type."""
    attempted, source = get("upstream_attempted"), get("response_source")
    status, reason = get("upstream_status_code"), get("local_response_reason")
    canonical = (
        (attempted is None or type(attempted) is bool)
        and (source is None or (type(source) is str and source in _SOURCES))
        and (status is None or type(status) is int)
        and (reason is None or type(reason) is str)
    )
    return attempted, source, status, reason, canonical


def _finish_reason(rget: Callable[[str], Any]) -> str | None:
    """The first string among stop_reason, choices[0].finish_reason and incomplete_details.reason
    (spec section 5), of a response's ``get``."""
    finish = rget("stop_reason")
    if isinstance(finish, str):
        return finish
    choices = rget("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        finish = choices[0].get("finish_reason")
        if isinstance(finish, str):
            return finish
    details = rget("incomplete_details")
    if isinstance(details, dict):
        finish = details.get("reason")
        if isinstance(finish, str):
            return finish
    return None


def _fill_from_response(fields: dict[str, Any], response: Mapping[str, Any], raw_request: Any) -> None:
    """The record's fields read from the response (and the request's model): counts, tool
    calls and reasoning, model, id, status, finish reason."""
    rget = response.get
    (
        fields["tokens_in"],
        fields["tokens_out"],
        fields["tokens_reasoning"],
        fields["tokens_total"],
        fields["cache_creation_tokens"],
        fields["cache_hit"],
        fields["cached_tokens"],
    ) = usage_stats(rget("usage"))
    if "output" in response or "choices" in response or "content" in response:
        fields["tool_calls"], fields["reasoning_content"] = tool_calls_and_reasoning(response)
    else:
        fields["tool_calls"], fields["reasoning_content"] = [], None
    model = rget("model") or (raw_request.get("model") if isinstance(raw_request, dict) else None)
    response_id, status = rget("id"), rget("status")
    fields["response_id"] = response_id if isinstance(response_id, str) else None
    fields["model"] = model if isinstance(model, str) else None
    fields["response_status"] = status if isinstance(status, str) else None
    fields["finish_reason"] = _finish_reason(rget)


def _as_floats(*values: Any) -> tuple[list[Any], bool]:
    """:func:`_as_float` of each value, and whether none needed validation (rows of other types)."""
    out, canonical = [], True
    for value in values:
        value, ok = _as_float(value)
        out.append(value)
        canonical = canonical and ok
    return out, canonical


def _model_ref(ref: Any) -> tuple[Any, bool]:
    """``(model_ref as the record holds it, whether that needed no validation)`` of a row's ref."""
    if type(ref) is dict and len(ref) == 2 and ref.get("type") == "responses_api_models":
        name = ref.get("name")
        if type(name) is str:
            return {"type": "responses_api_models", "name": name}, True
    return ref, False


def _add_payloads(
    fields: dict[str, Any], row: Mapping[str, Any], raw_request: Any, raw_response: Any
) -> None:
    """The payload fields of a record merged with payloads: objects and raw texts, else None."""
    request_raw, response_raw = row.get("request_raw"), row.get("response_raw")
    fields["request"] = raw_request if isinstance(raw_request, dict) else None
    fields["response"] = raw_response if isinstance(raw_response, dict) else None
    fields["request_raw"] = request_raw if isinstance(request_raw, str) else None
    fields["response_raw"] = response_raw if isinstance(response_raw, str) else None


def _raw_fields(
    row: Mapping[str, Any], call_index: int, include_payloads: bool
) -> tuple[dict[str, Any], bool]:
    """The call record's fields before typing, and whether they are already canonical.

    Canonical means pydantic would return every row-supplied value unchanged, so the dict
    is the dumped record as it stands. One pass over the row, one dict built at its final
    size: this is the merge hot path (the full one; :mod:`call_records_fast` is its twin).
    """
    try:  # the keys every model server writes, fetched in one C call
        values = _ROW_KEYS(row)
    except KeyError:
        values = _row_keys_one_by_one(row)
    response, request, call_id, dialect, category, status_code, started, completed, latency, ttft, ref = (
        values
    )
    # A template's copy filled in place costs less than a literal of 25 keys (and fixes their order).
    fields = (_FIELDS_WITH_PAYLOADS if include_payloads else _FIELDS).copy()
    _fill_from_response(fields, response if isinstance(response, dict) else _EMPTY, request)
    get = row.get
    session, verifier = get("client_session_id"), get("verifier_invocation_id")
    canonical = (
        (call_id is None or type(call_id) is str)
        and (dialect is None or type(dialect) is str)
        and (category is None or type(category) is str)
        and (verifier is None or type(verifier) is str)
        and (status_code is None or type(status_code) is int)
    )
    if not (
        type(started) is float and type(completed) is float and type(latency) is float and type(ttft) is float
    ):
        (started, completed, latency, ttft), typed = _as_floats(started, completed, latency, ttft)
        canonical = canonical and typed
    if ref is not None:
        ref, typed = _model_ref(ref)
        canonical = canonical and typed
    fields["model_call_id"] = call_id
    fields["client_session_id"] = session if isinstance(session, str) else None
    fields["call_index"] = call_index
    fields["model_ref"] = ref
    fields["dialect"] = dialect
    fields["status_code"] = status_code
    fields["started_at"] = started
    fields["completed_at"] = completed
    fields["error_category"] = category
    fields["latency_total_ms"] = latency
    fields["latency_ttft_ms"] = ttft
    fields["verifier_invocation_id"] = verifier
    (
        fields["upstream_attempted"],
        fields["response_source"],
        fields["upstream_status_code"],
        fields["local_response_reason"],
        typed,
    ) = _execution(get)
    canonical = canonical and typed
    hold = get(_WHEN_GIVEN)
    if hold is not None:
        fields[_WHEN_GIVEN], typed = _as_float(hold)
        canonical = canonical and typed
    if include_payloads:
        _add_payloads(fields, row, request, response)
    return fields, canonical


def build_model_call_record(row: Mapping[str, Any], *, call_index: int) -> ModelCallRecord:
    """The typed call record of one model-call row; raises ``ValidationError`` on bad fields."""
    return ModelCallRecord.model_validate(_raw_fields(row, call_index, True)[0])


def call_record_dict(
    row: Mapping[str, Any] | BuiltCall, call_index: int, *, include_payloads: bool = True
) -> dict[str, Any]:
    """Fast path of ``build_model_call_record(row).model_dump()`` (the reference); tests/test_call_records.py.

    There ``test_fast_path_equals_the_pydantic_model`` proves the two equal on any row: the
    dumped record is built directly when possible. Payload fields are left out unless
    ``include_payloads``. Raises ``ValidationError`` exactly when :func:`build_model_call_record`
    does. A :class:`BuiltCall` (read without payloads) gives its record.
    """
    if isinstance(row, BuiltCall):
        built = row.record
        built["call_index"] = call_index
        return built
    fields, canonical = _raw_fields(row, call_index, include_payloads)
    if canonical:
        return fields
    record = ModelCallRecord.model_validate(fields)
    excluded = set() if include_payloads else set(_PAYLOADS)
    if record.capture_hold_ms is None:
        excluded.add(_WHEN_GIVEN)
    return record.model_dump(exclude=excluded)


def _str_keys(value: dict[str, Any] | None) -> bool:
    """Whether pydantic's ``dict[str, Any]`` would keep this payload as it is."""
    if value is not None:
        for key in value:
            if type(key) is not str:
                return False
    return True


def verifier_invocation_dict(
    row: Mapping[str, Any], call_index: int, *, include_payloads: bool
) -> dict[str, Any]:
    """Fast path of the dumped :class:`VerifierInvocation` (the reference); tests/test_call_records.py.

    There ``test_verifier_fast_path_equals_the_pydantic_model`` proves them equal. One verifier
    row's invocation (``model_call_ids`` filled later), built directly when every field
    already has its canonical type (as for call records); pydantic decides, and raises, otherwise.
    """
    get = row.get
    raw_request = get("request")
    raw_response = get("response")
    request = raw_request if isinstance(raw_request, dict) else None
    response = raw_response if isinstance(raw_response, dict) else None
    invocation_id, ref, status_code, category = (
        get("verifier_invocation_id"),
        get("verifier_ref"),
        get("status_code"),
        get("error_category"),
    )
    started, ok1 = _as_float(get("started_at"))
    completed, ok2 = _as_float(get("completed_at"))
    latency, ok3 = _as_float(get("latency_ms"))
    reward, ok4 = _as_float(get("reward"))
    if ref is not None:
        name = ref.get("name") if type(ref) is dict and len(ref) == 2 else None
        if type(name) is str and ref.get("type") == "resources_servers":
            ref = {"type": "resources_servers", "name": name}
        else:
            ok1 = False
    if (
        ok1
        and ok2
        and ok3
        and ok4
        and type(invocation_id) is str
        and type(call_index) is int
        and (status_code is None or type(status_code) is int)
        and (category is None or type(category) is str)
        and _str_keys(request)
        and _str_keys(response)
    ):
        fields: dict[str, Any] = {
            "verifier_invocation_id": invocation_id,
            "call_index": call_index,
            "verifier_ref": ref,
            "started_at": started,
            "completed_at": completed,
            "latency_ms": latency,
            "status_code": status_code,
            "error_category": category,
            "reward": reward,
        }
        if include_payloads:  # in the model's field order
            fields["request"] = request
            fields["response"] = response
        fields["model_call_ids"] = []
        return fields
    return _validated_verifier_invocation(row, call_index, request, response, include_payloads)


def _validated_verifier_invocation(
    row: Mapping[str, Any],
    call_index: int,
    request: dict[str, Any] | None,
    response: dict[str, Any] | None,
    include_payloads: bool,
) -> dict[str, Any]:
    """:func:`verifier_invocation_dict` of a row not already canonical: pydantic decides (and raises)."""
    get = row.get
    record = VerifierInvocation.model_validate(
        {
            "verifier_invocation_id": get("verifier_invocation_id"),
            "call_index": call_index,
            "verifier_ref": get("verifier_ref"),
            "started_at": get("started_at"),
            "completed_at": get("completed_at"),
            "latency_ms": get("latency_ms"),
            "status_code": get("status_code"),
            "error_category": get("error_category"),
            "reward": get("reward"),
            "request": request,
            "response": response,
        }
    )
    return record.model_dump(exclude=None if include_payloads else {"request", "response"})
