"""``rollout_capture.printable``: text from captures and records as a terminal shows it. Every
character that would act on a terminal, whitespace included (a carriage return rewrites the line,
a line or paragraph separator breaks it), reads as its escape; printable text passes unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_capture.printable import printable, printable_lines

CONTROL = [
    ("\r", "\\r"),  # back to the line's start: what follows overwrites it
    ("\n", "\\n"),
    ("\t", "\\t"),
    ("\x0b", "\\x0b"),  # vertical tab
    ("\x0c", "\\x0c"),  # form feed
    ("\x1c", "\\x1c"),  # file separator: whitespace to str.split
    ("\x85", "\\x85"),  # next line (C1)
    ("\u2028", "\\u2028"),  # line separator
    ("\u2029", "\\u2029"),  # paragraph separator
    ("\xa0", "\\xa0"),  # no-break space: a space to str.isspace, not printable
    ("\u3000", "\\u3000"),  # ideographic space, likewise
    ("\x00", "\\x00"),
    ("\x1b", "\\x1b"),  # escape: the start of every terminal sequence
    ("\x7f", "\\x7f"),
    ("\x9b", "\\x9b"),  # CSI (C1)
    ("\u202e", "\\u202e"),  # right-to-left override: reorders what follows
    ("\u200b", "\\u200b"),  # zero width space
]


@pytest.mark.parametrize(("char", "escaped"), CONTROL, ids=[e for _, e in CONTROL])
def test_a_control_or_whitespace_character_is_shown_escaped(char: str, escaped: str) -> None:
    assert printable(f"gpt{char}4") == f"gpt{escaped}4"
    assert printable(char) == escaped


@pytest.mark.parametrize(
    ("char", "escaped"), [c for c in CONTROL if c[0] != "\n"], ids=[e for c, e in CONTROL if c != "\n"]
)
def test_printable_lines_keeps_only_the_line_feed(char: str, escaped: str) -> None:
    """A message of several lines still reads as lines; nothing else breaks or rewrites one."""
    assert printable_lines(f"first{char}\nsecond") == f"first{escaped}\nsecond"


@pytest.mark.parametrize("text", ["gpt-4o", "a b", "modèle", "模型", "نموذج", "😀", "back\\slash", ""])
def test_printable_text_of_any_script_comes_back_unchanged(text: str) -> None:
    assert printable(text) == text and printable_lines(text) == text


def test_what_is_not_a_string_is_shown_as_its_str() -> None:
    assert printable(None) == "None" and printable(42) == "42" and printable(b"\r") == "b'\\r'"


@given(st.text())
def test_what_comes_out_is_printable_and_only_what_was_not_is_changed(text: str) -> None:
    shown = printable(text)
    assert shown.isprintable()
    assert (shown == text) == text.isprintable()
    lines = printable_lines(text)
    assert lines.split("\n") == [printable(line) for line in text.split("\n")]
