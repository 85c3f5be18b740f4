"""A hostile world around an enrichment: bad inputs, planted links, full disks, crashed runs, weak stores.

End to end through ``python -m rollout_capture.cli enrich`` (real processes, a real Prefect
server, a real tmpfs, a real SIGKILL), plus the core pieces that decide each case.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore, rollout_files
from rollout_capture.backends import UnsafeStoreError, open_backend
from rollout_capture.batch import DuplicateIds, enrich_blob
from rollout_capture.rollout_files import (
    LEGACY_TEMP_STALE_S,
    OutputPathError,
    OutputSpool,
    RolloutsFileError,
    publish,
    remove_stale_temp_files,
    stage_rollouts,
)

from .conftest import SAMPLE

CAPTURES = SAMPLE / "captures"
ROLLOUTS = SAMPLE / "rollouts.jsonl"


def cli(*args: str, api: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": api}
    return subprocess.run(
        [sys.executable, "-m", "rollout_capture.cli", "enrich", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def temp_files(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if ".tmp-" in name)


# ---------------------------------------------------------------------- inputs


def test_a_fifo_as_input_is_refused_naming_it(prefect_api: str, tmp_path: Path) -> None:
    """It used to hang forever (opening a FIFO blocks until a writer comes)."""
    fifo = tmp_path / "rollouts.jsonl"
    os.mkfifo(fifo)
    done = cli(str(fifo), "--capture-dir", str(CAPTURES), api=prefect_api, timeout=120)
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: rollouts file") and str(fifo) in error and "not a regular file" in error
    assert not (tmp_path / "rollouts.enriched.jsonl").exists()


def test_a_fifo_behind_a_gz_name_and_a_directory_are_refused_too(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "r.jsonl.gz")
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(RolloutsFileError, match=r"r\.jsonl\.gz is a FIFO"):
        stage_rollouts(str(tmp_path / "r.jsonl.gz"))
    with pytest.raises(RolloutsFileError, match=r"d\.jsonl is a directory"):
        stage_rollouts(str(tmp_path / "d.jsonl"))


@pytest.mark.parametrize(
    ("content", "detail"),
    [
        (gzip.compress(ROLLOUTS.read_bytes())[:-300], "Compressed file ended"),  # truncated
        (
            ROLLOUTS.read_bytes(),
            "its first bytes are b'{",
        ),  # plain JSONL named .gz: refused by its magic bytes
    ],
    ids=["truncated", "fake"],
)
def test_a_broken_gz_input_is_bad_input_naming_the_file(
    prefect_api: str, tmp_path: Path, content: bytes, detail: str
) -> None:
    """It used to exit 1 with a bare ``EOFError`` / ``BadGzipFile`` and no file name."""
    source = tmp_path / "rollouts.jsonl.gz"
    source.write_bytes(content)
    done = cli(str(source), "--capture-dir", str(CAPTURES), api=prefect_api)
    assert done.returncode == 2, done.stderr
    assert f"error: rollouts file {source} is not valid gzip data" in done.stderr
    assert detail in done.stderr
    assert not (tmp_path / "rollouts.enriched.jsonl").exists()
    assert temp_files(tmp_path) == []


def test_a_failed_read_of_a_gz_input_stays_a_storage_fault(tmp_path: Path) -> None:
    """Only the decompressor's complaints are bad input: an error reading the bytes is raised as it came."""
    source = tmp_path / "r.jsonl.gz"
    source.write_bytes(gzip.compress(b'{"a": 1}\n' * 1000))

    class Failing:
        def __init__(self, raw: object) -> None:
            self.raw = raw

        def read(self, size: int = -1) -> bytes:
            raise ConnectionResetError("connection reset by peer")

        def __getattr__(self, name: str) -> object:
            return getattr(self.raw, name)

    tracked = rollout_files._TrackedReads(Failing(open(source, "rb")))  # type: ignore[arg-type]  # noqa: SIM115
    handle = gzip.GzipFile(fileobj=tracked, mode="rb")
    with pytest.raises(ConnectionResetError):
        handle.read(10)
    assert tracked.failed is not None  # what makes stage_rollouts re-raise it untouched


def test_duplicate_rollout_ids_are_warned_about_and_counted(prefect_api: str, tmp_path: Path) -> None:
    """Several lines of one id each got the same calls without a word; now named, across batches too."""
    lines = ROLLOUTS.read_bytes().splitlines(keepends=True)
    source = tmp_path / "rollouts.jsonl"
    source.write_bytes(b"".join([*lines, lines[0], lines[2], lines[0]]))  # lines 13-15 repeat 1, 3, 1
    out = tmp_path / "out.jsonl"
    args = ["--capture-dir", str(CAPTURES), "--output", str(out), "--batch-size", "4", "--json"]
    done = cli(str(source), *args, api=prefect_api)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)["stats"]
    assert stats["duplicate_id_lines"] == 3
    ids = {d["rollout_id"]: d["lines"] for d in stats["duplicate_ids"]}
    assert len(ids) == 2 and sorted(ids.values()) == [[1, 13, 15], [3, 14]]
    assert "2 rollout id(s) appear on more than one line" in done.stderr
    assert "(lines 1, 13, 15)" in done.stderr and "(lines 3, 14)" in done.stderr


def test_duplicate_ids_are_named_by_the_core_logger(caplog: pytest.LogCaptureFixture) -> None:
    lines = ROLLOUTS.read_bytes().splitlines(keepends=True)
    store = CaptureStore(str(CAPTURES))
    tracker = DuplicateIds()
    total = None
    for first, blob in ((1, b"".join(lines[:4])), (5, lines[0] + lines[1] + lines[0])):
        _, _, stats = enrich_blob(blob, [store], first_line=first, quiescence_timeout_s=0)
        tracker.add(stats)
        assert stats.id_lines == {}  # carried to the tracker only
        total = stats if total is None else total + stats
    assert total is not None
    with caplog.at_level(logging.WARNING, logger="rollout_capture.batch"):
        reported = tracker.report(total, "r.jsonl")
    assert reported.duplicate_id_lines == 3
    assert [(d.lines) for d in reported.duplicate_ids] == [[1, 5, 7], [2, 6]]
    assert "r.jsonl: 2 rollout id(s) appear on more than one line" in caplog.text
    assert "(lines 1, 5, 7)" in caplog.text
    assert "id_lines" not in reported.model_dump()


# ---------------------------------------------------------------------- the output


def test_a_link_planted_at_the_output_is_refused_and_left_alone(prefect_api: str, tmp_path: Path) -> None:
    """The link used to be replaced silently; now the run stops before reading, naming the path."""
    victim = tmp_path / "elsewhere" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    out = tmp_path / "runs" / "out.jsonl"
    out.parent.mkdir()
    out.symlink_to(victim)
    done = cli(str(ROLLOUTS), "--capture-dir", str(CAPTURES), "--output", str(out), api=prefect_api)
    assert done.returncode == 2, done.stderr
    assert f"error: output {out} is a symbolic link (to {victim})" in done.stderr
    assert out.is_symlink() and victim.read_text() == "keep me"
    assert temp_files(out.parent) == []


def test_a_link_planted_after_the_start_is_refused_at_publishing(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out.jsonl"
    spool = OutputSpool(str(out))
    spool.write(b"{}\n", 1)
    spool.close()
    out.symlink_to(victim)
    with pytest.raises(OutputPathError, match="is a symbolic link"):
        publish(spool.path, str(out))
    assert victim.read_text() == "keep me" and out.is_symlink()


def test_a_link_planted_at_the_temp_path_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a guessed temporary name is created exclusively, without following a link there."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out.jsonl"
    names = iter([".out.jsonl.tmp-planted", ".out.jsonl.tmp-ours"])
    (tmp_path / ".out.jsonl.tmp-planted").symlink_to(victim)
    monkeypatch.setattr(rollout_files, "_temp_name", lambda base: next(names))
    spool = OutputSpool(str(out))
    spool.write(b'{"a": 1}\n', 1)
    spool.close()
    publish(spool.path, str(out))
    assert victim.read_text() == "keep me"
    assert out.read_bytes() == b'{"a": 1}\n' and not out.is_symlink()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_on_the_output_names_the_output(
    prefect_api: str, tmp_path: Path, tiny_disk: Path
) -> None:
    """It used to say ``[Errno 28] No space left on device`` and nothing else."""
    source = tmp_path / "big.jsonl"
    source.write_bytes(b"".join(orjson.dumps({"n": n, "pad": "x" * 20_000}) + b"\n" for n in range(120)))
    out = tiny_disk / "big.enriched.jsonl"
    args = ["--capture-dir", str(CAPTURES), "--output", str(out), "--batch-size", "10"]
    done = cli(str(source), *args, api=prefect_api)
    assert done.returncode == 1, done.stderr
    assert "No space left on device" in done.stderr
    assert f"writing the output {out}" in done.stderr
    assert not out.exists() and temp_files(tiny_disk) == []  # the spool went with the failure


# ---------------------------------------------------------------------- leftovers


def test_a_killed_enrich_leaves_a_temp_file_the_next_run_removes(prefect_api: str, tmp_path: Path) -> None:
    """SIGKILL a real ``enrich`` mid-run (waiting on a live claim), then run it again."""
    captures = tmp_path / "captures"
    shutil.copytree(CAPTURES, captures)
    out = tmp_path / "out" / "sample.enriched.jsonl"
    args = ["--capture-dir", str(captures), "--output", str(out)]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": prefect_api}
    with CaptureStore(str(captures)).claim("0-0", ttl_s=600):  # a call still streaming: the run waits
        victim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollout_capture.cli",
                "enrich",
                str(ROLLOUTS),
                *args,
                "--quiescence-timeout",
                "600",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 240
            while not (out.parent.exists() and temp_files(out.parent)):
                assert victim.poll() is None, "enrich ended before writing its temporary file"
                assert time.monotonic() < deadline, "enrich never created its temporary file"
                time.sleep(0.1)
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait()
    left = temp_files(out.parent)
    assert len(left) == 1 and str(victim.pid) in left[0]  # the writer is named in its temp file
    done = cli(str(ROLLOUTS), *args, api=prefect_api)
    assert done.returncode == 0, done.stderr
    assert temp_files(out.parent) == []
    assert len(out.read_bytes().splitlines()) == len(ROLLOUTS.read_bytes().splitlines())


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_leftovers_of_dead_writers_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    host = rollout_files._HOST

    def nonce() -> str:
        return uuid.uuid4().hex[:12]

    dead = tmp_path / f".out.jsonl.tmp-{host}-{_dead_pid()}-{nonce()}"
    alive = tmp_path / f".out.jsonl.tmp-{host}-{os.getpid()}-{nonce()}"
    elsewhere = tmp_path / f".out.jsonl.tmp-otherhost-{_dead_pid()}-{nonce()}"  # locked by its writer
    legacy_old = tmp_path / f".out.jsonl.tmp-{nonce()}"
    legacy_new = tmp_path / f".out.jsonl.tmp-{nonce()}"
    other_output = tmp_path / f".other.jsonl.tmp-{host}-{_dead_pid()}-{nonce()}"
    not_ours = tmp_path / ".out.jsonl.tmp-notes"
    for path in (dead, alive, elsewhere, legacy_old, legacy_new, other_output, not_ours):
        path.write_bytes(b"{}\n")
    hour_ago = time.time() - LEGACY_TEMP_STALE_S - 60
    os.utime(legacy_old, (hour_ago, hour_ago))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / f".out.jsonl.tmp-{host}-{_dead_pid()}-{nonce()}"
    link.symlink_to(victim)
    holder = subprocess.Popen(  # a live writer on another host of a shared disk holds its lock
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX);"
            " print('locked', flush=True); sys.stdin.read()",
            str(elsewhere),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        removed = remove_stale_temp_files(str(out))
        assert sorted(removed) == sorted([str(dead), str(legacy_old)])
        assert all(p.exists() for p in (alive, elsewhere, legacy_new, other_output, not_ours))
        assert link.is_symlink() and victim.read_text() == "keep me"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    assert remove_stale_temp_files(str(out)) == [str(elsewhere)]  # its writer gone, its lock with it


def test_a_live_spool_holds_its_lock(tmp_path: Path) -> None:
    """The lock is what keeps a writer's file safe from a cleaner that cannot see its process."""
    spool = OutputSpool(str(tmp_path / "out.jsonl"))
    fd = os.open(spool.path, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        spool.discard()
    assert temp_files(tmp_path) == []


# ---------------------------------------------------------------------- stores


def test_a_store_without_atomic_create_is_refused_for_writing() -> None:
    """fsspec's look-then-write "create" lets two hosts both win: such stores read, never write."""
    options = {"path": f"/dirfs-{uuid.uuid4().hex}", "target_protocol": "memory"}
    backend = open_backend("dir://caps", options)
    assert not backend.capabilities.writable
    with pytest.raises(
        UnsafeStoreError, match=r"capture store dir://caps cannot be written: dir has no atomic"
    ):
        backend.create(backend.path("x"), b"1")
    store = CaptureStore("dir://caps", storage_options=options)
    with pytest.raises(UnsafeStoreError):
        store.record("12-3", {"model_call_id": "a1", "dialect": "chat"})
    assert store.read("12-3") == []  # and reading it works


def test_the_process_local_memory_store_stays_writable() -> None:
    root = f"memory://caps-{uuid.uuid4().hex}"
    backend = open_backend(root)
    assert backend.capabilities.writable
    store = CaptureStore(root)
    store.record("12-3", {"model_call_id": "a1", "dialect": "chat"})
    store.record("12-3", {"model_call_id": "a2", "dialect": "chat"})
    assert [row["model_call_id"] for row in store.read("12-3")] == ["a1", "a2"]


def test_spools_of_dead_runs_on_the_temp_disk_are_removed(tmp_path: Path) -> None:
    """A killed run's decompressed copy of a ``.gz`` input (tens of MB) no longer stays forever."""
    host = rollout_files._HOST
    dead = tmp_path / f"rollouts-{host}-{_dead_pid()}-abc_123.jsonl"
    alive = tmp_path / f"rollouts-{host}-{os.getpid()}-def456.jsonl"
    elsewhere = tmp_path / f"rollouts-otherhost-{_dead_pid()}-ghi789.jsonl"
    unrelated = tmp_path / "rollouts-notes.jsonl"
    for path in (dead, alive, elsewhere, unrelated):
        path.write_bytes(b"{}\n")
    source = tmp_path / "in" / "r.jsonl.gz"
    source.parent.mkdir()
    source.write_bytes(gzip.compress(b'{"a": 1}\n'))
    staged = stage_rollouts(str(source), spool_dir=str(tmp_path))
    assert not dead.exists() and alive.exists() and elsewhere.exists() and unrelated.exists()
    assert Path(staged.path).name.startswith(f"rollouts-{host}-{os.getpid()}-")
    assert Path(staged.path).read_bytes() == b'{"a": 1}\n'


def test_a_producer_refuses_a_store_without_atomic_create_at_startup(scripted_upstream: Any) -> None:
    """The middleware and the proxy refuse such a store when they open it, not row by row."""
    from rollout_capture.producer.middleware import CaptureMiddleware
    from rollout_capture.producer.proxy import CaptureProxy
    from rollout_capture.producer.settings import ProxySettings

    options = {"path": f"/dirfs-{uuid.uuid4().hex}", "target_protocol": "memory"}

    async def app(scope: Any, receive: Any, send: Any) -> None:  # never reached
        raise AssertionError

    with pytest.raises(UnsafeStoreError, match="dir://caps cannot be written"):
        CaptureMiddleware(app, capture_dir="dir://caps", storage_options=options)
    with pytest.raises(UnsafeStoreError, match="dir://caps cannot be written"):
        CaptureProxy(
            ProxySettings(upstream=scripted_upstream[0], capture_dir="dir://caps", storage_options=options)
        )
    CaptureMiddleware(app, capture_dir=f"memory://caps-{uuid.uuid4().hex}")  # one process: fine
