"""``rollout_capture.worker_pool``: what a worker of the processes runner does with a batch, run
here in the test's process (the pool itself is exercised by ``tests/test_runners.py``)."""

from __future__ import annotations

import os
import pickle
import re
import socket
from pathlib import Path

import orjson
import pytest

from examples.samples import capture_rows, corpus_records, jsonl_bytes
from rollout_capture import ATTACHMENT_KEY
from rollout_capture.names import jsonl_name
from rollout_capture.rollout_files import iter_line_ranges
from rollout_capture.worker_pool import (
    ClaimsPending,
    enrich_in_worker,
    require_capture_root,
    sees_capture_root,
    where_this_runs,
)

WHERE = f"on worker {socket.gethostname()} (pid {os.getpid()})"


@pytest.fixture
def run_dir(tmp_path: Path, corpus_dir: Path) -> Path:
    """Ten real rollouts, the first six with their captures in ``caps``."""
    captures = tmp_path / "caps"
    captures.mkdir()
    lines = []
    for index, record in enumerate(corpus_records(corpus_dir)[:10]):
        record = {**record, "_ng_task_index": index, "_ng_rollout_index": 0}
        if index < 6:
            rows = capture_rows(record, f"{index}-0", dialect="chat")
            (captures / jsonl_name(f"{index}-0")).write_bytes(jsonl_bytes(rows))
        lines.append(orjson.dumps(record))
    (tmp_path / "rollouts.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return tmp_path


def test_a_worker_enriches_its_slice_into_a_part_file_of_its_own(run_dir: Path) -> None:
    batches = list(iter_line_ranges(str(run_dir / "rollouts.jsonl"), 4))
    parts = []
    for batch in batches:
        part, lines, stats = enrich_in_worker(
            batch, str(run_dir), str(run_dir / "caps"), None, None, False, False
        )
        assert lines == batch.lines == stats.lines
        parts.append(Path(part))
    assert [p.parent for p in parts] == [run_dir] * 3 and len(set(parts)) == 3
    records = [orjson.loads(line) for part in parts for line in part.read_bytes().splitlines()]
    assert [r["_ng_task_index"] for r in records] == list(range(10))  # in order, every line once
    assert all(ATTACHMENT_KEY in r for r in records)


def test_a_worker_process_names_itself_and_the_file_it_cannot_reach(run_dir: Path) -> None:
    """The process pool's worker, given a parts dir or an input slice it cannot see."""
    batch = next(iter_line_ranges(str(run_dir / "rollouts.jsonl"), 7))
    caps = str(run_dir / "caps")
    with pytest.raises(FileNotFoundError, match=re.escape(f"parts dir not readable {WHERE}")):
        enrich_in_worker(batch, str(run_dir / "gone"), caps, None, None, False, False)
    moved = batch.model_copy(update={"path": str(run_dir / "moved.jsonl")})
    with pytest.raises(FileNotFoundError, match=re.escape(f"input slice not readable {WHERE}")) as failed:
        enrich_in_worker(moved, str(run_dir), caps, None, None, False, False)
    assert failed.value.filename == str(run_dir / "moved.jsonl")


def test_a_capture_root_the_worker_cannot_see_fails_the_batch_naming_it(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "0-0.capture.jsonl").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    require_capture_root(str(tmp_path / "full"))
    assert sees_capture_root(str(tmp_path / "full"))
    for name, wrong in (("empty", "is empty"), ("missing", "does not exist")):
        with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / name} {wrong} {WHERE}")):
            require_capture_root(str(tmp_path / name))
        assert not sees_capture_root(str(tmp_path / name))
    require_capture_root("s3://bucket/caps")  # a URL means the same on every worker
    assert not sees_capture_root("s3://bucket/caps")


def test_what_a_worker_sends_back_survives_the_pipe() -> None:
    pending = pickle.loads(pickle.dumps(ClaimsPending(["1-0", "2-0"])))
    assert isinstance(pending, ClaimsPending) and pending.rollout_ids == ["1-0", "2-0"]
    assert where_this_runs() == f"{socket.gethostname()} (pid {os.getpid()})"
