"""Rollouts files in and enriched files out: streamed, and published atomically.

Input on a local disk is read in place; remote or compressed input is first copied
(decompressed) to a local spool in one streaming pass, so batches are cheap local
reads and a storage fault can only hit that one retryable copy. Output goes to a
temporary file and appears under its name only when complete: a crash never leaves a
half file, and the output may even replace the input.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel

from rollout_capture.filesystem import open_filesystem

CHUNK_BYTES = 8 << 20
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")


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
    return isinstance(fs, LocalFileSystem) and not path.endswith(_COMPRESSED)


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
    if _is_plain_local(fs, path):
        return StagedRollouts(source=source, path=path, size=os.path.getsize(path), temporary=False)
    fd, spooled = tempfile.mkstemp(prefix="rollouts-", suffix=".jsonl", dir=spool_dir)
    size = 0
    try:
        with os.fdopen(fd, "wb") as out, fs.open(path, "rb", compression="infer") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                out.write(chunk)
                size += len(chunk)
    except BaseException:
        os.unlink(spooled)
        raise
    return StagedRollouts(source=source, path=spooled, size=size, temporary=True)


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


class OutputSpool:
    """An enriched file being written: appended batch by batch, then published at once."""

    def __init__(self, target: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.target = target
        self.storage_options = dict(storage_options or {})
        fs, path = open_filesystem(target, self.storage_options)
        self.local = isinstance(fs, LocalFileSystem)
        if self.local:  # beside the target, so publishing is a rename on one filesystem
            folder = os.path.dirname(path) or "."
            os.makedirs(folder, exist_ok=True)
            self.path = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        else:
            fd, self.path = tempfile.mkstemp(prefix="enriched-", suffix=".jsonl")
            os.close(fd)
        self._handle = open(self.path, "wb")  # noqa: SIM115 - held across batches, closed in close()
        self.lines = 0

    def write(self, blob: bytes, lines: int) -> None:
        """Append a batch's output: ``lines`` newline-terminated lines, in order."""
        self._handle.write(blob)
        self.lines += lines

    def append_part(self, part: str, lines: int) -> None:
        """Append a batch's output written to a part file by a worker, then delete the part."""
        with open(part, "rb") as source:
            shutil.copyfileobj(source, self._handle, CHUNK_BYTES)
        os.unlink(part)
        self.lines += lines

    def close(self) -> None:
        """Flush to disk; the spool is then ready to publish."""
        if not self._handle.closed:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()

    def discard(self) -> None:
        """Drop the spool: nothing appears at the target."""
        if not self._handle.closed:
            self._handle.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


def publish(
    spool_path: str,
    target: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> int:
    """Make the spool the target, atomically; returns its size. Safe to retry."""
    fs, path = open_filesystem(target, storage_options, credentials=credentials)
    size = os.path.getsize(spool_path)
    if isinstance(fs, LocalFileSystem):
        os.replace(spool_path, path)
        return size
    fs.put_file(spool_path, path)  # one object: it appears only once the upload completes
    os.unlink(spool_path)
    return size


def remove_staged(staged: StagedRollouts) -> None:
    """Delete a spooled copy of the input (never the input itself)."""
    if staged.temporary and os.path.exists(staged.path):
        os.unlink(staged.path)
