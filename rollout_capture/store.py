"""The capture store of one root: writes, claims, markers, reads and clearing (spec 2, 3, 9).

How rows and claims are written is the store's layout (:mod:`rollout_capture.layouts`), picked
once when it opens: by default JSONL appends on local POSIX disks, a put-if-absent sequence of
objects on object stores (which have no append). Reads understand every layout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from rollout_capture import names
from rollout_capture.backends import (
    Backend,
    ListingScope,
    ReadBatch,
    UnsafeStoreError,
    open_backend,
)
from rollout_capture.claims import DEFAULT_CLAIM_TTL_S, Claim, new_claim, partition
from rollout_capture.claims_log import ClaimsLogWriter
from rollout_capture.filesystem import DEFAULT_READ_CONCURRENCY
from rollout_capture.identity import validate_rollout_id
from rollout_capture.journal import (
    STREAMS,
    JournalCommitter,
    JournalReadBatch,
    JournalReader,
    JournalWriter,
    Stream,
    clear_entry,
)
from rollout_capture.layouts import ClaimsMode, Layout, LayoutChoice, StagedWrite, StoreJournal, open_layout
from rollout_capture.names import RolloutListing, probe_name
from rollout_capture.rows import CaptureRowError, Row
from rollout_capture.snapshot import RolloutSnapshot

if TYPE_CHECKING:
    from rollout_capture.compaction import Compaction

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_SCOPES = 64


async def finish_shielded(future: asyncio.Future[T]) -> T:
    """Wait for ``future`` even if the caller is cancelled meanwhile.

    A capture write that started must land (or fail) before its claim is released;
    cancellation is re-raised once it has, and the write's own error wins over it.
    """
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            cancelled = True
            if future.done():
                result = future.result()  # raises the write's own error, if it failed
                break
    if cancelled:
        raise asyncio.CancelledError
    return result


async def finish_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a thread and wait for it even if the caller is cancelled meanwhile."""
    return await finish_shielded(asyncio.ensure_future(asyncio.to_thread(fn, *args)))


class UnwritableRootError(ValueError):
    """A producer's capture root refused the startup probe: it would serve calls and record none."""


class ClaimContext:
    """``with store.claim(...)`` / ``async with store.claim(...)``: hold a claim for one call."""

    def __init__(self, store: CaptureStore, rollout_id: str, model_call_id: str | None, ttl_s: float) -> None:
        self._store = store
        self._rollout_id = validate_rollout_id(rollout_id)
        self._model_call_id = model_call_id
        self._ttl_s = ttl_s
        self.claim: Claim | None = None
        self.look: concurrent.futures.Future[int] | None = None  # the journal's, at the call's start

    def _acquire(self) -> Claim:
        claim = new_claim(self._model_call_id, self._ttl_s)
        self._store.layout_strategy.acquire_claim(self._rollout_id, claim)
        self.claim = claim
        return claim

    def start(self) -> concurrent.futures.Future[int] | None:
        """Journal layout: submit the claim and return at once; the future says when it is durable
        (the claim counts as held from now, so a release always follows). None on other layouts."""
        strategy = self._store.layout_strategy
        if not strategy.submits:
            return None
        claim = new_claim(self._model_call_id, self._ttl_s)
        self.look = strategy.look()  # what the row lands above: taken now, hidden behind the upstream
        future = strategy.submit_claim(self._rollout_id, claim)
        self.claim = claim
        return future

    @property
    def rollout_id(self) -> str:
        return self._rollout_id

    def _release(self) -> None:
        if self.claim is None:
            return
        strategy = self._store.layout_strategy
        claim_id = self.claim.claim_id
        if strategy.releases_once():
            self.claim = None  # a release that fails is not retried
        strategy.release_claim(self._rollout_id, claim_id)
        self.claim = None

    def __enter__(self) -> Claim:
        return self._acquire()

    def __exit__(self, *exc: object) -> None:
        self._release()

    async def __aenter__(self) -> Claim:
        try:
            return await finish_in_thread(self._acquire)
        except asyncio.CancelledError:
            await finish_in_thread(self._release)
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await finish_in_thread(self._release)


class CaptureStore:
    """One capture root (a local path or any fsspec URL) and the rollouts under it."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        layout: LayoutChoice = "auto",
        concurrency: int = DEFAULT_READ_CONCURRENCY,
        credentials: Mapping[str, Any] | None = None,
        claims: ClaimsMode = "files",
    ) -> None:
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        self.concurrency = concurrency
        self._backend: Backend = open_backend(
            self.url, self.storage_options, concurrency=concurrency, credentials=credentials
        )
        self.root = self._backend.root
        self._journal = StoreJournal(self._backend)
        self.layout_strategy = open_layout(self.url, self._backend, layout, claims, self._journal)
        """How this store writes rows and claims (picked once, here)."""
        self.layout: Layout = self.layout_strategy.name
        self.claims_mode: ClaimsMode = claims
        self._no_journal_scopes: dict[str, None] = {}  # jobs whose first batch found no journal
        self._open_scopes: set[str] = set()  # jobs reading now: the journal's bodies are kept for them
        self._scopes_lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        # Filesystems are not fork- or pickle-safe, and credentials never travel: a worker
        # rebuilds its own store (resolving credentials itself, see shared_store).
        return (
            _rebuild_store,
            (self.url, self.storage_options, self.layout, self.concurrency, self.claims_mode),
        )

    def __repr__(self) -> str:
        return f"CaptureStore({self.url!r}, layout={self.layout!r})"

    @property
    def claims_log_writer(self) -> ClaimsLogWriter | None:
        """This process's claims log, when claims go to one (not in the journal layout)."""
        return self.layout_strategy.claims_log_writer

    def close_claims_log(self) -> None:
        """Remove this process's claims logs that hold nothing open (a producer that stops)."""
        self.layout_strategy.close_claims_log()

    # ------------------------------------------------------------------ writing

    @property
    def writes_in_place(self) -> bool:
        """Whether claims and the first step of :meth:`record_staged` are quick local-disk work
        that an event loop may do itself (only the fsync blocks)."""
        return self._backend.writes_in_place

    def record(self, rollout_id: str, row: Mapping[str, Any]) -> None:
        """Append one row for the rollout; it is durable when this returns.

        If the write fails, the rollout is marked incomplete (so readers know its capture
        is partial) and the error is raised.
        """
        blocking, finish = self.record_staged(rollout_id, row)
        try:
            blocking()
        finally:
            finish()

    def record_staged(self, rollout_id: str, row: Mapping[str, Any]) -> StagedWrite:
        """:meth:`record` in steps for a caller on an event loop: the cheap part now, then
        ``(blocking, finish)``: run ``blocking`` off the loop (the row is durable after it),
        then ``finish`` on the loop (readers see the row after it), even if ``blocking`` failed.

        On a local disk the row is written now and ``blocking`` is its fsync; on object stores
        ``blocking`` does it all. A step that fails marks the rollout incomplete and raises.
        """
        validate_rollout_id(rollout_id)
        if not isinstance(row, Mapping):
            raise ValueError(f"a capture row must be a JSON object; got {type(row).__name__}")
        blocking, finish = self._guarded(rollout_id, self.layout_strategy.stage_row, rollout_id, row)
        return (lambda: self._guarded(rollout_id, blocking)), finish

    def _guarded(self, rollout_id: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``; if it fails, the rollout is marked incomplete and the error raised."""
        try:
            return fn(*args)
        except Exception:
            logger.warning(
                "capture write failed for rollout %s; marking it incomplete", rollout_id, exc_info=True
            )
            try:
                self.mark_incomplete(rollout_id)
            except Exception:
                logger.warning("could not mark rollout %s incomplete", rollout_id, exc_info=True)
            raise

    async def record_async(self, rollout_id: str, row: Mapping[str, Any]) -> None:
        """:meth:`record` off the event loop, shielded: a cancelled caller still lands its row."""
        await finish_in_thread(self.record, rollout_id, row)

    # ------------------------------------------------------------------ the journal (spec 2, extension)

    @property
    def journal_reader(self) -> JournalReader:
        """This store's reader of the root's journal (read incrementally, shared by its batches)."""
        return self._journal.reader

    @property
    def journal_writer(self) -> JournalCommitter:
        """This process's group committer for the root's journal rows (started by its first entry)."""
        return self.journal_writer_of("rows")

    def journal_writer_of(self, stream: Stream) -> JournalCommitter:
        """This process's group committer for one stream of the root's journal."""
        return self._journal.writer_of(stream)

    def commit_journal_through(self, through: Callable[[JournalWriter], JournalCommitter]) -> None:
        """Commit the journal through ``through(this process's own writer of a stream)`` from now
        on: a proxy's worker hands its entries to its parent's writers (before its first entry)."""
        self._journal.commit_through(through)

    def compact(self, **options: Any) -> Compaction:
        """Compact the root's journal once its run is over (``rollout_capture.compaction``:
        ``compact_root``'s options): refused while a writer may still write it."""
        from rollout_capture.compaction import compact_root

        return compact_root(self._backend, **options)

    def journal_record(
        self,
        rollout_id: str,
        row: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        release: ClaimContext | None = None,
    ) -> concurrent.futures.Future[int]:
        """Journal layout: submit a row (built by the committer when ``row`` is a function) and the
        release of ``release``'s claim, to land in one commit; the future says when they are durable.
        The row lands above what existed at the claim's start (its look), with no look of its own.

        The caller marks the rollout incomplete if the future fails (:meth:`mark_incomplete`).
        """
        released = None
        look = None
        if release is not None:
            look, release.look = release.look, None
            if release.claim is not None:
                released = (release.rollout_id, release.claim.claim_id)
                release.claim = None  # released with the row, whatever happens to it
        return self._journal.submit_row(rollout_id, row, released, look)

    def claim(
        self, rollout_id: str, model_call_id: str | None = None, ttl_s: float = DEFAULT_CLAIM_TTL_S
    ) -> ClaimContext:
        """Claim the rollout for one model call; use as a sync or async context manager."""
        return ClaimContext(self, rollout_id, model_call_id, ttl_s)

    def mark_incomplete(self, rollout_id: str) -> None:
        """Say that some row of this rollout could not be written."""
        self._backend.put(self._backend.path(names.marker_name(rollout_id)), b"")

    # ------------------------------------------------------------------ reading

    def is_incomplete(self, rollout_id: str) -> bool:
        """Whether the incomplete marker is present."""
        return self._backend.exists(self._backend.path(names.marker_name(rollout_id)))

    def listing(self, rollout_id: str) -> RolloutListing:
        """What this store holds for one rollout, without reading it."""
        return self.listings([rollout_id])[rollout_id]

    def has_any(self, rollout_id: str) -> bool:
        """True when rows, objects, the marker or claims exist for the rollout."""
        if self.listing(rollout_id).found:
            return True
        reader = self.journal_reader
        reader.refresh()
        return reader.holds(validate_rollout_id(rollout_id))

    def listings(self, rollout_ids: Iterable[str]) -> dict[str, RolloutListing]:
        """Listings of many rollouts, listed now, the quickest way the backend knows."""
        return self._backend.list_rollouts([validate_rollout_id(r) for r in rollout_ids])

    def prefetch(self, rollout_ids: Iterable[str], *, scope: ListingScope | None = None) -> ReadBatch:
        """Get a batch ready to be read rollout by rollout.

        The backend picks how: one concurrent pass over every file on object stores, reads
        as each rollout is parsed on local disks. A ``scope``'s batches may share one listing.
        """
        ids = [validate_rollout_id(r) for r in rollout_ids]
        if scope is not None:
            with self._scopes_lock:
                self._open_scopes.add(scope.key)
        fetched = self._backend.fetch(ids, scope=scope)
        reader = self.journal_reader
        # The journal is looked for unless the batch's listing showed the whole root without
        # one, or an earlier batch of the job found none (its listing is as old as that look);
        # a listing of the whole root says which commits there are: those are read, no more.
        if not fetched.journal_absent and (scope is None or scope.key not in self._no_journal_scopes):
            reader.refresh(fetched.journal_commits)
            if not reader.exists and scope is not None:
                if len(self._no_journal_scopes) >= _MAX_SCOPES:
                    self._no_journal_scopes.pop(next(iter(self._no_journal_scopes)))
                self._no_journal_scopes[scope.key] = None
        return JournalReadBatch(fetched, reader, ids) if reader.exists else fetched

    def journal_alone(self, scope: ListingScope) -> bool:
        """Whether a job's batches all read one journal (the root holds its commits and no
        rollout's own file), by the listing they share, taken now if no batch took it: the first
        batch reads every commit, the others wait on none, so more of them in flight buy no time."""
        return self._backend.journal_alone(scope)

    def listed_rollout_ids(self, scope: ListingScope) -> set[str] | None:
        """The rollout ids under the root from what a job's listing already holds (orphan captures)."""
        listed = self._backend.listed_rollout_ids(scope.key)
        reader = self.journal_reader
        return listed if listed is None or not reader.exists else listed | reader.rollout_ids()

    def refuse_unsafe_writes(self) -> None:
        """Raise naming what is missing unless several writers may share this store (producers' startup)."""
        self._backend.refuse_unsafe_writes()

    def prove_writable(self) -> None:
        """Create a probe object under the root, create it again, remove it (producers' startup):
        a root that cannot be written (no such bucket, read-only) is refused before a call is served
        unrecorded, and so is a store that takes the second create (no put-if-absent: rows would be
        lost), before anything of the caller's is written.

        Raises :class:`UnwritableRootError` (a ``ValueError``) naming the root and what the store
        said, or ``UnsafeStoreError`` naming the store, its endpoint and the request it ignored.
        """
        path = self._backend.path(probe_name())
        try:
            self._backend.prove_put_if_absent(path)
        except UnsafeStoreError:
            raise
        except Exception as exc:
            raise UnwritableRootError(
                f"capture root {self.url} cannot be written ({type(exc).__name__}: {exc}); "
                "nothing would be recorded"
            ) from None

    def require_put_if_absent(self) -> None:
        """Raise ``UnsafeStoreError`` unless this store refuses a second create of one object
        (proven once per store and process): what a flow asks before its first write to a root."""
        self._backend.require_put_if_absent()

    def root_found(self) -> bool:
        """Whether the capture root is there: a folder on a local disk, any key on an object store."""
        return self._backend.root_found()

    def end_scope(self, key: str) -> None:
        """Forget the listing the batches of a finished job (``ListingScope.key``) shared, and the
        journal's bodies once no job reads this store."""
        self._backend.end_scope(key)
        self._no_journal_scopes.pop(key, None)
        with self._scopes_lock:
            self._open_scopes.discard(key)
            idle = not self._open_scopes
        if idle:
            self._journal.forget_bodies()

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        """Everything this store holds for one rollout."""
        return self.prefetch([rollout_id]).snapshot(rollout_id)

    def read_available(self, rollout_id: str) -> tuple[list[tuple[int, Row]], int]:
        """Readable rows with their ``call_index``, and how many rows were damaged."""
        snap = self.snapshot(rollout_id)
        return snap.rows, len(snap.damaged)

    def read(self, rollout_id: str) -> list[Row]:
        """All rows in order; raises :class:`CaptureRowError` naming the first damaged one."""
        snap = self.snapshot(rollout_id)
        if snap.damaged:
            raise CaptureRowError(snap.damaged[0])
        return [row for _, row in snap.rows]

    def claims(self, rollout_ids: Iterable[str]) -> dict[str, list[Claim]]:
        """The claims of each rollout that has any, read now."""
        ids = [validate_rollout_id(r) for r in rollout_ids]
        out = self._backend.claims(ids)
        reader = self.journal_reader
        reader.refresh()
        if reader.exists:
            for rollout_id, claims in reader.view(ids).all_claims().items():
                out[rollout_id] = [*out.get(rollout_id, []), *claims]
        return out

    def live_claims(self, rollout_id: str, *, now: float | None = None) -> list[Claim]:
        """Claims of calls that may still write a row."""
        return partition(self.claims([rollout_id]).get(rollout_id, []), now)[0]

    def expired_claims(self, rollout_id: str, *, now: float | None = None) -> list[Claim]:
        """Claims whose producer outlived its TTL: presumed dead."""
        return partition(self.claims([rollout_id]).get(rollout_id, []), now)[1]

    # ------------------------------------------------------------------ clearing

    def clear(self, rollout_ids: Iterable[str]) -> list[str]:
        """Remove every file of these rollouts; all ids are validated before anything is deleted.

        Raises ``OSError`` when something survives (object stores check by listing again,
        because bulk deletes can drop keys silently).
        """
        ids = [validate_rollout_id(r) for r in rollout_ids]
        self.layout_strategy.forget(ids)
        self._backend.clear_rollouts(ids)
        reader = self.journal_reader
        reader.refresh()
        held = [r for r in dict.fromkeys(ids) if reader.holds(r)]
        if held:  # journal entries are never deleted (commits hold other rollouts'): cleared by an entry
            for stream in STREAMS:
                self.journal_writer_of(stream).write([clear_entry(r) for r in held])
            reader.refresh()
            left = [r for r in held if reader.holds(r)]
            if left:
                raise OSError(
                    f"{self.url}: journal entries of {len(left)} rollout(s) survived clearing: {left[:3]}"
                )
        return ids


def _rebuild_store(
    url: str,
    storage_options: dict[str, Any],
    layout: LayoutChoice,
    concurrency: int,
    claims: ClaimsMode = "files",
) -> CaptureStore:
    return CaptureStore(
        url, storage_options=storage_options, layout=layout, concurrency=concurrency, claims=claims
    )


CaptureDir = CaptureStore | str | os.PathLike[str]
"""Wherever capture dirs are taken: a path, a URL, or a store carrying its storage options."""


_shared: OrderedDict[tuple[str, bytes, str | None], CaptureStore] = OrderedDict()
_shared_lock = threading.Lock()
# A long-lived worker enriches one run after another, each with its own capture root.
_MAX_SHARED = 16


def shared_store(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> CaptureStore:
    """One store per URL, options and credentials in this process, reused across batches.

    Reuse keeps what a store learns (the size of its root, sequence hints, a job's shared
    listing) and its filesystem's connection pool; renewed credentials get a store of
    their own (keyed by a digest, never the secret). The least recently used are let go.
    """
    digest = (
        hashlib.sha256(orjson.dumps(dict(credentials), option=orjson.OPT_SORT_KEYS)).hexdigest()
        if credentials
        else None
    )
    key = (url, orjson.dumps(dict(storage_options or {}), option=orjson.OPT_SORT_KEYS), digest)
    with _shared_lock:
        store = _shared.get(key)
        if store is None:
            store = _shared[key] = CaptureStore(url, storage_options=storage_options, credentials=credentials)
            while len(_shared) > _MAX_SHARED:
                _shared.popitem(last=False)
        else:
            _shared.move_to_end(key)
        return store


def forget_shared_stores() -> None:
    """Let go of every store :func:`shared_store` kept (a fresh process's state, for tests)."""
    with _shared_lock:
        _shared.clear()


def end_scope(key: str) -> None:
    """Let go of what this process's stores kept for a finished job (its shared listings)."""
    with _shared_lock:
        stores = list(_shared.values())
    for store in stores:
        store.end_scope(key)


def as_store(target: CaptureDir) -> CaptureStore:
    """Accept a path, a URL or a store wherever ``capture_dirs`` are taken.

    A path or URL gets this process's shared store of it, so what it has read (a journal, read
    from where it stopped) serves the next call too (a quiescence wait per rollout, say).
    """
    return target if isinstance(target, CaptureStore) else shared_store(os.fspath(target))
