"""Model calls made with the official SDKs, and what their captured rows must say."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai

from rollout_capture import CaptureStore
from rollout_capture.call_records import call_record_dict

from .scripted_upstream import CHAT, MESSAGE, RESPONSE

DIALECTS = ("chat", "responses", "messages")
API_KEY = "sk-test-secret-0001"
PLAIN = {"chat": CHAT, "responses": RESPONSE, "messages": MESSAGE}


def openai_client(base: str, rollout_id: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base}/ng-rollout/{rollout_id}/v1", api_key=API_KEY, max_retries=0, timeout=30, **kwargs
    )


def anthropic_client(base: str, rollout_id: str, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"{base}/ng-rollout/{rollout_id}", api_key=API_KEY, max_retries=0, timeout=30, **kwargs
    )


def sdk_call(
    base: str, rollout_id: str, dialect: str, stream: bool, model: str = "scripted"
) -> dict[str, Any]:
    """One call through the SDK; returns what the client saw (tool call, usage, event count)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if dialect == "chat":
        client = openai_client(base, rollout_id)
        if not stream:
            completion = client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
            call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
            return {"tool": call.function.name, "usage": completion.usage, "events": 0}  # type: ignore[union-attr]
        chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True))  # type: ignore[arg-type]
        names = [tc.function.name for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or ()]
        return {"tool": next(n for n in names if n), "usage": chunks[-1].usage, "events": len(chunks)}
    if dialect == "responses":
        client = openai_client(base, rollout_id)
        if not stream:
            response = client.responses.create(model=model, input="What is the weather in Paris?")
            return {"tool": response.output[2].name, "usage": response.usage, "events": 0}  # type: ignore[union-attr]
        events = list(
            client.responses.create(model=model, input="What is the weather in Paris?", stream=True)
        )
        final = events[-1].response  # type: ignore[union-attr]
        return {"tool": final.output[2].name, "usage": final.usage, "events": len(events)}  # type: ignore[union-attr]
    claude = anthropic_client(base, rollout_id)
    if not stream:
        message = claude.messages.create(model=model, max_tokens=64, messages=messages)  # type: ignore[arg-type]
        return {"tool": message.content[2].name, "usage": message.usage, "events": 0}  # type: ignore[union-attr]
    with claude.messages.stream(model=model, max_tokens=64, messages=messages) as events:  # type: ignore[arg-type]
        message = events.get_final_message()
    return {"tool": message.content[2].name, "usage": message.usage, "events": 1}  # type: ignore[union-attr]


def rows_of(store: CaptureStore, rollout_id: str) -> list[dict[str, Any]]:
    return store.read(rollout_id)


def derived(row: dict[str, Any]) -> dict[str, Any]:
    """The reader's call record of a row, minus what depends on timing or identity."""
    record = call_record_dict(row, 0, include_payloads=False)
    for key in ("started_at", "completed_at", "latency_total_ms", "latency_ttft_ms", "model_call_id"):
        record.pop(key)
    record.pop("capture_hold_ms", None)  # timing too, and only where the producer held the answer
    return record


def check_row(row: dict[str, Any], dialect: str, *, server_name: str | None) -> None:
    """A successful call's row: spec 4 fields, timings in order, tokens and tools as the plain answer."""
    assert row["dialect"] == dialect
    assert row["status_code"] == 200 and row["error_category"] is None
    assert row["model_ref"] == (
        None if server_name is None else {"type": "responses_api_models", "name": server_name}
    )
    assert isinstance(row["model_call_id"], str) and int(row["model_call_id"], 16) >= 0
    assert row["started_at"] <= row["completed_at"]
    assert 0 <= row["latency_ttft_ms"] <= row["latency_ms"]
    assert isinstance(row["request"], dict) and row["request"]["model"] == "scripted"
    facts = ("upstream_attempted", "response_source", "upstream_status_code", "local_response_reason")
    if "upstream_attempted" in row:  # the proxy says who answered (NeMo Gym 0.7's facts, issue 34)
        assert [row[k] for k in facts] == [True, "upstream", None, None]  # a status only when an error
    assert derived(row) == derived(
        {
            "response": PLAIN[dialect],
            "request": row["request"],
            "dialect": dialect,
            "status_code": 200,
            "model_ref": row["model_ref"],
            **{k: row[k] for k in facts if k in row},
        }
    )
    assert API_KEY not in str(row)


def post_scope(path: str) -> dict[str, Any]:
    """The ASGI scope of a ``POST`` to ``path``, as a server hands it to an app."""
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "headers": [],
        "query_string": b"",
    }


def body_then_silence(body: bytes = b'{"model": "scripted"}') -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive``: the request body, then (as a server's does) nothing until the end."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive
