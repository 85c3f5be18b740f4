"""Run folders for scheduled enrichment: which runs are finished, enriched, or taken.

A run is ``<runs_root>/<run>/`` with ``rollouts.jsonl``, ``captures/`` and, once it has
finished, an empty ``_SUCCESS``. ``_ENRICHED`` is written last, so a run is enriched at
most once; an ``_ENRICHING.<generation>`` lease (put-if-absent, with an expiry) keeps two overlapping
schedules off the same run without letting a crashed one block it forever.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import BaseModel

from rollout_capture.backends import Backend, open_backend
from rollout_capture.filesystem import join, open_filesystem

ROLLOUTS = "rollouts.jsonl"
CAPTURES = "captures"
SUCCESS = "_SUCCESS"
ENRICHED = "_ENRICHED"
LEASE = "_ENRICHING"
OUTPUT = "rollouts.enriched.jsonl"
DEFAULT_LEASE_S = 3600.0


class RunFolder(BaseModel):
    """One run under the root, and where its parts are."""

    name: str
    url: str
    finished: bool
    enriched: bool

    @property
    def rollouts(self) -> str:
        return join(self.url, ROLLOUTS)

    @property
    def captures(self) -> str:
        return join(self.url, CAPTURES)

    @property
    def output(self) -> str:
        return join(self.url, OUTPUT)


class Lease(BaseModel):
    """Who is enriching a run, and until when the claim holds."""

    owner: str
    generation: int
    acquired_at: float
    expires_at: float


def _url(fs_root_url: str, name: str) -> str:
    return f"{fs_root_url.rstrip('/')}/{name}"


class RunsRoot:
    """The folder (local or any fsspec URL) that holds run folders."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        credentials: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        fs, root = open_filesystem(url, storage_options, credentials=credentials)
        self.fs = fs
        self.root = root
        self.backend: Backend = open_backend(url, storage_options, credentials=credentials)

    def runs(self) -> list[RunFolder]:
        """Every run folder holding a rollouts file, sorted by name."""
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            if entry.get("type") != "directory":
                continue
            name = os.path.basename(entry["name"].rstrip("/"))
            folder = join(self.root, name)
            if not self.fs.exists(join(folder, ROLLOUTS)):
                continue
            out.append(
                RunFolder(
                    name=name,
                    url=_url(self.url, name),
                    finished=self.fs.exists(join(folder, SUCCESS)),
                    enriched=self.fs.exists(join(folder, ENRICHED)),
                )
            )
        return sorted(out, key=lambda run: run.name)

    def _leases(self, run: RunFolder) -> list[tuple[int, str]]:
        """``(generation, path)`` of the run's lease objects, newest last."""
        folder = join(self.root, run.name)
        found = []
        for path in self.fs.ls(folder, detail=False):
            name = os.path.basename(path.rstrip("/"))
            prefix, _, generation = name.partition(".")
            if prefix == LEASE and generation.isdigit():
                found.append((int(generation), path if path.startswith(folder) else join(folder, name)))
        return sorted(found)

    def acquire(self, run: RunFolder, lease_s: float = DEFAULT_LEASE_S) -> Lease | None:
        """Take the run's lease, or None while another holder's lease is live.

        Leases are generations (``_ENRICHING.000000``, ...): breaking an expired one means
        creating the next generation with put-if-absent, so of two processes breaking the
        same stale lease exactly one wins.
        """
        leases = self._leases(run)
        generation = 0
        if leases:
            newest_generation, newest_path = leases[-1]
            current = self._read_lease(newest_path)
            if current is not None and current.expires_at > time.time():
                return None
            generation = newest_generation + 1
        now = time.time()
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        lease = Lease(owner=owner, generation=generation, acquired_at=now, expires_at=now + lease_s)
        try:
            self.backend.create(self._lease_path(run, generation), orjson.dumps(lease.model_dump()))
        except FileExistsError:
            return None  # someone else took this generation first
        self.backend.remove([path for _, path in leases])  # stale generations
        return lease

    def _lease_path(self, run: RunFolder, generation: int) -> str:
        return join(join(self.root, run.name), f"{LEASE}.{generation:06d}")

    def _read_lease(self, path: str) -> Lease | None:
        body = self.backend.read_many([path])[0]
        try:
            return Lease.model_validate(orjson.loads(body)) if body else None
        except (orjson.JSONDecodeError, ValueError):
            return None

    def release(self, run: RunFolder, lease: Lease) -> None:
        """Give the lease back, if it is still ours."""
        path = self._lease_path(run, lease.generation)
        current = self._read_lease(path)
        if current is not None and current.owner == lease.owner:
            self.backend.remove([path])

    def mark_enriched(self, run: RunFolder, summary: Mapping[str, Any]) -> None:
        """Write ``_ENRICHED`` (a small JSON summary): the run will be skipped from now on."""
        self.backend.put(
            join(join(self.root, run.name), ENRICHED), orjson.dumps(dict(summary), option=orjson.OPT_INDENT_2)
        )
