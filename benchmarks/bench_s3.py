"""Object-store reads against a real S3 endpoint (moto's server), counted on the wire.

    python benchmarks/bench_s3.py [--rollouts 2000] [--rows 8] [--latency-ms 10]

Compares, on the same capture prefix: a sequential reader (per rollout one listing, then
one object at a time with s3fs defaults, as a straightforward port of the local reader
would do) against the project's batch read path (one flat listing, then concurrent GETs
with sizes already known). Request counts by kind come from a proxy on the socket.

moto answers in about a millisecond but serves only a few hundred requests a second
(it is one Python process); a real store is the other way round. The proxy therefore
adds a fixed latency to each request (default 10 ms, the low end of S3 in-region), and
moto runs in its own process so it does not share an interpreter with the client.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsspec
import orjson

from benchmarks.corpus import source_corpus
from examples.samples import capture_rows, corpus_records
from rollout_capture import CaptureStore
from rollout_capture.batch import enrich_lines
from tests.fault_proxy import FaultProxy

BUCKET = "bench-captures"


def s3(endpoint: str, **options: object) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem(
        "s3",
        client_kwargs={"endpoint_url": endpoint},
        skip_instance_cache=True,
        use_listings_cache=False,
        **options,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"moto server did not start on {host}:{port}")


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


def sequential(endpoint: str, rollouts: int) -> int:
    """One rollout at a time, one object at a time, s3fs defaults; returns rows parsed."""
    fs = s3(endpoint)
    parsed = 0
    for index in range(rollouts):
        for path in sorted(fs.ls(f"{BUCKET}/caps/{index}-0.capture", detail=False)):
            orjson.loads(fs.cat_file(path))
            parsed += 1
    return parsed


def batch_path(endpoint: str, lines: list[bytes]) -> int:
    """The project's read path: ``enrich_lines`` on one batch; returns calls attached."""
    store = CaptureStore(f"s3://{BUCKET}/caps", storage_options={"client_kwargs": {"endpoint_url": endpoint}})
    return enrich_lines(lines, [store]).stats.calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=8)
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

        started = time.perf_counter()
        rows = sequential(proxy.endpoint, args.rollouts)
        sequential_s = time.perf_counter() - started
        sequential_counts = proxy.reset_counts()

        started = time.perf_counter()
        calls = batch_path(proxy.endpoint, lines)
        batch_s = time.perf_counter() - started
        batch_counts = proxy.reset_counts()
    finally:
        proxy.close()
        server.terminate()
        server.wait(30)
    assert rows == calls == keys, (rows, calls, keys)
    print(
        json.dumps(
            {
                "rollouts": args.rollouts,
                "objects": keys,
                "added_latency_ms": args.latency_ms,
                "sequential_s": round(sequential_s, 2),
                "batch_path_s": round(batch_s, 2),
                "speedup": round(sequential_s / batch_s, 1),
                "sequential_requests": sequential_counts,
                "batch_path_requests": batch_counts,
                "batch_lists_per_1000_keys": round(1000 * batch_counts.get("LIST", 0) / keys, 2),
                "batch_gets_per_object": round(batch_counts.get("GET", 0) / keys, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
