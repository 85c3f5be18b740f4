"""Producer logic without sockets: SSE framing, per-dialect reassembly, the relay, routing,
classification, settings and the row an exchange makes."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollout_capture.call_records import call_record_dict
from rollout_capture.producer.classify import category_for_status
from rollout_capture.producer.exchange import Exchange
from rollout_capture.producer.routing import BadRolloutId, route
from rollout_capture.producer.settings import ProducerSettings, ProxySettings
from rollout_capture.producer.sse import SseFramer
from rollout_capture.producer.streams import StreamRelay

from .support.scripted_upstream import CHAT, MESSAGE, RESPONSE, chat_events, messages_events, responses_events

STREAMS = {
    "chat": (lambda: chat_events(include_usage=True), CHAT),
    "responses": (responses_events, RESPONSE),
    "messages": (messages_events, MESSAGE),
}
TIMING = ("started_at", "completed_at", "latency_total_ms", "latency_ttft_ms", "model_call_id", "call_index")


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def derived(response: dict[str, object]) -> dict[str, object]:
    """The call record a reader derives, without what depends on timing or identity."""
    record = call_record_dict({"response": response}, 0, include_payloads=False)
    return {k: v for k, v in record.items() if k not in TIMING}


# ---------------------------------------------------------------- framing


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=40), crlf=st.booleans())
def test_framing_is_independent_of_how_bytes_arrive(cuts: list[int], crlf: bool) -> None:
    stream = b"".join(responses_events())
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    framer = SseFramer()
    events = [event for part in chunked(stream, cuts) for event in framer.feed(part)]
    assert b"".join(e.raw for e in events) == stream  # byte for byte, nothing rewritten
    assert framer.tail() == b""
    whole = SseFramer().feed(stream)
    assert [(e.event, e.data) for e in events] == [(e.event, e.data) for e in whole]
    assert events[-1].event == "response.completed"


def test_framing_fields_comments_and_multiline_data() -> None:
    framer = SseFramer()
    events = framer.feed(b": keep-alive\n\nevent: x\ndata: a\ndata:b\nid: 7\n\ndata: partial")
    assert [(e.event, e.data) for e in events] == [(None, None), ("x", "a\nb")]
    assert framer.tail() == b"data: partial"
    assert framer.feed(b"\r") == [] and framer.feed(b"\n\r\n")[0].data == "partial"


# ---------------------------------------------------------------- reassembly


@pytest.mark.parametrize("dialect", sorted(STREAMS))
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=30))
def test_a_stream_reassembles_into_what_the_plain_answer_says(dialect: str, cuts: list[int]) -> None:
    make, plain = STREAMS[dialect]
    relay = StreamRelay(dialect)  # type: ignore[arg-type]
    stream = b"".join(make())
    forwarded = b"".join(relay.feed(part) for part in chunked(stream, cuts)) + relay.finish()
    assert forwarded == stream
    assert relay.complete
    response = relay.response()
    assert response is not None
    assert derived(response) == derived(plain)
    assert derived(plain)["tool_calls"] and derived(plain)["reasoning_content"]
    assert derived(plain)["cached_tokens"] and derived(plain)["tokens_in"]


def test_chat_usage_asked_for_by_the_producer_is_hidden_from_the_client() -> None:
    relay = StreamRelay("chat", hide_usage=True)
    upstream = chat_events(include_usage=True)
    forwarded = b"".join(relay.feed(event) for event in upstream) + relay.finish()
    assert forwarded == b"".join(chat_events(include_usage=False))  # exactly what the client asked for
    assert relay.response()["usage"] == CHAT["usage"]  # type: ignore[index]


def test_the_terminal_event_waits_for_the_row() -> None:
    for dialect, (make, _) in STREAMS.items():
        events = make()
        relay = StreamRelay(dialect)  # type: ignore[arg-type]
        now = b"".join(relay.feed(event) for event in events)
        assert now == b"".join(events[:-1])  # every event as it came, but the last
        assert relay.finish() == events[-1]


@pytest.mark.parametrize("dialect", sorted(STREAMS))
def test_a_stream_cut_short_is_not_complete_and_keeps_what_came(dialect: str) -> None:
    make, _ = STREAMS[dialect]
    events = make()
    relay = StreamRelay(dialect)  # type: ignore[arg-type]
    for event in events[: len(events) // 2]:
        relay.feed(event)
    assert not relay.complete
    assert relay.response() is not None


def test_stream_errors_are_classified() -> None:
    relay = StreamRelay("messages")
    relay.feed(messages_events()[0])
    relay.feed(
        b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}\n\n'
    )
    assert relay.complete and str(relay.assembler.error) == "upstream_error"
    chat = StreamRelay("chat")
    chat.feed(b'data: {"error": {"message": "boom", "code": 429}}\n\n')
    assert str(chat.assembler.error) == "upstream_error"  # NeMo Gym's category, whatever the code


def test_past_the_cap_content_stops_but_usage_is_kept() -> None:
    relay = StreamRelay("messages", max_bytes=200)
    for event in messages_events():
        relay.feed(event)
    response = relay.response()
    assert relay.cut and relay.complete
    assert response is not None and response["usage"] == MESSAGE["usage"]


@pytest.mark.parametrize(
    ("status", "stream", "category"),
    [(200, True, None), (500, False, "upstream_error"), (429, True, "rate_limit")],
    ids=["stream", "error-body", "error-stream"],
)
def test_an_answer_over_the_cap_keeps_its_own_outcome(
    status: int, stream: bool, category: str | None
) -> None:
    """docs/faults.md: past the cap the row keeps the first bytes and says ``response_truncated``;
    the category is the answer's own (its status, how its stream ended), never ``incomplete``."""
    exchange = Exchange("1-0", "messages", server_name=None, max_body_bytes=200)
    exchange.prepare_request(b'{"model": "m"}', whole=True)
    exchange.forwarding()
    kind = b"text/event-stream" if stream else b"application/json"
    exchange.response_started(status, [(b"content-type", kind)])
    for chunk in messages_events() if stream else [orjson.dumps({"error": {"message": "x" * 500}})]:
        exchange.body(chunk)
    exchange.end()
    row = exchange.row()
    assert (row["status_code"], row["error_category"], row["response_truncated"]) == (status, category, True)


# ---------------------------------------------------------------- routing, classes, settings


def test_routing() -> None:
    found = route(
        "POST", "/ng-rollout/12-3-a1/v1/chat/completions", b"/ng-rollout/12-3-a1/v1/chat/completions"
    )
    assert (found.rollout_id, found.dialect, found.path) == ("12-3-a1", "chat", "/v1/chat/completions")
    assert route("POST", "/ng-rollout/r/v1/messages", None).dialect == "messages"
    assert route("POST", "/ng-rollout/r/v1/responses", None).dialect == "responses"
    models = route("GET", "/ng-rollout/r/v1/models", None)
    assert (models.rollout_id, models.dialect, models.path) == ("r", None, "/v1/models")
    assert route("GET", "/ng-rollout/r/v1/chat/completions", None).dialect is None  # only POST is a call
    plain = route("POST", "/v1/chat/completions", None)
    assert (plain.rollout_id, plain.dialect) == (None, None)


@pytest.mark.parametrize(
    "raw",
    [
        b"/ng-rollout/../v1/chat/completions",
        b"/ng-rollout/a%2Fb/v1/responses",
        b"/ng-rollout/%2E%2E/v1/messages",
        b"/ng-rollout/.x/v1/messages",
        b"/ng-rollout//v1/messages",
    ],
)
def test_bad_rollout_ids_are_refused(raw: bytes) -> None:
    with pytest.raises(BadRolloutId):
        route("POST", raw.decode(), raw)


def test_status_classification_follows_the_spec() -> None:
    expected = {
        200: None,
        399: None,
        408: "timeout",
        504: "timeout",
        429: "rate_limit",
        401: "auth",
        403: "auth",
    }
    expected |= {
        404: "not_found",
        400: "client_error",
        422: "client_error",
        500: "upstream_error",
        529: "upstream_error",
    }
    assert {
        s: (None if category_for_status(s) is None else str(category_for_status(s))) for s in expected
    } == expected


def test_settings_from_the_environment() -> None:
    env = {
        "ROLLOUT_CAPTURE_DIR": "s3://b/caps",
        "ROLLOUT_CAPTURE_SERVER_NAME": "policy",
        "ROLLOUT_CAPTURE_CLAIM_TTL_S": "60",
        "ROLLOUT_CAPTURE_STORAGE_OPTIONS": '{"anon": false}',
    }
    s = ProducerSettings.from_env(env)
    assert (s.capture_dir, s.server_name, s.claim_ttl_s, s.storage_options) == (
        "s3://b/caps",
        "policy",
        60.0,
        {"anon": False},
    )
    assert ProducerSettings.from_env(env, server_name="other").server_name == "other"
    with pytest.raises(ValueError, match="ROLLOUT_CAPTURE_DIR"):
        ProducerSettings.from_env({})
    with pytest.raises(ValueError, match="looks like a secret"):
        ProducerSettings.from_env({**env, "ROLLOUT_CAPTURE_STORAGE_OPTIONS": '{"secret": "x"}'})
    with pytest.raises(ValueError, match="upstream"):
        ProxySettings(capture_dir="/x", upstream="ftp://nope")
    # Spec 10, as the core checks it: a relative path would be relative to each server's cwd.
    for bad in ("captures", "./captures", "nope://bucket/captures"):
        with pytest.raises(ValueError, match="ROLLOUT_CAPTURE_DIR or --capture-dir"):
            ProducerSettings.from_env({"ROLLOUT_CAPTURE_DIR": bad})
    assert ProducerSettings(capture_dir="file:///tmp/caps").capture_dir == "file:///tmp/caps"


# ---------------------------------------------------------------- rows


def test_a_row_keeps_what_is_not_json_and_says_what_was_cut() -> None:
    exchange = Exchange("1-0", "chat", server_name="policy", max_body_bytes=10)
    assert exchange.prepare_request(b"0123456789abcdef", whole=False) == b"0123456789abcdef"
    exchange.forwarding()
    exchange.response_started(200, [(b"content-type", b"application/json")])
    exchange.body(b'{"id": "x", "padding": "0123456789"}')
    exchange.end()
    row = exchange.row()
    assert row["request"] is None and row["request_raw"] == "0123456789" and row["request_truncated"] is True
    # A good answer over the cap keeps its own outcome: it is cut in the row, not a failed call.
    assert row["response"] is None and row["response_truncated"] is True
    assert (row["status_code"], row["error_category"]) == (200, None)
    assert row["model_ref"] == {"type": "responses_api_models", "name": "policy"}

    text = Exchange("1-0", "messages", server_name=None, max_body_bytes=1000)
    text.prepare_request(b"not json", whole=True)
    text.response_started(200, [(b"content-type", b"text/plain")])
    text.body(b"plain words")
    text.end()
    row = text.row()
    assert (row["request_raw"], row["response_raw"], row["error_category"]) == (
        "not json",
        "plain words",
        "capture_parse_error",
    )
    assert row["model_ref"] is None


def test_only_chat_streams_without_usage_are_asked_for_it() -> None:
    def forwarded(dialect: str, body: dict[str, object]) -> dict[str, object]:
        exchange = Exchange("1-0", dialect, server_name=None, max_body_bytes=1 << 20)  # type: ignore[arg-type]
        return orjson.loads(exchange.prepare_request(orjson.dumps(body), whole=True))  # type: ignore[no-any-return]

    asked = forwarded("chat", {"stream": True, "stream_options": {"other": 1}})
    assert asked["stream_options"] == {"other": 1, "include_usage": True}
    assert "stream_options" not in forwarded("chat", {"stream": False})
    assert forwarded("chat", {"stream": True, "stream_options": {"include_usage": True}})[
        "stream_options"
    ] == {"include_usage": True}
    assert "stream_options" not in forwarded("responses", {"stream": True})


def test_imports_stay_light() -> None:
    """The core loads no HTTP stack; the producer loads neither Prefect nor typer."""
    import subprocess
    import sys

    code = (
        "import sys, rollout_capture; core = {'prefect', 'typer', 'httpx', 'uvicorn'} & set(sys.modules); "
        "import rollout_capture.producer; mw = {'prefect', 'typer', 'httpx', 'uvicorn'} & set(sys.modules); "
        "import rollout_capture.producer.proxy; proxy = {'prefect', 'typer'} & set(sys.modules); "
        "print(sorted(core), sorted(mw), sorted(proxy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] [] []"


@pytest.mark.parametrize(
    ("status", "streamed", "timed_out", "expected"),
    [
        (200, True, False, "stream_truncated"),
        (200, False, False, "incomplete"),
        (200, True, True, "timeout"),
        (503, True, False, "upstream_error"),  # the error status wins over how the answer ended
        (429, False, True, "rate_limit"),
    ],
)
def test_an_answer_broken_off_is_classified_from_its_status_then_how_it_ended(
    status: int, streamed: bool, timed_out: bool, expected: str
) -> None:
    exchange = Exchange("1-0", "chat", server_name=None, max_body_bytes=1000)
    exchange.prepare_request(b'{"model": "m"}', whole=True)
    kind = b"text/event-stream" if streamed else b"application/json"
    exchange.response_started(status, [(b"content-type", kind)])
    exchange.body(chat_events(include_usage=True)[0] if streamed else b'{"id": "chatcmpl')
    exchange.broke_off(timed_out=timed_out)
    exchange.end()
    assert exchange.row()["error_category"] == expected


EVENT_TYPES = {
    "chat": [None],
    "responses": ["response.output_text.delta", "response.output_item.added", "response.content_part.added"],
    "messages": ["content_block_start", "content_block_delta", "message_delta"],
}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FIELDS = st.sampled_from(
    ["choices", "delta", "index", "output_index", "content_index", "item", "part", "usage"]
)


@settings(max_examples=300, deadline=None)
@example(dialect="chat", at=2, junk={"choices": 5}, kind=0)
@example(dialect="responses", at=3, junk={"output_index": 0, "content_index": -5, "delta": "x"}, kind=0)
@given(
    dialect=st.sampled_from(sorted(STREAMS)),
    at=st.integers(0, 5),
    junk=st.dictionaries(FIELDS, JSON_VALUES, max_size=4),
    kind=st.integers(0, 2),
)
def test_a_malformed_event_is_forwarded_as_it_came_and_never_fails_the_call(
    dialect: str, at: int, junk: dict[str, object], kind: int
) -> None:
    """Whatever shape an upstream event has, the client still gets every byte: the capture
    never fails the call it records."""
    events = STREAMS[dialect][0]()
    types = EVENT_TYPES[dialect]
    event_type = types[kind % len(types)]
    body = {**junk, "type": event_type} if event_type else junk
    head = f"event: {event_type}\n".encode() if event_type and dialect != "chat" else b""
    bad = head + b"data: " + orjson.dumps(body) + b"\n\n"
    stream = [*events[:at], bad, *events[at:]]
    relay = StreamRelay(dialect)  # type: ignore[arg-type]
    forwarded = b"".join(relay.feed(event) for event in stream) + relay.finish()
    assert forwarded == b"".join(stream)


def _chunk(delta: dict[str, Any], finish: str | None = None, **top: Any) -> bytes:
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", **top}
    body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return b"data: " + orjson.dumps(body) + b"\n\n"


def test_a_chat_stream_of_tool_calls_alone_reassembles_as_nemo_gym_does() -> None:
    """NeMo Gym's rebuild (issue 34): ``content`` null when the stream said no text (OpenAI's first
    delta carries ``content: ""``), no ``created`` nor ``usage: null`` of our own making."""
    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": ""}}
    events = [
        _chunk({"role": "assistant", "content": "", "refusal": None}),
        _chunk({"tool_calls": [call]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        _chunk({}, "tool_calls"),
        b"data: [DONE]\n\n",
    ]
    relay = StreamRelay("chat")
    for event in events:
        relay.feed(event)
    assert relay.complete
    assert relay.response() == {
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "id": "c1",
    }


@pytest.mark.parametrize(
    "event", [b'event:error\ndata:{"error":"boom"}\n\n', b'event: error\ndata: {"message": "boom"}\n\n']
)
def test_an_error_event_ends_a_chat_stream_as_an_upstream_error(event: bytes) -> None:
    """NeMo Gym's own producer test (test_stream_error_events_are_terminal): ``event:error``, no
    space after the colon, in a chat stream, is the stream's error."""
    relay = StreamRelay("chat")
    relay.feed(_chunk({"role": "assistant", "content": "par"}))
    relay.feed(event)
    assert str(relay.assembler.error) == "upstream_error"
    done = StreamRelay("chat")
    done.feed(b"data:[DONE]\n\n")
    assert done.complete
