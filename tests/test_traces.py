"""Every rollout as an OpenTelemetry trace (issues 30, 35): the mapping of an enriched record to its
spans (ids scoped to a project and a run, both conventions, nesting, gaps, payloads cut to a
budget, unknowns), the OTLP/HTTP exporter against a local receiver, and, marked ``phoenix``, a real
Phoenix read back through its REST API (two runs with the same rollout ids landing side by side)
and its trace page screenshotted in headless Chromium. The exporter against endpoints that
misbehave (redirects, trickles, huge answers) is tests/test_traces_endpoint.py.

The corpus is the bundled sample enriched by the real merge (with and without payloads), plus
one rollout of our own: an agent invocation owning a rate-limited call and a good one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture.merge import merge_model_call_capture_into_record
from rollout_capture.store import CaptureStore
from rollout_capture.summary import EvidenceShapeError

from .conftest import ROOT, SAMPLE
from .support.otlp_receiver import OtlpReceiver
from .support.phoenix import Phoenix, phoenix_server, phoenix_spans, settled_spans

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.trace import StatusCode

from rollout_capture.traces import ids
from rollout_capture.traces.exporter import (
    OtlpEndpointError,
    OtlpHeaders,
    TraceProgress,
    check_endpoint,
    export_traces,
    traces_url,
)
from rollout_capture.traces.ids import RunScope
from rollout_capture.traces.payloads import cut_text, payload_attributes, text_bytes, water_level
from rollout_capture.traces.runs import check_name, folder_run, output_run, runs_project
from rollout_capture.traces.spans import rollout_spans, weighed_spans

SECRET = "sk-test-0123456789-never-shown"
ERR_ID = "err-0"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _err_rows() -> list[dict[str, Any]]:
    """Two chat calls of one agent invocation: rate-limited (no usage), then answered."""
    base = 1_780_100_000.25
    rows = []
    for i, (status, category) in enumerate(((429, "rate_limit"), (200, None))):
        started = base + 2 * i
        response: dict[str, Any] = (
            {"error": {"type": "rate_limit_error", "message": "slow down"}}
            if status == 429
            else {
                "id": "chatcmpl-err-ok",
                "model": "model-x",
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": "checking",
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {"name": "lookup", "arguments": '{"q": "x"}'},
                                }
                            ],
                        },
                        "finish_reason": "tool_calls",
                    }
                ],
                "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37},
            }
        )
        rows.append(
            {
                "model_call_id": f"e{i:031x}",
                "dialect": "chat",
                "model_ref": {"type": "responses_api_models", "name": "policy_model"},
                "started_at": started,
                "completed_at": started + 0.75,
                "latency_ms": 750.0,
                "latency_ttft_ms": 120.0,
                "status_code": status,
                "error_category": category,
                "request": {
                    "model": "model-x",
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": [{"type": "text", "text": "find x"}]},
                    ],
                },
                "response": response,
            }
        )
    return rows


@dataclass(frozen=True)
class Corpus:
    plain: Path
    payloads: Path
    records: dict[str, dict[str, Any]]
    """rollout id -> enriched record (with payloads)"""


def _enrich(
    lines: list[bytes], captures: Path, out: Path, include_payloads: bool
) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    written = []
    for line in lines:
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            written.append(line)
            continue
        merged = merge_model_call_capture_into_record(record, [captures], include_payloads=include_payloads)
        if "ng_model_call_capture" in merged:
            records[merged["ng_model_call_capture"]["rollout_id"]] = merged
        written.append(orjson.dumps(merged))
    out.write_bytes(b"\n".join(written) + b"\n")
    return records


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    root = tmp_path_factory.mktemp("traces")
    captures = root / "captures"
    shutil.copytree(SAMPLE / "captures", captures)
    store = CaptureStore(captures)
    for row in _err_rows():
        store.record(ERR_ID, row)
    lines = [line for line in (SAMPLE / "rollouts.jsonl").read_bytes().splitlines() if line.strip()]
    lines.append(
        orjson.dumps(
            {
                "_ng_rollout_id": ERR_ID,
                "reward": 0.5,
                "agent_ref": {"name": "err_agent"},
                "ng_agent_observations": {
                    "source": "test",
                    "invocations": [
                        {
                            "invocation_id": "inv-main",
                            "agent_ref": {"name": "err_agent"},
                            "model_calls": [{"model_call_id": f"e{0:031x}"}, {"model_call_id": f"e{1:031x}"}],
                        }
                    ],
                    "gaps": [],
                },
            }
        )
    )
    plain, payloads = root / "plain.enriched.jsonl", root / "payloads.enriched.jsonl"
    _enrich(lines, captures, plain, include_payloads=False)
    records = _enrich(lines, captures, payloads, include_payloads=True)
    return Corpus(plain, payloads, records)


def _by_name(spans: list[Any]) -> dict[str, Any]:
    return {span.name: span for span in spans}


def _ns(seconds: float) -> int:
    return round(seconds * 1e6) * 1000  # the capture's microseconds


# ---------------------------------------------------------------------- ids


def test_ids_are_deterministic_distinct_and_never_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ids.trace_id("r-1") == ids.trace_id("r-1") != ids.trace_id("r-2")
    assert 0 < ids.trace_id("r-1") < 2**128
    spans = {
        ids.span_id("r-1", "rollout"),
        ids.span_id("r-1", "call", "c0"),
        ids.span_id("r-1", "call", "c1"),
        ids.span_id("r-2", "call", "c0"),  # the same call id in another rollout
        ids.span_id("r-1", "agent", "c0"),  # an invocation named like a call
        ids.span_id("r-1", "verifier", "c0"),
    }
    assert len(spans) == 6 and all(0 < s < 2**64 for s in spans)
    assert ids.call_key("abc", 3, 0) == "abc"
    assert ids.call_key(None, 3, 0) == "call_index:3" != ids.call_key(None, None, 3)
    with pytest.raises(ValueError, match="span kind"):
        ids.span_id("r-1", "tool")  # type: ignore[arg-type]
    monkeypatch.setattr(ids, "_digest", lambda *parts: bytes(32))
    assert ids.trace_id("r-1") == 1 and ids.span_id("r-1", "rollout") == 1


def test_ids_tell_runs_and_projects_apart_and_stay_the_same_for_one_run() -> None:
    """NeMo Gym's rollout ids repeat in every run: the run and the project are part of every id."""
    a, b = RunScope("p", "/runs/a/rollouts.enriched.jsonl"), RunScope("p", "/runs/b/rollouts.enriched.jsonl")
    elsewhere = RunScope("q", a.run)
    assert ids.trace_id("0-0", a) == ids.trace_id("0-0", RunScope("p", a.run))  # one run: stable
    assert len({ids.trace_id("0-0", s) for s in (a, b, elsewhere, ids.NO_SCOPE)}) == 4
    assert len({ids.span_id("0-0", "call", "c0", s) for s in (a, b, elsewhere, ids.NO_SCOPE)}) == 4
    # the parts are kept apart: moving a character from the run to the project changes the id
    assert ids.trace_id("x", RunScope("ab", "c")) != ids.trace_id("x", RunScope("a", "bc"))


def test_what_names_a_run_and_its_project() -> None:
    assert output_run("out/x.enriched.jsonl") == os.path.abspath("out/x.enriched.jsonl")
    assert output_run("file:///data/r1/x.jsonl") == output_run("/data/r1/x.jsonl") == "/data/r1/x.jsonl"
    assert output_run("s3://bucket/runs/r1/x.jsonl?versionId=3") == "s3://bucket/runs/r1/x.jsonl"
    assert folder_run(None, "r1", "s3://b/runs/r1/rollouts.enriched.jsonl") == (
        "s3://b/runs/r1/rollouts.enriched.jsonl"
    )
    assert folder_run("nightly", "r1", "/x/r1/rollouts.enriched.jsonl") == "nightly/r1"
    assert runs_project("/data/nemo-runs/") == "nemo-runs" and runs_project("s3://bucket") == "bucket"
    assert runs_project("s3://bucket/team/runs") == "runs" and runs_project("/") == "rollout-capture"
    assert check_name(None, "x") is None and check_name("run 7", "x") == "run 7"
    for bad, says in (("", "blank"), ("a\0b", "control character"), ("a\nb", "control"), ("x" * 513, "512")):
        with pytest.raises(ValueError, match=says):
            check_name(bad, "--otlp-run-name")


@pytest.mark.parametrize("char", ["x", "é", "模"])
def test_a_name_of_exactly_the_documented_maximum_is_taken_and_one_more_refused(char: str) -> None:
    """docs/contract.md 13: "at most 512 characters" (characters, not bytes): 512 is a good name."""
    assert "at most 512 characters" in (ROOT / "docs" / "contract.md").read_text()
    for what in ("--otlp-run-name", "--otlp-project"):
        assert check_name(char * 512, what) == char * 512
        with pytest.raises(ValueError, match=f"{what}: a name has at most 512 characters, this one 513"):
            check_name(char * 513, what)


def test_the_root_span_names_its_run(corpus: Corpus) -> None:
    scope = RunScope("proj", "/runs/r7/rollouts.enriched.jsonl")
    root, *children = rollout_spans(corpus.records["1-0"], scope=scope)
    assert root.attributes["rollout_capture.run.name"] == scope.run
    assert json.loads(root.attributes["metadata"])["run"] == scope.run
    assert root.resource.attributes["openinference.project.name"] == "proj"
    assert {s.context.trace_id for s in [root, *children]} == {ids.trace_id("1-0", scope)}
    assert root.context.span_id == ids.span_id("1-0", "rollout", "", scope)
    assert "rollout_capture.run.name" not in rollout_spans(corpus.records["1-0"])[0].attributes


def test_the_same_record_gives_the_same_spans(corpus: Corpus) -> None:
    record = corpus.records["1-0"]
    one, two = rollout_spans(record), rollout_spans(orjson.loads(orjson.dumps(record)))
    assert [(s.context.trace_id, s.context.span_id, s.start_time, s.end_time) for s in one] == [
        (s.context.trace_id, s.context.span_id, s.start_time, s.end_time) for s in two
    ]
    assert {s.context.trace_id for s in one} == {ids.trace_id("1-0")}


# ---------------------------------------------------------------------- the mapping


def test_call_spans_carry_both_conventions_with_the_capture_s_values(corpus: Corpus) -> None:
    from openinference.semconv.trace import SpanAttributes as OI

    record = corpus.records["1-0"]
    call = record["ng_model_call_capture"]["calls"][0]
    spans = rollout_spans(record)
    span = next(
        s for s in spans if s.attributes.get("rollout_capture.call.model_call_id") == call["model_call_id"]
    )
    a = dict(span.attributes)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "openai"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == call["model"] == a[OI.LLM_MODEL_NAME]
    assert a["gen_ai.response.id"] == call["response_id"]
    assert a["gen_ai.usage.input_tokens"] == a[OI.LLM_TOKEN_COUNT_PROMPT] == call["tokens_in"]
    assert a["gen_ai.usage.output_tokens"] == a[OI.LLM_TOKEN_COUNT_COMPLETION] == call["tokens_out"]
    assert a[OI.LLM_TOKEN_COUNT_TOTAL] == call["tokens_total"]
    assert a[OI.LLM_TOKEN_COUNT_COMPLETION_DETAILS_REASONING] == call["tokens_reasoning"]
    assert a[OI.OPENINFERENCE_SPAN_KIND] == "LLM"
    assert "error.type" not in a and span.status.status_code is StatusCode.OK
    assert span.start_time == _ns(call["started_at"]) and span.end_time == _ns(call["completed_at"])
    assert span.name == f"chat {call['model']}"
    assert span.kind.name == "CLIENT" and span.parent is not None


def test_attribute_names_are_the_conventions_own() -> None:
    """The names written as strings here are the ones the installed conventions define."""
    from openinference.semconv.trace import MessageAttributes, SpanAttributes, ToolCallAttributes
    from opentelemetry.semconv._incubating.attributes import error_attributes as E
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G

    assert {
        G.GEN_AI_OPERATION_NAME,
        G.GEN_AI_PROVIDER_NAME,
        G.GEN_AI_REQUEST_MODEL,
        G.GEN_AI_RESPONSE_MODEL,
        G.GEN_AI_RESPONSE_ID,
        G.GEN_AI_RESPONSE_FINISH_REASONS,
        G.GEN_AI_USAGE_INPUT_TOKENS,
        G.GEN_AI_USAGE_OUTPUT_TOKENS,
        G.GEN_AI_INPUT_MESSAGES,
        G.GEN_AI_OUTPUT_MESSAGES,
        G.GEN_AI_AGENT_ID,
        G.GEN_AI_AGENT_NAME,
        E.ERROR_TYPE,
        SpanAttributes.OPENINFERENCE_SPAN_KIND,
        SpanAttributes.LLM_MODEL_NAME,
        SpanAttributes.LLM_TOKEN_COUNT_PROMPT,
        SpanAttributes.LLM_TOKEN_COUNT_COMPLETION,
        SpanAttributes.LLM_TOKEN_COUNT_TOTAL,
        SpanAttributes.LLM_INPUT_MESSAGES,
        SpanAttributes.LLM_OUTPUT_MESSAGES,
        SpanAttributes.INPUT_VALUE,
        SpanAttributes.OUTPUT_VALUE,
        MessageAttributes.MESSAGE_ROLE,
        MessageAttributes.MESSAGE_CONTENT,
        MessageAttributes.MESSAGE_TOOL_CALLS,
        ToolCallAttributes.TOOL_CALL_FUNCTION_NAME,
        ToolCallAttributes.TOOL_CALL_FUNCTION_ARGUMENTS_JSON,
    } == {
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "gen_ai.response.id",
        "gen_ai.response.finish_reasons",
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.agent.id",
        "gen_ai.agent.name",
        "error.type",
        "openinference.span.kind",
        "llm.model_name",
        "llm.token_count.prompt",
        "llm.token_count.completion",
        "llm.token_count.total",
        "llm.input_messages",
        "llm.output_messages",
        "input.value",
        "output.value",
        "message.role",
        "message.content",
        "message.tool_calls",
        "tool_call.function.name",
        "tool_call.function.arguments",
    }


def test_calls_nest_under_their_agent_invocation_and_a_failed_call_is_an_error(corpus: Corpus) -> None:
    spans = rollout_spans(corpus.records[ERR_ID])
    root, *children = spans
    assert root.parent is None and root.name == f"rollout {ERR_ID}"
    agent = next(s for s in children if s.attributes["openinference.span.kind"] == "AGENT")
    assert agent.parent.span_id == root.context.span_id
    assert agent.context.span_id == ids.span_id(ERR_ID, "agent", "inv-main")
    assert (
        agent.attributes["gen_ai.agent.name"] == "err_agent"
        and agent.attributes["gen_ai.agent.id"] == "inv-main"
    )
    calls = [s for s in children if s.attributes["openinference.span.kind"] == "LLM"]
    assert len(calls) == 2 and all(c.parent.span_id == agent.context.span_id for c in calls)
    assert (agent.start_time, agent.end_time) == (
        min(c.start_time for c in calls),
        max(c.end_time for c in calls),
    )
    limited, answered = sorted(calls, key=lambda s: s.start_time)
    assert limited.status.status_code is StatusCode.ERROR and limited.attributes["error.type"] == "rate_limit"
    assert limited.attributes["http.response.status_code"] == 429
    assert answered.status.status_code is StatusCode.OK and "error.type" not in answered.attributes
    assert (
        root.status.status_code is StatusCode.ERROR
        and root.attributes["rollout_capture.rollout.failed_calls"] == 1
    )
    assert root.attributes["rollout_capture.rollout.reward"] == 0.5
    assert root.attributes["gen_ai.agent.name"] == "err_agent"
    assert (root.start_time, root.end_time) == (limited.start_time, answered.end_time)


def test_unknown_tokens_are_absent_never_zero(corpus: Corpus) -> None:
    spans = rollout_spans(corpus.records[ERR_ID])
    limited = min(
        (s for s in spans if s.attributes["openinference.span.kind"] == "LLM"), key=lambda s: s.start_time
    )
    assert not [k for k in limited.attributes if "token" in k]
    assert (
        "gen_ai.response.id" not in limited.attributes
        and "gen_ai.response.finish_reasons" not in limited.attributes
    )
    no_usage = rollout_spans(corpus.records["9-0-a1"])  # a call that reported no usage at all
    root, call = no_usage
    assert not [k for k in call.attributes if "token" in k]
    assert not [k for k in root.attributes if "tokens" in k]


def test_a_verifier_invocation_is_a_span_its_judge_calls_nest_under(corpus: Corpus) -> None:
    record = corpus.records["1-0"]
    verifier = record["ng_model_call_capture"]["verifier_invocations"][0]
    spans = rollout_spans(record)
    root = spans[0]
    span = next(s for s in spans if s.attributes["openinference.span.kind"] == "EVALUATOR")
    assert span.parent.span_id == root.context.span_id
    assert span.context.span_id == ids.span_id("1-0", "verifier", verifier["verifier_invocation_id"])
    assert span.attributes["rollout_capture.verifier.reward"] == verifier["reward"]
    assert (span.start_time, span.end_time) == (_ns(verifier["started_at"]), _ns(verifier["completed_at"]))
    judges = [s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id]
    assert [j.attributes["rollout_capture.call.model_call_id"] for j in judges] == verifier["model_call_ids"]
    assert root.attributes["rollout_capture.rollout.verifier_invocations"] == 1


def test_each_gap_is_an_event_on_the_root_span(corpus: Corpus) -> None:
    root = rollout_spans(corpus.records["3-0"])[0]
    gaps = corpus.records["3-0"]["ng_model_call_capture"]["gaps"]
    assert [e.name for e in root.events] == [g["code"] for g in gaps]
    event = root.events[0]
    assert event.attributes["rollout_capture.gap.detail"] == gaps[0]["detail"]
    assert event.attributes["rollout_capture.gap.source"] == "capture"
    assert list(root.attributes["rollout_capture.rollout.gap_codes"]) == [
        "model_call_capture_records_unreadable"
    ]
    owned = rollout_spans(corpus.records["2-0"])[0]  # an ownership gap, from ng_agent_observations
    assert [(e.name, e.attributes["rollout_capture.gap.source"]) for e in owned.events] == [
        ("model_call_ownership_unavailable", "ownership")
    ]


def test_a_rollout_without_calls_is_its_root_span_alone(corpus: Corpus) -> None:
    (root,) = rollout_spans(corpus.records["8-0"], fallback_time_ns=1_234_000_000_000)
    assert root.start_time == root.end_time == 1_234_000_000_000
    assert root.attributes["rollout_capture.rollout.times_known"] is False
    assert root.attributes["rollout_capture.rollout.num_calls"] == 0
    assert [e.name for e in root.events] == ["model_call_capture_no_records"]
    assert rollout_spans({"no": "attachment"}) == []


def test_payloads_only_when_asked_under_the_message_attributes(corpus: Corpus) -> None:
    record = corpus.records[ERR_ID]
    without = rollout_spans(record)  # the record carries payloads; they stay out unless asked
    assert not [
        k
        for s in without
        for k in s.attributes
        if k.startswith(("input.", "output.", "llm.input", "gen_ai.input"))
    ]
    answered = max(
        (
            s
            for s in rollout_spans(record, include_payloads=True)
            if s.attributes["openinference.span.kind"] == "LLM"
        ),
        key=lambda s: s.start_time,
    )
    a = answered.attributes
    assert a["llm.input_messages.0.message.role"] == "system"
    assert a["llm.input_messages.0.message.content"] == "be brief"
    assert a["llm.input_messages.1.message.content"] == "find x"
    assert a["llm.output_messages.0.message.content"] == "checking"
    assert a["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] == "lookup"
    assert a["llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments"] == '{"q": "x"}'
    assert json.loads(a["gen_ai.input.messages"])[1] == {
        "role": "user",
        "parts": [{"type": "text", "content": "find x"}],
    }
    output = json.loads(a["gen_ai.output.messages"])
    assert output[0]["finish_reason"] == "tool_calls"
    assert output[0]["parts"][1] == {
        "type": "tool_call",
        "name": "lookup",
        "id": "call_1",
        "arguments": '{"q": "x"}',
    }
    assert a["input.value"] == "find x" and a["input.mime_type"] == "text/plain"  # the newest turn
    assert json.loads(a["llm.invocation_parameters"]) == {"model": "model-x"}
    assert (
        json.loads(a["output.value"])["id"] == "chatcmpl-err-ok"
        and a["output.mime_type"] == "application/json"
    )
    assert "rollout_capture.call.payload_cut" not in a


@pytest.mark.parametrize("rollout_id", ["0-0", "6-0", "3-0"])  # responses, messages, chat
def test_payloads_of_every_dialect_read_as_messages(corpus: Corpus, rollout_id: str) -> None:
    spans = rollout_spans(corpus.records[rollout_id], include_payloads=True)
    call = next(s for s in spans if s.attributes["openinference.span.kind"] == "LLM")
    a = call.attributes
    roles = [v for k, v in a.items() if k.startswith("llm.input_messages.") and k.endswith(".message.role")]
    assert roles and "user" in roles
    assert a["llm.output_messages.0.message.role"] == "assistant"
    assert json.loads(a["gen_ai.output.messages"])[0]["role"] == "assistant"
    assert "output.value" in a


def _huge_call(context_bytes: int) -> dict[str, Any]:
    """A chat call whose early turn holds ``context_bytes`` of text, then a short newest turn."""
    return {
        "model_call_id": "huge",
        "dialect": "chat",
        "request": {
            "model": "m",
            "temperature": 0.2,
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "é" + "x" * (context_bytes - 2)},  # not ASCII: bytes, not chars
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and now?"},
            ],
        },
        "response": {
            "choices": [{"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}]
        },
    }


def _payload_bytes(attributes: dict[str, Any]) -> int:
    return sum(text_bytes(v) for k, v in attributes.items() if isinstance(v, str))


def test_a_payload_s_text_goes_about_twice_not_three_times() -> None:
    """The context (every earlier turn) once per convention; ``input.value`` is the newest turn."""
    size = 1_000_000
    a, weighed = payload_attributes(_huge_call(size), "chat", "stop")
    assert size * 2 <= _payload_bytes(a) < size * 2.05
    assert abs(weighed - _payload_bytes(a)) < 0.02 * weighed  # the size measured as it was fitted
    assert a["input.value"] == "and now?"
    assert a["llm.input_messages.1.message.content"].startswith("éxxx")
    assert json.loads(a["gen_ai.input.messages"])[1]["parts"][0]["content"].endswith("xxx")
    assert json.loads(a["llm.tools.0.tool.json_schema"])["function"]["name"] == "lookup"
    assert json.loads(a["llm.invocation_parameters"]) == {"model": "m", "temperature": 0.2}


def test_a_payload_over_its_budget_is_cut_and_says_so() -> None:
    """Past the budget the longest texts are cut to one length, each ending in a note; short ones
    (roles, the newest turn, the output) stay whole and every JSON attribute still parses."""
    budget = 200_000
    a, weighed = payload_attributes(_huge_call(3_000_000), "chat", "stop", budget)
    assert a["rollout_capture.call.payload_cut"] is True
    assert a["rollout_capture.call.payload_bytes"] > 6_000_000
    assert _payload_bytes(a) <= budget and abs(weighed - _payload_bytes(a)) < 0.05 * budget
    cut = a["llm.input_messages.1.message.content"]
    assert cut.startswith("éxxx") and cut.endswith("characters]") and "rollout-capture cut" in cut
    assert json.loads(a["gen_ai.input.messages"])[1]["parts"][0]["content"] == cut
    assert a["input.value"] == "and now?" and a["llm.output_messages.0.message.content"] == "done"
    assert a["llm.input_messages.0.message.content"] == "be brief"
    assert water_level([5, 10, 100], 60) == 45 and water_level([5, 10], 60) == 10
    assert cut_text("abc", 3) == "abc" and cut_text("a" * 500, 200).startswith("a" * 104 + "…[")


@pytest.mark.parametrize(("context", "budget"), [(300_000, 4 * 1024 * 1024), (3_000_000, 200_000)])
def test_a_call_span_weighs_what_it_encodes_to(corpus: Corpus, context: int, budget: int) -> None:
    """A call's weight (what the exporter batches by) comes from its payload's texts as they were
    measured when fitted, never encoded again, and is what the span encodes to, within 5%."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    record = orjson.loads(orjson.dumps(corpus.records[ERR_ID]))
    call = record["ng_model_call_capture"]["calls"][1]
    call.update({k: v for k, v in _huge_call(context).items() if k in ("dialect", "request", "response")})
    weighed = weighed_spans(record, include_payloads=True, payload_budget=budget)
    alone = rollout_spans(record, include_payloads=True, payload_budget=budget)
    assert [span.to_json() for span, _ in weighed] == [span.to_json() for span in alone]
    (span, weight), *_ = sorted(weighed, key=lambda pair: -pair[1])
    encoded = len(encode_spans([span]).SerializeToString())
    assert encoded > 0.9 * min(context, budget) and abs(weight - encoded) < 0.05 * encoded


def test_the_exporter_counts_the_calls_it_cut(corpus: Corpus, tmp_path: Path, receiver: OtlpReceiver) -> None:
    record = orjson.loads(orjson.dumps(corpus.records[ERR_ID]))
    record["ng_model_call_capture"]["calls"][1]["request"]["messages"][0]["content"] = "x" * 400_000
    path = tmp_path / "big.enriched.jsonl"
    path.write_bytes(orjson.dumps(record) + b"\n")
    counts = export_traces(path, receiver.url, include_payloads=True, payload_budget=100_000)
    assert counts.calls_cut == 1 and "payloads of 1 call(s) cut" in counts.sent(receiver.url)
    (cut,) = [
        s for s in receiver.spans() if any(a.key == "rollout_capture.call.payload_cut" for a in s.attributes)
    ]
    assert sum(len(a.value.string_value) for a in cut.attributes) < 110_000


def test_who_answered_a_call_is_on_its_span_when_the_record_says(corpus: Corpus) -> None:
    """The call record's upstream_attempted, response_source, upstream_status_code and
    local_response_reason (null when unknown: then absent), read from records that carry them."""
    record = orjson.loads(orjson.dumps(corpus.records[ERR_ID]))
    limited, answered = record["ng_model_call_capture"]["calls"]
    limited.update(
        upstream_attempted=False,
        response_source="local",
        upstream_status_code=None,
        local_response_reason="capture_unavailable",
    )
    answered.update(upstream_attempted=True, response_source="upstream", upstream_status_code=200)
    calls = {
        s.attributes["rollout_capture.call.model_call_id"]: s.attributes
        for s in rollout_spans(record)
        if s.attributes["openinference.span.kind"] == "LLM"
    }
    local, upstream = calls[limited["model_call_id"]], calls[answered["model_call_id"]]
    assert local["rollout_capture.call.upstream_attempted"] is False
    assert local["rollout_capture.call.response_source"] == "local"
    assert local["rollout_capture.call.local_response_reason"] == "capture_unavailable"
    assert "rollout_capture.call.upstream_status_code" not in local
    assert upstream["rollout_capture.call.upstream_attempted"] is True
    assert upstream["rollout_capture.call.upstream_status_code"] == 200
    assert "rollout_capture.call.local_response_reason" not in upstream
    before = rollout_spans(corpus.records[ERR_ID])  # records from before the fields: none of them
    assert not [k for span in before for k in span.attributes if "upstream" in k or "response_source" in k]
    answered["upstream_attempted"] = "yes"
    with pytest.raises(EvidenceShapeError, match=r"calls\[1\]\.upstream_attempted"):
        rollout_spans(record)


def test_the_payloads_of_a_nemo_gym_record_are_read_from_its_trajectory(tmp_path: Path) -> None:
    """Enrichment leaves a NeMo Gym record's payloads in its ``ng_trajectory`` alone, as NeMo Gym's
    collection does (issue 45): its calls' spans still carry them when asked."""
    from .support.projection_cases import cases

    case = next(c for c in cases() if c["name"] == "simple_agent")
    captures = tmp_path / "captures"
    captures.mkdir()
    (captures / "3-1.capture.jsonl").write_text("".join(json.dumps(row) + "\n" for row in case["rows"]))
    built = json.loads((ROOT / "tests" / "data" / "nemo_gym_070_projections.json").read_text())
    empty = next(c for c in built["cases"] if c["name"] == "simple_agent")["empty"]
    record = merge_model_call_capture_into_record(empty, [str(captures)])
    assert all("request" not in call for call in record["ng_model_call_capture"]["calls"])
    llm = [
        s
        for s in rollout_spans(record, include_payloads=True)
        if s.attributes["openinference.span.kind"] == "LLM"
    ]
    assert len(llm) == 2
    assert all(s.attributes["llm.input_messages.0.message.content"] == "weather in sf?" for s in llm)
    assert all("output.value" in s.attributes for s in llm)
    assert not [k for s in rollout_spans(record) for k in s.attributes if k.startswith("llm.input")]


def test_a_malformed_attachment_is_refused_naming_the_field(corpus: Corpus) -> None:
    record = orjson.loads(orjson.dumps(corpus.records["1-0"]))
    record["ng_model_call_capture"]["calls"][0]["tokens_in"] = 3.7
    with pytest.raises(EvidenceShapeError, match=r"calls\[0\]\.tokens_in"):
        rollout_spans(record)


def test_the_modules_import_without_opentelemetry_and_say_what_to_install() -> None:
    probe = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "from rollout_capture.traces import TracesUnavailable\n"
        "from rollout_capture.traces.exporter import export_traces\n"
        "from rollout_capture.traces.spans import rollout_spans, weighed_spans\n"
        "try:\n    rollout_spans({})\nexcept TracesUnavailable as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "pip install 'rollout-capture[otel]'" in done.stdout


# ---------------------------------------------------------------------- the exporter, a local receiver


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver()
    try:
        yield server
    finally:
        server.stop()


def test_export_streams_batches_after_an_empty_probe(corpus: Corpus, receiver: OtlpReceiver) -> None:
    seen: list[TraceProgress] = []
    counts = export_traces(
        corpus.plain, receiver.url, headers={"api_key": SECRET}, batch_spans=5, progress=seen.append
    )
    expected = sum(len(rollout_spans(r)) for r in corpus.records.values())
    assert (counts.rollouts, counts.spans, counts.lines_skipped) == (len(corpus.records), expected, 2)
    assert counts.calls == sum(len(r["ng_model_call_capture"]["calls"]) for r in corpus.records.values())
    assert receiver.bodies[0] == b""  # the probe: an empty export request, before any span
    assert len(receiver.bodies) == counts.batches + 1 and counts.batches > 1
    assert all(
        {k.lower(): v for k, v in h.items()}.get("api_key") == SECRET
        for h in (r.headers for r in receiver.received)
    )
    assert seen[-1] == TraceProgress(counts.rollouts, counts.spans, counts.batches)
    spans = receiver.spans()
    assert len(spans) == expected and len({bytes(s.span_id) for s in spans}) == expected
    run = RunScope("", str(corpus.plain))  # the run: the file's own location
    assert counts.run == run.run and counts.project is None
    assert {int.from_bytes(s.trace_id, "big") for s in spans} == {
        ids.trace_id(r, run) for r in corpus.records
    }


def test_an_unreachable_endpoint_fails_before_anything_is_sent(corpus: Corpus) -> None:
    port = _free_port()
    with pytest.raises(OtlpEndpointError, match=rf"127\.0\.0\.1:{port}/v1/traces is unreachable") as caught:
        export_traces(corpus.plain, f"http://127.0.0.1:{port}", headers={"authorization": SECRET})
    assert SECRET not in str(caught.value) and "nothing was sent" in str(caught.value)


@pytest.mark.parametrize(
    ("status", "says"), [(401, "refused the credentials"), (404, "no OTLP/HTTP traces receiver")]
)
def test_a_refusing_endpoint_is_named_without_its_headers(corpus: Corpus, status: int, says: str) -> None:
    server = OtlpReceiver(status=status)
    try:
        with pytest.raises(OtlpEndpointError, match=says) as caught:
            export_traces(corpus.plain, server.url + "/v1/traces?tenant=q", headers={"x-api-key": SECRET})
        assert len(server.bodies) == 1 and server.bodies[0] == b""  # only the probe
        assert SECRET not in str(caught.value) and "tenant=q" not in str(caught.value)
    finally:
        server.shutdown()
        server.server_close()


def test_a_receiver_pushing_back_slows_the_export_down_and_a_refusal_stops_it(corpus: Corpus) -> None:
    busy = OtlpReceiver(then=[503, 503, 429])  # Phoenix answers 503 while its ingestion queue is full
    try:
        counts = export_traces(corpus.plain, busy.url)
        assert busy.spans() and len({bytes(s.span_id) for s in busy.spans()}) == counts.spans
    finally:
        busy.shutdown()
        busy.server_close()
    refusing = OtlpReceiver(then=[400])
    try:
        with pytest.raises(
            OtlpEndpointError,
            match=r"refused a batch of \d+ spans \(HTTP 400 Bad Request; [\d,]+ bytes\) after 0",
        ):
            export_traces(corpus.plain, refusing.url, headers={"authorization": SECRET})
        assert len(refusing.bodies) == 2  # the probe, the one batch: a refusal is not retried
    finally:
        refusing.shutdown()
        refusing.server_close()


def test_headers_never_show_and_urls_are_checked() -> None:
    headers = OtlpHeaders({"authorization": SECRET})
    assert (
        SECRET not in repr(headers)
        and SECRET not in str(headers)
        and dict(headers) == {"authorization": SECRET}
    )
    assert traces_url("http://h:4318") == traces_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert traces_url("https://h/api/v1/traces") == "https://h/api/v1/traces"
    with pytest.raises(ValueError, match="credentials in the URL") as caught:
        traces_url(f"http://user:{SECRET}@h:4318")
    assert SECRET not in str(caught.value)
    with pytest.raises(ValueError, match="http"):
        traces_url("grpc://h:4317")
    with pytest.raises(OtlpEndpointError):
        check_endpoint(f"http://127.0.0.1:{_free_port()}", headers, timeout_s=2)


def test_a_malformed_line_stops_the_export_naming_file_and_line(
    corpus: Corpus, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.enriched.jsonl"
    lines = corpus.plain.read_bytes().splitlines()
    record = orjson.loads(lines[1])
    record["ng_model_call_capture"]["calls"][0]["status_code"] = "200"
    bad.write_bytes(b"\n".join([lines[0], orjson.dumps(record)]) + b"\n")
    with pytest.raises(EvidenceShapeError, match=r"bad\.enriched\.jsonl:2: .*status_code"):
        export_traces(bad, receiver.url)


# ---------------------------------------------------------------------- a real Phoenix


PROJECT = "rollout-capture-test"


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    """``phoenix serve`` on free ports with its own working dir, telemetry off; stopped after."""
    pytest.importorskip("phoenix")
    with phoenix_server(tmp_path_factory.mktemp("phoenix")) as server:
        yield server


def _phoenix_spans(phoenix: Phoenix, project: str = PROJECT) -> list[dict[str, Any]]:
    return phoenix_spans(phoenix, project)


def _settled(phoenix: Phoenix, count: int, project: str = PROJECT) -> list[dict[str, Any]]:
    return settled_spans(phoenix, count, project)


def _scope(corpus: Corpus) -> RunScope:
    """The run the module's Phoenix export is: the payloads file's own location, in PROJECT."""
    return RunScope(PROJECT, str(corpus.payloads))


def _after_all_sent_landed(phoenix: Phoenix, tmp_path: Path, corpus: Corpus) -> None:
    """Once a sentinel run sent after everything else is stored, so is everything sent before it:
    Phoenix ingests spans in the order their requests were accepted, whatever their project."""
    sentinel = tmp_path / f"sentinel-{time.monotonic_ns()}.jsonl"
    sentinel.write_bytes(orjson.dumps(corpus.records["8-0"]) + b"\n")  # one root span
    project = f"sentinel-{sentinel.stem}"
    counts = export_traces(sentinel, phoenix.url, project=project)
    _settled(phoenix, counts.spans, project)


def _micros(text: str) -> int:
    moment = datetime.fromisoformat(text)
    return (int(moment.timestamp()) * 1_000_000) + moment.microsecond


@pytest.fixture(scope="module")
def exported(phoenix: Phoenix, corpus: Corpus) -> list[dict[str, Any]]:
    counts = export_traces(corpus.payloads, phoenix.url, project=PROJECT, include_payloads=True)
    spans = _settled(phoenix, counts.spans)
    assert len(spans) == counts.spans
    return spans


@pytest.mark.integration
@pytest.mark.phoenix
def test_phoenix_holds_the_spans_with_the_enriched_file_s_tokens_and_times(
    corpus: Corpus, exported: list[dict[str, Any]]
) -> None:
    by_span = {s["context"]["span_id"]: s for s in exported}
    for rollout_id, record in corpus.records.items():
        attachment = record["ng_model_call_capture"]
        scope = _scope(corpus)
        trace = f"{ids.trace_id(rollout_id, scope):032x}"
        root = by_span[f"{ids.span_id(rollout_id, 'rollout', '', scope):016x}"]
        assert root["attributes"]["rollout_capture.run.name"] == scope.run
        assert root["context"]["trace_id"] == trace and root["parent_id"] is None
        assert root["span_kind"] == "CHAIN"
        assert root["attributes"]["rollout_capture.rollout.id"] == rollout_id
        assert root["attributes"]["rollout_capture.rollout.num_calls"] == len(attachment["calls"])
        for field in ("tokens_in", "tokens_out", "tokens_total"):
            assert root["attributes"].get(f"rollout_capture.rollout.{field}") == attachment["metrics"][field]
        assert [e["name"] for e in root["events"]][: len(attachment.get("gaps", []))] == [
            g["code"] for g in attachment.get("gaps", [])
        ]
        for position, call in enumerate(attachment["calls"]):
            key = ids.call_key(call["model_call_id"], call["call_index"], position)
            span = by_span[f"{ids.span_id(rollout_id, 'call', key, scope):016x}"]
            a = span["attributes"]
            assert span["context"]["trace_id"] == trace and span["span_kind"] == "LLM"
            assert _micros(span["start_time"]) == round(call["started_at"] * 1e6)
            assert _micros(span["end_time"]) == round(call["completed_at"] * 1e6)
            assert a.get("gen_ai.usage.input_tokens") == a.get("llm.token_count.prompt") == call["tokens_in"]
            assert (
                a.get("gen_ai.usage.output_tokens")
                == a.get("llm.token_count.completion")
                == call["tokens_out"]
            )
            assert a.get("llm.token_count.total") == call["tokens_total"]
            assert a["gen_ai.response.model"] == a["llm.model_name"] == call["model"]
            assert a.get("gen_ai.response.id") == call["response_id"]
            assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] in (
                "openai",
                "anthropic",
            )
            assert a.get("error.type") == call["error_category"]
            assert span["status_code"] == ("ERROR" if call["error_category"] else "OK")
            if call["response"] is not None:  # payloads asked for: the response is there whole
                assert json.loads(a["output.value"]) == call["response"]
            if call["response"] and (call["response"].get("choices") or call["response"].get("output")):
                assert a["llm.output_messages.0.message.role"] == "assistant"
    err = [s for s in exported if s["context"]["trace_id"] == f"{ids.trace_id(ERR_ID, _scope(corpus)):032x}"]
    agent = next(s for s in err if s["span_kind"] == "AGENT")
    assert {s["parent_id"] for s in err if s["span_kind"] == "LLM"} == {agent["context"]["span_id"]}
    verifier = next(s for s in exported if s["span_kind"] == "EVALUATOR")
    judges = [s for s in exported if s["parent_id"] == verifier["context"]["span_id"]]
    assert [j["attributes"]["llm.model_name"] for j in judges] == ["judge"]


@pytest.mark.integration
@pytest.mark.phoenix
def test_exporting_again_does_not_double_a_trace_in_phoenix(
    phoenix: Phoenix, corpus: Corpus, exported: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Phoenix keys spans by span id and keeps the first it stored (insert, on conflict do
    nothing): a second export adds nothing, and a re-enriched record re-exported as the same run
    (its name given) leaves the stored span as it was (to replace it, delete the trace first)."""
    export_traces(corpus.payloads, phoenix.url, project=PROJECT, include_payloads=True)
    changed = tmp_path / "re-enriched.jsonl"
    record = orjson.loads(orjson.dumps(corpus.records[ERR_ID]))
    record["reward"] = 0.75
    changed.write_bytes(orjson.dumps(record) + b"\n")
    export_traces(changed, phoenix.url, project=PROJECT, run=str(corpus.payloads))
    _after_all_sent_landed(phoenix, tmp_path, corpus)
    again = _phoenix_spans(phoenix)
    assert len(again) == len(exported)
    assert sorted(s["context"]["span_id"] for s in again) == sorted(s["context"]["span_id"] for s in exported)
    root_id = f"{ids.span_id(ERR_ID, 'rollout', '', _scope(corpus)):016x}"
    root = next(s for s in again if s["context"]["span_id"] == root_id)
    assert root["attributes"]["rollout_capture.rollout.reward"] == 0.5  # the first export's


def _records(path: Path) -> dict[str, dict[str, Any]]:
    """The records of an enriched file that carry an attachment, by rollout id."""
    out = {}
    for line in path.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict) and "ng_model_call_capture" in record:
            out[record["ng_model_call_capture"]["rollout_id"]] = record
    return out


@pytest.mark.integration
@pytest.mark.phoenix
def test_two_runs_with_the_same_rollout_ids_land_side_by_side_in_one_project(
    phoenix: Phoenix, corpus: Corpus, tmp_path: Path
) -> None:
    """Run B repeats run A's rollout ids with other rewards and one call fewer: exported one after
    the other into one project, each rollout of each run is a trace of its own (its run's reward,
    its run's spans), and exporting either again changes nothing."""
    project = "two-runs"
    run_a, run_b = tmp_path / "a" / "rollouts.enriched.jsonl", tmp_path / "b" / "rollouts.enriched.jsonl"
    run_a.parent.mkdir()
    run_b.parent.mkdir()
    shutil.copyfile(corpus.plain, run_a)
    lines = []
    for line in corpus.plain.read_bytes().splitlines():
        record = orjson.loads(line) if line.startswith(b"{") else None
        if isinstance(record, dict) and "ng_model_call_capture" in record:
            record["reward"] = 100 + len(lines)
            if record["ng_model_call_capture"]["rollout_id"] == ERR_ID:
                del record["ng_model_call_capture"]["calls"][1]
            line = orjson.dumps(record)
        lines.append(line)
    run_b.write_bytes(b"\n".join(lines) + b"\n")
    sent = [export_traces(path, phoenix.url, project=project) for path in (run_a, run_b)]
    assert sent[0].run == str(run_a) and sent[1].run == str(run_b)
    total = sum(counts.spans for counts in sent)
    stored = _settled(phoenix, total, project)
    assert len(stored) == total
    traces: dict[str, list[dict[str, Any]]] = {}
    for span in stored:
        traces.setdefault(span["context"]["trace_id"], []).append(span)
    for path in (run_a, run_b):
        scope = RunScope(project, str(path))
        for rollout_id, record in _records(path).items():
            trace = traces[f"{ids.trace_id(rollout_id, scope):032x}"]
            (root,) = [span for span in trace if span["parent_id"] is None]
            assert root["attributes"]["rollout_capture.run.name"] == str(path)
            assert root["attributes"].get("rollout_capture.rollout.reward") == record.get("reward")
            assert len(trace) == len(rollout_spans(record, scope=scope))
    assert (
        len(traces[f"{ids.trace_id(ERR_ID, RunScope(project, str(run_b))):032x}"]) == 3
    )  # root, agent, call
    for path in (run_b, run_a):
        export_traces(path, phoenix.url, project=project)
    _after_all_sent_landed(phoenix, tmp_path, corpus)
    again = _phoenix_spans(phoenix, project)
    assert sorted(s["context"]["span_id"] for s in again) == sorted(s["context"]["span_id"] for s in stored)


@pytest.mark.integration
@pytest.mark.phoenix
def test_the_export_command_to_a_real_phoenix_reads_back_every_span(phoenix: Phoenix, tmp_path: Path) -> None:
    """``rollout-capture export --otlp`` (the CLI, its own process) into the module's Phoenix, a
    project of its own: every span the mapping promises is read back."""
    pytest.importorskip("opentelemetry.sdk.trace")
    from .support.cli import run_cli
    from .test_cli_outputs import _expected_spans
    from .test_report import build_corpus

    _, enriched = build_corpus(tmp_path / "bad")
    rollouts, calls, spans = _expected_spans(enriched)
    done = run_cli("export", str(enriched), "--otlp", phoenix.url, "--otlp-project", "cli-test", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["traces"]["spans"] == spans
    found = _settled(phoenix, spans, "cli-test")
    assert len(found) == spans
    roots = [span for span in found if span["name"].startswith("rollout ")]
    assert len(roots) == rollouts
    assert sum(1 for span in found if span["name"].startswith("chat ")) == calls


@pytest.mark.integration
@pytest.mark.phoenix
def test_an_unreachable_phoenix_port_sends_nothing(phoenix: Phoenix, corpus: Corpus) -> None:
    with pytest.raises(OtlpEndpointError, match="unreachable"):
        export_traces(corpus.plain, f"http://127.0.0.1:{_free_port()}", project="never-created")
    assert _phoenix_spans(phoenix, "never-created") == []


CHROMIUM = shutil.which("chromium")


@pytest.mark.integration
@pytest.mark.phoenix
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium")
def test_the_trace_page_of_a_rollout_renders_in_headless_chromium(
    phoenix: Phoenix, corpus: Corpus, exported: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Phoenix's own trace page for the rollout with an agent invocation and a failed call;
    the first screenshot is also kept as out/phoenix-trace.png (the issue's closing note)."""
    assert CHROMIUM is not None
    shot = tmp_path / "phoenix-trace.png"
    home = tmp_path / "home"
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            f"--user-data-dir={home}",
            "--window-size=1600,1000",
            "--virtual-time-budget=20000",
            "--run-all-compositor-stages-before-draw",
            f"--screenshot={shot}",
            f"{phoenix.url}/redirects/traces/{ids.trace_id(ERR_ID, _scope(corpus)):032x}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HOME": str(home)},
        check=False,
    )
    assert shot.exists() and shot.stat().st_size > 20_000, done.stderr[-2000:]
    kept = ROOT / "out" / "phoenix-trace.png"
    if not kept.exists():
        kept.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, kept)
