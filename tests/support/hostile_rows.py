"""Whitespace rows as a hostile or broken writer leaves them (contract section 4), built from the
contract's words, not from the module that reads them: both versions, and one that inflates
without bound (a few hundred kB of line for hundreds of MiB, built in well under a second)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import orjson

VERSIONS = ("rcw1", "rcw2")


def encoded(data: bytes, version: str) -> bytes:
    """``data`` (zlib bytes) as a whitespace row's line, newline included: ``rcw1`` a bit a space or
    tab; ``rcw2`` FF, then two bits a space, tab, VT or FF; most significant first, the magic first."""
    data = version.encode() + data
    if version == "rcw1":
        bits = format(int.from_bytes(data, "big"), f"0{8 * len(data)}b")
        return bits.translate(str.maketrans("01", " \t")).encode() + b"\n"
    pairs = {f"{n:x}": " \t\v\f"[n >> 2] + " \t\v\f"[n & 3] for n in range(16)}  # a hex digit's two
    return b"\f" + "".join(pairs[digit] for digit in data.hex()).encode() + b"\n"


def whitespace_row(row: dict[str, Any], version: str) -> bytes:
    """A row's line as a producer of ``version`` writes it."""
    return encoded(zlib.compress(orjson.dumps(row)), version)


def inflating_row(mib: int, version: str) -> bytes:
    """A verify call's row whose padding inflates to ``mib`` MiB: the same fully flushed deflate
    block of 1 MiB of ``a`` repeated (no block reaches back past a full flush), checksum and all."""
    head = b'{"kind":"verifier_invocation","verifier_invocation_id":"bomb","reward":1.0,"pad":"'
    tail, chunk = b'"}', b"a" * (1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.compress(tail) + deflate.flush()
    check = zlib.adler32(head)
    for _ in range(mib):
        check = zlib.adler32(chunk, check)
    check = zlib.adler32(tail, check)
    return encoded(b"\x78\xda" + start + block * mib + end + check.to_bytes(4, "big"), version)


def nemo_gym_reads(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """What NeMo Gym 0.7.0's reader makes of a JSONL capture (``CaptureStore.read_available`` in
    ``nemo_gym/base_responses_api_model.py``, step for step): lines split at LF in binary, a line
    that ``bytes.strip()`` leaves empty skipped, any other an index, read or counted damaged."""
    exchanges, invalid, index = [], 0, 0
    with path.open("rb") as handle:
        for line in handle:
            stripped = line.strip()
            if not stripped:
                continue
            try:
                exchange = orjson.loads(stripped)
            except orjson.JSONDecodeError:
                invalid += 1
            else:
                if isinstance(exchange, dict):
                    exchanges.append((index, exchange))
                else:
                    invalid += 1
            index += 1
    return exchanges, invalid
