"""A run's rollouts as numbered parts: each number taken once, read in order as one file, a number
missing below a later one refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollout_capture.rollout_parts import PartsWriter, part_name, stage_parts


def test_parts_stage_as_one_file_in_number_order(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    writers = [PartsWriter(str(run)), PartsWriter(str(run))]  # two harness processes
    numbers = [writers[n % 2].append([f"{n}".encode()]) for n in range(5)]
    assert numbers == [0, 1, 2, 3, 4]  # a taken number is never taken again
    (run / part_name(5)).write_bytes(b"5\n6")  # a last line without its newline ends at its part's end
    (run / part_name(6)).write_bytes(b"7\n")
    staged = stage_parts(str(run))
    try:
        assert Path(staged.path).read_bytes() == b"0\n1\n2\n3\n4\n5\n6\n7\n" and staged.temporary
    finally:
        os.unlink(staged.path)
    (run / part_name(8)).write_bytes(b"9\n")
    with pytest.raises(ValueError, match=rf"{run}/rollouts.parts/000000000007.jsonl is missing below"):
        stage_parts(str(run))
