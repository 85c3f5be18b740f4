"""The object-store read path, counted on the wire: one listing, no HEADs, one GET per object;
throttling backs off instead of failing the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.backends import ListingScope, open_backend
from rollout_capture.batch import enrich_lines
from rollout_capture.journal import bodies

from .conftest import S3
from .support.journal_runs import ROW, enriched, journal_run


def fill(s3: S3, rollouts: int, rows: int) -> list[bytes]:
    """Write the object layout directly (not through the proxy: it is not what is measured)."""
    s3.fs().pipe(
        {
            f"{s3.bucket}/caps/{r}-0.capture/{seq:012d}.json": orjson.dumps(
                {**ROW, "model_call_id": f"{r}-{seq}"}
            )
            for r in range(rollouts)
            for seq in range(rows)
        }
    )
    return [orjson.dumps({"_ng_task_index": r, "_ng_rollout_index": 0}) for r in range(rollouts)]


def test_a_batch_costs_one_listing_and_one_get_per_object(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    via, proxy = flaky_s3
    lines = fill(s3, rollouts=300, rows=4)
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    proxy.reset_counts()
    batch = enrich_lines(lines, [store])
    assert batch.stats.calls == 1200 and not batch.stats.gaps
    assert proxy.reset_counts() == {"LIST": 2, "GET": 1200}  # 1,200 keys: two pages of a flat listing


def test_throttling_backs_off_instead_of_failing(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    via, proxy = flaky_s3
    lines = fill(s3, rollouts=40, rows=2)
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    expected = enrich_lines(lines, [CaptureStore(s3.url("caps"), storage_options=s3.storage_options)])
    proxy.throttle(6)  # the listing and some GETs meet 503 SlowDown
    batch = enrich_lines(lines, [store])
    assert proxy.throttled == 6
    assert batch.lines == expected.lines and batch.stats.calls == 80


def test_listing_is_shared_by_a_job_or_done_per_rollout_whichever_is_quicker(
    flaky_s3: tuple[S3, Any], s3: S3
) -> None:
    via, proxy = flaky_s3
    lines = fill(s3, rollouts=300, rows=4)  # 1,200 keys: a flat listing is two pages
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    job = ListingScope(key="flow-run-1", rollouts=len(lines))
    proxy.reset_counts()
    batches = [enrich_lines(lines[i : i + 10], [store], scope=job) for i in range(0, 60, 10)]
    assert sum(b.stats.calls for b in batches) == 240 and not any(b.stats.gaps for b in batches)
    assert proxy.reset_counts() == {"LIST": 2, "GET": 240}  # six batches, one listing
    enrich_lines(lines[:10], [store], scope=ListingScope(key="flow-run-2", rollouts=300))
    assert proxy.reset_counts()["LIST"] == 2  # another job lists afresh: never a stale listing

    # A job of 33 rollouts: one round of 64 concurrent per-rollout listings beats two pages,
    # so the flat listing is abandoned after its budget, and the job remembers.
    quick = CaptureStore(via.url("caps"), storage_options=via.storage_options, concurrency=64)
    small = ListingScope(key="flow-run-3", rollouts=33)
    first = enrich_lines(lines[:20], [quick], scope=small)
    # and a GET for the first commit of each journal stream (absent) and a LIST of the compacted
    # generations' folder (a compacted root has no commit 0): no whole-root listing ruled them out
    assert proxy.reset_counts() == {"LIST": 2 + 20 + 1, "GET": 80 + 2}
    second = enrich_lines(lines[20:33], [quick], scope=small)
    assert proxy.reset_counts() == {"LIST": 13, "GET": 52}
    assert first.stats.calls + second.stats.calls == 132 and not first.stats.gaps and not second.stats.gaps


def test_a_small_job_lists_each_rollout(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    via, proxy = flaky_s3
    lines = fill(s3, rollouts=40, rows=2)[:3]
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    proxy.reset_counts()
    assert enrich_lines(lines, [store]).stats.calls == 6
    # + the journal streams' first commits, absent, and a LIST of the compacted generations' folder
    assert proxy.reset_counts() == {"LIST": 3 + 1, "GET": 6 + 2}


def test_a_claim_released_after_the_jobs_listing_brings_its_row_in(s3: S3) -> None:
    """The job's one listing saw a claim and no row; by a later batch the call has finished.
    The vanished claim means a row landed after the listing: that rollout is listed again."""
    lines = fill(s3, rollouts=40, rows=1)
    late = orjson.dumps({"_ng_task_index": 99, "_ng_rollout_index": 0})
    store = CaptureStore(s3.url("caps"), storage_options=s3.storage_options)
    job = ListingScope(key="flow-run-late", rollouts=41)
    with store.claim("99-0", model_call_id="late"):
        first = enrich_lines(lines, [store], scope=job, quiescence_timeout_s=0)  # lists the root
        assert first.stats.calls == 40
        store.record("99-0", {**ROW, "model_call_id": "late"})
    assert not store.live_claims("99-0")
    second = enrich_lines([late], [store], scope=job, quiescence_timeout_s=0)
    assert second.stats.calls == 1 and not second.stats.gaps


def test_jobs_sharing_a_store_in_parallel_each_keep_their_listing(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    """Runs enriched side by side share one store: their batches interleave, and each job
    still lists the root once."""
    via, proxy = flaky_s3
    lines = fill(s3, rollouts=300, rows=4)  # 1,200 keys: a flat listing is two pages
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    jobs = [ListingScope(key=f"run-{n}", rollouts=len(lines)) for n in range(3)]
    proxy.reset_counts()
    calls = 0
    for start in range(0, 60, 10):
        for job in jobs:
            calls += enrich_lines(lines[start : start + 10], [store], scope=job).stats.calls
    assert calls == 3 * 240
    assert proxy.reset_counts() == {"LIST": 3 * 2, "GET": 3 * 240}


def test_a_missing_file_costs_one_head_and_no_listing(flaky_s3: tuple[S3, Any]) -> None:
    """A marker looked for, a sequence probed: s3fs would list the prefix after each miss (to tell a
    folder); every path asked is a file, so a miss is one HEAD."""
    via, proxy = flaky_s3
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    proxy.reset_counts()
    assert not store.is_incomplete("m-0")
    assert proxy.reset_counts() == {"HEAD": 1}
    store.mark_incomplete("m-0")
    proxy.reset_counts()
    assert store.is_incomplete("m-0")
    assert proxy.reset_counts() == {"HEAD": 1}


# ---------------------------------------------------------------------- the journal's read plan


def test_an_enrichment_reads_each_journal_commit_once(
    flaky_s3: tuple[S3, Any], s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48: a finished journal run costs one listing and one GET a commit, whatever the batches
    (each needs rows of commits others read, and most bodies went to the reader's file: a 4 kB
    memory budget), nothing answered 404 (no number read past the end), and the output is the
    same bytes as over the same objects copied to a local disk."""
    monkeypatch.setattr(bodies, "MEMORY_BUDGET", 4096)
    via, proxy = flaky_s3
    lines = journal_run(CaptureStore(s3.url("caps"), storage_options=s3.storage_options), 60, 3)
    commits = len(s3.fs().find(f"{s3.bucket}/caps/_journal"))
    assert commits == 60  # 180 calls, 6 a commit: 30 of claims, 30 of rows and releases
    proxy.reset_counts()
    proxy.reset_answers()
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    out = enriched(lines, store, "enrichment-1")
    assert proxy.reset_counts() == {"LIST": 1, "GET": commits}
    assert proxy.reset_answers()["statuses"] == {200: 1, 206: commits}  # obstore's GETs are whole ranges
    s3.fs().get(f"{s3.bucket}/caps", str(tmp_path / "copy"), recursive=True)
    assert out == enriched(lines, CaptureStore(str(tmp_path / "copy")), "local")
    assert sum(orjson.loads(line)["ng_model_call_capture"]["metrics"]["num_calls"] for line in out) == 180

    # The enrichment over, its bodies are let go, its index kept: the next one reads the commits of
    # rows once again (those of claims no more: no claim is open).
    assert enriched(lines, store, "enrichment-2") == out
    assert proxy.reset_counts() == {"LIST": 1, "GET": commits // 2}


def test_a_refresh_after_a_wait_reads_no_number_past_the_end(flaky_s3: tuple[S3, Any], s3: S3) -> None:
    """A batch's listing showed the journal's end: later batches of the job read nothing more, a
    refresh looks one number past it, and a root holding the journal alone is never listed
    rollout by rollout."""
    via, proxy = flaky_s3
    lines = journal_run(CaptureStore(s3.url("caps"), storage_options=s3.storage_options), 40, 1)
    store = CaptureStore(via.url("caps"), storage_options=via.storage_options)
    scope = ListingScope(key="job", rollouts=len(lines))
    enrich_lines(lines[:20], [store], scope=scope)
    proxy.reset_counts()
    fetched = store.prefetch(["21-0", "22-0"], scope=scope)
    assert proxy.reset_counts() == {}
    proxy.reset_answers()
    fetched.refresh(["21-0"])  # rows may have landed: each stream's next number is asked, once
    # and the last one read (still there), and a look for a compacted generation (a LIST, none)
    assert proxy.reset_counts() == {"GET": 2, "HEAD": 2, "LIST": 1}
    assert proxy.reset_answers()["statuses"] == {200: 3, 404: 2}  # the HEADs, the LIST; the GETs past the end
    assert fetched.snapshot("21-0").rows


def test_a_store_that_answers_ranges_whole_is_read_by_one_plain_get_an_object(
    request: pytest.FixtureRequest,
) -> None:
    """``rclone serve s3`` answers a ranged GET with 200 (the range's bytes): obstore refuses it,
    and a whole object asked as a range then costs two GETs. After three such objects the reader
    asks whole objects by plain GETs: one a object, the bytes the same (issue 48)."""
    from .conftest import open_store
    from .support.fault_proxy import FaultProxy

    rclone = open_store(request, "rclone")
    bodies = {f"{rclone.bucket}/objs/{n:03d}": f"object {n} ".encode() * (n + 1) for n in range(10)}
    rclone.fs().pipe(bodies)
    host, port = rclone.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    try:
        backend = open_backend(
            f"s3://{rclone.bucket}/objs",
            {"client_kwargs": {"endpoint_url": proxy.endpoint}},
            concurrency=1,  # one at a time: the switch comes after exactly three
        )
        assert backend.read_many(list(bodies)) == list(bodies.values())
        assert proxy.reset_counts() == {"GET": 3 * 2 + 7}
        assert backend.read_many(list(bodies)) == list(bodies.values())
        assert proxy.reset_counts() == {"GET": 10}
    finally:
        proxy.close()
