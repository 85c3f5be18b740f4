"""What a layout is: the row side and the claim side of one store, behind one interface.

A store picks its layout once when it opens (:func:`rollout_capture.layouts.open_layout`) and
then only calls this interface; reading never depends on it (a reader understands every
layout, so one store reads what any other wrote).
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from rollout_capture import names
from rollout_capture.backends import Backend
from rollout_capture.claims import Claim, claim_body
from rollout_capture.claims_log import ClaimsLogWriter

if TYPE_CHECKING:
    from rollout_capture.layouts.journal import StoreJournal

Layout = Literal["jsonl", "objects", "journal"]
"""How a store lays out its rows and claims under a root (docs/layouts.md)."""
LayoutChoice = Literal["auto", "jsonl", "objects", "journal"]
"""A layout, or ``auto``: the backend's own (JSONL on a local disk, objects elsewhere)."""
ClaimsMode = Literal["files", "log"]
"""How a store writes its claims outside the journal: a file each (spec 3), or this process's
claims log (local disks only, ``rollout_capture.claims_log``). Readers read both, always."""
StagedWrite = tuple[Callable[[], None], Callable[[], None]]
"""``(blocking, finish)``: run ``blocking`` off the loop (durable after it), then ``finish`` on it."""


class LayoutStrategy(ABC):
    """One store's way of writing rows and claims; one instance per store, chosen when it opens.

    Claims go to a file each, or to this process's claims log (``claims="log"``), unless the
    layout keeps them itself (the journal overrides the claim methods).
    """

    name: ClassVar[Layout]
    submits: ClassVar[bool] = False
    """Whether rows and claims are submitted to a group committer and acknowledged by a future
    (the journal) rather than written on the caller's thread; a producer waits on the future."""

    def __init__(self, backend: Backend, claims: ClaimsMode, journal: StoreJournal) -> None:
        self.backend = backend
        self.claims_mode = claims
        self.journal = journal
        self._claims_log: ClaimsLogWriter | None = None

    # ------------------------------------------------------------------ rows

    @abstractmethod
    def stage_row(self, rollout_id: str, row: Mapping[str, Any]) -> StagedWrite:
        """Do the cheap part of writing one (validated) row now; raise if it fails."""

    def forget(self, rollout_ids: Collection[str]) -> None:  # noqa: B027 - nothing kept unless a layout keeps hints
        """Drop what was learnt about these rollouts (they are being cleared)."""

    # ------------------------------------------------------------------ claims

    @property
    def claims_log_writer(self) -> ClaimsLogWriter | None:
        """This process's claims log under the root, when claims go to one (opened by the first claim)."""
        if self.claims_mode != "log":
            return None
        if self._claims_log is None:
            self._claims_log = ClaimsLogWriter(self.backend.root)
        return self._claims_log

    def acquire_claim(self, rollout_id: str, claim: Claim) -> None:
        """Write the claim durably enough for readers to see it at once."""
        log = self.claims_log_writer
        if log is not None:
            log.claim(rollout_id, claim)
            return
        self.backend.put_live(
            self.backend.path(names.claim_name(rollout_id, claim.claim_id)), claim_body(claim)
        )

    def submit_claim(self, rollout_id: str, claim: Claim) -> concurrent.futures.Future[int] | None:
        """Submit the claim and return at once with a future saying when it is durable (the
        journal); None where a claim is written by :meth:`acquire_claim` instead."""
        return None

    def look(self) -> concurrent.futures.Future[int] | None:
        """At a call's start, beside its claim: what its row must land above (the journal, spec 2);
        None where rows are ordered otherwise."""
        return None

    def submit_release(self, rollout_id: str, claim_id: str) -> concurrent.futures.Future[int] | None:
        """Submit the release of a claim and return at once with a future saying when it is
        durable (the journal); None where :meth:`release_claim` releases instead."""
        return None

    def release_claim(self, rollout_id: str, claim_id: str) -> None:
        """Release a claim this store holds."""
        log = self.claims_log_writer
        if log is not None:
            log.release(rollout_id, claim_id)
            return
        self.backend.remove([self.backend.path(names.claim_name(rollout_id, claim_id))])

    def releases_once(self) -> bool:
        """Whether a failed release is dropped rather than tried again (a claims log's)."""
        return self.claims_mode == "log"

    def close_claims_log(self) -> None:
        """Remove this process's claims logs that hold nothing open (a producer that stops)."""
        if self._claims_log is not None:
            self._claims_log.close()
