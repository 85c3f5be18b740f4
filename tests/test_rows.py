"""JSONL capture bytes to rows (spec 2, "Readers"): add_jsonl against a split-based oracle."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_capture.rows import Damage, add_jsonl, new_parsed_rows
from rollout_capture.whitespace_rows import is_whitespace_row, read_whitespace_row

from .support.hostile_rows import whitespace_row

VERIFY = {"kind": "verifier_invocation", "verifier_invocation_id": "v"}


def reference(data: bytes, source: str) -> tuple[list[tuple[int, Any]], list[Damage], int]:
    """The reader's rules written the obvious way: split, read each line stripped (NeMo Gym's
    reader strips it), a whitespace row (FF or ``rcw1``'s magic first) where it stands with no
    position and naming its damage, any other blank line skipped, one position per other line."""
    rows: list[tuple[int, Any]] = []
    damaged, position = [], 0
    lines = data.split(b"\n")
    for number, line in enumerate(lines, start=1):
        ours = is_whitespace_row(line)
        if not line.strip():
            if ours:
                try:
                    rows.append((position, read_whitespace_row(line)))
                except ValueError as exc:
                    damaged.append(Damage(source, number, str(exc), True))
            continue
        if ours:  # torn, another row glued to it
            damaged.append(Damage(source, number, "a whitespace row cut short, a row glued to it", True))
        try:
            row = orjson.loads(line.strip())
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
        [
            b"",
            b" ",
            b"\t",
            b"\r",
            b"\x0b",
            b"\x0c",
            b"{}",
            b"[]",
            b"1",
            b'{"a": 1}',
            b'{"a"',
            b" {} ",
            b"\xff",
        ]
        + [whitespace_row(VERIFY, version)[:-1] for version in ("rcw1", "rcw2")]
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
