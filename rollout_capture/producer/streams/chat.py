"""The chat completions dialect: ``chat.completion.chunk`` deltas into one ``chat.completion``."""

from __future__ import annotations

from typing import Any

from rollout_capture.producer.classify import ErrorCategory, category_for_stream_error
from rollout_capture.producer.streams.assembly import JsonObject, append


class ChatAssembler:
    """``chat.completion.chunk`` deltas into one ``chat.completion``."""

    _TOP = ("id", "created", "model", "system_fingerprint", "service_tier")

    def __init__(self) -> None:
        self.complete = False
        self.error: ErrorCategory | None = None
        self.lean = False
        self._top: JsonObject = {}
        self._missing: tuple[str, ...] = (
            self._TOP
        )  # top-level keys not seen yet (the first value found stays)
        self._choices: dict[int, JsonObject] = {}
        self._usage: Any = None
        self._seen = False  # a choice was seen: without one there is no completion to rebuild

    def feed(self, event: str | None, data: JsonObject) -> bool:
        if "error" in data or data.get("object") == "error":
            self.error = category_for_stream_error(data.get("error", data))
            return False
        if self._missing:
            found = False
            for key in self._missing:
                value = data.get(key)
                if value is not None:
                    self._top[key] = value
                    found = True
            if found:
                self._missing = tuple(key for key in self._missing if key not in self._top)
        usage = data.get("usage")
        if usage is not None:
            self._usage = usage
        for choice in data.get("choices") or ():
            if isinstance(choice, dict):
                self._seen = True
                self._feed_choice(choice)
        return False

    def _feed_choice(self, choice: JsonObject) -> None:
        index = choice.get("index", 0)
        index = index if isinstance(index, int) else 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = {"index": index, "message": {}, "finish_reason": None}
        finish = choice.get("finish_reason")
        if finish is not None:
            state["finish_reason"] = finish
        if self.lean:
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            message = state["message"]
            for key, value in delta.items():
                if key == "tool_calls" and isinstance(value, list):
                    self._feed_tool_calls(message, value)
                elif key == "reasoning":  # vLLM's name; the message says reasoning_content (NeMo Gym's)
                    if "reasoning_content" not in delta:
                        append(message, "reasoning_content", value)
                else:
                    append(message, key, value)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            merged = state.setdefault("logprobs", {})
            for key, value in logprobs.items():
                if isinstance(value, list):
                    merged.setdefault(key, []).extend(value)

    @staticmethod
    def _feed_tool_calls(message: JsonObject, deltas: list[Any]) -> None:
        calls: dict[int, JsonObject] = message.setdefault("_tool_calls", {})
        for delta in deltas:
            if not isinstance(delta, dict):
                continue
            index = delta.get("index", len(calls))
            call = calls.setdefault(index if isinstance(index, int) else len(calls), {})
            for key, value in delta.items():
                if key == "index":
                    continue
                if key == "function" and isinstance(value, dict):
                    function = call.setdefault("function", {})
                    for name, part in value.items():
                        append(function, name, part)
                else:
                    append(call, key, value)

    def result(self) -> JsonObject | None:
        if not self._seen:
            return None
        choices = []
        for index in sorted(self._choices):
            state = dict(self._choices[index])
            message = dict(state["message"])
            calls = message.pop("_tool_calls", None)
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
            message.setdefault("role", "assistant")
            message.setdefault("content", None)
            state["message"] = message
            choices.append(state)
        return {**self._top, "object": "chat.completion", "choices": choices, "usage": self._usage}
