"""Promises that small mutations of the code once broke with the whole suite green.

Each test here was checked against its mutation (applied by hand, seen to fail, reverted):
the local append's fsync removed; a failed fsync no longer marking the rollout incomplete; a
claim live one TTL too long; ``_ENRICHED`` written
before the run's output is published; a ref whose ``model_call_id`` matches but whose
``model_ref`` disagrees, accepted.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.run_folders import RunsRoot

from .conftest import S3, Clock, wait_for
from .support.runs_helpers import ROW, Where
from .support.spawned import run_tick

# ----------------------------------------------------------------------------- durability

_RECORDS = """
import asyncio, sys
from rollout_capture import CaptureStore
store = CaptureStore(sys.argv[1])
store.record("1-0", {"model_call_id": "sync", "dialect": "chat"})
asyncio.run(store.record_async("1-0", {"model_call_id": "async", "dialect": "chat"}))
store.record("2-0", {"model_call_id": "other", "dialect": "chat"})
"""


# Run before _RECORDS in the writing process: every open of a capture file, write, fsync and
# close on a descriptor is noted in order (the calls as the code makes them, no strace needed).
_TRACED = """
import atexit, os, sys, threading
_trace, _guard = [], threading.Lock()
_real = {n: getattr(os, n) for n in ("open", "write", "fsync", "fdatasync", "close")}
def _note(*event):
    with _guard:
        _trace.append(" ".join(map(str, event)))
def _open(path, *args, **kwargs):
    fd = _real["open"](path, *args, **kwargs)
    if os.fspath(path).endswith(".capture.jsonl"):
        _note("open", fd, os.path.join(sys.argv[1], os.path.basename(os.fspath(path))))
    return fd
def _write(fd, data):
    written = _real["write"](fd, data)
    _note("write", fd, written)
    return written
def _sync(name):
    def sync(fd):
        _real[name](fd)
        _note("fsync", fd if isinstance(fd, int) else fd.fileno())
    return sync
def _close(fd):
    _note("close", fd)
    _real["close"](fd)
os.open, os.write, os.close = _open, _write, _close
os.fsync, os.fdatasync = _sync("fsync"), _sync("fdatasync")
atexit.register(lambda: open(sys.argv[2], "w").write("\\n".join(_trace)))
"""


def test_every_local_append_is_fsynced_after_its_write_before_record_returns(tmp_path: Path) -> None:
    """Each row's write to its capture file is followed by an fsync of that file's descriptor
    (no close in between), so a row is durable once recorded: the writing process notes its
    own ``os`` calls in order (a removed or misplaced fsync fails this; no strace needed)."""
    trace = tmp_path / "trace"
    done = subprocess.run(
        [sys.executable, "-c", _TRACED + _RECORDS, str(tmp_path / "caps"), str(trace)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]

    files: dict[str, str] = {}  # fd -> capture file it holds
    pending: dict[str, int] = {}  # capture file -> rows written, not yet fsynced
    durable: dict[str, int] = {}
    for line in trace.read_text().splitlines():
        call, fd, *rest = line.split(" ", 2)
        if call == "open":
            files[fd] = rest[0]
        elif call == "write" and (path := files.get(fd)) is not None:
            pending[path] = pending.get(path, 0) + 1
        elif call == "fsync" and (path := files.get(fd)) is not None and pending.get(path):
            durable[path] = durable.get(path, 0) + pending.pop(path)
        elif call == "close" and (path := files.pop(fd, None)) is not None:
            assert not pending.get(path), f"{path} closed with a row written but never fsynced"
    first, second = str(tmp_path / "caps" / "1-0.capture.jsonl"), str(tmp_path / "caps" / "2-0.capture.jsonl")
    assert not any(pending.values()), f"rows never fsynced: {pending}"
    assert durable == {first: 2, second: 1}
    assert [r["model_call_id"] for r in CaptureStore(tmp_path / "caps").read("1-0")] == ["sync", "async"]


@pytest.mark.parametrize("how", ["record", "record_async", "record_staged"])
async def test_a_failed_fsync_of_a_local_row_marks_the_rollout_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The disk refuses the row's fsync (EIO, once): the write raises, the row is cut back (it is
    not known durable) and the rollout carries ``model_call_capture_incomplete``; rows after it
    land as usual."""
    import errno

    store = CaptureStore(tmp_path)
    store.record("1-0", {**ROW, "model_call_id": "before"})
    real_fsync = os.fsync

    def failing_once(fd: int) -> None:
        monkeypatch.setattr(os, "fsync", real_fsync)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_once)
    row = {**ROW, "model_call_id": "lost"}
    with pytest.raises(OSError, match="Input/output error"):
        if how == "record":
            store.record("1-0", row)
        elif how == "record_async":
            await store.record_async("1-0", row)
        else:
            blocking, finish = store.record_staged("1-0", row)
            try:
                blocking()
            finally:
                finish()
    assert os.fsync is real_fsync  # the fsync was reached, and failed
    store.record("1-0", {**ROW, "model_call_id": "after"})
    assert [r["model_call_id"] for r in store.read("1-0")] == ["before", "after"]
    record = merge_model_call_capture_into_record({"_ng_rollout_id": "1-0"}, [tmp_path])
    assert {"code": "model_call_capture_incomplete"} in record["ng_model_call_capture"]["gaps"]


# ----------------------------------------------------------------------------- the claim boundary


def test_a_local_claim_is_live_until_exactly_its_ttl(tmp_path: Path, clock: Clock) -> None:
    store = CaptureStore(tmp_path)
    made = clock.now
    with store.claim("1-0", ttl_s=10):
        clock.set(made + 10 - 0.001)
        assert len(store.live_claims("1-0")) == 1 and store.expired_claims("1-0") == []
        clock.set(made + 10)
        assert store.live_claims("1-0") == [] and len(store.expired_claims("1-0")) == 1
        # Asked with an explicit moment, the same on both sides.
        assert len(store.live_claims("1-0", now=made + 9.999)) == 1
        assert store.live_claims("1-0", now=made + 10) == []


def test_an_object_store_claim_is_live_until_its_objects_time_plus_ttl(s3: S3, clock: Clock) -> None:
    """On an object store expiry counts from the object's own modification time."""
    store = CaptureStore(s3.url("caps"), storage_options=s3.storage_options)
    with store.claim("1-0", ttl_s=10):
        (path,) = [p for p in s3.fs().find(f"{s3.bucket}/caps") if ".capture.claims" in p]
        stored_at = s3.fs().info(path)["LastModified"].timestamp()
        clock.set(stored_at + 10 - 0.001)
        assert len(store.live_claims("1-0")) == 1
        clock.set(stored_at + 10)
        assert store.live_claims("1-0") == [] and len(store.expired_claims("1-0")) == 1


# ----------------------------------------------------------------------------- publish order


def _names(s3: S3) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in s3.fs().ls(f"{s3.bucket}/runs/r", detail=False)}


@pytest.mark.usefixtures("prefect_api")
def test_a_failed_publish_leaves_no_enriched_marker(flaky_s3: tuple[S3, Any], s3: S3, tmp_path: Path) -> None:
    """The store refuses the output's PUT: the run fails and ``_ENRICHED`` is not there (it
    would say an output exists that no one can read); the next tick enriches it."""
    from rollout_capture.flows import enrich_completed_runs

    via, proxy = flaky_s3
    Where(tmp_path, s3).make_run("r")
    proxy.deny_on(f"PUT /{s3.bucket}/runs/r/rollouts.enriched.jsonl ".encode())
    state = enrich_completed_runs(via.url("runs"), storage_options=via.storage_options, return_state=True)
    assert proxy.denied >= 1 and state.is_failed()
    assert "_ENRICHED" not in _names(s3) and "rollouts.enriched.jsonl" not in _names(s3)
    proxy.deny_on(None)
    again = enrich_completed_runs(via.url("runs"), storage_options=via.storage_options)
    assert again.enriched == ["r"] and "_ENRICHED" in _names(s3)


def test_a_holder_killed_between_its_output_and_its_marker_left_the_whole_output(
    prefect_api: str, flaky_s3: tuple[S3, Any], s3: S3, tmp_path: Path, clock: Clock
) -> None:
    """The endpoint dies under the marker's PUT and the holder is SIGKILLed while it retries:
    by then its output is published in full, and ``_ENRICHED`` is not there. The next tick,
    once the lease lapses, enriches the run and writes the marker once."""
    from rollout_capture.flows import enrich_completed_runs

    via, proxy = flaky_s3
    where = Where(tmp_path, s3)
    where.make_run("r")
    proxy.outage_on(f"PUT /{s3.bucket}/runs/r/_ENRICHED ".encode(), 3600)
    tick = multiprocessing.get_context("spawn").Process(
        target=run_tick, args=(prefect_api, via.url("runs"), via.storage_options, 30.0)
    )
    tick.start()
    try:
        wait_for(lambda: proxy.outages >= 1 or not tick.is_alive(), 180, "the holder to write its marker")
        assert tick.is_alive(), "the tick ended before it wrote its marker"
        os.kill(tick.pid or 0, signal.SIGKILL)
        tick.join(30)
    finally:
        if tick.is_alive():
            tick.kill()
    proxy.up()
    assert "_ENRICHED" not in _names(s3)
    out = s3.fs().cat_file(f"{s3.bucket}/runs/r/rollouts.enriched.jsonl").splitlines()
    assert [orjson.loads(line)["ng_model_call_capture"]["metrics"]["num_calls"] for line in out] == [1, 1, 1]

    runs = RunsRoot(s3.url("runs"), s3.storage_options)
    (run,) = runs.runs()
    dead = runs.current_lease(run)
    assert dead is not None and f":{tick.pid}:" in dead.owner
    clock.set(dead.expires_at)  # the dead holder's lease lapses
    after = enrich_completed_runs(s3.url("runs"), storage_options=s3.storage_options)
    assert after.enriched == ["r"] and "_ENRICHED" in _names(s3)
    marker = orjson.loads(s3.fs().cat_file(f"{s3.bucket}/runs/r/_ENRICHED"))
    assert f":{os.getpid()}:" in marker["enriched_by"]


# ----------------------------------------------------------------------------- ownership refs

POLICY = {"type": "responses_api_models", "name": "policy"}
OTHER = {"type": "responses_api_models", "name": "other"}


def test_a_ref_whose_call_id_matches_but_whose_model_ref_disagrees_is_unmatched(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    for call_id in ("c0", "c1"):
        store.record(
            "1-0", {**ROW, "model_call_id": call_id, "model_ref": POLICY, "response": {"id": call_id}}
        )
    refs = [{"model_call_id": "c0", "model_ref": OTHER}, {"model_call_id": "c1", "model_ref": POLICY}]
    record = {
        "_ng_task_index": 1,
        "_ng_rollout_index": 0,
        "ng_agent_observations": {"invocations": [{"invocation_id": "main", "model_calls": refs}]},
    }
    result = merge_model_call_capture_into_record(record, [tmp_path])["ng_agent_observations"]
    (main,) = result["invocations"]
    assert main["model_calls"][0] == {"model_call_id": "c0", "model_ref": OTHER}  # left as it was
    assert main["model_calls"][1] == {"model_call_id": "c1", "model_ref": POLICY, "response_id": "c1"}
    assert {"code": "model_call_reference_unmatched", "invocation_id": "main", "detail": "c0"} in result[
        "gaps"
    ]
    assert {"code": "model_call_ownership_unavailable", "detail": "capture:c0:call_index=0"} in result["gaps"]
