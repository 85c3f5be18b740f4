"""A hostile disk (issue 15): links planted inside a capture or runs root, a full disk, ids too
long for a file name.

Real parts throughout: symbolic links on the local disk, a 2 MB tmpfs that really fills up,
the capture proxy served in this process or as its own process (stopped with SIGTERM), and
the scripted upstream behind it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.attachment import GAP_RECORDS_UNREADABLE
from rollout_capture.backends.posix_files import LINK_REASON, LinkedEntryError
from rollout_capture.claims import claim_body, new_claim
from rollout_capture.identity import MAX_ROLLOUT_ID_LENGTH, NAME_MAX, rollout_id_of, validate_rollout_id
from rollout_capture.names import CLAIMS_SUFFIX, JSONL_SUFFIX, MARKER_SUFFIX, OBJECTS_SUFFIX, SEQ_WIDTH
from rollout_capture.rows import Damage
from rollout_capture.run_folders import CAPTURES, ROLLOUTS, SUCCESS, RunFolder, RunsRoot

from .support.producer_calls import sdk_call
from .test_proxy import Proxy, Spawned

ROW = {"kind": "model_call", "n": 0}


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under a folder and its bytes (None for folders), links not followed."""
    out: dict[str, bytes | None] = {}
    for path in sorted(folder.rglob("*")):
        out[str(path.relative_to(folder))] = None if path.is_dir() else path.read_bytes()
    return out


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, Path]:
    """``(capture root, a folder outside it holding a victim file)``.

    The root is itself a link (``/data -> /mnt/data``): the user's own choice, followed;
    only the entries inside it are refused.
    """
    root, outside = tmp_path / "caps", tmp_path / "outside"
    (tmp_path / "real-caps").mkdir()
    root.symlink_to("real-caps")
    outside.mkdir()
    (outside / "victim.txt").write_bytes(b"precious\n")
    return root, outside


# ---------------------------------------------------------------- links: writers


def test_rows_are_never_appended_through_a_link_nor_create_a_file_outside(world: tuple[Path, Path]) -> None:
    root, outside = world
    before = tree(outside)
    (root / "r1.capture.jsonl").symlink_to("../outside/victim.txt")
    (root / "r1b.capture.jsonl").symlink_to("../outside/created.txt")  # dangling
    store = CaptureStore(root)
    for rollout_id in ("r1", "r1b"):
        with pytest.raises(LinkedEntryError, match=re.escape(f"{rollout_id}.capture.jsonl")):
            store.record(rollout_id, ROW)
        with pytest.raises(LinkedEntryError):  # the unstaged append (a busy lock) refuses too
            store._backend.append_line(str(root / f"{rollout_id}.capture.jsonl"), b"{}\n")
        assert store.is_incomplete(rollout_id)  # the failure path: logged and marked
        assert not (root / f"{rollout_id}.capture.incomplete").is_symlink()
    assert tree(outside) == before


def test_claims_are_never_created_or_deleted_through_a_linked_folder(world: tuple[Path, Path]) -> None:
    root, outside = world
    (outside / "claims").mkdir()
    kept = new_claim("call-0", 300)
    (outside / "claims" / f"{kept.claim_id}.json").write_bytes(claim_body(kept))
    before = tree(outside)
    (root / "r2.capture.claims").symlink_to("../outside/claims")
    (root / "r2b.capture.claims").symlink_to("../outside/none")  # dangling
    store = CaptureStore(root)
    for rollout_id in ("r2", "r2b"):
        linked = re.escape(f"{rollout_id}.capture.claims")
        with pytest.raises(LinkedEntryError, match=linked), store.claim(rollout_id):
            pass
    with pytest.raises(LinkedEntryError):
        store._backend.remove([str(root / "r2.capture.claims" / f"{kept.claim_id}.json")])
    assert store.claims(["r2", "r2b"]) == {}  # an outside claim is no claim of ours
    with store.claim("ok-1"):  # through the root's own link, claims and rows work as ever
        store.record("ok-1", ROW)
        assert list(store.claims(["ok-1"])) == ["ok-1"]
    assert store.read("ok-1") == [ROW] and store.clear(["ok-1"]) == ["ok-1"]
    assert store.clear(["r2", "r2b"]) == ["r2", "r2b"]
    assert os.listdir(root) == []  # the links went, and nothing they pointed to
    assert tree(outside) == before


def test_object_rows_are_never_written_into_a_linked_folder(world: tuple[Path, Path]) -> None:
    root, outside = world
    (outside / "objects").mkdir()
    (root / "r5.capture").symlink_to("../outside/objects")
    (root / "r5.capture.incomplete").symlink_to("../outside/victim.txt")
    before = tree(outside)
    store = CaptureStore(root, layout="objects")
    with pytest.raises(LinkedEntryError, match=re.escape("/r5.capture'")):
        store.record("r5", ROW)
    # The marker's name held a link: it is replaced by a real marker, never written through.
    assert (root / "r5.capture.incomplete").is_file() and not (root / "r5.capture.incomplete").is_symlink()
    assert tree(outside) == before
    assert not [name for name in os.listdir(root) if name.startswith(".tmp-")]


# ---------------------------------------------------------------- links: readers


@pytest.mark.parametrize("batch", [1, 40], ids=["probed", "listed"])
def test_readers_report_a_linked_entry_as_damage_and_never_read_it(
    world: tuple[Path, Path], batch: int
) -> None:
    root, outside = world
    row = orjson.dumps({"kind": "model_call", "status_code": 200}) + b"\n"
    (outside / "rows.jsonl").write_bytes(row * 3)
    (outside / "objects").mkdir()
    (outside / "objects" / "000000000000.json").write_bytes(row)
    (outside / "claims").mkdir()
    live = new_claim("call-0", 300)
    (outside / "claims" / f"{live.claim_id}.json").write_bytes(claim_body(live))
    (root / "r3.capture.jsonl").symlink_to("../outside/rows.jsonl")
    (root / "r4.capture").symlink_to(outside / "objects")
    (root / "r5.capture.jsonl").symlink_to("/etc/passwd")
    (root / "r6.capture").mkdir()  # a real folder: its real row is read, its link is not
    (root / "r6.capture" / "000000000000.json").write_bytes(row)
    (root / "r6.capture" / "000000000001.json").symlink_to(outside / "objects" / "000000000000.json")
    (root / "r7.capture.claims").symlink_to("../outside/claims")
    (root / "r8.capture").symlink_to("../outside/missing")  # dangling
    expected = {
        "r3": ([], ["r3.capture.jsonl"]),
        "r4": ([], ["r4.capture"]),
        "r5": ([], ["r5.capture.jsonl"]),
        "r6": ([(0, orjson.loads(row))], ["r6.capture/000000000001.json"]),
        "r7": ([], ["r7.capture.claims"]),
        "r8": ([], ["r8.capture"]),
    }
    store = CaptureStore(root)
    padding = [f"pad-{n}" for n in range(batch - 1)]
    fetched = store.prefetch([*expected, *padding])
    for rollout_id, (rows, linked) in expected.items():
        snap = fetched.snapshot(rollout_id)
        assert snap.found, rollout_id
        assert snap.rows == rows, rollout_id
        assert snap.damaged == [Damage(str(root / name), None, LINK_REASON) for name in linked]
    assert store.claims(expected) == {}
    record = {"_ng_rollout_id": "r3"}
    gaps = merge_model_call_capture_into_record(record, [store])["ng_model_call_capture"]["gaps"]
    assert {"code": GAP_RECORDS_UNREADABLE, "detail": "count=1"} in gaps


# ---------------------------------------------------------------- links: run folders


def make_run(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / ROLLOUTS).write_bytes(b'{"_ng_rollout_id": "a"}\n')
    (folder / SUCCESS).write_bytes(b"")
    (folder / CAPTURES).mkdir()


def test_discovery_refuses_linked_run_folders_and_runs_holding_links(tmp_path: Path) -> None:
    root, outside = tmp_path / "runs", tmp_path / "outside"
    make_run(tmp_path / "real-runs" / "ok")
    root.symlink_to("real-runs")  # the root may be a link; what is in it may not
    make_run(outside / "run")
    (outside / "caps").mkdir()
    (outside / "index.json").write_bytes(b'{"format": 1, "enriched": ["ok"]}')
    (root / "evil").symlink_to(outside / "run")
    make_run(root / "sneaky")
    (root / "sneaky" / CAPTURES).rmdir()
    (root / "sneaky" / CAPTURES).symlink_to(outside / "caps")
    make_run(root / "leased")
    (root / "leased" / "_ENRICHING.000000").symlink_to(outside / "lease.json")  # dangling
    (root / "_rollout_capture_index.json").symlink_to(outside / "index.json")
    before = tree(outside)
    runs = RunsRoot(str(root))
    found = runs.discover()
    assert [run.name for run in found.runs] == ["ok"]
    assert not found.runs[0].enriched  # the linked index was not read
    assert sorted(found.refused) == ["leased", "sneaky"]  # run folders holding links: the tick fails once
    assert sorted(found.links) == ["_rollout_capture_index.json", "evil"]  # no run folders of the root
    assert found.refused["sneaky"].startswith("captures:")
    evil = RunFolder(name="evil", url=f"{root}/evil", finished=True, enriched=False)
    with pytest.raises(LinkedEntryError, match="evil"):
        runs.take(evil)
    leased = RunFolder(name="leased", url=f"{root}/leased", finished=True, enriched=False)
    with pytest.raises(LinkedEntryError, match=r"_ENRICHING\.000000"):  # its name is taken by the link
        runs.take(leased)
    assert tree(outside) == before


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MB tmpfs, unmounted afterwards; skipped where mounting is not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Fill the disk to the last byte; the filler file, to be removed when space may return."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1):
            with pytest.raises(OSError) as full:
                while True:
                    os.write(fd, b"\0" * size)
            assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_an_append_that_hits_a_full_disk_leaves_the_file_as_it_was(tmpfs: Path) -> None:
    store = CaptureStore(tmpfs / "caps")
    store.record("d-1", ROW)
    capture = tmpfs / "caps" / "d-1.capture.jsonl"
    before = capture.read_bytes()
    filler = fill(tmpfs)
    big = {"kind": "model_call", "pad": "x" * 6000}  # more than the slack of the file's last page
    with pytest.raises(OSError) as full:
        store.record("d-1", big)  # staged: written under the lock on the caller's loop
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        store._backend.append_line(str(capture), orjson.dumps(big) + b"\n")  # the whole append in one step
    assert capture.read_bytes() == before  # no partial line for the next row to be glued onto
    filler.unlink()  # space returns
    after = {"kind": "model_call", "n": 2}
    store.record("d-1", after)
    assert store.read_available("d-1") == ([(0, ROW), (1, after)], 0)
    assert store.is_incomplete("d-1")


def test_a_torn_line_left_by_a_dead_writer_stays_the_only_damage(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    (tmp_path / "t-1.capture.jsonl").write_bytes(orjson.dumps(ROW) + b'\n{"kind": "model_call", "pa')
    after = {"kind": "model_call", "n": 2}
    store.record("t-1", after)
    rows, damaged = store.read_available("t-1")
    assert (rows, damaged) == ([(0, ROW), (2, after)], 1)  # the torn row keeps its position


def test_failed_claims_and_puts_leave_no_file_behind(tmpfs: Path) -> None:
    store = CaptureStore(tmpfs / "caps")
    store.record("c-0", ROW)  # the root exists: only the claim's own write can fail
    filler = fill(tmpfs)
    with pytest.raises(OSError) as full, store.claim("c-1", "call-1"):
        pass
    assert full.value.errno == errno.ENOSPC
    assert store.claims(["c-1"]) == {}  # no empty claim holding enrichment for its TTL
    assert os.listdir(tmpfs / "caps" / "c-1.capture.claims") == []
    backend = store._backend
    with pytest.raises(OSError):
        backend.put(backend.path("big.json"), b"x" * 10_000)
    with pytest.raises(OSError):
        CaptureStore(tmpfs / "caps", layout="objects").record("c-2", {"pad": "x" * 10_000})
    filler.unlink()
    (tmpfs / "caps" / "a-folder").mkdir()
    with pytest.raises(IsADirectoryError):  # the rename fails: the temp file goes too
        backend.put(backend.path("a-folder"), b"{}")
    leftovers = [p for p in tree(tmpfs / "caps") if os.path.basename(p).startswith(".tmp-")]
    assert leftovers == []


def test_a_proxy_on_a_full_disk_serves_every_call_and_leaves_whole_rows_and_no_claim(
    scripted_upstream: tuple[str, Any], tmpfs: Path
) -> None:
    spawned = Spawned(scripted_upstream[0], tmpfs / "caps")
    store = CaptureStore(tmpfs / "caps")
    try:
        for n in range(9):  # 3 calls with space, 3 on a full disk, 3 once space returned
            if n == 3:
                filler = fill(tmpfs)
            if n == 6:
                filler.unlink()
            assert sdk_call(spawned.url, "9-0", "chat", stream=n % 2 == 1)["tool"] == "get_weather"
        spawned.proc.send_signal(signal.SIGTERM)
        assert spawned.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        spawned.stop()
    rows, damaged = store.read_available("9-0")
    # Every row whole; those that failed are absent (one may have fitted in the last page's slack).
    assert damaged == 0 and 6 <= len(rows) < 9
    assert store.is_incomplete("9-0")
    assert store.claims(["9-0"]) == {}
    assert any("capture write failed for rollout 9-0" in line for line in spawned.log)


# ---------------------------------------------------------------- links and long ids at the proxy


def test_the_proxy_serves_a_call_whose_capture_file_is_a_link_and_marks_the_rollout(
    scripted_upstream: tuple[str, Any], world: tuple[Path, Path]
) -> None:
    root, outside = world
    before = tree(outside)
    (root / "p-1.capture.jsonl").symlink_to("../outside/victim.txt")
    (root / "p-2.capture.claims").symlink_to("../outside")
    served = Proxy(scripted_upstream[0], str(root), claims="files")  # a claim file a call, as before the log
    try:
        for rollout_id in ("p-1", "p-2"):
            assert sdk_call(served.url, rollout_id, "chat", stream=False)["tool"] == "get_weather"
    finally:
        served.server.stop()
    assert tree(outside) == before
    assert served.store.is_incomplete("p-1") and served.store.read_available("p-1")[0] == []
    assert served.store.is_incomplete("p-2") and len(served.store.read_available("p-2")[0]) == 1


def test_the_longest_id_fits_every_capture_file_and_a_longer_one_is_refused(tmp_path: Path) -> None:
    longest = "a" * MAX_ROLLOUT_ID_LENGTH
    for suffix in (JSONL_SUFFIX, MARKER_SUFFIX, OBJECTS_SUFFIX, CLAIMS_SUFFIX):
        assert len((longest + suffix).encode()) <= NAME_MAX
    assert len(f".tmp-{uuid.uuid4().hex}") <= NAME_MAX and SEQ_WIDTH + len(".json") <= NAME_MAX
    store = CaptureStore(tmp_path / "jsonl")
    with store.claim(longest, "call-0"):
        claimed = sorted(os.listdir(tmp_path / "jsonl"))  # the claims folder's name fits too
        store.record(longest, ROW)
    store.mark_incomplete(longest)
    assert claimed == [longest + CLAIMS_SUFFIX]
    objects = CaptureStore(tmp_path / "objects", layout="objects")
    objects.record(longest, ROW)
    assert store.read(longest) == [ROW] and objects.read(longest) == [ROW]
    assert store.is_incomplete(longest)
    too_long = longest + "b"
    with pytest.raises(ValueError, match=f"invalid rollout id .*{MAX_ROLLOUT_ID_LENGTH + 1} characters"):
        validate_rollout_id(too_long)
    with pytest.raises(ValueError, match="invalid rollout id"):
        store.record(too_long, ROW)
    with pytest.raises(ValueError, match="invalid rollout id"):  # derived ids too, however made
        rollout_id_of({"_ng_task_index": 10**240, "_ng_rollout_index": 0})
    shutil.rmtree(tmp_path / "objects")
    assert sorted(os.listdir(tmp_path / "jsonl")) == [  # the emptied claims folder is removed
        longest + MARKER_SUFFIX,
        longest + JSONL_SUFFIX,
    ]


def test_the_proxy_answers_400_to_an_id_too_long_for_a_file_name(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    served = Proxy(scripted_upstream[0], str(tmp_path))
    seen = len(scripted_upstream[1].seen)
    try:
        with httpx.Client(base_url=served.url) as client:
            answer = client.post(f"/ng-rollout/{'a' * 300}/v1/chat/completions", json={"model": "scripted"})
        assert answer.status_code == 400
        assert "invalid rollout id" in answer.json()["error"]["message"]
        assert len(scripted_upstream[1].seen) == seen  # never forwarded
        assert os.listdir(tmp_path) == []  # no row, claim, marker or temp file
        longest = "a" * MAX_ROLLOUT_ID_LENGTH
        assert sdk_call(served.url, longest, "chat", stream=False)["tool"] == "get_weather"
    finally:
        served.server.stop()
    assert len(served.store.read(longest)) == 1
