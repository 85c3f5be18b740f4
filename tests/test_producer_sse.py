"""``rollout_capture.producer.sse``: events framed byte for byte, whatever the chunking and line ends."""

from __future__ import annotations

import pytest

from rollout_capture.producer.sse import SseEvent, SseFramer, parse_event

STREAM = (
    b'data: {"a": 1}\n\n'
    b": keep-alive comment\n\n"
    b"event: response.created\ndata: line one\ndata: line two\n\n"
    b"event: response.incomplete\n\n"
    b"data: [DONE]\n\n"
)


def test_parse_event_reads_name_and_joined_data_and_keeps_the_raw_bytes() -> None:
    raw = b"event: delta\r\ndata:first\r\n: a comment\r\nid: 7\r\ndata: second\r\n\r\n"
    assert parse_event(raw) == SseEvent(raw, "delta", "first\nsecond")
    assert parse_event(b"data: x\n\n") == SseEvent(b"data: x\n\n", None, "x")
    assert parse_event(b": only a comment\n\n").data is None


def test_an_event_with_a_name_and_no_data_is_named_only() -> None:
    assert parse_event(b"event: response.incomplete\n\n").named_only
    assert not parse_event(b"data: x\n\n").named_only
    assert not parse_event(b":\n\n").named_only  # a keep-alive


def _framed(chunks: list[bytes]) -> tuple[list[SseEvent], bytes]:
    framer = SseFramer()
    events = [event for chunk in chunks for event in framer.feed(chunk)]
    return events, framer.tail()


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_every_split_of_a_stream_frames_the_same_events(ending: bytes) -> None:
    stream = STREAM.replace(b"\n", ending)
    whole, tail = _framed([stream])
    assert b"".join(event.raw for event in whole) + tail == stream
    expected = [
        (None, '{"a": 1}'),
        (None, None),
        ("response.created", "line one\nline two"),
        ("response.incomplete", None),
        (None, "[DONE]"),
    ]
    # A CR the stream ends with may be the first half of a CRLF: the last event waits for a byte.
    assert [(e.event, e.data) for e in whole] == (expected[:-1] if ending == b"\r" else expected)
    assert tail == (b"data: [DONE]\r\r" if ending == b"\r" else b"")
    for cut in range(1, len(stream)):
        for second in (cut, min(len(stream), cut + 7)):
            events, rest = _framed([stream[:cut], stream[cut:second], stream[second:]])
            assert (events, rest) == (whole, tail), (ending, cut, second)


def test_a_cr_at_the_end_of_a_chunk_waits_for_a_possible_lf() -> None:
    framer = SseFramer()
    assert framer.feed(b"data: x\r\n\r") == []
    (event,) = framer.feed(b"\n")
    assert event.raw == b"data: x\r\n\r\n" and event.data == "x"


def test_an_unfinished_event_stays_in_the_tail() -> None:
    framer = SseFramer()
    assert [e.data for e in framer.feed(b"data: one\n\ndata: cut sho")] == ["one"]
    assert framer.tail() == b"data: cut sho"
    assert framer.feed(b"") == []
