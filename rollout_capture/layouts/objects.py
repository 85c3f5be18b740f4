"""The objects layout: one object a row, numbered gaplessly and created put-if-absent (spec 2).

What object stores, which have no append, write unless told to use the journal.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from rollout_capture import names
from rollout_capture.backends import Backend
from rollout_capture.backends.base import nothing_to_finish
from rollout_capture.layouts.base import ClaimsMode, Layout, LayoutStrategy, StagedWrite
from rollout_capture.rows import NONCE_KEY
from rollout_capture.sequence import create_numbered, first_absent

if TYPE_CHECKING:
    from rollout_capture.layouts.journal import StoreJournal

_MAX_SEQ_HINTS = 10_000


def _nonce_of(body: bytes) -> str | None:
    try:
        row = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return row.get(NONCE_KEY) if isinstance(row, dict) else None


class ObjectsLayout(LayoutStrategy):
    """Rows as ``{rollout_id}.capture/{seq:012d}.json``; the next number of each rollout remembered."""

    name: ClassVar[Layout] = "objects"

    def __init__(self, backend: Backend, claims: ClaimsMode, journal: StoreJournal) -> None:
        super().__init__(backend, claims, journal)
        self._seq_hints: dict[str, int] = {}

    def stage_row(self, rollout_id: str, row: Mapping[str, Any]) -> StagedWrite:
        return (lambda: self._append_object(rollout_id, row)), nothing_to_finish

    def forget(self, rollout_ids: Collection[str]) -> None:
        for rollout_id in rollout_ids:
            self._seq_hints.pop(rollout_id, None)

    def _append_object(self, rollout_id: str, row: Mapping[str, Any]) -> None:
        nonce = uuid.uuid4().hex
        body = orjson.dumps({**row, NONCE_KEY: nonce}, default=str)
        seq = create_numbered(
            self.backend,
            lambda n: names.object_name(rollout_id, n),
            self._seq_hints.get(rollout_id, 0),
            body,
            lambda existing: _nonce_of(existing) == nonce,
            lambda taken: self._first_free_after(rollout_id, taken),
        )
        if len(self._seq_hints) >= _MAX_SEQ_HINTS:
            self._seq_hints.clear()
        self._seq_hints[rollout_id] = seq + 1

    def _first_free_after(self, rollout_id: str, taken: int) -> int:
        """Smallest free seq above ``taken``; occupied seqs always form a prefix."""
        exists, path = self.backend.exists, self.backend.path
        return first_absent(lambda seq: exists(path(names.object_name(rollout_id, seq))), taken + 1)
