"""The chat completions dialect: ``chat.completion.chunk`` deltas into one ``chat.completion``.

Rebuilt as NeMo Gym's capture rebuilds it (``_reconstruct_chat_sse``), so a stream reads the
same whichever producer recorded it: the message's ``role``, ``content`` (the text, null when
there is none: a stream of tool calls alone), ``reasoning_content`` (``reasoning`` too, vLLM's
name), ``refusal`` and ``tool_calls`` only; the last ``model``, ``id`` and ``usage`` a chunk
carried (``usage`` left out when none did). Beyond NeMo Gym: each choice of a stream of several
(``n`` > 1) is kept apart, where NeMo Gym folds them into one.
"""

from __future__ import annotations

from typing import Any

from rollout_capture.producer.classify import ErrorCategory, category_for_stream_error
from rollout_capture.producer.streams.assembly import JsonObject


class _Choice:
    """One choice's deltas, as NeMo Gym keeps them."""

    __slots__ = ("content", "finish_reason", "reasoning", "refusal", "role", "tool_calls")

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, JsonObject] = {}
        self.finish_reason: Any = None

    def message(self) -> JsonObject:
        message: JsonObject = {"role": self.role, "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


def _text(value: Any) -> str | None:
    """A delta's text part when it says something (NeMo Gym skips empty and missing ones)."""
    return value if isinstance(value, str) and value else None


class ChatAssembler:
    """``chat.completion.chunk`` deltas into one ``chat.completion`` (NeMo Gym's shape)."""

    def __init__(self) -> None:
        self.complete = False
        self.error: ErrorCategory | None = None
        self.lean = False
        self._model: Any = None
        self._id: str | None = None
        self._usage: Any = None
        self._choices: dict[int, _Choice] = {}

    def feed(self, event: str | None, data: JsonObject) -> bool:
        if event == "error":  # an event named error ends a chat stream too (NeMo Gym's rule)
            self.error = category_for_stream_error(data.get("error", data))
            return False
        if data.get("error") is not None or data.get("object") == "error":
            self.error = category_for_stream_error(data.get("error", data))
            return False
        self._model = data.get("model") or self._model
        if isinstance(data.get("id"), str):
            self._id = data["id"]
        if data.get("usage"):
            self._usage = data["usage"]
        for choice in data.get("choices") or ():
            if isinstance(choice, dict):
                self._feed_choice(choice)
        return False

    def _feed_choice(self, choice: JsonObject) -> None:
        index = choice.get("index", 0)
        index = index if isinstance(index, int) and not isinstance(index, bool) else 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice()
        if choice.get("finish_reason"):
            state.finish_reason = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        role = delta.get("role")
        if role:
            state.role = role
        if self.lean:  # past the body cap: no more content
            return
        text = _text(delta.get("content"))
        if text is not None:
            state.content.append(text)
        text = _text(delta.get("refusal"))
        if text is not None:
            state.refusal.append(text)
        text = _text(delta.get("reasoning_content")) or _text(delta.get("reasoning"))
        if text is not None:
            state.reasoning.append(text)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                self._feed_tool_call(state, call)

    @staticmethod
    def _feed_tool_call(state: _Choice, delta: JsonObject) -> None:
        key = delta.get("index", 0)
        key = key if isinstance(key, int) and not isinstance(key, bool) else 0
        slot = state.tool_calls.get(key)
        if slot is None:
            slot = state.tool_calls[key] = {
                "id": None,
                "type": "function",
                "function": {"name": "", "arguments": ""},
            }
        if delta.get("id"):
            slot["id"] = delta["id"]
        function = delta.get("function")
        if isinstance(function, dict):
            if function.get("name"):
                slot["function"]["name"] = function["name"]
            arguments = _text(function.get("arguments"))
            if arguments is not None:
                slot["function"]["arguments"] += arguments

    def result(self) -> JsonObject | None:
        if not self._choices:
            return None
        result: JsonObject = {
            "object": "chat.completion",
            "model": self._model,
            "choices": [
                {"index": index, "message": state.message(), "finish_reason": state.finish_reason}
                for index, state in sorted(self._choices.items())
            ],
        }
        if self._id is not None:
            result["id"] = self._id
        if self._usage:
            result["usage"] = self._usage
        return result
