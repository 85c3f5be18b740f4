"""A capture root on an object store or any other fsspec filesystem but the local disk.

:class:`ObjectStoreBackend` is generic: it speaks fsspec's interface only. What a store does
better or differently is a subclass overriding its hooks (``_listed_files``, ``_list_names_of``,
``_read_kwargs``, ``create_unproven``, ``endpoint``) and declaring its ``capabilities``, picked by
protocol in :mod:`rollout_capture.backends.registry` (S3, GCS and Azure in modules of their own).

Object stores answer per request, with a first-byte latency of tens of milliseconds, so
this backend lists flat (1,000 keys a page, sizes included, never a HEAD) when that is
quicker than listing each rollout, reads every file of a batch concurrently, and lets the
batches of one job share a single listing of the root.

Writers need put-if-absent (a row object, a lease, must never replace another writer's):
stores whose ``capabilities`` say ``conditional-request`` (S3, GCS, Azure) do it in one conditional
request, proven honoured once per store and process before it is relied on
(:mod:`rollout_capture.backends.proof`); a ``process-lock`` one (fsspec's in-memory filesystem) is
one process's, so a lock does it there. Any other store (SFTP, ``dir://``...) reads fine but is
refused for writing, naming what it lacks: its emulation (look, then write) would let two hosts
both win.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import itertools
import math
import queue
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import fsspec
from fsspec.asyn import sync as fsspec_sync

from rollout_capture.backends.base import Backend, ListedReadBatch, ListingScope, Named, ReadBatch
from rollout_capture.backends.capabilities import ONE_PROCESS, READ_ONLY_STORE, Capabilities
from rollout_capture.filesystem import DEFAULT_READ_CONCURRENCY, join, protocol_of
from rollout_capture.identity import validate_rollout_id
from rollout_capture.names import (
    COMPACTED,
    Entry,
    RolloutListing,
    group_entries,
    journal_numbers,
    objects_dir,
)

if TYPE_CHECKING:
    from rollout_capture.layouts import Layout

T = TypeVar("T")

KEYS_PER_PAGE = 1000
"""Keys in one page of a listing (the maximum of the common object stores)."""
# Below this many rollouts, and with nothing learnt yet, one listing per rollout is cheapest.
_FLAT_MIN_IDS = 32
_SCOPES_KEPT = 4  # jobs whose listing is kept at once

_memory_create_lock = threading.Lock()


def mtime_of(info: dict[str, Any]) -> float | None:
    """The modification time (epoch s) an fsspec info dict gives, whatever the store calls it."""
    for key in ("LastModified", "mtime", "updated", "created", "last_modified"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


def _reads_async(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether the filesystem's coroutine reads work: a wrapper (``dir://``) is async only
    when the filesystem it wraps is (its ``_cat_file`` calls the inner one's)."""
    inner = getattr(fs, "fs", None)
    if isinstance(inner, fsspec.AbstractFileSystem) and not _reads_async(inner):
        return False
    return bool(getattr(fs, "async_impl", False))


def named_entries(folder: str, listed: list[dict[str, Any]]) -> dict[str, Named]:
    """Base name -> entry for a one-level listing of ``folder`` (its own folder marker left out)."""
    base = folder.rstrip("/")
    out = {}
    for info in listed:
        path = str(info["name"]).rstrip("/")
        name = path.rsplit("/", 1)[-1]
        if path == base or not name:
            continue
        is_folder = info.get("type") == "directory"
        size = None if is_folder else info.get("size")
        out[name] = Named(name, path, is_folder, size, None if is_folder else mtime_of(info))
    return out


class RootListing(dict[str, RolloutListing]):
    """Every rollout of a flat listing of the whole root, and the journal commits it showed (by
    stream; under ``compacted``, the compacted generations with a manifest)."""

    commits: dict[str, list[int]]

    def __init__(self, rollouts: dict[str, RolloutListing], commits: dict[str, list[int]]) -> None:
        super().__init__(rollouts)
        self.commits = commits


def _read_batch(backend: Backend, flat: dict[str, RolloutListing] | None) -> ListedReadBatch:
    """A batch to read, knowing what ``flat`` (a listing of the whole root, if one) said of the journal."""
    batch = ListedReadBatch(backend)
    if isinstance(flat, RootListing):
        batch.journal_commits = flat.commits
        batch.journal_only = not flat
    return batch


class ListingTooLarge(Exception):
    """A flat listing outgrew its budget: listing per rollout is quicker."""


class ObjectStoreBackend(Backend):
    """A capture root on any fsspec filesystem but the local disk (generic: fsspec calls only)."""

    default_layout: Layout = "objects"
    supports_append = False  # no object store appends safely (emulated appends lose rows)
    trust_mtime = True  # modification times come from the store's clock
    capabilities: ClassVar[Capabilities] = READ_ONLY_STORE  # fsspec alone offers no put-if-absent
    _read_kwargs: ClassVar[Mapping[str, Any]] = {}
    """Keyword arguments of every ``cat_file`` (a store's own tuning)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, concurrency: int = DEFAULT_READ_CONCURRENCY):
        self.fs = fs
        self.root = root
        self.concurrency = concurrency
        finder = getattr(type(fs), "_find", None) or type(fs).find
        self._find_takes_prefix = "prefix" in inspect.signature(finder).parameters
        self._root_keys: int | None = None  # keys in the root at its last flat listing
        # The listing of each job (flow run) recently served, newest last: jobs sharing this
        # store in parallel (runs enriched side by side) each keep theirs.
        self._scoped: dict[str, dict[str, RolloutListing] | None] = {}
        self._scope_lock = threading.Lock()
        # The threads blocking GETs run on, started as needed and kept for the next read.
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="rollout-capture-get")

    @classmethod
    def from_filesystem(
        cls, fs: fsspec.AbstractFileSystem, root: str, concurrency: int
    ) -> ObjectStoreBackend:
        return cls(fs, root, concurrency)

    def path(self, name: str) -> str:
        return join(self.root, name)

    # ------------------------------------------------------------------ listing strategy

    def _rounds(self, rollouts: int) -> int:
        """Sequential request rounds that listing ``rollouts`` one by one takes."""
        return math.ceil(rollouts / max(1, self.concurrency))

    def _flat_quicker(self, rollouts: int) -> bool | None:
        """Whether one flat listing beats listing each rollout (None: not known yet)."""
        if self._root_keys is None:
            return None
        return math.ceil(max(1, self._root_keys) / KEYS_PER_PAGE) <= self._rounds(rollouts)

    def _entries(self, prefix: str, budget: int | None) -> list[tuple[str, Entry]]:
        """``(name relative to the root, entry)`` of every file under ``root/prefix``.

        With a ``budget`` (in pages), :class:`ListingTooLarge` is raised once more keys than it
        covers have been seen, and no further page is requested.
        """
        limit = None if budget is None else budget * KEYS_PER_PAGE
        found = self._listed_files(prefix, limit)
        start = len(self.root) + 1
        out = []
        for name, info in found:
            if not name.startswith(self.root + "/"):
                continue
            relative = name[start:]
            if relative.startswith(prefix):
                out.append((relative, Entry(name, info.get("size"), mtime_of(info))))
        return out

    def _listed_files(self, prefix: str, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
        """``(full name, info)`` of every file whose name under the root starts with ``prefix``
        (a hook: one flat listing); :class:`ListingTooLarge` past ``limit`` files, if given."""
        kwargs: dict[str, Any] = {"detail": True}
        if self._find_takes_prefix:
            kwargs["prefix"] = prefix
        try:
            listed = self.fs.find(self.root, **kwargs)
        except FileNotFoundError:
            listed = {}
        found = [(name, info) for name, info in listed.items() if info.get("type") != "directory"]
        if limit is not None and len(found) > limit:
            raise ListingTooLarge
        return found

    def _flat(self, budget: int | None = None) -> dict[str, RolloutListing]:
        """Every rollout under the root, from one flat listing; learns the root's size."""
        entries = self._entries("", budget)
        self._root_keys = len(entries)
        return RootListing(group_entries(entries), journal_numbers(name for name, _ in entries))

    def _one_by_one(self, ids: Sequence[str]) -> dict[str, RolloutListing]:
        def one(rollout_id: str) -> RolloutListing:
            grouped = group_entries(self._entries(objects_dir(rollout_id), None), {rollout_id})
            return grouped.get(rollout_id) or RolloutListing()

        if len(ids) == 1:
            return {ids[0]: one(ids[0])}
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(ids))) as pool:
            return dict(zip(ids, pool.map(one, ids), strict=True))

    def _listings(self, ids: Sequence[str], expected: int) -> dict[str, RolloutListing] | None:
        """A flat listing of the root when it is quicker than listing ``expected`` rollouts one by
        one; None when listing one by one is.

        Not knowing the root's size yet, the flat listing is tried within the time the other
        way would take, and abandoned past it (so a wrong guess costs at most twice the best).
        """
        quicker = self._flat_quicker(expected)
        if quicker is None:
            if expected < _FLAT_MIN_IDS:
                return None
            try:
                return self._flat(budget=self._rounds(expected))
            except ListingTooLarge:
                self._root_keys = (self._rounds(expected) + 1) * KEYS_PER_PAGE  # at least
                return None
        return self._flat() if quicker else None

    def list_rollouts(self, rollout_ids: Collection[str]) -> dict[str, RolloutListing]:
        return self._list_rollouts(rollout_ids)[0]

    def _list_rollouts(
        self, rollout_ids: Collection[str]
    ) -> tuple[dict[str, RolloutListing], dict[str, RolloutListing] | None]:
        """The rollouts' listings, and the whole-root listing they came from, if one."""
        ids = [validate_rollout_id(r) for r in dict.fromkeys(rollout_ids)]
        if not ids:
            return {}, None
        flat = self._listings(ids, len(ids))
        if flat is None:
            return self._one_by_one(ids), None
        return {r: flat.get(r) or RolloutListing() for r in ids}, flat

    def _scope_listing(
        self, ids: list[str], scope: ListingScope, *, decide: bool = True
    ) -> dict[str, RolloutListing] | None:
        """The job's one flat listing of the root, taken by the first to ask; None when listing its
        rollouts one by one is quicker (remembered for the job's batches unless not ``decide``:
        a batch's own rollouts may tip it)."""
        with self._scope_lock:  # batches of one job run in threads: one of them lists
            if scope.key in self._scoped:
                return self._scoped[scope.key]
            flat = self._listings(ids, max(scope.rollouts, len(ids)))
            if flat is None and not decide:
                return None
            while len(self._scoped) >= _SCOPES_KEPT:
                del self._scoped[next(iter(self._scoped))]  # the oldest job's
            self._scoped[scope.key] = flat
            return flat

    def journal_alone(self, scope: ListingScope) -> bool:
        flat = self._scope_listing([], scope, decide=False)
        if not isinstance(flat, RootListing) or flat:
            return False
        # A compacted generation's parts are read in ranges, each batch its own: not counted here.
        commits = flat.commits
        return bool(commits.get("rows") or commits.get("claims")) and not commits.get(COMPACTED)

    def _scoped_listings(
        self, ids: list[str], scope: ListingScope
    ) -> tuple[dict[str, RolloutListing], dict[str, RolloutListing] | None]:
        """Listings for a batch of a job, from the job's one flat listing when it has (or takes) one."""
        flat = self._scope_listing(ids, scope)
        if flat is None:
            return self._one_by_one(ids), None
        return {r: flat.get(r) or RolloutListing() for r in ids}, flat

    def listed_rollout_ids(self, scope_key: str) -> set[str] | None:
        with self._scope_lock:
            flat = self._scoped.get(scope_key)
        return None if flat is None else set(flat)

    def end_scope(self, key: str) -> None:
        with self._scope_lock:
            self._scoped.pop(key, None)

    # ------------------------------------------------------------------ reading

    def fetch(self, rollout_ids: Collection[str], *, scope: ListingScope | None = None) -> ReadBatch:
        ids = [validate_rollout_id(r) for r in dict.fromkeys(rollout_ids)]
        listings, flat = (
            self._list_rollouts(ids) if scope is None or not ids else self._scoped_listings(ids, scope)
        )
        fetched = _read_batch(self, flat)
        fetched.add(listings)
        return fetched

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        if not paths:
            return []
        blocking = self._blocking_get()
        if blocking is not None:
            if len(paths) == 1:  # in the caller's thread: no hop to another for one request
                return [blocking(paths[0])]
            return list(self.read_iter(paths))
        if _reads_async(self.fs):
            result: list[bytes | None] = fsspec_sync(self.fs.loop, self._read_many_async, list(paths))
            return result
        out: list[bytes | None] = []
        for path in paths:
            try:
                out.append(self.fs.cat_file(path, **self._read_kwargs))
            except FileNotFoundError:
                out.append(None)
        return out

    async def _before_reads(self) -> None:
        """A hook run on the filesystem's loop before a pass of coroutine reads (credentials taken
        afresh; a blocking GET takes care of its own)."""

    def _blocking_get(self) -> Callable[[str], bytes | None] | None:
        """The store's own GET as a call that blocks its thread, ``None`` when it has none (a hook):
        reads then run on threads of their own, handing no future between threads (0.25 against
        0.43 ms of CPU a GET through obstore), else as coroutines of the filesystem's loop."""
        return None

    async def _get(self, path: str) -> bytes | None:
        """One object's bytes, ``None`` when it is missing (a hook: the store's own GET)."""
        try:
            data: bytes = await self.fs._cat_file(path, **self._read_kwargs)
        except FileNotFoundError:
            return None
        return data

    async def _read_many_async(self, paths: list[str]) -> list[bytes | None]:
        await self._before_reads()
        out: list[bytes | None] = [None] * len(paths)
        todo = iter(enumerate(paths))

        async def worker() -> None:
            for index, path in todo:  # shared: each path taken by one worker
                out[index] = await self._get(path)

        await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(paths)))))
        return out

    def read_iter(self, paths: Sequence[str]) -> Generator[bytes | None]:
        """Concurrent GETs (``concurrency`` in flight, at most :data:`READ_AHEAD` times that read
        ahead of the caller), handed over in order as they complete: a pipeline never drained
        between batches of requests, and never more than a window of bodies in memory."""
        blocking = self._blocking_get()
        if blocking is not None and len(paths) > 1:
            yield from _threaded_pipeline(blocking, list(paths), self._pool, self.concurrency)
            return
        if not _reads_async(self.fs) or len(paths) <= self.concurrency:
            yield from super().read_iter(paths)
            return
        yield from _ordered_pipeline(
            self.fs.loop, self._before_reads, self._get, list(paths), self.concurrency
        )

    async def _get_range(self, path: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of one object, ``None`` when it is missing (a hook: the store's own
        ranged GET)."""
        try:
            data: bytes = await self.fs._cat_file(path, start=start, end=end)
        except FileNotFoundError:
            return None
        return data

    def read_ranges(
        self, ranges: Sequence[tuple[str, int, int]], concurrency: int = 4
    ) -> Generator[bytes | None]:
        if not _reads_async(self.fs):
            for path, start, end in ranges:
                try:
                    yield self.fs.cat_file(path, start=start, end=end)
                except FileNotFoundError:
                    yield None
            return

        async def get(item: tuple[str, int, int]) -> bytes | None:
            return await self._get_range(*item)

        yield from _ordered_pipeline(self.fs.loop, self._before_reads, get, list(ranges), concurrency)

    def list_under(self, prefix: str) -> list[tuple[str, Entry]]:
        return self._entries(prefix.rstrip("/") + "/", None)

    def upload(self, path: str, local: str) -> None:
        self.fs.put_file(local, path)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def existing(self, paths: Sequence[str]) -> list[bool]:
        """One listing page from the first name, where the store lists from a name (``_page_from``)
        and the paths share a folder: the names that sort among them come back in one page, and
        what the page did not reach is asked one by one. Otherwise every path is read at once."""
        if len(paths) < 2:
            return [self.exists(path) for path in paths]  # one request (a HEAD where the store has one)
        if type(self)._page_from is ObjectStoreBackend._page_from:
            return [body is not None for body in self.read_many(paths)]  # at once, not one by one
        split = [self.fs.split_path(path)[:2] for path in paths]  # (bucket, key): stores that list by key
        keys = [key for _, key in split]
        folder = keys[0].rpartition("/")[0]
        if (
            not folder
            or any(b != split[0][0] or k.rpartition("/")[0] != folder for b, k in split)
            or (page := self._page_from(split[0][0], folder, min(keys), len(keys) + 8)) is None
        ):
            return [body is not None for body in self.read_many(paths)]  # at once, not one by one
        found, truncated = page
        reached = max(found, default="")
        if truncated and reached < max(keys):  # the page stopped short of the last
            return [
                key in found or (key > reached and self.exists(path))
                for key, path in zip(keys, paths, strict=True)
            ]
        return [key in found for key in keys]

    def _page_from(self, bucket: str, folder: str, first: str, limit: int) -> tuple[set[str], bool] | None:
        """A hook: the keys of one listing page of ``folder/`` from the key ``first`` (inclusive) on,
        at most ``limit``, and whether more follow; ``None`` where the store cannot list from a name.
        A subfolder's keys need not be listed (only ``folder/``'s own are asked for)."""
        return None

    def modified(self, paths: Sequence[str]) -> list[float | None]:
        out: list[float | None] = []
        for path in paths:  # open claims only: a handful
            try:
                out.append(mtime_of(self.fs.info(path)))
            except FileNotFoundError:
                out.append(None)
        return out

    def list_names(self, folders: Sequence[str]) -> list[dict[str, Named]]:
        if not folders:
            return []
        return self._list_names_of(list(folders))

    def _list_names_of(self, folders: list[str]) -> list[dict[str, Named]]:
        """One-level listings of these (non-empty list of) folders (a hook: one ``ls`` each)."""
        return [self._ls_names(folder) for folder in folders]

    def _ls_names(self, folder: str) -> dict[str, Named]:
        try:
            listed = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            return {}
        return named_entries(folder, listed)

    # ------------------------------------------------------------------ writing

    def append_line(self, path: str, line: bytes) -> None:
        raise OSError(errno.EOPNOTSUPP, f"{protocol_of(self.fs)} has no safe append; use the object layout")

    def store_url(self) -> str:
        return f"{protocol_of(self.fs)}://{self.root}"

    def endpoint(self) -> str:
        return protocol_of(self.fs)

    def create(self, path: str, data: bytes) -> None:
        self.require_put_if_absent()  # proven once per store and process; refused if not kept
        self.create_unproven(path, data)

    def create_unproven(self, path: str, data: bytes) -> None:
        """One conditional request (``pipe_file(mode="create")``), or under a lock in one process."""
        if self.capabilities.put_if_absent == "conditional-request":
            self.fs.pipe_file(path, data, mode="create")
            return
        self.refuse_unsafe_writes()
        with _memory_create_lock:  # process-local filesystems (memory): exclusive under one lock
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    def put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def remove(self, paths: Sequence[str]) -> None:
        if not paths:
            return
        try:
            self.fs.rm(list(paths))
        except FileNotFoundError:  # some were absent, and fsspec may then have removed none
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)


READ_AHEAD = 4
"""Windows of concurrent requests a pipelined read may run ahead of its consumer."""


def _ordered_pipeline(
    loop: asyncio.AbstractEventLoop,
    before: Callable[[], Awaitable[None]],
    get: Callable[[T], Awaitable[bytes | None]],
    paths: list[T],
    concurrency: int,
) -> Generator[bytes | None]:
    """``get`` of each path on ``loop`` (another thread's) by ``concurrency`` workers, yielded in
    order; a request starts only while fewer than ``READ_AHEAD * concurrency`` bodies wait for the
    consumer. Closing the generator early stops the requests not yet started."""
    answers: queue.SimpleQueue[tuple[int, bytes | None, BaseException | None]] = queue.SimpleQueue()
    window = READ_AHEAD * concurrency
    step = max(1, concurrency // 2)  # consumed bodies handed back as room at once: fewer wake-ups
    room: list[asyncio.Semaphore] = []

    async def produce() -> None:
        await before()
        ahead = asyncio.Semaphore(window)
        room.append(ahead)
        todo = iter(enumerate(paths))

        async def worker() -> None:
            for index, path in todo:  # shared: each path taken by one worker, in order
                await ahead.acquire()
                try:
                    answers.put((index, await get(path), None))
                except Exception as exc:  # handed to the consumer, raised there
                    answers.put((index, None, exc))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(paths)))))

    def give_back(count: int) -> None:
        for _ in range(count):
            room[0].release()

    producing = asyncio.run_coroutine_threadsafe(produce(), loop)
    waiting: dict[int, tuple[bytes | None, BaseException | None]] = {}
    taken = 0
    try:
        for want in range(len(paths)):
            while want not in waiting:
                try:
                    index, body, error = answers.get(timeout=1.0)
                except queue.Empty:
                    if producing.done():
                        producing.result()  # raises what stopped it
                    continue
                waiting[index] = (body, error)
            body, error = waiting.pop(want)
            taken += 1
            if taken == step:
                loop.call_soon_threadsafe(give_back, taken)
                taken = 0
            if error is not None:
                raise error
            yield body
    finally:
        producing.cancel()


def _threaded_pipeline(
    get: Callable[[T], bytes | None], paths: list[T], pool: ThreadPoolExecutor, concurrency: int
) -> Generator[bytes | None]:
    """``get`` of each path on ``pool``'s threads, yielded in order; a request is asked only while
    fewer than ``READ_AHEAD * concurrency`` bodies wait for the consumer. Closed early, it asks
    no more and waits for those in flight (their answers dropped)."""
    window = READ_AHEAD * concurrency
    todo = iter(paths)
    asked: deque[Future[bytes | None]] = deque(
        pool.submit(get, path) for path in itertools.islice(todo, window)
    )
    try:
        while asked:
            body = asked.popleft().result()  # a request's error raised in its place
            for path in itertools.islice(todo, 1):
                asked.append(pool.submit(get, path))
            yield body
    finally:
        for request in asked:
            request.cancel()
        futures_wait(asked)


class ProcessLocalBackend(ObjectStoreBackend):
    """A store that lives in one process (fsspec's ``memory://``): put-if-absent under a lock is
    atomic there, so it is writable (tests, one-process tools), though never shared by hosts."""

    capabilities = ONE_PROCESS
