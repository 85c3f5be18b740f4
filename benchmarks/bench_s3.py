"""Object-store reads against a real S3 endpoint (moto's server), counted on the wire.

    python benchmarks/bench_s3.py [--rollouts 2000] [--rows 8] [--batch 250] [--latency-ms 10]

Compares, on the same capture prefix and the same job (every rollout, in batches):
- the ordinary s3fs way: ``find`` the prefix, then ``cat`` every object (s3fs's own
  concurrent multi-path read) and parse the rows;
- the project's read path as a flow runs it: batches of one job sharing one listing
  (``ListingScope``), concurrent GETs with sizes already known, full enrichment;
- the same read path with every batch on its own (no shared listing), for reference.
Request counts by kind come from a proxy on the socket.

moto answers in about a millisecond but serves only a few hundred requests a second
(it is one Python process); a real store is the other way round. The proxy therefore
adds a fixed latency to each request (default 10 ms, the low end of S3 in-region), and
moto runs in its own process so it does not share an interpreter with the client.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsspec
import orjson

from benchmarks.corpus import source_corpus
from benchmarks.store_bench import free_port, wait_for_port
from examples.samples import capture_rows, corpus_records
from rollout_capture import CaptureStore
from rollout_capture.backends import ListingScope
from rollout_capture.batch import enrich_lines
from tests.support.fault_proxy import FaultProxy

BUCKET = "bench-captures"


def s3(endpoint: str, **options: object) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem(
        "s3",
        client_kwargs={"endpoint_url": endpoint},
        skip_instance_cache=True,
        use_listings_cache=False,
        **options,
    )


def build(endpoint: str, rollouts: int, rows: int) -> list[bytes]:
    """``rollouts`` x ``rows`` objects of real capture rows; returns the rollout lines."""
    fs = s3(endpoint)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    records = corpus_records(source_corpus())
    objects: dict[str, bytes] = {}
    lines = []
    for index in range(rollouts):
        record = {**records[index % len(records)], "_ng_task_index": index, "_ng_rollout_index": 0}
        produced = capture_rows(record, f"{index}-0", dialect="chat", seed=index, repeat=rows)[:rows]
        for seq, row in enumerate(produced):
            objects[f"{BUCKET}/caps/{index}-0.capture/{seq:012d}.json"] = orjson.dumps(row)
        lines.append(orjson.dumps(record))
    for start in range(0, len(objects), 2000):
        fs.pipe(dict(list(objects.items())[start : start + 2000]))
    return lines


def find_and_cat(endpoint: str) -> int:
    """The ordinary s3fs way: one ``find`` of the prefix, one concurrent ``cat``; returns rows parsed."""
    fs = s3(endpoint)
    paths = fs.find(f"{BUCKET}/caps")
    bodies = fs.cat(paths)
    for body in bodies.values():
        orjson.loads(body)
    return len(bodies)


def read_path(endpoint: str, lines: list[bytes], batch: int, *, shared: bool) -> int:
    """The project's read path over every batch of the job; returns calls attached."""
    store = CaptureStore(f"s3://{BUCKET}/caps", storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    scope = ListingScope(key="bench-job", rollouts=len(lines)) if shared else None
    return sum(
        enrich_lines(lines[start : start + batch], [store], scope=scope).stats.calls
        for start in range(0, len(lines), batch)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--batch", type=int, default=250, help="rollout lines per batch")
    parser.add_argument("--latency-ms", type=float, default=10.0)
    args = parser.parse_args()

    host, port = "127.0.0.1", free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(host, port)
    proxy = FaultProxy(host, port, latency_s=args.latency_ms / 1000)
    try:
        lines = build(f"http://{host}:{port}", args.rollouts, args.rows)
        keys = args.rollouts * args.rows
        timings: dict[str, float] = {}
        requests: dict[str, dict[str, int]] = {}
        counted: dict[str, int] = {}
        runs: dict[str, Callable[[], int]] = {
            "s3fs_find_cat": lambda: find_and_cat(proxy.endpoint),
            "read_path_shared_listing": lambda: read_path(proxy.endpoint, lines, args.batch, shared=True),
            "read_path_listing_per_batch": lambda: read_path(proxy.endpoint, lines, args.batch, shared=False),
        }
        for name, run in runs.items():
            proxy.reset_counts()
            started = time.perf_counter()
            counted[name] = run()
            timings[name] = time.perf_counter() - started
            requests[name] = proxy.reset_counts()
    finally:
        proxy.close()
        server.terminate()
        server.wait(30)
    assert set(counted.values()) == {keys}, (counted, keys)
    shared = requests["read_path_shared_listing"]
    print(
        json.dumps(
            {
                "rollouts": args.rollouts,
                "objects": keys,
                "batches": -(-args.rollouts // args.batch),
                "added_latency_ms": args.latency_ms,
                "seconds": {name: round(value, 2) for name, value in timings.items()},
                "s3fs_find_cat_over_read_path": round(
                    timings["s3fs_find_cat"] / timings["read_path_shared_listing"], 2
                ),
                "requests": requests,
                "read_path_lists_per_1000_keys": round(1000 * shared.get("LIST", 0) / keys, 2),
                "read_path_gets_per_object": round(shared.get("GET", 0) / keys, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
