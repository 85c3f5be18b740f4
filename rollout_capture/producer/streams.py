"""Event streams of the three dialects: reassembly into the complete response object, and
the relay that forwards events as they arrive.

Pure logic, no I/O. The relay forwards each event the moment it is complete, except the
dialect's terminal event, which waits until the row is durable (the client's last bytes
come after the capture). For chat streams whose client did not ask for usage, the relay
hides what the producer's added ``stream_options.include_usage`` brought.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

import orjson

from rollout_capture.producer.classify import ErrorCategory, category_for_stream_error
from rollout_capture.producer.routing import Dialect
from rollout_capture.producer.sse import SseFramer

logger = logging.getLogger(__name__)

JsonObject = dict[str, Any]


class Assembler(Protocol):
    """Builds one dialect's complete response object from its stream events."""

    complete: bool
    """The dialect's terminal event was seen."""
    error: ErrorCategory | None
    """An error reported inside the stream."""
    lean: bool
    """Past the body cap: keep ids, status and usage, stop accumulating content."""

    def feed(self, event: str | None, data: JsonObject) -> bool:
        """Apply one event; True when it is the terminal one."""
        ...

    def result(self) -> JsonObject | None:
        """The response object as far as the stream went (None before any event)."""
        ...


def _append(target: JsonObject, key: str, value: Any) -> None:
    """Concatenate string deltas; take anything else as the latest value."""
    current = target.get(key)
    if isinstance(value, str) and isinstance(current, str):
        target[key] = current + value
    elif value is not None or key not in target:
        target[key] = value


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
                        _append(message, "reasoning_content", value)
                else:
                    _append(message, key, value)
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
                        _append(function, name, part)
                else:
                    _append(call, key, value)

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


class ResponsesAssembler:
    """Responses API events into one ``response`` object (the terminal event carries it whole)."""

    _TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete"})

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
        if kind in self._TERMINAL:
            self.complete = True
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
            _append(item, "arguments", data.get("delta", ""))
        elif kind == "response.reasoning_summary_text.delta":
            item = self._items.setdefault(index, {"type": "reasoning"})
            summary = item.setdefault("summary", [])
            part = data.get("summary_index", 0)
            while len(summary) <= (part if isinstance(part, int) else 0):
                summary.append({"type": "summary_text", "text": ""})
            _append(summary[part if isinstance(part, int) else 0], "text", data.get("delta", ""))
        return False

    def _text_delta(self, index: int, data: JsonObject, part_type: str) -> None:
        item = self._items.setdefault(index, {"type": "message", "role": "assistant", "content": []})
        content = item.setdefault("content", [])
        part = data.get("content_index", 0)
        part = part if isinstance(part, int) else 0
        while len(content) <= part:
            content.append({"type": part_type, "text": ""})
        if isinstance(content[part], dict):
            _append(content[part], "text", data.get("delta", ""))

    def result(self) -> JsonObject | None:
        if self.complete or self._response is None:
            return self._response
        # Cut short: the last snapshot, with the output items seen so far.
        return {**self._response, "output": [self._items[i] for i in sorted(self._items)]}


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
            _append(block, "text", delta.get("text", ""))
        elif kind == "input_json_delta":
            self._json[index] = self._json.get(index, "") + str(delta.get("partial_json", ""))
        elif kind == "thinking_delta":
            _append(block, "thinking", delta.get("thinking", ""))
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


def new_assembler(dialect: Dialect) -> Assembler:
    """The assembler of one dialect."""
    if dialect == "chat":
        return ChatAssembler()
    if dialect == "responses":
        return ResponsesAssembler()
    return MessagesAssembler()


# A top-level ``"usage": null`` member as OpenAI-compatible servers write it, with its comma.
_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,\s*')


def strip_usage(raw: bytes, data: JsonObject) -> bytes:
    """The event without its top-level ``usage`` member, bytes otherwise unchanged when possible."""
    if data.get("usage") is None and raw.count(b'"usage"') == 1:
        at = raw.find(b',"usage":null')
        if at >= 0 and raw[at + 13 : at + 14] in (b",", b"}"):  # compact JSON: what the pattern finds
            return raw[:at] + raw[at + 13 :]
        stripped, count = _USAGE_NULL.subn(b"", raw, count=1)
        if count == 1:
            return stripped
    rest = {k: v for k, v in data.items() if k != "usage"}
    return b"data: " + orjson.dumps(rest) + b"\n\n"


class StreamRelay:
    """Forwards an event stream as it arrives while reassembling it for the row.

    ``feed`` returns what may go to the client now; ``finish`` what waits for the row
    (the terminal event and anything after it, or a trailing partial event).
    """

    def __init__(
        self,
        dialect: Dialect,
        *,
        hide_usage: bool = False,
        max_bytes: int | None = None,
        label: str = "a call",
    ) -> None:
        self.dialect = dialect
        self.label = label  # names the call in a log line (never its content)
        self.assembler = new_assembler(dialect)
        self.hide_usage = hide_usage
        self.max_bytes = max_bytes
        self.bytes_seen = 0
        self.events = 0
        self.cut = False  # past max_bytes: content no longer accumulated
        self.unreadable_events = 0  # events the assembler could not take (forwarded all the same)
        self.unparsed_events = 0  # events whose data is no JSON object (forwarded all the same)
        self._framer = SseFramer()
        self._held: list[bytes] = []

    @property
    def complete(self) -> bool:
        """The terminal event was seen (the stream was not cut short)."""
        return self.assembler.complete

    def feed(self, chunk: bytes) -> bytes:
        """Take upstream bytes; return the bytes to forward now."""
        self.bytes_seen += len(chunk)
        if self.max_bytes is not None and self.bytes_seen > self.max_bytes and not self.cut:
            self.cut = self.assembler.lean = True
        out: list[bytes] = []
        for event in self._framer.feed(chunk):
            self.events += 1
            if self.assembler.complete:
                self._held.append(event.raw)
                continue
            text = event.data
            if text is None:
                out.append(event.raw)  # comments, keep-alives
                continue
            if self.dialect == "chat" and text.strip() == "[DONE]":
                self.assembler.complete = True
                self._held.append(event.raw)
                continue
            try:
                data = orjson.loads(text)
            except orjson.JSONDecodeError:
                data = None
            if not isinstance(data, dict):
                self._unparsed(text)
                out.append(event.raw)
                continue
            raw = event.raw
            if self.hide_usage and "usage" in data:
                if data.get("usage") is not None and not data.get("choices"):
                    self._assemble(event.event, data)  # the chunk we asked for: keep it from the client
                    continue
                raw = strip_usage(raw, data)
            if self._assemble(event.event, data):  # the terminal event: it waits for the row
                self._held.append(raw)
            else:
                out.append(raw)
        return b"".join(out)

    def _unparsed(self, text: str) -> None:
        """An event the response cannot be built from: counted for the row, logged once a stream.
        ``[DONE]`` (some servers end every dialect with it) and empty data are no damage."""
        stripped = text.strip()
        if not stripped or stripped == "[DONE]":
            return
        self.unparsed_events += 1
        if self.unparsed_events == 1:
            logger.warning(
                "a %s stream event of %s is not JSON (%d bytes); forwarded as is, left out of the "
                "reassembled response and counted in the row",
                self.dialect,
                self.label,
                len(text),
            )

    def _assemble(self, event: str | None, data: JsonObject) -> bool:
        """Feed the assembler; an event of a shape it cannot take is forwarded as it came
        (and logged): the capture never fails the call it records."""
        try:
            return self.assembler.feed(event, data)
        except Exception as exc:
            self.unreadable_events += 1
            if self.unreadable_events == 1:
                logger.warning(
                    "a %s stream event could not be reassembled (%r); forwarded as is", self.dialect, exc
                )
            return False

    def finish(self) -> bytes:
        """The bytes held back for after the row: the terminal event onwards, and any partial event."""
        held = b"".join(self._held) + self._framer.tail()
        self._held = []
        return held

    def response(self) -> JsonObject | None:
        """The reassembled response object."""
        return self.assembler.result()
