"""Rows written as whitespace lines of a JSONL capture, which NeMo Gym's reader skips (spec 4).

NeMo Gym's reader (0.7.0, and the releases before it) counts every non-blank line of
``R.capture.jsonl`` as a model call, and skips a line that is blank once stripped of ASCII
whitespace. A row that is no model call (a verify call's) is therefore written as a line of
spaces and tabs alone: the bits, most significant first, of a magic prefix and the row's JSON,
zlib-compressed (a space a 0, a tab a 1). NeMo Gym reads past it; ours reads it. It lives in
the file NeMo Gym's clear deletes, so it never outlives the calls it goes with.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import orjson

MAGIC = b"rcw1"
"""What a whitespace row's bits begin with (the format's name and version)."""

_BITS = str.maketrans({"0": " ", "1": "\t"})
_DIGITS = bytes.maketrans(b" \t", b"01")
_MARK = format(int.from_bytes(MAGIC, "big"), f"0{8 * len(MAGIC)}b").translate(_BITS).encode()


def whitespace_line(row: Mapping[str, Any]) -> bytes:
    """The JSONL line (newline included) holding ``row`` in spaces and tabs alone."""
    data = MAGIC + zlib.compress(orjson.dumps(row, default=str))
    bits = format(int.from_bytes(data, "big"), f"0{8 * len(data)}b")
    return bits.translate(_BITS).encode() + b"\n"


def is_whitespace_row(line: bytes) -> bool:
    """Whether ``line`` (without its newline) is a row written by :func:`whitespace_line`: any
    other blank line is no row."""
    return line.startswith(_MARK)


def read_whitespace_row(line: bytes) -> dict[str, Any]:
    """The row of a line :func:`is_whitespace_row` holds; ``ValueError`` naming why when it does
    not decode (a line cut short by a failed write)."""
    digits = line.rstrip(b"\r").translate(_DIGITS)
    if len(digits) % 8 or digits.translate(None, b"01"):
        raise ValueError("a whitespace row cut short")
    data = int(digits, 2).to_bytes(len(digits) // 8, "big")
    try:
        row = orjson.loads(zlib.decompress(data[len(MAGIC) :]))
    except (zlib.error, orjson.JSONDecodeError):
        raise ValueError("a whitespace row that does not decode") from None
    if type(row) is not dict:
        raise ValueError(f"a whitespace row holding no JSON object ({type(row).__name__})")
    return row


__all__ = ["MAGIC", "is_whitespace_row", "read_whitespace_row", "whitespace_line"]
