"""The Responses API dialect: its events into one ``response`` object."""

from __future__ import annotations

from rollout_capture.producer.classify import ErrorCategory, category_for_stream_error
from rollout_capture.producer.streams.assembly import JsonObject, append

# The terminal events, and the state each says the response ended in.
_TERMINAL = {
    "response.completed": "completed",
    "response.failed": "failed",
    "response.incomplete": "incomplete",
}


class ResponsesAssembler:
    """Responses API events into one ``response`` object (the terminal event carries it whole)."""

    def __init__(self) -> None:
        self.complete = False
        self.error: ErrorCategory | None = None
        self.lean = False
        self._response: JsonObject | None = None
        self._items: dict[int, JsonObject] = {}

    def feed(self, event: str | None, data: JsonObject) -> bool:
        kind = data.get("type") or event
        response = data.get("response")
        if isinstance(response, dict):
            self._response = response
        if kind in _TERMINAL:
            self.complete = True
            if not isinstance(response, dict) and self._response is not None:
                # Named with no response of its own (``event: response.incomplete`` and no data):
                # the last snapshot, with the items seen, ends in the state the event names.
                output = [self._items[i] for i in sorted(self._items)] or self._response.get("output")
                self._response = {**self._response, "status": _TERMINAL[kind], "output": output}
            if kind == "response.failed":
                failed = response.get("error") if isinstance(response, dict) else None
                self.error = category_for_stream_error(failed)
            elif kind == "response.incomplete":  # cut by the model (max_output_tokens...), as NeMo Gym says
                self.error = ErrorCategory.INCOMPLETE
            if self.lean and isinstance(self._response, dict):
                self._response = {**self._response, "output": []}
            return True
        if kind == "error":
            self.error = category_for_stream_error(data.get("error", data))
            self.complete = True
            return True
        if self.lean:
            return False
        index = data.get("output_index")
        if not isinstance(index, int):
            return False
        if kind in ("response.output_item.added", "response.output_item.done"):
            item = data.get("item")
            if isinstance(item, dict):
                self._items[index] = dict(item)
        elif kind == "response.output_text.delta":
            self._text_delta(index, data, "output_text")
        elif kind == "response.function_call_arguments.delta":
            item = self._items.setdefault(index, {"type": "function_call"})
            append(item, "arguments", data.get("delta", ""))
        elif kind == "response.reasoning_summary_text.delta":
            item = self._items.setdefault(index, {"type": "reasoning"})
            summary = item.setdefault("summary", [])
            part = data.get("summary_index", 0)
            while len(summary) <= (part if isinstance(part, int) else 0):
                summary.append({"type": "summary_text", "text": ""})
            append(summary[part if isinstance(part, int) else 0], "text", data.get("delta", ""))
        return False

    def _text_delta(self, index: int, data: JsonObject, part_type: str) -> None:
        item = self._items.setdefault(index, {"type": "message", "role": "assistant", "content": []})
        content = item.setdefault("content", [])
        part = data.get("content_index", 0)
        part = part if isinstance(part, int) else 0
        while len(content) <= part:
            content.append({"type": part_type, "text": ""})
        if isinstance(content[part], dict):
            append(content[part], "text", data.get("delta", ""))

    def result(self) -> JsonObject | None:
        if self.complete or self._response is None:
            return self._response
        # Cut short: the last snapshot, with the output items seen so far.
        return {**self._response, "output": [self._items[i] for i in sorted(self._items)]}
