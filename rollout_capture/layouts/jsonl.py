"""The JSONL layout: one appended file of lines a rollout, on a local disk (NeMo Gym's).

A row is written under the file's lock on the caller's thread and made durable by the fsync
that :meth:`JsonlLayout.stage_row`'s ``blocking`` step runs (spec 2). A ``verifier_invocation``
row goes to the rollout's object rows instead (``{rollout_id}.capture/{seq}.json``): NeMo Gym's
reader reads the JSONL file alone and counts each of its lines as a model call, so evidence that
is no model call stays where it does not look, and where ours does (spec 4).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from rollout_capture import names
from rollout_capture.layouts.base import ClaimsMode, Layout, LayoutStrategy, StagedWrite
from rollout_capture.layouts.objects import ObjectsLayout

if TYPE_CHECKING:
    from rollout_capture.backends import Backend
    from rollout_capture.layouts.journal import StoreJournal

NOT_A_MODEL_CALL = frozenset({"verifier_invocation"})
"""Row kinds a JSONL-layout store writes as object rows, out of NeMo Gym's sight (spec 4)."""


def row_line(row: Mapping[str, Any]) -> bytes:
    """One JSONL line of a row (values JSON cannot hold become strings)."""
    return orjson.dumps(row, default=str, option=orjson.OPT_APPEND_NEWLINE)


class JsonlLayout(LayoutStrategy):
    """Rows appended to ``{rollout_id}.capture.jsonl``; needs a backend that appends safely."""

    name: ClassVar[Layout] = "jsonl"

    def __init__(self, backend: Backend, claims: ClaimsMode, journal: StoreJournal) -> None:
        super().__init__(backend, claims, journal)
        self._apart = ObjectsLayout(backend, claims, journal)  # rows NeMo Gym must not count

    def stage_row(self, rollout_id: str, row: Mapping[str, Any]) -> StagedWrite:
        kind = row.get("kind")
        if isinstance(kind, str) and kind in NOT_A_MODEL_CALL:
            return self._apart.stage_row(rollout_id, row)
        line = row_line(row)  # a row orjson cannot write is a failed write too
        return self.backend.append_line_staged(self.backend.path(names.jsonl_name(rollout_id)), line)

    def forget(self, rollout_ids: Collection[str]) -> None:
        self._apart.forget(rollout_ids)
