"""Rows written as whitespace lines of a JSONL capture, which NeMo Gym's reader skips (spec 4).

NeMo Gym's reader (0.7.0, and the releases before it) reads ``R.capture.jsonl`` in binary, a line
to each newline, and skips a line that ``bytes.strip()`` leaves empty: one of spaces, tabs, CR, VT
and FF alone; every other line is a model call to it (or a damaged one). A row that is no model
call (a verify call's, and nothing else: :data:`KIND`) is therefore written as a line of
whitespace alone: FF, then the row's JSON, zlib-compressed behind a magic, two bits a character
(a space 0, a tab 1, a VT 2, an FF 3; most significant first). CR is left out: a line ending in
one could not be told from a CRLF line. The leading FF, which no other writer puts there, tells a
row of ours, torn or whole, from its first character. Rows of the first version (``rcw1``: spaces
and tabs alone, a bit a character, no FF) still read.

Reading is bounded: a row that inflates past :data:`MAX_ROW_BYTES` is damage, found without
holding what it inflates to. It lives in the file NeMo Gym's clear deletes, so it never outlives
the calls it goes with.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import orjson

KIND = "verifier_invocation"
"""The one row kind a whitespace row may hold (what our producers write so): any other is damage,
since NeMo Gym would not count it either way (spec 4)."""

MAX_ROW_BYTES = 256 << 20
"""The most a whitespace row's JSON may take (256 MiB, far above a verify call's row under the
producers' 16 MiB body cap): past it the row is damage, and a producer does not write it."""

MAGIC = b"rcw2"
"""What a whitespace row's bytes begin with (the format's name and version)."""
MAGIC_V1 = b"rcw1"
"""The first version's magic: a bit a character, spaces and tabs alone."""

START = b"\f"
"""The first character of a row of the current version: no JSON whitespace."""

_SYMBOLS = b" \t\v\f"  # 0, 1, 2, 3
_DIGITS = bytes.maketrans(_SYMBOLS, b"0123")
_DIGITS_V1 = bytes.maketrans(b" \t", b"01")
_HEX = b"0123456789abcdef"
_HIGH = bytes.maketrans(_HEX, bytes(_SYMBOLS[n >> 2] for n in range(16)))
_LOW = bytes.maketrans(_HEX, bytes(_SYMBOLS[n & 3] for n in range(16)))
_CHUNK = 1 << 18  # bytes encoded, or decoded, at a time: what a row costs beyond its line


def _symbols(data: bytes) -> bytes:
    """``data`` as two-bit symbols, most significant first (four a byte)."""
    digits = data.hex().encode()
    out = bytearray(2 * len(digits))
    out[0::2] = digits.translate(_HIGH)
    out[1::2] = digits.translate(_LOW)
    return bytes(out)


_MARK_V1 = format(int.from_bytes(MAGIC_V1, "big"), "032b").translate(str.maketrans("01", " \t")).encode()


def whitespace_line(row: Mapping[str, Any]) -> bytes:
    """The JSONL line (newline included) holding ``row`` in whitespace alone; ``ValueError`` for a
    row that is no verify call's, or whose JSON passes :data:`MAX_ROW_BYTES` (readers refuse it)."""
    if row.get("kind") != KIND:
        raise ValueError(f"a whitespace row holds a {KIND} row only, not {row.get('kind')!r}")
    text = orjson.dumps(row, default=str)
    if len(text) > MAX_ROW_BYTES:
        raise ValueError(
            f"a {KIND} row of {len(text)} bytes: past the {MAX_ROW_BYTES} a whitespace row may hold"
        )
    data = MAGIC + zlib.compress(text)
    del text
    parts = [START]
    parts.extend(_symbols(data[at : at + _CHUNK]) for at in range(0, len(data), _CHUNK))
    parts.append(b"\n")
    return b"".join(parts)


def is_whitespace_row(line: bytes) -> bool:
    """Whether ``line`` (without its newline) is a row of ours, whole or torn: one starting with FF
    (no one else writes it), or with the first version's magic. Any other blank line is no row."""
    return line.startswith(START) or line.startswith(_MARK_V1)


def torn_before(line: bytes) -> bool:
    """Whether a line that is not blank starts with a whitespace row cut short by its writer, the
    next row glued to it (a writer that starts no fresh line: NeMo Gym's). NeMo Gym's reader strips
    it off and reads that row; the verify call's row is lost, and is damage. Today's rows start
    with FF, which no other writer puts there, so any tear tells; a first version's row with its
    magic's 32 spaces and tabs, so one torn within them reads as leading whitespace."""
    return line.startswith(START) or line.startswith(_MARK_V1)


def read_whitespace_row(line: bytes) -> dict[str, Any]:
    """The row of a line :func:`is_whitespace_row` holds; ``ValueError`` naming why when it does
    not decode (a line cut short by a failed write), inflates past :data:`MAX_ROW_BYTES`, or holds
    anything but a verify call's row."""
    data = _bytes_of(line.rstrip(b"\r"))  # CR is no symbol: a CRLF line's end
    size = _inflated_size(data)  # what it inflates to, found without keeping it
    try:
        row = orjson.loads(zlib.decompress(data, bufsize=max(size, 1)))
    except orjson.JSONDecodeError:
        raise ValueError("a whitespace row that does not decode") from None
    if type(row) is not dict:
        raise ValueError(f"a whitespace row holding no JSON object ({type(row).__name__})")
    if row.get("kind") != KIND:
        raise ValueError(
            f"a whitespace row holding no {KIND} (kind {row.get('kind')!r}): NeMo Gym reads none"
        )
    return row


def _bytes_of(line: bytes) -> bytes:
    """The compressed bytes a whitespace row's symbols spell, past its magic."""
    if line.startswith(START):
        version, alphabet, digits, bits, symbols = MAGIC, _SYMBOLS, _DIGITS, 2, memoryview(line)[1:]
    else:
        version, alphabet, digits, bits, symbols = MAGIC_V1, b" \t", _DIGITS_V1, 1, memoryview(line)
    per_byte = 8 // bits
    if len(symbols) % per_byte or len(symbols) < per_byte * len(version):
        raise ValueError("a whitespace row cut short")
    step = _CHUNK * per_byte
    parts = []
    for at in range(0, len(symbols), step):
        chunk = bytes(symbols[at : at + step])
        if chunk.translate(None, alphabet):
            raise ValueError("a whitespace row holding other characters")
        parts.append(int(chunk.translate(digits), 1 << bits).to_bytes(len(chunk) // per_byte, "big"))
    if not parts[0].startswith(version):
        raise ValueError("a whitespace row of an unknown version")
    parts[0] = parts[0][len(version) :]
    return b"".join(parts)


def _inflated_size(data: bytes) -> int:
    """How many bytes ``data`` inflates to, holding a chunk at a time; ``ValueError`` past
    :data:`MAX_ROW_BYTES` or when it is no whole zlib stream."""
    inflate = zlib.decompressobj()
    size = 0
    try:
        while not inflate.eof:
            out = len(inflate.decompress(data, _CHUNK))
            size += out
            if size > MAX_ROW_BYTES:
                raise ValueError(f"a whitespace row inflating past {MAX_ROW_BYTES >> 20} MiB")
            data = inflate.unconsumed_tail
            if not out and not data:
                break  # all of it read, and the stream not at its end: cut short
    except zlib.error:
        raise ValueError("a whitespace row that does not decode") from None
    if not inflate.eof or inflate.unused_data:
        raise ValueError("a whitespace row that does not decode")
    return size


__all__ = [
    "KIND",
    "MAGIC",
    "MAGIC_V1",
    "MAX_ROW_BYTES",
    "START",
    "is_whitespace_row",
    "read_whitespace_row",
    "torn_before",
    "whitespace_line",
]
