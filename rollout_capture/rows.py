"""Capture bytes to rows (spec section 2, "Readers").

A damaged row is reported with where it came from and never hides the others; every
row, damaged or not, takes one position so ``call_index`` stays stable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from rollout_capture.call_records import BuiltCall
from rollout_capture.call_records_fast import (
    Untyped,
    orjson_reads,
    typed_decode,
    typed_of,
    typed_record,
    typed_row,
)
from rollout_capture.whitespace_rows import is_whitespace_row, read_whitespace_row, torn_before

Row = dict[str, Any]

# Object-layout writers tag each body so a retried PUT can recognise its own landed write.
NONCE_KEY = "_capture_nonce"


@dataclass(frozen=True, slots=True)
class Damage:
    """One unreadable row: the file it sits in, its line (JSONL only) and why; ``whitespace``: a
    whitespace row's (NeMo Gym skips its line, so it takes no position and NeMo Gym counts none)."""

    source: str
    line: int | None
    reason: str
    whitespace: bool = False

    def describe(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{where}: {self.reason}"


class CaptureRowError(ValueError):
    """Raised by strict readers on the first damaged row; names file and line."""

    def __init__(self, damage: Damage) -> None:
        super().__init__(damage.describe())
        self.damage = damage


class ParsedRows:
    """Rows in read order with their positions, plus what could not be read.

    Bytes are kept as added and parsed when first asked for: :attr:`rows` reads every row
    whole (orjson); :meth:`record_rows` reads them for call records, typed when it can
    (:mod:`rollout_capture.call_records_fast`). Both give the same positions and damage.
    """

    __slots__ = ("_damaged", "_full", "_parts")

    def __init__(self) -> None:
        # ("jsonl" | "object", data, source), ("journal", (data, line), source), ("row", row, None),
        # ("damage", damage, None)
        self._parts: list[tuple[str, Any, str | None]] = []
        self._full: list[tuple[int, Row]] | None = None
        self._damaged: tuple[list[Damage], int] | None = None

    def _add(self, part: tuple[str, Any, str | None]) -> None:
        self._parts.append(part)
        self._full = self._damaged = None

    def add_row(self, row: Row) -> None:
        self._add(("row", row, None))

    def add_damage(self, damage: Damage) -> None:
        self._add(("damage", damage, None))

    @property
    def rows(self) -> list[tuple[int, Row]]:
        """Every readable row, whole, with its position."""
        if self._full is None:
            self._full, damaged, positions = self._read(typed=False)
            self._damaged = damaged, positions
        return self._full

    @property
    def damaged(self) -> list[Damage]:
        """What could not be read, in read order."""
        if self._damaged is None:
            self.rows  # noqa: B018 - reading the rows counts the damage
        assert self._damaged is not None
        return self._damaged[0]

    @property
    def positions(self) -> int:
        """How many positions rows and damage took."""
        if self._damaged is None:
            self.rows  # noqa: B018
        assert self._damaged is not None
        return self._damaged[1]

    def record_rows(self, include_payloads: bool) -> tuple[list[tuple[int, Any]], list[Damage]]:
        """``(rows, damaged)`` for building call records.

        Without payloads, rows the typed path takes come as :class:`BuiltCall` (model
        calls) or the few fields their reader uses; the others whole. Read afresh each
        time (a record is the caller's to change).
        """
        if include_payloads or self._full is not None:
            return self.rows, self.damaged
        rows, damaged, positions = self._read(typed=True)
        self._damaged = damaged, positions
        return rows, damaged

    def _read(self, *, typed: bool) -> tuple[list[tuple[int, Any]], list[Damage], int]:
        rows: list[tuple[int, Any]] = []
        damaged: list[Damage] = []
        position = 0
        for kind, value, source in self._parts:
            if kind == "jsonl":
                assert source is not None
                position = _read_jsonl(rows, damaged, position, value, source, typed)
                continue
            if kind == "object" or kind == "journal":
                assert source is not None
                data, line = (value, None) if kind == "object" else value
                row = _read_object(damaged, data, source, position, typed, line)
                if row is not None:
                    rows.append((position, row))
            elif kind == "row":
                rows.append((position, value))
            else:
                damaged.append(value)
            position += 1
        return rows, damaged, position


def new_parsed_rows() -> ParsedRows:
    """An empty accumulator; JSONL rows go in first, then object rows by seq."""
    return ParsedRows()


def add_jsonl(parsed: ParsedRows, data: bytes, source: str) -> None:
    """Append the rows of a JSONL capture: file order, blank lines skipped but for whitespace rows
    (:mod:`rollout_capture.whitespace_rows`), which take no position (read when asked)."""
    parsed._add(("jsonl", data, source))


def add_object(parsed: ParsedRows, data: bytes, source: str) -> None:
    """Append the single row held by one object-layout file (read when asked)."""
    parsed._add(("object", data, source))


def _read_jsonl(
    rows: list[tuple[int, Any]], damaged: list[Damage], position: int, data: bytes, source: str, typed: bool
) -> int:
    """Read a JSONL capture's rows from ``position`` on; returns the next position.

    Lines are cut with ``find`` (memchr) rather than ``split``, whose byte-by-byte scan
    costs as much as a fifth of parsing a typical capture. A model call the typed path
    takes is read here without a call per row (:func:`typed_row`, step for step); any
    other line goes through :func:`typed_row` and then, if need be, the full way.
    """
    loads = orjson.loads
    find, end = data.find, len(data)
    start = number = 0
    checked = typed and orjson_reads(data)  # then it holds for every line: checked once
    append = rows.append
    while start < end or number == 0:
        number += 1
        stop = find(b"\n", start)
        if stop < 0:
            line, start = data[start:], end
        else:
            line, start = data[start:stop], stop + 1
        if line[:1] in _BLANK_FIRST or line[-1:] in _BLANK_LAST:  # NeMo Gym reads it stripped
            if not line or line.isspace():  # never parsed: orjson's error costs 12 times a line
                if is_whitespace_row(line):  # a row NeMo Gym skips: no position of its own (spec 4)
                    try:
                        append((position, read_whitespace_row(line)))
                    except ValueError as exc:
                        damaged.append(Damage(source, number, str(exc), True))
                continue  # any other blank line is no row
            if torn_before(line):  # the row glued to it reads on, as NeMo Gym reads it
                damaged.append(Damage(source, number, "a whitespace row cut short, a row glued to it", True))
            line = line.strip()
        if checked:
            try:
                row = typed_decode(line)
            except (msgspec.DecodeError, RecursionError):
                row = None
            if row is not None:
                kind = row.kind
                try:
                    if kind is None or kind == "model_call":
                        append((position, BuiltCall(typed_record(row, position))))
                    else:
                        append((position, typed_of(row, position)))
                    position += 1
                    continue
                except (orjson.JSONDecodeError, Untyped):  # tool call arguments orjson cannot read
                    pass
        elif typed:
            try:
                append((position, typed_row(line, position)))
                position += 1
                continue
            except Untyped:
                pass
        try:
            parsed = loads(line)
        except orjson.JSONDecodeError:
            damaged.append(Damage(source, number, "torn final line" if stop < 0 else "not JSON"))
            position += 1
            continue
        if type(parsed) is dict:
            append((position, parsed))
        else:
            damaged.append(Damage(source, number, f"not a JSON object ({type(parsed).__name__})"))
        position += 1
    return position


# What NeMo Gym's reader strips off a line (bytes.strip()), where JSON allows only some of it.
_BLANK_FIRST = (b"", b" ", b"\t", b"\r", b"\v", b"\f")
_BLANK_LAST = (b"\v", b"\f")


def add_journal_row(parsed: ParsedRows, data: bytes, source: str, line: int) -> None:
    """Append one row held on ``line`` of a journal commit (read when asked)."""
    parsed._add(("journal", (data, line), source))


def _read_object(
    damaged: list[Damage], data: bytes, source: str, position: int, typed: bool, line: int | None = None
) -> Any:
    """The row of one object-layout file (or journal line), or None with its damage recorded."""
    if not data.strip():
        damaged.append(Damage(source, line, "empty object" if line is None else "empty line"))
        return None
    if typed:
        try:
            return typed_row(data, position)
        except Untyped:
            pass
    try:
        row = orjson.loads(data)
    except orjson.JSONDecodeError:
        damaged.append(Damage(source, line, "not JSON"))
        return None
    if type(row) is dict:
        row.pop(NONCE_KEY, None)
        return row
    damaged.append(Damage(source, line, f"not a JSON object ({type(row).__name__})"))
    return None
