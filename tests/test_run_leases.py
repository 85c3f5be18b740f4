"""Run-folder leases, on a local disk and on S3: renewal, takeover after expiry, fencing.

Exactly one holder at a time: takeover and renewal both create the next generation
put-if-absent, and a holder that finds its lease taken (or the run enriched) can neither
renew nor publish.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture.faults import is_transient_storage_error
from rollout_capture.run_folders import (
    AlreadyEnriched,
    Lease,
    LeaseKeeper,
    LeaseLost,
    RunFolder,
    RunsRoot,
    new_owner,
)

from .conftest import S3, Clock, wait_for
from .support.runs_helpers import Where

# Leases are judged by the test's clock: they lapse when the test says, never on a busy
# machine's own time, so a minute is as quick as a second.
LEASE_S = {"local": 60.0, "s3": 60.0}


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    s3: S3 | None = request.getfixturevalue("s3") if request.param == "s3" else None
    where = Where(tmp_path, s3)
    where.make_run("r")
    return where


def leases(where: Where) -> list[str]:
    return sorted(n for n in where.names("r") if n.startswith("_ENRICHING"))


def wait_until_lapsed(root: RunsRoot, run: RunFolder, clock: Clock) -> None:
    """Set the clock to the instant the run's newest lease generation lapses (as a taker judges
    it, by the store's clock on S3), checking it holds until just before."""
    current = root.current_lease(run)
    assert current is not None
    clock.set(current.expires_at - 0.001)
    assert root.take(run, 60.0) == "busy"  # the boundary's near side: still held
    clock.set(current.expires_at)


def test_renewal_keeps_the_lease_and_takeover_waits_for_expiry(where: Where, clock: Clock) -> None:
    lease_s = LEASE_S["s3" if where.s3 else "local"]
    holder, other = where.root(), where.root()
    run = where.run("r")
    first = holder.acquire(run, lease_s)
    assert first is not None and first.generation == 0
    assert other.take(run, lease_s) == "busy"

    renewed = holder.renew(run, first)
    assert renewed.generation == 1 and renewed.owner == first.owner
    assert leases(where) == ["_ENRICHING.000001"]  # the older generation is dropped
    assert other.take(run, lease_s) == "busy"

    wait_until_lapsed(other, run, clock)  # the holder stopped renewing: crashed, or paused
    taken = other.take(run, lease_s)
    assert isinstance(taken, Lease) and taken.generation == 2 and taken.owner != first.owner
    with pytest.raises(LeaseLost):
        holder.renew(run, renewed)  # the old holder learns it lost, and touches nothing
    holder.release(run, renewed)
    assert leases(where) == ["_ENRICHING.000002"]
    assert other.renew(run, taken).generation == 3


def test_release_lets_the_next_taker_in_at_once_and_numbers_never_repeat(where: Where) -> None:
    root = where.root()
    run = where.run("r")
    lease = root.acquire(run, 600)
    assert lease is not None
    root.release(run, lease)
    assert leases(where) == ["_ENRICHING.000001"]  # a released generation stays on top
    released = root.current_lease(run)
    assert released is not None and released.released
    again = root.acquire(run, 600)
    assert again is not None and again.generation == 2


def test_a_retried_take_finds_the_lease_it_already_took(where: Where) -> None:
    root = where.root()
    run = where.run("r")
    owner = new_owner()
    first = root.take(run, 600, owner)
    assert isinstance(first, Lease)
    again = root.take(run, 600, owner)  # a task retry whose first try's answer was lost
    assert isinstance(again, Lease) and again.owner == owner and again.generation == first.generation + 1
    assert root.take(run, 600) == "busy"  # anyone else is still kept out
    renewed = root.renew(run, again)
    assert root.renew(run, again) == renewed  # a renewal retried after its first try went through


def test_a_stale_view_cannot_take_a_generation_that_was_dropped(where: Where) -> None:
    """A process that listed long ago creates a generation number that no longer exists:
    it succeeds at creating it, sees the newer one, and backs off."""
    root = where.root()
    run = where.run("r")
    lease = root.acquire(run, 600)
    assert lease is not None
    lease = root.renew(run, root.renew(run, lease))  # generations 0 and 1 are gone
    now = time.time()
    stale = Lease(owner=new_owner(), generation=1, acquired_at=now, expires_at=now + 600, lease_s=600)
    stale = root._create(run, stale)
    with pytest.raises(LeaseLost):
        root._confirm(run, stale)
    assert leases(where) == ["_ENRICHING.000002"]  # it took its object back with it
    assert root.renew(run, lease).generation == 3  # the holder never noticed


def test_fencing_keeps_a_paused_holder_from_publishing(where: Where, clock: Clock) -> None:
    lease_s = LEASE_S["s3" if where.s3 else "local"]
    root = where.root()
    run = where.run("r")
    first = root.acquire(run, lease_s)
    assert first is not None
    paused = LeaseKeeper(root, run, first)  # never started: its heartbeat is paused
    wait_until_lapsed(root, run, clock)
    taken = root.acquire(run, lease_s)
    assert taken is not None
    current = LeaseKeeper(where.root(), run, taken)
    current.fence()
    current.finish({"by": "current"})

    with pytest.raises(AlreadyEnriched):
        paused.fence()  # resumed: its fence fails, so it publishes nothing
    with pytest.raises(LeaseLost):
        paused.finish({"by": "paused"})
    marker = orjson.loads(where.read("r", "_ENRICHED"))
    assert marker["by"] == "current" and marker["enriched_by"] == taken.owner
    assert leases(where) == []
    assert root.take(run, lease_s) == "enriched"


def test_a_keeper_that_finds_its_lease_taken_stops(tmp_path: Path) -> None:
    where = Where(tmp_path, None)
    where.make_run("r")
    root = where.root()
    run = where.run("r")
    lease = root.acquire(run, 600)
    assert lease is not None
    with LeaseKeeper(root, run, lease, heartbeat_s=0.05) as keeper:
        thief = Lease(owner="thief", generation=0, acquired_at=0, expires_at=0, lease_s=600)
        while True:  # take the generation its next renewal needs
            thief = thief.model_copy(update={"generation": keeper.lease.generation + 1})
            try:
                root._create(run, thief)
                break
            except LeaseLost:
                continue
        wait_for(lambda: keeper.lost, what="the keeper to find its lease taken")
        assert keeper.lost is not None and "thief" in keeper.lost
        with pytest.raises(LeaseLost):
            keeper.check()
        with pytest.raises(LeaseLost):
            keeper.fence()
    keeper.release()  # lost: nothing to give back, the thief's generation stays
    assert f"_ENRICHING.{thief.generation:06d}" in leases(where)


def test_the_heartbeat_rides_out_an_outage(flaky_s3: tuple[S3, Any], s3: S3, tmp_path: Path) -> None:
    """Renewals that meet a dead endpoint are transient faults: tried again, the lease kept."""
    via, proxy = flaky_s3
    Where(tmp_path, s3).make_run("r")
    root = RunsRoot(via.url("runs"), via.storage_options)
    (run,) = root.runs()
    lease = root.acquire(run, 600)
    assert lease is not None
    with LeaseKeeper(root, run, lease, heartbeat_s=0.1) as keeper:
        proxy.down()
        try:  # down until a renewal has met the dead endpoint
            wait_for(lambda: keeper.last_error, what="a renewal to meet the dead endpoint")
        finally:
            proxy.up()
        renewed = keeper.renewals
        wait_for(lambda: keeper.renewals != renewed, what="renewals to go through again")
        assert keeper.lost is None and is_transient_storage_error(keeper.last_error)
        assert keeper.fence().generation > lease.generation
    keeper.release()


def test_a_finish_retried_after_its_marker_landed_still_finishes(
    flaky_s3: tuple[S3, Any], s3: S3, tmp_path: Path
) -> None:
    """``_ENRICHED`` lands but every answer to it is lost, so finishing fails; the retry must
    recognise its own marker (not renew into it and call the run lost) and drop the lease."""
    via, proxy = flaky_s3
    Where(tmp_path, s3).make_run("r")
    root = RunsRoot(via.url("runs"), via.storage_options)
    (run,) = root.runs()
    lease = root.acquire(run, 600)
    assert lease is not None
    keeper = LeaseKeeper(root, run, lease, heartbeat_s=0.05).start()
    # Every answer to the marker's PUTs, however many times s3fs retries: a budget of 20 was
    # at times one short of its retries, the 21st went through and the fault never showed.
    proxy.lose_answer_on(b"/runs/r/_ENRICHED ", times=1_000_000)
    with pytest.raises(Exception) as failed:
        keeper.finish({"rollouts": 3})
    assert not isinstance(failed.value, LeaseLost)
    assert proxy.lost >= 1
    proxy.lose_answer_on(b"", times=0)  # answers get through again
    keeper.finish({"rollouts": 3})  # the retry
    assert keeper.lost is None
    names = Where(tmp_path, s3).names("r")
    assert "_ENRICHED" in names and not any(n.startswith("_ENRICHING") for n in names)
    marker = orjson.loads(s3.fs().cat(f"{s3.bucket}/runs/r/_ENRICHED"))
    assert marker["enriched_by"] == lease.owner


def test_a_lease_keeps_renewing_with_credentials_renewed_meanwhile(s3: S3, tmp_path: Path) -> None:
    """The root asks its credentials provider at each use: renewed credentials (temporary ones
    expire within the hour) reach the lease's renewals without restarting the run."""
    Where(tmp_path, s3).make_run("r")
    handed_out: list[dict[str, str]] = []

    def provider() -> dict[str, str]:
        if not handed_out:
            handed_out.append({"key": "testing", "secret": "testing"})
        return handed_out[-1]

    root = RunsRoot(s3.url("runs"), s3.storage_options, credentials=provider)
    (run,) = root.runs()
    lease = root.acquire(run, 600)
    assert lease is not None
    first = root.backend
    assert root.backend is first  # the same credentials: the same storage
    handed_out.append({"key": "testing", "secret": "testing", "token": "renewed"})
    renewed = root.renew(run, lease)
    assert root.backend is not first and renewed.generation == lease.generation + 1
    current = root.current_lease(run)  # read back through the storage opened anew
    assert current is not None and (current.generation, current.owner) == (renewed.generation, lease.owner)
