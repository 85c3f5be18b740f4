"""CaptureStore on every backend: rows, markers, claims, clearing (spec 2, 3, 9)."""

from __future__ import annotations

import os
import pickle
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore, model_call_capture_dirs_from_config

from .conftest import S3

BACKENDS = ["local", "local-objects", "memory", "s3"]
StoreFactory = Callable[[], CaptureStore]


@pytest.fixture(params=BACKENDS)
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    kind = request.param
    if kind == "local":
        return lambda: CaptureStore(tmp_path / "caps")
    if kind == "local-objects":
        return lambda: CaptureStore(tmp_path / "caps", layout="objects")
    if kind == "memory":
        url = f"memory://caps-{uuid.uuid4().hex}"
        return lambda: CaptureStore(url)
    s3: S3 = request.getfixturevalue("s3")
    return lambda: CaptureStore(s3.url("caps"), storage_options=s3.storage_options)


def test_layout_follows_the_filesystem(make_store: StoreFactory, request: pytest.FixtureRequest) -> None:
    expected = "jsonl" if request.node.callspec.params["make_store"] == "local" else "objects"
    assert make_store().layout == expected


def test_rows_round_trip_in_order(make_store: StoreFactory) -> None:
    store = make_store()
    rows = [{"model_call_id": f"c{i}", "n": i, "text": 'é\n"quoted"'} for i in range(5)]
    for row in rows:
        store.record("7-1", row)
    assert store.read("7-1") == rows
    available, damaged = store.read_available("7-1")
    assert [index for index, _ in available] == [0, 1, 2, 3, 4] and damaged == 0
    assert make_store().read("7-1") == rows  # a second writer/reader instance sees the same


def test_empty_rollout(make_store: StoreFactory) -> None:
    store = make_store()
    assert store.read("0-0") == [] and store.read_available("0-0") == ([], 0)
    assert not store.has_any("0-0") and not store.is_incomplete("0-0")
    assert store.live_claims("0-0") == [] and store.expired_claims("0-0") == []


def test_has_any_sees_each_kind_of_file(make_store: StoreFactory) -> None:
    store = make_store()
    store.mark_incomplete("m-1")
    assert store.has_any("m-1") and store.is_incomplete("m-1")
    with store.claim("c-1"):
        assert store.has_any("c-1")
    assert not store.has_any("c-1")  # a released claim leaves nothing behind that counts
    store.record("r-1", {"x": 1})
    assert store.has_any("r-1")


def test_claims_live_then_released(make_store: StoreFactory) -> None:
    store = make_store()
    with store.claim("1-0", model_call_id="abc", ttl_s=60) as claim:
        (live,) = store.live_claims("1-0")
        assert live.claim_id == claim.claim_id and live.model_call_id == "abc" and live.ttl_s == 60
        assert store.expired_claims("1-0") == []
        assert len(store.expired_claims("1-0", now=time.time() + 3600)) == 1  # past its TTL: abandoned
    assert store.live_claims("1-0") == []


async def test_async_claim_context(make_store: StoreFactory) -> None:
    store = make_store()
    async with store.claim("1-0") as claim:
        assert [c.claim_id for c in store.live_claims("1-0")] == [claim.claim_id]
        await store.record_async("1-0", {"model_call_id": "x"})
    assert store.live_claims("1-0") == [] and store.read("1-0") == [{"model_call_id": "x"}]


def test_clear_removes_everything_of_the_rollout_and_nothing_else(make_store: StoreFactory) -> None:
    store = make_store()
    neighbours = ["1-10", "1-1-a1", "1-1.x", "11-1", "11"]
    for rollout_id in ["1-1", *neighbours]:
        store.record(rollout_id, {"id": rollout_id})
        store.record(rollout_id, {"id": rollout_id, "n": 2})
        store.mark_incomplete(rollout_id)
    held = store.claim("1-1")
    held.__enter__()
    other_claim = store.claim("1-10")
    other_claim.__enter__()
    assert store.clear(["1-1"]) == ["1-1"]
    assert not store.has_any("1-1") and store.read("1-1") == []
    for rollout_id in neighbours:
        assert store.read(rollout_id) == [{"id": rollout_id}, {"id": rollout_id, "n": 2}]
        assert store.is_incomplete(rollout_id)
    assert len(store.live_claims("1-10")) == 1
    store.record("1-1", {"fresh": True})  # a retry starts from an empty capture
    assert store.read("1-1") == [{"fresh": True}]


def test_clear_validates_every_id_first(make_store: StoreFactory) -> None:
    store = make_store()
    store.record("1-0", {"x": 1})
    with pytest.raises(ValueError):
        store.clear(["1-0", "../escape"])
    assert store.read("1-0") == [{"x": 1}]


def test_store_pickles_without_its_filesystem(make_store: StoreFactory) -> None:
    store = make_store()
    store.record("1-0", {"x": 1})
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url and clone.layout == store.layout
    if not store.url.startswith("memory://"):  # memory is per process anyway
        assert clone.read("1-0") == [{"x": 1}]


def test_failed_write_marks_the_rollout_incomplete(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    (tmp_path / "9-9.capture.jsonl").mkdir()  # the append target cannot be opened
    with pytest.raises(OSError):
        store.record("9-9", {"x": 1})
    assert store.is_incomplete("9-9")


def test_rows_must_be_objects(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON object"):
        CaptureStore(tmp_path).record("1-0", [1, 2])  # type: ignore[arg-type]


def test_jsonl_layout_needs_a_local_disk() -> None:
    with pytest.raises(ValueError, match="local disk"):
        CaptureStore("memory://x", layout="jsonl")


def test_config_builds_the_store(tmp_path: Path) -> None:
    assert model_call_capture_dirs_from_config({"observability_enabled": False}) == []
    (store,) = model_call_capture_dirs_from_config(
        {"observability_enabled": True, "model_call_capture_dir": str(tmp_path), "unrelated": 1}
    )
    assert isinstance(store, CaptureStore) and store.root == str(tmp_path)


def test_a_retried_object_write_that_had_landed_is_recognised_by_its_nonce(flaky_s3: tuple[S3, Any]) -> None:
    """The PUT lands but its answer is lost: the retry meets If-None-Match (412), and the body it
    reads back carries this write's nonce, so the row is neither duplicated nor moved to seq 1."""
    via, proxy = flaky_s3
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    store.require_put_if_absent()  # the store's proof (once a process) before the counted write
    proxy.lose_answer_on(b"PUT /" + via.bucket.encode() + b"/caps/1-0.capture/000000000000.json")
    proxy.reset_counts()
    store.record("1-0", {"model_call_id": "a"})
    assert proxy.lost == 1 and proxy.reset_counts().get("PUT") == 2  # the write was sent twice
    assert store.read("1-0") == [{"model_call_id": "a"}]
    assert [seq for seq, _ in store.listing("1-0").objects] == [0]
    store.record("1-0", {"model_call_id": "b"})  # and the next write goes to seq 1
    assert [row["model_call_id"] for row in store.read("1-0")] == ["a", "b"]


def test_a_reused_listing_of_the_root_never_hides_a_new_capture(tmp_path: Path) -> None:
    """Batches reuse the root's names while the folder is unchanged; a new file changes it."""
    from rollout_capture.batch import enrich_lines

    store = CaptureStore(tmp_path / "caps")
    for task in range(40):
        store.record(f"{task}-0", {"model_call_id": f"c{task}"})
    settled = time.time() - 60
    os.utime(tmp_path / "caps", (settled, settled))  # long unchanged: its listing may be kept
    lines = [orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": 0}) for t in range(41)]
    first = enrich_lines(lines, [store])
    assert first.stats.gaps == {"model_call_capture_no_records": 1}  # 40-0 has nothing yet
    store.record("40-0", {"model_call_id": "late"})
    second = enrich_lines(lines, [store])
    assert second.stats.calls == 41 and not second.stats.gaps


@pytest.mark.parametrize("staged", [False, True])
def test_a_row_json_cannot_hold_marks_the_rollout_incomplete(tmp_path: Path, staged: bool) -> None:
    """orjson refuses a value nested past its limit: that is a failed write like any other."""
    deep: dict[str, object] = {}
    inner = deep
    for _ in range(300):
        inner["x"] = {}
        inner = inner["x"]  # type: ignore[assignment]
    store = CaptureStore(tmp_path / "caps")
    with pytest.raises(orjson.JSONEncodeError):
        if staged:
            store.record_staged("1-0", {"model_call_id": "a", "request": deep})
        else:
            store.record("1-0", {"model_call_id": "a", "request": deep})
    assert store.is_incomplete("1-0")
