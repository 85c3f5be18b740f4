"""One enriched record as the spans of its trace, in both GenAI and OpenInference conventions.

The spans are :class:`~opentelemetry.sdk.trace.ReadableSpan` built directly, not recorded by a
tracer: their ids come from the evidence and the run it belongs to (:mod:`.ids`), their times
from the capture (each call's own ``started_at`` / ``completed_at``, the model's time, never when
we read it), so the same record of the same run always gives the same spans. The mapping is
documented in docs/contract.md ("Traces (OpenTelemetry)"). Unknown values are left out of
the attributes, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import orjson

from rollout_capture.attachment import OBSERVATIONS_KEY
from rollout_capture.export import call_owners
from rollout_capture.summary import (
    EvidenceShapeError,
    attachment_of,
    count_field,
    is_failed,
    model_of,
    number_field,
    text_field,
)
from rollout_capture.traces import ids, require_otel
from rollout_capture.traces.payloads import PAYLOAD_BUDGET, payload_attributes, text_bytes

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
Measured = tuple[Collection[str], int]
"""Attributes of a span already weighed, and their bytes (a call's payloads, measured as fitted)."""
NOTHING_MEASURED: Measured = ((), 0)


def make_resource(project: str | None = None) -> Resource:
    """The resource of every span: ``service.name`` = rollout-capture, and Phoenix's project
    (``openinference.project.name``) when given (Phoenix's ``default`` otherwise)."""
    require_otel(_MISSING)
    attributes: dict[str, str] = {"service.name": SERVICE_NAME}
    if project:
        attributes["openinference.project.name"] = project
    return Resource.create(attributes)


# ------------------------------------------------------------------ typed reads (unknown: None)


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
        start = _ns(number_field(item, "started_at", where))
        end = _ns(number_field(item, "completed_at", where))
        latency = number_field(item, latency_key, where)
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
            name = _ref_name(item.get("agent_ref")) or text_field(item, "name", f"{OBSERVATIONS_KEY}.{key}")
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


def _flag(call: Mapping[str, Any], name: str, where: str) -> bool | None:
    """A call's boolean field, or null; anything else refused naming ``where``."""
    value = call.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise EvidenceShapeError(f"{where}.{name}: expected true, false or null, got {value!r}")


def _answer_attributes(a: Attributes, call: Mapping[str, Any], where: str) -> None:
    """Who answered the call (the producer's own record of it): the upstream, or the capture
    layer itself, and why; absent when the record does not say."""
    _put(a, "rollout_capture.call.upstream_attempted", _flag(call, "upstream_attempted", where))
    _put(a, "rollout_capture.call.response_source", text_field(call, "response_source", where))
    _put(a, "rollout_capture.call.upstream_status_code", count_field(call, "upstream_status_code", where))
    _put(a, "rollout_capture.call.local_response_reason", text_field(call, "local_response_reason", where))


def _call_attributes(
    call: Mapping[str, Any], where: str, owner: str | None, payload_budget: int | None
) -> tuple[str, Attributes, Status, Measured]:
    """A call's span name, attributes (both conventions) and status; its payloads within
    ``payload_budget`` bytes when given (none when ``None``), and what they weigh."""
    include_payloads = payload_budget is not None
    dialect = text_field(call, "dialect", where)
    model = text_field(call, "model", where)
    response_id = text_field(call, "response_id", where)
    finish = text_field(call, "finish_reason", where)
    status_code = count_field(call, "status_code", where)
    category = text_field(call, "error_category", where)
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
        value = count_field(call, field, where)
        if value is not None:
            if genai is not None:
                a[genai] = value
            a[openinference] = value
    ttft = number_field(call, "latency_ttft_ms", where)
    if ttft is not None and ttft >= 0:
        a["gen_ai.response.time_to_first_chunk"] = ttft / 1000
    _put(a, "http.response.status_code", status_code)
    failed = is_failed(status_code, category)
    _put(a, "error.type", _error_type(status_code, category, failed))
    # what only this project knows, under its own names
    _put(a, "rollout_capture.call.model_call_id", text_field(call, "model_call_id", where))
    _put(a, "rollout_capture.call.index", count_field(call, "call_index", where))
    _put(a, "rollout_capture.call.dialect", dialect)
    _put(a, "rollout_capture.call.model_server", _ref_name(call.get("model_ref")))
    _put(a, "rollout_capture.call.response_status", text_field(call, "response_status", where))
    _put(a, "rollout_capture.call.latency_ms", number_field(call, "latency_total_ms", where))
    _put(a, "rollout_capture.call.ttft_ms", ttft)
    _put(a, "rollout_capture.call.capture_hold_ms", number_field(call, "capture_hold_ms", where))
    _put(a, "rollout_capture.call.verifier_invocation_id", text_field(call, "verifier_invocation_id", where))
    _put(a, "rollout_capture.call.owner_invocation_id", owner)
    tool_calls = call.get("tool_calls")
    if isinstance(tool_calls, list):
        a["rollout_capture.call.tool_calls"] = len(tool_calls)
    _answer_attributes(a, call, where)
    measured = NOTHING_MEASURED
    if payload_budget is not None:
        payload, size = payload_attributes(call, dialect, finish, payload_budget)
        a.update(payload)
        measured = (payload.keys(), size)
    if failed:
        detail = category or "failed"
        status = Status(StatusCode.ERROR, f"{detail} (HTTP {status_code})" if status_code else detail)
    else:
        status = Status(StatusCode.OK)
    return f"chat {requested or model_of(call)}", a, status, measured


# ------------------------------------------------------------------ the trace of one record

_VERIFIERS = "ng_model_call_capture.verifier_invocations"
_GroupKey = tuple[ids.SpanKindKey, str]


def trajectory_payloads(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The payloads of a NeMo Gym record's calls, by ``model_call_id``, from its ``ng_trajectory``
    (where NeMo Gym's collection keeps them, and enrichment leaves them: contract section 14),
    each under its call record's name (a text one as ``request_raw`` / ``response_raw``); only
    for calls whose own record carries none."""
    trajectory = record.get("ng_trajectory")
    calls = trajectory.get("model_calls") if isinstance(trajectory, Mapping) else None
    found: dict[str, dict[str, Any]] = {}
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, Mapping) or not isinstance(call.get("model_call_id"), str):
            continue
        payloads: dict[str, Any] = {}
        for key in ("request", "response"):
            value = call.get(key)
            if isinstance(value, Mapping):
                payloads[key] = value
            elif isinstance(value, str):
                payloads[f"{key}_raw"] = value
        if payloads:
            found[call["model_call_id"]] = payloads
    return found


class _Trace:
    """One record's trace while it is built: what its spans share, read once, in the order the
    fields are checked (so a malformed record fails on the same field as ever)."""

    def __init__(
        self,
        record: Mapping[str, Any],
        attachment: Mapping[str, Any],
        payload_budget: int | None,
        resource: Resource,
        fallback_time_ns: int | None,
        scope: ids.RunScope,
    ) -> None:
        self.record, self.attachment, self.payload_budget = record, attachment, payload_budget
        self.rollout_id: str = attachment["rollout_id"]
        self.resource, self.scope = resource, scope
        self.trace = ids.trace_id(self.rollout_id, scope)
        self.root_ctx = _context(self.trace, self._span_id("rollout"))
        self.calls: list[Mapping[str, Any]] = attachment["calls"]
        self.trajectory_payloads = trajectory_payloads(record) if payload_budget is not None else {}
        self.owners = call_owners(record)
        self.invocations = _invocations(record)
        self.verifiers = self._read_verifiers()
        self.call_times = [
            _Times.of(call, f"ng_model_call_capture.calls[{i}]", "latency_total_ms")
            for i, call in enumerate(self.calls)
        ]
        self.verifier_times = {
            vid: _Times.of(v, _VERIFIERS, "latency_ms") for vid, v in self.verifiers.items()
        }
        self.known, self.times_known = self._settle_times(fallback_time_ns)
        self.parent_of = self._parents()
        self.group_times = self._group_times()
        self.failed_calls = 0

    def _span_id(self, kind: ids.SpanKindKey, key: str = "") -> int:
        return ids.span_id(self.rollout_id, kind, key, self.scope)

    def _read_verifiers(self) -> dict[str, Mapping[str, Any]]:
        """The verifier invocations by id, first of an id wins; one that is not an object is refused."""
        verifiers_raw = self.attachment.get("verifier_invocations") or []
        if not isinstance(verifiers_raw, list) or not all(isinstance(v, Mapping) for v in verifiers_raw):
            raise EvidenceShapeError(f"{_VERIFIERS}: expected a list of objects")
        verifiers: dict[str, Mapping[str, Any]] = {}
        for index, verifier in enumerate(verifiers_raw):
            vid = text_field(verifier, "verifier_invocation_id", f"{_VERIFIERS}[{index}]")
            if vid is not None:
                verifiers.setdefault(vid, verifier)
        return verifiers

    def _settle_times(self, fallback_time_ns: int | None) -> tuple[tuple[int, int], bool]:
        """The rollout's (start, end) over everything timed, and whether anything was; a record
        timing nothing gets ``fallback_time_ns`` (else 0) for both."""
        invocation_times = (i.times for i in self.invocations)
        known = _bounds([*self.call_times, *self.verifier_times.values(), *invocation_times])
        if known is not None:
            return known, True
        at = fallback_time_ns if fallback_time_ns is not None else 0
        return (at, at), False

    def _parents(self) -> list[_GroupKey | None]:
        """Which parent each call hangs under: its verifier invocation, else the agent invocation
        owning it, else (``None``) the root."""
        invocation_ids = {inv.invocation_id for inv in self.invocations}
        parent_of: list[_GroupKey | None] = []
        for call in self.calls:
            vid = call.get("verifier_invocation_id")
            mid = call.get("model_call_id")
            owner = self.owners.get(mid) if isinstance(mid, str) else None
            if isinstance(vid, str) and vid in self.verifiers:
                parent_of.append(("verifier", vid))
            elif owner is not None and owner in invocation_ids:
                parent_of.append(("agent", owner))
            else:
                parent_of.append(None)
        return parent_of

    def _group_time(self, key: _GroupKey, times: _Times) -> tuple[int, int]:
        """An invocation's (start, end): its own times, else its calls' bounds, else the rollout's."""
        members = [self.call_times[i] for i, p in enumerate(self.parent_of) if p == key]
        bounds = (times.start, times.end) if times.known else _bounds([times, *members])
        return _settle(
            _Times(bounds[0], bounds[1], True) if bounds else _Times(None, None, False), self.known
        )

    def _group_times(self) -> dict[_GroupKey, tuple[int, int]]:
        """The settled times of every agent and verifier invocation, by its parent key."""
        group_times: dict[_GroupKey, tuple[int, int]] = {}
        for inv in self.invocations:
            group_times[("agent", inv.invocation_id)] = self._group_time(
                ("agent", inv.invocation_id), inv.times
            )
        for vid, vtimes in self.verifier_times.items():
            group_times[("verifier", vid)] = self._group_time(("verifier", vid), vtimes)
        return group_times

    def call_span(self, position: int, call: Mapping[str, Any]) -> tuple[ReadableSpan, int]:
        """The span of one call, under its parent, timed by the capture (counts a failed call),
        and its weight (:func:`span_weight`)."""
        where = f"ng_model_call_capture.calls[{position}]"
        mid = call.get("model_call_id") if isinstance(call.get("model_call_id"), str) else None
        owner = self.owners.get(mid) if mid else None
        if self.payload_budget is not None and mid in self.trajectory_payloads:
            call = {**self.trajectory_payloads[mid], **call}  # where NeMo Gym keeps them
        name, attributes, status, measured = _call_attributes(call, where, owner, self.payload_budget)
        self.failed_calls += status.status_code is StatusCode.ERROR
        key = ids.call_key(mid, count_field(call, "call_index", where), position)
        parent_key = self.parent_of[position]
        parent_id = self.root_ctx.span_id if parent_key is None else self._span_id(*parent_key)
        fallback = self.known if parent_key is None else self.group_times[parent_key]
        times = self.call_times[position]
        start, end = _settle(times, fallback)
        if not times.known:
            attributes["rollout_capture.call.times_known"] = False
        elif times.end is not None and times.start is not None and times.end < times.start:
            attributes["rollout_capture.call.timing_impossible"] = True
        span = ReadableSpan(
            name=name,
            context=_context(self.trace, self._span_id("call", key)),
            parent=_context(self.trace, parent_id),
            resource=self.resource,
            attributes=attributes,
            kind=SpanKind.CLIENT,
            status=status,
            start_time=start,
            end_time=end,
            instrumentation_scope=SCOPE,
        )
        return span, span_weight(span, measured)

    def invocation_span(self, inv: _Invocation) -> ReadableSpan:
        """The span of one agent invocation, a child of the root."""
        key: _GroupKey = ("agent", inv.invocation_id)
        start, end = self.group_times[key]
        a: Attributes = {
            "openinference.span.kind": "AGENT",
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.id": inv.invocation_id,
            "rollout_capture.invocation.id": inv.invocation_id,
            "rollout_capture.invocation.calls": sum(p == key for p in self.parent_of),
        }
        _put(a, "gen_ai.agent.name", inv.name)
        if not inv.times.known:
            a["rollout_capture.invocation.times_known"] = False
        return ReadableSpan(
            name=f"invoke_agent {inv.name or inv.invocation_id}",
            context=_context(self.trace, self._span_id(*key)),
            parent=self.root_ctx,
            resource=self.resource,
            attributes=a,
            kind=SpanKind.INTERNAL,
            start_time=start,
            end_time=end,
            instrumentation_scope=SCOPE,
        )

    def verifier_span(self, vid: str, verifier: Mapping[str, Any]) -> ReadableSpan:
        """The span of one verifier invocation (an evaluator), a child of the root."""
        start, end = self.group_times[("verifier", vid)]
        status_code = count_field(verifier, "status_code", _VERIFIERS)
        category = text_field(verifier, "error_category", _VERIFIERS)
        reward = number_field(verifier, "reward", _VERIFIERS)
        server = _ref_name(verifier.get("verifier_ref"))
        a: Attributes = {
            "openinference.span.kind": "EVALUATOR",
            "rollout_capture.verifier.invocation_id": vid,
        }
        _put(a, "rollout_capture.verifier.name", server)
        _put(a, "gen_ai.evaluation.name", server)
        _put(a, "rollout_capture.verifier.reward", reward)
        _put(a, "gen_ai.evaluation.score.value", reward)
        _put(a, "http.response.status_code", status_code)
        _put(a, "rollout_capture.verifier.latency_ms", number_field(verifier, "latency_ms", _VERIFIERS))
        mids = verifier.get("model_call_ids")
        if isinstance(mids, list) and all(isinstance(m, str) for m in mids):
            a["rollout_capture.verifier.model_call_ids"] = list(mids)
        failed = is_failed(status_code, category)
        _put(a, "error.type", _error_type(status_code, category, failed))
        if not self.verifier_times[vid].known:
            a["rollout_capture.verifier.times_known"] = False
        return ReadableSpan(
            name=f"verify {server or vid}",
            context=_context(self.trace, self._span_id("verifier", vid)),
            parent=self.root_ctx,
            resource=self.resource,
            attributes=a,
            kind=SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, category or "failed") if failed else Status(StatusCode.OK),
            start_time=start,
            end_time=end,
            instrumentation_scope=SCOPE,
        )

    def _root_attributes(self, codes: list[str], observed: list[str]) -> Attributes:
        """The rollout's figures (from the attachment's metrics) and its gap codes, on the root."""
        metrics = self.attachment.get("metrics") or {}
        root: Attributes = {
            "openinference.span.kind": "CHAIN",
            "rollout_capture.rollout.id": self.rollout_id,
            "rollout_capture.rollout.num_calls": len(self.calls),
            "rollout_capture.rollout.failed_calls": self.failed_calls,
            "rollout_capture.rollout.verifier_invocations": len(self.verifiers),
        }
        _put(root, "rollout_capture.run.name", self.scope.run or None)
        if not self.times_known:
            root["rollout_capture.rollout.times_known"] = False
        reward = self.record.get("reward")
        if isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward):
            root["rollout_capture.rollout.reward"] = float(reward)
        for field in ("tokens_in", "tokens_out", "tokens_total", "tokens_reasoning", "cached_tokens"):
            value = count_field(metrics, field, "ng_model_call_capture.metrics")
            _put(root, f"rollout_capture.rollout.{field}", value)
        _put(
            root,
            "rollout_capture.rollout.latency_total_ms",
            number_field(metrics, "latency_total_ms", "metrics"),
        )
        if codes:
            root["rollout_capture.rollout.gap_codes"] = codes
        if observed:
            root["rollout_capture.rollout.observation_gap_codes"] = observed
        _put(root, "gen_ai.agent.name", _ref_name(self.record.get("agent_ref")))
        metadata: dict[str, Any] = {"rollout_id": self.rollout_id, "num_calls": len(self.calls)}
        if self.scope.run:
            metadata["run"] = self.scope.run
        if "rollout_capture.rollout.reward" in root:
            metadata["reward"] = root["rollout_capture.rollout.reward"]
        if codes or observed:
            metadata["gap_codes"] = codes + observed
        root["metadata"] = orjson.dumps(metadata).decode()
        return root

    def root_span(self) -> ReadableSpan:
        """The rollout's span, its gaps as events; built after the call spans (it counts the failed ones)."""
        capture_gaps = _gaps(self.attachment.get("gaps"), "ng_model_call_capture.gaps")
        observations = self.record.get(OBSERVATIONS_KEY)
        observation_gaps = []
        if isinstance(observations, Mapping):
            observation_gaps = _gaps(observations.get("gaps"), f"{OBSERVATIONS_KEY}.gaps")
        codes = list(dict.fromkeys(g["code"] for g in capture_gaps))
        observed = list(dict.fromkeys(g["code"] for g in observation_gaps))
        attributes = self._root_attributes(codes, observed)
        start, end = self.known
        events = [_gap_event(g, "capture", start) for g in capture_gaps]
        events += [_gap_event(g, "ownership", start) for g in observation_gaps]
        failed, calls = self.failed_calls, len(self.calls)
        status = (
            Status(StatusCode.ERROR, f"{failed} of {calls} calls failed")
            if failed
            else Status(StatusCode.UNSET)
        )
        return ReadableSpan(
            name=f"rollout {self.rollout_id}",
            context=self.root_ctx,
            parent=None,
            resource=self.resource,
            attributes=attributes,
            events=events,
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=start,
            end_time=end,
            instrumentation_scope=SCOPE,
        )


def span_weight(span: ReadableSpan, measured: Measured = NOTHING_MEASURED) -> int:
    """About how many bytes a span takes on the wire (its string attributes dominate): what the
    exporter fills its batches by. The attributes ``measured`` names count as its size says (a
    call's payloads, measured as they were fitted), never encoded again to be weighed."""
    skip, size = measured
    size += 200
    for attributes, weighed in ((span.attributes, skip), *((e.attributes, ()) for e in span.events)):
        for key, value in (attributes or {}).items():
            if key in weighed:
                continue
            size += len(key) + 8
            if isinstance(value, str):
                size += text_bytes(value)
            elif isinstance(value, tuple | list):
                size += sum(text_bytes(v) + 4 if isinstance(v, str) else 12 for v in value)
            else:
                size += 12
    return size


def rollout_spans(
    record: Mapping[str, Any],
    *,
    include_payloads: bool = False,
    scope: ids.RunScope = ids.NO_SCOPE,
    payload_budget: int = PAYLOAD_BUDGET,
    resource: Resource | None = None,
    fallback_time_ns: int | None = None,
) -> list[ReadableSpan]:
    """The spans of one enriched record's trace, the rollout's root span first; ``[]`` for a
    record without an ``ng_model_call_capture`` attachment.

    Children of the root: each agent invocation of ``ng_agent_observations`` (calls it owns nest
    under it), each verifier invocation (its judge calls nest under it), and every other call.
    ``scope`` (the project and the run) goes into every id, the run onto the root span.
    ``include_payloads`` puts requests and responses (when the file carries them) in the
    conventions' message attributes, each call's cut to ``payload_budget`` bytes when longer
    (:mod:`.payloads`). ``resource`` defaults to the scope's project's. ``fallback_time_ns``
    times the root of a rollout whose record knows no time at all (no call or invocation timed):
    the exporter passes the enriched file's modification time. A malformed attachment raises
    :class:`EvidenceShapeError`.
    """
    weighed = weighed_spans(
        record,
        include_payloads=include_payloads,
        scope=scope,
        payload_budget=payload_budget,
        resource=resource,
        fallback_time_ns=fallback_time_ns,
    )
    return [span for span, _ in weighed]


def weighed_spans(
    record: Mapping[str, Any],
    *,
    include_payloads: bool = False,
    scope: ids.RunScope = ids.NO_SCOPE,
    payload_budget: int = PAYLOAD_BUDGET,
    resource: Resource | None = None,
    fallback_time_ns: int | None = None,
) -> list[tuple[ReadableSpan, int]]:
    """:func:`rollout_spans`, each span with its weight (:func:`span_weight`): what the exporter
    batches by, its payloads' texts measured once, where they were fitted to their budget."""
    require_otel(_MISSING)
    attachment = attachment_of(record)
    if attachment is None:
        return []
    budget = payload_budget if include_payloads else None
    resource = resource or make_resource(scope.project or None)
    trace = _Trace(record, attachment, budget, resource, fallback_time_ns, scope)
    calls = [trace.call_span(position, call) for position, call in enumerate(trace.calls)]
    others = [trace.invocation_span(inv) for inv in trace.invocations]
    others += [trace.verifier_span(vid, verifier) for vid, verifier in trace.verifiers.items()]
    root = trace.root_span()  # after the calls: it counts the failed ones
    return [(root, span_weight(root)), *calls, *((span, span_weight(span)) for span in others)]
