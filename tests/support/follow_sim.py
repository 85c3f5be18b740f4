"""A seeded simulation of following a run: the real follower, tail and live file over a real run
folder, a harness appending records (some still claimed, some not JSON), and kills.

One ``random.Random(seed)`` picks every step: a record lands (its rows written first, or its claim
still open), a claim is released (its row written), a row lands late for a record already live,
time passes (the simulation's clock: quiescence deadlines lapse when it says), the follower takes a
step, or the follower is killed (between steps, or in the middle of writing a round: a prefix of
its bytes written, then nothing more), and a new one starts. Then the run finishes (``_SUCCESS``,
perhaps after a last line without its newline) and the follower runs to its end.

The invariants, checked at the end and as each round is written:

- line ``n`` of the live output is the enrichment of line ``n`` of the rollouts, each exactly once,
  none missing, however many followers were killed (a cut line is never left, never doubled);
- a line is never written while its rollout holds a claim the harness has not released, unless its
  quiescence timeout has passed since it landed (then it carries the pending gap).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from rollout_capture import CaptureStore
from rollout_capture.following import Follower, FollowSettings
from rollout_capture.live_output import LiveFile
from rollout_capture.rollout_tail import RunRollouts
from rollout_capture.run_folders import LIVE, SUCCESS, run_folder

TIMEOUT_S = 5.0
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
"""Memory-backed where there is one: a schedule's fsyncs cost nothing there, and it checks no disk."""
ROW = {"dialect": "chat", "status_code": 200, "response": {"usage": {"prompt_tokens": 3}}}


class Killed(Exception):
    """The follower's process died here."""


@dataclass
class Outcome:
    seed: int
    steps: int = 0
    kills: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class _Harness:
    run: Path
    rng: random.Random
    now: float = 1_000.0
    lines: list[bytes] = field(default_factory=list)
    landed_at: list[float] = field(default_factory=list)
    ids: list[str | None] = field(default_factory=list)
    claims: dict[str, object] = field(default_factory=dict)  # rollout id -> its open claim
    tail_cut: bool = False

    def __post_init__(self) -> None:
        self.store = CaptureStore(self.run / "captures")

    def land(self) -> None:
        """A record lands (or a line that is not one), its rows written first or its claim open."""
        number = len(self.lines)
        kind = self.rng.random()
        if kind < 0.08:
            line, rollout = b"not json {", None
        elif kind < 0.12:
            line, rollout = b"", None
        else:
            rollout = f"{number}-0"
            for call in range(self.rng.randrange(0, 3)):
                self.store.record(rollout, {**ROW, "model_call_id": f"{rollout}-{call}"})
            if self.rng.random() < 0.25:
                claim = self.store.claim(rollout, f"{rollout}-late", ttl_s=3600)
                claim.__enter__()
                self.claims[rollout] = claim
            line = orjson.dumps({"_ng_task_index": number, "_ng_rollout_index": 0, "reward": 1.0})
        with open(self.run / "rollouts.jsonl", "ab") as handle:
            handle.write(line + b"\n")
        self.lines.append(line)
        self.landed_at.append(self.now)
        self.ids.append(rollout)

    def release(self) -> None:
        if not self.claims:
            return
        rollout = self.rng.choice(sorted(self.claims))
        self.store.record(rollout, {**ROW, "model_call_id": f"{rollout}-claimed"})
        self.claims.pop(rollout).__exit__(None, None, None)  # type: ignore[attr-defined]

    def late_row(self) -> None:
        known = [rollout for rollout in self.ids if rollout is not None]
        if known:
            rollout = self.rng.choice(known)
            self.store.record(rollout, {**ROW, "model_call_id": f"{rollout}-late-{self.rng.getrandbits(16)}"})

    def finish(self) -> None:
        if self.rng.random() < 0.3:  # a last line without its newline
            number = len(self.lines)
            line = orjson.dumps({"_ng_task_index": number, "_ng_rollout_index": 0})
            with open(self.run / "rollouts.jsonl", "ab") as handle:
                handle.write(line)
            self.lines.append(line)
            self.landed_at.append(self.now)
            self.ids.append(f"{number}-0")
        (self.run / SUCCESS).write_bytes(b"")


class _CheckedLive(LiveFile):
    """The live file, each round checked as it is written, and killed mid-write when told."""

    def __init__(self, path: str, harness: _Harness, outcome: Outcome) -> None:
        super().__init__(path)
        self.harness, self.outcome = harness, outcome
        self.cut_at: int | None = None  # kill the next append after this many bytes

    def append(self, first_line: int, lines: Sequence[bytes]) -> None:
        harness = self.harness
        for number in range(first_line, first_line + len(lines)):
            rollout = harness.ids[number - 1]
            landed = harness.landed_at[number - 1]
            if rollout in harness.claims and harness.now < landed + TIMEOUT_S:
                self.outcome.problems.append(
                    f"line {number} ({rollout}) written while claimed, "
                    f"{harness.now - landed:.1f} s after it landed"
                )
        if self.cut_at is not None:
            data = b"".join(line + b"\n" for line in lines)
            assert self._fd is not None
            os.lseek(self._fd, 0, os.SEEK_END)
            os.write(self._fd, data[: self.cut_at % max(1, len(data))])
            raise Killed
        super().append(first_line, lines)


def simulate(seed: int, steps: int = 40) -> Outcome:
    """One schedule; its problems (none: every invariant held)."""
    rng = random.Random(seed)
    outcome = Outcome(seed)
    folder = Path(tempfile.mkdtemp(prefix="follow-sim-", dir=SCRATCH))
    try:
        run = folder / "runs" / "r"
        (run / "captures").mkdir(parents=True)
        (run / "_STARTED").write_bytes(b"")
        harness = _Harness(run, rng)
        follower, live = _start(harness, outcome)
        for _ in range(steps):
            outcome.steps += 1
            action = rng.random()
            try:
                if action < 0.35:
                    harness.land()
                elif action < 0.45:
                    harness.release()
                elif action < 0.5:
                    harness.late_row()
                elif action < 0.6:
                    harness.now += rng.choice((0.5, 2.0, TIMEOUT_S))
                elif action < 0.68:
                    _kill(follower, live)  # between steps
                    follower, live = _start(harness, outcome)
                    outcome.kills += 1
                elif action < 0.72:
                    live.cut_at = rng.randrange(1, 1 << 16)
                    follower.step()
                else:
                    follower.step()
            except Killed:
                _kill(follower, live)
                follower, live = _start(harness, outcome)
                outcome.kills += 1
        harness.finish()
        for _ in range(1000):
            try:
                if follower.step() == "finished":
                    break
            except Killed:  # a kill told before the end, met now
                _kill(follower, live)
                follower, live = _start(harness, outcome)
                outcome.kills += 1
            harness.now += 1.0  # held lines wait for their claims or their deadline, then go
        else:
            outcome.problems.append("the follower never finished")
        _kill(follower, live)
        _check(harness, outcome)
        for claim in harness.claims.values():
            claim.__exit__(None, None, None)  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return outcome


def _kill(follower: Follower, live: LiveFile) -> None:
    """The follower's process is gone: its files closed (its lock goes with them)."""
    live.close()
    follower.tail.close()


def _start(harness: _Harness, outcome: Outcome) -> tuple[Follower, _CheckedLive]:
    """A follower started afresh (a process started again), as the flow starts one."""
    state, folder = run_folder(str(harness.run), needs="started")
    live = _CheckedLive(str(harness.run / LIVE), harness, outcome)
    settings = FollowSettings(quiescence_timeout_s=TIMEOUT_S, batch_size=7, poll_s=0.0, state_s=0.0)
    follower = Follower(
        folder, RunRollouts(folder, state.url), live, [harness.store], settings, clock=lambda: harness.now
    )
    follower.start()
    return follower, live


def _check(harness: _Harness, outcome: Outcome) -> None:
    written = (harness.run / LIVE).read_bytes()
    if written and not written.endswith(b"\n"):
        outcome.problems.append("the live output ends in a cut line")
    live = written.split(b"\n")[:-1] if written else []
    if len(live) != len(harness.lines):
        outcome.problems.append(f"{len(live)} live line(s) for {len(harness.lines)} landed")
    for number, (line, enriched) in enumerate(zip(harness.lines, live, strict=False), 1):
        rollout = harness.ids[number - 1]
        same = (
            enriched == line
            if rollout is None
            else enriched.startswith(line[:-1] + b',"ng_model_call_capture"')
        )
        if not same:
            outcome.problems.append(f"live line {number} is not the enrichment of rollouts line {number}")
            break
