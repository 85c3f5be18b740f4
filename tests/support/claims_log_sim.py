"""A seeded simulation of the claims log, run on the real writer and reader over a real folder.

Each simulated producer process is a real ``ClaimsLogWriter`` with its own locked log files
(``flock`` locks belong to open files, so a reader's own open of a log conflicts with a writer's
lock in one process as across processes); it is taken out of the process's own-logs registry, so
the reader judges it by its lock alone, as it judges other processes. A kill closes its files
(the kernel drops the lock) without another line, sometimes after half a line (a torn write); a
short write is a line cut by a full disk while the writer lives on. One ``random.Random(seed)``
picks every step: claims, releases, kills, new writers, reads, clears, rotations (a small
``max_bytes``). After every read :func:`check_read` states the invariants.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import orjson

from rollout_capture import claims_log
from rollout_capture.claims import Claim, current_time, new_claim
from rollout_capture.claims_log import ClaimsLogReader, ClaimsLogWriter


@dataclass
class SimWriter:
    name: str
    writer: ClaimsLogWriter
    dead: bool = False
    open: dict[str, str] = field(default_factory=dict)  # claim id -> rollout, acknowledged, not released


@dataclass
class Outcome:
    seed: int
    steps: int = 0
    problems: list[str] = field(default_factory=list)


def _claim(rng: random.Random, n: int) -> Claim:
    """A claim whose line is the same in any process (host, pid, id and time from the seed), so a
    schedule (rotation points, where a line is cut) replays exactly."""
    claim = new_claim(f"m{n}", 30.0)
    claim.claim_id = f"{rng.getrandbits(128):032x}"
    claim.host, claim.pid, claim.claimed_at = "sim-host", 4242, 1_700_000_000.0 + n
    return claim


def _kill(sim: SimWriter, rng: random.Random) -> None:
    """The writer process dies: maybe mid-line, then every file of it closed, nothing more written."""
    logs = list(sim.writer._logs.values())
    if logs and rng.random() < 0.5:
        line = orjson.dumps(["claim", "r0", {"claim_id": "torn", "claimed_at": 1.0}]) + b"\n"
        os.write(logs[-1].fd, line[: rng.randrange(1, len(line))])  # killed mid-append
    for log in logs:
        os.close(log.fd)
    sim.writer._logs.clear()
    sim.writer._finalizer.detach()
    sim.dead = True


def _short_write_once(rng: random.Random) -> Callable[[int, bytes], int]:
    real = os.write
    used = [False]

    def write(fd: int, data: bytes) -> int:
        if not used[0]:
            used[0] = True
            return real(fd, bytes(data)[: rng.randrange(1, len(data))])
        return real(fd, data)

    return write


def check_read(
    reader: ClaimsLogReader, writers: list[SimWriter], rollouts: list[str], step: int
) -> list[str]:
    """After a read: a live writer's acknowledged open claims are all seen and live, whatever the
    clocks; a dead writer's are seen and abandoned; nothing released or cleared is seen."""
    problems = []
    now = current_time()
    seen = {c.claim_id: c for found in reader.claims(rollouts).values() for c in found}
    expected = {cid: sim for sim in writers for cid in sim.open}
    for claim_id, sim in expected.items():
        claim = seen.get(claim_id)
        if claim is None:
            problems.append(f"step {step}: {sim.name}'s open claim {claim_id} not seen (dead={sim.dead})")
        elif not sim.dead and not (claim.is_live(now) and claim.is_live(now + 7_200) and claim.is_live(0.0)):
            problems.append(f"step {step}: live {sim.name}'s claim {claim_id} not live at every clock")
        elif sim.dead and claim.is_live(now):
            problems.append(f"step {step}: dead {sim.name}'s claim {claim_id} still live")
    for claim_id in set(seen) - set(expected):
        problems.append(f"step {step}: claim {claim_id} seen, but never acknowledged, or released or cleared")
    return problems


def simulate(seed: int, steps: int = 60) -> Outcome:
    """One seeded schedule over a fresh capture root."""
    rng = random.Random(seed)
    outcome = Outcome(seed)
    root = tempfile.mkdtemp(prefix="claims-sim-")
    rollouts = [f"r{i}" for i in range(rng.choice((1, 2, 3)))]
    max_bytes = rng.choice((150, 400, 1 << 20))
    writers: list[SimWriter] = []
    reader = ClaimsLogReader(root)
    counter = [0]

    def start() -> SimWriter:
        writer = ClaimsLogWriter(root, max_bytes=max_bytes)
        claims_log._writers.discard(writer)  # judged by its lock, as another process would be
        sim = SimWriter(f"w{len(writers)}", writer)
        writers.append(sim)
        return sim

    try:
        start()
        for step in range(steps):
            outcome.steps += 1
            alive = [w for w in writers if not w.dead]
            pick = rng.random()
            if not alive or pick < 0.05:
                start()
            elif pick < 0.45:
                sim = rng.choice(alive)
                counter[0] += 1
                claim = _claim(rng, counter[0])
                rollout = rng.choice(rollouts)
                short = rng.random() < 0.05
                try:
                    with _writes(rng, short):
                        sim.writer.claim(rollout, claim)
                except OSError:
                    continue  # cut short: not acknowledged, never read (nor a later line lost in it)
                sim.open[claim.claim_id] = rollout
            elif pick < 0.75:
                candidates = [w for w in alive if w.open]
                if candidates:
                    sim = rng.choice(candidates)
                    claim_id = rng.choice(sorted(sim.open))
                    short = rng.random() < 0.05
                    try:
                        with _writes(rng, short):
                            sim.writer.release(sim.open[claim_id], claim_id)
                    except OSError:
                        continue  # cut short: the claim stays open (abandoned once its writer is gone)
                    del sim.open[claim_id]
            elif pick < 0.8:
                _kill(rng.choice(alive), rng)
            elif pick < 0.85:
                targets = rng.sample(rollouts, rng.randrange(1, len(rollouts) + 1))
                try:
                    ClaimsLogReader(root).clear(targets)  # another process: the harness before dispatch
                except OSError as exc:
                    outcome.problems.append(f"step {step}: clearing {targets} failed: {exc}")
                for sim in writers:
                    sim.open = {c: r for c, r in sim.open.items() if r not in targets}
            else:
                reader.refresh()
                outcome.problems += check_read(reader, writers, rollouts, step)
            if outcome.problems:
                break
        reader.refresh()
        outcome.problems += check_read(reader, writers, rollouts, steps)
        fresh = ClaimsLogReader(root)  # one that never read before: the same answer
        fresh.refresh()
        outcome.problems += check_read(fresh, writers, rollouts, steps + 1)
    finally:
        for sim in writers:
            if not sim.dead:
                _kill(sim, rng)
        shutil.rmtree(root, ignore_errors=True)
    return outcome


def _writes(rng: random.Random, short: bool) -> contextlib.AbstractContextManager[Any]:
    """The next line written cut short (a full disk), or written as usual."""
    return (
        mock.patch.object(claims_log.os, "write", _short_write_once(rng))
        if short
        else contextlib.nullcontext()
    )
