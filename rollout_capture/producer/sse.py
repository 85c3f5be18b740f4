"""Server-sent events framing: bytes in, whole events out, each with its exact raw bytes.

A producer forwards events as they complete, byte for byte, so framing never rewrites
anything: it only finds where an event ends (a blank line, with LF, CRLF or CR endings).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One event: its raw bytes (terminator included), its ``event`` name and joined ``data``."""

    raw: bytes
    event: str | None
    data: str | None

    @property
    def named_only(self) -> bool:
        """A name and no data line (``event: response.incomplete``): the openai SDK dispatches it as
        that event (a browser's EventSource would drop it), so it is no keep-alive."""
        return self.data is None and self.event is not None


def parse_event(raw: bytes) -> SseEvent:
    """Read the fields of one event block (comments and unknown fields ignored)."""
    lf_only = b"\r" not in raw
    if lf_only and raw.startswith(b"data: ") and raw.find(b"\n") == len(raw) - 2:
        # The common shape, one ``data:`` line: what the loop below makes of it, quicker.
        return SseEvent(raw, None, raw[6:-2].decode("utf-8", "replace"))
    name: str | None = None
    data: list[str] = []
    for line in raw.split(b"\n") if lf_only else _LINE_END.split(raw):
        if not line or line.startswith(b":"):
            continue
        field, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value.decode("utf-8", "replace"))
        elif field == b"event":
            name = value.decode("utf-8", "replace")
    return SseEvent(raw, name, "\n".join(data) if data else None)


class SseFramer:
    """Incremental framing: :meth:`feed` returns the events completed by a chunk."""

    def __init__(self) -> None:
        self._buffer = b""
        self._scanned = 0  # where the buffer's first line not yet known to be non-blank starts

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Add bytes; return every event they complete, in order."""
        if not chunk:
            return []
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" not in buffer:
            return self._feed_lf(buffer)
        events: list[SseEvent] = []
        start = 0  # where the current event begins
        pos = self._scanned  # where the next unexamined line begins
        length = len(buffer)
        while pos < length:
            match = _LINE_END.search(buffer, pos)
            if match is None:
                break
            if match.group() == b"\r" and match.end() == length:
                break  # maybe the first half of CRLF: wait for the next byte
            blank = match.start() == pos
            pos = match.end()
            if blank:
                events.append(parse_event(buffer[start:pos]))
                start = pos
        self._buffer = buffer[start:]
        self._scanned = pos - start
        return events

    def _feed_lf(self, buffer: bytes) -> list[SseEvent]:
        """:meth:`feed` for a buffer with LF line ends only (the usual case): an event ends
        at the first blank line, found with one ``find`` instead of line by line."""
        events: list[SseEvent] = []
        start = 0
        while True:
            if buffer.startswith(b"\n", start):  # a blank line at an event's start is one of its own
                end = start + 1
            else:
                found = buffer.find(b"\n\n", max(start, start + self._scanned - 1))
                if found < 0:
                    break
                end = found + 2
            events.append(parse_event(buffer[start:end]))
            start = end
            self._scanned = 0
        rest = self._buffer = buffer[start:]
        self._scanned = (
            rest.rfind(b"\n") + 1
        )  # its whole lines are not blank: the next look starts after them
        return events

    def tail(self) -> bytes:
        """Bytes of an event that never completed (at the end of a stream)."""
        return self._buffer
