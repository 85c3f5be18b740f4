"""Compaction of a finished run's journal (issue 48): every reader we ship reads a compacted
generation plus the commits after it with every row, its order and its evidence unchanged, on a
local disk and on the object stores' real servers; a journal a writer may still write is refused;
a compaction killed at any point loses and doubles nothing, and the next one finishes."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.samples import corpus_records
from rollout_capture import CaptureStore
from rollout_capture.attachment import build_attachment
from rollout_capture.claims import new_claim
from rollout_capture.compaction import compact_root
from rollout_capture.evidence import gather_evidence
from rollout_capture.journal import claim_entry, row_entry
from rollout_capture.journal.compacted import QUIET_S

from .conftest import CORPUS, wait_for
from .support.journal_runs import enriched, journal_run, rich_run
from .support.stores import Store

LATER = 3_600.0
"""The compactor's clock this far ahead: the run's quiet period (and the dead writer's claim) over."""


def _later() -> float:
    return time.time() + LATER


def _journal_objects(store: CaptureStore) -> list[str]:
    return sorted(name for name, _ in store._backend.list_under("_journal"))


def _what_readers_see(store: CaptureStore, lines: list[bytes], job: str) -> tuple[list[bytes], Any, Any]:
    """The batch path's output (``enrich``, ``enrich-runs``, following's end), each rollout's rows
    as ``inspect`` and a snapshot read them, and their evidence."""
    ids = [f"{r}-0" for r in range(len(lines))]
    out = enriched(lines, store, job, batch=4)
    snapshots = {}
    for rollout_id in ids:
        snap = store.snapshot(rollout_id)
        damage = [(d.reason, d.whitespace) for d in snap.damaged]  # where: the part, once compacted
        snapshots[rollout_id] = (
            snap.found,
            snap.rows,
            damage,
            snap.incomplete,
            repr(snap.claims),
            snap.holes,
        )
    evidence = gather_evidence(ids, [store])  # what ``inspect`` shows of each
    shown = {
        k: orjson.dumps(build_attachment(k, v), option=orjson.OPT_SORT_KEYS) for k, v in evidence.items()
    }
    return out, snapshots, shown


def _compact_and_compare(url: str, options: dict[str, Any] | None, rollouts: int) -> dict[str, Any]:
    writer = CaptureStore(url, storage_options=options, layout="journal")
    lines = rich_run(writer, corpus_records(CORPUS), rollouts)
    # One store enriches before and after (a long-lived reader, as a follower's), one opens after.
    kept = CaptureStore(url, storage_options=options)
    before = _what_readers_see(kept, lines, "before")
    commits = _journal_objects(kept)
    done = compact_root(CaptureStore(url, storage_options=options)._backend, remove_after_s=0, now=_later)
    assert done.status == "compacted", done
    assert _journal_objects(kept) == sorted(
        [f"_journal/compact/{1:012d}/manifest.json"]
        + [f"_journal/compact/{1:012d}/{name}" for name in _part_names(kept)]
    )
    assert done.objects_before == len(commits) and done.objects_after == 2 and done.removed == len(commits)
    assert _what_readers_see(kept, lines, "after") == before
    assert _what_readers_see(CaptureStore(url, storage_options=options), lines, "fresh") == before
    # A second compaction of a quiet, compacted journal has nothing to do.
    again = compact_root(CaptureStore(url, storage_options=options)._backend, remove_after_s=0, now=_later)
    assert again.status == "already compacted" and again.generation == 1
    return {"before": before, "commits": len(commits), "lines": lines}


def _part_names(store: CaptureStore) -> list[str]:
    from rollout_capture.journal.compacted import read_manifest

    manifest = read_manifest(store._backend, 1)
    assert manifest is not None
    return [part.name for part in manifest.parts]


def test_enrichment_is_byte_identical_after_compaction_on_a_local_disk(tmp_path: Path) -> None:
    """Rows of every dialect and a verifier's, a rollout cleared midway, a dead writer's open claim,
    a damaged row, a rollout cleared for good: the enriched output, each rollout's rows and its
    evidence are the same bytes before and after, for a reader that read the commits before and
    for a fresh one; the journal is then two objects (a part and its manifest)."""
    found = _compact_and_compare(str(tmp_path / "caps"), None, 12)
    assert found["commits"] > 10
    out = found["before"][0]
    assert sum(b"ng_model_call_capture" in line for line in out) >= 9  # the run's rollouts enriched


def test_commits_after_a_generation_are_read_after_its_rows(tmp_path: Path) -> None:
    """A generation and later commits (a run resumed after it was compacted, then compacted again):
    each rollout's rows in commit order across both, the same as never compacted."""
    url = str(tmp_path / "caps")
    twin = str(tmp_path / "twin")  # the same writes, never compacted
    stores = [CaptureStore(u, layout="journal") for u in (url, twin)]
    lines = rich_run(stores[0], corpus_records(CORPUS), 6)
    rich_run(stores[1], corpus_records(CORPUS), 6)
    assert compact_root(stores[0]._backend, remove_after_s=0, now=_later).status == "compacted"
    for store in stores:  # more rows of the same rollouts, and a new one
        fresh = CaptureStore(store.root, layout="journal")
        fresh.journal_writer_of("rows").write(
            [
                row_entry("0-0", {"model_call_id": "late", "dialect": "chat"}),
                row_entry("6-0", {"dialect": "chat"}),
            ]
        )
    expected = enriched(lines, CaptureStore(twin), "twin")
    assert enriched(lines, CaptureStore(url), "resumed") == expected
    second = compact_root(CaptureStore(url)._backend, remove_after_s=0, now=_later)
    assert second.status == "compacted" and second.generation == 2 and second.objects_after == 2
    assert enriched(lines, CaptureStore(url), "twice") == expected


def test_a_journal_that_may_still_be_written_is_refused_naming_its_root(tmp_path: Path) -> None:
    """A commit younger than the quiet period, or a claim still live (a call in flight), refuses
    the compaction with a message naming the root; nothing is written or removed."""
    url = str(tmp_path / "caps")
    store = CaptureStore(url, layout="journal")
    journal_run(CaptureStore(str(tmp_path / "released"), layout="journal"), 3, 2)  # every claim released
    young = compact_root(CaptureStore(str(tmp_path / "released"))._backend)
    assert young.status == "refused" and "released" in str(young.reason) and "quiet" in str(young.reason)
    rich_run(store, corpus_records(CORPUS), 6)
    store.journal_writer_of("claims").write([claim_entry("1-0", new_claim("in-flight", 600))])
    objects = _journal_objects(store)
    young = compact_root(store._backend)
    assert young.status == "refused" and url in str(young.reason)
    live = compact_root(store._backend, quiet_s=0)  # a call in flight: its row is still to come
    assert live.status == "refused" and url in str(live.reason) and "live" in str(live.reason)
    assert _journal_objects(store) == objects


def _write_forever(url: str, ready: Any, stop: Any) -> None:
    """A writer process: a claimed call, then its row, one after another until told to stop."""
    store = CaptureStore(url, layout="journal")
    n = 0
    while not stop.is_set():
        with store.claim(f"{n % 3}-0", f"w{n}"):
            store.record(f"{n % 3}-0", {"model_call_id": f"w{n}", "dialect": "chat"})
        n += 1
        if n == 3:
            ready.set()


def test_a_compaction_beside_a_running_writer_is_refused_and_loses_nothing(tmp_path: Path) -> None:
    """A writer process writing as the compaction looks: refused (a commit younger than the
    quiet period, or its claim live); once it has stopped and been quiet, compacted, every row
    it wrote read once, in order."""
    url = str(tmp_path / "caps")
    CaptureStore(url, layout="journal").journal_writer_of("rows").write(
        [row_entry("0-0", {"dialect": "chat"})]
    )
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    writer = context.Process(target=_write_forever, args=(url, ready, stop))
    writer.start()
    try:
        assert ready.wait(120), "the writer process did not start writing"
        for _ in range(3):
            done = compact_root(CaptureStore(url)._backend, remove_after_s=0)
            assert done.status == "refused" and url in str(done.reason), done
    finally:
        stop.set()
        writer.join(60)
    assert writer.exitcode == 0
    lines = [orjson.dumps({"_ng_task_index": r, "_ng_rollout_index": 0}) for r in range(3)]
    before = enriched(lines, CaptureStore(url), "before")
    done = compact_root(CaptureStore(url)._backend, remove_after_s=0, now=_later)
    assert done.status == "compacted"
    assert enriched(lines, CaptureStore(url), "after") == before
    calls = [c for line in before for c in orjson.loads(line)["ng_model_call_capture"]["calls"]]
    assert len(calls) == done.rows


# ----------------------------------------------------------------------------- killed mid-way


def _compact_until_killed(url: str, at: str, said: Any) -> None:
    """A compaction process that stops for good at ``at`` (a part uploaded, before or after its
    manifest is created, half the replaced commits removed) and says so: the test SIGKILLs it
    there. One that ends without reaching it (nothing left to do there) says ``finished``."""
    from rollout_capture.backends import base

    backend = CaptureStore(url)._backend
    cls = type(backend)
    original_upload, original_create, original_remove = cls.upload, cls.create, cls.remove

    def hang() -> None:
        said.put(at)
        while True:
            time.sleep(60)

    def upload(self: base.Backend, path: str, local: str) -> None:
        original_upload(self, path, local)
        if at == "part":
            hang()

    def create(self: base.Backend, path: str, data: bytes) -> None:
        if at == "before manifest" and path.endswith("manifest.json"):
            hang()
        original_create(self, path, data)
        if at == "manifest" and path.endswith("manifest.json"):
            hang()

    def remove(self: base.Backend, paths: list[str]) -> None:
        if at == "removing" and paths:
            original_remove(self, paths[: len(paths) // 2])
            hang()
        original_remove(self, paths)

    cls.upload, cls.create, cls.remove = upload, create, remove  # type: ignore[method-assign]
    compact_root(backend, remove_after_s=0, now=_later, part_bytes=4096)  # several parts
    said.put("finished")


KILL_POINTS = ["part", "before manifest", "manifest", "removing"]


@pytest.mark.parametrize("first", KILL_POINTS)
def test_a_compaction_killed_at_any_point_loses_and_doubles_nothing(tmp_path: Path, first: str) -> None:
    """A compaction process SIGKILLed at ``first``, then a second one at a point drawn by the seed
    (where it gets that far): after each kill a reader reads every row once, in order, as before
    compaction; a last compaction finishes (its journal: the manifest and its parts), the same."""
    rng = random.Random(KILL_POINTS.index(first))
    url = str(tmp_path / "caps")
    lines = rich_run(CaptureStore(url, layout="journal"), corpus_records(CORPUS), 10)
    before = enriched(lines, CaptureStore(url), "before")
    context = multiprocessing.get_context("spawn")
    hit = []
    for round_, at in enumerate([first, rng.choice(KILL_POINTS)]):
        said = context.Queue()
        process = context.Process(target=_compact_until_killed, args=(url, at, said))
        process.start()
        where = None
        try:
            where = said.get(timeout=120)
        finally:
            if where != "finished":  # hung where it was told (or never said): killed there
                os.kill(process.pid, signal.SIGKILL)
            process.join(30)
        assert where in (at, "finished")
        assert process.exitcode == (-signal.SIGKILL if where == at else 0)
        hit.append(where)
        assert enriched(lines, CaptureStore(url), f"round-{round_}") == before, f"killed at {at!r}"
    assert hit[0] == first  # a fresh journal: every point is reached
    done = compact_root(CaptureStore(url)._backend, remove_after_s=0, now=_later, part_bytes=4096)
    assert done.status in ("compacted", "already compacted"), done
    assert done.objects_after == 1 + done.parts and done.parts > 1
    assert enriched(lines, CaptureStore(url), "finished") == before


# ----------------------------------------------------------------------------- object stores


@pytest.mark.parametrize("store", ["s3", "gcs", "azure"], indirect=True)
def test_enrichment_is_byte_identical_after_compaction_on_an_object_store(
    store: Store, tmp_path: Path
) -> None:
    """The same on a real server of each store (moto, fake-gcs-server, Azurite), and the same bytes
    as the journal's objects copied to a local disk before compaction."""
    url = store.url("caps")
    found = _compact_and_compare(url, store.storage_options or None, 10)
    assert found["commits"] > 10


def test_a_compacted_run_on_s3_costs_a_handful_of_requests(flaky_s3: tuple[Any, Any], s3: Any) -> None:
    """A compacted run's enrichment on S3 (a job of batches sharing one listing): the listing, the
    manifest, and at most a ranged GET of its part a batch (a batch's rollouts lie together,
    near ranges fetched as one); no HEAD, and fewer than half the GETs of a GET a commit."""
    via, proxy = flaky_s3
    url, options = s3.url("caps"), s3.storage_options
    lines = rich_run(CaptureStore(url, storage_options=options, layout="journal"), corpus_records(CORPUS), 60)
    proxy.reset_counts()
    before = enriched(lines, CaptureStore(via.url("caps"), storage_options=via.storage_options), "before")
    uncompacted = proxy.reset_counts()
    done = compact_root(CaptureStore(url, storage_options=options)._backend, remove_after_s=0, now=_later)
    assert done.status == "compacted" and done.parts == 1
    proxy.reset_counts()
    after = enriched(lines, CaptureStore(via.url("caps"), storage_options=via.storage_options), "after")
    counts = proxy.reset_counts()
    assert after == before
    batches = -(-len(lines) // 10)
    assert set(counts) == {"LIST", "GET"} and counts["LIST"] == 1, (counts, uncompacted)
    assert 2 <= counts["GET"] <= 1 + batches, (counts, uncompacted)  # the manifest, then the part's ranges
    assert uncompacted["GET"] > 2 * counts["GET"]


def test_a_quiet_period_is_judged_by_the_stores_clock(tmp_path: Path) -> None:
    """Nothing written for ``QUIET_S`` by the store's clock: compacted without a shifted clock."""
    url = str(tmp_path / "caps")
    store = CaptureStore(url, layout="journal")
    store.journal_writer_of("rows").write([row_entry("0-0", {"dialect": "chat"})])
    old = time.time() - QUIET_S - 10
    for path in (tmp_path / "caps" / "_journal").rglob("*"):
        os.utime(path, (old, old))
    assert compact_root(CaptureStore(url)._backend, remove_after_s=0).status == "compacted"


@pytest.mark.integration  # two CLI processes
def test_the_compact_command_refuses_a_journal_written_just_now_then_compacts_it(tmp_path: Path) -> None:
    """``rollout-capture compact``: exit 1 naming the root while the journal may still be written;
    told a quiet period it has had, exit 0 with the objects before and after (``--json``)."""
    from .support.cli import run_cli

    url = str(tmp_path / "caps")
    lines = journal_run(CaptureStore(url, layout="journal"), 6, 2)
    before = enriched(lines, CaptureStore(url), "before")
    refused = run_cli("compact", url)
    assert refused.returncode == 1 and f"refused: {url} may still be written" in refused.stderr
    done = run_cli("compact", url, "--quiet", "0", "--remove-after", "0", "--json")
    assert done.returncode == 0, done.stderr
    summary = orjson.loads(done.stdout)
    assert summary["status"] == "compacted" and summary["objects_after"] == 2
    assert summary["objects_before"] == summary["removed"] == 4  # 12 calls, 6 a commit: 2 of each stream
    assert enriched(lines, CaptureStore(url), "after") == before


def test_enrich_runs_compacts_the_runs_it_enriched_when_asked(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``enrich_completed_runs(compact=True)`` (``enrich-runs --compact``): the run enriched, then its
    journal compacted (its commits removed); the run's captures then read as they did."""
    from rollout_capture import compaction
    from rollout_capture.flows import enrich_completed_runs

    # The replaced commits removed at once, not DELETE_AFTER_S (30 s) after the manifest.
    monkeypatch.setitem(compaction.compact_root.__kwdefaults__, "remove_after_s", 0.0)
    run = tmp_path / "runs" / "r1"
    captures = str(run / "captures")
    lines = journal_run(CaptureStore(captures, layout="journal"), 6, 2)
    (run / "rollouts.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    (run / "_SUCCESS").touch()
    old = time.time() - QUIET_S - 10  # the run ended a while ago
    for path in (run / "captures" / "_journal").rglob("*"):
        os.utime(path, (old, old))
    before = enriched(lines, CaptureStore(captures), "before")
    summary = enrich_completed_runs(str(tmp_path / "runs"), compact=True)
    assert summary.enriched == ["r1"] and summary.compaction == {"r1": "compacted"}
    left = sorted(p.name for p in (run / "captures" / "_journal").rglob("*") if p.is_file())
    assert len(left) == 2 and left[0] == "manifest.json"
    assert enriched(lines, CaptureStore(captures), "after") == before


def test_a_compacted_run_is_followed_to_the_output_post_run_enrichment_gives(
    prefect_api: str, tmp_path: Path
) -> None:
    """Following (``follow_run``) reads a compacted run's captures: its published output is the
    bytes post-run enrichment wrote over the same captures before they were compacted."""
    import shutil

    from rollout_capture.flows import enrich_completed_runs
    from rollout_capture.flows.follow import follow_run
    from rollout_capture.run_folders import OUTPUT, STARTED, SUCCESS

    run = tmp_path / "runs" / "r1"
    lines = rich_run(CaptureStore(str(run / "captures"), layout="journal"), corpus_records(CORPUS), 9)
    (run / "rollouts.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    (run / STARTED).touch()
    (run / SUCCESS).touch()
    shutil.copytree(tmp_path / "runs", tmp_path / "before")
    assert enrich_completed_runs(str(tmp_path / "before")).enriched == ["r1"]
    done = compact_root(CaptureStore(str(run / "captures"))._backend, remove_after_s=0, now=_later)
    assert done.status == "compacted"
    assert follow_run(str(run)).status == "published"
    assert (run / OUTPUT).read_bytes() == (tmp_path / "before" / "r1" / OUTPUT).read_bytes()


def test_a_compaction_told_to_wait_waits_out_the_quiet_period_once(tmp_path: Path) -> None:
    """``wait_quiet`` (``enrich-runs --compact``, ``compact --wait-quiet``): a journal written just
    now is compacted once its quiet period is over, the wait the rest of it (by the store's
    clock); a live claim is refused at once, not waited for."""
    url = str(tmp_path / "caps")
    lines = journal_run(CaptureStore(url, layout="journal"), 4, 2)
    before = enriched(lines, CaptureStore(url), "before")
    moment = [time.time()]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        moment[0] += seconds

    done = compact_root(
        CaptureStore(url)._backend, wait_quiet=True, remove_after_s=0, now=lambda: moment[0], sleep=sleep
    )
    assert done.status == "compacted"
    assert len(waits) == 1 and QUIET_S - 30 < waits[0] <= QUIET_S  # what was left of the quiet period
    assert enriched(lines, CaptureStore(url), "after") == before
    live = str(tmp_path / "live")
    CaptureStore(live, layout="journal").journal_writer_of("claims").write(
        [claim_entry("0-0", new_claim("in-flight", 600))]
    )
    refused = compact_root(CaptureStore(live)._backend, wait_quiet=True, sleep=sleep)
    assert refused.status == "refused" and "live" in str(refused.reason) and len(waits) == 1


def test_a_part_read_whole_has_the_next_part_copied_behind_it() -> None:
    """On an object store, a read needing much of a part copies it and then the next part in the
    background (a whole run is read part after part): the next part's rows are then read from
    the copy, even with the part gone from the store, and nothing is fetched twice."""
    import uuid

    from rollout_capture.journal.compacted import newest_manifest
    from rollout_capture.journal.parts import PartsReader

    store = CaptureStore(f"memory://parts-{uuid.uuid4().hex}", layout="journal")
    journal_run(store, 60, 3)
    backend = store._backend
    done = compact_root(backend, remove_after_s=0, now=_later, part_bytes=4096)
    manifest = newest_manifest(backend)
    assert done.status == "compacted" and manifest is not None and len(manifest.parts) >= 3

    def whole(part: int) -> list[tuple[int, int, int]]:
        return [(part, placed.offset, placed.length) for placed in manifest.parts[part].rollouts]

    def stored(part: int) -> list[bytes]:
        data = backend.fs.cat_file(manifest.part_path(backend, part))
        return [data[offset : offset + length] for _, offset, length in whole(part)]

    expected = stored(1)
    reader = PartsReader(backend, manifest)
    try:
        assert reader.read(whole(0)) == stored(0)
        wait_for(lambda: 1 in reader._copies, what="the next part's copy")
        assert reader.requests == 2  # a part of 4 kB: one ranged GET each
        backend.fs.rm_file(manifest.part_path(backend, 1))
        assert reader.read(whole(1)) == expected  # from the copy made ahead
        assert reader.requests == 3  # part 1 not fetched again; part 2 now copied behind it
    finally:
        reader.clear()
