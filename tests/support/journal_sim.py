"""A seeded, deterministic simulation of the journal protocol, run on the real writer and reader.

The writers (``JournalWriter``, threads and all) and readers (``JournalReader``) are the product's
code; only their world is simulated: a store with put-if-absent (:class:`SimStore`), a fake clock
(:class:`SimClock`) and a scheduler (:class:`World`) that lets exactly one thread run at a time.
Every place a thread can block (a store request, a sleep, a condition wait, a wait for an
acknowledgement) is a *gate*; the scheduler, driven by one ``random.Random(seed)``, picks which
gated thread goes next, whether a request lands, fails, lands with its answer lost or its answer
delayed past other requests, and when a whole writer process is killed (its threads stop where
they stand). So a schedule replays exactly from its seed.

Agents (one per rollout) make calls one after another through whichever writer process is alive,
as an agent's calls go through several proxies; some clear rollouts as a harness does before
dispatch. After every schedule :func:`check` states the protocol's invariants against a final
read by a fresh reader allowed to fill holes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import orjson

from rollout_capture.backends.base import Backend, Named
from rollout_capture.compaction import compact_root
from rollout_capture.journal import (
    JournalReader,
    JournalWriter,
    clear_entry,
    commit_name,
    decode_commit,
    row_entry,
)
from rollout_capture.journal import writer as writer_module
from rollout_capture.journal.compacted import DELETE_AFTER_S, floors_of, manifest_name, newest_manifest
from rollout_capture.names import Entry
from rollout_capture.rows import new_parsed_rows

_EPOCH = 1.7e9  # SimClock.time() is the world's time plus this
_SIM_CAPABILITIES = SimpleNamespace(local=False)
_REAL_TIMEOUT_S = 20.0  # a thread that neither gates nor ends in this long: the code blocked outside a gate


class Killed(BaseException):
    """Raised in a killed process's threads once the schedule is over, so they end."""


class StoreFault(ConnectionError):
    """A request the store (or the network) failed."""


@dataclass
class Process:
    """A writer process: its writer, and whether it was killed."""

    name: str
    writer: JournalWriter | None = None
    dead: bool = False


@dataclass
class Actor:
    """One thread of the world (a writer's, a reader's, an agent's)."""

    name: str
    process: Process | None
    state: str = "gated"  # gated | running | done
    eligible: Callable[[], bool] = lambda: True
    deadline: float | None = None  # a timed wait's end, by the fake clock
    what: str = "start"
    go: str | None = None
    thread: threading.Thread | None = None
    cv: threading.Condition | None = None


@dataclass
class Commit:
    seq: int
    landed_step: int
    tombstone: bool
    row_ids: list[str]


@dataclass
class Call:
    """One agent call's row (or a clear), from submission to acknowledgement."""

    key: str
    rollout_ids: tuple[str, ...]
    process: str
    submit_step: int
    op: str = "row"
    start_step: int | None = None  # the call's start, when its look was taken (else its submission)
    ack_step: int | None = None
    seq: int | None = None
    failed: str | None = None

    @property
    def began(self) -> int:
        """The step from which this call's row must land above every commit durable (its look)."""
        return self.submit_step if self.start_step is None else self.start_step


class World:
    """The scheduler: one thread runs at a time; ``rng`` decides everything else."""

    def __init__(self, seed: int, *, kill_rate: float = 0.01, fault_rate: float = 0.08) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.kill_rate = kill_rate
        self.fault_rate = fault_rate
        self.now = 1_000.0
        self.step = 0
        self.closed = False
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # the scheduler's
        self.actors: list[Actor] = []
        self.running: Actor | None = None
        self.local = threading.local()
        self.trace: list[str] = []
        self.errors: list[str] = []

    # -- the actor's side

    def spawn(self, name: str, process: Process | None, target: Callable[[], None]) -> Actor:
        """A new thread, gated until the scheduler first picks it."""
        actor = Actor(name, process, cv=threading.Condition(self._lock))

        def run() -> None:
            self.local.actor = actor
            try:
                if self._wait_turn(actor) == "kill":
                    self.park()
                target()
            except Killed:
                pass
            except BaseException as exc:  # a crash in the code under test is a finding
                self.errors.append(f"{actor.name} raised {type(exc).__name__}: {exc}")
            finally:
                with self._cv:
                    actor.state = "done"
                    if self.running is actor:
                        self.running = None
                    self._cv.notify_all()

        with self._cv:
            self.actors.append(actor)
        actor.thread = threading.Thread(target=run, name=f"sim-{name}", daemon=True)
        actor.thread.start()
        return actor

    def current(self) -> Actor | None:
        return getattr(self.local, "actor", None)

    def gate(
        self, what: str, eligible: Callable[[], bool] = lambda: True, deadline: float | None = None
    ) -> str:
        """Give the turn back and wait to be picked; the scheduler's decision for this step."""
        actor = self.current()
        if actor is None:  # the test's own thread (the final read): no gates
            return "ok"
        if self.closed:
            raise Killed
        with self._cv:
            actor.state, actor.what, actor.eligible, actor.deadline = "gated", what, eligible, deadline
            self.running = None
            self._cv.notify_all()
        return self._wait_turn(actor)

    def _wait_turn(self, actor: Actor) -> str:
        assert actor.cv is not None
        with self._lock:
            while actor.go is None:
                if self.closed:
                    raise Killed
                actor.cv.wait()
            decision, actor.go = actor.go, None
            actor.state = "running"
            return decision

    def kill_check(self) -> None:
        """Called by a request when the scheduler killed the running actor's process at this step."""
        actor = self.current()
        if actor is not None and actor.process is not None and actor.process.dead:
            self.park()

    def park(self) -> None:
        """The running thread's process is dead: it stops here, for good."""
        actor = self.current()
        assert actor is not None
        with self._cv:
            actor.state = "done"
            self.running = None
            self._cv.notify_all()
            while not self.closed:
                assert actor.cv is not None
                actor.cv.wait()
        raise Killed

    # -- the scheduler's side

    def run(self, max_steps: int) -> None:
        """Run until every actor is done (or only dead ones remain); errors when stuck."""
        try:
            while True:
                with self._cv:
                    if not self._cv.wait_for(lambda: self.running is None, timeout=_REAL_TIMEOUT_S):
                        self.errors.append(f"step {self.step}: {self.running} blocked outside a gate")
                        return
                    live = [a for a in self.actors if a.state == "gated" and not self._dead(a)]
                    if not live:
                        return
                    ready = [a for a in live if a.eligible() or self._due(a)]
                    if not ready:
                        timed = [a.deadline for a in live if a.deadline is not None]
                        if not timed:
                            stuck = ", ".join(f"{a.name} at {a.what}" for a in live)
                            self.errors.append(f"step {self.step}: nothing can move ({stuck})")
                            return
                        self.now = max(self.now, min(timed))
                        continue
                    self.step += 1
                    if self.step > max_steps:
                        stuck = ", ".join(f"{a.name} at {a.what}" for a in live)
                        self.errors.append(f"no end after {max_steps} steps ({stuck})")
                        return
                    self.now += self.rng.choice((0.0, 0.001, 0.005, 0.02, 0.1))
                    actor = self.rng.choice(ready)
                    decision = "ok"
                    if actor.process is not None and self.rng.random() < self.kill_rate:
                        actor.process.dead = True
                        decision = "kill"
                    elif self.rng.random() < self.fault_rate:
                        decision = self.rng.choice(("fail", "lost", "exists"))
                    elif self.rng.random() < 0.2:
                        decision = "late"  # a request's answer comes back after other steps
                    self.trace.append(f"{self.step} {actor.name} {actor.what} {decision}")
                    actor.go = decision
                    self.running = actor
                    assert actor.cv is not None
                    actor.cv.notify()
        finally:
            self.close()

    def _dead(self, actor: Actor) -> bool:
        return actor.process is not None and actor.process.dead

    def _due(self, actor: Actor) -> bool:
        return actor.deadline is not None and self.now >= actor.deadline

    def close(self) -> None:
        """End the schedule: every thread still parked or gated raises :class:`Killed` and ends."""
        with self._lock:
            self.closed = True
            for actor in self.actors:
                assert actor.cv is not None
                actor.cv.notify_all()
        for actor in self.actors:
            if actor.thread is not None:
                actor.thread.join(timeout=5)


class SimClock:
    """The journal's clock seam, simulated: fake time, gated sleeps and waits, world threads."""

    def __init__(self, world: World, process: Process | None, name: str) -> None:
        self.world = world
        self.process = process
        self.name = name
        self._threads = 0

    def monotonic(self) -> float:
        return self.world.now

    def time(self) -> float:
        return self.world.now + _EPOCH

    def sleep(self, seconds: float) -> None:
        wake = self.world.now + seconds
        self._decide(self.world.gate(f"sleep {seconds:.3f}", lambda: False, wake))

    def condition(self) -> SimCondition:
        return SimCondition(self)

    def start_thread(self, target: Callable[[], None], name: str) -> None:
        self._threads += 1
        self.world.spawn(f"{self.name}/{name}-{self._threads}", self.process, target)

    def _decide(self, decision: str) -> None:
        if decision == "kill":
            self.world.park()


class SimCondition:
    """A condition variable whose waits are gates (woken by a notify, a timeout, or spuriously)."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self._notified: set[int] = set()
        self._active: set[int] = set()
        self._waits = 0

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        world = self._clock.world
        self._waits += 1
        token = self._waits
        deadline = None if timeout is None else world.now + timeout
        self._active.add(token)
        self._lock.release()
        try:
            self._clock._decide(world.gate("wait", lambda: token in self._notified, deadline))
        finally:
            self._lock.acquire()
            self._active.discard(token)
        notified = token in self._notified
        self._notified.discard(token)
        return notified

    def notify_all(self) -> None:
        self._notified |= self._active

    notify = notify_all


class SimStore:
    """A store with put-if-absent, whose every request is a gate: it may land, fail, land with its
    answer lost, or (``exists``) land with a retried request answering "already there"."""

    trust_mtime = False
    writes_in_place = False
    root = "sim://root"

    def __init__(
        self, world: World, *, readonly: bool = False, objects: dict[str, Any] | None = None
    ) -> None:
        self.world = world
        self.readonly = readonly
        self.objects: dict[str, tuple[bytes, int]] = (
            {} if objects is None else objects
        )  # path -> (body, step)
        self.mtimes: dict[str, float] = {}  # path -> when it was written, by the store's clock
        self.gone: dict[str, tuple[bytes, int]] = {}  # what a compaction removed (for check's history)
        self.capabilities = _SIM_CAPABILITIES

    def view(self, *, readonly: bool) -> SimStore:
        """The same objects, seen by a client that may (not) write."""
        twin = SimStore(self.world, readonly=readonly, objects=self.objects)
        twin.mtimes, twin.gone = self.mtimes, self.gone
        return twin

    def store_url(self) -> str:
        return self.root

    def require_put_if_absent(self) -> None:
        """The simulated store refuses a second create of a name."""

    def _land(self, path: str, data: bytes) -> None:
        self.objects[path] = (data, self.world.step)
        self.mtimes[path] = self.world.now + _EPOCH

    def upload(self, path: str, local: str) -> None:
        """A compacted part, PUT whole (under a name of its compactor's own)."""
        with open(local, "rb") as handle:
            data = handle.read()
        decision = self._request(f"put {path.rsplit('/', 1)[-1]}")
        self._may_write(decision, path)
        self._land(path, data)
        self._answer(decision)
        if decision == "lost":
            raise StoreFault(f"connection reset after PUT {path} landed")

    def remove(self, paths: list[str]) -> None:
        """A DELETE of each (a compaction removing what its generation replaced)."""
        if not paths:
            return
        decision = self._request(f"remove {len(paths)}")
        if self.readonly:
            self._answer(decision)
            raise PermissionError("403 Forbidden: DELETE")
        landing = paths if decision != "fail" else paths[: len(paths) // 2]  # a batch half done
        for path in landing:
            if path in self.objects:
                self.gone[path] = self.objects.pop(path)
        self._answer(decision)
        if decision in ("fail", "lost"):
            raise StoreFault("503 on DELETE")

    def read_iter(self, paths: list[str], step: int = 64) -> Iterator[bytes | None]:
        for start in range(0, len(paths), step):
            yield from self.read_many(paths[start : start + step])

    def read_ranges(self, ranges: list[tuple[str, int, int]], concurrency: int = 4) -> Iterator[bytes | None]:
        decision = self._request(f"read ranges {len(ranges)}")
        if decision == "fail":
            self._answer(decision)
            raise StoreFault("503 on GET")
        out = [self.objects[p][0][start:end] if p in self.objects else None for p, start, end in ranges]
        self._answer(decision)
        yield from out

    def list_under(self, prefix: str) -> list[tuple[str, Entry]]:
        """Every object under a folder, with its size and time (one LIST, as one request)."""
        decision = self._request("list under")
        if decision == "fail":
            self._answer(decision)
            raise StoreFault("503 on LIST")
        head = self.path(prefix.rstrip("/")) + "/"
        out = [
            (path[len(self.root) + 1 :], Entry(path, len(body), self.mtimes.get(path)))
            for path, (body, _) in sorted(self.objects.items())
            if path.startswith(head)
        ]
        self._answer(decision)
        return out

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _request(self, what: str) -> str:
        decision = self.world.gate(what)
        if decision == "kill":
            self.world.park()
        return decision

    def _answer(self, decision: str) -> None:
        """The answer's own trip back, when late: other requests may land before it arrives."""
        if decision == "late" and self.world.gate("answer") == "kill":
            self.world.park()

    def _may_write(self, decision: str, path: str) -> None:
        """A PUT's refusals: a client that may not write, a request the store failed."""
        if self.readonly:
            self._answer(decision)
            raise PermissionError(f"403 Forbidden: {path}")
        if decision == "fail":
            self._answer(decision)
            raise StoreFault(f"503 on PUT {path}")

    def create(self, path: str, data: bytes) -> None:
        decision = self._request(f"create {path.rsplit('/', 2)[-2:]}")
        self._may_write(decision, path)
        landed = path not in self.objects
        if landed:
            self._land(path, data)
        self._answer(decision)
        if decision == "lost" and landed:
            raise StoreFault(f"connection reset after PUT {path} landed")
        if not landed or decision == "exists":
            raise FileExistsError(path)

    def read_many(self, paths: list[str]) -> list[bytes | None]:
        decision = self._request(f"read {len(paths)}")
        if decision == "fail":
            self._answer(decision)
            raise StoreFault("503 on GET")
        out = [self.objects[p][0] if p in self.objects else None for p in paths]
        self._answer(decision)
        return out

    def exists(self, path: str) -> bool:
        return self.read_many([path])[0] is not None

    def existing(self, paths: list[str]) -> list[bool]:
        return [body is not None for body in self.read_many(paths)]

    def modified(self, paths: list[str]) -> list[float | None]:
        return [None for _ in paths]

    def list_names(self, folders: list[str]) -> list[dict[str, Named]]:
        """One level under each folder (a LIST a folder, as one request)."""
        decision = self._request(f"list {len(folders)}")
        if decision == "fail":
            self._answer(decision)
            raise StoreFault("503 on LIST")
        out = []
        for folder in folders:
            prefix = folder.rstrip("/") + "/"
            names: dict[str, Named] = {}
            for path, (body, _) in self.objects.items():
                if path.startswith(prefix):
                    name, below, _ = path[len(prefix) :].partition("/")
                    folder_path = prefix + name
                    names[name] = (
                        Named(name, folder_path, True) if below else Named(name, path, False, len(body))
                    )
            out.append(names)
        self._answer(decision)
        return out

    def commits(self, stream: str = "rows") -> Iterator[tuple[int, bytes, int]]:
        seq = 0
        every = {**self.gone, **self.objects}  # compacted commits too: what landed, ever
        while True:
            found = every.get(self.path(commit_name(seq, stream)))  # type: ignore[arg-type]
            if found is None:
                later = [s for s in range(seq + 1, seq + 64) if self.path(commit_name(s)) in every]
                if not later:
                    return
                seq = later[0]
                continue
            yield seq, found[0], found[1]
            seq += 1


@dataclass
class Scenario:
    """What one seed runs: writer processes, agents' calls, clears, readers."""

    seed: int
    processes: int = 2
    rollouts: int = 3
    calls: int = 4
    clears: bool = True
    readonly_reader: bool = True
    writable_reader: bool = True
    crash_at_end: bool = False  # every writer process killed while the last calls are in flight
    kill_rate: float = 0.03
    fault_rate: float = 0.08
    max_commit_entries: int | None = None  # a smaller bound, so submissions are held back by it
    max_steps: int = 6_000
    compactors: int = 0  # compaction processes, each trying a few times (killed like writers)

    @classmethod
    def with_compaction(cls, seed: int) -> Scenario:
        """A seed's scenario with compactors, agents that pause past the quiet period between calls
        (so a run is compacted between its calls), and readers refreshing on either side of
        ``CHECK_AFTER_S``."""
        rng = random.Random(seed * 104_729)
        return cls(
            seed,
            processes=rng.choice((1, 2, 3)),
            rollouts=rng.choice((2, 3)),
            calls=rng.choice((3, 4)),
            kill_rate=rng.choice((0.0, 0.01, 0.03)),
            fault_rate=rng.choice((0.0, 0.08, 0.2)),
            max_commit_entries=rng.choice((None, 1, 2)),
            writable_reader=rng.random() < 0.7,
            crash_at_end=rng.random() < 0.2,
            compactors=rng.choice((1, 2, 2, 3)),
            max_steps=20_000,
        )

    @classmethod
    def of(cls, seed: int) -> Scenario:
        """The scenario a seed runs: its shape drawn from the seed too."""
        rng = random.Random(seed * 7_919)
        return cls(
            seed,
            processes=rng.choice((1, 2, 3, 3)),
            rollouts=rng.choice((2, 3, 4)),
            calls=rng.choice((3, 4, 6)),
            kill_rate=rng.choice((0.0, 0.01, 0.03, 0.05)),
            fault_rate=rng.choice((0.0, 0.08, 0.2)),
            max_commit_entries=rng.choice((None, None, 1, 2)),
            writable_reader=rng.random() < 0.7,
            crash_at_end=rng.random() < 0.3,
        )


@dataclass
class Outcome:
    """What a schedule did, for :func:`check`."""

    world: World
    store: SimStore
    calls: list[Call] = field(default_factory=list)
    final: dict[str, list[str]] = field(default_factory=dict)  # rollout -> row keys, as read
    compactions: list[str] = field(default_factory=list)  # each compaction's status, in order
    compacted_final: dict[str, list[str]] | None = None  # the final read after a last compaction
    left: list[str] = field(default_factory=list)  # the journal's objects after it
    manifest_files: list[str] = field(default_factory=list)  # what its manifest names
    readonly_rows: dict[str, list[str]] = field(default_factory=dict)
    readonly_gaps: dict[str, list[str]] = field(default_factory=dict)


def _row_keys(reader: JournalReader, rollout_ids: list[str]) -> dict[str, list[str]]:
    view = reader.view(rollout_ids)
    out = {}
    for rollout_id in rollout_ids:
        parsed = new_parsed_rows()
        view.add_rows(rollout_id, parsed)
        out[rollout_id] = [cast(dict[str, Any], row)["key"] for _, row in parsed.rows]
    return out


def simulate(scenario: Scenario) -> Outcome:
    """Run one seeded schedule to its end, then read the journal back with a fresh reader."""
    world = World(scenario.seed, kill_rate=scenario.kill_rate, fault_rate=scenario.fault_rate)
    rng = random.Random(scenario.seed ^ 0x5EED)
    store = SimStore(world)
    outcome = Outcome(world, store)
    rollout_ids = [f"r{i}" for i in range(scenario.rollouts)]
    processes: list[Process] = []

    def start_process() -> Process:
        process = Process(f"p{len(processes)}")
        clock = SimClock(world, process, process.name)
        in_flight = rng.choice((1, 2, 2, 3, 4))
        view = cast(Backend, store.view(readonly=False))
        process.writer = JournalWriter(
            view,
            "rows",
            in_flight=in_flight,
            clock=clock,
            tail_hint=(lambda: floors_of(newest_manifest(view))["rows"]) if scenario.compactors else None,
        )
        process.writer.look_delay_s = rng.choice((0.0, writer_module.LOOK_DELAY_S))  # paced by answers
        process.writer.look_in_flight = rng.choice((1, 1, 2, 3))
        # Below 0: more than one look at once whatever rows wait (after a writer's first look), as
        # producers set it behind a slow store; drawn apart, leaving the schedules' draws as they were.
        pacing = random.Random(f"{scenario.seed}:{process.name}")
        process.writer.rows_wait_share = pacing.choice((writer_module.ROWS_WAIT_SHARE, -1.0))
        processes.append(process)
        return process

    for _ in range(scenario.processes):
        start_process()
    done_agents = [0]
    last_submitted = [0]

    def agent(rollout_id: str, index: int) -> None:
        agent_rng = random.Random(scenario.seed * 1_000 + index)
        clock = SimClock(world, None, f"agent-{rollout_id}")
        for n in range(scenario.calls):
            if scenario.compactors and n and agent_rng.random() < 0.4:  # a long think between calls
                clock.sleep(agent_rng.choice((40.0, 150.0, 300.0)))
            alive = [p for p in processes if not p.dead]
            if not alive or agent_rng.random() < 0.1:
                alive = [start_process()]  # a proxy restarted, or one more started
            process = agent_rng.choice(alive)
            assert process.writer is not None
            key = f"{rollout_id}:{n}"
            look = None
            started = world.step
            if agent_rng.random() < 0.75:  # a producer's call: the look at its start, then the upstream
                look = process.writer.look()
                clock.sleep(agent_rng.choice((0.0, 0.001, 0.01, 0.05, 0.2)))
                if process.dead:  # the proxy died while the upstream answered: no row
                    last_submitted[0] += n == scenario.calls - 1
                    outcome.calls.append(Call(key, (rollout_id,), process.name, world.step, failed="killed"))
                    continue
            call = Call(key, (rollout_id,), process.name, world.step, start_step=started if look else None)
            future = process.writer.submit([row_entry(rollout_id, {"key": key})], look=look)
            last_submitted[0] += n == scenario.calls - 1
            await_call(call, process, future)
        done_agents[0] += 1

    def await_call(call: Call, process: Process, future: Any) -> None:
        outcome.calls.append(call)
        world.gate(f"await {call.key}", lambda: future.done() or process.dead)
        if future.done():
            exc = future.exception()
            if exc is None:
                call.ack_step, call.seq = world.step, future.result()
            else:
                call.failed = f"{type(exc).__name__}: {exc}"
        else:
            call.failed = "process killed"

    def harness() -> None:
        """Clears of two rollouts at a time, at any moment (racing the agents' calls)."""
        harness_rng = random.Random(scenario.seed * 31 + 7)
        clock = SimClock(world, None, "harness")
        for n in range(harness_rng.choice((1, 2, 3))):
            clock.sleep(harness_rng.choice((0.0, 0.01, 0.05, 0.2, 1.0)))
            alive = [p for p in processes if not p.dead]
            if not alive:
                return
            process = harness_rng.choice(alive)
            assert process.writer is not None
            targets = tuple(harness_rng.sample(rollout_ids, min(2, len(rollout_ids))))
            call = Call(f"clear{n}", targets, process.name, world.step, op="clear")
            await_call(call, process, process.writer.submit([clear_entry(r) for r in targets]))

    for index, rollout_id in enumerate(rollout_ids):
        world.spawn(f"agent-{rollout_id}", None, lambda r=rollout_id, i=index: agent(r, i))
    if scenario.clears:
        world.spawn("harness", None, harness)

    def crash() -> None:
        """Every writer process killed at once, some time after the last calls were submitted."""
        world.gate("crash", lambda: last_submitted[0] >= len(rollout_ids))
        for process in processes:
            process.dead = True

    if scenario.crash_at_end:
        world.spawn("crash", None, crash)

    readers: dict[str, JournalReader] = {}

    def reading(name: str, readonly: bool) -> None:
        clock = SimClock(world, None, name)
        reader = JournalReader(cast(Backend, store.view(readonly=readonly)), clock=clock)
        readers[name] = reader

        def refresh(retries: int) -> None:
            for _ in range(retries + 1):
                try:
                    reader.refresh()
                    return
                except StoreFault:
                    clock.sleep(0.3)  # a failed GET: a task's retry reads again

        pauses = (0.05, 0.5, 2.0) if not scenario.compactors else (0.5, 2.0, 20.0, 90.0)
        while done_agents[0] < len(rollout_ids):
            refresh(0)
            clock.sleep(rng.choice(pauses))
        refresh(50)
        for _ in range(2):  # twice past the grace: what a hole holds is read, or reported
            clock.sleep(6.0)
            refresh(50)

    def compacting(index: int, process: Process) -> None:
        """A compaction process: a few tries at moments of its own (a command or a flow's task,
        run again after a storage fault); refused while the journal may still be written."""
        own = random.Random(scenario.seed * 97 + index)
        clock = SimClock(world, process, process.name)
        view = cast(Backend, store.view(readonly=False))
        for _ in range(own.choice((2, 3, 4))):
            clock.sleep(own.choice((1.0, 30.0, 130.0, 200.0, 400.0)))
            try:
                done = compact_root(view, clock=clock, remove_after_s=own.choice((DELETE_AFTER_S, None)))
            except StoreFault:
                outcome.compactions.append("failed")
                continue
            outcome.compactions.append(done.status)

    for index in range(scenario.compactors):
        process = Process(f"compactor{index}")
        world.spawn(process.name, process, lambda i=index, p=process: compacting(i, p))

    if scenario.writable_reader:
        world.spawn("reader", None, lambda: reading("reader", False))
    if scenario.readonly_reader:
        world.spawn("readonly-reader", None, lambda: reading("readonly-reader", True))

    bound = writer_module.MAX_COMMIT_ENTRIES
    if scenario.max_commit_entries is not None:
        writer_module.MAX_COMMIT_ENTRIES = scenario.max_commit_entries
    try:
        world.run(scenario.max_steps)
    finally:
        writer_module.MAX_COMMIT_ENTRIES = bound

    world.now += 3_600.0  # the final read: long after, by a reader allowed to fill holes
    final = JournalReader(cast(Backend, store.view(readonly=False)), clock=SimClock(world, None, "final"))
    for _ in range(3):  # a hole is filled once seen older than the grace
        final.refresh()
        world.now += 10.0
    outcome.final = _row_keys(final, rollout_ids)
    if scenario.compactors:  # the run over: compacted once more, then read by a fresh reader
        world.now += 3_600.0
        last = compact_root(
            cast(Backend, store.view(readonly=False)),
            clock=SimClock(world, None, "last-compaction"),
            remove_after_s=0,
        )
        outcome.compactions.append(f"last: {last.status}")
        fresh = JournalReader(cast(Backend, store.view(readonly=True)), clock=SimClock(world, None, "after"))
        fresh.refresh()
        outcome.compacted_final = _row_keys(fresh, rollout_ids)
        outcome.left = sorted(p for p in store.objects if "/_journal/" in p)
        manifest = fresh.generation
        if manifest is not None:
            outcome.manifest_files = sorted(
                [store.path(manifest_name(manifest.generation))]
                + [manifest.part_path(cast(Backend, store), i) for i in range(len(manifest.parts))]
            )
    if "readonly-reader" in readers:
        readonly = readers["readonly-reader"]
        outcome.readonly_rows = _row_keys(readonly, rollout_ids)
        outcome.readonly_gaps = {r: readonly_holes(readonly, r) for r in rollout_ids}
    return outcome


def readonly_holes(reader: JournalReader, rollout_id: str) -> list[str]:
    """What a reader says it could not read past for a rollout (its pending gaps' details)."""
    return list(reader.view([rollout_id]).holes)


def _landed(store: SimStore) -> dict[str, tuple[int, int]]:
    """Each row key in the store: (commit number, the step its commit landed)."""
    out = {}
    for seq, body, step in store.commits():
        commit = decode_commit(seq, body)
        for index, (op, _, _) in enumerate(commit.headers):
            if op == "row":
                out[orjson.loads(commit.line(index))["key"]] = (seq, step)
    return out


def check(outcome: Outcome) -> list[str]:
    """The protocol's invariants, each broken one a line naming the seed's evidence."""
    problems = list(outcome.world.errors)
    if outcome.compacted_final is not None:
        if outcome.compacted_final != outcome.final:
            problems.append(f"compacted, the journal reads {outcome.compacted_final}, not {outcome.final}")
        if outcome.left != outcome.manifest_files:
            problems.append(
                f"after the last compaction the journal holds {outcome.left}, not its generation alone"
            )
        last = outcome.compactions[-1]
        empty = last == "last: no journal" and not any(True for _ in outcome.store.commits())
        if not empty and (not last.startswith("last: ") or "compacted" not in last):
            problems.append(f"the last compaction did not finish: {last}")  # (every write lost: none)
    landed = _landed(outcome.store)
    clears = [c for c in outcome.calls if c.op == "clear"]
    for rollout_id, keys in outcome.final.items():
        if len(keys) != len(set(keys)):
            problems.append(f"{rollout_id}: a row read twice: {keys}")
        position = {k: i for i, k in enumerate(keys)}
        mine = [c for c in outcome.calls if c.op == "row" and c.rollout_ids == (rollout_id,)]
        for call in mine:
            if call.ack_step is None or call.key in position:
                continue
            voided = any(rollout_id in c.rollout_ids and not _before(c, call) for c in clears)
            if not voided:
                problems.append(
                    f"{call.key}: acknowledged at step {call.ack_step} (commit {call.seq}), never read"
                )
        for a in mine:
            for b in mine:
                if a.key not in position or b.key not in position or position[a.key] < position[b.key]:
                    continue
                if a.ack_step is not None and a.ack_step < b.submit_step:
                    problems.append(
                        f"{rollout_id}: {a.key} acknowledged (step {a.ack_step}) before {b.key} was "
                        f"submitted (step {b.submit_step}) but read after it"
                    )
                elif a.key in landed and landed[a.key][1] < b.began:
                    problems.append(
                        f"{rollout_id}: {a.key} durable in commit {landed[a.key][0]} (step "
                        f"{landed[a.key][1]}) before {b.key} began (step {b.began}), "
                        f"but {b.key} was put below it, in commit {landed.get(b.key, ('?',))[0]}"
                    )
        for clear in clears:
            if rollout_id not in clear.rollout_ids or clear.ack_step is None:
                continue
            for call in mine:
                if call.ack_step is None or call.key in position:
                    continue
                later_clear = any(
                    rollout_id in c.rollout_ids and c is not clear and not _before(c, call) for c in clears
                )
                same_writer_after = call.process == clear.process and clear.submit_step < call.submit_step
                if (_before(clear, call) or same_writer_after) and not later_clear:
                    problems.append(
                        f"{call.key}: submitted after {clear.key} "
                        f"({'acknowledged' if _before(clear, call) else 'queued on the same writer'}) "
                        f"yet voided by it"
                    )
        readonly = outcome.readonly_rows.get(rollout_id)
        reported = bool(outcome.readonly_gaps.get(rollout_id))
        if readonly is not None and readonly != keys[: len(readonly)] and not reported:
            problems.append(f"{rollout_id}: the read-only reader read {readonly}, not a prefix of {keys}")
        if readonly is not None and keys[len(readonly) :] and not reported:
            problems.append(
                f"{rollout_id}: the read-only reader misses rows {keys[len(readonly) :]} and reports no hole"
            )
    return problems


def _before(first: Call, then: Call) -> bool:
    """``first`` was acknowledged before ``then`` was submitted."""
    return first.ack_step is not None and first.ack_step < then.submit_step
