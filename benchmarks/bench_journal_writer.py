"""The journal writer alone on S3: how long a row waits for its acknowledgement, by commits in flight.

    python benchmarks/bench_journal_writer.py [--in-flight 1,2,4] [--clients 4,32] [--rounds 3]

Callers (threads of this process) each think ``--think-ms``, then write one row of a rollout of
their own through one ``JournalWriter`` and wait for it, as a proxy's calls do after their
upstream's last byte. The store is moto in its own process behind a request-counting proxy adding
``--store-latency-ms`` per request (benchmarks/store_bench.py). Each in-flight bound runs in turn
within a round, rounds interleaved, so the machine's other load falls on all of them alike.

Reported per run: acknowledgement latency p50/p99 (submission to durable), the PUT's own p50
(what one commit costs on this store, the floor of the acknowledgement), commits a row, the
process's CPU a row, and a HEAD's round trip through the proxy (the ``RTT`` of bench_proxy's
targets). JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.store_bench import DUMMY_CREDENTIALS, CountingProxy, Moto

BUCKET = "bench-journal-writer"
ROW = {"kind": "model_call", "dialect": "chat", "response": {"text": "y" * 500}}


def run(
    url: str, options: dict[str, Any], in_flight: int, clients: int, calls: int, think_s: float
) -> dict[str, Any]:
    """One load: ``clients`` callers writing ``calls`` rows in all through a fresh writer."""
    from rollout_capture import CaptureStore
    from rollout_capture.journal import JournalWriter, row_entry

    store = CaptureStore(url, storage_options=options, layout="journal")
    backend = store._backend
    writer = JournalWriter(backend, "rows", in_flight=in_flight)
    writer.write([row_entry("warm-0", ROW)])  # the tail found, the first commit alone
    puts: list[float] = []
    create = backend.create

    def timed_create(path: str, data: bytes) -> None:
        started = time.perf_counter()
        try:
            create(path, data)
        finally:
            puts.append((time.perf_counter() - started) * 1000)

    backend.create = timed_create  # type: ignore[method-assign]
    latencies: list[float] = []
    lock = threading.Lock()
    left = [calls]

    def caller(c: int) -> None:
        n = 0
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            time.sleep(think_s)
            started = time.perf_counter()
            writer.write([row_entry(f"c{c}-0", {**ROW, "n": n})])
            with lock:
                latencies.append((time.perf_counter() - started) * 1000)
            n += 1

    commits, cpu = writer.commits, time.process_time()
    threads = [threading.Thread(target=caller, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies.sort()
    return {
        "in_flight": in_flight,
        "clients": clients,
        "ack_p50_ms": round(latencies[len(latencies) // 2], 1),
        "ack_p99_ms": round(latencies[int(len(latencies) * 0.99)], 1),
        "put_p50_ms": round(statistics.median(puts), 1),
        "commits_per_row": round((writer.commits - commits) / calls, 3),
        "cpu_ms_per_row": round((time.process_time() - cpu) * 1000 / calls, 2),
        "peak_in_flight": writer.peak_in_flight,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", default="1,2,4", help="commits in flight per run, comma-separated")
    parser.add_argument("--clients", default="4,32", help="callers per run, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=400, help="rows per run at the largest load")
    parser.add_argument("--think-ms", type=float, default=150.0, help="each caller's pause before a row")
    parser.add_argument("--store-latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    try:
        bounds = [int(x) for x in args.in_flight.split(",") if x.strip()]
        loads = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        raise SystemExit("--in-flight and --clients take comma-separated integers") from None
    os.environ.update(DUMMY_CREDENTIALS)
    moto = Moto()
    counter = None
    try:
        moto.make_bucket(BUCKET)
        counter = CountingProxy(moto.port, args.store_latency_ms)
        options = {"client_kwargs": {"endpoint_url": counter.endpoint}}
        runs = []
        for r in range(args.rounds):
            for clients in loads:
                calls = max(40, args.calls * clients // max(loads))
                for k in bounds:
                    result = run(
                        f"s3://{BUCKET}/r{r}-c{clients}-k{k}",
                        options,
                        k,
                        clients,
                        calls,
                        args.think_ms / 1000,
                    )
                    result["round"] = r
                    result["head_rtt_ms"] = round(statistics.median(counter.round_trips_ms(BUCKET)), 1)
                    print(json.dumps(result), file=sys.stderr, flush=True)
                    runs.append(result)
        print(json.dumps({"load_average": os.getloadavg(), "runs": runs}, indent=2))
    finally:
        if counter is not None:
            counter.close()
        moto.close()


if __name__ == "__main__":
    main()
