"""Core merge throughput versus the orjson floor, on local disk, measured in one run.

    python benchmarks/bench_merge.py [--rollouts 10000] [--repeat 2]

The floor reads the same capture files and rollout lines and merely parses them with
orjson; the merge loop parses, merges and serializes each enriched record. Peak RSS is
taken from separate processes at two corpus sizes, to show it does not grow with them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import ValidationError

from benchmarks import corpus
from rollout_capture import CaptureStore, build_model_call_record, merge_model_call_capture_into_record
from rollout_capture.batch import enrich_lines
from rollout_capture.identity import rollout_id_of
from rollout_capture.layout import jsonl_name
from rollout_capture.metrics import aggregate_call_dicts


def floor(rollouts: Path, captures: Path) -> float:
    """Read and parse every capture row and rollout line, nothing more."""
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
    args = parser.parse_args()

    rollouts, captures = corpus.build(args.rollouts, repeat=args.repeat)
    sizes = corpus.manifest(rollouts)
    floor(rollouts, captures)  # warm the page cache for both
    floors, merges, singles, straightforward = [], [], [], []
    for _ in range(args.rounds):  # interleaved, so drift hits all alike
        floors.append(floor(rollouts, captures))
        merges.append(merge_loop(rollouts, captures)[0])
        singles.append(per_record_loop(rollouts, captures))
        straightforward.append(pydantic_loop(rollouts, captures))
    best_floor, best_merge = min(floors), min(merges)
    small = max(1, args.rollouts // 4)
    corpus.build(small, repeat=args.repeat)
    result = {
        "rollouts": args.rollouts,
        "capture_mb": round(sizes["capture_bytes"] / 1e6, 1),
        "rollouts_mb": round(sizes["rollout_bytes"] / 1e6, 1),
        "floor_s": round(best_floor, 3),
        "merge_s": round(best_merge, 3),
        "merge_rollouts_per_s": round(args.rollouts / best_merge),
        "merge_over_floor": round(best_merge / best_floor, 2),
        "per_record_api_over_floor": round(min(singles) / best_floor, 2),
        "pydantic_per_call_over_floor": round(min(straightforward) / best_floor, 2),
        f"peak_rss_mb_{small}": round(peak_rss_mb(small, args.repeat), 1),
        f"peak_rss_mb_{args.rollouts}": round(peak_rss_mb(args.rollouts, args.repeat), 1),
        "this_process_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
