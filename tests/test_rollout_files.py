"""Rollouts files in and out: batches cut exactly, staging, default names, atomic publish."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_capture import rollout_files
from rollout_capture.rollout_files import default_output, iter_line_batches, split_lines, stage_rollouts


@given(
    st.lists(st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"")), max_size=40),
    st.booleans(),
    st.integers(1, 7),
    st.integers(1, 64),
)
@settings(max_examples=200, deadline=None)
def test_batches_reassemble_the_file_exactly(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes], last_newline: bool, batch: int, chunk: int
) -> None:
    data = b"\n".join(lines) + (b"\n" if lines and last_newline else b"")
    path = tmp_path_factory.mktemp("b") / "r.jsonl"
    path.write_bytes(data)
    original, rollout_files.CHUNK_BYTES = rollout_files.CHUNK_BYTES, chunk  # tiny chunks: batches span many
    try:
        batches = list(iter_line_batches(str(path), batch))
        ranges = list(rollout_files.iter_line_ranges(str(path), batch))
    finally:
        rollout_files.CHUNK_BYTES = original
    assert b"".join(blob for _, blob in batches) == data
    assert [first for first, _ in batches] == list(range(1, 1 + batch * len(batches), batch))
    assert all(len(split_lines(blob)) == batch for _, blob in batches[:-1])
    assert sum(len(split_lines(blob)) for _, blob in batches) == len(split_lines(data))
    assert [r.lines for r in ranges] == [len(split_lines(blob)) for _, blob in batches]  # counted as cut


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("/runs/a/rollouts.jsonl", "/runs/a/rollouts.enriched.jsonl"),
        ("s3://b/x/rollouts.jsonl.gz", "s3://b/x/rollouts.enriched.jsonl"),
        ("data.json", "data.enriched.jsonl"),
        ("plain", "plain.enriched.jsonl"),
    ],
)
def test_default_output_sits_beside_the_input(source: str, expected: str) -> None:
    assert default_output(source) == expected


def test_gzip_input_is_staged_uncompressed_and_counted(tmp_path: Path) -> None:
    source = tmp_path / "r.jsonl.gz"
    source.write_bytes(gzip.compress(b'{"a": 1}\n{"a": 2}\n{"a": 3}'))
    staged = stage_rollouts(str(source))
    assert staged.temporary and staged.size == len(b'{"a": 1}\n{"a": 2}\n{"a": 3}')
    assert Path(staged.path).read_bytes() == b'{"a": 1}\n{"a": 2}\n{"a": 3}'
    rollout_files.remove_staged(staged)
    assert not Path(staged.path).exists() and source.exists()


def test_missing_input_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="rollouts file not found"):
        stage_rollouts(str(tmp_path / "gone.jsonl"))


def test_output_may_replace_the_input_atomically(tmp_path: Path) -> None:
    target = tmp_path / "r.jsonl"
    target.write_bytes(b"old\n")
    spool = rollout_files.OutputSpool(str(target))
    spool.write(b"new 1\nnew 2\n", 2)
    assert target.read_bytes() == b"old\n"  # untouched until published
    spool.close()
    rollout_files.publish(spool.path, str(target))
    assert target.read_bytes() == b"new 1\nnew 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.jsonl"]
