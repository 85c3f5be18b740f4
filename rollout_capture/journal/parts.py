"""The parts of a compacted generation (:mod:`.compacted`) as a reader reads them: the few ranges
a small read needs (one rollout's rows: ``inspect``) by ranged GETs, or, once a read needs much
of a part, the whole part copied in a few large ranged GETs to an unlinked temporary file of this
host and read there until the enrichment ends. So a part is fetched once per enrichment however
many batches read its rollouts, with memory flat; a local disk's parts are read in place. A part
read whole has the next one copied behind it (a whole run's enrichment reads them in order: their
downloads overlap its work)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import IO

from rollout_capture.backends.base import Backend
from rollout_capture.journal.compacted import Manifest

CHUNK_BYTES = 8 << 20
"""One ranged GET of a part being copied (the object stores' advice: 8-16 MB)."""
CHUNKS_IN_FLIGHT = 4
"""Ranged GETs of a part in flight at once (a few: each is a large body)."""
GAP_BYTES = 1 << 20
"""Ranges of one read closer than this are fetched as one (the bytes between cost less than a request)."""
DIRECT_RANGES = 8
"""A read needing more ranges than this of a part (or more than a quarter of it) copies the part."""


def coalesce(spans: Sequence[tuple[int, int]], gap: int = GAP_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` spans merged where they overlap or lie closer than ``gap``, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] <= gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class PartsReader:
    """The parts of one generation, read as asked; thread-safe (a job's batches read at once)."""

    def __init__(self, backend: Backend, manifest: Manifest) -> None:
        self._backend = backend
        self._manifest = manifest
        self._copies: dict[int, int] = {}  # part -> where its copy starts in the file
        self._copying: dict[int, threading.Event] = {}
        self._file: IO[bytes] | None = None
        self._end = 0
        self._epoch = 0  # advanced by clear(): a copy begun before writes nothing after
        self._lock = threading.Lock()
        self.requests = 0  # ranged GETs sent (for tests and benchmarks)

    def read(self, wanted: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        """The bytes of each ``(part, offset, length)``, in order; ``None`` where the part is gone
        from the store (a newer generation replaced it: the reader reads that one)."""
        by_part: dict[int, list[int]] = {}
        for at, (part, _, _) in enumerate(wanted):
            by_part.setdefault(part, []).append(at)
        out: list[bytes | None] = [None] * len(wanted)
        for part, places in by_part.items():
            spans = [(wanted[at][1], wanted[at][1] + wanted[at][2]) for at in places]
            for at, piece in zip(places, self._read_part(part, spans), strict=True):
                out[at] = piece
        return out

    def _read_part(self, part: int, spans: list[tuple[int, int]]) -> list[bytes | None]:
        base = self._copy_of(part, spans)
        if base is not None:
            self._read_ahead(part + 1)
            with self._lock:
                handle = self._file
            assert handle is not None
            return [os.pread(handle.fileno(), end - start, base + start) for start, end in spans]
        merged = coalesce(spans)
        path = self._manifest.part_path(self._backend, part)
        self.requests += len(merged)
        got = list(self._backend.read_ranges([(path, start, end) for start, end in merged]))
        out: list[bytes | None] = []
        for start, end in spans:
            for (low, high), data in zip(merged, got, strict=True):
                if low <= start and end <= high:
                    whole = data is not None and len(data) == high - low
                    out.append(data[start - low : end - low] if whole and data is not None else None)
                    break
        return out

    def _copy_of(self, part: int, spans: list[tuple[int, int]]) -> int | None:
        """Where the part's local copy starts, copying it now when this read needs much of it;
        ``None`` to read these spans from the store (a few, or the part is gone)."""
        if self._backend.capabilities.local:  # read in place: nothing to copy
            return None
        size = self._manifest.parts[part].size
        with self._lock:
            if part in self._copies:
                return self._copies[part]
            event = self._copying.get(part)
            mine = event is None
            if mine:
                merged = coalesce(spans)
                if len(merged) <= DIRECT_RANGES and 4 * sum(e - s for s, e in merged) <= size:
                    return None
                event = self._copying[part] = threading.Event()
        assert event is not None
        if not mine:
            event.wait()
            with self._lock:
                return self._copies.get(part)
        return self._copy_then_say(part, event)

    def _read_ahead(self, part: int) -> None:
        """Copy ``part`` in the background unless it is (being) copied; at most one part beyond
        what was read is fetched for nothing, when the reads stop there."""
        with self._lock:
            if part >= len(self._manifest.parts) or part in self._copies or part in self._copying:
                return
            event = self._copying[part] = threading.Event()
        threading.Thread(
            target=self._copy_ahead, args=(part, event), name="rollout-capture-part-ahead", daemon=True
        ).start()

    def _copy_ahead(self, part: int, event: threading.Event) -> None:
        # A copy ahead that fails leaves the part uncopied: the read that needs it copies it
        # (or reads its ranges) itself, and meets the store's error there, where it is reported.
        with contextlib.suppress(Exception):
            self._copy_then_say(part, event)

    def _copy_then_say(self, part: int, event: threading.Event) -> int | None:
        """Copy ``part``, then wake the readers waiting on ``event`` for it."""
        try:
            return self._copy(part, self._manifest.parts[part].size)
        finally:
            with self._lock:
                self._copying.pop(part, None)
            event.set()

    def _copy(self, part: int, size: int) -> int | None:
        path = self._manifest.part_path(self._backend, part)
        chunks = [(path, start, min(size, start + CHUNK_BYTES)) for start in range(0, size, CHUNK_BYTES)]
        with self._lock:
            if self._file is None:
                # unlinked at once: nothing is left behind, whatever ends this process
                self._file = tempfile.TemporaryFile(prefix="rollout-capture-parts-")  # noqa: SIM115
            base, self._end = self._end, self._end + size
            handle, epoch = self._file, self._epoch
        self.requests += len(chunks)
        with contextlib.closing(self._backend.read_ranges(chunks, CHUNKS_IN_FLIGHT)) as pieces:
            for (_, start, end), data in zip(chunks, pieces, strict=True):
                if data is None or len(data) != end - start:
                    return None  # gone (or not what the manifest says): read from the store, which tells
                with self._lock:  # never into a file clear() closed (its number may be another's now)
                    if self._epoch != epoch:
                        return None
                    os.pwrite(handle.fileno(), data, base + start)
        with self._lock:
            if self._epoch != epoch:
                return None
            self._copies[part] = base
        return base

    def clear(self) -> None:
        """Let every copy go (the enrichment is over)."""
        with self._lock:
            self._epoch += 1
            self._copies.clear()
            self._end = 0
            if self._file is not None:
                self._file.close()
                self._file = None
