"""Run folders for scheduled enrichment: which runs are finished, enriched, or taken.

A run is ``<runs_root>/<run>/`` with ``rollouts.jsonl``, ``captures/`` and, once it has
finished, an empty ``_SUCCESS``. ``_ENRICHED`` is written last and once (put-if-absent),
so a run is enriched at most once.

**Discovery** is one listing of the root (1,000 folders a page) plus one delimiter listing
per run folder, concurrently, never a HEAD: a folder's top-level names say all there is
to know. The job keeps an index at the root (``_rollout_capture_index.json``, the runs it
has seen enriched), so an idle tick over enriched runs costs the root's pages and one GET;
a folder missing from the index (new, or written by hand) is listed as before. The index
is a cache of ``_ENRICHED``, never the truth: an entry is added only once ``_ENRICHED`` has
been seen, so a lost entry costs one listing later and never a second enrichment; finishing a
run it names without ``_ENRICHED`` (a folder made again under its name) drops the entry.

**Leases** are generations ``_ENRICHING.<n>``, each created put-if-absent. Taking over
an expired generation ``n`` and renewing a live one both mean creating ``n + 1``: of two
processes trying, exactly one succeeds. The creator then lists the folder: a newer
generation (someone superseded it) or ``_ENRICHED`` means it lost. The newest generation
is never deleted while the run is unenriched (a release writes a ``released`` generation
on top), so a process acting on a stale view can only create an old number and sees the
newer one. Expiry counts from the store's clock on object stores (the object's
modification time) and from the holder's timestamps on a local disk.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import stat
import threading
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field, ValidationError

from rollout_capture.backends import Backend, Named, open_backend
from rollout_capture.claims import Clock, current_time, lapses_at
from rollout_capture.faults import is_transient_storage_error
from rollout_capture.filesystem import absolute_location, join, local_path

ROLLOUTS = "rollouts.jsonl"
PARTS = "rollouts.parts"
"""A run's rollouts written as numbered parts (an object store has no append): read in number
order as one file (:mod:`rollout_capture.rollout_parts`)."""
CAPTURES = "captures"
STARTED = "_STARTED"
"""Written when a run starts (``rollout-capture start``): a run to follow while it runs."""
HELD = "_REFUSED"
"""A run an earlier tick refused for its own input (a link where its parts belong, no captures):
why, as JSON. Later ticks leave it alone, naming it, without failing, until it is finished again
(``finish`` removes it) or rechecked."""
SUCCESS = "_SUCCESS"
ENRICHED = "_ENRICHED"
LEASE = "_ENRICHING"
OUTPUT = "rollouts.enriched.jsonl"
LIVE = "rollouts.enriched.live.jsonl"
"""A followed run's records enriched as they land (a local disk): appended, whole lines only."""
LIVE_PARTS = "rollouts.enriched.live"
"""A followed run's records enriched as they land (object stores): a part per round, named after
its first line (:mod:`rollout_capture.live_output`)."""
INDEX = "_rollout_capture_index.json"
DEFAULT_LEASE_S = 120.0
BEATS_PER_LEASE = 3
"""Renewals per lease period: two may fail (a storage hiccup) before the lease lapses."""

Taken = Literal["busy", "enriched"]
_RUN_PARTS = frozenset(
    {ROLLOUTS, PARTS, CAPTURES, STARTED, SUCCESS, ENRICHED, OUTPUT, LIVE, LIVE_PARTS, HELD}
)
_LINKED = "a symbolic link, never followed inside a runs root"
logger = logging.getLogger(__name__)


class RunFolder(BaseModel):
    """One run under the root, and where its parts are."""

    name: str
    url: str
    finished: bool
    enriched: bool
    rollouts_bytes: int | None = None
    """The size of its rollouts file when listed unenriched (what a tick weighs its work by); None
    for an enriched run, or when the store did not say."""
    started: bool = False
    """Whether the run said it started (``_STARTED``): one to follow while it runs."""
    parts: bool = False
    """Whether its rollouts are numbered parts (``rollouts.parts/``) rather than one file."""
    held: bool = False
    """Whether an earlier tick refused it (``_REFUSED``): said by :func:`run_folder`, and by a
    tick's discovery of a run it was told to recheck."""

    @property
    def rollouts(self) -> str:
        """Where its rollouts are: the file, or the folder of its parts."""
        return join(self.url, PARTS if self.parts else ROLLOUTS)

    @property
    def captures(self) -> str:
        return join(self.url, CAPTURES)

    @property
    def output(self) -> str:
        return join(self.url, OUTPUT)


class Lease(BaseModel):
    """One generation of a run's lease: who holds it, and until when by the holder's clock."""

    owner: str
    generation: int
    acquired_at: float
    expires_at: float
    renewed_at: float | None = None
    lease_s: float | None = None
    released: bool = False

    @property
    def duration_s(self) -> float:
        """How long a generation holds after it is written."""
        if self.lease_s is not None:
            return self.lease_s
        return self.expires_at - (self.renewed_at if self.renewed_at is not None else self.acquired_at)

    def successor(self, *, released: bool = False, clock: Clock | None = None) -> Lease:
        """The next generation of this holder's lease, starting now (by ``clock``, default the
        claims' and leases' :func:`~rollout_capture.claims.current_time`)."""
        now = (clock or current_time)()
        return self.model_copy(
            update={
                "generation": self.generation + 1,
                "renewed_at": now,
                "expires_at": now + self.duration_s,
                "lease_s": self.duration_s,
                "released": released,
            }
        )


class LeaseLost(RuntimeError):
    """Another holder took the run's lease: this one must stop and publish nothing."""


class AlreadyEnriched(LeaseLost):
    """The run was enriched (``_ENRICHED`` appeared) while this holder worked on it."""


class RunsIndex(BaseModel):
    """The index object at the root: the runs seen enriched (a cache of their ``_ENRICHED``)."""

    format: Literal[1] = 1
    enriched: list[str] = Field(default_factory=list)


class Discovery(BaseModel):
    """The runs under the root, and what finding them cost."""

    runs: list[RunFolder]
    listed: int
    """Folders listed this time (one request each)."""
    indexed: int
    """Runs taken from the index as enriched, without listing their folders."""
    refused: dict[str, str] = Field(default_factory=dict)
    """Run folders left alone, and why: one holding a link where its parts belong (found now)."""
    links: dict[str, str] = Field(default_factory=dict)
    """Names under the root that are links, left alone (never followed out of the root): no run
    folder of this root."""
    held: dict[str, str] = Field(default_factory=dict)
    """Runs an earlier tick refused (their ``_REFUSED``), and why: left alone until finished again."""


def rollouts_kind(names: Mapping[str, Named], where: str) -> Literal["file", "parts"] | None:
    """How a run folder's rollouts come, from its listed names: ``rollouts.jsonl``, numbered parts
    (``rollouts.parts/``), or None (none yet); a folder holding both is refused (``ValueError``):
    which of them is the run would be a guess."""
    file, parts = names.get(ROLLOUTS), names.get(PARTS)
    has_file = file is not None and not file.folder and not file.link
    has_parts = parts is not None and parts.folder
    if has_file and has_parts:
        raise ValueError(
            f"run folder {where} holds both {ROLLOUTS} and {PARTS}/: a run's rollouts are one or the other"
        )
    return "file" if has_file else "parts" if has_parts else None


RunNeeds = Literal["rollouts", "started", "any"]
"""What makes a folder a run to :func:`run_folder`: rollouts (a tick's, ``finish``'s), rollouts or
``_STARTED`` (``follow``: a run that has begun may have no rollouts yet), or anything (``start``)."""


def run_folder(
    run: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
    needs: RunNeeds = "rollouts",
) -> tuple[RunFolder, Backend]:
    """The run folder as it is now (started? finished? enriched?), named as every worker names it (a
    local path made absolute), and its storage opened at it.

    Refused as a tick would leave it: ``FileNotFoundError`` when the folder does not exist or holds
    no rollouts (``rollouts.jsonl`` or ``rollouts.parts/``; see ``needs``); ``ValueError`` when it is
    a symbolic link, or holds one where a run's part belongs (a tick never follows links, and a
    write through one lands outside the runs root), or holds both kinds of rollouts;
    ``IsADirectoryError`` when its ``_SUCCESS`` is a folder (no file can be written there).
    """
    run = absolute_location(run).rstrip("/")
    local = local_path(run)
    if local is not None:  # the folder itself: a link to it is never followed by a tick
        try:
            mode: int | None = os.lstat(local).st_mode
        except FileNotFoundError:
            if needs != "any":
                raise FileNotFoundError(f"run folder {run} does not exist") from None
            mode = None  # a run about to start: ``start_run`` makes it
        if mode is not None and stat.S_ISLNK(mode):
            raise ValueError(
                f"run folder {run} is {_LINKED}: nothing written through it (it leads outside "
                "its runs root, and no tick enriches it); use the folder it leads to under its own root"
            )
        if mode is not None and not stat.S_ISDIR(mode):
            raise ValueError(f"run folder {run} is not a folder")
    backend = open_backend(run, storage_options, credentials=credentials)
    (names,) = backend.list_names([backend.root])
    if not names and local is None and needs != "any":
        raise FileNotFoundError(f"run folder {run} does not exist (nothing under it)")
    linked = sorted(part for part, entry in names.items() if entry.link and _is_run_part(part))
    if linked:
        raise ValueError(f"run folder {run}: {', '.join(linked)}: {_LINKED}, so no tick enriches it")
    kind = rollouts_kind(names, run)
    started = STARTED in names
    if kind is None and needs != "any" and not (needs == "started" and started):
        raise FileNotFoundError(f"run folder {run} has no {ROLLOUTS}: not a run folder")
    success = names.get(SUCCESS)
    if success is not None and success.folder:  # writing the file would meet it as a temporary name's error
        raise IsADirectoryError(
            f"run folder {run}: {SUCCESS} is a folder, not the empty file that marks a run finished: "
            "remove it, then finish the run"
        )
    name = run.rsplit("/", 1)[-1]
    state = RunFolder(
        name=name,
        url=run,
        finished=SUCCESS in names,
        enriched=ENRICHED in names,
        started=started,
        parts=kind == "parts",
        held=HELD in names,
    )
    return state, backend


def start_run(
    run: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> RunFolder:
    """Write the run's empty ``_STARTED`` (what a harness does as it begins: its run may then be
    followed), making the folder on a local disk; nothing when the run is started, finished or
    enriched already. Returns the run folder as it was found, refused as :func:`run_folder` refuses
    (a link is never written through)."""
    local = local_path(absolute_location(run))
    if local is not None and not os.path.lexists(local):
        os.makedirs(local, exist_ok=True)
    state, backend = run_folder(run, storage_options, credentials=credentials, needs="any")
    if not (state.started or state.finished or state.enriched):
        backend.put(backend.path(STARTED), b"")
    return state


def finish_run(
    run: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> RunFolder:
    """Write the run's empty ``_SUCCESS`` (what a harness does once its rollouts file is whole),
    unless it is enriched already (then nothing is written: nothing would come of it); returns
    the run folder as it was found (:func:`run_folder`, which names what it refuses).

    An unenriched run the root's index names is a folder deleted and made again under its name:
    its entry is dropped first, or no tick would list it again (one GET of the index, and a PUT
    when the entry is there)."""
    state, backend = run_folder(run, storage_options, credentials=credentials)
    if not state.enriched:
        parent, _, name = state.url.rpartition("/")
        if parent and not parent.endswith("/"):  # a folder under a root (not a bucket, not /)
            RunsRoot(parent, storage_options, credentials=credentials).forget_enriched([name])
        if state.held:  # finished again: the next tick tries it again
            backend.remove([backend.path(HELD)])
        backend.put(backend.path(SUCCESS), b"")  # never through a link: a rename in the folder
    return state


def mark_finished(
    run: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    credentials: Mapping[str, Any] | None = None,
) -> str:
    """:func:`finish_run`, returning the run folder as every worker names it (a local path made
    absolute). Raises ``FileNotFoundError`` when the run folder is not there or has no
    ``rollouts.jsonl`` (a run that is not there would never be enriched), ``ValueError`` for a link.
    """
    return finish_run(run, storage_options, credentials=credentials).url


def new_owner() -> str:
    """A holder id, unique per acquisition (host and pid say where it runs)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _parse_lease(body: bytes | None) -> Lease | None:
    if not body:
        return None
    try:
        return Lease.model_validate(orjson.loads(body))
    except (orjson.JSONDecodeError, ValidationError):
        return None


_HELD_REASON_BYTES = 4096


def _held_reason(body: bytes | None) -> str:
    """Why an earlier tick refused a run, from its ``_REFUSED`` (what it says, bounded)."""
    try:
        reason = orjson.loads(body).get("reason") if body and len(body) <= _HELD_REASON_BYTES else None
    except (orjson.JSONDecodeError, AttributeError):
        reason = None
    return reason if isinstance(reason, str) else "refused by an earlier tick"


def _is_run_part(name: str) -> bool:
    """Whether a name in a run folder is one the job reads, writes or enriches from."""
    return name in _RUN_PARTS or name.partition(".")[0] == LEASE


def _generations(names: Mapping[str, Named]) -> dict[int, Named]:
    """Generation -> entry of the lease objects among a run folder's names."""
    out = {}
    for name, entry in names.items():
        prefix, dot, generation = name.partition(".")
        if prefix == LEASE and dot and generation.isdigit() and not entry.folder and not entry.link:
            out[int(generation)] = entry
    return out


class RunsRoot:
    """The folder (local or any fsspec URL) that holds run folders."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        credentials: Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``credentials`` may be a provider, asked at each use: a lease held for hours keeps
        renewing with credentials that are renewed in turn (temporary ones expire). ``clock``
        judges leases (default: the claims' clock, ``time.time`` unless a test set one)."""
        self.url = url.rstrip("/")
        self._clock = clock
        self._storage_options = storage_options
        self._provider = credentials if callable(credentials) else None
        self._credentials = credentials() if callable(credentials) else credentials
        self._backend: Backend = open_backend(url, storage_options, credentials=self._credentials)
        self.root = self._backend.root

    @property
    def backend(self) -> Backend:
        """The root's storage, opened again when the credentials provider hands out new ones."""
        if self._provider is not None:
            current = self._provider()
            if current is not self._credentials:
                self._credentials = current
                self._backend = open_backend(self.url, self._storage_options, credentials=current)
        return self._backend

    # ------------------------------------------------------------------ discovery

    def _folder(self, name: str) -> str:
        return self.backend.path(name)

    def _run(
        self,
        name: str,
        *,
        finished: bool,
        enriched: bool,
        size: int | None = None,
        started: bool = False,
        parts: bool = False,
        held: bool = False,
    ) -> RunFolder:
        return RunFolder(
            name=name,
            url=f"{self.url}/{name}",
            finished=finished,
            enriched=enriched,
            rollouts_bytes=size,
            started=started,
            parts=parts,
            held=held,
        )

    def discover(
        self, *, use_index: bool = True, recheck: Collection[str] = (), update_index: bool = True
    ) -> Discovery:
        """Every run folder (one holding a rollouts file), sorted by name.

        Runs the index lists as enriched are not listed again unless named in ``recheck``;
        without ``use_index`` every folder is. The index is rewritten when what was found
        differs from it (``update_index``).
        """
        (top,) = self.backend.list_names([self.root])
        links = {name: _LINKED for name, entry in top.items() if entry.link}
        refused: dict[str, str] = {}
        held: dict[str, str] = {}
        folders = sorted(name for name, entry in top.items() if entry.folder)
        index = self._read_index() if use_index and INDEX in top and not top[INDEX].link else None
        known = set(index or ()) & set(folders)
        known -= set(recheck)
        to_list = [name for name in folders if name not in known]
        runs = [self._run(name, finished=True, enriched=True) for name in known]
        for name, names in zip(
            to_list, self.backend.list_names([self._folder(n) for n in to_list]), strict=True
        ):
            hold = names.get(HELD)
            if (
                hold is not None
                and not (hold.link or hold.folder)
                and ENRICHED not in names
                and name not in recheck
            ):
                held[name] = hold.path
                continue
            try:
                kind = rollouts_kind(names, f"{self.url}/{name}")
            except ValueError as exc:
                refused[name] = str(exc)
                continue
            if kind is None:
                continue  # not a run (yet)
            linked = sorted(part for part, entry in names.items() if entry.link and _is_run_part(part))
            if linked:
                refused[name] = f"{', '.join(linked)}: {_LINKED}"
                continue
            done = ENRICHED in names
            size = None if done or kind == "parts" else names[ROLLOUTS].size
            runs.append(
                self._run(
                    name,
                    finished=SUCCESS in names,
                    enriched=done,
                    size=size,
                    started=STARTED in names,
                    parts=kind == "parts",
                    held=hold is not None,  # rechecked: its _REFUSED goes once it is enriched
                )
            )
        runs.sort(key=lambda run: run.name)
        held = dict(zip(held, map(_held_reason, self.backend.read_many(list(held.values()))), strict=True))
        for name, why in sorted({**links, **refused}.items()):
            logger.warning("%s/%s is left alone: %s", self.url, name, why)
        for name, why in sorted(held.items()):
            logger.warning("%s/%s is left alone, refused by an earlier tick: %s", self.url, name, why)
        if update_index:
            enriched = {run.name for run in runs if run.enriched}
            if enriched != set(index or ()):
                if known:  # taken on trust from the index read before listing: kept only if still there
                    enriched -= known - set(self._read_index() or ())
                self._write_index(enriched)
        return Discovery(
            runs=runs, listed=len(to_list), indexed=len(known), refused=refused, links=links, held=held
        )

    def unhold(self, name: str) -> None:
        """A held run enriched after all (rechecked): its ``_REFUSED`` goes."""
        self.backend.remove([join(self._folder(name), HELD)])

    def hold(self, name: str, why: str) -> None:
        """Leave a run alone from the next tick on, saying why (its ``_REFUSED``): it was refused
        for its own input, and refusing it again each tick would fail every tick for one run."""
        body = {"reason": why, "at": self._now(), "by": new_owner()}
        self.backend.put(join(self._folder(name), HELD), orjson.dumps(body))

    def runs(self) -> list[RunFolder]:
        """Every run folder, each listed now (the index neither read nor written)."""
        return self.discover(use_index=False, update_index=False).runs

    def _read_index(self) -> list[str] | None:
        """The index's run names; None when it is missing or damaged (then every folder is listed)."""
        body = self.backend.read_many([self._folder(INDEX)])[0]
        if not body:
            return None
        try:
            return RunsIndex.model_validate(orjson.loads(body)).enriched
        except (orjson.JSONDecodeError, ValidationError):
            return None

    def _write_index(self, enriched: Collection[str]) -> None:
        # Last writer wins. Concurrent ticks each write what they read plus what they saw
        # enriched, so an entry can be lost (one listing later) but never invented.
        body = RunsIndex(enriched=sorted(set(enriched))).model_dump()
        self.backend.put(self._folder(INDEX), orjson.dumps(body))

    def forget_enriched(self, names: Collection[str]) -> None:
        """Drop runs from the index (read, rewritten if it names any): folders made again under a
        name it remembers enriched. A tick rewriting the index meanwhile keeps what it took on trust
        only if the index still names it (:meth:`discover`)."""
        current = set(self._read_index() or ())
        if current & set(names):
            self._write_index(current - set(names))

    def remember_enriched(self, names: Collection[str]) -> None:
        """Add runs just enriched to the index (read, merged, rewritten)."""
        current = set(self._read_index() or ())
        if not set(names) <= current:
            self._write_index(current | set(names))

    # ------------------------------------------------------------------ leases

    def _now(self) -> float:
        return (self._clock or current_time)()

    def _lease_path(self, run: RunFolder, generation: int) -> str:
        return join(self._folder(run.name), f"{LEASE}.{generation:06d}")

    def _names(self, run: RunFolder) -> dict[str, Named]:
        return self.backend.list_names([self._folder(run.name)])[0]

    def _expires_at(self, lease: Lease | None, entry: Named) -> float:
        """When a listed generation stops holding: by the store's clock where it keeps one."""
        trust_mtime = self.backend.trust_mtime
        if lease is None:  # unreadable: counts from its modification time
            return lapses_at(None, DEFAULT_LEASE_S, entry.mtime, trust_mtime=trust_mtime, clock=self._clock)
        if lease.released:
            return -math.inf
        return lapses_at(lease.expires_at, lease.duration_s, entry.mtime, trust_mtime=trust_mtime)

    def current_lease(self, run: RunFolder) -> Lease | None:
        """The run's newest lease generation, ``expires_at`` as judged here; None when there is none."""
        generations = _generations(self._names(run))
        if not generations:
            return None
        entry = generations[max(generations)]
        lease = _parse_lease(self.backend.read_many([entry.path])[0])
        if lease is None:
            return None
        return lease.model_copy(update={"expires_at": self._expires_at(lease, entry)})

    def take(
        self, run: RunFolder, lease_s: float = DEFAULT_LEASE_S, owner: str | None = None
    ) -> Lease | Taken:
        """Take the run's lease: the lease, or ``"busy"`` (a live holder) or ``"enriched"``.

        Taking again with the same ``owner`` (a retry after a storage fault) finds the
        lease it may already have taken, rather than being kept out by it.
        """
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive; got {lease_s!r}")
        owner = owner or new_owner()
        names = self._names(run)
        if ENRICHED in names:
            return "enriched"
        generations = _generations(names)
        generation = 0
        if generations:
            newest = max(generations)
            body = self.backend.read_many([generations[newest].path])[0]
            if body is None:  # replaced while we looked: its holder is renewing it
                return "busy"
            current = _parse_lease(body)
            if current is not None and current.owner == owner and not current.released:
                return self._adopt(run, current)
            if self._now() < self._expires_at(current, generations[newest]):
                return "busy"
            generation = newest + 1
        now = self._now()
        lease = Lease(
            owner=owner,
            generation=generation,
            acquired_at=now,
            renewed_at=now,
            expires_at=now + lease_s,
            lease_s=lease_s,
        )
        try:
            lease = self._create(run, lease)
            self._confirm(run, lease)
        except AlreadyEnriched:
            return "enriched"
        except LeaseLost:
            return "busy"
        return lease

    def _adopt(self, run: RunFolder, lease: Lease) -> Lease | Taken:
        try:
            return self.renew(run, lease)
        except AlreadyEnriched:
            return "enriched"
        except LeaseLost:
            return "busy"

    def acquire(self, run: RunFolder, lease_s: float = DEFAULT_LEASE_S) -> Lease | None:
        """The run's lease, or None while someone else holds it (or the run is enriched)."""
        taken = self.take(run, lease_s)
        return taken if isinstance(taken, Lease) else None

    def _create(self, run: RunFolder, lease: Lease) -> Lease:
        """Create the lease's generation; ``LeaseLost`` when another holder created it first."""
        path = self._lease_path(run, lease.generation)
        try:
            self.backend.create(path, orjson.dumps(lease.model_dump()))
        except FileExistsError:
            existing = _parse_lease(self.backend.read_many([path])[0])
            if existing is not None and existing.owner == lease.owner:
                return existing  # our own write, retried after its answer was lost
            holder = existing.owner if existing is not None else "another holder"
            raise LeaseLost(
                f"{run.name}: lease generation {lease.generation} was taken by {holder}"
            ) from None
        return lease

    def _confirm(self, run: RunFolder, lease: Lease) -> None:
        """Make sure ``lease`` is the run's newest generation and the run unenriched; drop older ones."""
        names = self._names(run)
        mine = self._lease_path(run, lease.generation)
        if ENRICHED in names:
            self._clean_up(run, [mine])
            raise AlreadyEnriched(f"{run.name} was enriched by another holder")
        generations = _generations(names)
        newer = [g for g in generations if g > lease.generation]
        if newer or lease.generation not in generations:
            self._clean_up(run, [mine])
            raise LeaseLost(f"{run.name}: its lease was taken over (generation {max(newer, default='?')})")
        self._clean_up(run, [entry.path for g, entry in generations.items() if g < lease.generation])

    def renew(self, run: RunFolder, lease: Lease) -> Lease:
        """The lease's next generation: proof that its holder is still the current one.

        ``LeaseLost`` when someone took over (created that generation, or a newer one) or
        the run was enriched meanwhile.
        """
        renewed = self._create(run, lease.successor(clock=self._clock))
        self._confirm(run, renewed)
        return renewed

    def release(self, run: RunFolder, lease: Lease) -> None:
        """Give the lease back, if it is still ours: a released generation on top of it."""
        try:
            self._create(run, lease.successor(released=True, clock=self._clock))
        except LeaseLost:
            return  # taken over: nothing of ours to give back
        self._clean_up(run, [self._lease_path(run, lease.generation)])

    def mark_enriched(self, run: RunFolder, lease: Lease, summary: Mapping[str, Any]) -> None:
        """Write ``_ENRICHED`` (a small JSON summary naming the holder) once, put-if-absent."""
        path = join(self._folder(run.name), ENRICHED)
        body = {**summary, "enriched_by": lease.owner}
        try:
            self.backend.create(path, orjson.dumps(body, option=orjson.OPT_INDENT_2))
        except FileExistsError:
            existing = self.backend.read_many([path])[0] or b""
            try:
                holder = orjson.loads(existing).get("enriched_by")
            except (orjson.JSONDecodeError, AttributeError):
                holder = None
            if holder != lease.owner:  # not our own retried write
                raise AlreadyEnriched(f"{run.name} was enriched by {holder or 'another holder'}") from None

    def enriched_marker(self, run: RunFolder) -> dict[str, Any] | None:
        """What the run's ``_ENRICHED`` says (its summary, ``enriched_by``); None when it is absent
        or not a JSON object (a marker written by hand)."""
        body = self.backend.read_many([join(self._folder(run.name), ENRICHED)])[0]
        try:
            marker = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            return None
        return marker if isinstance(marker, dict) else None

    def drop_leases(self, run: RunFolder) -> None:
        """Delete every lease generation of an enriched run (its ``_ENRICHED`` keeps others off)."""
        self._clean_up(run, [entry.path for entry in _generations(self._names(run)).values()])

    def _clean_up(self, run: RunFolder, paths: list[str]) -> None:
        """Remove lease generations no longer needed. A store refusing deletes (credentials without
        the right) leaves them, said in a warning naming them: harmless, since the newest generation
        and ``_ENRICHED`` decide, so no reason to fail the run."""
        try:
            self.backend.remove(paths)
        except PermissionError as exc:
            logger.warning("%s: lease generation(s) left behind, not deleted: %s", run.url, exc)


class LeaseKeeper:
    """Holds a run's lease while the run is enriched: renews it in the background, fences publishing.

    A live holder never loses its run however long it takes (a renewal every
    ``lease_s / 3``); one that finds its lease taken stops renewing, and ``check`` and
    ``fence`` raise ``LeaseLost`` from then on, so it publishes nothing.
    """

    def __init__(
        self, root: RunsRoot, run: RunFolder, lease: Lease, heartbeat_s: float | None = None
    ) -> None:
        self.root = root
        self.run = run
        self._lease = lease
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else lease.duration_s / BEATS_PER_LEASE
        self.renewals = 0
        self.last_error: BaseException | None = None
        self._lost: str | None = None
        self._fenced = False  # finish() renewed the lease for the last time
        self._marked = False
        self._lock = threading.Lock()  # one renewal at a time: the beat and a fence never race
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lease(self) -> Lease:
        return self._lease

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or None while it is held."""
        return self._lost

    def start(self) -> LeaseKeeper:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name=f"lease:{self.run.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """No more renewals (the lease lapses unless it is finished or released)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                if self._stop.is_set() or self._lost is not None:
                    return
                try:
                    self._renew()
                except LeaseLost:
                    return
                except Exception as exc:
                    self.last_error = exc
                    if not is_transient_storage_error(exc):
                        self._lost = f"{self.run.name}: renewing its lease failed: {exc!r}"
                        return
                    # transient: the next beat tries again, well inside the lease

    def _renew(self) -> Lease:
        try:
            self._lease = self.root.renew(self.run, self._lease)
        except LeaseLost as exc:
            self._lost = str(exc)
            raise
        self.renewals += 1
        return self._lease

    def check(self) -> None:
        """Raise ``LeaseLost`` once the lease is known to be lost."""
        if self._lost is not None:
            raise LeaseLost(self._lost)

    def fence(self) -> Lease:
        """Renew now, right before publishing: success proves this holder is the current one,
        and nobody can take over for another lease period."""
        with self._lock:
            self.check()
            return self._renew()

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Fence, write ``_ENRICHED``, drop the lease. Safe to retry: once fenced, a retry
        writes the marker again (its own earlier write is recognised) without renewing,
        since a renewal would find that marker and call the lease lost."""
        with self._lock:
            if not self._fenced:
                self.check()
                self._renew()
                self._fenced = True
                self._stop.set()  # the fence holds a whole lease: no renewal may follow
            if not self._marked:
                try:
                    self.root.mark_enriched(self.run, self._lease, summary)
                except AlreadyEnriched as exc:
                    self._lost = str(exc)
                    raise
                self._marked = True
            self.root.drop_leases(self.run)
        self.stop()

    def release(self) -> None:
        """Give the lease back after a failure, unless it was lost or the run is done."""
        self.stop()
        with self._lock:
            if self._lost is None and not self._marked:
                self.root.release(self.run, self._lease)
