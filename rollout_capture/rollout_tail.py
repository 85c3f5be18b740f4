"""A run's rollouts read as they land, from where the last read stopped: never read again.

A rollouts file that grows (a local disk: NeMo Gym's collection appends a line per finished
rollout) is watched by its size alone (an ``fstat`` a poll, on the descriptor opened once) and read
from the offset reached; only whole lines are handed on, a line still being written waits for its
newline. A file on an object store (each upload a longer version of the same file) is watched by
the size its run folder's listing shows and read by range. Numbered parts (:mod:`rollout_capture.
rollout_parts`, an object store's way) are read in order, one read a poll when nothing is new.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from rollout_capture.backends import Backend, Named
from rollout_capture.filesystem import join, local_path, open_filesystem
from rollout_capture.rollout_files import CHUNK_BYTES, RolloutsFileError, open_regular
from rollout_capture.rollout_parts import PartsReader, lines_of, part_name
from rollout_capture.run_folders import ROLLOUTS, rollouts_kind

Listing = Mapping[str, Named]
"""A run folder's names, as its last listing showed them."""


class RolloutsTail(ABC):
    """A run's rollouts from where the last read stopped: whole lines, in order, each once."""

    def __init__(self) -> None:
        self._ahead: list[bytes] = []  # read while skipping, not handed on yet
        self.requests = 0
        """Store requests made (object stores; 0 on a local disk)."""

    def read(self, folder: Listing) -> tuple[list[bytes], bool]:
        """The whole lines landed since the last read (without newlines), about a chunk of bytes
        at most, and whether more is there already. ``folder``: the run folder as last listed."""
        if self._ahead:
            lines, self._ahead = self._ahead, []
            return lines, True
        return self._read(folder)

    @abstractmethod
    def _read(self, folder: Listing) -> tuple[list[bytes], bool]: ...

    def rest(self) -> list[bytes]:
        """Once the run is finished and everything was read: a last line without its newline (none
        by default: parts are whole)."""
        return []

    def close(self) -> None:  # noqa: B027 - only a local file holds something open
        """Let go of what the tail holds open."""

    def skip(self, count: int, folder: Listing, finished: bool) -> tuple[int, bytes | None]:
        """Pass over the first ``count`` lines (enriched already, by an earlier follower); returns
        how many there were (fewer when the rollouts hold fewer lines) and the last of them."""
        skipped, last = 0, None
        while skipped < count:
            lines, more = self.read(folder)
            if not lines:
                if more:
                    continue
                if not finished:
                    break
                lines = self.rest()
                if not lines:
                    break
            take = min(count - skipped, len(lines))
            skipped += take
            last = lines[take - 1]
            self._ahead = lines[take:]
        return skipped, last


def _split(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole lines of ``buffer`` and what follows its last newline."""
    cut = buffer.rfind(b"\n")
    if cut < 0:
        return [], buffer
    return buffer[:cut].split(b"\n"), buffer[cut + 1 :]


class FileTail(RolloutsTail):
    """A rollouts file that grows: read from the offset reached, whole lines handed on."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        credentials: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self._local = local_path(url)
        self._fs: Any = None
        self._path = ""
        if self._local is None:
            self._fs, self._path = open_filesystem(url, storage_options, credentials=credentials)
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self.offset = 0
        self._partial = b""

    def _open(self) -> bool:
        """Open the local file once it is there (never through a link, never a FIFO)."""
        assert self._local is not None
        try:
            fd = open_regular(
                self._local,
                os.O_RDONLY,
                lambda why: RolloutsFileError(
                    f"rollouts file {self.url} is {why}: only a regular file is followed"
                ),
            )
        except FileNotFoundError:
            return False
        info = os.fstat(fd)
        self._fd, self._identity = fd, (info.st_dev, info.st_ino)
        return True

    def _size(self, folder: Listing) -> int | None:
        """The file's size now; None while it is not there."""
        if self._local is None:
            entry = folder.get(ROLLOUTS)
            return None if entry is None or entry.folder else entry.size
        if self._fd is None and not self._open():
            return None
        assert self._fd is not None
        try:  # the same file still: one replaced (not appended) would be read from the wrong place
            now = os.lstat(self._local)
            replaced = (now.st_dev, now.st_ino) != self._identity
        except FileNotFoundError:
            replaced = True
        if replaced:
            raise RolloutsFileError(
                f"rollouts file {self.url} was replaced or removed while followed: a followed run's "
                "rollouts file only grows"
            )
        return os.fstat(self._fd).st_size

    def _read(self, folder: Listing) -> tuple[list[bytes], bool]:
        size = self._size(folder)
        if size is None or size == self.offset:
            return [], False
        if size < self.offset:
            raise RolloutsFileError(
                f"rollouts file {self.url} shrank from {self.offset:,} to {size:,} bytes while followed: "
                "a followed run's rollouts file only grows"
            )
        end = min(size, self.offset + CHUNK_BYTES)
        if self._fd is not None:
            data = os.pread(self._fd, end - self.offset, self.offset)
        else:
            data = self._fs.cat_file(self._path, start=self.offset, end=end)
            self.requests += 1
        self.offset += len(data)
        lines, self._partial = _split(self._partial + data)
        return lines, self.offset < size

    def rest(self) -> list[bytes]:
        rest, self._partial = self._partial, b""
        return [rest] if rest else []

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PartsTail(RolloutsTail):
    """A run's numbered parts, read in order as they land."""

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self._reader = PartsReader(backend)

    def _read(self, folder: Listing) -> tuple[list[bytes], bool]:
        bodies, more = self._reader.read_new()
        self.requests = self._reader.requests
        return lines_of(bodies), more


class RunRollouts(RolloutsTail):
    """A run's rollouts whichever way they come, as its folder's listing first shows them: its
    rollouts file (:class:`FileTail`) or its parts (:class:`PartsTail`). Nothing is read before."""

    def __init__(
        self,
        backend: Backend,
        run: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        credentials: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.backend, self.run = backend, run
        self._options, self._credentials = storage_options, credentials
        self.inner: RolloutsTail | None = None
        self._probes = 0  # reads looking for a first part, before any rollouts showed

    def _read(self, folder: Listing) -> tuple[list[bytes], bool]:
        if self.inner is None:
            kind = rollouts_kind(folder, self.run)
            if kind is None and local_path(self.run) is None:
                # On an object store the first part is looked for at every poll (one read), not
                # only once a listing of the folder shows it: the first records are not kept waiting.
                self._probes += 1
                if self.backend.read_many([self.backend.path(part_name(0))])[0] is not None:
                    kind = "parts"
            if kind is None:
                self.requests = self._probes
                return [], False
            self.inner = (
                PartsTail(self.backend)
                if kind == "parts"
                else FileTail(join(self.run, ROLLOUTS), self._options, credentials=self._credentials)
            )
        lines, more = self.inner.read(folder)
        self.requests = self._probes + self.inner.requests
        return lines, more

    def rest(self) -> list[bytes]:
        return self.inner.rest() if self.inner is not None else []

    def close(self) -> None:
        if isinstance(self.inner, FileTail):
            self.inner.close()
