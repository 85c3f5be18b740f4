"""Following a run in the core: the follower's rounds under a seeded simulation of landings,
claims, late rows and kills (``tests/support/follow_sim.py``), and what a round holds back.

A failing seed replays alone: ``pytest tests/test_following.py --sim-seed N``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.follow_sim import simulate

SEEDS = int(os.environ.get("ROLLOUT_CAPTURE_SIM_SEEDS", "1500")) // 5
"""Schedules: a fifth of the other simulations' (each enriches real captures in rounds)."""


def test_following_keeps_its_invariants_under_every_simulated_schedule(
    request: pytest.FixtureRequest,
) -> None:
    one = request.config.getoption("--sim-seed") or os.environ.get("ROLLOUT_CAPTURE_SIM_SEED")
    seeds = [int(one)] if one is not None else range(SEEDS)
    outcomes = [simulate(seed) for seed in seeds]
    failures = [f"seed {o.seed}: " + "; ".join(o.problems[:2]) for o in outcomes if o.problems]
    assert not failures, f"{len(failures)} schedule(s) broke an invariant:\n" + "\n".join(failures[:10])
    assert one is not None or sum(o.kills for o in outcomes) > len(outcomes) // 2  # kills were simulated


def test_the_simulation_finds_a_cut_line_left_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """It can fail: a restarted follower that appends after a cut line (the cut never removed)."""
    from rollout_capture import live_output

    monkeypatch.setattr(live_output, "_cut_to_last_line", lambda fd: os.fstat(fd).st_size)
    assert any(simulate(seed).problems for seed in range(200))


def test_the_simulation_finds_a_line_written_while_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """It can fail: a follower whose round writes whatever its claims say (no line held)."""
    from rollout_capture.following import Follower

    enrich = Follower._enrich
    monkeypatch.setattr(Follower, "_enrich", lambda self, batch, noted: enrich(self, batch, set()))
    assert any(simulate(seed).problems for seed in range(200))


@pytest.mark.parametrize(
    ("live", "why"),
    [
        (b'{"_ng_task_index": 1, "_ng_rollout_index": 0, "ng_model_call_capture": {}}\n', "line 1 is not"),
        (b"{}\n" * 4, "the rollouts hold only 3"),
    ],
)
def test_a_live_output_that_is_not_the_runs_is_refused_naming_it(
    tmp_path: Path, live: bytes, why: str
) -> None:
    """A restarted follower checks that the live output is this run's (its count, and its last line
    the enrichment of the rollouts' line there): the rollouts rewritten since (a collection that
    resumed and cut or migrated lines), or another run's live output, stop it, named."""
    from rollout_capture.following import Follower
    from rollout_capture.live_output import LiveFile
    from rollout_capture.rollout_tail import RunRollouts
    from rollout_capture.run_folders import LIVE, run_folder

    run = tmp_path / "r"
    run.mkdir()
    (run / "rollouts.jsonl").write_bytes(
        b"".join(b'{"_ng_task_index": %d, "_ng_rollout_index": 0}\n' % n for n in (7, 8, 9))
    )
    (run / LIVE).write_bytes(live)
    state, folder = run_folder(str(run))
    live_file = LiveFile(str(run / LIVE))
    follower = Follower(folder, RunRollouts(folder, state.url), live_file, [])
    with pytest.raises(ValueError, match=f"the live output {run / LIVE} holds .* but {why}.*remove it"):
        follower.start()
    live_file.close()
