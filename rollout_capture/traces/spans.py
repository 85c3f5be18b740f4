"""One enriched record as the spans of its trace, in both GenAI and OpenInference conventions.

The spans are :class:`~opentelemetry.sdk.trace.ReadableSpan` built directly, not recorded by a
tracer: their ids come from the evidence (:mod:`.ids`) and their times from the capture (each
call's own ``started_at`` / ``completed_at``, the model's time, never when we read it), so the
same record always gives the same spans. The mapping is documented in docs/contract.md
("Traces (OpenTelemetry)"). Unknown values are left out of the attributes, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import orjson

from rollout_capture.attachment import OBSERVATIONS_KEY
from rollout_capture.export import _owners
from rollout_capture.summary import EvidenceShapeError, attachment_of, is_failed, model_of
from rollout_capture.traces import ids, require_otel
from rollout_capture.traces.messages import (
    genai_json,
    input_messages,
    openinference_attributes,
    output_messages,
)

_MISSING: ImportError | None = None
try:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
    from opentelemetry.trace.status import Status, StatusCode

    SCOPE = InstrumentationScope("rollout_capture.traces", "1")
    """The instrumentation scope every span carries (what made it: this exporter)."""
    _SAMPLED = TraceFlags(TraceFlags.SAMPLED)
except ImportError as exc:  # no [otel] extra: the module imports, its functions raise TracesUnavailable
    _MISSING = exc

SERVICE_NAME = "rollout-capture"
PROVIDER_OF_DIALECT = {"chat": "openai", "responses": "openai", "messages": "anthropic"}
"""``gen_ai.provider.name`` / ``llm.provider`` by the API the call spoke (the conventions ask for
the client's best knowledge; an OpenAI-compatible server is named ``openai``)."""

AttrValue = str | bool | int | float | list[str]
Attributes = dict[str, AttrValue]


def make_resource(project: str | None = None) -> Resource:
    """The resource of every span: ``service.name`` = rollout-capture, and Phoenix's project
    (``openinference.project.name``) when given (Phoenix's ``default`` otherwise)."""
    require_otel(_MISSING)
    attributes: dict[str, str] = {"service.name": SERVICE_NAME}
    if project:
        attributes["openinference.project.name"] = project
    return Resource.create(attributes)


# ------------------------------------------------------------------ typed reads (unknown: None)


def _where(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _int(item: Mapping[str, Any], name: str, where: str) -> int | None:
    """A whole number or None; 3.7 tokens or a string is refused naming the field."""
    value = item.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvidenceShapeError(f"{_where(where, name)}: expected a whole number or null, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise EvidenceShapeError(f"{_where(where, name)}: expected a whole number or null, got {value!r}")
        value = int(value)
    if not -(2**63) <= value < 2**63:
        raise EvidenceShapeError(f"{_where(where, name)}: {value!r} does not fit a 64-bit integer")
    return value


def _float(item: Mapping[str, Any], name: str, where: str) -> float | None:
    value = item.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EvidenceShapeError(f"{_where(where, name)}: expected a number or null, got {value!r}")
    return float(value)


def _str(item: Mapping[str, Any], name: str, where: str) -> str | None:
    value = item.get(name)
    if value is None or isinstance(value, str):
        return value
    raise EvidenceShapeError(f"{_where(where, name)}: expected a string or null, got {value!r}")


def _ns(seconds: float | None) -> int | None:
    """Unix seconds (the capture's clock) as OpenTelemetry's nanoseconds, from the digits the
    capture wrote (``1780063552.839689`` is ...839689000 ns): ``t * 1e9`` in binary floating
    point would be off by up to 128 ns at today's epoch."""
    if seconds is None:
        return None
    return int(Decimal(repr(seconds)).scaleb(9).to_integral_value(ROUND_HALF_EVEN))


def _error_type(status_code: int | None, category: str | None, failed: bool) -> str | None:
    """``error.type``: the error category; for a failed call without one its status code, else
    the conventions' ``_OTHER``; absent when the call did not fail."""
    if category is not None:
        return category
    if not failed:
        return None
    return str(status_code) if status_code is not None else "_OTHER"


def _put(attributes: Attributes, name: str, value: AttrValue | None) -> None:
    """Set an attribute only when it is known: unknown is absent, never 0 or an empty string."""
    if value is not None:
        attributes[name] = value


def _ref_name(ref: Any) -> str | None:
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) and name else None


# ------------------------------------------------------------------ the parts of a trace


@dataclass(slots=True)
class _Times:
    """A span's start and end in ns, and whether both came from the capture itself."""

    start: int | None
    end: int | None
    known: bool

    @classmethod
    def of(cls, item: Mapping[str, Any], where: str, latency_key: str) -> _Times:
        """``started_at`` / ``completed_at``; one of them from the other and the latency when missing."""
        start = _ns(_float(item, "started_at", where))
        end = _ns(_float(item, "completed_at", where))
        latency = _float(item, latency_key, where)
        known = start is not None and end is not None
        if start is None and end is not None and latency is not None and latency >= 0:
            start = end - round(latency * 1e6)
        elif end is None and start is not None and latency is not None and latency >= 0:
            end = start + round(latency * 1e6)
        return cls(start, end, known)


def _bounds(times: list[_Times]) -> tuple[int, int] | None:
    starts = [t.start for t in times if t.start is not None]
    ends = [t.end for t in times if t.end is not None]
    if not starts and not ends:
        return None
    return min(starts or ends), max(ends or starts)


def _settle(times: _Times, fallback: tuple[int, int]) -> tuple[int, int]:
    """A span's final (start, end): what it knows, else the parent's start; never ending before it starts."""
    start = times.start if times.start is not None else times.end if times.end is not None else fallback[0]
    end = times.end if times.end is not None else start
    return start, max(start, end)


def _context(trace: int, span: int) -> SpanContext:
    return SpanContext(trace, span, is_remote=False, trace_flags=_SAMPLED)


@dataclass(slots=True)
class _Invocation:
    """An agent invocation of ``ng_agent_observations`` (a span the calls it owns nest under)."""

    invocation_id: str
    name: str | None
    times: _Times


def _invocations(record: Mapping[str, Any]) -> list[_Invocation]:
    """The invocations of ``ng_agent_observations`` (its ``invocations``, NeMo Gym's typed
    ``records`` of kind ``agent_invocation``), first of an id wins."""
    observations = record.get(OBSERVATIONS_KEY)
    if not isinstance(observations, Mapping):
        return []
    out: dict[str, _Invocation] = {}
    for key in ("invocations", "records"):
        items = observations.get(key)
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, Mapping) or not isinstance(item.get("invocation_id"), str):
                continue
            if key == "records" and item.get("kind") != "agent_invocation":
                continue
            invocation_id = item["invocation_id"]
            if invocation_id in out:
                continue
            name = _ref_name(item.get("agent_ref")) or _str(item, "name", f"{OBSERVATIONS_KEY}.{key}")
            times = _Times.of(item, f"{OBSERVATIONS_KEY}.{key}", "latency_ms")
            out[invocation_id] = _Invocation(invocation_id, name, times)
    return list(out.values())


def _gaps(gaps: Any, where: str) -> list[Mapping[str, Any]]:
    if gaps is None:
        return []
    if not isinstance(gaps, list):
        raise EvidenceShapeError(f"{where}: expected a list of gaps")
    for index, gap in enumerate(gaps):
        if not isinstance(gap, Mapping) or not isinstance(gap.get("code"), str):
            raise EvidenceShapeError(f"{where}[{index}]: a gap needs a string code")
    return gaps


def _gap_event(gap: Mapping[str, Any], source: str, at: int) -> Event:
    attributes: Attributes = {"rollout_capture.gap.code": gap["code"], "rollout_capture.gap.source": source}
    for name in ("detail", "invocation_id"):
        if isinstance(gap.get(name), str):
            attributes[f"rollout_capture.gap.{name}"] = gap[name]
    return Event(gap["code"], attributes, timestamp=at)


# ------------------------------------------------------------------ attributes of one call

_TOKENS = (
    # (call record field, GenAI attribute, OpenInference attribute)
    ("tokens_in", "gen_ai.usage.input_tokens", "llm.token_count.prompt"),
    ("tokens_out", "gen_ai.usage.output_tokens", "llm.token_count.completion"),
    ("tokens_total", None, "llm.token_count.total"),
    (
        "tokens_reasoning",
        "gen_ai.usage.reasoning.output_tokens",
        "llm.token_count.completion_details.reasoning",
    ),
    ("cached_tokens", "gen_ai.usage.cache_read.input_tokens", "llm.token_count.prompt_details.cache_read"),
    (
        "cache_creation_tokens",
        "gen_ai.usage.cache_creation.input_tokens",
        "llm.token_count.prompt_details.cache_write",
    ),
)


def _payload_attributes(call: Mapping[str, Any], dialect: str | None, finish: str | None) -> Attributes:
    """The request and response under both conventions' message attributes, and whole as
    OpenInference's ``input.value`` / ``output.value`` (JSON; the raw text when not JSON)."""
    out: Attributes = {}
    request = call.get("request") if isinstance(call.get("request"), Mapping) else None
    response = call.get("response") if isinstance(call.get("response"), Mapping) else None
    for side, body, raw in (
        ("input", request, call.get("request_raw")),
        ("output", response, call.get("response_raw")),
    ):
        if body is not None:
            out[f"{side}.value"] = orjson.dumps(body).decode()
            out[f"{side}.mime_type"] = "application/json"
        elif isinstance(raw, str):
            out[f"{side}.value"] = raw
            out[f"{side}.mime_type"] = "text/plain"
    sent = input_messages(dialect, request)
    got = output_messages(dialect, response, finish)
    if sent:
        out["gen_ai.input.messages"] = genai_json(sent, output=False)
        out.update(openinference_attributes("llm.input_messages", sent))
    if got:
        out["gen_ai.output.messages"] = genai_json(got, output=True)
        out.update(openinference_attributes("llm.output_messages", got))
    return out


def _call_attributes(
    call: Mapping[str, Any], where: str, owner: str | None, include_payloads: bool
) -> tuple[str, Attributes, Status]:
    """A call's span name, attributes (both conventions) and status."""
    dialect = _str(call, "dialect", where)
    model = _str(call, "model", where)
    response_id = _str(call, "response_id", where)
    finish = _str(call, "finish_reason", where)
    status_code = _int(call, "status_code", where)
    category = _str(call, "error_category", where)
    request = call.get("request") if include_payloads and isinstance(call.get("request"), Mapping) else None
    asked = request.get("model") if request is not None else None
    requested = asked if isinstance(asked, str) else model
    provider = PROVIDER_OF_DIALECT.get(dialect or "")
    a: Attributes = {"openinference.span.kind": "LLM", "gen_ai.operation.name": "chat"}
    _put(a, "gen_ai.provider.name", provider)
    _put(a, "llm.provider", provider)
    _put(a, "llm.system", provider)
    _put(a, "gen_ai.request.model", requested)
    _put(a, "gen_ai.response.model", model)
    _put(a, "llm.model_name", model)
    _put(a, "gen_ai.response.id", response_id)
    if finish is not None:
        a["gen_ai.response.finish_reasons"] = [finish]
        a["llm.finish_reason"] = finish
    for field, genai, openinference in _TOKENS:
        value = _int(call, field, where)
        if value is not None:
            if genai is not None:
                a[genai] = value
            a[openinference] = value
    ttft = _float(call, "latency_ttft_ms", where)
    if ttft is not None and ttft >= 0:
        a["gen_ai.response.time_to_first_chunk"] = ttft / 1000
    _put(a, "http.response.status_code", status_code)
    failed = is_failed(status_code, category)
    _put(a, "error.type", _error_type(status_code, category, failed))
    # what only this project knows, under its own names
    _put(a, "rollout_capture.call.model_call_id", _str(call, "model_call_id", where))
    _put(a, "rollout_capture.call.index", _int(call, "call_index", where))
    _put(a, "rollout_capture.call.dialect", dialect)
    _put(a, "rollout_capture.call.model_server", _ref_name(call.get("model_ref")))
    _put(a, "rollout_capture.call.response_status", _str(call, "response_status", where))
    _put(a, "rollout_capture.call.latency_ms", _float(call, "latency_total_ms", where))
    _put(a, "rollout_capture.call.ttft_ms", ttft)
    _put(a, "rollout_capture.call.capture_hold_ms", _float(call, "capture_hold_ms", where))
    _put(a, "rollout_capture.call.verifier_invocation_id", _str(call, "verifier_invocation_id", where))
    _put(a, "rollout_capture.call.owner_invocation_id", owner)
    tool_calls = call.get("tool_calls")
    if isinstance(tool_calls, list):
        a["rollout_capture.call.tool_calls"] = len(tool_calls)
    if include_payloads:
        a.update(_payload_attributes(call, dialect, finish))
    if failed:
        detail = category or "failed"
        status = Status(StatusCode.ERROR, f"{detail} (HTTP {status_code})" if status_code else detail)
    else:
        status = Status(StatusCode.OK)
    return f"chat {requested or model_of(call)}", a, status


# ------------------------------------------------------------------ the trace of one record


def rollout_spans(
    record: Mapping[str, Any],
    *,
    include_payloads: bool = False,
    resource: Resource | None = None,
    fallback_time_ns: int | None = None,
) -> list[ReadableSpan]:
    """The spans of one enriched record's trace, the rollout's root span first; ``[]`` for a
    record without an ``ng_model_call_capture`` attachment.

    Children of the root: each agent invocation of ``ng_agent_observations`` (calls it owns nest
    under it), each verifier invocation (its judge calls nest under it), and every other call.
    ``include_payloads`` puts requests and responses (when the file carries them) in the
    conventions' message attributes. ``fallback_time_ns`` times the root of a rollout whose
    record knows no time at all (no call or invocation timed): the exporter passes the enriched
    file's modification time. A malformed attachment raises :class:`EvidenceShapeError`.
    """
    require_otel(_MISSING)
    attachment = attachment_of(record)
    if attachment is None:
        return []
    rollout_id: str = attachment["rollout_id"]
    resource = resource or make_resource()
    trace = ids.trace_id(rollout_id)
    root_id = ids.span_id(rollout_id, "rollout")
    root_ctx = _context(trace, root_id)
    calls: list[Mapping[str, Any]] = attachment["calls"]
    owners = _owners(record)
    invocations = _invocations(record)
    verifiers_raw = attachment.get("verifier_invocations") or []
    if not isinstance(verifiers_raw, list) or not all(isinstance(v, Mapping) for v in verifiers_raw):
        raise EvidenceShapeError("ng_model_call_capture.verifier_invocations: expected a list of objects")
    verifiers: dict[str, Mapping[str, Any]] = {}
    for index, verifier in enumerate(verifiers_raw):
        vid = _str(verifier, "verifier_invocation_id", f"ng_model_call_capture.verifier_invocations[{index}]")
        if vid is not None:
            verifiers.setdefault(vid, verifier)

    call_times = [
        _Times.of(call, f"ng_model_call_capture.calls[{i}]", "latency_total_ms")
        for i, call in enumerate(calls)
    ]
    verifier_times = {
        vid: _Times.of(v, "ng_model_call_capture.verifier_invocations", "latency_ms")
        for vid, v in verifiers.items()
    }
    known = _bounds([*call_times, *verifier_times.values(), *(i.times for i in invocations)])
    times_known = known is not None
    if known is None:
        at = fallback_time_ns if fallback_time_ns is not None else 0
        known = (at, at)

    # which parent each call hangs under
    invocation_ids = {inv.invocation_id for inv in invocations}
    parent_of: list[tuple[ids.SpanKindKey, str] | None] = []
    for call in calls:
        vid = call.get("verifier_invocation_id")
        mid = call.get("model_call_id")
        owner = owners.get(mid) if isinstance(mid, str) else None
        if isinstance(vid, str) and vid in verifiers:
            parent_of.append(("verifier", vid))
        elif owner is not None and owner in invocation_ids:
            parent_of.append(("agent", owner))
        else:
            parent_of.append(None)

    spans: list[ReadableSpan] = []
    failed_calls = 0
    child_spans: list[ReadableSpan] = []
    # invocation spans: their own times, else their calls' bounds, else the rollout's
    group_times: dict[tuple[ids.SpanKindKey, str], tuple[int, int]] = {}
    for inv in invocations:
        members = [call_times[i] for i, p in enumerate(parent_of) if p == ("agent", inv.invocation_id)]
        bounds = (inv.times.start, inv.times.end) if inv.times.known else _bounds([inv.times, *members])
        group_times[("agent", inv.invocation_id)] = _settle(
            _Times(bounds[0], bounds[1], True) if bounds else _Times(None, None, False), known
        )
    for vid, vtimes in verifier_times.items():
        members = [call_times[i] for i, p in enumerate(parent_of) if p == ("verifier", vid)]
        bounds = (vtimes.start, vtimes.end) if vtimes.known else _bounds([vtimes, *members])
        group_times[("verifier", vid)] = _settle(
            _Times(bounds[0], bounds[1], True) if bounds else _Times(None, None, False), known
        )

    for position, call in enumerate(calls):
        where = f"ng_model_call_capture.calls[{position}]"
        mid = call.get("model_call_id") if isinstance(call.get("model_call_id"), str) else None
        owner = owners.get(mid) if mid else None
        name, attributes, status = _call_attributes(call, where, owner, include_payloads)
        failed_calls += status.status_code is StatusCode.ERROR
        key = ids.call_key(mid, _int(call, "call_index", where), position)
        parent_key = parent_of[position]
        parent_id = root_id if parent_key is None else ids.span_id(rollout_id, *parent_key)
        fallback = known if parent_key is None else group_times[parent_key]
        times = call_times[position]
        start, end = _settle(times, fallback)
        if not times.known:
            attributes["rollout_capture.call.times_known"] = False
        elif times.end is not None and times.start is not None and times.end < times.start:
            attributes["rollout_capture.call.timing_impossible"] = True
        child_spans.append(
            ReadableSpan(
                name=name,
                context=_context(trace, ids.span_id(rollout_id, "call", key)),
                parent=_context(trace, parent_id),
                resource=resource,
                attributes=attributes,
                kind=SpanKind.CLIENT,
                status=status,
                start_time=start,
                end_time=end,
                instrumentation_scope=SCOPE,
            )
        )

    for inv in invocations:
        start, end = group_times[("agent", inv.invocation_id)]
        a: Attributes = {
            "openinference.span.kind": "AGENT",
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.id": inv.invocation_id,
            "rollout_capture.invocation.id": inv.invocation_id,
            "rollout_capture.invocation.calls": sum(p == ("agent", inv.invocation_id) for p in parent_of),
        }
        _put(a, "gen_ai.agent.name", inv.name)
        if not inv.times.known:
            a["rollout_capture.invocation.times_known"] = False
        child_spans.append(
            ReadableSpan(
                name=f"invoke_agent {inv.name or inv.invocation_id}",
                context=_context(trace, ids.span_id(rollout_id, "agent", inv.invocation_id)),
                parent=root_ctx,
                resource=resource,
                attributes=a,
                kind=SpanKind.INTERNAL,
                start_time=start,
                end_time=end,
                instrumentation_scope=SCOPE,
            )
        )

    for vid, verifier in verifiers.items():
        where = "ng_model_call_capture.verifier_invocations"
        start, end = group_times[("verifier", vid)]
        status_code = _int(verifier, "status_code", where)
        category = _str(verifier, "error_category", where)
        reward = _float(verifier, "reward", where)
        server = _ref_name(verifier.get("verifier_ref"))
        a = {"openinference.span.kind": "EVALUATOR", "rollout_capture.verifier.invocation_id": vid}
        _put(a, "rollout_capture.verifier.name", server)
        _put(a, "gen_ai.evaluation.name", server)
        _put(a, "rollout_capture.verifier.reward", reward)
        _put(a, "gen_ai.evaluation.score.value", reward)
        _put(a, "http.response.status_code", status_code)
        _put(a, "rollout_capture.verifier.latency_ms", _float(verifier, "latency_ms", where))
        mids = verifier.get("model_call_ids")
        if isinstance(mids, list) and all(isinstance(m, str) for m in mids):
            a["rollout_capture.verifier.model_call_ids"] = list(mids)
        failed = is_failed(status_code, category)
        _put(a, "error.type", _error_type(status_code, category, failed))
        if not verifier_times[vid].known:
            a["rollout_capture.verifier.times_known"] = False
        child_spans.append(
            ReadableSpan(
                name=f"verify {server or vid}",
                context=_context(trace, ids.span_id(rollout_id, "verifier", vid)),
                parent=root_ctx,
                resource=resource,
                attributes=a,
                kind=SpanKind.INTERNAL,
                status=Status(StatusCode.ERROR, category or "failed") if failed else Status(StatusCode.OK),
                start_time=start,
                end_time=end,
                instrumentation_scope=SCOPE,
            )
        )

    # the root: the rollout, its figures, its gaps as events
    metrics = attachment.get("metrics") or {}
    capture_gaps = _gaps(attachment.get("gaps"), "ng_model_call_capture.gaps")
    observations = record.get(OBSERVATIONS_KEY)
    observation_gaps = []
    if isinstance(observations, Mapping):
        observation_gaps = _gaps(observations.get("gaps"), f"{OBSERVATIONS_KEY}.gaps")
    root: Attributes = {
        "openinference.span.kind": "CHAIN",
        "rollout_capture.rollout.id": rollout_id,
        "rollout_capture.rollout.num_calls": len(calls),
        "rollout_capture.rollout.failed_calls": failed_calls,
        "rollout_capture.rollout.verifier_invocations": len(verifiers),
    }
    if not times_known:
        root["rollout_capture.rollout.times_known"] = False
    reward = record.get("reward")
    if isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward):
        root["rollout_capture.rollout.reward"] = float(reward)
    for field in ("tokens_in", "tokens_out", "tokens_total", "tokens_reasoning", "cached_tokens"):
        _put(root, f"rollout_capture.rollout.{field}", _int(metrics, field, "ng_model_call_capture.metrics"))
    _put(root, "rollout_capture.rollout.latency_total_ms", _float(metrics, "latency_total_ms", "metrics"))
    codes = list(dict.fromkeys(g["code"] for g in capture_gaps))
    observed = list(dict.fromkeys(g["code"] for g in observation_gaps))
    if codes:
        root["rollout_capture.rollout.gap_codes"] = codes
    if observed:
        root["rollout_capture.rollout.observation_gap_codes"] = observed
    agent = _ref_name(record.get("agent_ref"))
    _put(root, "gen_ai.agent.name", agent)
    metadata: dict[str, Any] = {"rollout_id": rollout_id, "num_calls": len(calls)}
    if "rollout_capture.rollout.reward" in root:
        metadata["reward"] = root["rollout_capture.rollout.reward"]
    if codes or observed:
        metadata["gap_codes"] = codes + observed
    root["metadata"] = orjson.dumps(metadata).decode()
    start, end = known
    events = [_gap_event(g, "capture", start) for g in capture_gaps]
    events += [_gap_event(g, "ownership", start) for g in observation_gaps]
    root_status = (
        Status(StatusCode.ERROR, f"{failed_calls} of {len(calls)} calls failed")
        if failed_calls
        else Status(StatusCode.UNSET)
    )
    spans.append(
        ReadableSpan(
            name=f"rollout {rollout_id}",
            context=root_ctx,
            parent=None,
            resource=resource,
            attributes=root,
            events=events,
            kind=SpanKind.INTERNAL,
            status=root_status,
            start_time=start,
            end_time=end,
            instrumentation_scope=SCOPE,
        )
    )
    spans.extend(child_spans)
    return spans
