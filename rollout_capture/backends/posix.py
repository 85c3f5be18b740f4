"""A capture root on a local POSIX disk.

It talks to the OS directly (flock, O_APPEND, link-based put-if-absent) because fsspec's
local layer offers neither locks nor exclusive creation. Probing a rollout costs a few
syscalls, so a batch is read rollout by rollout; one listing of the root's names replaces
the probes when the root is small enough for that to pay.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet

from rollout_capture.backends.base import Backend, Fetched, ListingScope, Named, RowLayout, nothing
from rollout_capture.claims import Claim
from rollout_capture.identity import validate_rollout_id
from rollout_capture.layout import (
    CLAIMS_SUFFIX,
    JSONL_SUFFIX,
    MARKER_SUFFIX,
    OBJECTS_SUFFIX,
    Entry,
    RolloutListing,
    claims_dir,
    group_entries,
    objects_dir,
)
from rollout_capture.rows import add_jsonl
from rollout_capture.snapshot import RolloutSnapshot, listed_paths, parse_snapshot

_ALL_SUFFIXES = (JSONL_SUFFIX, MARKER_SUFFIX, OBJECTS_SUFFIX, CLAIMS_SUFFIX)
# A name in a listing of the root costs a fraction of the access() probes a rollout needs.
_NAMES_PER_PROBE = 16
# With no size hint yet, a batch this large lists the root's names (and learns its size).
_LIST_NAMES_MIN_IDS = 32
# A listing is reused only if the root last changed this long before it was taken.
_SETTLED_NS = 2_000_000_000
_LIVE_FOLDERS_KEPT = 10_000
# Most captures fit in one read this size, which saves an fstat per file; larger ones are sized.
_FIRST_READ = 64 << 10


def _stat_entry(path: str) -> Entry | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Entry(path, st.st_size, st.st_mtime)


def _scan_names(folder: str) -> dict[str, Named]:
    """One folder's names via scandir: a stat per file, none per folder."""
    out = {}
    try:
        with os.scandir(folder) as it:
            for item in it:
                try:
                    if item.is_dir():
                        out[item.name] = Named(item.name, item.path, True)
                        continue
                    st = item.stat()
                except FileNotFoundError:  # removed while listed
                    continue
                out[item.name] = Named(item.name, item.path, False, st.st_size, st.st_mtime)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return out


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_whole(fd: int) -> bytes:
    """A file's bytes, read from its start: one read for a typical capture, and no fstat.

    A short read means EOF on a regular file; only a file filling the first read is sized,
    and read on until a short read (it may grow meanwhile).
    """
    data = os.read(fd, _FIRST_READ)
    if len(data) < _FIRST_READ:
        return data
    chunks = [data]
    want = max(os.fstat(fd).st_size - len(data), 0) + 1
    while True:
        chunk = os.read(fd, want)
        chunks.append(chunk)
        if len(chunk) < want:
            return b"".join(chunks)
        want = 1 << 20


def _read_locked(path: str) -> bytes | None:
    """A file's bytes, every line whole; None if absent.

    Each JSONL append is one line with its newline, written under an exclusive lock, so
    bytes ending in a newline hold only whole lines: read without the lock first, and take
    the shared lock only when a write may be in progress (they do not end in one).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        data = _read_whole(fd)
        if not data or data.endswith(b"\n"):
            return data
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.lseek(fd, 0, os.SEEK_SET)
        return _read_whole(fd)
    finally:
        os.close(fd)  # also releases the lock


class PosixBackend(Backend):
    """A capture root on a local POSIX disk."""

    default_layout: RowLayout = "jsonl"
    supports_append = True
    trust_mtime = False  # a local file's mtime is the writer's own clock
    writes_in_place = True
    folders_exist = True

    def __init__(self, root: str) -> None:
        self.root = root
        self._base = os.path.join(root, "")  # root with its separator, for fast concatenation
        self._names_hint: int | None = None  # how many names the root held when last listed
        self._names_cache: tuple[int, set[str]] | None = None  # (root mtime, its names)
        self._live_folders: set[str] = set()  # claims folders known to exist (saves a failed open)

    def path(self, name: str) -> str:
        return self._base + name

    # ------------------------------------------------------------------ reading

    def _scan(self, folder: str) -> Iterable[tuple[str, Entry]]:
        try:
            with os.scandir(self.path(folder)) as it:
                for item in it:
                    if item.is_file(follow_symlinks=False):
                        st = item.stat(follow_symlinks=False)
                        yield f"{folder}/{item.name}", Entry(item.path, st.st_size, st.st_mtime)
        except (FileNotFoundError, NotADirectoryError):
            return

    def _list_one(self, rollout_id: str) -> RolloutListing:
        listing = RolloutListing()
        listing.jsonl = _stat_entry(self.path(rollout_id + JSONL_SUFFIX))
        listing.marker = _stat_entry(self.path(rollout_id + MARKER_SUFFIX))
        grouped = group_entries(
            [*self._scan(objects_dir(rollout_id)), *self._scan(claims_dir(rollout_id))], {rollout_id}
        )
        found = grouped.get(rollout_id)
        if found is not None:
            listing.objects, listing.claims = found.objects, found.claims
        return listing

    def list_rollouts(self, rollout_ids: Collection[str]) -> dict[str, RolloutListing]:
        return {r: self._list_one(validate_rollout_id(r)) for r in rollout_ids}

    def fetch(self, rollout_ids: Collection[str], *, scope: ListingScope | None = None) -> Fetched:
        ids = {validate_rollout_id(r) for r in rollout_ids}
        names = None
        worth = (
            len(ids) >= _LIST_NAMES_MIN_IDS
            if self._names_hint is None
            else (self._names_hint <= _NAMES_PER_PROBE * len(ids))
        )
        if worth:
            names = self._names()
            self._names_hint = len(names)
        return PosixFetched(self, ids, names)

    def _names(self) -> set[str]:
        """The names directly under the root, without stat calls (cheap for a batch).

        Reused while the root's modification time is unchanged (entries added or removed
        change it), but only once that time is older than the clock's coarsest step: a
        listing taken in the same tick as a change could miss it.
        """
        try:
            changed = os.stat(self.root).st_mtime_ns
        except FileNotFoundError:
            return set()
        cached = self._names_cache
        if cached is not None and cached[0] == changed:
            return cached[1]
        listed_at = time.time_ns()
        try:
            names = set(os.listdir(self.root))
        except FileNotFoundError:
            return set()
        self._names_cache = (changed, names) if listed_at - changed >= _SETTLED_NS else None
        return names

    def _may_have_claims(self, rollout_id: str) -> bool:
        """Whether the rollout's claims folder exists (one syscall, no exception)."""
        return os.access(self._base + rollout_id + CLAIMS_SUFFIX, os.F_OK)

    def claims(self, rollout_ids: Collection[str]) -> dict[str, list[Claim]]:
        # One access() per id; only rollouts with a claims folder are listed.
        claimed = [r for r in rollout_ids if self._may_have_claims(validate_rollout_id(r))]
        return super().claims(claimed) if claimed else {}

    def snapshot(self, rollout_id: str, names: AbstractSet[str] | None = None) -> RolloutSnapshot:
        """One rollout with the fewest syscalls.

        ``names`` (a listing of the root) answers which parts exist; without it each absent
        part costs one ``access`` call. Rollouts with object rows or claims (rare on a local
        disk) are listed and parsed like any store's.
        """
        base = self._base + rollout_id
        jsonl = base + JSONL_SUFFIX
        if names is None:
            has_dirs = os.access(base + OBJECTS_SUFFIX, os.F_OK) or os.access(base + CLAIMS_SUFFIX, os.F_OK)
        else:
            has_dirs = rollout_id + OBJECTS_SUFFIX in names or rollout_id + CLAIMS_SUFFIX in names
        if has_dirs:
            listing = self._list_one(rollout_id)
            paths = listed_paths(listing)
            bodies = dict(zip(paths, self.read_many(paths), strict=True))
            return parse_snapshot(rollout_id, listing, bodies, trust_mtime=False)
        if names is None:
            has_marker = os.access(base + MARKER_SUFFIX, os.F_OK)
            data = _read_locked(jsonl)
        else:
            has_marker = rollout_id + MARKER_SUFFIX in names
            data = _read_locked(jsonl) if rollout_id + JSONL_SUFFIX in names else None
        snap = RolloutSnapshot(rollout_id, found=data is not None or has_marker, incomplete=has_marker)
        if data:
            add_jsonl(snap.parsed, data, jsonl)
        return snap

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        return [_read_locked(path) for path in paths]

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def root_found(self) -> bool:
        return os.path.isdir(self.root)

    def list_names(self, folders: Sequence[str]) -> list[dict[str, Named]]:
        return [_scan_names(folder) for folder in folders]

    # ------------------------------------------------------------------ writing

    def _open_append(self, path: str) -> int:
        try:
            return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the root is not there yet
            os.makedirs(self.root, exist_ok=True)
            return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @staticmethod
    def _write_all(fd: int, line: bytes) -> None:
        view = memoryview(line)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    def append_line(self, path: str, line: bytes) -> None:
        # The exclusive lock is held until the line is durable: a reader (shared lock) sees
        # whole lines only, and only once they are on disk.
        fd = self._open_append(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._write_all(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)  # also releases the lock

    def append_line_staged(self, path: str, line: bytes) -> tuple[Callable[[], None], Callable[[], None]]:
        # append_line's steps, split where they block: the line is written under the lock
        # now, fsynced by ``blocking``, and the lock let go by ``finish``. A file locked by
        # another writer or a reader makes the whole append the blocking step.
        fd = self._open_append(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return (lambda: self.append_line(path, line)), nothing
        except BaseException:
            os.close(fd)
            raise
        try:
            self._write_all(fd, line)
        except BaseException:
            os.close(fd)
            raise
        return (lambda: os.fsync(fd)), (lambda: os.close(fd))  # closing releases the lock

    def _write_temp(self, path: str, data: bytes) -> str:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        temp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return temp

    def create(self, path: str, data: bytes) -> None:
        # link() fails with EEXIST atomically and the file appears whole, never empty.
        temp = self._write_temp(path, data)
        try:
            os.link(temp, path)
        finally:
            os.unlink(temp)
        _fsync_dir(os.path.dirname(path))

    def put(self, path: str, data: bytes) -> None:
        temp = self._write_temp(path, data)
        os.replace(temp, path)

    def put_live(self, path: str, data: bytes) -> None:
        # One write of a fresh file, no fsync: a claim is for the living. A reader that catches
        # it empty still counts it (from its mtime), and the old temp-and-rename never fsynced
        # the folder either, so a crash could always lose a claim.
        folder = os.path.dirname(path)
        if folder not in self._live_folders:  # a new rollout: its claims folder first
            self._make_folder(folder)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # cleared meanwhile
            self._make_folder(folder)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _make_folder(self, folder: str) -> None:
        try:
            os.mkdir(folder)  # one syscall when the root is there, as it mostly is
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(folder, exist_ok=True)
        if len(self._live_folders) >= _LIVE_FOLDERS_KEPT:
            self._live_folders.clear()
        self._live_folders.add(folder)

    def remove(self, paths: Sequence[str]) -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def clear_rollouts(self, rollout_ids: Collection[str]) -> None:
        for rollout_id in rollout_ids:
            self.remove([self.path(rollout_id + JSONL_SUFFIX), self.path(rollout_id + MARKER_SUFFIX)])
            for folder in (objects_dir(rollout_id), claims_dir(rollout_id)):
                path = self.path(folder)
                if os.path.islink(path):
                    os.unlink(path)  # never follow a link out of the root
                elif os.path.isdir(path):
                    shutil.rmtree(path)


class PosixFetched(Fetched):
    """A batch on a local disk: optionally the root's names; files read rollout by rollout."""

    def __init__(self, backend: PosixBackend, ids: set[str], names: set[str] | None) -> None:
        self._backend = backend
        self._ids = ids
        self._names = names
        self._fresh: set[str] = set()  # rollouts refreshed since the names were listed

    def _names_for(self, rollout_id: str) -> set[str] | None:
        return None if self._names is None or rollout_id in self._fresh else self._names

    def found(self, rollout_id: str) -> bool:
        names = self._names_for(rollout_id)
        if names is None:
            return self._backend.list_rollouts([rollout_id])[rollout_id].found
        return any(rollout_id + suffix in names for suffix in _ALL_SUFFIXES)

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        if rollout_id not in self._ids:  # the batch's ids were validated when it was fetched
            validate_rollout_id(rollout_id)
        return self._backend.snapshot(rollout_id, self._names_for(rollout_id))

    def claims(self) -> dict[str, list[Claim]]:
        names = self._names
        return self._backend.claims(
            [r for r in self._ids if names is None or r in self._fresh or r + CLAIMS_SUFFIX in names]
        )

    def refresh(self, rollout_ids: Collection[str]) -> None:
        ids = {validate_rollout_id(r) for r in rollout_ids}
        self._ids |= ids
        self._fresh |= ids
