"""A call's request and response as span attributes: each text sent about twice, the whole held to a
budget, so one huge call never makes a request no endpoint takes nor holds up the rollouts after it.

The messages go once per convention: OpenInference's ``llm.input_messages.*`` /
``llm.output_messages.*`` (Phoenix's LLM view) and GenAI's ``gen_ai.input.messages`` /
``gen_ai.output.messages``. ``input.value`` is the newest input turn (what the model was just
asked: the column Phoenix lists), the request's other fields are ``llm.invocation_parameters``
and each of its tools ``llm.tools.<i>.tool.json_schema``; ``output.value`` is the response whole
(a response is small beside the context that grew to it). A request or response whose messages
cannot be read (raw text, another shape) goes whole as ``input.value`` / ``output.value``.

When all of it passes ``budget`` bytes (UTF-8), the longest texts are cut to one common length
(short ones stay whole: roles, tool names, most turns), each cut text ending in a note of how
much was left out, and the span says so: ``rollout_capture.call.payload_cut`` = true and
``rollout_capture.call.payload_bytes`` (the size it would have had). Each text is measured
once, here: the size the attributes come to is handed on (the exporter fills its batches by it)
rather than measured again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_capture.traces.messages import (
    Message,
    genai_json,
    input_messages,
    openinference_attributes,
    output_messages,
)

PAYLOAD_BUDGET = 4 * 1024 * 1024
"""Bytes of payload text a call's span carries at most (the exporter's batches are as big)."""
_MARK_RESERVE = 96
"""Bytes kept free in a cut text for the note saying what was cut."""
_SLOT_OVERHEAD = 64
"""Bytes a text's attribute takes besides the text (its key, a role, JSON's quotes) when the
payload fits and its overhead is not rendered to be measured: about."""
_MESSAGE_KEYS = frozenset({"messages", "input", "instructions", "system", "tools"})
"""Request fields carried as messages or tools, not as invocation parameters (every dialect's)."""

Attributes = dict[str, str | bool | int | float | list[str]]


def text_bytes(text: str) -> int:
    """A text's size in UTF-8 (``isascii`` is free in CPython: only other texts are encoded)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def water_level(sizes: Sequence[int], budget: int) -> int:
    """The largest cap such that ``sum(min(size, cap)) <= budget`` (the largest size when all fit)."""
    remaining, left = budget, len(sizes)
    for size in sorted(sizes):
        share = remaining // left
        if size > share:
            return max(share, 0)
        remaining -= size
        left -= 1
    return max(sizes, default=0)


def cut_text(text: str, cap: int) -> str:
    """``text`` within ``cap`` bytes: as it is when it fits, else its start and a note of the cut."""
    size = text_bytes(text)
    if size <= cap:
        return text
    keep_bytes = max(cap - _MARK_RESERVE, 0)
    keep = keep_bytes if text.isascii() else int(len(text) * keep_bytes / size)
    return f"{text[:keep]}…[rollout-capture cut {len(text) - keep:,} of {len(text):,} characters]"


@dataclass(slots=True)
class _Slot:
    """One text of the payload, where it lives (a message, a tool call, a value of its own) and how
    many times it goes out (its share of the budget scales with that)."""

    owner: Any
    field: str
    copies: int

    @property
    def text(self) -> str | None:
        value = getattr(self.owner, self.field)
        return value if isinstance(value, str) else None

    def cut(self, cap: int) -> None:
        text = self.text
        if text is not None:
            setattr(self.owner, self.field, cut_text(text, cap // self.copies))


@dataclass(slots=True)
class _Value:
    """A payload value that is not a message text (``input.value``, a tool's schema...)."""

    value: str
    mime: str = "text/plain"


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _message_slots(messages: list[Message], copies: int) -> list[_Slot]:
    slots = [_Slot(m, "text", copies) for m in messages]
    slots += [_Slot(call, "arguments", copies) for m in messages for call in m.tool_calls]
    return slots


@dataclass(slots=True)
class _Payload:
    """A call's payload while it is measured and cut, rendered once it fits."""

    sent: list[Message]
    got: list[Message]
    values: dict[str, _Value]
    newest: Message | None

    @classmethod
    def read(cls, call: Mapping[str, Any], dialect: str | None, finish: str | None) -> _Payload:
        request = call.get("request") if isinstance(call.get("request"), Mapping) else None
        response = call.get("response") if isinstance(call.get("response"), Mapping) else None
        sent, got = input_messages(dialect, request), output_messages(dialect, response, finish)
        values: dict[str, _Value] = {}
        newest = next((m for m in reversed(sent) if m.text is not None), None)
        if newest is None:  # no turn read: the request whole (its raw text when it was no JSON)
            raw = call.get("request_raw")
            if request is not None:
                values["input"] = _Value(_json(request), "application/json")
            elif isinstance(raw, str):
                values["input"] = _Value(raw)
        elif request is not None:
            parameters = {k: v for k, v in request.items() if k not in _MESSAGE_KEYS}
            if parameters:
                values["llm.invocation_parameters"] = _Value(_json(parameters))
            tools = request.get("tools")
            for i, tool in enumerate(tools if isinstance(tools, list) else []):
                values[f"llm.tools.{i}.tool.json_schema"] = _Value(_json(tool))
        raw = call.get("response_raw")
        if response is not None:
            values["output"] = _Value(_json(response), "application/json")
        elif isinstance(raw, str):
            values["output"] = _Value(raw)
        return cls(sent, got, values, newest)

    def slots(self) -> list[_Slot]:
        """Every text: a message's goes out once per convention (the newest turn once more)."""
        slots = _message_slots(self.sent, 2) + _message_slots(self.got, 2)
        for slot in slots:
            if slot.owner is self.newest and slot.field == "text":
                slot.copies = 3
        return slots + [_Slot(value, "value", 1) for value in self.values.values()]

    def _overhead(self, slots: list[_Slot]) -> int:
        """Bytes the attributes take besides the texts (roles, JSON structure, mime types): the
        attributes rendered with every text blank (cheap: nothing big is copied)."""
        texts = [slot.text for slot in slots]
        for slot in slots:
            if slot.text is not None:
                setattr(slot.owner, slot.field, "")
        try:
            return sum(text_bytes(v) for v in self.attributes().values() if isinstance(v, str))
        finally:
            for slot, text in zip(slots, texts, strict=True):
                if text is not None:
                    setattr(slot.owner, slot.field, text)

    def fit(self, budget: int) -> tuple[int, int | None]:
        """Cut the longest texts until the whole fits ``budget``: about the bytes the attributes
        then take (from the texts' sizes measured here), and the size before when cut."""
        slots = self.slots()
        sizes = [text_bytes(text) * slot.copies if (text := slot.text) else 0 for slot in slots]
        total = sum(sizes)
        if total <= budget:
            return total + _SLOT_OVERHEAD * len(slots), None
        overhead = self._overhead(slots)
        # 2% kept for JSON's escapes (a quote or a line break is two bytes in gen_ai.*.messages)
        level = water_level(sizes, max(budget - overhead - budget // 50, 0))
        after = overhead
        for slot, size in zip(slots, sizes, strict=True):
            after += min(size, level)
            if size > level:
                slot.cut(level)
                if isinstance(slot.owner, _Value):
                    slot.owner.mime = "text/plain"  # a cut JSON text is JSON no more
        return after, total + overhead

    def attributes(self) -> Attributes:
        out: Attributes = {}
        for side in ("input", "output"):
            value = self.values.get(side)
            if value is not None:
                out[f"{side}.value"], out[f"{side}.mime_type"] = value.value, value.mime
        if self.newest is not None and self.newest.text is not None:
            out["input.value"], out["input.mime_type"] = self.newest.text, "text/plain"
        for name, value in self.values.items():
            if name not in ("input", "output"):
                out[name] = value.value
        if self.sent:
            out["gen_ai.input.messages"] = genai_json(self.sent, output=False)
            out.update(openinference_attributes("llm.input_messages", self.sent))
        if self.got:
            out["gen_ai.output.messages"] = genai_json(self.got, output=True)
            out.update(openinference_attributes("llm.output_messages", self.got))
        return out


def payload_attributes(
    call: Mapping[str, Any], dialect: str | None, finish: str | None, budget: int = PAYLOAD_BUDGET
) -> tuple[Attributes, int]:
    """The call's request and response under both conventions' attributes, cut to ``budget``
    bytes of text when longer (and then marked so), and about how many bytes they take (their
    texts measured once, as they were fitted: never encoded again to be weighed)."""
    payload = _Payload.read(call, dialect, finish)
    size, before = payload.fit(budget)
    out = payload.attributes()
    if before is not None:
        out["rollout_capture.call.payload_cut"] = True
        out["rollout_capture.call.payload_bytes"] = before
    return out, size
