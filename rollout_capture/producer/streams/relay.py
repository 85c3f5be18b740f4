"""The relay: forwards a stream's events as they arrive while the dialect's assembler rebuilds
the response for the row.

Pure logic, no I/O. Each event goes on the moment it is complete, except the dialect's
terminal event, which waits until the row is durable (the client's last bytes come after
the capture). For chat streams whose client did not ask for usage, the relay hides what
the producer's added ``stream_options.include_usage`` brought.
"""

from __future__ import annotations

import logging
import re

import orjson

from rollout_capture.producer.routing import Dialect
from rollout_capture.producer.sse import SseFramer
from rollout_capture.producer.streams.assembly import Assembler, JsonObject
from rollout_capture.producer.streams.chat import ChatAssembler
from rollout_capture.producer.streams.messages import MessagesAssembler
from rollout_capture.producer.streams.responses import ResponsesAssembler

logger = logging.getLogger(__name__)


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
                # A named event without data is that event (as the openai SDK reads it) in the
                # dialects whose events are named; chat chunks are not.
                if event.named_only and self.dialect != "chat" and self._assemble(event.event, {}):
                    self._held.append(event.raw)  # a terminal event: it waits for the row
                else:
                    out.append(event.raw)  # comments, keep-alives, a named event forwarded
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
