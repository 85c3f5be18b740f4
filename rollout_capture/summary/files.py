"""Enriched JSONL files read for their evidence: each line parsed (a torn line carrying an
attachment refused), and the summary of a file or of parsed records."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from rollout_capture.attachment import ATTACHMENT_KEY
from rollout_capture.summary.checks import EvidenceShapeError
from rollout_capture.summary.evidence import EvidenceSummary


def iter_enriched(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """``(line number, record)`` for each non-blank line of an enriched JSONL; ``None`` for a
    line that is not a JSON object (enrichment passes such lines through unchanged).

    A line that is not JSON but names ``ng_model_call_capture`` (a NaN reward, a lone surrogate,
    a torn write) held calls that would vanish: it raises :class:`EvidenceShapeError` naming the
    file, line and the field where parsing stopped, rather than being skipped as a passed-through line.
    """
    key = ATTACHMENT_KEY.encode()
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                if key in line:
                    raise EvidenceShapeError(
                        f"{path}:{number}: {_field_at(line, exc.pos)}: not JSON ({exc.msg}), "
                        f"though the line carries {ATTACHMENT_KEY}: its calls would be lost"
                    ) from None
                yield number, None
                continue
            yield number, record if isinstance(record, dict) else None


_KEY_BEFORE = re.compile(rb'"((?:[^"\\]|\\.)*)"\s*:')


def _field_at(line: bytes, position: int) -> str:
    """The name of the last key before ``position`` in a JSON line (where parsing stopped)."""
    keys: list[bytes] = _KEY_BEFORE.findall(line[: max(position, 0)])
    if not keys:
        return "line"
    name = keys[-1].decode("utf-8", "replace")
    return name if len(name) <= 80 else name[:79] + "\u2026"


def no_attachment_error(path: str | Path) -> EvidenceShapeError:
    """The error of an enriched file in which no line carries an attachment (``report`` and
    ``export`` of the rollouts file itself, or of any other JSONL): an empty page is no evidence."""
    return EvidenceShapeError(
        f"{path}: no line carries an {ATTACHMENT_KEY} attachment; is it an enriched file "
        "(rollout-capture enrich writes <input>.enriched.jsonl)?"
    )


def summarize_records(records: Iterable[Mapping[str, Any]]) -> EvidenceSummary:
    """The summary of parsed enriched records."""
    summary = EvidenceSummary()
    for record in records:
        summary.add(record)
    return summary


def summarize_file(path: str | Path) -> tuple[EvidenceSummary, int]:
    """The summary of an enriched JSONL and its count of lines that are not JSON objects.

    A malformed attachment, or a line carrying one that is not JSON, raises
    :class:`EvidenceShapeError` naming the file, line and field.
    """
    summary = EvidenceSummary()
    unreadable = 0
    for number, record in iter_enriched(path):
        if record is None:
            unreadable += 1
            continue
        try:
            summary.add(record)
        except EvidenceShapeError as exc:
            raise EvidenceShapeError(f"{path}:{number}: {exc}") from None
    return summary, unreadable
