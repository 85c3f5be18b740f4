"""The journal protocol under a seeded simulation of its interleavings, faults and kills.

The real ``JournalWriter`` and ``JournalReader`` run against a simulated store and clock
(``tests/support/journal_sim.py``): one thread at a time, every request, sleep and wait a point
where a seeded scheduler picks what happens next (a put lands, fails, lands with its answer
lost or late; a writer process is killed). Invariants, after every schedule:

- every acknowledged row is read exactly once (unless a clear not acknowledged before it voids it);
- per rollout, rows read in acknowledgement order, and no row put below a commit that was durable
  before the row's call began: its look, taken at the call's start (``JournalWriter.look``), or,
  for a row submitted without one, its submission (spec 2: numbered above all that existed);
- a clear never voids a row submitted after it was acknowledged, or queued after it on one writer;
- every writer, reader and agent ends (no schedule runs out of steps or blocks outside a gate);
- a reader that may not write, stopped at a hole it cannot fill, reports it for every rollout.

A failing seed replays alone: ``pytest tests/test_journal_sim.py --sim-seed N``
(or ``ROLLOUT_CAPTURE_SIM_SEED=N``); ``ROLLOUT_CAPTURE_SIM_SEEDS`` sets how many run.
"""

from __future__ import annotations

import logging
import os

import pytest

from tests.support.journal_sim import Scenario, check, simulate

SEEDS = int(os.environ.get("ROLLOUT_CAPTURE_SIM_SEEDS", "1500"))
CHUNKS = 6  # the seeds in a few tests, so a failure names its range


def _seeds(config: pytest.Config, chunk: int) -> list[int]:
    one = config.getoption("--sim-seed") or os.environ.get("ROLLOUT_CAPTURE_SIM_SEED")
    if one is not None:
        return [int(one)] if chunk == 0 else []
    size = -(-SEEDS // CHUNKS)
    return list(range(chunk * size, min(SEEDS, (chunk + 1) * size)))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_the_journal_keeps_its_invariants_under_every_simulated_schedule(
    chunk: int, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="rollout_capture.journal")
    failures = []
    steps = 0
    for seed in _seeds(request.config, chunk):
        outcome = simulate(Scenario.of(seed))
        steps += outcome.world.step
        problems = check(outcome)
        if problems:
            failures.append(f"seed {seed}: " + "; ".join(problems[:3]))
    assert not failures, (
        f"{len(failures)} schedule(s) broke an invariant (replay one: pytest "
        f"tests/test_journal_sim.py --sim-seed N):\n" + "\n".join(failures[:10])
    )


@pytest.mark.parametrize("blind", ["the look at a call's start", "the look before a put"])
def test_the_simulation_finds_a_row_put_below_a_dead_writers_commit(blind: str) -> None:
    """The simulation can fail: with either look switched off (the one at a call's start, which
    then sees nothing; or the one above its number before a row without a look is put), the
    schedule of item 1 (a dead writer's commit above a hole, the rollout's next row put in the
    hole) is found among the first seeds (writers killed at 10% of their steps: a rare schedule,
    found by seed 75-115 so, where at 5% it took 270-1,800 seeds, moving with any change of steps)."""
    from rollout_capture.journal import writer as writer_module

    cls = writer_module.JournalWriter
    name = "_look_once" if blind.startswith("the look at") else "_above_all"
    original = getattr(cls, name)
    blinded = (lambda self: -1) if name == "_look_once" else (lambda self, seq, headers: seq)
    setattr(cls, name, blinded)
    try:
        found = []
        for seed in range(600):
            problems = check(simulate(Scenario(seed, calls=6, processes=3, kill_rate=0.1)))
            if any("put below it" in p for p in problems):
                found.append(seed)
                break
    finally:
        setattr(cls, name, original)
    assert found, f"with {blind} off, no schedule put a row below a commit durable before its call began"
