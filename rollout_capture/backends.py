"""Byte-level I/O on a capture root: one POSIX backend, one for any fsspec filesystem.

The POSIX backend talks to the OS directly (flock, O_APPEND, link-based put-if-absent)
because fsspec's local layer offers neither locks nor exclusive creation; the fsspec
backend lists with one flat, prefixed listing and reads concurrently on async stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import inspect
import os
import shutil
import threading
import uuid
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime
from typing import Any, Protocol

import fsspec
from fsspec.asyn import sync as fsspec_sync

from rollout_capture.filesystem import DEFAULT_READ_CONCURRENCY, is_s3, join, protocol_of
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


class Backend(Protocol):
    """What the store needs from a filesystem; paths are full, as the filesystem names them."""

    root: str
    trust_mtime: bool
    """Whether modification times come from the store's clock (object stores)."""

    def path(self, name: str) -> str: ...
    def list_rollout(self, rollout_id: str) -> RolloutListing: ...
    def read_many(self, paths: Sequence[str]) -> list[bytes | None]: ...
    def append_line(self, path: str, line: bytes) -> None: ...
    def create(self, path: str, data: bytes) -> None: ...
    def put(self, path: str, data: bytes) -> None: ...
    def exists(self, path: str) -> bool: ...
    def remove(self, paths: Sequence[str]) -> None: ...


# ---------------------------------------------------------------------------- POSIX


def _stat_entry(path: str) -> Entry | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Entry(path, st.st_size, st.st_mtime)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_locked(path: str) -> bytes | None:
    """A file's bytes under a shared lock (JSONL writers hold the exclusive one); None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)  # one byte more than expected: a short read means EOF
        if len(data) <= size:
            return data
        chunks = [data]
        while chunks[-1]:  # the file grew since fstat; read to the end
            chunks.append(os.read(fd, 1 << 20))
        return b"".join(chunks)
    finally:
        os.close(fd)  # also releases the lock


class LocalBackend:
    """A capture root on a local POSIX disk."""

    trust_mtime = False

    def __init__(self, root: str) -> None:
        self.root = root
        self._base = os.path.join(root, "")  # root with its separator, for fast concatenation

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _scan(self, folder: str) -> Iterable[tuple[str, Entry]]:
        try:
            with os.scandir(self.path(folder)) as it:
                for item in it:
                    if item.is_file(follow_symlinks=False):
                        st = item.stat(follow_symlinks=False)
                        yield f"{folder}/{item.name}", Entry(item.path, st.st_size, st.st_mtime)
        except (FileNotFoundError, NotADirectoryError):
            return

    def list_rollout(self, rollout_id: str) -> RolloutListing:
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

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        return [_read_locked(path) for path in paths]

    def may_have_claims(self, rollout_id: str) -> bool:
        """Whether the rollout's claims folder exists (one syscall, no exception)."""
        return os.access(self._base + rollout_id + CLAIMS_SUFFIX, os.F_OK)

    def names(self) -> set[str]:
        """The names directly under the root, without stat calls (cheap for a batch)."""
        try:
            return set(os.listdir(self.root))
        except FileNotFoundError:
            return set()

    def snapshot(self, rollout_id: str, names: AbstractSet[str] | None = None) -> RolloutSnapshot:
        """One rollout with the fewest syscalls.

        ``names`` (from :meth:`names`) answers which parts exist; without it each absent
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
            listing = self.list_rollout(rollout_id)
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

    def append_line(self, path: str, line: bytes) -> None:
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                view = memoryview(line)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

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
        # link() fails with EEXIST atomically and the object appears whole, never empty.
        temp = self._write_temp(path, data)
        try:
            os.link(temp, path)
        finally:
            os.unlink(temp)
        _fsync_dir(os.path.dirname(path))

    def put(self, path: str, data: bytes) -> None:
        temp = self._write_temp(path, data)
        os.replace(temp, path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def remove(self, paths: Sequence[str]) -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def clear_rollout(self, rollout_id: str) -> None:
        """Remove the rollout's files and folders (object rows, claims) outright."""
        self.remove([self.path(rollout_id + JSONL_SUFFIX), self.path(rollout_id + MARKER_SUFFIX)])
        for folder in (objects_dir(rollout_id), claims_dir(rollout_id)):
            path = self.path(folder)
            if os.path.islink(path):
                os.unlink(path)  # never follow a link out of the root
            elif os.path.isdir(path):
                shutil.rmtree(path)


# ---------------------------------------------------------------------------- fsspec


def _mtime(info: dict[str, Any]) -> float | None:
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


_memory_create_lock = threading.Lock()


class FsspecBackend:
    """A capture root on any fsspec filesystem (S3, GCS, memory...)."""

    trust_mtime = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, concurrency: int = DEFAULT_READ_CONCURRENCY):
        self.fs = fs
        self.root = root
        self.concurrency = concurrency
        self._s3 = is_s3(fs)
        finder = getattr(type(fs), "_find", None) or type(fs).find
        self._find_takes_prefix = "prefix" in inspect.signature(finder).parameters
        self._read_kwargs: dict[str, Any] = {"max_concurrency": 1} if self._s3 else {}
        self._atomic_create = self._s3 or protocol_of(fs) in {"gs", "gcs"}

    def path(self, name: str) -> str:
        return join(self.root, name)

    def _find(self, prefix: str) -> list[tuple[str, Entry]]:
        kwargs: dict[str, Any] = {"detail": True}
        if self._find_takes_prefix:
            kwargs["prefix"] = prefix
        try:
            found = self.fs.find(self.root, **kwargs)
        except FileNotFoundError:
            return []
        start = len(self.root) + 1
        out = []
        for name, info in found.items():
            if info.get("type") == "directory" or not name.startswith(self.root + "/"):
                continue
            relative = name[start:]
            if relative.startswith(prefix):
                out.append((relative, Entry(name, info.get("size"), _mtime(info))))
        return out

    def list_rollout(self, rollout_id: str) -> RolloutListing:
        grouped = group_entries(self._find(objects_dir(rollout_id)), {rollout_id})
        return grouped.get(rollout_id) or RolloutListing()

    def list_all(self, wanted: set[str] | None = None) -> dict[str, RolloutListing]:
        """Every rollout under the root, from one flat listing (1 LIST per 1,000 keys)."""
        return group_entries(self._find(""), wanted)

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        if not paths:
            return []
        if getattr(self.fs, "async_impl", False):
            result: list[bytes | None] = fsspec_sync(self.fs.loop, self._read_many_async, list(paths))
            return result
        out: list[bytes | None] = []
        for path in paths:
            try:
                out.append(self.fs.cat_file(path, **self._read_kwargs))
            except FileNotFoundError:
                out.append(None)
        return out

    async def _read_many_async(self, paths: list[str]) -> list[bytes | None]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(path: str) -> bytes | None:
            async with gate:
                try:
                    data: bytes = await self.fs._cat_file(path, **self._read_kwargs)
                except FileNotFoundError:
                    return None
                return data

        return list(await asyncio.gather(*(one(p) for p in paths)))

    def append_line(self, path: str, line: bytes) -> None:
        raise OSError(errno.EOPNOTSUPP, f"{protocol_of(self.fs)} has no safe append; use the object layout")

    def create(self, path: str, data: bytes) -> None:
        if self._atomic_create:
            self.fs.pipe_file(path, data, mode="create")
            return
        # In-process filesystems (memory): exclusive creation under one lock.
        with _memory_create_lock:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    def put(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def remove(self, paths: Sequence[str]) -> None:
        if paths:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(list(paths))
