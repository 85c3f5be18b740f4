"""The JSONL layout: one appended file of lines a rollout, on a local disk (NeMo Gym's).

A row is written under the file's lock on the caller's thread and made durable by the fsync
that :meth:`JsonlLayout.stage_row`'s ``blocking`` step runs (spec 2). A ``verifier_invocation``
row is written as a whitespace line (:mod:`rollout_capture.whitespace_rows`): NeMo Gym's reader
counts each non-blank line as a model call and skips blank ones, so evidence that is no model
call stays in the file, where ours reads it and NeMo Gym's clear removes it, out of NeMo Gym's
count (spec 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from rollout_capture import names
from rollout_capture.layouts.base import Layout, LayoutStrategy, StagedWrite
from rollout_capture.whitespace_rows import whitespace_line

NOT_A_MODEL_CALL = frozenset({"verifier_invocation"})
"""Row kinds a JSONL-layout store writes as whitespace lines, out of NeMo Gym's count (spec 4)."""


def row_line(row: Mapping[str, Any]) -> bytes:
    """One JSONL line of a row (values JSON cannot hold become strings)."""
    return orjson.dumps(row, default=str, option=orjson.OPT_APPEND_NEWLINE)


class JsonlLayout(LayoutStrategy):
    """Rows appended to ``{rollout_id}.capture.jsonl``; needs a backend that appends safely."""

    name: ClassVar[Layout] = "jsonl"

    def stage_row(self, rollout_id: str, row: Mapping[str, Any]) -> StagedWrite:
        kind = row.get("kind")
        hidden = isinstance(kind, str) and kind in NOT_A_MODEL_CALL
        line = whitespace_line(row) if hidden else row_line(row)  # one orjson cannot write: a failed write
        return self.backend.append_line_staged(self.backend.path(names.jsonl_name(rollout_id)), line)
