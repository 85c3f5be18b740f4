"""Concurrent writers (spec 2): separate processes lose nothing and interleave nothing."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from rollout_capture import CaptureStore

from .conftest import S3
from .support.spawned import write_rows

WRITERS, ROWS = 4, 50


def run_writers(
    url: str, options: dict[str, Any], layout: str, writers: int = WRITERS, rows: int = ROWS
) -> None:
    """``writers`` processes each writing ``rows`` rows of one rollout at once (every layout's test)."""
    context = multiprocessing.get_context("spawn")  # filesystems are not fork-safe
    go = context.Event()
    processes = [
        context.Process(target=write_rows, args=(url, options, layout, w, rows, go)) for w in range(writers)
    ]
    for process in processes:
        process.start()
    go.set()
    for process in processes:
        process.join()  # however long a loaded machine takes (pytest-timeout bounds a hang)
        assert process.exitcode == 0


def check(store: CaptureStore) -> None:
    rows, damaged = store.read_available("c-0")
    assert damaged == 0  # no torn or interleaved row
    missing = {(w, n) for w in range(WRITERS) for n in range(ROWS)} - {(r["writer"], r["n"]) for _, r in rows}
    objects = len(store.listing("c-0").objects) if store.layout == "objects" else None
    lost = f"lost (writer, n): {sorted(missing)}; objects: {objects}"
    assert not missing and len(rows) == WRITERS * ROWS, lost  # nothing lost
    for writer in range(WRITERS):
        mine = [row for _, row in rows if row["writer"] == writer]
        assert [row["n"] for row in mine] == list(range(ROWS))  # each writer's own order kept
        assert all(set(row["pad"]) == {str(writer)} for row in mine)
    listing = store.listing("c-0")
    if store.layout == "objects":
        assert [seq for seq, _ in listing.objects] == list(range(WRITERS * ROWS))  # seq has no holes


@pytest.mark.parametrize("layout", ["jsonl", "objects"])
def test_writer_processes_on_a_local_disk(tmp_path: Path, layout: str) -> None:
    run_writers(str(tmp_path), {}, layout)
    check(CaptureStore(tmp_path, layout=layout))  # type: ignore[arg-type]


def test_writer_processes_on_s3(s3: S3) -> None:
    run_writers(s3.url("caps"), s3.storage_options, "objects")
    check(CaptureStore(s3.url("caps"), storage_options=s3.storage_options))
