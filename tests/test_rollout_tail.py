"""A run's rollouts read as they land: whole lines only, each byte read once, the file never
replaced or shrunk under the follower, never through a link; parts in order as they land."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout_capture.backends import open_backend
from rollout_capture.rollout_files import RolloutsFileError
from rollout_capture.rollout_parts import PartsWriter
from rollout_capture.rollout_tail import FileTail, Listing, PartsTail, RolloutsTail, RunRollouts


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of every ``pread`` from now on."""
    sizes: list[int] = []
    real: Callable[[int, int, int], bytes] = os.pread

    def pread(fd: int, size: int, offset: int) -> bytes:
        data = real(fd, size, offset)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", pread)
    return sizes


def test_a_growing_file_hands_on_whole_lines_reading_each_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rollouts.jsonl"
    tail = FileTail(str(path))
    assert tail.read({}) == ([], False)  # not there yet: nothing, no error
    path.write_bytes(b'{"a": 1}\n{"b":')
    reads = _reads(monkeypatch)
    assert tail.read({}) == ([b'{"a": 1}'], False)  # the line still being written waits
    assert tail.read({}) == ([], False)  # nothing new: an fstat, no read
    with open(path, "ab") as handle:
        handle.write(b' 2}\n\n{"c": 3}')
    assert tail.read({}) == ([b'{"b": 2}', b""], False)  # a blank line is a line, as enrichment keeps it
    assert tail.rest() == [b'{"c": 3}']  # once the run is finished: the last line without its newline
    assert sum(reads) == path.stat().st_size and len(reads) == 2
    tail.close()


@pytest.mark.parametrize("change", ["replaced", "shrunk", "removed"])
def test_a_file_replaced_shrunk_or_removed_while_followed_is_refused_naming_it(
    tmp_path: Path, change: str
) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"1\n2\n")
    tail = FileTail(str(path))
    assert tail.read({})[0] == [b"1", b"2"]
    if change == "replaced":
        (tmp_path / "new").write_bytes(b"1\n2\n3\n")
        os.replace(tmp_path / "new", path)
    elif change == "shrunk":
        os.truncate(path, 2)
    else:
        path.unlink()
    with pytest.raises(RolloutsFileError, match=f"rollouts file {path} .*only grows"):
        tail.read({})
    tail.close()


def test_a_rollouts_file_that_is_a_link_is_never_followed(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.jsonl").write_bytes(b"secret\n")
    (tmp_path / "rollouts.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(RolloutsFileError, match="is a symbolic link: only a regular file is followed"):
        FileTail(str(tmp_path / "rollouts.jsonl")).read({})


def everything(tail: RolloutsTail, listed: Listing) -> list[bytes]:
    """What a follower's read takes: reads while the tail says more is there."""
    lines, more = tail.read(listed)
    while more:
        extra, more = tail.read(listed)
        lines += extra
    return lines


def test_parts_are_read_in_order_as_they_land_and_a_restart_skips_into_a_part(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    backend = open_backend(str(run))
    writer = PartsWriter(str(run))
    tail = RunRollouts(backend, str(run))
    assert tail.read(backend.list_names([backend.root])[0]) == ([], False)  # no parts yet: nothing read
    assert [writer.append([b"1", b"2"]), writer.append([b"3"])] == [0, 1]
    listed = backend.list_names([backend.root])[0]
    assert everything(tail, listed) == [b"1", b"2", b"3"]
    (run / "rollouts.parts" / "000000000003.jsonl").write_bytes(b"5\n")  # above a missing number
    assert tail.read(listed) == ([], False)  # parts are read up to the first missing number
    assert writer.append([b"4"]) == 2
    assert everything(tail, listed) == [b"4", b"5"]

    again = PartsTail(backend)
    assert again.skip(2, listed, finished=False) == (2, b"2")  # a restart whose live output holds 2 lines
    assert everything(again, listed) == [b"3", b"4", b"5"]


def test_a_file_on_an_object_store_is_read_by_range_as_its_listing_grows() -> None:
    from rollout_capture.filesystem import open_filesystem

    fs, _ = open_filesystem("memory://follow-tail/r")
    fs.pipe_file("/follow-tail/r/rollouts.jsonl", b"1\n2")
    backend = open_backend("memory://follow-tail/r")
    tail = RunRollouts(backend, "memory://follow-tail/r")
    assert tail.read(backend.list_names([backend.root])[0])[0] == [b"1"]
    fs.pipe_file("/follow-tail/r/rollouts.jsonl", b"1\n2\n3\n")  # a longer version of the same file
    assert tail.read(backend.list_names([backend.root])[0])[0] == [b"2", b"3"]
    assert tail.requests == 2  # a ranged read each time it grew
    fs.rm("/follow-tail", recursive=True)
