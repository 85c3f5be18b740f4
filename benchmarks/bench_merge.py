"""Core merge throughput versus the orjson floor, on local disk, measured in one run.

    python benchmarks/bench_merge.py [--rollouts 10000] [--repeat 2] [--stages]

The floor reads the same capture files and rollout lines and merely parses them with
orjson (every row's full dict); the bytes floor only reads them and cuts their lines. The
merge loop reads what it needs of each line (typed decoding), merges and serializes each
enriched record. Each is timed
by wall clock and by CPU time (``process_time``, which a busy shared machine disturbs
less), best of interleaved rounds. Peak RSS is taken from separate processes at two
corpus sizes, to show it does not grow with them. ``--stages`` prints instead the CPU
seconds of each stage of the merge, each run alone (where the time goes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import ValidationError

from benchmarks import corpus
from rollout_capture import CaptureStore, build_model_call_record, merge_model_call_capture_into_record
from rollout_capture.attachment import build_attachment
from rollout_capture.batch import enrich_lines, splice_attachment
from rollout_capture.call_records_fast import orjson_reads, typed_decode
from rollout_capture.evidence import Evidence, EvidenceReader
from rollout_capture.identity import rollout_id_of
from rollout_capture.identity_fast import identify_line
from rollout_capture.metrics import aggregate_call_dicts
from rollout_capture.names import jsonl_name
from rollout_capture.summary import AttachmentFold, EvidenceSummary


def floor(rollouts: Path, captures: Path) -> float:
    """Read and parse every capture row and rollout line, nothing more.

    With the cheapest primitives the merge's own local reads use (one ``os.read``, lines
    cut with ``find``), so the ratio counts only what merging adds.
    """
    started = time.perf_counter()
    loads = orjson.loads
    base = os.path.join(captures, "")
    with rollouts.open("rb") as handle:
        for line in handle:
            record = loads(line)
            try:
                fd = os.open(base + jsonl_name(rollout_id_of(record) or ""), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                data = os.read(fd, os.fstat(fd).st_size + 1)
            finally:
                os.close(fd)
            find, end, start = data.find, len(data), 0
            while start < end:
                stop = find(b"\n", start)
                if stop < 0:
                    stop = end
                if stop > start:
                    try:  # noqa: SIM105 - contextlib.suppress would slow the floor down
                        loads(data[start:stop])
                    except orjson.JSONDecodeError:
                        pass
                start = stop + 1
    return time.perf_counter() - started


def bytes_floor(rollouts: Path, captures: Path) -> float:
    """Read every rollout line and capture file and cut their lines, parsing nothing.

    What reading the input costs before any JSON is looked at: the part of the merge that
    no decoder can take away.
    """
    started = time.perf_counter()
    base = os.path.join(captures, "")
    with rollouts.open("rb") as handle:
        for _line in handle:
            pass
    for name in os.listdir(captures):
        fd = os.open(base + name, os.O_RDONLY)
        try:
            data = os.read(fd, os.fstat(fd).st_size + 1)
        finally:
            os.close(fd)
        find, end, start = data.find, len(data), 0
        while start < end:
            stop = find(b"\n", start)
            if stop < 0:
                stop = end
            data[start:stop]
            start = stop + 1
    return time.perf_counter() - started


def legacy_floor(rollouts: Path, captures: Path) -> float:
    """The floor as first measured (buffered ``open().read()``, ``split``), for comparison.

    Slower than the merge's own reads, so ratios against it flatter the merge.
    """
    started = time.perf_counter()
    loads = orjson.loads
    with rollouts.open("rb") as handle:
        for line in handle:
            record = loads(line)
            path = os.path.join(captures, jsonl_name(rollout_id_of(record) or ""))
            try:
                with open(path, "rb") as capture:
                    data = capture.read()
            except FileNotFoundError:
                continue
            for row in data.split(b"\n"):
                if row:
                    try:  # noqa: SIM105 - contextlib.suppress would slow the floor down
                        loads(row)
                    except orjson.JSONDecodeError:
                        pass
    return time.perf_counter() - started


def merge_loop(rollouts: Path, captures: Path, batch_size: int = 1000) -> tuple[float, int]:
    """Enrich every rollout as the flows do: batches of lines in, enriched lines out (discarded)."""
    store = CaptureStore(captures)
    started = time.perf_counter()
    count = 0
    with rollouts.open("rb") as handle:
        while True:
            lines = list(itertools.islice(handle, batch_size))
            if not lines:
                break
            enriched = enrich_lines(lines, [store], first_line=count + 1)
            assert len(enriched.lines) == len(lines)
            count += len(lines)
    return time.perf_counter() - started, count


def per_record_loop(rollouts: Path, captures: Path) -> float:
    """The one-record API (``merge_model_call_capture_into_record``) plus ``orjson.dumps``."""
    store = CaptureStore(captures)
    started = time.perf_counter()
    with rollouts.open("rb") as handle:
        for line in handle:
            record = orjson.loads(line)
            merge_model_call_capture_into_record(record, [store])
            orjson.dumps(record)
    return time.perf_counter() - started


def pydantic_loop(rollouts: Path, captures: Path) -> float:
    """A straightforward merge: per call a validated pydantic record, dumped; for comparison."""
    started = time.perf_counter()
    with rollouts.open("rb") as handle:
        for line in handle:
            record = orjson.loads(line)
            path = os.path.join(captures, jsonl_name(rollout_id_of(record) or ""))
            calls = []
            with open(path, "rb") as capture:
                for index, row in enumerate(capture.read().split(b"\n")):
                    if not row:
                        continue
                    try:
                        parsed = orjson.loads(row)
                        call = build_model_call_record(parsed, call_index=index)
                    except (orjson.JSONDecodeError, ValidationError):
                        continue
                    calls.append(
                        call.model_dump(exclude={"request", "response", "request_raw", "response_raw"})
                    )
            record["ng_model_call_capture"] = {"calls": calls, "metrics": aggregate_call_dicts(calls)}
            orjson.dumps(record)
    return time.perf_counter() - started


def _evidence_of(store: CaptureStore, batch: list[str]) -> Iterator[tuple[str, Evidence]]:
    """Each rollout of a batch with its evidence, read as the merge reads it."""
    read = EvidenceReader(batch, [store])
    return ((rollout_id, read.evidence(rollout_id)) for rollout_id in batch)


def _read_lines(rollouts: Path, batch_size: int) -> None:
    with rollouts.open("rb") as handle:
        while list(itertools.islice(handle, batch_size)):
            pass


def _reads(store: CaptureStore, ids: list[list[str]]) -> None:
    for batch in ids:
        for _ in _evidence_of(store, batch):
            pass


def _rows_alone(
    store: CaptureStore,
    ids: list[list[str]],
    step: Callable[[bytes], object],
    whole: Callable[[bytes], object] | None = None,
) -> None:
    """``step`` over every capture line (or ``whole`` over every capture file), as the merge cuts them."""
    for batch in ids:
        for _, evidence in _evidence_of(store, batch):
            snap = evidence.snapshot
            for data in [part[1] for part in snap.parsed._parts if part[0] == "jsonl"] if snap else ():
                if whole is not None:
                    whole(data)
                    continue
                find, end, start = data.find, len(data), 0
                while start < end:
                    stop = find(b"\n", start)
                    stop = end if stop < 0 else stop
                    try:  # noqa: SIM105 - contextlib.suppress would slow the stage down
                        step(data[start:stop])
                    except msgspec.DecodeError:
                        pass
                    start = stop + 1


def _records(store: CaptureStore, ids: list[list[str]]) -> None:
    for batch in ids:
        for _, evidence in _evidence_of(store, batch):
            if evidence.snapshot is not None:
                evidence.snapshot.record_rows(False)


def _attachments(store: CaptureStore, ids: list[list[str]]) -> None:
    for batch in ids:
        for rollout_id, evidence in _evidence_of(store, batch):
            build_attachment(rollout_id, evidence)


def _splices(batches: list[list[bytes]], built: list[list[dict[str, Any]]], repeat: int) -> None:
    for _ in range(repeat):
        for lines, batch in zip(batches, built, strict=False):
            for line, attachment in zip(lines, batch, strict=False):
                splice_attachment(line, attachment)


def _folds(built: list[list[dict[str, Any]]], repeat: int) -> None:
    """As the merge folds: a built attachment without gaps counted as built."""
    for _ in range(repeat):
        for batch in built:
            fold = AttachmentFold(EvidenceSummary())
            for attachment in batch:
                fold.add_built_attachment(attachment)
            fold.flush()


def _stage_runs(rollouts: Path, captures: Path, batch_size: int) -> dict[str, Callable[[], object]]:
    """Each stage of the merge as a run of its own over the whole corpus, by the name it is printed under."""
    store = CaptureStore(captures)
    with rollouts.open("rb") as handle:
        batches = [lines for lines in iter(lambda: list(itertools.islice(handle, batch_size)), [])]
    ids = [[item[0] for item in map(identify_line, lines) if item] for lines in batches]
    built = [[build_attachment(r, e) for r, e in _evidence_of(store, batch)] for batch in ids[:2]]
    repeat = max(1, len(ids) // max(1, len(built)))
    return {
        "read rollout lines": lambda: _read_lines(rollouts, batch_size),
        "identify rollout lines (typed)": lambda: [identify_line(line) for b in batches for line in b],
        "  of which the UTF-8 check": lambda: [orjson_reads(line) for b in batches for line in b],
        "read captures": lambda: _reads(store, ids),
        "cut + UTF-8 check + decode + build records": lambda: _records(store, ids),
        "  cut + decode rows (msgspec)": lambda: _rows_alone(store, ids, typed_decode),
        "  UTF-8 check of captures": lambda: _rows_alone(store, ids, orjson_reads, whole=orjson_reads),
        "attachments (records, metrics, gaps)": lambda: _attachments(store, ids),
        "dump + splice": lambda: _splices(batches, built, repeat),
        "evidence fold": lambda: _folds(built, repeat),
        "merge": lambda: merge_loop(rollouts, captures, batch_size),
        "floor": lambda: floor(rollouts, captures),
    }


def _stage_shares(best: dict[str, float]) -> dict[str, float]:
    """The stages' own seconds: each less the stages it contains (reading captures, decoding)."""
    best["read captures (alone)"] = best["read captures"]
    for name in ("cut + UTF-8 check + decode + build records", "attachments (records, metrics, gaps)"):
        best[name] -= best["read captures"]
    best["  build records (the rest)"] = (
        best["cut + UTF-8 check + decode + build records"]
        - best["  cut + decode rows (msgspec)"]
        - best["  UTF-8 check of captures"]
        + 2 * best["read captures"]
    )
    best["  cut + decode rows (msgspec)"] -= best["read captures"]
    best["  UTF-8 check of captures"] -= best["read captures"]
    best["attachments (metrics, gaps): the rest"] = (
        best["attachments (records, metrics, gaps)"] - best["cut + UTF-8 check + decode + build records"]
    )
    parts = (
        "read rollout lines",
        "identify rollout lines (typed)",
        "read captures",
        "attachments (records, metrics, gaps)",
        "dump + splice",
        "evidence fold",
    )
    best["batch overhead (merge less the stages)"] = best["merge"] - sum(best[name] for name in parts)
    return best


def stages(rollouts: Path, captures: Path, batch_size: int = 1000) -> dict[str, float]:
    """CPU seconds of each stage of the merge, each run alone over the whole corpus.

    Where the merge's time goes: the stages are what :func:`merge_loop` does, taken apart
    (``batch overhead`` is the merge less their sum). Each stage's output is dropped per
    batch, as the merge drops it.
    """
    timed = _stage_runs(rollouts, captures, batch_size)
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(3):
        for name, run in timed.items():
            started = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - started)
    return {name: round(value, 3) for name, value in _stage_shares(best).items()}


def peak_rss_mb(rollouts: int, repeat: int) -> float:
    """Peak RSS of a fresh process merging a corpus of this size."""
    return corpus.peak_rss_mb_of(
        "from benchmarks import corpus, bench_merge\n"
        f"p, c = corpus.build({rollouts}, repeat={repeat})\n"
        "bench_merge.merge_loop(p, c)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=2, help="turn multiplier: calls per rollout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", action="store_true", help="only the CPU seconds of each merge stage")
    args = parser.parse_args()

    rollouts, captures = corpus.build(args.rollouts, repeat=args.repeat)
    if args.stages:
        floor(rollouts, captures)  # warm the page cache
        print(json.dumps({"rollouts": args.rollouts, "cpu_s": stages(rollouts, captures)}, indent=2))
        return
    sizes = corpus.manifest(rollouts)
    runs: dict[str, Callable[[Path, Path], object]] = {
        "floor": floor,
        "bytes_floor": bytes_floor,
        "legacy_floor": legacy_floor,
        "merge": merge_loop,
        "per_record": per_record_loop,
        "pydantic": pydantic_loop,
    }
    floor(rollouts, captures)  # warm the page cache for both
    wall: dict[str, float] = dict.fromkeys(runs, float("inf"))
    cpu: dict[str, float] = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):  # interleaved, so drift hits all alike
        for name, run in runs.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            run(rollouts, captures)
            wall[name] = min(wall[name], time.perf_counter() - started)
            cpu[name] = min(cpu[name], time.process_time() - started_cpu)
    small = max(1, args.rollouts // 4)
    corpus.build(small, repeat=args.repeat)
    result = {
        "rollouts": args.rollouts,
        "capture_mb": round(sizes["capture_bytes"] / 1e6, 1),
        "rollouts_mb": round(sizes["rollout_bytes"] / 1e6, 1),
        "floor_s": round(wall["floor"], 3),
        "merge_s": round(wall["merge"], 3),
        "merge_rollouts_per_s": round(args.rollouts / wall["merge"]),
        "merge_over_floor": round(wall["merge"] / wall["floor"], 2),
        "merge_over_floor_cpu": round(cpu["merge"] / cpu["floor"], 2),
        "bytes_floor_s": round(wall["bytes_floor"], 3),
        "merge_over_bytes_floor": round(wall["merge"] / wall["bytes_floor"], 2),
        "floor_over_bytes_floor": round(wall["floor"] / wall["bytes_floor"], 2),
        "merge_over_legacy_floor": round(wall["merge"] / wall["legacy_floor"], 2),
        "per_record_api_over_floor": round(wall["per_record"] / wall["floor"], 2),
        "pydantic_per_call_over_floor": round(wall["pydantic"] / wall["floor"], 2),
        f"peak_rss_mb_{small}": round(peak_rss_mb(small, args.repeat), 1),
        f"peak_rss_mb_{args.rollouts}": round(peak_rss_mb(args.rollouts, args.repeat), 1),
        "this_process_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
