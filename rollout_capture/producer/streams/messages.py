"""The Anthropic Messages dialect: its events into one ``message`` object."""

from __future__ import annotations

import orjson

from rollout_capture.producer.classify import ErrorCategory, category_for_stream_error
from rollout_capture.producer.streams.assembly import JsonObject, append


class MessagesAssembler:
    """Anthropic Messages events into one ``message`` object."""

    def __init__(self) -> None:
        self.complete = False
        self.error: ErrorCategory | None = None
        self.lean = False
        self._message: JsonObject | None = None
        self._blocks: dict[int, JsonObject] = {}
        self._json: dict[int, str] = {}

    def feed(self, event: str | None, data: JsonObject) -> bool:
        kind = data.get("type") or event
        if kind == "message_start":
            message = data.get("message")
            if isinstance(message, dict):
                self._message = dict(message)
                self._message["usage"] = dict(message.get("usage") or {})
        elif kind == "message_delta":
            message = self._message if self._message is not None else {}
            self._message = message
            delta = data.get("delta")
            if isinstance(delta, dict):
                message.update(delta)
            usage = data.get("usage")
            if isinstance(usage, dict):  # cumulative counts: the latest known value wins
                merged = message.setdefault("usage", {})
                merged.update({k: v for k, v in usage.items() if v is not None})
        elif kind == "message_stop":
            self.complete = True
            return True
        elif kind == "error":
            self.error = category_for_stream_error(data.get("error"))
            self.complete = True
            return True
        elif self.lean:
            return False
        elif kind == "content_block_start":
            index, block = data.get("index"), data.get("content_block")
            if isinstance(index, int) and isinstance(block, dict):
                self._blocks[index] = dict(block)
        elif kind == "content_block_delta":
            self._delta(data)
        elif kind == "content_block_stop":
            index = data.get("index")
            if isinstance(index, int):
                self._close_json(index)
        return False

    def _delta(self, data: JsonObject) -> None:
        index, delta = data.get("index"), data.get("delta")
        if not isinstance(index, int) or not isinstance(delta, dict):
            return
        block = self._blocks.setdefault(index, {})
        kind = delta.get("type")
        if kind == "text_delta":
            append(block, "text", delta.get("text", ""))
        elif kind == "input_json_delta":
            self._json[index] = self._json.get(index, "") + str(delta.get("partial_json", ""))
        elif kind == "thinking_delta":
            append(block, "thinking", delta.get("thinking", ""))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "citations_delta":
            block.setdefault("citations", []).append(delta.get("citation"))

    def _close_json(self, index: int) -> None:
        text = self._json.pop(index, None)
        if text is None or index not in self._blocks:
            return
        try:
            self._blocks[index]["input"] = orjson.loads(text) if text.strip() else {}
        except orjson.JSONDecodeError:
            self._blocks[index]["input"] = text  # unparseable: readers keep it as {"_raw": ...}

    def result(self) -> JsonObject | None:
        if self._message is None:
            return None
        for index in list(self._json):
            self._close_json(index)
        out = dict(self._message)
        if self._blocks or not self.lean:
            out["content"] = [self._blocks[i] for i in sorted(self._blocks)]
        return out
