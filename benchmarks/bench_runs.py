"""Idle ticks of the scheduled job over a runs root on S3 (moto's server), counted on the wire.

    python benchmarks/bench_runs.py [--runs 400 4000] [--latency-ms 30] [--baseline-runs 400]

For each size, a runs root of N run folders, all already enriched, is built directly on
moto; then ``enrich_completed_runs`` runs through a proxy that adds a fixed latency to
every request (30 ms: an object store's first-byte time) and counts requests by kind:

- the first tick, with no index at the root: one delimiter listing per run folder,
  concurrently (it writes the index);
- an idle tick, with the index: the root's pages and one GET.

Each tick is also timed without Prefect (``RunsRoot.discover`` alone). For the smallest
size the previous discovery (three ``exists`` calls per folder, one at a time) is timed
as well. The target an idle tick must meet: at most N/16 x latency + 2 s, and at most
1.1 requests per run folder. moto runs in its own process, as in ``bench_s3.py``.

moto answers a delimiter listing in time that grows with the bucket's keys (it scans
them), so the rate it serves listings at, measured first without the proxy, bounds
the first tick here; S3 answers a prefix listing in about the same time at any size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="bench-runs-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsspec
import orjson

from benchmarks.bench_s3 import free_port, s3, wait_for_port
from rollout_capture.run_folders import ENRICHED, ROLLOUTS, SUCCESS, RunsRoot
from tests.support.fault_proxy import FaultProxy

RECORD = orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": 0}) + b"\n"


def build(endpoint: str, bucket: str, runs: int) -> None:
    """``runs`` enriched run folders: rollouts, ``_SUCCESS`` and ``_ENRICHED`` each."""
    fs = s3(endpoint)
    fs.mkdir(bucket)
    objects = {}
    for index in range(runs):
        folder = f"{bucket}/runs/run-{index:06d}"
        objects |= {f"{folder}/{ROLLOUTS}": RECORD, f"{folder}/{SUCCESS}": b"", f"{folder}/{ENRICHED}": b"{}"}
    items = list(objects.items())
    for start in range(0, len(items), 3000):
        fs.pipe(dict(items[start : start + 3000]))


def previous_discovery(fs: fsspec.AbstractFileSystem, root: str) -> int:
    """What ``RunsRoot.runs()`` did before: a listing, then three ``exists`` per folder, in turn."""
    found = 0
    for entry in fs.ls(root, detail=True):
        if entry.get("type") != "directory":
            continue
        folder = entry["name"].rstrip("/")
        if not fs.exists(f"{folder}/{ROLLOUTS}"):
            continue
        fs.exists(f"{folder}/{SUCCESS}")
        fs.exists(f"{folder}/{ENRICHED}")
        found += 1
    return found


def timed(proxy: FaultProxy, fn: Any) -> tuple[Any, float, dict[str, int]]:
    proxy.reset_counts()
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started, proxy.reset_counts()


def measured(seconds: float, counts: dict[str, int], runs: int) -> dict[str, Any]:
    requests = sum(counts.values())
    return {
        "seconds": round(seconds, 2),
        "requests": counts,
        "requests_per_run_folder": round(requests / runs, 4),
    }


def one_size(endpoint: str, proxy: FaultProxy, runs: int, latency_s: float, baseline: bool) -> dict[str, Any]:
    from rollout_capture.flows import enrich_completed_runs

    bucket = f"bench-runs-{runs}"
    build(endpoint, bucket, runs)
    url = f"s3://{bucket}/runs"
    options = {"client_kwargs": {"endpoint_url": proxy.endpoint}}
    index = f"{bucket}/runs/_rollout_capture_index.json"
    direct = s3(endpoint)
    out: dict[str, Any] = {"run_folders": runs}
    target_s = runs / 16 * latency_s + 2
    out["target"] = {"seconds": round(target_s, 2), "requests_per_run_folder": 1.1}

    # What moto itself can serve (no proxy, no added latency): the first tick's floor here.
    sample = RunsRoot(url, {"client_kwargs": {"endpoint_url": endpoint}}).backend
    folders = [sample.path(f"run-{i:06d}") for i in range(min(runs, 200))]
    started, cpu = time.perf_counter(), time.process_time()
    sample.list_names(folders)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    out["moto_delimiter_lists_per_s"] = round(len(folders) / seconds)
    out["client_cpu_ms_per_list"] = round(1000 * cpu / len(folders), 2)
    out["first_tick_floor_on_moto_s"] = round(runs / (len(folders) / seconds), 1)

    # Discovery alone (no Prefect): without the index, then with it.
    root = RunsRoot(url, options)
    started, cpu = time.perf_counter(), time.process_time()
    found, seconds, counts = timed(proxy, lambda: root.discover())
    assert len(found.runs) == runs and found.listed == runs, (len(found.runs), found.listed)
    out["discovery_no_index"] = measured(seconds, counts, runs)
    out["discovery_no_index"]["process_cpu_s"] = round(time.process_time() - cpu, 2)  # client and proxy
    found, seconds, counts = timed(proxy, lambda: root.discover())
    assert len(found.runs) == runs and found.indexed == runs
    out["discovery_with_index"] = measured(seconds, counts, runs)

    # The scheduled flow: the first tick (no index yet), then an idle one.
    direct.rm(index)
    summary, seconds, counts = timed(proxy, lambda: enrich_completed_runs(url, storage_options=options))
    assert len(summary.already_enriched) == runs and not summary.enriched
    out["first_tick_no_index"] = measured(seconds, counts, runs)
    summary, seconds, counts = timed(proxy, lambda: enrich_completed_runs(url, storage_options=options))
    assert len(summary.already_enriched) == runs and not summary.enriched
    idle = out["idle_tick"] = measured(seconds, counts, runs)
    idle["prefect_overhead_s"] = round(idle["seconds"] - out["discovery_with_index"]["seconds"], 2)
    first = out["first_tick_no_index"]
    out["meets_target"] = {
        "idle_tick": idle["seconds"] <= target_s and idle["requests_per_run_folder"] <= 1.1,
        "first_tick_no_index": first["seconds"] <= target_s and first["requests_per_run_folder"] <= 1.1,
    }
    if baseline:
        fs = s3(proxy.endpoint)
        found_before, seconds, counts = timed(proxy, lambda: previous_discovery(fs, f"{bucket}/runs"))
        assert found_before == runs
        out["previous_discovery"] = measured(seconds, counts, runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, nargs="+", default=[400, 4000])
    parser.add_argument("--latency-ms", type=float, default=30.0)
    parser.add_argument(
        "--baseline-runs", type=int, default=400, help="time the previous discovery at this size (0: never)"
    )
    args = parser.parse_args()
    logging.getLogger("prefect").setLevel(logging.WARNING)

    from rollout_capture.flows import enrich_completed_runs

    host, port = "127.0.0.1", free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(host, port)
    latency_s = args.latency_ms / 1000
    proxy = FaultProxy(host, port, latency_s=latency_s)
    results = []
    try:
        with tempfile.TemporaryDirectory() as empty:  # Prefect's temporary server starts here, untimed
            enrich_completed_runs(empty)
        for runs in args.runs:
            results.append(
                one_size(f"http://{host}:{port}", proxy, runs, latency_s, runs == args.baseline_runs)
            )
    finally:
        proxy.close()
        server.terminate()
        server.wait(30)
    print(json.dumps({"added_latency_ms": args.latency_ms, "sizes": results}, indent=2))


if __name__ == "__main__":
    main()
