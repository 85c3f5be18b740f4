"""The journal layout: rows and claims as entries of a few shared commits (spec 2, extension).

:class:`StoreJournal` is a store's reader and writers of its root's journal: every store reads
(and clears through) it whatever it writes, since a reader understands every layout;
:class:`JournalLayout` writes rows and claims through it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from rollout_capture.backends import Backend
from rollout_capture.backends.base import nothing_to_finish
from rollout_capture.claims import Claim
from rollout_capture.journal import (
    JournalCommitter,
    JournalReader,
    JournalWriter,
    Stream,
    claim_entry,
    release_entry,
    row_entry,
)
from rollout_capture.journal.compacted import Manifest, floors_of, newest_manifest
from rollout_capture.layouts.base import Layout, LayoutStrategy, StagedWrite


class StoreJournal:
    """One store's reader of the root's journal (read incrementally, shared by its batches) and
    this process's group committer of each stream (started by its first entry), or what stands in
    for it (:meth:`commit_through`)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._reader: JournalReader | None = None
        self._writers: dict[Stream, JournalWriter] = {}
        self._through: Callable[[JournalWriter], JournalCommitter] | None = None
        self._committers: dict[Stream, JournalCommitter] = {}  # ``_through``'s, one a stream
        self._generation: Manifest | None = None  # the newest compacted generation a writer looked up

    @property
    def reader(self) -> JournalReader:
        with self._lock:
            if self._reader is None:
                self._reader = JournalReader(self._backend)
            return self._reader

    def forget_bodies(self) -> None:
        """Let the commit bodies the reader kept go (no job reads the root now)."""
        with self._lock:
            reader = self._reader
        if reader is not None:
            reader.forget_bodies()

    def writer_of(self, stream: Stream) -> JournalCommitter:
        """Whoever commits ``stream``'s entries for this process: its own writer, or what
        :meth:`commit_through` put in front of it."""
        with self._lock:
            writer = self._writers.get(stream)
            if writer is None:
                writer = self._writers[stream] = JournalWriter(
                    self._backend, stream, tail_hint=lambda: self._tail(stream)
                )
            if self._through is None:
                return writer
            committer = self._committers.get(stream)
            if committer is None:
                committer = self._committers[stream] = self._through(writer)
            return committer

    def commit_through(self, through: Callable[[JournalWriter], JournalCommitter]) -> None:
        """Commit every stream through ``through(own writer)`` from now on (a proxy's worker: its
        parent's writers, its own the fallback); before the first entry (``through`` is asked
        once a stream)."""
        with self._lock:
            self._through = through

    def submit_row(
        self,
        rollout_id: str,
        row: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        release: tuple[str, str] | None,
        look: concurrent.futures.Future[int] | None = None,
    ) -> concurrent.futures.Future[int]:
        """Submit a row (built by the committer when ``row`` is a function) and, when ``release``
        names a claim (``(rollout_id, claim_id)``), its release, to land in one commit; ``look``,
        taken at the call's start, is what the commit lands above (no look of its own)."""
        entries = [row_entry(rollout_id, row)]
        if release is not None:
            entries.append(release_entry(*release))
        return self.writer_of("rows").submit(entries, look=look)

    def _tail(self, stream: Stream) -> int:
        """Where the next commit may be: all below what this store has read exist already, and
        none below the newest compacted generation's floors may be taken (its commits there were
        removed: a number taken there would be read by no one). Looked up when a writer starts, and
        again when it was idle (one listing of the generations; their manifest once each)."""
        reader = self._reader
        read = reader.tail(stream) if reader is not None else 0
        generation = newest_manifest(self._backend, known=self._generation)
        self._generation = generation
        return max(read, floors_of(generation)[stream])


class JournalLayout(LayoutStrategy):
    """Rows in the ``rows`` stream, claims and releases in ``claims`` (a release rides with its
    row when :meth:`CaptureStore.journal_record` submits both); claims never in files or a log."""

    name: ClassVar[Layout] = "journal"
    submits: ClassVar[bool] = True

    def stage_row(self, rollout_id: str, row: Mapping[str, Any]) -> StagedWrite:
        entry = row_entry(rollout_id, row)

        def committed() -> None:
            self.journal.writer_of("rows").write([entry])

        return committed, nothing_to_finish

    @property
    def claims_log_writer(self) -> None:
        return None

    def acquire_claim(self, rollout_id: str, claim: Claim) -> None:
        self.journal.writer_of("claims").write([claim_entry(rollout_id, claim)])

    def submit_claim(self, rollout_id: str, claim: Claim) -> concurrent.futures.Future[int]:
        return self.journal.writer_of("claims").submit([claim_entry(rollout_id, claim)])

    def look(self) -> concurrent.futures.Future[int]:
        return self.journal.writer_of("rows").look()

    def release_claim(self, rollout_id: str, claim_id: str) -> None:
        self.journal.writer_of("rows").write([release_entry(rollout_id, claim_id)])

    def submit_release(self, rollout_id: str, claim_id: str) -> concurrent.futures.Future[int]:
        return self.journal.writer_of("rows").submit([release_entry(rollout_id, claim_id)])

    def releases_once(self) -> bool:
        return False
