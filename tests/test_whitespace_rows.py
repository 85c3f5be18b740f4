"""Whitespace rows (contract section 4, issue 46): read with bounded memory, no larger than they
need to be, torn ones damage and never a call, and only a verify call's row counted, so that ours
and NeMo Gym's reader count the same calls (tests/support/hostile_rows.py's ``nemo_gym_reads`` is
its reader step for step; ``make test-nemo-gym`` runs the real one on the same cases)."""

from __future__ import annotations

import multiprocessing
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore, merge_model_call_capture_into_record
from rollout_capture.whitespace_rows import read_whitespace_row, whitespace_line

from .support.hostile_rows import VERSIONS, inflating_row, nemo_gym_reads, whitespace_row
from .support.runs_helpers import make_run
from .support.scripted_upstream import CHAT
from .support.spawned import run_tick_measured

VERIFY = {"kind": "verifier_invocation", "verifier_invocation_id": "v1", "reward": 1.0, "response": CHAT}


def call(name: str) -> bytes:
    return orjson.dumps({"model_call_id": name, "dialect": "chat", "response": CHAT}) + b"\n"


def attachment(root: Path, rollout: str = "0-0") -> dict[str, Any]:
    task, index = rollout.split("-")
    record = {"_ng_task_index": int(task), "_ng_rollout_index": int(index)}
    return merge_model_call_capture_into_record(record, [root])["ng_model_call_capture"]  # type: ignore[no-any-return]


def calls_of(capture: dict[str, Any]) -> list[tuple[str, int]]:
    return [(c["model_call_id"], c["call_index"]) for c in capture["calls"]]


def theirs(path: Path) -> tuple[list[tuple[str, int]], int]:
    exchanges, invalid = nemo_gym_reads(path)
    return [(row["model_call_id"], index) for index, row in exchanges], invalid


def test_a_row_takes_two_bits_a_character_and_rows_of_the_first_version_still_read(tmp_path: Path) -> None:
    """A 40 MB verify answer made a 182 MB line at a bit a character; two bits a character (space,
    tab, VT, FF: all that NeMo Gym skips but CR, which a CRLF line ends with) halve it. Rows
    already written (``rcw1``) read as before."""
    row = {**VERIFY, "response": {"reward": 1.0, "text": orjson.dumps(list(range(20_000))).decode()}}
    line = whitespace_line(row)
    compressed = len(zlib.compress(orjson.dumps(row)))
    assert len(line) == 1 + 4 * (4 + compressed) + 1  # FF, four symbols a byte of magic and data, LF
    assert line.strip() == b"" and b"\r" not in line and line.count(b"\n") == 1  # blank to NeMo Gym
    assert read_whitespace_row(line[:-1]) == row
    old = whitespace_row(row, "rcw1")
    assert len(line) < len(old) / 1.9
    store = CaptureStore(tmp_path)
    store.record("0-0", orjson.loads(call("p0")))
    store.record("0-0", row)  # a verify call's row, on the JSONL layout: a whitespace row
    with (tmp_path / "0-0.capture.jsonl").open("ab") as handle:
        handle.write(old.replace(b"\n", b"\r\n"))  # the first version, as a CRLF line even
    assert (tmp_path / "0-0.capture.jsonl").read_bytes().split(b"\n")[1] == line[:-1]
    capture = attachment(tmp_path)
    assert calls_of(capture) == [("p0", 0)] and "gaps" not in capture
    assert len(capture["verifier_invocations"]) == 1  # the same id twice: the last wins
    assert theirs(tmp_path / "0-0.capture.jsonl") == ([("p0", 0)], 0)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_row_inflating_past_the_cap_is_damage_named_and_read_in_bounded_memory(
    tmp_path: Path, version: str
) -> None:
    """A line of 1-2 MB inflating to 300 MiB (past the 256 MiB cap): a damaged row named in the
    gap, the calls around it read, and what reading held stays far below what it inflates to."""
    bomb = inflating_row(300, version)
    (tmp_path / "0-0.capture.jsonl").write_bytes(call("p0") + bomb + call("p1"))
    tracemalloc.start()
    try:
        capture = attachment(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(peak, len(bomb))
    assert peak < 8 * len(bomb)  # the file and a few copies of the line: never what it inflates to
    assert calls_of(capture) == [("p0", 0), ("p1", 1)] and "verifier_invocations" not in capture
    detail = "count=1; 0-0.capture.jsonl:2: a whitespace row inflating past 256 MiB"
    assert capture["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": detail}]
    assert theirs(tmp_path / "0-0.capture.jsonl") == ([("p0", 0), ("p1", 1)], 0)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_torn_row_glued_to_the_next_is_damage_and_both_readers_count_the_same_calls(
    tmp_path: Path, version: str
) -> None:
    """A verifier's writer killed mid-row, then NeMo Gym's model server appending a call (it starts
    no fresh line): NeMo Gym's reader strips the torn row's whitespace off and reads the call, and
    so does ours; the verify call's row is lost, and ours says so (a first version's spaces and
    tabs read as JSON whitespace, and no damage was seen)."""
    row = whitespace_row(VERIFY, version)
    torn = row[: len(row) // 3]
    (tmp_path / "0-0.capture.jsonl").write_bytes(call("p0") + torn + call("p1") + call("p2"))
    capture = attachment(tmp_path)
    assert calls_of(capture) == [("p0", 0), ("p1", 1), ("p2", 2)] and "verifier_invocations" not in capture
    assert theirs(tmp_path / "0-0.capture.jsonl") == (calls_of(capture), 0)
    detail = "count=1; 0-0.capture.jsonl:2: a whitespace row cut short, a row glued to it"
    assert capture["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": detail}]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_model_call_hidden_in_a_whitespace_row_is_damage_not_a_call(tmp_path: Path, version: str) -> None:
    """NeMo Gym skips every whitespace line, so a model call (or any row but a verify call's) hidden
    in one would be a call to us alone: it is a damaged row, named, and the counts agree."""
    hidden = {"model_call_id": "hidden", "dialect": "chat", "response": CHAT}
    lines = [
        call("p0"),
        whitespace_row(hidden, version),
        whitespace_row({**hidden, "kind": "model_call"}, version),
    ]
    (tmp_path / "0-0.capture.jsonl").write_bytes(b"".join([*lines, call("p1")]))
    capture = attachment(tmp_path)
    assert calls_of(capture) == [("p0", 0), ("p1", 1)] == theirs(tmp_path / "0-0.capture.jsonl")[0]
    assert capture["metrics"]["num_calls"] == 2
    detail = (
        "count=2; 0-0.capture.jsonl:2: a whitespace row holding no verifier_invocation (kind None): "
        "NeMo Gym reads none (and 1 more)"
    )
    assert capture["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": detail}]
    with pytest.raises(ValueError, match="holds a verifier_invocation row only"):
        whitespace_line(hidden)  # and our writer writes none


LIMIT_KIB = 1 << 20  # the memory a tick may have (a container's limit): 1 GiB


def _rss_kib(pid: int) -> int:
    """A live process's resident set, KiB (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)


def _watch(processes: list[Any], limit_kib: int) -> set[int]:
    """Wait for every process to exit, killing any whose RSS passes ``limit_kib`` (an OOM killer's
    part); the indexes of those killed."""
    killed: set[int] = set()
    while any(process.is_alive() for process in processes):
        for index, process in enumerate(processes):
            if process.is_alive() and _rss_kib(process.pid) > limit_kib:
                process.kill()
                killed.add(index)
        processes[0].join(0.01)  # a poll of the watchdog, not a window anything waits out
    return killed


def test_a_tick_beside_an_inflating_row_enriches_every_run_in_the_memory_of_one_without(
    prefect_api: str, tmp_path: Path
) -> None:
    """Issue 46: a line of 4 MB inflating to 512 MiB in one rollout of one run, under enrich-runs in
    a process of its own with a 1 GiB limit (the adversary's ticks died at 3 GB, three in a row, the
    run never enriched): every run is enriched, the bomb's rollout with its gap naming the row, and
    the tick peaks within twice the same tick's peak without the bomb, run beside it."""
    roots = {kind: tmp_path / kind for kind in ("plain", "bomb")}
    for root in roots.values():
        for name in ("r1", "r2", "r3"):
            make_run(root, name, finished=True)
    with (roots["bomb"] / "r2" / "captures" / "1-0.capture.jsonl").open("ab") as capture:
        capture.write(inflating_row(512, "rcw1"))  # a first version's row, as captures already hold
    spawn = multiprocessing.get_context("spawn")
    reports = {kind: tmp_path / f"{kind}.json" for kind in roots}
    ticks = [
        spawn.Process(target=run_tick_measured, args=(prefect_api, str(roots[kind]), str(reports[kind])))
        for kind in roots
    ]
    for tick in ticks:
        tick.start()
    killed = _watch(ticks, LIMIT_KIB)
    assert not killed and [tick.exitcode for tick in ticks] == [0, 0]
    plain, bomb = (orjson.loads(reports[kind].read_bytes()) for kind in roots)
    assert plain["summary"]["enriched"] == bomb["summary"]["enriched"] == ["r1", "r2", "r3"]
    assert bomb["peak_kib"] <= 2 * plain["peak_kib"], (bomb["peak_kib"], plain["peak_kib"])
    enriched = [
        orjson.loads(line)
        for line in (roots["bomb"] / "r2" / "rollouts.enriched.jsonl").read_bytes().splitlines()
    ]
    captures = {c["rollout_id"]: c for c in (record["ng_model_call_capture"] for record in enriched)}
    assert [len(c["calls"]) for c in captures.values()] == [1, 1, 1]
    detail = "count=1; 1-0.capture.jsonl:2: a whitespace row inflating past 256 MiB"
    assert captures["1-0"]["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": detail}]
    assert "gaps" not in captures["0-0"] and "gaps" not in captures["2-0"]
