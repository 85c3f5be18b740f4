"""Finding run folders: one delimiter listing per folder, concurrently, never a HEAD; the root's
index spares the enriched ones even that; hand-written folders and rechecks are still seen."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture.run_folders import INDEX, RunsRoot, finish_run

from .conftest import S3
from .support.runs_helpers import make_run, run_objects


def statuses(root: RunsRoot, **kwargs: Any) -> dict[str, str]:
    found = root.discover(**kwargs)
    return {
        run.name: "enriched" if run.enriched else "ready" if run.finished else "unfinished"
        for run in found.runs
    }


def test_discovery_on_s3_lists_each_folder_once_then_the_index_spares_enriched_ones(
    flaky_s3: tuple[S3, Any], s3: S3
) -> None:
    via, proxy = flaky_s3
    objects: dict[str, bytes] = {}
    for i in range(30):
        objects |= run_objects("runs", f"done-{i:02d}", finished=True, enriched=True)
    for i in range(3):
        objects |= run_objects("runs", f"ready-{i}", finished=True)
    for i in range(2):
        objects |= run_objects("runs", f"running-{i}", finished=False)
    objects["runs/not-a-run/notes.txt"] = b""
    s3.fs().pipe({f"{s3.bucket}/{key}": data for key, data in objects.items()})
    root = RunsRoot(via.url("runs"), via.storage_options)

    proxy.reset_counts()
    first = statuses(root)
    assert proxy.reset_counts() == {"LIST": 1 + 36, "PUT": 1}  # the root, each folder once; the index
    assert sum(s == "enriched" for s in first.values()) == 30
    assert {n for n, s in first.items() if s != "enriched"} == {
        "ready-0",
        "ready-1",
        "ready-2",
        "running-0",
        "running-1",
    }

    assert statuses(root) == first
    assert proxy.reset_counts() == {"LIST": 1 + 6, "GET": 1}  # enriched runs: not listed at all

    # A run folder written by hand is found; a run whose _ENRICHED was deleted is re-checked on request.
    s3.fs().pipe({f"{s3.bucket}/{k}": v for k, v in run_objects("runs", "by-hand", finished=True).items()})
    s3.fs().rm(f"{s3.bucket}/runs/done-07/_ENRICHED")
    assert statuses(root)["done-07"] == "enriched"  # the index still says so
    proxy.reset_counts()
    third = statuses(root, recheck=["done-07"])
    assert third["by-hand"] == "ready" and third["done-07"] == "ready"
    # The index loses done-07: read again before it is rewritten (what the tick took on trust from
    # it stays only if it is still there: finish may have dropped a run meanwhile).
    assert proxy.reset_counts() == {"LIST": 1 + 8, "GET": 2, "PUT": 1}
    assert statuses(root)["done-07"] == "ready"


def test_discovery_on_local_disk_and_a_full_scan(tmp_path: Path) -> None:
    assert RunsRoot(str(tmp_path / "typo")).discover().runs == []
    assert not (tmp_path / "typo").exists()  # a wrong root is not created by writing an index
    for name in ("a", "b"):
        make_run(tmp_path, name, finished=True, enriched=True)
    make_run(tmp_path, "c", finished=True)
    make_run(tmp_path, "d", finished=False)
    (tmp_path / "not-a-run").mkdir()
    root = RunsRoot(str(tmp_path))

    first = root.discover()
    assert (first.listed, first.indexed) == (5, 0) and (tmp_path / INDEX).exists()
    second = root.discover()
    assert (second.listed, second.indexed) == (3, 2) and second.runs == first.runs
    assert [r.name for r in root.runs()] == ["a", "b", "c", "d"]  # runs(): everything listed

    (tmp_path / "b" / "_ENRICHED").unlink()
    full = root.discover(use_index=False)
    assert full.listed == 5 and next(r for r in full.runs if r.name == "b").finished
    assert not next(r for r in full.runs if r.name == "b").enriched
    assert root.discover().indexed == 1  # the full scan rebuilt the index: only "a" is in it

    (tmp_path / INDEX).write_bytes(b"{torn")  # a damaged index is a full scan, then rewritten
    assert root.discover().listed == 5
    assert root.discover().indexed == 1
    root.remember_enriched(["c"])  # what a tick does after enriching c
    assert orjson.loads((tmp_path / INDEX).read_bytes())["enriched"] == ["a", "c"]


def test_a_run_finish_drops_from_the_index_while_a_tick_lists_stays_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``b`` deleted and made again, then finished (its index entry dropped) while a tick lists the
    folders it did not find in the index: the tick's rewrite does not bring ``b`` back."""
    for name in ("a", "b"):
        make_run(tmp_path, name, finished=True, enriched=True)
    root = RunsRoot(str(tmp_path))
    root.discover()
    make_run(tmp_path, "c", finished=True, enriched=True)  # new: the tick lists it, then rewrites the index
    shutil.rmtree(tmp_path / "b")
    make_run(tmp_path, "b", finished=True)
    backend, listing = root.backend, root.backend.list_names

    def list_while_b_is_finished(paths: list[str]) -> Any:
        if paths == [backend.path("c")]:
            finish_run(str(tmp_path / "b"))  # another process, between the tick's read and its write
        return listing(paths)

    monkeypatch.setattr(backend, "list_names", list_while_b_is_finished)
    assert statuses(root) == {"a": "enriched", "b": "enriched", "c": "enriched"}  # read before finish
    monkeypatch.undo()
    assert orjson.loads((tmp_path / INDEX).read_bytes())["enriched"] == ["a", "c"]
    assert statuses(root)["b"] == "ready"


def test_a_held_run_is_named_not_listed_until_finished_again_or_rechecked(tmp_path: Path) -> None:
    """A run an earlier tick refused for its own input (issue 45) says why in its ``_REFUSED``:
    discovery names it held and leaves it out of the runs, a recheck lists it (marked held), and
    ``finish`` drops the marker so the next tick tries it again. Root-level links are named apart."""
    root = tmp_path / "runs"
    make_run(root, "r1", finished=True)
    make_run(root, "r2", finished=True)
    (root / "latest").symlink_to(root / "r2")
    runs = RunsRoot(str(root))
    runs.hold("r1", "capture dir r1/captures holds no capture")
    found = runs.discover()
    assert [r.name for r in found.runs] == ["r2"]
    assert found.held == {"r1": "capture dir r1/captures holds no capture"}
    assert list(found.links) == ["latest"] and found.refused == {}
    rechecked = runs.discover(recheck=["r1"])
    assert [(r.name, r.held) for r in rechecked.runs] == [("r1", True), ("r2", False)]
    assert finish_run(str(root / "r1")).held
    assert not (root / "r1" / "_REFUSED").exists()
    assert [r.name for r in runs.discover().runs] == ["r1", "r2"]
