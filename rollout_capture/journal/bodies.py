"""The commit bodies a journal reader has read, kept until it is told to let them go: the newest
in memory up to a budget, the rest in an unlinked temporary file of this host. Commits never
change, so a body read once is never asked of the store again while it is kept: an enrichment
costs one GET a commit however many of its batches read a commit's rows, with memory flat."""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from typing import IO

from rollout_capture.journal.commits import BadCommit, Commit, Stream, decode_commit

MEMORY_BUDGET = 32 << 20
"""Bytes of bodies kept in memory (decoded, ready to read); the rest go to the temporary file."""

Loc = tuple[Stream, int]
"""Where a commit is: its stream and number."""


class CommitBodies:
    """Commit bodies by where they are; thread-safe (batches of one job read them at once)."""

    def __init__(self, memory_budget: int | None = None) -> None:
        self._budget = MEMORY_BUDGET if memory_budget is None else memory_budget
        self._memory: OrderedDict[Loc, Commit] = OrderedDict()
        self._memory_bytes = 0
        self._spilled: dict[Loc, tuple[int, int]] = {}  # offset, length in the file
        self._file: IO[bytes] | None = None
        self._end = 0
        self._lock = threading.Lock()

    def __contains__(self, loc: Loc) -> bool:
        return loc in self._memory or loc in self._spilled

    def __len__(self) -> int:
        return len(self._memory) + len(self._spilled)

    @property
    def spilled_bytes(self) -> int:
        """Bytes of bodies in the temporary file."""
        return self._end

    def keep(self, loc: Loc, commit: Commit) -> None:
        """Keep a commit read from the store (the oldest in memory move to the file past the budget)."""
        with self._lock:
            if loc in self:
                return
            self._memory[loc] = commit
            self._memory_bytes += len(commit.body)
            while self._memory_bytes > self._budget and len(self._memory) > 1:
                old, spilled = self._memory.popitem(last=False)
                self._memory_bytes -= len(spilled.body)
                self._spill(old, spilled.body)

    def _spill(self, loc: Loc, body: bytes) -> None:
        if self._file is None:
            # unlinked at once: nothing is left behind, whatever ends this process
            self._file = tempfile.TemporaryFile(prefix="rollout-capture-commits-")  # noqa: SIM115
        os.pwrite(self._file.fileno(), body, self._end)
        self._spilled[loc] = (self._end, len(body))
        self._end += len(body)

    def get(self, loc: Loc) -> Commit | None:
        """The commit, if kept (``None`` also for one whose kept bytes no longer decode)."""
        with self._lock:
            commit = self._memory.get(loc)
            place = self._spilled.get(loc)
            handle = self._file
        if commit is not None:
            return commit
        if place is None or handle is None:
            return None
        offset, length = place
        try:
            return decode_commit(loc[1], os.pread(handle.fileno(), length, offset))
        except BadCommit:
            return None

    def clear(self) -> None:
        """Let every body go (the file too)."""
        with self._lock:
            self._memory.clear()
            self._memory_bytes = 0
            self._spilled.clear()
            self._end = 0
            if self._file is not None:
                self._file.close()
                self._file = None
