"""A run's rollouts written as numbered parts: how a run on an object store (which has no append)
lets its records land while it runs.

``<run>/rollouts.parts/000000000000.jsonl``, ``000000000001.jsonl``... each holds whole lines and is
created once, put-if-absent, never changed. Read in number order up to the first missing number,
they are the run's rollouts file (a last line without its newline ends at its part's end), for
every reader alike: the follower as parts land, a scheduled tick or the follower's end once the run
is finished (staged as one local file). A number missing below a later one is refused by name at
the end: the run's rollouts would otherwise be read short.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollout_capture.backends import Backend, open_backend
from rollout_capture.filesystem import join
from rollout_capture.rollout_files import CHUNK_BYTES, StagedRollouts, local_spool, spool_faults
from rollout_capture.run_folders import PARTS
from rollout_capture.sequence import create_numbered, first_absent

PART_DIGITS = 12
_PART = re.compile(rf"[0-9]{{{PART_DIGITS}}}\.jsonl")
MAX_WINDOW = 64
"""Parts asked for at once, at most, while catching up (one concurrent read)."""


def part_name(number: int) -> str:
    """The name of part ``number`` under the run folder."""
    return f"{PARTS}/{number:0{PART_DIGITS}d}.jsonl"


def part_lines(body: bytes) -> list[bytes]:
    """The lines of one part, without their newlines (its last line too when it lacks one)."""
    lines = body.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return lines


def part_bytes(body: bytes) -> bytes:
    """A part as it reads within the run's rollouts: its bytes, a newline added where its last line
    lacks one."""
    return body if not body or body.endswith(b"\n") else body + b"\n"


class PartsReader:
    """Reads a run's parts in number order from where it stopped, never listing: one read a poll
    when nothing is new, a window of reads at once while parts keep coming."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.next = 0
        self._window = 1
        self.requests = 0

    def read_new(self) -> tuple[list[bytes], bool]:
        """The bodies of the parts landed since the last call, in order; and whether more may be
        there already (the window came back full)."""
        numbers = range(self.next, self.next + self._window)
        bodies = self.backend.read_many([self.backend.path(part_name(n)) for n in numbers])
        self.requests += len(bodies)
        found: list[bytes] = []
        for body in bodies:
            if body is None:
                break
            found.append(body)
        self.next += len(found)
        full = len(found) == self._window
        self._window = min(MAX_WINDOW, self._window * 2) if full else max(1, len(found) + 1)
        return found, full


def listed_parts(backend: Backend, where: str) -> list[str]:
    """The full paths of a finished run's parts in order, from one listing of their folder;
    ``ValueError`` naming the first number missing below a later one (a part never written, or lost)."""
    (names,) = backend.list_names([backend.path(PARTS)])
    numbered = sorted(
        int(name[:PART_DIGITS])
        for name, entry in names.items()
        if _PART.fullmatch(name) and not entry.folder and not entry.link
    )
    for expected, number in enumerate(numbered):
        if number != expected:
            raise ValueError(
                f"{join(where, part_name(expected))} is missing below {join(where, part_name(number))}: "
                "a run's parts are numbered from 0 without gaps"
            )
    return [backend.path(part_name(n)) for n in numbered]


def stage_parts(
    run: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> StagedRollouts:
    """A run's parts as one local rollouts file (the form every enrichment reads), in number order."""
    backend = open_backend(run, storage_options, credentials=credentials)
    paths = listed_parts(backend, run)
    fd, spooled = local_spool("rollouts-")
    size = 0
    try:
        with open(fd, "wb", buffering=CHUNK_BYTES) as out:
            for start in range(0, len(paths), MAX_WINDOW):
                for path, body in zip(
                    paths[start : start + MAX_WINDOW],
                    backend.read_many(paths[start : start + MAX_WINDOW]),
                    strict=True,
                ):
                    if body is None:
                        raise FileNotFoundError(f"{path} vanished while the run's parts were read")
                    data = part_bytes(body)
                    with spool_faults(f"{run}'s parts", spooled):
                        out.write(data)
                    size += len(data)
    except BaseException:
        os.unlink(spooled)
        raise
    return StagedRollouts(source=join(run, PARTS), path=spooled, size=size, temporary=True)


class PartsWriter:
    """What a harness on an object store does with its finished rollouts: each call to :meth:`append`
    lands them as the run's next part (put-if-absent, so two writers never take one number).

    Example:
        ```python
        parts = PartsWriter("s3://my-runs/runs/r1")
        parts.append([b'{"_ng_task_index": 0, "_ng_rollout_index": 0}'])
        ```
    """

    def __init__(
        self,
        run: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        credentials: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = open_backend(run, storage_options, credentials=credentials)
        self._next: int | None = None

    def append(self, lines: Iterable[bytes]) -> int:
        """Land ``lines`` (each without its newline) as one part; returns its number."""
        body = b"".join(line.rstrip(b"\n") + b"\n" for line in lines)
        if not body:
            raise ValueError("a part holds at least one line")
        if self._next is None:
            self._next = first_absent(lambda n: self.backend.exists(self.backend.path(part_name(n))), 0)
        number = create_numbered(
            self.backend, part_name, self._next, body, lambda existing: existing == body, lambda n: n + 1
        )
        self._next = number + 1
        return number


def lines_of(bodies: Sequence[bytes]) -> list[bytes]:
    """Every line of these parts, in order, without newlines."""
    return [line for body in bodies for line in part_lines(body)]
