"""Files under a local capture root, opened with the OS directly and never through a link.

fsspec's local layer offers neither locks nor exclusive creation, and follows links: these are
the opens, locked appends and locked reads :class:`~rollout_capture.backends.posix.PosixBackend`
is built on (:class:`NoFollowRoot` below the root, each folder entered without following one).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

from rollout_capture.backends.base import Named

# Most captures fit in one read this size, which saves an fstat per file; larger ones are sized.
_FIRST_READ = 64 << 10

READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never blocks a reader
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Read-write: an append looks at the last byte first (see append_locked).
APPEND_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
LINK_REASON = "a symbolic link, never followed inside a capture root"


class LinkedEntryError(OSError):
    """An entry inside a capture or runs root is a symbolic link: nothing is read or written
    through it (a planted link would lead out of the root)."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.ELOOP, "a symbolic link inside the root; refused, never followed", path)


def is_link(name: str, dir_fd: int | None = None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def link_refusal(exc: OSError, shown: str, name: str, dir_fd: int | None) -> OSError:
    """The error to raise for a failed no-follow open: a link is named as one."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and is_link(name, dir_fd):
        return LinkedEntryError(shown)
    return exc


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def append_locked(fd: int, line: bytes) -> int:
    """Append ``line`` (the exclusive lock held) and return the size it started from.

    A file not ending in a newline holds a torn line (a writer killed mid-write): the new
    line starts on a fresh one, so that torn row stays the only damage. A write that fails
    (a full disk) is cut off again: the file holds what it held before.
    """
    end = os.lseek(fd, 0, os.SEEK_END)
    if end and os.pread(fd, 1, end - 1) != b"\n":
        line = b"\n" + line
    try:
        write_all(fd, line)
    except BaseException:
        _cut(fd, end)
        raise
    return end


def _cut(fd: int, end: int) -> None:
    """Take a failed append back (shrinking needs no space); if even that fails, the next
    append still starts on a fresh line."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, end)


def fsync_or_cut(fd: int, end: int) -> None:
    try:
        os.fsync(fd)
    except BaseException:
        _cut(fd, end)  # a line not known durable is not left behind as if it were
        raise


def scan_names(fd: int, folder: str) -> dict[str, Named]:
    """One folder's names via scandir of its fd: a stat per file, none per folder; links named as such."""
    out = {}
    with os.scandir(fd) as it:
        for item in it:
            name = item.name
            path = os.path.join(folder, name)
            try:
                if item.is_symlink():
                    out[name] = Named(name, path, False, link=True)
                    continue
                if item.is_dir(follow_symlinks=False):
                    out[name] = Named(name, path, True)
                    continue
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed while listed
                continue
            out[name] = Named(name, path, False, st.st_size, st.st_mtime)
    return out


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


def read_locked(fd: int) -> bytes:
    """An open file's bytes, every line whole; closes ``fd``.

    Each JSONL append is one line with its newline, written under an exclusive lock, so
    bytes ending in a newline hold only whole lines: read without the lock first, and take
    the shared lock only when a write may be in progress (they do not end in one).
    """
    try:
        data = _read_whole(fd)
        if not data or data.endswith(b"\n"):
            return data
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.lseek(fd, 0, os.SEEK_SET)
        return _read_whole(fd)
    finally:
        os.close(fd)  # also releases the lock


class NoFollowRoot:
    """A local root whose entries are opened without following a link (the root itself may be one)."""

    root: str
    _base: str  # root with its separator, for fast concatenation

    def _relative(self, path: str) -> str:
        if not path.startswith(self._base):
            raise ValueError(f"{path}: not under the root {self.root}")
        return path[len(self._base) :]

    def _open_root(self, create: bool) -> int:
        """The root's own fd, following it if it is a link (the root is the user's choice)."""
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self.root, exist_ok=True)
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _enter(self, dir_fd: int | None, name: str, shown: str, create: bool) -> int:
        """Open one folder below the root without following a link; ``mkdir`` it when asked."""
        target = shown if dir_fd is None else name
        for attempt in range(2):
            try:
                return os.open(target, FOLDER_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                if not create or attempt:
                    raise
                try:
                    os.mkdir(target, 0o755, dir_fd=dir_fd)  # never follows a link either
                except FileExistsError:
                    pass
                except FileNotFoundError:  # the root is not there yet
                    if dir_fd is not None:
                        raise
                    os.makedirs(self.root, exist_ok=True)
                    os.mkdir(target, 0o755)
            except OSError as exc:
                raise link_refusal(exc, shown, target, dir_fd) from None
        raise AssertionError("unreachable")

    def _parent(self, path: str, *, create: bool = False) -> tuple[int, str]:
        """``(fd of the folder holding path, its last name)``: each folder below the root opened
        without following a link (a linked one raises :class:`LinkedEntryError`)."""
        head, _, name = self._relative(path).rpartition("/")
        if not head:
            return self._open_root(create), name
        fd: int | None = None
        shown = self.root
        try:
            for part in head.split("/"):
                shown = f"{shown}/{part}"
                entered = self._enter(fd, part, shown, create)
                if fd is not None:
                    os.close(fd)
                fd = entered
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        assert fd is not None
        return fd, name

    def _open(self, path: str, flags: int, mode: int = 0o644) -> int:
        """Open a file inside the root, never through a link (flags carry ``O_NOFOLLOW``).

        A file directly under the root costs one ``open`` (the root's own path is followed,
        the name is not); a deeper one opens its folders first, each without following.
        """
        if "/" not in self._relative(path):
            try:
                return os.open(path, flags, mode)
            except OSError as exc:
                raise link_refusal(exc, path, path, None) from None
        dir_fd, name = self._parent(path)
        try:
            return os.open(name, flags, mode, dir_fd=dir_fd)
        except OSError as exc:
            raise link_refusal(exc, path, name, dir_fd) from None
        finally:
            os.close(dir_fd)

    def _read(self, path: str) -> bytes | None:
        """A file's bytes (lines whole); None if absent; ``LinkedEntryError`` for a link."""
        try:
            fd = self._open(path, READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return read_locked(fd)

    def _folder_fd(self, folder: str, *, create: bool = False) -> int:
        """A folder below the root, each part of it opened without following a link."""
        dir_fd, name = self._parent(folder, create=create)
        try:
            return self._enter(dir_fd, name, folder, create)
        finally:
            os.close(dir_fd)
