"""JSONL capture bytes to rows (spec 2, "Readers"): add_jsonl against a split-based oracle."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_capture.rows import Damage, add_jsonl, new_parsed_rows


def reference(data: bytes, source: str) -> tuple[list[tuple[int, Any]], list[Damage], int]:
    """The reader's rules written the obvious way: split, skip blanks, one position per row."""
    rows, damaged, position = [], [], 0
    lines = data.split(b"\n")
    for number, line in enumerate(lines, start=1):
        if not line or line.isspace():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            damaged.append(Damage(source, number, "torn final line" if number == len(lines) else "not JSON"))
        else:
            if type(row) is dict:
                rows.append((position, row))
            else:
                damaged.append(Damage(source, number, f"not a JSON object ({type(row).__name__})"))
        position += 1
    return rows, damaged, position


pieces = st.one_of(
    st.sampled_from(
        [b"", b" ", b"\t", b"\r", b"\x0b", b"{}", b"[]", b"1", b'{"a": 1}', b'{"a"', b" {} ", b"\xff"]
    ),
    st.binary(max_size=4),
)


@given(st.lists(pieces, max_size=6), st.sampled_from([b"\n", b"\r\n", b"\n\n"]), st.booleans())
@settings(max_examples=400, deadline=None)
def test_add_jsonl_matches_the_reference(parts: list[bytes], separator: bytes, terminated: bool) -> None:
    data = separator.join(parts) + (separator if terminated else b"")
    parsed = new_parsed_rows()
    add_jsonl(parsed, data, "a.jsonl")
    add_jsonl(parsed, data, "b.jsonl")  # positions continue across files
    first, second = reference(data, "a.jsonl"), reference(data, "b.jsonl")
    shifted = [(first[2] + position, row) for position, row in second[0]]
    assert parsed.rows == first[0] + shifted
    assert parsed.damaged == first[1] + second[1]
    assert parsed.positions == first[2] + second[2]
