"""A followed run's live output: each record's enriched line, readable as soon as it is written, in
the order the records landed, line ``n`` of it the enrichment of line ``n`` of the run's rollouts.

On a local disk it is ``<run>/rollouts.enriched.live.jsonl``, appended a round at a time (one
``write`` of whole lines, then ``fdatasync``), under an exclusive ``flock`` its follower holds for
as long as it writes: a second follower cannot append, even one whose lease was taken over while it
was paused. A follower killed mid-write leaves at most a cut last line, which the next one cuts off
before it appends. On an object store (no append) each round is one object,
``<run>/rollouts.enriched.live/<first line, 12 digits>.jsonl``, created put-if-absent: two
followers can never both write the part that starts at a line. Either way the output itself says
where it stands: a restarted follower counts its lines and goes on from the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from rollout_capture.backends import Backend
from rollout_capture.filesystem import join
from rollout_capture.rollout_files import CHUNK_BYTES, OutputPathError, StorageWriteError, open_regular
from rollout_capture.rollout_parts import MAX_WINDOW, part_lines
from rollout_capture.run_folders import LIVE_PARTS

LINE_DIGITS = 12
_LIVE_PART = re.compile(rf"([0-9]{{{LINE_DIGITS}}})\.jsonl")


class LiveOutputBusy(RuntimeError):
    """Another follower writes this live output now (its lock is held)."""


class LiveOutputTaken(RuntimeError):
    """A part this follower meant to write was written by another (a follower that took over)."""


class LiveOutput(ABC):
    """Where a followed run's enriched lines go as they are made, and what is there already."""

    where: str
    """The live output as a user names it (a path, or the folder of its parts)."""

    @abstractmethod
    def open(self) -> Iterator[bytes]:
        """Take the output for writing (``LiveOutputBusy`` while another follower holds it) and
        yield the lines already there, in order (a cut last line is dropped: it is written again)."""

    @abstractmethod
    def append(self, first_line: int, lines: Sequence[bytes]) -> None:
        """Write these enriched lines (without newlines), the first being line ``first_line``."""

    def close(self) -> None:  # noqa: B027 - only a local file has something to let go
        """Stop writing (let another follower take it)."""


def _cut_to_last_line(fd: int) -> int:
    """Cut the file back to its last newline (a write cut short by a kill); returns its size."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:  # the last newline, read backwards a chunk at a time
        start = max(0, end - CHUNK_BYTES)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            end = start + cut + 1
            break
        end = start
    if end < size:
        os.ftruncate(fd, end)
        os.fsync(fd)
    return end


def _lines(fd: int, end: int) -> Iterator[bytes]:
    """The lines of the file's first ``end`` bytes (whole lines), read a chunk at a time."""
    offset, rest = 0, b""
    while offset < end:
        chunk = os.pread(fd, min(CHUNK_BYTES, end - offset), offset)
        if not chunk:
            break
        offset += len(chunk)
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines


def part_path(first_line: int) -> str:
    """The live part, under the run folder, that starts at line ``first_line``."""
    return f"{LIVE_PARTS}/{first_line:0{LINE_DIGITS}d}.jsonl"


class LiveFile(LiveOutput):
    """The live output on a local disk: one file, appended whole lines at a time, locked while written."""

    def __init__(self, path: str) -> None:
        self.where = path
        self._fd: int | None = None

    def open(self) -> Iterator[bytes]:
        fd = open_regular(
            self.where,
            os.O_RDWR | os.O_CREAT,
            lambda why: OutputPathError(f"live output {self.where} is {why}: never written through"),
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LiveOutputBusy(f"{self.where} is written by another follower now") from None
        self._fd = fd
        return _lines(fd, _cut_to_last_line(fd))

    def append(self, first_line: int, lines: Sequence[bytes]) -> None:
        fd = self._fd
        if fd is None:
            raise RuntimeError("live output not open")
        data = b"".join(line + b"\n" for line in lines)
        before = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fdatasync(fd)
        except OSError as exc:  # a full disk: the lines written so far go, the file stays whole
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            raise StorageWriteError(
                exc.errno, f"{exc.strerror}: appending to the live output {self.where}"
            ) from exc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with it
            self._fd = None


class LiveParts(LiveOutput):
    """The live output on an object store: a part a round, named after its first line, created
    put-if-absent."""

    def __init__(self, backend: Backend, run: str) -> None:
        self.backend = backend
        self.where = join(run, LIVE_PARTS)
        self.requests = 0

    def open(self) -> Iterator[bytes]:
        self.backend.require_put_if_absent()
        (names,) = self.backend.list_names([self.backend.path(LIVE_PARTS)])
        self.requests += 1
        firsts = sorted(
            int(match[1])
            for name, entry in names.items()
            if (match := _LIVE_PART.fullmatch(name)) and not entry.folder and not entry.link
        )
        return self._parts(firsts)

    def _parts(self, firsts: list[int]) -> Iterator[bytes]:
        expected = 1
        for start in range(0, len(firsts), MAX_WINDOW):
            window = firsts[start : start + MAX_WINDOW]
            bodies = self.backend.read_many([self.backend.path(part_path(first)) for first in window])
            self.requests += len(window)
            for first, body in zip(window, bodies, strict=True):
                if first != expected or body is None:
                    raise ValueError(
                        f"{self.where}: the part of line {expected} is missing (found {part_path(first)}): "
                        "the live output is not whole"
                    )
                lines = part_lines(body)
                expected += len(lines)
                yield from lines

    def append(self, first_line: int, lines: Sequence[bytes]) -> None:
        data = b"".join(line + b"\n" for line in lines)
        path = self.backend.path(part_path(first_line))
        self.requests += 1
        try:
            self.backend.create(path, data)
        except FileExistsError:
            self.requests += 1
            if self.backend.read_many([path])[0] != data:  # not our own write, landed before a retry
                raise LiveOutputTaken(f"{path} was written by another follower") from None
