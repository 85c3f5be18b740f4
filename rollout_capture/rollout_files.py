"""Rollouts files in and enriched files out: streamed, and published atomically.

Input on a local disk is read in place; remote or compressed input is first copied
(decompressed) to a local spool in one streaming pass, so batches are cheap local
reads and a storage fault can only hit that one retryable copy. Output goes to a
temporary file and appears under its name only when complete: a crash never leaves a
half file, and the output may even replace the input.

A hostile world: an input that is not a regular file (a FIFO would hang the run) or not
valid compressed data is refused naming it; the output is never written through a
symbolic link; a storage fault on the output names it; and the temporary files a killed
run left beside an output are removed by the next run of that output, never those of a
writer still alive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import fsspec
from fsspec.compression import compr
from fsspec.utils import infer_compression
from pydantic import BaseModel

from rollout_capture.filesystem import is_local, open_filesystem

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
LEGACY_TEMP_STALE_S = 3600.0
"""A temporary output file of the old naming (no writer named in it) is removed only when
untouched this long: its writer, if any, never locked it."""
_HOST = re.sub(r"[^A-Za-z0-9.]", "", socket.gethostname())[:32] or "host"
_TEMP_SUFFIX = re.compile(r"(?:(?P<host>[A-Za-z0-9.]+)-(?P<pid>[0-9]+)-)?(?P<nonce>[0-9a-f]{12})")


class RolloutsFileError(ValueError):
    """A rollouts file that cannot be read as one (not a regular file, corrupt compressed data)."""


class OutputPathError(ValueError):
    """An output path that must not be written: a symbolic link, or not a regular file."""


class StorageWriteError(OSError):
    """A storage fault writing a file of ours (the output, a spool): a full disk, say, with the file named."""


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def _refuse_irregular_input(path: str, source: str) -> None:
    """A FIFO or device would block or never end: only regular files are read (links followed)."""
    kind = _kind(os.stat(path).st_mode)
    if kind is not None:
        raise RolloutsFileError(f"rollouts file {source} is {kind}, not a regular file")


class _TrackedReads:
    """The raw input under a decompressor: remembers whether a read of the storage itself failed,
    which tells a storage fault (retried) from corrupt compressed data (bad input)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.failed: BaseException | None = None

    def read(self, size: int = -1) -> bytes:
        try:
            return self._raw.read(size)
        except BaseException as exc:
            self.failed = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class StagedRollouts(BaseModel):
    """A rollouts file ready to be read in batches: a local, uncompressed path and its size."""

    source: str
    path: str
    size: int
    temporary: bool


def default_output(source: str) -> str:
    """``<input stem>.enriched.jsonl`` beside the input (``runs/a.jsonl.gz`` -> ``runs/a.enriched.jsonl``)."""
    head, _, name = source.rpartition("/")
    for suffix in _COMPRESSED:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    stem = (
        name[: -len(".jsonl")] if name.endswith(".jsonl") else name.rsplit(".", 1)[0] if "." in name else name
    )
    return f"{head}/{stem}.enriched.jsonl" if head else f"{stem}.enriched.jsonl"


def _is_plain_local(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return is_local(fs) and not path.endswith(_COMPRESSED)


def stage_rollouts(
    source: str,
    storage_options: Mapping[str, Any] | None = None,
    spool_dir: str | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> StagedRollouts:
    """Make ``source`` a local uncompressed file (in place when it already is one).

    Raises ``FileNotFoundError`` naming the source when it does not exist.
    """
    fs, path = open_filesystem(source, storage_options, credentials=credentials)
    if not fs.exists(path):
        raise FileNotFoundError(f"rollouts file not found: {source}")
    if is_local(fs):
        _refuse_irregular_input(path, source)
    if _is_plain_local(fs, path):
        return StagedRollouts(source=source, path=path, size=os.path.getsize(path), temporary=False)
    refuse_wrong_compression(fs, path, source)
    fd, spooled = local_spool("rollouts-", spool_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            size = _copy_decompressed(fs, path, source, out, spooled)
    except BaseException:
        os.unlink(spooled)
        raise
    return StagedRollouts(source=source, path=spooled, size=size, temporary=True)


MAGIC = {
    "gzip": b"\x1f\x8b",
    "bz2": b"BZh",
    "xz": b"\xfd7zXZ\x00",
}
"""The first bytes of each compressed format: a file named ``.gz`` that lacks them is refused before
anything starts (no server, no flow run), not after a spool copy."""


def refuse_wrong_compression(fs: fsspec.AbstractFileSystem, path: str, source: str) -> None:
    """A compressed name (``.gz``...) over bytes of another kind is a :class:`RolloutsFileError`
    naming the source (one small read); a truncated file is only found by reading it whole."""
    compression = infer_compression(path)
    magic = MAGIC.get(compression or "")
    if magic is None:
        return
    with fs.open(path, "rb") as raw:
        head = raw.read(len(magic))
    if head != magic:
        raise RolloutsFileError(
            f"rollouts file {source} is not valid {compression} data (truncated or not {compression} "
            f"at all?): its first bytes are {head!r}, not {magic!r}"
        )


def _copy_decompressed(
    fs: fsspec.AbstractFileSystem, path: str, source: str, out: IO[bytes], spooled: str
) -> int:
    """Copy ``path`` into ``out``, decompressed by its suffix; returns the bytes written.

    Corrupt or truncated compressed data is a :class:`RolloutsFileError` naming the source;
    a failed read of the storage is raised as it came (it may heal on retry).
    """
    compression = infer_compression(path)
    size = 0
    with fs.open(path, "rb") as raw:
        tracked = _TrackedReads(raw)
        handle = compr[compression](tracked, mode="rb") if compression else tracked
        while True:
            try:
                chunk = handle.read(CHUNK_BYTES)
            except Exception as exc:
                if tracked.failed is not None or compression is None:
                    raise
                detail = str(exc) or type(exc).__name__
                raise RolloutsFileError(
                    f"rollouts file {source} is not valid {compression} data (truncated or not "
                    f"{compression} at all?): {detail}"
                ) from exc
            with spool_faults(source, spooled):
                if not chunk:
                    out.flush()
                    return size
                out.write(chunk)
            size += len(chunk)


@contextlib.contextmanager
def spool_faults(source: str, spooled: str) -> Iterator[None]:
    """A storage fault writing a local spool (a full disk) as a :class:`StorageWriteError` naming
    what was being copied and where."""
    try:
        yield
    except OSError as exc:
        raise StorageWriteError(
            exc.errno, f"{exc.strerror}: copying {source} to the local spool {spooled}"
        ) from exc


def open_regular(path: str, flags: int, refused: Callable[[str], Exception], mode: int = 0o644) -> int:
    """``path`` opened as a regular file only, never through a symbolic link (``O_NOFOLLOW``) and never
    blocking on a FIFO (``O_NONBLOCK``); ``refused(why)`` is raised otherwise ("a symbolic link",
    "not a regular file"). A missing file raises ``FileNotFoundError`` as ``open`` does."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refused("a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refused("not a regular file")
    return fd


class LineRange(BaseModel):
    """A batch as a slice of a local file: cheap to ship to a worker, read where it runs."""

    path: str
    first_line: int
    offset: int
    length: int
    lines: int

    @property
    def last_line(self) -> int:
        """The number of the slice's last line."""
        return self.first_line + self.lines - 1

    def read(self) -> bytes:
        """The slice's bytes (newline-terminated lines, a last unterminated one too)."""
        with open(self.path, "rb") as handle:
            data = os.pread(handle.fileno(), self.length, self.offset)
            while len(data) < self.length:  # a short read: keep going until the slice is whole
                more = os.pread(handle.fileno(), self.length - len(data), self.offset + len(data))
                if not more:
                    raise EOFError(f"{self.path} is shorter than when it was cut into batches")
                data += more
        return data


def iter_line_ranges(path: str, batch_size: int) -> Iterator[LineRange]:
    """The file cut into slices of ``batch_size`` lines (the last may hold fewer).

    Read in large chunks and cut at every ``batch_size``-th newline: few syscalls and no
    per-line objects, so the scan barely competes with the CPU-bound merge.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}")
    number, start, found, position = 1, 0, 0, 0  # position: file offset of the chunk
    line_start = 0  # file offset just after the last newline
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            end = 0
            while True:
                newline = chunk.find(b"\n", end)
                if newline < 0:
                    break
                end = newline + 1
                line_start = position + end
                found += 1
                if found == batch_size:
                    cut = position + end
                    yield LineRange(
                        path=path, first_line=number, offset=start, length=cut - start, lines=found
                    )
                    number, start, found = number + found, cut, 0
            position += len(chunk)
    if position > line_start:  # a last unterminated line
        found += 1
    if found:
        yield LineRange(path=path, first_line=number, offset=start, length=position - start, lines=found)


def iter_line_batches(path: str, batch_size: int) -> Iterator[tuple[int, bytes]]:
    """``(first line number, raw bytes of up to batch_size lines)`` of a local file."""
    for piece in iter_line_ranges(path, batch_size):
        yield piece.first_line, piece.read()


def split_lines(blob: bytes) -> list[bytes]:
    """The lines of newline-terminated bytes, without their newlines (a last unterminated one too)."""
    lines = blob.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return lines


def local_spool(prefix: str, folder: str | None = None) -> tuple[int, str]:
    """A new spool file on this host's temporary disk, named after its writer; the spools that
    dead writers of this host left there (a killed run's decompressed input, say) go first."""
    folder = folder or tempfile.gettempdir()
    pattern = re.compile(re.escape(prefix) + r"(?P<host>[A-Za-z0-9.]+)-(?P<pid>[0-9]+)-[A-Za-z0-9_]+\.jsonl")
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            match = pattern.fullmatch(name)
            if match is None or match["host"] != _HOST or _pid_alive(int(match["pid"])):
                continue
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    os.unlink(path)
                    logger.warning(
                        "removed %s: the spool of an earlier run that died (%d bytes)", path, info.st_size
                    )
    return tempfile.mkstemp(prefix=f"{prefix}{_HOST}-{os.getpid()}-", suffix=".jsonl", dir=folder)


def _pid_alive(pid: int) -> bool:
    """Whether a process of this id runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temp_prefix(base: str) -> str:
    return f".{base}.tmp-"


def _temp_name(base: str) -> str:
    """``.<output>.tmp-<host>-<pid>-<random>``: the writer is named, so a leftover can be told apart."""
    return f"{_temp_prefix(base)}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _try_lock(fd: int) -> bool | None:
    """Take the exclusive lock every live writer holds on its temporary file: True if taken,
    False if someone holds it, None where the filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def remove_stale_temp_files(target: str, now: float | None = None) -> list[str]:
    """Remove the temporary files that earlier, dead runs writing ``target`` (a local path) left.

    Only files of our naming for this very output, regular files (never a link), owned by
    this user, and only when no live writer owns them: its process is gone from this host
    and nobody holds the lock a writer keeps on its file (which also covers writers on other
    hosts of a shared filesystem). Files of the old naming, which no writer ever locked, go
    once untouched for :data:`LEGACY_TEMP_STALE_S`. Returns the paths removed.
    """
    folder, base = os.path.split(os.path.abspath(target))
    prefix = _temp_prefix(base)
    now = time.time() if now is None else now
    removed = []
    try:
        names = [name for name in os.listdir(folder) if name.startswith(prefix)]
    except FileNotFoundError:
        return []
    for name in names:
        match = _TEMP_SUFFIX.fullmatch(name[len(prefix) :])
        if match is None:
            continue
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            continue
        pid = match["pid"]
        if pid is None:
            if now - info.st_mtime < LEGACY_TEMP_STALE_S:
                continue
        elif match["host"] == _HOST and _pid_alive(int(pid)):
            continue
        if _remove_if_unowned(path, info):
            removed.append(path)
            logger.warning(
                "removed %s: the temporary file of an earlier run that died (%d bytes)", path, info.st_size
            )
    return removed


def _remove_if_unowned(path: str, info: os.stat_result) -> bool:
    """Unlink ``path`` if no writer holds its lock and it is still the file looked at."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not _try_lock(fd):  # held by a live writer, or no way to know: left alone
            return False
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) != (info.st_dev, info.st_ino):
            return False
        with contextlib.suppress(FileNotFoundError):
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                os.unlink(path)
                return True
        return False
    finally:
        os.close(fd)


def refuse_unsafe_output(target: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse a local output path that is a symbolic link or not a regular file.

    Replacing a link would silently drop what it pointed at from the user's view, and
    writing through it would lead out of the folder: neither is what anyone asked for.
    """
    fs, path = open_filesystem(target, storage_options)
    if not is_local(fs):
        return
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise OutputPathError(
            f"output {target} is a symbolic link (to {os.readlink(path)}); refusing to write through "
            "or replace it: remove the link or name another output"
        )
    kind = _kind(info.st_mode)
    if kind is not None:
        raise OutputPathError(f"output {target} is {kind}; refusing to replace it")


def _create_locked(folder: str, base: str) -> tuple[str, int]:
    """A new temporary file beside the output, created without following any link, and locked."""
    for _ in range(8):
        path = os.path.join(folder, _temp_name(base))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o666)
        except FileExistsError:  # a name taken (a link planted there, say): never opened, another name
            continue
        if _try_lock(fd) is not False:  # taken, or a filesystem without locks (the name still tells)
            held, there = os.fstat(fd), None
            with contextlib.suppress(FileNotFoundError):
                there = os.lstat(path)
            if there is not None and (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino):
                return path, fd
        os.close(fd)  # a cleaner of another host took it in the instant between: another name
    raise OSError(errno.EAGAIN, f"could not create a temporary file beside {os.path.join(folder, base)}")


class OutputSpool:
    """An enriched file being written: appended batch by batch, then published at once.

    On a local disk the spool sits beside the target (publishing is a rename), named after
    its writer and locked while it lives; leftovers of dead writers of the same target are
    removed first.
    """

    def __init__(self, target: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.target = target
        self.storage_options = dict(storage_options or {})
        refuse_unsafe_output(target, self.storage_options)
        fs, path = open_filesystem(target, self.storage_options)
        self.local = is_local(fs)
        if self.local:  # beside the target, so publishing is a rename on one filesystem
            folder = os.path.dirname(path) or "."
            os.makedirs(folder, exist_ok=True)
            remove_stale_temp_files(path)
            self.path, fd = _create_locked(folder, os.path.basename(path))
        else:
            fd, self.path = local_spool("enriched-")
        self._handle = os.fdopen(fd, "wb")
        self.lines = 0

    def _fault(self, exc: OSError) -> StorageWriteError:
        where = self.target if self.local else f"{self.target} (its local spool {self.path})"
        return StorageWriteError(exc.errno, f"{exc.strerror}: writing the output {where}")

    def write(self, blob: bytes, lines: int) -> None:
        """Append a batch's output: ``lines`` newline-terminated lines, in order."""
        try:
            self._handle.write(blob)
        except OSError as exc:
            raise self._fault(exc) from exc
        self.lines += lines

    def append_part(self, part: str, lines: int) -> None:
        """Append a batch's output written to a part file by a worker, then delete the part."""
        with open(part, "rb") as source:
            try:
                shutil.copyfileobj(source, self._handle, CHUNK_BYTES)
            except OSError as exc:
                raise self._fault(exc) from exc
        os.unlink(part)
        self.lines += lines

    def close(self) -> None:
        """Flush to disk; the spool is then ready to publish."""
        if not self._handle.closed:
            try:
                self._handle.flush()
                os.fsync(self._handle.fileno())
            except OSError as exc:
                raise self._fault(exc) from exc
            finally:
                with contextlib.suppress(OSError):  # a failed flush is reported above
                    self._handle.close()

    def discard(self) -> None:
        """Drop the spool: nothing appears at the target."""
        if not self._handle.closed:
            with contextlib.suppress(OSError):  # unflushed bytes on a full disk: dropped anyway
                self._handle.close()
        if os.path.lexists(self.path):
            os.unlink(self.path)


def publish(
    spool_path: str,
    target: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> int:
    """Make the spool the target, atomically; returns its size. Safe to retry.

    A local target that has become a link (or a folder) meanwhile is refused, never
    written through; a rename replaces a link planted after this check, it never follows it.
    """
    fs, path = open_filesystem(target, storage_options, credentials=credentials)
    size = os.path.getsize(spool_path)
    if is_local(fs):
        refuse_unsafe_output(target, storage_options)
        os.replace(spool_path, path)
        return size
    fs.put_file(spool_path, path)  # one object: it appears only once the upload completes
    os.unlink(spool_path)
    return size


def remove_staged(staged: StagedRollouts) -> None:
    """Delete a spooled copy of the input (never the input itself)."""
    if staged.temporary and os.path.exists(staged.path):
        os.unlink(staged.path)
