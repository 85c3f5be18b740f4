"""The storage seam: what a capture store needs from a filesystem, declared in one place.

Modelled on fsspec's ``AbstractFileSystem``: the store talks to this interface only, and
each backend owns its strategy (per-rollout probes on a local disk, one flat listing on
an object store), so no caller ever asks which backend it holds. A backend must give the
byte operations (list, read, create-if-absent, put, remove) and its listing of a rollout;
everything else has a generic default built on them, which a backend overrides where it
knows a quicker way.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from rollout_capture.backends import proof
from rollout_capture.backends.capabilities import Capabilities
from rollout_capture.claims import Claim
from rollout_capture.identity import validate_rollout_id
from rollout_capture.names import Entry, RolloutListing, claims_dir, group_entries, objects_dir
from rollout_capture.snapshot import RolloutSnapshot, claims_of, listed_paths, parse_snapshot

if TYPE_CHECKING:
    import fsspec

    from rollout_capture.layouts import Layout


_CLEAR_ATTEMPTS = 3
_READ_ITER_STEP = 64  # files of one read_many in the default read_iter
_RELIST_ATTEMPTS = 4  # listings of a rollout whose claims keep vanishing as they are read


def nothing_to_finish() -> None:
    """The ``finish`` step of a staged write whose ``blocking`` step did it all."""


@dataclass(frozen=True, slots=True)
class Named:
    """One name directly under a folder: a file (with size and modification time) or a folder,
    or (local disks) a symbolic link, which is never followed: neither file nor folder."""

    name: str
    path: str
    folder: bool
    size: int | None = None
    mtime: float | None = None
    link: bool = False


@dataclass(frozen=True, slots=True)
class ListingScope:
    """A job (a flow run) whose batches may share one listing of a capture root.

    ``rollouts`` is about how many rollouts the job will look up in all, which decides
    whether one listing of the whole root is quicker than listing each of them.
    """

    key: str
    rollouts: int


class ReadBatch(ABC):
    """A batch of rollouts made ready to be read (listed, maybe read), parsed one rollout at a time."""

    journal_commits: Mapping[str, Sequence[int]] | None = None
    """The journal's commit numbers by stream (``rows``, ``claims``) that the listing behind this
    batch showed, when it covered the whole root, and under ``compacted`` its compacted
    generations with a manifest: the journal's reader reads those, and nothing past them; ``None``
    when no such listing was taken."""

    @property
    def journal_absent(self) -> bool:
        """Whether the listing behind this batch covered the whole root and held no journal commit
        (then the journal need not be looked for: nothing of it was there when the batch was listed)."""
        return self.journal_commits is not None and not any(self.journal_commits.values())

    @abstractmethod
    def found(self, rollout_id: str) -> bool:
        """Whether the store holds anything for the rollout (rows, objects, marker or claims)."""

    @abstractmethod
    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        """Everything the store holds for the rollout, parsed."""

    @abstractmethod
    def claims(self) -> dict[str, list[Claim]]:
        """The claims of each rollout of the batch that has any."""

    @abstractmethod
    def refresh(self, rollout_ids: Collection[str]) -> None:
        """Read these rollouts afresh from now on (rows may have landed since)."""


def _is_file(named: Named) -> bool:
    return not named.folder and not named.link


class Backend(ABC):
    """Byte-level access to one capture root; paths are full, as the filesystem names them."""

    root: str
    capabilities: ClassVar[Capabilities]
    """What the store can do (local or not, its put-if-absent, its listings): the class's to say."""
    conditional_request: ClassVar[str] = ""
    """The request creating only if absent, as a refusal names it (``PutObject with If-None-Match: *``)."""
    default_layout: Layout
    """The row layout writers use here unless told otherwise (``jsonl`` or ``objects``)."""
    supports_append: bool
    """Whether appending a line is safe (a JSONL capture can be written)."""
    trust_mtime: bool
    """Whether modification times come from the store's clock (object stores) rather than a writer's."""
    writes_in_place: bool = False
    """Whether small writes are page-cache work, quick enough for an event loop (a local disk);
    only their fsync blocks. Object stores go over the network: never on a loop."""
    folders_exist: bool = False
    """Whether a folder exists apart from what it holds (a disk), so a missing root is a mistyped
    path; under an object prefix a folder is there only once a key is, and none is fine."""

    @classmethod
    @abstractmethod
    def from_filesystem(cls, fs: fsspec.AbstractFileSystem, root: str, concurrency: int) -> Backend:
        """The backend for ``root`` on an opened filesystem: how the protocol table
        (:mod:`rollout_capture.backends.registry`) makes one, whichever class it picked."""

    @abstractmethod
    def path(self, name: str) -> str:
        """The full path of ``name`` relative to the root."""

    # ------------------------------------------------------------------ reading

    def list_rollouts(self, rollout_ids: Collection[str]) -> dict[str, RolloutListing]:
        """What the root holds for each rollout, listed now (never from a cache).

        By default one listing of the root's names, then one of each rollout folder it shows
        (a link is neither file nor folder: never listed into).
        """
        ids = [validate_rollout_id(r) for r in dict.fromkeys(rollout_ids)]
        if not ids:
            return {}
        top = self.list_names([self.root])[0]
        folders = [
            name
            for rollout_id in ids
            for name in (objects_dir(rollout_id), claims_dir(rollout_id))
            if (named := top.get(name)) is not None and named.folder
        ]
        entries = [(name, Entry(n.path, n.size, n.mtime)) for name, n in top.items() if _is_file(n)]
        for folder, below in zip(folders, self.list_names([self.path(f) for f in folders]), strict=True):
            entries += [
                (f"{folder}/{name}", Entry(n.path, n.size, n.mtime))
                for name, n in below.items()
                if _is_file(n)
            ]
        grouped = group_entries(entries, set(ids))
        return {rollout_id: grouped.get(rollout_id) or RolloutListing() for rollout_id in ids}

    def fetch(self, rollout_ids: Collection[str], *, scope: ListingScope | None = None) -> ReadBatch:
        """A batch ready to be read rollout by rollout; a ``scope``'s batches may share a listing.

        By default the rollouts are listed now and every listed file read at once (no listing shared).
        """
        batch = ListedReadBatch(self)
        batch.add(self.list_rollouts([validate_rollout_id(r) for r in dict.fromkeys(rollout_ids)]))
        return batch

    def end_scope(self, key: str) -> None:  # noqa: B027 - nothing to forget unless a backend shares listings
        """Forget what was kept for the batches of a finished job."""

    def journal_alone(self, scope: ListingScope) -> bool:
        """Whether the root holds journal commits and no rollout's own file, by the listing the
        job's batches share (taken now if none took it yet); False when that is not known."""
        return False

    def listed_rollout_ids(self, scope_key: str) -> set[str] | None:
        """The rollout ids under the root, from what is cheap here (orphan captures are counted
        from it): a listing the job's batches shared, or one look at a local folder; ``None``
        when no such listing exists, since listing again only for this costs a whole LIST."""
        return None

    @abstractmethod
    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        """The bytes of each path, ``None`` where it does not exist."""

    def read_iter(self, paths: Sequence[str]) -> Generator[bytes | None]:
        """The bytes of each path (``None`` where it does not exist), in order, as a stream: a long
        read handed over piece by piece, with only a window of it in memory. By default
        :meth:`read_many` of a few at a time; object stores keep their requests in flight."""
        step = _READ_ITER_STEP
        for start in range(0, len(paths), step):
            yield from self.read_many(paths[start : start + step])

    def read_ranges(
        self, ranges: Sequence[tuple[str, int, int]], concurrency: int = 4
    ) -> Generator[bytes | None]:
        """Bytes ``[start, end)`` of each ``(path, start, end)``, in order (``None`` where the file
        does not exist), as a stream: a large object (a compacted part) read in pieces, a few in
        flight, never whole in memory. By default each file read whole, then cut."""
        for path, start, end in ranges:
            data = self.read_many([path])[0]
            yield None if data is None else data[start:end]

    def list_under(self, prefix: str) -> list[tuple[str, Entry]]:
        """Every file whose name relative to the root starts with the folder ``prefix``, with its
        size and modification time (by default a listing of each folder, one level at a time)."""
        out: list[tuple[str, Entry]] = []
        todo = [prefix.rstrip("/")]
        while todo:
            folders, todo = todo, []
            for folder, names in zip(folders, self.list_names([self.path(f) for f in folders]), strict=True):
                for name, named in names.items():
                    if named.folder:
                        todo.append(f"{folder}/{name}")
                    elif not named.link:
                        out.append((f"{folder}/{name}", Entry(named.path, named.size, named.mtime)))
        return out

    def exists(self, path: str) -> bool:
        """Whether the file exists (by default: whether it can be read)."""
        return self.read_many([path])[0] is not None

    def existing(self, paths: Sequence[str]) -> list[bool]:
        """Whether each of these files exists, in as few requests as the store allows (a journal
        writer asks for the few commit numbers above its own before each put)."""
        return [self.exists(path) for path in paths]

    def modified(self, paths: Sequence[str]) -> list[float | None]:
        """Each file's modification time (epoch s), ``None`` where unknown or missing; only asked
        where :attr:`trust_mtime` holds (the store's own clock judges claims there)."""
        return [None for _ in paths]

    def refuse_unsafe_writes(self) -> None:
        """Raise :class:`~rollout_capture.backends.capabilities.UnsafeStoreError` naming what is missing
        unless the backend has a put-if-absent at all (no request made: a producer asks it first)."""
        if not self.capabilities.writable:
            raise proof.no_put_if_absent(self)

    def require_put_if_absent(self) -> None:
        """Return once this store is known to refuse a second create of one object, else raise
        ``UnsafeStoreError``: proven once per store and process where a server's condition could be
        ignored (:mod:`rollout_capture.backends.proof`). Every :meth:`create` asks it first."""
        proof.require_put_if_absent(self)

    def prove_put_if_absent(self, path: str) -> None:
        """Create ``path``, create it again (refused, or the store is), remove it: a producer's
        startup probe, proving the root writable and its put-if-absent kept at once."""
        proof.prove_put_if_absent(self, path)

    def create_unproven(self, path: str, data: bytes) -> None:
        """:meth:`create` without asking :meth:`require_put_if_absent` first (the proof's own creates)."""
        self.create(path, data)

    def store_url(self) -> str:
        """The root as a user names it (``s3://bucket/prefix``, or a local path)."""
        return self.root

    def endpoint(self) -> str:
        """Where the store's requests go, as an error names it (a URL, or this machine): scheme, host
        and path only, never a credential riding in a query or userinfo (an Azure SAS token)."""
        return "this machine"

    def store_key(self) -> Hashable:
        """What makes two roots one store (an endpoint and a bucket): proven once per process."""
        return (type(self).__name__, self.endpoint(), self.root.split("/", 1)[0])

    def root_found(self) -> bool:
        """Whether the root is there at all: a folder on a disk, at least one key on a store.

        A mistyped capture dir would otherwise read as a run whose every rollout went
        uncaptured. By default: whether the root lists any name (one delimited LIST, never a HEAD).
        """
        return bool(self.list_names([self.root])[0])

    @abstractmethod
    def list_names(self, folders: Sequence[str]) -> list[dict[str, Named]]:
        """The names directly under each folder (one level, never from a cache); ``{}`` if it is missing.

        Run folders are told apart by their top-level names alone, so this is one request
        per folder (per 1,000 names) on object stores, never a HEAD, with folders listed
        concurrently.
        """

    def claims(self, rollout_ids: Collection[str]) -> dict[str, list[Claim]]:
        """The claims of each rollout that has any, read now."""
        listings = {r: v for r, v in self.list_rollouts(rollout_ids).items() if v.claims}
        paths = [path for listing in listings.values() for path in listed_paths(listing, rows=False)]
        bodies = dict(zip(paths, self.read_many(paths), strict=True))
        return claims_of(listings, bodies, trust_mtime=self.trust_mtime)

    # ------------------------------------------------------------------ writing

    def append_line(self, path: str, line: bytes) -> None:
        """Append one line durably, never interleaved with another writer's (only where
        :attr:`supports_append`; by default refused: emulated appends lose rows)."""
        raise OSError(errno.EOPNOTSUPP, f"{self.root}: no safe append here; use the object layout")

    def append_line_staged(self, path: str, line: bytes) -> tuple[Callable[[], None], Callable[[], None]]:
        """Append one line in steps: the cheap part now, then ``(blocking, finish)``.

        ``blocking`` makes it durable (for a thread); ``finish`` (cheap, for the caller's
        loop) lets readers see it. By default everything happens in ``blocking``.
        """
        return (lambda: self.append_line(path, line)), nothing_to_finish

    @abstractmethod
    def create(self, path: str, data: bytes) -> None:
        """Write a new file whole; ``FileExistsError`` when it already exists (put-if-absent)."""

    @abstractmethod
    def put(self, path: str, data: bytes) -> None:
        """Write a file whole, replacing any earlier one."""

    def upload(self, path: str, local: str) -> None:
        """Write the local file ``local`` whole at ``path``, replacing any earlier one (a compacted
        part, under a name of its own). By default read into memory and :meth:`put`."""
        with open(local, "rb") as handle:
            self.put(path, handle.read())

    def put_live(self, path: str, data: bytes) -> None:
        """Write a new file that matters only while its writer lives (a claim, under a fresh
        name): it must be seen at once, not survive the machine. By default a :meth:`put`;
        replacing a file is not promised (a disk creates it exclusively)."""
        self.put(path, data)

    @abstractmethod
    def remove(self, paths: Sequence[str]) -> None:
        """Delete these files; absent ones are fine."""

    def clear_rollouts(self, rollout_ids: Collection[str]) -> None:
        """Delete everything of these rollouts, or raise ``OSError`` when something survives.

        By default what is listed is removed, and listed again after: bulk deletes can drop keys silently.
        """
        for _ in range(_CLEAR_ATTEMPTS):
            leftover = [p for listing in self.list_rollouts(rollout_ids).values() for p in listing.paths()]
            if not leftover:
                return
            self.remove(leftover)
        leftover = [p for listing in self.list_rollouts(rollout_ids).values() for p in listing.paths()]
        if leftover:
            survived = f"{len(leftover)} capture file(s) survived deletion: {leftover[:3]}"
            raise OSError(errno.EIO, f"{self.root}: {survived}")


class ListedReadBatch(ReadBatch):
    """A batch listed, then read as bytes in one pass (concurrent where the backend reads so);
    parsed one rollout at a time. What :meth:`Backend.fetch` gives unless a backend does better."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._listings: dict[str, RolloutListing] = {}
        self._bodies: dict[str, bytes | None] = {}
        self.journal_only = False
        """Whether the whole-root listing behind it held no rollout's file at all (the journal, if
        anything): the root is written in the journal, so listing a rollout again would find nothing."""

    def add(self, listings: dict[str, RolloutListing]) -> None:
        """Read the files of these listings (replacing what was known of their rollouts).

        A listed claim gone by the time it is read was released after the listing, so its
        row landed after it too: those rollouts are listed and read again, until no claim
        vanishes (a listing shared by a whole job is minutes old by its last batch).
        """
        for _ in range(_RELIST_ATTEMPTS):
            paths = [path for listing in listings.values() for path in listed_paths(listing)]
            self._bodies.update(zip(paths, self._backend.read_many(paths), strict=True))
            self._listings.update(listings)
            released = [
                rollout_id
                for rollout_id, listing in listings.items()
                if any(self._bodies.get(entry.path) is None for _, entry in listing.claims)
            ]
            if not released:
                return
            listings = self._backend.list_rollouts(released)

    def found(self, rollout_id: str) -> bool:
        listing = self._listings.get(rollout_id)
        return listing is not None and listing.found

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        listing = self._listings.get(rollout_id) or RolloutListing()
        return parse_snapshot(rollout_id, listing, self._bodies, trust_mtime=self._backend.trust_mtime)

    def claims(self) -> dict[str, list[Claim]]:
        return claims_of(self._listings, self._bodies, trust_mtime=self._backend.trust_mtime)

    def refresh(self, rollout_ids: Collection[str]) -> None:
        if not self.journal_only:
            self.add(self._backend.list_rollouts(rollout_ids))
