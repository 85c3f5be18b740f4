"""The live output: whole lines only (a cut one removed before anything is appended), one writer
at a time (a local file's lock; an object store's put-if-absent parts), and it says where a
restarted follower goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_capture.backends import open_backend
from rollout_capture.live_output import LiveFile, LiveOutputBusy, LiveOutputTaken, LiveParts, part_path
from rollout_capture.rollout_files import OutputPathError


def test_a_live_file_is_cut_back_to_its_last_whole_line_and_written_by_one_follower(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.enriched.live.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": 3')  # a follower killed mid-write
    first = LiveFile(str(path))
    assert list(first.open()) == [b'{"a": 1}', b'{"b": 2}']
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'  # cut before anything is appended
    with pytest.raises(LiveOutputBusy, match="written by another follower"):
        LiveFile(str(path)).open()
    first.append(3, [b'{"c": 3}', b""])
    first.close()
    second = LiveFile(str(path))
    assert list(second.open()) == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', b""]
    second.close()


def test_a_live_file_that_is_a_link_is_never_written_through(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"")
    (tmp_path / "live.jsonl").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OutputPathError, match="symbolic link: never written through"):
        LiveFile(str(tmp_path / "live.jsonl")).open()


def test_live_parts_say_where_they_stand_and_a_part_of_another_follower_stops_this_one(
    tmp_path: Path,
) -> None:
    run = tmp_path / "r"
    run.mkdir()
    live = LiveParts(open_backend(str(run)), str(run))
    assert list(live.open()) == []
    live.append(1, [b"1", b"2"])
    live.append(3, [b"3"])
    live.append(3, [b"3"])  # its own write again (a retried request): recognised
    assert list(LiveParts(open_backend(str(run)), str(run)).open()) == [b"1", b"2", b"3"]
    with pytest.raises(LiveOutputTaken, match="written by another follower"):
        live.append(3, [b"3, enriched otherwise"])
    (run / part_path(9)).write_bytes(b"9\n")  # a part whose lines before it are missing
    with pytest.raises(ValueError, match="the part of line 4 is missing"):
        list(LiveParts(open_backend(str(run)), str(run)).open())
