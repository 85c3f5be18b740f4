"""The whole Prefect flow versus the core merge loop alone, measured in one run.

    python benchmarks/bench_flow.py [--rollouts 10000] [--big 1000000] [--skip-big]

Reports: the flow's overhead over the core loop (threads runner, with Prefect's default
flow-run heartbeats and without); 1 worker versus all cores (process pool); threads /
processes / Dask / Ray on the same corpus with the hash of each output, all timed alike (one
warm-up run each, heartbeats off, best of three; Dask and Ray on a local cluster of one
worker per core, started before anything is timed); peak RSS of the flow process for a small
and a large rollouts input. Runs on Prefect's temporary local server, started once before
anything is timed.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from benchmarks import corpus
from rollout_capture import CaptureStore
from rollout_capture.batch import enrich_lines

CORES = os.cpu_count() or 1


def core_loop(rollouts: Path, captures: Path, output: Path, batch_size: int = 1000) -> float:
    """The core alone: batches through ``enrich_lines``, written to a file."""
    store = CaptureStore(captures)
    started = time.perf_counter()
    first = 1
    with rollouts.open("rb") as handle, output.open("wb") as out:
        while lines := list(itertools.islice(handle, batch_size)):
            batch = enrich_lines(lines, [store], first_line=first)
            out.write(b"\n".join(batch.lines) + b"\n")
            first += len(lines)
    return time.perf_counter() - started


def flow_run(
    rollouts: Path, captures: Path, output: Path, *, heartbeats: bool = True, **options: object
) -> float:
    """Wall time of one ``enrich_rollouts`` run (Prefect defaults, or without flow heartbeats).

    Prefect >= 3.9 joins a heartbeat thread that sleeps in whole seconds when a flow run
    ends, which pads every run to the next second; ``heartbeats=False`` shows the rest.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from rollout_capture.flows import enrich_rollouts

    updates = {} if heartbeats else {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    with temporary_settings(updates=updates):
        started = time.perf_counter()
        enrich_rollouts(str(rollouts), str(captures), output=str(output), **options)
        return time.perf_counter() - started


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def big_input(lines: int) -> tuple[Path, Path]:
    """``lines`` compact rollout records, one in a hundred with a capture."""
    root = corpus.CACHE / f"big-{lines}"
    rollouts, captures = root / "rollouts.jsonl", root / "captures"
    if rollouts.exists():
        return rollouts, captures
    captures.mkdir(parents=True, exist_ok=True)
    row = orjson.dumps(
        {
            "model_call_id": "c",
            "dialect": "chat",
            "latency_ms": 10.0,
            "response": {"usage": {"prompt_tokens": 5}},
        }
    )
    with rollouts.open("wb") as out:
        for index in range(lines):
            record = {
                "_ng_task_index": index,
                "_ng_rollout_index": 0,
                "reward": index % 2,
                "answer": "x" * 200,
            }
            out.write(orjson.dumps(record) + b"\n")
            if index % 100 == 0:
                (captures / f"{index}-0.capture.jsonl").write_bytes(row + b"\n")
    return rollouts, captures


def peak_rss_mb(lines: int) -> float:
    """Peak RSS of a fresh process running the flow on a ``lines``-line input."""
    return corpus.peak_rss_mb_of(
        "import pathlib, tempfile\n"
        "from benchmarks import bench_flow\n"
        f"r, c = bench_flow.big_input({lines})\n"
        "bench_flow.flow_run(r, c, pathlib.Path(tempfile.mkdtemp()) / 'out.jsonl')"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--big", type=int, default=1_000_000, help="lines of the large RSS input")
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()

    rollouts, captures = corpus.build(args.rollouts, repeat=args.repeat)
    work = Path(tempfile.mkdtemp(prefix="bench-flow-"))
    flow_run(rollouts, captures, work / "warm.jsonl", batch_size=1000)  # starts the server: not timed
    results: dict[str, object] = {"rollouts": args.rollouts, "cores": CORES}

    cores, flows, quiet = [], [], []
    for _ in range(3):
        cores.append(core_loop(rollouts, captures, work / "core.jsonl"))
        flows.append(flow_run(rollouts, captures, work / "threads.jsonl", runner="threads"))
        quiet.append(flow_run(rollouts, captures, work / "quiet.jsonl", runner="threads", heartbeats=False))
    results["core_loop_s"] = round(min(cores), 3)
    results["flow_threads_s"] = round(min(flows), 3)
    results["flow_threads_no_heartbeat_s"] = round(min(quiet), 3)
    results["prefect_overhead"] = f"{100 * (min(flows) / min(cores) - 1):.1f}%"
    results["prefect_overhead_no_heartbeat"] = f"{100 * (min(quiet) / min(cores) - 1):.1f}%"
    results["same_bytes_as_core"] = digest(work / "core.jsonl") == digest(work / "threads.jsonl")

    def best(source: Path, caps: Path, name: str, rounds: int = 3, **options: object) -> float:
        """Best of ``rounds`` after one untimed warm-up run (worker pools, clusters start there).

        Every runner is timed alike: flow-run heartbeats off, which otherwise pad each run
        to the next whole second.
        """
        flow_run(source, caps, work / name, heartbeats=False, **options)
        return min(flow_run(source, caps, work / name, heartbeats=False, **options) for _ in range(rounds))

    one = best(rollouts, captures, "p1.jsonl", runner="processes", max_workers=1)
    every = best(rollouts, captures, "pn.jsonl", runner="processes", max_workers=CORES)
    results["processes_1_worker_s"] = round(one, 3)
    results[f"processes_{CORES}_workers_s"] = round(every, 3)
    results["all_cores_speedup"] = round(one / every, 2)
    big_rollouts, big_captures = corpus.build(args.rollouts * 4, repeat=args.repeat)
    big_one = best(big_rollouts, big_captures, "b1.jsonl", runner="processes", max_workers=1)
    big_every = best(big_rollouts, big_captures, "bn.jsonl", runner="processes", max_workers=CORES)
    results[f"all_cores_speedup_{args.rollouts * 4}_rollouts"] = round(big_one / big_every, 2)
    big_core = min(core_loop(big_rollouts, big_captures, work / "bcore.jsonl") for _ in range(2))
    big_flow = best(big_rollouts, big_captures, "bt.jsonl", rounds=2, runner="threads")
    results[f"prefect_overhead_no_heartbeat_{args.rollouts * 4}_rollouts"] = (
        f"{100 * (big_flow / big_core - 1):.1f}%"
    )

    runners = {
        "threads": best(rollouts, captures, "threads-quiet.jsonl", runner="threads"),
        "processes": every,
    }
    if not args.skip_dask:
        from distributed import LocalCluster

        with LocalCluster(
            n_workers=CORES, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster:
            runners["dask"] = best(
                rollouts, captures, "dask.jsonl", runner="dask", dask_address=cluster.scheduler_address
            )
    if not args.skip_ray:
        # A local Ray instance of one worker per core, as the Dask cluster: the flow uses the
        # connection this process already has and leaves it open. Its token stays in this
        # process (a local ray.init() would otherwise write one to ~/.ray for every later
        # use); set before Ray is imported, which reads it once.
        if "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ:
            os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})
        import ray

        ray.init(num_cpus=CORES, include_dashboard=False, log_to_driver=False)
        try:
            runners["ray"] = best(rollouts, captures, "ray.jsonl", runner="ray")
        finally:
            ray.shutdown()
    results["runner_seconds_no_heartbeat"] = {name: round(seconds, 3) for name, seconds in runners.items()}
    outputs = {
        "threads": "threads-quiet.jsonl",
        "processes": "pn.jsonl",
        "dask": "dask.jsonl",
        "ray": "ray.jsonl",
    }
    hashes = {name: digest(work / outputs[name]) for name in runners}
    results["runner_output_sha256"] = hashes
    results["runner_outputs_identical"] = len(set(hashes.values())) == 1

    if not args.skip_big:
        small = max(1, args.big // 10)
        results[f"peak_rss_mb_{small}_lines"] = round(peak_rss_mb(small), 1)
        results[f"peak_rss_mb_{args.big}_lines"] = round(peak_rss_mb(args.big), 1)
    results["bench_process_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
