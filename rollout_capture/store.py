"""The capture store of one root: writes, claims, markers, reads and clearing (spec 2, 3, 9).

Layout follows the filesystem: JSONL appends on local POSIX disks, a put-if-absent
sequence of objects on object stores (which have no append). Reads understand both.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Literal, TypeVar

import orjson
from fsspec.implementations.local import LocalFileSystem

from rollout_capture import layout as names
from rollout_capture.backends import Backend, FsspecBackend, LocalBackend
from rollout_capture.claims import DEFAULT_CLAIM_TTL_S, Claim, claim_body, new_claim
from rollout_capture.filesystem import DEFAULT_READ_CONCURRENCY, open_filesystem
from rollout_capture.identity import validate_rollout_id
from rollout_capture.layout import CLAIMS_SUFFIX, JSONL_SUFFIX, MARKER_SUFFIX, OBJECTS_SUFFIX, RolloutListing
from rollout_capture.rows import NONCE_KEY, CaptureRowError, Row
from rollout_capture.snapshot import RolloutSnapshot, claims_of, listed_paths, parse_snapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")
Layout = Literal["auto", "jsonl", "objects"]

# A flat listing of the root beats one listing per rollout while the root holds fewer
# than this many keys per rollout asked for (a LIST page holds 1,000 keys).
_KEYS_PER_LIST_PAGE = 1000
# A local name costs a fraction of the access() probes a rollout needs without the listing.
_NAMES_PER_PROBE = 16
# With no size hint yet, a batch this large is listed flat (and the hint learned).
_FLAT_LISTING_MIN_IDS = 32
_ALL_SUFFIXES = (JSONL_SUFFIX, MARKER_SUFFIX, OBJECTS_SUFFIX, CLAIMS_SUFFIX)
_MAX_SEQ_HINTS = 10_000
_CLEAR_ATTEMPTS = 3


async def finish_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a thread and wait for it even if the caller is cancelled meanwhile.

    A capture write that started must land (or fail) before its claim is released;
    cancellation is re-raised once it has.
    """
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done():
                # The write finished with an error while we were cancelled.
                error = None if future.cancelled() else future.exception()
                if error is None:
                    raise
                raise error from None
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class Prefetch:
    """A batch of rollouts fetched as bytes in one pass; parsed one rollout at a time."""

    def __init__(
        self, listings: dict[str, RolloutListing], bodies: dict[str, bytes | None], *, trust_mtime: bool
    ) -> None:
        self.listings = listings
        self.bodies = bodies
        self.trust_mtime = trust_mtime

    def found(self, rollout_id: str) -> bool:
        """Whether the store holds anything for the rollout."""
        listing = self.listings.get(rollout_id)
        return listing is not None and listing.found

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        """Parse one rollout from the fetched bytes."""
        listing = self.listings.get(rollout_id) or RolloutListing()
        return parse_snapshot(rollout_id, listing, self.bodies, trust_mtime=self.trust_mtime)

    def claims(self) -> dict[str, list[Claim]]:
        """The claims of each fetched rollout that has any."""
        return claims_of(self.listings, self.bodies, trust_mtime=self.trust_mtime)

    def updated(self, newer: Prefetch | LocalPrefetch) -> Prefetch:
        """This prefetch with the rollouts of ``newer`` replaced by their newer state."""
        assert isinstance(newer, Prefetch)
        return Prefetch(
            {**self.listings, **newer.listings}, {**self.bodies, **newer.bodies}, trust_mtime=self.trust_mtime
        )


class LocalPrefetch:
    """A batch on a local disk: optionally the root's names, files read rollout by rollout."""

    def __init__(self, backend: LocalBackend, ids: set[str], names: set[str] | None) -> None:
        self._backend = backend
        self._ids = ids
        self._names = names
        self._fresh: set[str] = set()  # rollouts refreshed since the names were listed

    def _names_for(self, rollout_id: str) -> set[str] | None:
        return None if self._names is None or rollout_id in self._fresh else self._names

    def found(self, rollout_id: str) -> bool:
        """Whether the store holds anything for the rollout."""
        names = self._names_for(rollout_id)
        if names is None:
            return self._backend.list_rollout(rollout_id).found
        return any(rollout_id + suffix in names for suffix in _ALL_SUFFIXES)

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        """Read and parse one rollout."""
        return self._backend.snapshot(validate_rollout_id(rollout_id), self._names_for(rollout_id))

    def claims(self) -> dict[str, list[Claim]]:
        """The claims of each rollout of the batch that has any."""
        out: dict[str, list[Claim]] = {}
        for rollout_id in self._ids:
            names = self._names_for(rollout_id)
            if names is None:
                if not self._backend.may_have_claims(rollout_id):
                    continue
            elif rollout_id + CLAIMS_SUFFIX not in names:
                continue
            found = self._backend.snapshot(rollout_id, names).claims
            if found:
                out[rollout_id] = found
        return out

    def updated(self, newer: Prefetch | LocalPrefetch) -> LocalPrefetch:
        """This batch with the rollouts of ``newer`` read afresh from now on."""
        assert isinstance(newer, LocalPrefetch)
        merged = LocalPrefetch(self._backend, self._ids | newer._ids, self._names)
        merged._fresh = self._fresh | newer._ids
        return merged


class ClaimContext:
    """``with store.claim(...)`` / ``async with store.claim(...)``: hold a claim for one call."""

    def __init__(self, store: CaptureStore, rollout_id: str, model_call_id: str | None, ttl_s: float) -> None:
        self._store = store
        self._rollout_id = validate_rollout_id(rollout_id)
        self._model_call_id = model_call_id
        self._ttl_s = ttl_s
        self.claim: Claim | None = None

    def _acquire(self) -> Claim:
        claim = new_claim(self._model_call_id, self._ttl_s)
        self._store._backend.put(
            self._store._backend.path(names.claim_name(self._rollout_id, claim.claim_id)), claim_body(claim)
        )
        self.claim = claim
        return claim

    def _release(self) -> None:
        if self.claim is not None:
            self._store._backend.remove(
                [self._store._backend.path(names.claim_name(self._rollout_id, self.claim.claim_id))]
            )
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
        layout: Layout = "auto",
        concurrency: int = DEFAULT_READ_CONCURRENCY,
        credentials: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        self.concurrency = concurrency
        fs, root = open_filesystem(
            self.url, self.storage_options, concurrency=concurrency, credentials=credentials
        )
        self.root = root
        self.is_local = isinstance(fs, LocalFileSystem)
        self._backend: Backend = LocalBackend(root) if self.is_local else FsspecBackend(fs, root, concurrency)
        if layout == "auto":
            layout = "jsonl" if self.is_local else "objects"
        if layout == "jsonl" and not self.is_local:
            raise ValueError(
                f"{self.url}: the JSONL layout needs a local disk (object stores have no append)"
            )
        self.layout: Literal["jsonl", "objects"] = layout
        self._seq_hints: dict[str, int] = {}
        self._root_keys_hint: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Filesystems are not fork- or pickle-safe, and credentials never travel: a worker
        # rebuilds its own store (resolving credentials itself, see shared_store).
        return (_rebuild_store, (self.url, self.storage_options, self.layout, self.concurrency))

    def __repr__(self) -> str:
        return f"CaptureStore({self.url!r}, layout={self.layout!r})"

    # ------------------------------------------------------------------ writing

    def record(self, rollout_id: str, row: Mapping[str, Any]) -> None:
        """Append one row for the rollout; it is durable when this returns.

        If the write fails, the rollout is marked incomplete (so readers know its capture
        is partial) and the error is raised.
        """
        validate_rollout_id(rollout_id)
        if not isinstance(row, Mapping):
            raise ValueError(f"a capture row must be a JSON object; got {type(row).__name__}")
        try:
            if self.layout == "jsonl":
                line = orjson.dumps(row, default=str, option=orjson.OPT_APPEND_NEWLINE)
                self._backend.append_line(self._backend.path(names.jsonl_name(rollout_id)), line)
            else:
                self._append_object(rollout_id, row)
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

    def _append_object(self, rollout_id: str, row: Mapping[str, Any]) -> None:
        nonce = uuid.uuid4().hex
        body = orjson.dumps({**row, NONCE_KEY: nonce}, default=str)
        backend = self._backend
        seq = self._seq_hints.get(rollout_id, 0)
        while True:
            path = backend.path(names.object_name(rollout_id, seq))
            try:
                backend.create(path, body)
                break
            except FileExistsError:
                # Our own retried request may have landed: the nonce tells.
                existing = backend.read_many([path])[0]
                if existing is not None and _nonce_of(existing) == nonce:
                    break
                seq = self._first_free_after(rollout_id, seq)
        if len(self._seq_hints) >= _MAX_SEQ_HINTS:
            self._seq_hints.clear()
        self._seq_hints[rollout_id] = seq + 1

    def _first_free_after(self, rollout_id: str, taken: int) -> int:
        """Smallest free seq above ``taken``; occupied seqs always form a prefix."""
        exists = self._backend.exists
        path = self._backend.path
        low, step = taken, 1
        while exists(path(names.object_name(rollout_id, low + step))):
            low += step
            step *= 2
        high = low + step  # free; low is taken
        while high - low > 1:
            mid = (low + high) // 2
            if exists(path(names.object_name(rollout_id, mid))):
                low = mid
            else:
                high = mid
        return high

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
        return self._backend.list_rollout(validate_rollout_id(rollout_id))

    def has_any(self, rollout_id: str) -> bool:
        """True when rows, objects, the marker or claims exist for the rollout."""
        return self.listing(rollout_id).found

    def _flat_listing_pays(self, wanted: int, keys_per_probe: int) -> bool:
        """Whether listing the whole root beats probing ``wanted`` rollouts one by one."""
        if self._root_keys_hint is None:
            return wanted >= _FLAT_LISTING_MIN_IDS  # and the listing teaches us the root's size
        return self._root_keys_hint <= keys_per_probe * wanted

    def _names_worth_listing(self, wanted: int) -> bool:
        return self._flat_listing_pays(wanted, _NAMES_PER_PROBE)

    def listings(self, rollout_ids: Iterable[str]) -> dict[str, RolloutListing]:
        """Listings of many rollouts, from one flat listing when that is cheaper."""
        ids = [validate_rollout_id(r) for r in rollout_ids]
        if not ids:
            return {}
        backend = self._backend
        if isinstance(backend, LocalBackend):  # per-rollout probes are cheap on a local disk
            return {r: backend.list_rollout(r) for r in ids}
        if isinstance(backend, FsspecBackend) and self._flat_listing_pays(len(ids), _KEYS_PER_LIST_PAGE):
            everything = backend.list_all()
            self._root_keys_hint = sum(len(v.paths()) for v in everything.values())
            return {r: everything.get(r) or RolloutListing() for r in ids}
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(ids))) as pool:
            return dict(zip(ids, pool.map(backend.list_rollout, ids), strict=True))

    def prefetch(self, rollout_ids: Iterable[str]) -> Prefetch | LocalPrefetch:
        """Get a batch ready to be read rollout by rollout.

        Object stores: one listing, then every file read as bytes, concurrently. Local
        disks: at most one listing of names (when the root is small enough for it to beat
        per-rollout probes); files are read when each rollout is.
        """
        backend = self._backend
        if isinstance(backend, LocalBackend):
            ids = {validate_rollout_id(r) for r in rollout_ids}
            names = None
            if self._names_worth_listing(len(ids)):
                names = backend.names()
                self._root_keys_hint = len(names)
            return LocalPrefetch(backend, ids, names)
        return self._fetch_objects(rollout_ids)

    def _fetch_objects(self, rollout_ids: Iterable[str]) -> Prefetch:
        listings = self.listings(rollout_ids)
        paths = [path for listing in listings.values() for path in listed_paths(listing)]
        bodies = dict(zip(paths, self._backend.read_many(paths), strict=True))
        return Prefetch(listings, bodies, trust_mtime=self._backend.trust_mtime)

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
        """The claims of each rollout that has any."""
        ids = [validate_rollout_id(r) for r in rollout_ids]
        backend = self._backend
        if isinstance(backend, LocalBackend):  # one access() per id; only the claimed are listed
            return LocalPrefetch(backend, set(ids), None).claims()
        listings = {r: v for r, v in self.listings(ids).items() if v.claims}
        paths = [entry.path for listing in listings.values() for _, entry in listing.claims]
        bodies = dict(zip(paths, backend.read_many(paths), strict=True))
        return claims_of(listings, bodies, trust_mtime=backend.trust_mtime)

    def live_claims(self, rollout_id: str, *, now: float | None = None) -> list[Claim]:
        """Claims of calls that may still write a row."""
        return _split_claims(self.claims([rollout_id]).get(rollout_id, []), now)[0]

    def expired_claims(self, rollout_id: str, *, now: float | None = None) -> list[Claim]:
        """Claims whose producer outlived its TTL: presumed dead."""
        return _split_claims(self.claims([rollout_id]).get(rollout_id, []), now)[1]

    # ------------------------------------------------------------------ clearing

    def clear(self, rollout_ids: Iterable[str]) -> list[str]:
        """Remove every file of these rollouts; all ids are validated before anything is deleted.

        On object stores the deletion is checked by listing again, because bulk deletes
        can drop keys silently.
        """
        ids = [validate_rollout_id(r) for r in rollout_ids]
        for rollout_id in ids:
            self._seq_hints.pop(rollout_id, None)
        backend = self._backend
        if isinstance(backend, LocalBackend):
            for rollout_id in ids:
                backend.clear_rollout(rollout_id)
            return ids
        for _ in range(_CLEAR_ATTEMPTS):
            leftover = [p for listing in self.listings(ids).values() for p in listing.paths()]
            if not leftover:
                return ids
            backend.remove(leftover)
        leftover = [p for listing in self.listings(ids).values() for p in listing.paths()]
        if leftover:
            raise OSError(
                errno.EIO, f"{self.url}: {len(leftover)} capture file(s) survived deletion: {leftover[:3]}"
            )
        return ids


def _split_claims(claims: list[Claim], now: float | None) -> tuple[list[Claim], list[Claim]]:
    moment = time.time() if now is None else now
    live = [c for c in claims if c.is_live(moment)]
    return live, [c for c in claims if not c.is_live(moment)]


def _nonce_of(body: bytes) -> str | None:
    try:
        row = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return row.get(NONCE_KEY) if isinstance(row, dict) else None


def _rebuild_store(
    url: str, storage_options: dict[str, Any], layout: Layout, concurrency: int
) -> CaptureStore:
    return CaptureStore(url, storage_options=storage_options, layout=layout, concurrency=concurrency)


CaptureDir = CaptureStore | str | os.PathLike[str]
"""Wherever capture dirs are taken: a path, a URL, or a store carrying its storage options."""


_shared: dict[tuple[str, bytes, str | None], CaptureStore] = {}
_shared_lock = threading.Lock()


def shared_store(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
    credentials_name: str | None = None,
) -> CaptureStore:
    """One store per URL and options in this process, reused across batches.

    Reuse keeps what a store learns (the size of its root, sequence hints) and its
    filesystem's connection pool. ``credentials_name`` keys the credentials' source.
    """
    key = (url, orjson.dumps(dict(storage_options or {}), option=orjson.OPT_SORT_KEYS), credentials_name)
    with _shared_lock:
        store = _shared.get(key)
        if store is None:
            store = _shared[key] = CaptureStore(url, storage_options=storage_options, credentials=credentials)
        return store


def as_store(target: CaptureDir) -> CaptureStore:
    """Accept a path, a URL or a store wherever ``capture_dirs`` are taken."""
    return target if isinstance(target, CaptureStore) else CaptureStore(target)
