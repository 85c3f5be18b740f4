"""The storage seam: what a capture store needs from a filesystem, declared in one place.

Modelled on fsspec's ``AbstractFileSystem``: the store talks to this interface only, and
each backend owns its strategy (per-rollout probes on a local disk, one flat listing on
an object store), so no caller ever asks which backend it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_capture.claims import Claim
from rollout_capture.names import RolloutListing
from rollout_capture.snapshot import RolloutSnapshot, claims_of, listed_paths

if TYPE_CHECKING:
    import fsspec

    from rollout_capture.layouts import Layout


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

    journal_absent: bool = False
    """Whether the listing behind this batch covered the whole root and held no journal commit
    (then the journal need not be looked for: nothing of it was there when the batch was listed)."""

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


class Backend(ABC):
    """Byte-level access to one capture root; paths are full, as the filesystem names them."""

    root: str
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

    @abstractmethod
    def list_rollouts(self, rollout_ids: Collection[str]) -> dict[str, RolloutListing]:
        """What the root holds for each rollout, listed now (never from a cache)."""

    @abstractmethod
    def fetch(self, rollout_ids: Collection[str], *, scope: ListingScope | None = None) -> ReadBatch:
        """A batch ready to be read rollout by rollout; a ``scope``'s batches may share a listing."""

    def end_scope(self, key: str) -> None:  # noqa: B027 - nothing to forget unless a backend shares listings
        """Forget what was kept for the batches of a finished job."""

    def listed_rollout_ids(self, scope_key: str) -> set[str] | None:
        """The rollout ids under the root, from what is cheap here (orphan captures are counted
        from it): a listing the job's batches shared, or one look at a local folder; ``None``
        when no such listing exists, since listing again only for this costs a whole LIST."""
        return None

    @abstractmethod
    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        """The bytes of each path, ``None`` where it does not exist."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether the path exists."""

    def existing(self, paths: Sequence[str]) -> list[bool]:
        """Whether each of these files exists, in as few requests as the store allows (a journal
        writer asks for the few commit numbers above its own before each put)."""
        return [self.exists(path) for path in paths]

    def modified(self, paths: Sequence[str]) -> list[float | None]:
        """Each file's modification time (epoch s), ``None`` where unknown or missing; only asked
        where :attr:`trust_mtime` holds (the store's own clock judges claims there)."""
        return [None for _ in paths]

    def refuse_unsafe_writes(self) -> None:
        """Raise a ``ValueError`` naming what is missing unless several writers may share this store.

        A producer calls it when it opens the store, so an unsafe store is refused at startup
        rather than at its first row. A local disk (flock, link-based create) is always safe.
        """
        return None

    @abstractmethod
    def root_found(self) -> bool:
        """Whether the root is there at all: a folder on a disk, at least one key on a store.

        A mistyped capture dir would otherwise read as a run whose every rollout went
        uncaptured.
        """

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

    @abstractmethod
    def append_line(self, path: str, line: bytes) -> None:
        """Append one line durably, never interleaved with another writer's."""

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

    def put_live(self, path: str, data: bytes) -> None:
        """Write a new file that matters only while its writer lives (a claim, under a fresh
        name): it must be seen at once, not survive the machine. By default a :meth:`put`;
        replacing a file is not promised (a disk creates it exclusively)."""
        self.put(path, data)

    @abstractmethod
    def remove(self, paths: Sequence[str]) -> None:
        """Delete these files; absent ones are fine."""

    @abstractmethod
    def clear_rollouts(self, rollout_ids: Collection[str]) -> None:
        """Delete everything of these rollouts, or raise ``OSError`` when something survives."""
