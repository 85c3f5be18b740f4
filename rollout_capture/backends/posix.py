"""A capture root on a local POSIX disk.

It talks to the OS directly (flock, O_APPEND, link-based put-if-absent; the opens, locked
appends and reads in :mod:`.posix_files`) because fsspec's local layer offers neither locks nor
exclusive creation. Probing a rollout costs a few
syscalls, so a batch is read rollout by rollout; one listing of the root's names replaces
the probes when the root is small enough for that to pay.

Nothing outside the root is read or written through a symbolic link: every entry inside
the root is opened without following one (``O_NOFOLLOW``, folders through their own fds),
so a planted link is refused when written and reported as damage when read. The root
itself may be a link; that is the user's choice.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Collection, Generator, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from rollout_capture.backends.base import Backend, ListingScope, Named, ReadBatch, nothing_to_finish
from rollout_capture.backends.capabilities import LOCAL_DISK
from rollout_capture.backends.posix_files import (
    APPEND_FLAGS,
    FOLDER_FLAGS,
    LINK_REASON,
    NEW_FLAGS,
    READ_FLAGS,
    LinkedEntryError,
    NoFollowRoot,
    append_locked,
    fsync_or_cut,
    is_link,
    link_refusal,
    read_locked,
    scan_names,
    write_all,
)
from rollout_capture.claims import Claim
from rollout_capture.claims_log import ClaimsLogReader
from rollout_capture.identity import validate_rollout_id
from rollout_capture.names import (
    CLAIMS_LOG_DIR,
    CLAIMS_SUFFIX,
    JSONL_SUFFIX,
    MARKER_SUFFIX,
    OBJECTS_SUFFIX,
    Entry,
    Refused,
    RolloutListing,
    capture_ids_from_root_entries,
    claims_dir,
    group_entries,
    objects_dir,
    parse_capture_name,
)
from rollout_capture.rows import Damage, add_jsonl
from rollout_capture.snapshot import RolloutSnapshot, claims_of, listed_paths, parse_snapshot

if TYPE_CHECKING:
    import fsspec

    from rollout_capture.layouts import Layout

_ALL_SUFFIXES = (JSONL_SUFFIX, MARKER_SUFFIX, OBJECTS_SUFFIX, CLAIMS_SUFFIX)
# A name in a listing of the root costs a fraction of the access() probes a rollout needs.
_NAMES_PER_PROBE = 16
# With no size hint yet, a batch this large lists the root's names (and learns its size).
_LIST_NAMES_MIN_IDS = 32
# A listing is reused only if the root last changed this long before it was taken.
_SETTLED_NS = 2_000_000_000


class PosixBackend(NoFollowRoot, Backend):
    """A capture root on a local POSIX disk."""

    default_layout: Layout = "jsonl"
    supports_append = True
    trust_mtime = False  # a local file's mtime is the writer's own clock
    writes_in_place = True
    folders_exist = True
    capabilities = LOCAL_DISK  # link-based create: the OS keeps put-if-absent

    def __init__(self, root: str) -> None:
        self.root = root
        self._base = os.path.join(root, "")  # root with its separator, for fast concatenation
        self._names_hint: int | None = None  # how many names the root held when last listed
        self._names_cache: tuple[int, set[str]] | None = None  # (root mtime, its names)
        # The producers' claims logs, read incrementally. Writing one is the layout's business
        # (rollout_capture.layouts); reading stays here, merged into each rollout's listing and
        # snapshot in the same pass (claims first, then rows), which a second reader would split.
        self.claims_log = ClaimsLogReader(root)

    def _logged(self, listing: RolloutListing, rollout_id: str) -> RolloutListing:
        """The listing with the rollout's open claims in the claims logs, as last read."""
        listing.logged_claims = self.claims_log.claims([rollout_id]).get(rollout_id, [])
        return listing

    @classmethod
    def from_filesystem(cls, fs: fsspec.AbstractFileSystem, root: str, concurrency: int) -> PosixBackend:
        return cls(root)  # the OS directly: fsspec's local layer has no locks nor exclusive creates

    def path(self, name: str) -> str:
        return self._base + name

    # ------------------------------------------------------------------ reading

    def _entry(self, path: str, listing: RolloutListing) -> Entry | None:
        """A file directly under the root, by ``lstat``: a link is refused, never followed."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(st.st_mode):
            listing.refused.append(Refused(path, LINK_REASON))
            return None
        return Entry(path, st.st_size, st.st_mtime)

    def _scan(self, rollout_id: str, folder: str, listing: RolloutListing) -> list[tuple[str, Entry]]:
        """The files of a rollout's folder; a linked folder, or a link in it, is refused, not read."""
        path = self.path(folder)
        try:
            fd = os.open(path, FOLDER_FLAGS)
        except FileNotFoundError:
            return []
        except OSError as exc:
            if is_link(path):
                listing.refused.append(Refused(path, LINK_REASON))
            elif exc.errno != errno.ENOTDIR:  # a file where the folder belongs holds no rows
                raise
            return []
        out = []
        try:
            with os.scandir(fd) as it:
                for item in it:
                    try:
                        regular = item.is_file(follow_symlinks=False)
                        st = item.stat(follow_symlinks=False) if regular else None
                    except FileNotFoundError:  # removed while listed
                        continue
                    relative = f"{folder}/{item.name}"
                    if st is not None:
                        out.append((relative, Entry(f"{path}/{item.name}", st.st_size, st.st_mtime)))
                        continue
                    name = parse_capture_name(relative)
                    if item.is_symlink() and name is not None and name.rollout_id == rollout_id:
                        listing.refused.append(Refused(f"{path}/{item.name}", LINK_REASON))
        finally:
            os.close(fd)
        return out

    def _list_one(self, rollout_id: str) -> RolloutListing:
        listing = RolloutListing()
        listing.jsonl = self._entry(self.path(rollout_id + JSONL_SUFFIX), listing)
        try:  # a marker is never read, only seen: whatever holds its name says "incomplete"
            st = os.lstat(self.path(rollout_id + MARKER_SUFFIX))
            listing.marker = Entry(self.path(rollout_id + MARKER_SUFFIX), st.st_size, st.st_mtime)
        except (FileNotFoundError, NotADirectoryError):
            pass
        grouped = group_entries(
            [
                *self._scan(rollout_id, objects_dir(rollout_id), listing),
                *self._scan(rollout_id, claims_dir(rollout_id), listing),
            ],
            {rollout_id},
        )
        found = grouped.get(rollout_id)
        if found is not None:
            listing.objects, listing.claims = found.objects, found.claims
        return self._logged(listing, rollout_id)

    def list_rollouts(self, rollout_ids: Collection[str]) -> dict[str, RolloutListing]:
        ids = [validate_rollout_id(r) for r in rollout_ids]
        self.claims_log.refresh()  # logs first, then the rows' files: a released claim's row is there
        return {r: self._list_one(r) for r in ids}

    def fetch(self, rollout_ids: Collection[str], *, scope: ListingScope | None = None) -> ReadBatch:
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
        else:  # too many names to list for a batch; but a listing taken before may still hold
            names = self._listed_before()
        if names is None or CLAIMS_LOG_DIR in names:
            self.claims_log.refresh()  # before any row is read (claims first, as listings do)
        else:
            self.claims_log.forget()  # no log when the root was listed
        return PosixReadBatch(self, ids, names)

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

    def _listed_before(self) -> set[str] | None:
        """The listing an earlier batch took, while the root is unchanged since (one ``stat``):
        it answers every existence check of a batch for free. None without one."""
        cached = self._names_cache
        if cached is None:
            return None
        try:
            changed = os.stat(self.root).st_mtime_ns
        except FileNotFoundError:
            return None
        return cached[1] if cached[0] == changed else None

    def _may_have_claims(self, rollout_id: str) -> bool:
        """Whether the rollout's claims folder exists (one syscall, no exception)."""
        return os.access(self._base + rollout_id + CLAIMS_SUFFIX, os.F_OK)

    def claims(self, rollout_ids: Collection[str]) -> dict[str, list[Claim]]:
        # The logs read now; then one access() per id, and only rollouts with a claims folder listed.
        ids = [validate_rollout_id(r) for r in rollout_ids]
        return self.claims_read(ids, refresh=True)

    def claims_read(
        self, ids: Collection[str], *, refresh: bool, with_folder: set[str] | None = None
    ) -> dict[str, list[Claim]]:
        """The claims of these (validated) rollouts: files listed now, logs read now if ``refresh``;
        ``with_folder`` gets the ids whose claims folder exists (a snapshot need not look again)."""
        if refresh:
            self.claims_log.refresh()
        logged = self.claims_log.claims(ids)
        claimed = [r for r in ids if self._may_have_claims(r)]
        if with_folder is not None:
            with_folder.update(claimed)
        out: dict[str, list[Claim]] = {}
        if claimed:
            listings = {r: v for r in claimed if (v := self._list_one(r)).claims}
            paths = [path for listing in listings.values() for path in listed_paths(listing, rows=False)]
            out = claims_of(listings, dict(zip(paths, self.read_many(paths), strict=True)), trust_mtime=False)
        for rollout_id, held in logged.items():
            out[rollout_id] = [*out.get(rollout_id, []), *held]
        return out

    def snapshot(
        self, rollout_id: str, names: AbstractSet[str] | None = None, *, claims_folder: bool | None = None
    ) -> RolloutSnapshot:
        """One rollout with the fewest syscalls.

        ``names`` (a listing of the root) answers which parts exist; without it each absent
        part costs one ``access`` call (never following a link), but for the claims folder when
        ``claims_folder`` says already whether it exists (the batch's claims were just read).
        Rollouts with object rows or claims (rare on a local disk) are listed and parsed like
        any store's. An entry that is a link is never read: it counts as one damaged row
        (naming it), after the others.
        """
        base = self._base + rollout_id
        jsonl = base + JSONL_SUFFIX
        if names is None:
            has_dirs = os.access(base + OBJECTS_SUFFIX, os.F_OK, follow_symlinks=False) or (
                claims_folder
                if claims_folder is not None
                else os.access(base + CLAIMS_SUFFIX, os.F_OK, follow_symlinks=False)
            )
        else:
            has_dirs = rollout_id + OBJECTS_SUFFIX in names or rollout_id + CLAIMS_SUFFIX in names
        if has_dirs:
            listing = self._list_one(rollout_id)
            paths = listed_paths(listing)
            bodies = dict(zip(paths, [self._read_listed(path, listing) for path in paths], strict=True))
            snap = parse_snapshot(rollout_id, listing, bodies, trust_mtime=False)
            snap.claims.extend(listing.logged_claims)
            for entry in listing.refused:
                snap.parsed.add_damage(Damage(entry.path, None, entry.reason))
            return snap
        data: bytes | None = None
        refused: str | None = None
        if names is None:
            has_marker = os.access(base + MARKER_SUFFIX, os.F_OK, follow_symlinks=False)
            data, refused = self._read_or_refuse(jsonl)
        else:
            has_marker = rollout_id + MARKER_SUFFIX in names
            if rollout_id + JSONL_SUFFIX in names:
                try:  # directly under the root: one no-follow open (what _open does, unwrapped)
                    fd = os.open(jsonl, READ_FLAGS)
                except (FileNotFoundError, NotADirectoryError):
                    pass
                except OSError:  # a link, say: the full way names it
                    data, refused = self._read_or_refuse(jsonl)
                else:
                    data = read_locked(fd)
        logged = self.claims_log.claims([rollout_id]).get(rollout_id, [])  # as read when fetched
        snap = RolloutSnapshot(
            rollout_id,
            found=data is not None or has_marker or refused is not None or bool(logged),
            incomplete=has_marker,
            claims=logged,
        )
        if data:
            add_jsonl(snap.parsed, data, jsonl)
        if refused is not None:
            snap.parsed.add_damage(Damage(jsonl, None, refused))
        return snap

    def _read_or_refuse(self, path: str) -> tuple[bytes | None, str | None]:
        """``(bytes or None if absent, None)``, or ``(None, why it is not read)`` for a link."""
        try:
            return self._read(path), None
        except LinkedEntryError:
            return None, LINK_REASON

    def _read_listed(self, path: str, listing: RolloutListing) -> bytes | None:
        """A listed file's bytes; one swapped for a link since it was listed joins the refused."""
        data, refused = self._read_or_refuse(path)
        if refused is not None:
            listing.refused.append(Refused(path, refused))
        return data

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        return [self._read(path) for path in paths]

    def read_ranges(
        self, ranges: Sequence[tuple[str, int, int]], concurrency: int = 4
    ) -> Generator[bytes | None]:
        # Parts never change once written: read in place, no lock, never through a link.
        for path, start, end in ranges:
            try:
                fd = self._open(path, READ_FLAGS)
            except (FileNotFoundError, NotADirectoryError, LinkedEntryError):
                yield None
                continue
            try:
                yield os.pread(fd, max(0, end - start), start)
            finally:
                os.close(fd)

    def exists(self, path: str) -> bool:
        if "/" not in self._relative(path):
            return os.path.lexists(path)
        try:
            dir_fd, name = self._parent(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        finally:
            os.close(dir_fd)
        return True

    def listed_rollout_ids(self, scope_key: str) -> set[str] | None:
        try:  # one look at the root's top level, no stat calls: cheap on a disk
            with os.scandir(self.root) as entries:
                found = capture_ids_from_root_entries(entry.name for entry in entries)
        except FileNotFoundError:
            return set()
        self.claims_log.refresh()
        return found | self.claims_log.rollout_ids()

    def root_found(self) -> bool:
        return os.path.isdir(self.root)

    def list_names(self, folders: Sequence[str]) -> list[dict[str, Named]]:
        # The root is followed (the user chose it); a folder below it is not (LinkedEntryError).
        out: list[dict[str, Named]] = []
        for folder in folders:
            top = folder.rstrip("/") == self.root.rstrip("/")
            try:
                fd = self._open_root(False) if top else self._folder_fd(folder)
            except (FileNotFoundError, NotADirectoryError):
                out.append({})
                continue
            try:
                out.append(scan_names(fd, folder))
            finally:
                os.close(fd)
        return out

    # ------------------------------------------------------------------ writing

    def _open_append(self, path: str) -> int:
        try:
            return self._open(path, APPEND_FLAGS)
        except FileNotFoundError:  # the root is not there yet
            os.makedirs(self.root, exist_ok=True)
            return self._open(path, APPEND_FLAGS)

    def append_line(self, path: str, line: bytes) -> None:
        # The exclusive lock is held until the line is durable: a reader (shared lock) sees
        # whole lines only, and only once they are on disk. A failed append is taken back.
        fd = self._open_append(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fsync_or_cut(fd, append_locked(fd, line))
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
            return (lambda: self.append_line(path, line)), nothing_to_finish
        except BaseException:
            os.close(fd)
            raise
        try:
            end = append_locked(fd, line)
        except BaseException:
            os.close(fd)
            raise
        return (lambda: fsync_or_cut(fd, end)), (lambda: os.close(fd))  # closing releases the lock

    def _write_temp(self, path: str, data: bytes) -> tuple[int, str, str]:
        """``data`` written durably to a fresh temp file beside ``path``: ``(folder fd, temp, name)``.

        The temp file is removed again if anything fails; the caller closes the fd.
        """
        dir_fd, name = self._parent(path, create=True)
        temp = f".tmp-{uuid.uuid4().hex}"
        try:
            fd = os.open(temp, NEW_FLAGS, 0o644, dir_fd=dir_fd)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            os.close(dir_fd)
            raise
        return dir_fd, temp, name

    def create(self, path: str, data: bytes) -> None:
        # link() fails with EEXIST atomically (a link planted there too) and the file appears
        # whole, never empty.
        dir_fd, temp, name = self._write_temp(path, data)
        try:
            try:
                os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            finally:
                os.unlink(temp, dir_fd=dir_fd)
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def put(self, path: str, data: bytes) -> None:
        # rename() replaces whatever held the name, a link included, and never follows it.
        dir_fd, temp, name = self._write_temp(path, data)
        try:
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        finally:
            os.close(dir_fd)

    def put_live(self, path: str, data: bytes) -> None:
        # One write of a fresh file, no fsync: a claim is for the living. A reader that catches
        # it empty still counts it (from its mtime), and the old temp-and-rename never fsynced
        # the folder either, so a crash could always lose a claim. A claim whose write failed
        # (a full disk) is removed at once: left empty, it would hold enrichment for its TTL.
        for attempt in range(3):
            dir_fd, name = self._parent(path, create=True)
            try:
                fd = os.open(name, NEW_FLAGS, 0o644, dir_fd=dir_fd)
                try:
                    write_all(fd, data)
                except BaseException:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dir_fd)
                    raise
                os.close(fd)
                return
            except FileNotFoundError as exc:
                # The claims folder was removed (its last claim released) after we opened it:
                # open it afresh, made again, rather than lose the claim.
                if attempt == 2:
                    raise link_refusal(exc, path, name, dir_fd) from None
            except OSError as exc:
                raise link_refusal(exc, path, name, dir_fd) from None
            finally:
                os.close(dir_fd)

    def _remove_empty_claims_folder(self, path: str) -> None:
        """Remove a claims folder once its last claim is gone (left alone while any remains).

        ``rmdir`` removes only an empty folder and never follows a link; a writer that had
        the folder open meanwhile makes it again (see :meth:`put_live`).
        """
        head = self._relative(path).rpartition("/")[0]
        if "/" in head or not head.endswith(CLAIMS_SUFFIX):
            return
        try:
            root_fd = self._open_root(False)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):  # not empty, gone, or not a folder: leave it
                os.rmdir(head, dir_fd=root_fd)
        finally:
            os.close(root_fd)

    def remove(self, paths: Sequence[str]) -> None:
        for path in paths:
            if "/" not in self._relative(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # removes a link itself, never what it points to
                continue
            try:
                dir_fd, name = self._parent(path)
            except (FileNotFoundError, NotADirectoryError):
                continue  # its folder is gone: so is the file
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            self._remove_empty_claims_folder(path)

    def clear_rollouts(self, rollout_ids: Collection[str]) -> None:
        for rollout_id in rollout_ids:
            self.remove([self.path(rollout_id + JSONL_SUFFIX), self.path(rollout_id + MARKER_SUFFIX)])
            for folder in (objects_dir(rollout_id), claims_dir(rollout_id)):
                path = self.path(folder)
                if os.path.islink(path):
                    os.unlink(path)  # never follow a link out of the root
                elif os.path.isdir(path):
                    shutil.rmtree(path)  # fd-based: a link met inside is removed, not followed
        self.claims_log.clear(rollout_ids)


class PosixReadBatch(ReadBatch):
    """A batch on a local disk: optionally the root's names; files read rollout by rollout."""

    def __init__(self, backend: PosixBackend, ids: set[str], names: set[str] | None) -> None:
        self._backend = backend
        self._ids = ids
        self._names = names
        self._fresh: set[str] = set()  # rollouts refreshed since the names were listed
        self._probed: set[str] = set()  # ids whose claims folder was looked for (no names)
        self._with_claims: set[str] = set()  # of those, the ones that have it

    def _names_for(self, rollout_id: str) -> set[str] | None:
        return None if self._names is None or rollout_id in self._fresh else self._names

    def found(self, rollout_id: str) -> bool:
        names = self._names_for(rollout_id)
        if names is None:
            return self._backend._list_one(validate_rollout_id(rollout_id)).found
        return any(rollout_id + suffix in names for suffix in _ALL_SUFFIXES) or (
            self._backend.claims_log.holds(rollout_id)
        )

    def snapshot(self, rollout_id: str) -> RolloutSnapshot:
        if rollout_id not in self._ids:  # the batch's ids were validated when it was fetched
            validate_rollout_id(rollout_id)
        names = self._names_for(rollout_id)
        if names is None and rollout_id in self._probed:  # claims() just looked for its folder
            return self._backend.snapshot(rollout_id, None, claims_folder=rollout_id in self._with_claims)
        return self._backend.snapshot(rollout_id, names)

    def claims(self) -> dict[str, list[Claim]]:
        names = self._names
        backend = self._backend
        backend.claims_log.refresh()
        logged = backend.claims_log.rollout_ids()
        fresh = self._fresh
        probed = [
            r for r in self._ids if names is None or r in fresh or r + CLAIMS_SUFFIX in names or r in logged
        ]
        with_claims: set[str] = set()
        found = backend.claims_read(probed, refresh=False, with_folder=with_claims)
        self._probed, self._with_claims = set(probed), with_claims
        return found

    def refresh(self, rollout_ids: Collection[str]) -> None:
        ids = {validate_rollout_id(r) for r in rollout_ids}
        self._ids |= ids
        self._fresh |= ids
        self._probed -= ids  # their claims may have gone (and their folder with them) meanwhile
        self._backend.claims_log.refresh()
