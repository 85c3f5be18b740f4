"""The JSONL layout: one appended file of lines a rollout, on a local disk (NeMo Gym's).

A row is written under the file's lock on the caller's thread and made durable by the fsync
that :meth:`JsonlLayout.stage_row`'s ``blocking`` step runs (spec 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from rollout_capture import names
from rollout_capture.layouts.base import Layout, LayoutStrategy, StagedWrite


def row_line(row: Mapping[str, Any]) -> bytes:
    """One JSONL line of a row (values JSON cannot hold become strings)."""
    return orjson.dumps(row, default=str, option=orjson.OPT_APPEND_NEWLINE)


class JsonlLayout(LayoutStrategy):
    """Rows appended to ``{rollout_id}.capture.jsonl``; needs a backend that appends safely."""

    name: ClassVar[Layout] = "jsonl"

    def stage_row(self, rollout_id: str, row: Mapping[str, Any]) -> StagedWrite:
        line = row_line(row)  # a row orjson cannot write is a failed write too
        return self.backend.append_line_staged(self.backend.path(names.jsonl_name(rollout_id)), line)
