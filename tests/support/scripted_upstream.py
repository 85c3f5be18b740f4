"""A scripted model server: real-shaped answers of the three dialects, errors, slow and cut streams.

The request's ``model`` picks the script: ``scripted`` answers normally (tool calls,
reasoning, cached-token usage), ``scripted-429`` / ``-500`` / ``-400`` answer that error,
``scripted-slow-<s>`` streams with ``s`` seconds between events, ``scripted-cut`` ends a
stream without its terminal event, ``scripted-abort`` drops the connection mid-stream
(``scripted-abort-500`` too, with status 500), ``scripted-cut-body`` drops it in the middle
of a plain JSON answer,
``scripted-gated-<name>`` streams its first event and waits for ``gate(name)`` before the
rest, ``scripted-hang`` answers after 3 s, ``scripted-text`` answers 200 with plain text,
``scripted-big`` answers a large JSON body (``scripted-big-<n>``: padded to ``n`` bytes, handed
over at once in 64 KiB pieces), ``scripted-size-<n>`` a chat answer whose content is ``n``
characters (streamed or not: an agent's answers of many sizes), ``scripted-gzip`` a gzipped one
whatever was asked, ``scripted-status-<n>`` answers status ``n`` with a JSON body (999: one no
server knows),
``scripted-garbled`` streams a chat answer with a non-JSON event in its middle,
``scripted-tools-only`` a chat answer of tool calls alone (``content: ""`` in its first delta, as
OpenAI sends it), ``scripted-stream-error`` a stream whose third event is ``event:error`` (no space,
as NeMo Gym's own producer test sends it). A request whose body holds ``scripted-context-overflow``
(whatever its model: a harness may set that) is answered 400 as vLLM answers a prompt past the
model's context. Each ``seen``
request also says whether its body arrived whole (``complete``) and its ``raw_path``; the
first body bytes of each request are in ``receiving`` as soon as they arrive; its ``sent``
says when the answer's headers, first and last body bytes left, by the upstream's own clock
(``time.time()``, taken as each is handed to the server): the truth a producer's timing is
checked against. Streamed and plain answers carry the same content, so their reassembly can be
compared.
"""

from __future__ import annotations

import asyncio
import copy
import gzip
import logging
import re
import threading
import time
from typing import Any

import orjson

CREATED = 1_700_000_000
MODEL = "scripted-model"
TOOL_ARGS = '{"city": "Paris", "unit": "c"}'

CHAT = {
    "id": "chatcmpl-scripted",
    "object": "chat.completion",
    "created": CREATED,
    "model": MODEL,
    "system_fingerprint": "fp_scripted",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Let me check the weather.",
                "reasoning_content": "The user wants the weather, so call the tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": TOOL_ARGS},
                    }
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 120,
        "completion_tokens": 35,
        "total_tokens": 155,
        "prompt_tokens_details": {"cached_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 12},
    },
}

_REASONING_ITEM = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [{"type": "summary_text", "text": "Need the weather tool."}],
}
_MESSAGE_ITEM = {
    "type": "message",
    "id": "msg_1",
    "status": "completed",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "Checking the weather.", "annotations": []}],
}
_CALL_ITEM = {
    "type": "function_call",
    "id": "fc_1",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": TOOL_ARGS,
    "status": "completed",
}
RESPONSE = {
    "id": "resp_scripted",
    "object": "response",
    "created_at": CREATED,
    "status": "completed",
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "model": MODEL,
    "output": [_REASONING_ITEM, _MESSAGE_ITEM, _CALL_ITEM],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": {
        "input_tokens": 200,
        "input_tokens_details": {"cached_tokens": 128},
        "output_tokens": 40,
        "output_tokens_details": {"reasoning_tokens": 16},
        "total_tokens": 240,
    },
}

MESSAGE = {
    "id": "msg_scripted",
    "type": "message",
    "role": "assistant",
    "model": MODEL,
    "content": [
        {"type": "thinking", "thinking": "Weather needs the tool.", "signature": "sig-1"},
        {"type": "text", "text": "Checking the weather."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 50,
        "cache_creation_input_tokens": 10,
        "cache_read_input_tokens": 200,
        "output_tokens": 30,
    },
}


def _split(text: str, parts: int = 3) -> list[str]:
    step = max(1, -(-len(text) // parts))
    return [text[i : i + step] for i in range(0, len(text), step)]


def chat_events(include_usage: bool, content: str | None = None) -> list[bytes]:
    """A chat stream as OpenAI sends it (``usage: null`` on every chunk when usage is asked for);
    ``content``: the answer's text instead of the script's."""
    message = dict(CHAT["choices"][0]["message"])  # type: ignore[index]
    if content is not None:
        message["content"] = content
    head = {k: CHAT[k] for k in ("id", "created", "model", "system_fingerprint")}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": head["id"],
            "object": "chat.completion.chunk",
            "created": head["created"],
            "model": head["model"],
            "system_fingerprint": head["system_fingerprint"],
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            body["usage"] = None
        return b"data: " + orjson.dumps(body) + b"\n\n"

    call = message["tool_calls"][0]
    events = [chunk({"role": "assistant", "content": "", "refusal": None})]
    events += [chunk({"reasoning_content": part}) for part in _split(message["reasoning_content"])]
    events += [chunk({"content": part}) for part in _split(message["content"])]
    events.append(
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""},
                    }
                ]
            }
        )
    )
    events += [
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
        for part in _split(call["function"]["arguments"])
    ]
    events.append(chunk({}, "tool_calls"))
    if include_usage:
        usage = {**head, "object": "chat.completion.chunk", "choices": [], "usage": CHAT["usage"]}
        events.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def sized_chat(content: str) -> dict[str, Any]:
    """The chat answer with ``content`` as its text."""
    answer = copy.deepcopy(CHAT)
    answer["choices"][0]["message"]["content"] = content  # type: ignore[index]
    return answer


def garbled(events: list[bytes]) -> list[bytes]:
    """``events`` with the one carrying the second content delta mangled into no JSON at all."""
    found = [i for i, e in enumerate(events) if b'"content":"' in e and b'"content":""' not in e]
    at = found[1]
    return [*events[:at], b"data: {not json, " + events[at][6:30] + b"\n\n", *events[at + 1 :]]


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **body}) + b"\n\n"


def responses_events() -> list[bytes]:
    """A Responses stream: created, items and their deltas, completed (with ``event:`` lines)."""
    seq = iter(range(1000))
    start = {**copy.deepcopy(RESPONSE), "status": "in_progress", "output": [], "usage": None}
    out = [
        _event("response.created", {"sequence_number": next(seq), "response": start}),
        _event("response.in_progress", {"sequence_number": next(seq), "response": start}),
    ]

    def item_added(index: int, item: dict[str, Any]) -> None:
        out.append(
            _event(
                "response.output_item.added",
                {"sequence_number": next(seq), "output_index": index, "item": item},
            )
        )

    def item_done(index: int, item: dict[str, Any]) -> None:
        out.append(
            _event(
                "response.output_item.done",
                {"sequence_number": next(seq), "output_index": index, "item": item},
            )
        )

    item_added(0, {**_REASONING_ITEM, "summary": []})
    part = {"item_id": "rs_1", "output_index": 0, "summary_index": 0}
    text = _REASONING_ITEM["summary"][0]["text"]  # type: ignore[index]
    out.append(
        _event(
            "response.reasoning_summary_part.added",
            {"sequence_number": next(seq), **part, "part": {"type": "summary_text", "text": ""}},
        )
    )
    for piece in _split(text):
        out.append(
            _event(
                "response.reasoning_summary_text.delta",
                {"sequence_number": next(seq), **part, "delta": piece},
            )
        )
    out.append(
        _event("response.reasoning_summary_text.done", {"sequence_number": next(seq), **part, "text": text})
    )
    out.append(
        _event(
            "response.reasoning_summary_part.done",
            {"sequence_number": next(seq), **part, "part": {"type": "summary_text", "text": text}},
        )
    )
    item_done(0, _REASONING_ITEM)

    item_added(1, {**_MESSAGE_ITEM, "status": "in_progress", "content": []})
    where = {"item_id": "msg_1", "output_index": 1, "content_index": 0}
    answer = _MESSAGE_ITEM["content"][0]["text"]  # type: ignore[index]
    out.append(
        _event(
            "response.content_part.added",
            {
                "sequence_number": next(seq),
                **where,
                "part": {"type": "output_text", "text": "", "annotations": []},
            },
        )
    )
    for piece in _split(answer):
        out.append(
            _event(
                "response.output_text.delta",
                {"sequence_number": next(seq), **where, "delta": piece, "logprobs": []},
            )
        )
    out.append(
        _event(
            "response.output_text.done",
            {"sequence_number": next(seq), **where, "text": answer, "logprobs": []},
        )
    )
    out.append(
        _event(
            "response.content_part.done",
            {"sequence_number": next(seq), **where, "part": _MESSAGE_ITEM["content"][0]},  # type: ignore[index]
        )
    )
    item_done(1, _MESSAGE_ITEM)

    item_added(2, {**_CALL_ITEM, "arguments": "", "status": "in_progress"})
    for piece in _split(TOOL_ARGS):
        out.append(
            _event(
                "response.function_call_arguments.delta",
                {"sequence_number": next(seq), "item_id": "fc_1", "output_index": 2, "delta": piece},
            )
        )
    out.append(
        _event(
            "response.function_call_arguments.done",
            {"sequence_number": next(seq), "item_id": "fc_1", "output_index": 2, "arguments": TOOL_ARGS},
        )
    )
    item_done(2, _CALL_ITEM)
    out.append(_event("response.completed", {"sequence_number": next(seq), "response": RESPONSE}))
    return out


def messages_events() -> list[bytes]:
    """An Anthropic Messages stream: message_start, blocks, a ping, message_delta, message_stop."""
    usage = MESSAGE["usage"]
    start = {**MESSAGE, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}  # type: ignore[dict-item]
    blocks: list[Any] = MESSAGE["content"]  # type: ignore[assignment]
    out = [_event("message_start", {"message": start})]
    out.append(
        _event(
            "content_block_start",
            {"index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        )
    )
    for piece in _split(blocks[0]["thinking"]):
        out.append(
            _event(
                "content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": piece}}
            )
        )
    out.append(
        _event(
            "content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": "sig-1"}}
        )
    )
    out.append(_event("content_block_stop", {"index": 0}))
    out.append(_event("ping", {}))
    out.append(_event("content_block_start", {"index": 1, "content_block": {"type": "text", "text": ""}}))
    for piece in _split(blocks[1]["text"]):
        out.append(
            _event("content_block_delta", {"index": 1, "delta": {"type": "text_delta", "text": piece}})
        )
    out.append(_event("content_block_stop", {"index": 1}))
    out.append(
        _event(
            "content_block_start",
            {
                "index": 2,
                "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
            },
        )
    )
    for piece in _split(TOOL_ARGS):
        out.append(
            _event(
                "content_block_delta",
                {"index": 2, "delta": {"type": "input_json_delta", "partial_json": piece}},
            )
        )
    out.append(_event("content_block_stop", {"index": 2}))
    out.append(
        _event(
            "message_delta",
            {
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]},
            },  # type: ignore[index]
        )
    )
    out.append(_event("message_stop", {}))
    return out


CONTEXT_OVERFLOW = orjson.dumps(
    {
        "object": "error",
        "message": "This model's maximum context length is 32768 tokens. However, you requested 40000 "
        "tokens in the messages, Please reduce the length of the messages.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
)
"""vLLM's answer to a prompt past the model's context (NeMo Gym's vLLM server answers it itself)."""


def _error(dialect: str, status: int) -> bytes:
    kinds = {400: "invalid_request_error", 429: "rate_limit_error", 500: "api_error"}
    if dialect == "messages":
        return orjson.dumps(
            {"type": "error", "error": {"type": kinds[status], "message": f"scripted {status}"}}
        )
    return orjson.dumps(
        {"error": {"message": f"scripted {status}", "type": kinds[status], "param": None, "code": None}}
    )


# Answers the script cuts off: (model, stream, the (status_code, error_category) of the row that
# either producer writes). An error status wins (spec 11: classified by spec 5's rules).
CUT_ANSWERS: list[tuple[str, bool, tuple[int, str]]] = [
    ("scripted-cut", True, (200, "stream_truncated")),  # ends cleanly without its terminal event
    ("scripted-abort", True, (200, "stream_truncated")),  # the connection dropped mid-stream
    ("scripted-abort-500", True, (500, "upstream_error")),
    ("scripted-cut-body", False, (200, "incomplete")),
]
# The scripts that raise in the app to drop their connection. Under the middleware the app itself
# raised: NeMo Gym's rule, ``exception`` (an error status keeps its own category).
RAISING = frozenset({"scripted-abort", "scripted-abort-500", "scripted-cut-body"})


class ScriptAbort(Exception):
    """Raised inside the scripted server to drop a connection mid-answer."""


class _QuietAborts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ScriptAbort)


DIALECTS = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}
AZURE_DEPLOYMENT = re.compile(r"^/openai/deployments/[^/]+/chat/completions$")
"""Azure OpenAI's chat path (``AsyncAzureOpenAI``, NeMo Gym's ``azure_openai_model``): a chat call."""
LITELLM_HEALTH = "/health/readiness/details"
"""Where NeMo Gym's ``litellm_model`` asks a LiteLLM proxy its version before it serves."""
LITELLM_VERSION = "1.83.0"


def _timed(send: Any, sent: dict[str, float]) -> Any:
    """``send`` noting in ``sent`` when the headers, the first and the last body bytes left."""

    async def timed(message: dict[str, Any]) -> None:
        now = time.time()
        if message["type"] == "http.response.start":
            sent["headers"] = now
        elif message["type"] == "http.response.body":
            if message.get("body"):
                sent.setdefault("first", now)
            if not message.get("more_body", False):
                sent["last"] = now
        await send(message)

    return timed


class ScriptedUpstream:
    """The ASGI app. ``seen`` holds every request it got: method, path, query, headers, JSON body."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s  # before the first byte of every answer (the benchmark's 20 ms)
        self.seen: list[dict[str, Any]] = []
        self.receiving: list[bytes] = []  # the first body bytes of each request, as they arrive
        self._gates: dict[str, threading.Event] = {}
        logging.getLogger("uvicorn.error").addFilter(_QuietAborts())

    def gate(self, name: str) -> threading.Event:
        """The gate a ``scripted-gated-<name>`` stream waits at after its first event."""
        return self._gates.setdefault(name, threading.Event())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        first = True
        while True:
            message = await receive()
            if first:
                self.receiving.append(message.get("body", b""))
                first = False
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        complete = message["type"] == "http.request"  # else the sender went away mid-body
        try:
            request = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            request = None
        sent: dict[str, float] = {}
        self.seen.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "raw_path": scope.get("raw_path"),
                "complete": complete,
                "query": scope["query_string"].decode(),
                "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
                "body": request,
                "raw": body,
                "sent": sent,
            }
        )
        send = _timed(send, sent)
        dialect = DIALECTS.get(scope["path"]) or ("chat" if AZURE_DEPLOYMENT.match(scope["path"]) else None)
        if scope["path"] == LITELLM_HEALTH:
            await self._json(send, 200, {"status": "connected", "litellm_version": LITELLM_VERSION})
            return
        if dialect is None or scope["method"] != "POST":
            await self._json(
                send,
                200,
                {"object": "list", "data": [{"id": MODEL, "object": "model"}], "path": scope["path"]},
            )
            return
        model = request.get("model", "scripted") if isinstance(request, dict) else "scripted"
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if b"scripted-context-overflow" in body:
            await self._raw(send, 400, b"application/json", CONTEXT_OVERFLOW)
            return
        for status in (400, 429, 500):
            if model == f"scripted-{status}":
                await self._raw(send, status, b"application/json", _error(dialect, status))
                return
        if model.startswith("scripted-status-"):
            status = int(model.removeprefix("scripted-status-"))
            await self._raw(send, status, b"application/json", b'{"error": {"message": "odd status"}}')
            return
        if model == "scripted-hang":
            await asyncio.sleep(3.0)
        if model == "scripted-text":
            await self._raw(send, 200, b"text/plain", b"upstream said something that is not JSON")
            return
        if model == "scripted-gzip":  # compressed although the request may ask for identity
            body = gzip.compress(orjson.dumps(CHAT))
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-encoding", b"gzip"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if model == "scripted-cut-body":
            body = orjson.dumps(CHAT)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            raise ScriptAbort("connection dropped by the script")
        if model == "scripted-big":
            big = {**copy.deepcopy(CHAT), "padding": "x" * 200_000}
            await self._json(send, 200, big)
            return
        if model.startswith("scripted-big-"):
            await self._pieces(send, orjson.dumps({**CHAT, "padding": "x" * int(model.rsplit("-", 1)[1])}))
            return
        stream = isinstance(request, dict) and request.get("stream") is True
        sized = None
        if model.startswith("scripted-size-"):
            sized = "x" * int(model.removeprefix("scripted-size-"))
        if not stream:
            if sized is not None and dialect == "chat":
                await self._json(send, 200, sized_chat(sized))
                return
            await self._json(send, 200, {"chat": CHAT, "responses": RESPONSE, "messages": MESSAGE}[dialect])
            return
        if dialect == "chat":
            options = request.get("stream_options") or {}
            events = chat_events(bool(options.get("include_usage")), sized)
            if model == "scripted-garbled":
                events = garbled(events)
            elif model == "scripted-tools-only":
                events = [e for e in events if b'"content":"' not in e or b'"content":""' in e]
                events = [e for e in events if b'"reasoning_content"' not in e]
        elif dialect == "responses":
            events = responses_events()
        else:
            events = messages_events()
        if model == "scripted-stream-error":
            error = b'{"type":"error","error":{"type":"api_error","message":"scripted stream error"}}'
            events = [*events[:2], b"event:error\ndata:" + error + b"\n\n"]
        await self._stream(send, model, events)

    async def _stream(self, send: Any, model: str, events: list[bytes]) -> None:
        gap = float(model.rsplit("-", 1)[1]) if model.startswith("scripted-slow-") else 0.0
        if model in ("scripted-cut", "scripted-abort", "scripted-abort-500"):
            events = events[: len(events) // 2]
        await send(
            {
                "type": "http.response.start",
                "status": 500 if model == "scripted-abort-500" else 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        gate = (
            self.gate(model.removeprefix("scripted-gated-")) if model.startswith("scripted-gated-") else None
        )
        for number, event in enumerate(events):
            await send({"type": "http.response.body", "body": event, "more_body": True})
            if gap:
                await asyncio.sleep(gap)
            if gate is not None and number == 0:
                while not gate.is_set():  # no window: the test sets it (a stop cancels this wait)
                    await asyncio.sleep(0.01)
        if model in ("scripted-abort", "scripted-abort-500"):
            raise ScriptAbort("connection dropped by the script")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _pieces(send: Any, body: bytes) -> None:
        """A JSON body of known length handed to the server at once, in 64 KiB messages."""
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        for at in range(0, len(body), 1 << 16):
            await send({"type": "http.response.body", "body": body[at : at + (1 << 16)], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _json(self, send: Any, status: int, body: Any) -> None:
        await self._raw(send, status, b"application/json", orjson.dumps(body))

    @staticmethod
    async def _raw(send: Any, status: int, content_type: bytes, body: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-scripted", b"1"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})
