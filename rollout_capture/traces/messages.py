"""A captured request and response as chat messages, for the conventions' message attributes.

The three dialects (chat, responses, messages) carry their turns differently; trace viewers
read one shape. This module reads each dialect's request and response into :class:`Message`
and renders it both ways: the GenAI conventions' ``gen_ai.input.messages`` /
``gen_ai.output.messages`` (JSON, role + parts) and OpenInference's flattened
``llm.input_messages.<i>.message.*``. What a dialect does not say is left out, never invented.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(slots=True)
class ToolCall:
    """One tool call the model asked for (``arguments`` as the JSON text it was sent as)."""

    id: str | None
    name: str | None
    arguments: str | None


@dataclass(slots=True)
class Message:
    """One turn: a role, its text, the tool calls it made, the tool call it answers."""

    role: str
    text: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    finish_reason: str | None = None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _json_text(value: Any) -> str | None:
    """Tool arguments as text: a string as it is, anything else as JSON."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return None


def _text_of(content: Any) -> str | None:
    """The text of a content value: a string, or the ``text`` of its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [
        part["text"]
        for part in content
        if isinstance(part, Mapping)
        and isinstance(part.get("text"), str)
        and part.get("type") in (None, "text", "input_text", "output_text")
    ]
    return "".join(texts) if texts else None


def _chat_message(item: Mapping[str, Any], finish_reason: str | None = None) -> Message:
    calls: list[ToolCall] = []
    for call in item.get("tool_calls") or []:
        if isinstance(call, Mapping):
            given = call.get("function")
            function: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
            calls.append(
                ToolCall(
                    _str(call.get("id")), _str(function.get("name")), _json_text(function.get("arguments"))
                )
            )
    return Message(
        role=_str(item.get("role")) or "assistant",
        text=_text_of(item.get("content")),
        tool_calls=calls,
        tool_call_id=_str(item.get("tool_call_id")),
        finish_reason=finish_reason,
    )


def _responses_items(items: list[Any], default_role: str) -> list[Message]:
    """Responses items in order: messages, and function calls / outputs as tool turns."""
    out: list[Message] = []
    for item in items:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == "function_call":
            call = ToolCall(
                _str(item.get("call_id")) or _str(item.get("id")),
                _str(item.get("name")),
                _json_text(item.get("arguments")),
            )
            if out and out[-1].role == "assistant" and out[-1].tool_call_id is None:
                out[-1].tool_calls.append(call)
            else:
                out.append(Message("assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            output, call_id = _json_text(item.get("output")), _str(item.get("call_id"))
            out.append(Message("tool", text=output, tool_call_id=call_id))
        elif kind in ("message", None) and ("role" in item or "content" in item):
            out.append(Message(_str(item.get("role")) or default_role, text=_text_of(item.get("content"))))
    return out


def _anthropic_blocks(role: str, content: Any) -> list[Message]:
    """An Anthropic turn: its text and tool uses in one message, each tool result a tool turn."""
    if isinstance(content, str) or content is None:
        return [Message(role, text=_str(content))]
    if not isinstance(content, list):
        return [Message(role)]
    main = Message(role)
    texts: list[str] = []
    results: list[Message] = []
    for block in content:
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            main.tool_calls.append(
                ToolCall(_str(block.get("id")), _str(block.get("name")), _json_text(block.get("input")))
            )
        elif kind == "tool_result":
            results.append(
                Message(
                    "tool",
                    text=_text_of(block.get("content")) or _json_text(block.get("content")),
                    tool_call_id=_str(block.get("tool_use_id")),
                )
            )
    main.text = "".join(texts) if texts else None
    return ([main] if texts or main.tool_calls or not results else []) + results


def input_messages(dialect: str | None, request: Mapping[str, Any] | None) -> list[Message]:
    """The turns a request sent (system instructions first), in the dialect's order."""
    if not isinstance(request, Mapping):
        return []
    out: list[Message] = []
    if dialect == "chat":
        out = [_chat_message(m) for m in request.get("messages") or [] if isinstance(m, Mapping)]
    elif dialect == "responses":
        if isinstance(request.get("instructions"), str):
            out.append(Message("system", text=request["instructions"]))
        given = request.get("input")
        if isinstance(given, str):
            out.append(Message("user", text=given))
        elif isinstance(given, list):
            out.extend(_responses_items(given, "user"))
    elif dialect == "messages":
        system = request.get("system")
        if system is not None:
            out.append(Message("system", text=_text_of(system)))
        for turn in request.get("messages") or []:
            if isinstance(turn, Mapping):
                out.extend(_anthropic_blocks(_str(turn.get("role")) or "user", turn.get("content")))
    return out


def output_messages(
    dialect: str | None, response: Mapping[str, Any] | None, finish_reason: str | None
) -> list[Message]:
    """The turn(s) a response gave (a chat response's choices, each its own)."""
    if not isinstance(response, Mapping):
        return []
    if dialect == "chat":
        out = []
        for choice in response.get("choices") or []:
            if isinstance(choice, Mapping) and isinstance(choice.get("message"), Mapping):
                out.append(_chat_message(choice["message"], _str(choice.get("finish_reason"))))
        return out
    if dialect == "responses":
        turns = _responses_items(response.get("output") or [], "assistant")
        merged = Message("assistant", finish_reason=finish_reason)
        texts = [m.text for m in turns if m.role == "assistant" and m.text is not None]
        merged.text = "".join(texts) if texts else None
        merged.tool_calls = [call for m in turns for call in m.tool_calls]
        return [merged] if merged.text is not None or merged.tool_calls else []
    if dialect == "messages":
        turns = _anthropic_blocks(_str(response.get("role")) or "assistant", response.get("content"))
        for turn in turns:
            turn.finish_reason = finish_reason
        return turns
    return []


def genai_json(messages: list[Message], *, output: bool) -> str:
    """``gen_ai.input.messages`` / ``gen_ai.output.messages``: role, parts (text, tool_call,
    tool_call_response) and, for output, ``finish_reason``; a JSON string, as the conventions
    allow where span attributes hold no nested objects (the Python SDK's do not)."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        parts: list[dict[str, Any]] = []
        if message.tool_call_id is not None:
            parts.append({"type": "tool_call_response", "id": message.tool_call_id, "response": message.text})
        elif message.text is not None:
            parts.append({"type": "text", "content": message.text})
        for call in message.tool_calls:
            part: dict[str, Any] = {"type": "tool_call", "name": call.name}
            if call.id is not None:
                part["id"] = call.id
            if call.arguments is not None:
                part["arguments"] = call.arguments
            parts.append(part)
        entry: dict[str, Any] = {"role": message.role, "parts": parts}
        if output and message.finish_reason is not None:
            entry["finish_reason"] = message.finish_reason
        rendered.append(entry)
    return orjson.dumps(rendered).decode()


def openinference_attributes(prefix: str, messages: list[Message]) -> dict[str, str]:
    """OpenInference's flattened message attributes under ``prefix`` (``llm.input_messages``)."""
    out: dict[str, str] = {}
    for i, message in enumerate(messages):
        at = f"{prefix}.{i}.message"
        out[f"{at}.role"] = message.role
        if message.text is not None:
            out[f"{at}.content"] = message.text
        if message.tool_call_id is not None:
            out[f"{at}.tool_call_id"] = message.tool_call_id
        for j, call in enumerate(message.tool_calls):
            tool = f"{at}.tool_calls.{j}.tool_call"
            if call.id is not None:
                out[f"{tool}.id"] = call.id
            if call.name is not None:
                out[f"{tool}.function.name"] = call.name
            if call.arguments is not None:
                out[f"{tool}.function.arguments"] = call.arguments
    return out
