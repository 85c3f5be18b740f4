"""Claims and quiescence (spec 3): waits are bounded, releases are seen, dead producers ignored."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import (
    CaptureStore,
    await_model_call_capture_quiescence,
    await_quiescence_many,
    merge_model_call_capture_into_record,
)
from rollout_capture.names import claim_name

from .conftest import S3, Clock


def gaps(root: Any, rollout_id: str = "1-0") -> list[dict[str, str]]:
    task, rollout = rollout_id.split("-")
    record = {"_ng_task_index": int(task), "_ng_rollout_index": int(rollout)}
    dirs = [root]
    return merge_model_call_capture_into_record(record, dirs)["ng_model_call_capture"].get("gaps", [])


async def test_live_claim_blocks_until_the_deadline(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    with store.claim("1-0"):
        started = time.monotonic()
        assert (
            await await_model_call_capture_quiescence("1-0", [tmp_path], timeout_s=0.2, poll_s=0.02) is False
        )
        assert time.monotonic() - started >= 0.2  # it did not give up before its deadline
        assert {"code": "model_call_capture_pending", "detail": "count=1"} in gaps(tmp_path)


async def test_the_wait_keeps_watching_until_the_claim_goes(tmp_path: Path) -> None:
    """A claim that lapses mid-wait (its producer died) ends the wait: quiescent, not a timeout."""
    store = CaptureStore(tmp_path)
    store.claim("1-0", ttl_s=0.3).__enter__()  # never released
    assert await await_model_call_capture_quiescence("1-0", [tmp_path], timeout_s=30, poll_s=0.02) is True


async def test_release_lets_the_wait_return_true(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    claim = store.claim("1-0")
    claim.__enter__()
    releasing = threading.Event()  # set before the release, so a wait that returns has seen it begin

    def release_soon() -> None:
        time.sleep(0.15)
        releasing.set()
        claim.__exit__(None, None, None)

    threading.Thread(target=release_soon).start()
    assert await await_model_call_capture_quiescence("1-0", [tmp_path], timeout_s=30, poll_s=0.02) is True
    assert releasing.is_set()
    assert gaps(tmp_path) == [{"code": "model_call_capture_no_records"}]


async def test_missing_id_is_quiescent_at_once(tmp_path: Path) -> None:
    assert await await_model_call_capture_quiescence("5-5", [tmp_path / "absent"], timeout_s=5) is True


async def test_expired_claim_does_not_block_and_is_reported(tmp_path: Path, clock: Clock) -> None:
    store = CaptureStore(tmp_path)
    clock.set(time.time() - 60)  # a minute ago...
    claim = store.claim("1-0", ttl_s=30)
    claim.__enter__()  # ...the producer died without releasing
    clock.set(time.time())  # its 30 s ran out half a minute ago
    store.record("1-0", {"model_call_id": "a"})
    assert await await_model_call_capture_quiescence("1-0", [tmp_path], timeout_s=30) is True
    assert gaps(tmp_path) == [{"code": "model_call_capture_claim_abandoned", "detail": "count=1"}]


async def test_one_deadline_for_a_whole_batch(tmp_path: Path) -> None:
    """Twenty stuck rollouts cost one deadline: waiting per rollout would outlast their claims."""
    store = CaptureStore(tmp_path)
    for i in range(20):
        store.claim(f"{i}-0", ttl_s=4.0).__enter__()  # live for 4 s, never released
    pending = await await_quiescence_many(
        [f"{i}-0" for i in range(40)], [tmp_path], timeout_s=0.5, poll_s=0.05
    )
    # All twenty still live when the one deadline passed; a wait per rollout (20 x 0.5 s)
    # would have seen the later ones lapse. The free half is not held back either.
    assert pending == {f"{i}-0" for i in range(20)}


async def test_object_store_expiry_uses_the_store_clock(s3: S3) -> None:
    """A writer whose clock is an hour behind must not make a fresh claim look abandoned."""
    store = CaptureStore(s3.url("caps"), storage_options=s3.storage_options)
    body = {"claim_id": "skewed", "host": "h", "pid": 1, "claimed_at": time.time() - 3600, "ttl_s": 300}
    s3.fs().pipe_file(f"{s3.bucket}/caps/{claim_name('1-0', 'skewed')}", orjson.dumps(body))
    assert len(store.live_claims("1-0")) == 1
    assert await await_model_call_capture_quiescence("1-0", [store], timeout_s=0.2, poll_s=0.05) is False


class SlowText:
    """A value whose serialization takes a while, so cancellation lands mid-write."""

    def __init__(self, entered: threading.Event) -> None:
        self.entered = entered

    def __str__(self) -> str:
        self.entered.set()
        time.sleep(0.3)
        return "slow"


@pytest.mark.parametrize("layout", ["jsonl", "objects"])
async def test_cancelled_writer_still_lands_its_row_and_releases(tmp_path: Path, layout: str) -> None:
    store = CaptureStore(tmp_path, layout=layout)  # type: ignore[arg-type]
    entered = threading.Event()

    async def model_call() -> None:
        async with store.claim("1-0", model_call_id="abc"):
            await store.record_async("1-0", {"model_call_id": "abc", "note": SlowText(entered)})

    task = asyncio.create_task(model_call())
    await asyncio.to_thread(entered.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.read("1-0") == [{"model_call_id": "abc", "note": "slow"}]
    assert store.live_claims("1-0") == [] and not store.is_incomplete("1-0")


@pytest.mark.parametrize("age_s", [0.0, 3600.0])
async def test_an_unreadable_claim_counts_from_its_file_time(tmp_path: Path, age_s: float) -> None:
    """A claim whose body cannot be read still says a call was in flight: live for the default
    TTL from the file's time, abandoned after it."""
    path = tmp_path / claim_name("1-0", "torn")
    path.parent.mkdir()
    path.write_bytes(b'{"claim_id": "torn", "claimed_')
    then = time.time() - age_s
    os.utime(path, (then, then))
    expected_live = age_s == 0.0
    assert await await_model_call_capture_quiescence("1-0", [tmp_path], timeout_s=0.1) is not expected_live
    code = "model_call_capture_pending" if expected_live else "model_call_capture_claim_abandoned"
    assert {"code": code, "detail": "count=1"} in gaps(tmp_path)


async def test_a_live_claim_in_any_of_several_dirs_keeps_the_rollout_pending(tmp_path: Path) -> None:
    """Watched in every dir, not the last one alone: a claim in the first of two dirs (the
    second empty, or holding the rollout's rows) is not quiet, by the wait and by a batch."""
    from rollout_capture.batch import enrich_lines

    first, second = tmp_path / "first", tmp_path / "second"
    CaptureStore(second).record("2-0", {"model_call_id": "other", "dialect": "chat"})
    with CaptureStore(first).claim("1-0"):
        for dirs in ([first, second], [second, first]):
            assert not await await_model_call_capture_quiescence("1-0", dirs, timeout_s=0.05, poll_s=0.01)
            assert await await_quiescence_many(["1-0", "2-0"], dirs, timeout_s=0.05, poll_s=0.01) == {"1-0"}
        line = orjson.dumps({"_ng_task_index": 1, "_ng_rollout_index": 0})
        batch = await asyncio.to_thread(enrich_lines, [line], [first, second], quiescence_timeout_s=0.05)
        assert batch.stats.waited_for == 1
        (out,) = batch.lines
        assert {"code": "model_call_capture_pending", "detail": "count=1"} in orjson.loads(out)[
            "ng_model_call_capture"
        ]["gaps"]
