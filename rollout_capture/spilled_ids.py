"""An input's rollout ids on this host's temporary disk, split by hash into partitions read back
one at a time: how an input of a million rollouts finds its repeated ids and its orphan captures
in memory that does not grow with it (a partition holds 1/64 of the ids).

Each id is written with the lines it was on and an order key (when it was seen), so the
repeated ids come back in the order they were first seen repeated, as in memory.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from typing import IO

import orjson

from rollout_capture.summary.orphans import near_candidates, near_input_id

PARTITIONS = 64
_BUFFER = 1 << 16


def _close_and_remove(files: list[IO[bytes]], folder: str) -> None:
    for handle in files:
        with contextlib.suppress(OSError):
            handle.close()
    shutil.rmtree(folder, ignore_errors=True)


class SpilledIds:
    """Rollout ids with their line numbers, on disk; removed with :meth:`close` (or when collected)."""

    def __init__(self, partitions: int = PARTITIONS, folder: str | None = None) -> None:
        self._folder = tempfile.mkdtemp(prefix="rollout-ids-", dir=folder)
        self._count = partitions
        self._ids = [self._open(f"ids-{n:03d}") for n in range(partitions)]
        self._listed: list[IO[bytes]] = []
        self._handles = [*self._ids]  # every file open, closed with the folder's removal
        self._removal = weakref.finalize(self, _close_and_remove, self._handles, self._folder)

    def _open(self, name: str) -> IO[bytes]:
        return open(os.path.join(self._folder, name), "w+b", buffering=_BUFFER)  # kept open

    def _partition(self, rollout_id: str) -> int:
        return hash(rollout_id) % self._count

    def add(self, rollout_id: str, key: int, lines: list[int]) -> None:
        """The id was on ``lines``, seen at ``key`` (its place among everything added)."""
        self._ids[self._partition(rollout_id)].write(orjson.dumps([rollout_id, key, lines]) + b"\n")

    def _entries(self, partition: int) -> Iterator[tuple[str, int, list[int]]]:
        handle = self._ids[partition]
        handle.flush()
        handle.seek(0)
        for line in handle:
            rollout_id, key, lines = orjson.loads(line)
            yield rollout_id, key, lines
        handle.seek(0, os.SEEK_END)

    def repeated(self, limit: int, lines_each: int) -> tuple[int, int, list[tuple[str, list[int]]]]:
        """``(ids on more than one line, the lines beyond each id's first, the first `limit` such ids
        in the order they were first seen repeated, each with its first `lines_each` lines)``."""
        count = extra = 0
        first: list[tuple[int, str, list[int]]] = []
        for partition in range(self._count):
            seen: dict[str, list[tuple[int, list[int]]]] = {}
            for rollout_id, key, lines in self._entries(partition):
                seen.setdefault(rollout_id, []).append((key, lines))
            for rollout_id, entries in seen.items():
                total = sum(len(lines) for _, lines in entries)
                if total < 2:
                    continue
                count += 1
                extra += total - 1
                entries.sort()
                held, repeated_at = 0, entries[-1][0]
                for key, lines in entries:  # repeated at the entry that brought its second line
                    held += len(lines)
                    if held > 1:
                        repeated_at = key
                        break
                every = sorted(line for _, lines in entries for line in lines)
                first = heapq.nsmallest(limit, [*first, (repeated_at, rollout_id, every[:lines_each])])
        return count, extra, [(rollout_id, lines) for _, rollout_id, lines in first]

    def orphans(self, listed_ids: Iterable[str], limit: int) -> tuple[int, list[str], dict[str, str]]:
        """Of ``listed_ids`` (a capture root's), those no input line names: ``(how many, the first
        `limit` sorted, each of those with the input id it was probably meant to be)``."""
        if not self._listed:
            self._listed = [self._open(f"listed-{n:03d}") for n in range(self._count)]
            self._handles.extend(self._listed)
        for rollout_id in listed_ids:
            self._listed[self._partition(rollout_id)].write(rollout_id.encode() + b"\n")
        count = 0
        first: list[str] = []
        for partition in range(self._count):
            wanted = {rollout_id for rollout_id, _, _ in self._entries(partition)}
            handle = self._listed[partition]
            handle.flush()
            handle.seek(0)
            found = {line.rstrip(b"\n").decode() for line in handle} - wanted
            handle.seek(0)
            handle.truncate()
            count += len(found)
            first = heapq.nsmallest(limit, [*first, *found])
        present = self._present({candidate for orphan in first for candidate in near_candidates(orphan)})
        near = {orphan: near_input_id(orphan, present) for orphan in first}
        return count, first, {orphan: meant for orphan, meant in near.items() if meant is not None}

    def _present(self, candidates: set[str]) -> set[str]:
        """Which of these ids some input line names (only their partitions are read)."""
        partitions = {self._partition(candidate) for candidate in candidates}
        return {
            rollout_id
            for partition in sorted(partitions)
            for rollout_id, _, _ in self._entries(partition)
            if rollout_id in candidates
        }

    def close(self) -> None:
        """Remove the files."""
        self._removal()
