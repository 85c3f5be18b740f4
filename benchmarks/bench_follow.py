"""Following a run while it runs: seconds from a record landing to its enriched line being
readable, and what the follower costs, idle and under load.

    python benchmarks/bench_follow.py [--rates 20,100] [--seconds 20] [--stores local,s3]
                                      [--latency-ms 20] [--idle-s 10] [--delay-ms 10]

For each store and rate: a run folder is started (``_STARTED``) and followed by ``rollout-capture
follow`` (its own process, on a ``prefect server`` of its own, so the flow's live artifacts and
lease are in what it costs); then a harness runs rollouts of 5 calls each through our capture
proxy (``rollout-capture proxy`` in front of the scripted upstream, answering after ``--delay-ms``)
and lands each rollout's record as its last call returns, at ``--rates`` records a second for
``--seconds``: on a local disk appended to ``rollouts.jsonl`` (a write and a flush, as NeMo Gym's
collection does); on S3 (moto, its own process, behind tests/support/fault_proxy.py's FaultProxy
adding ``--latency-ms`` to every request) as the run's next part, the records finished in the last
100 ms in one part (the time a record lands is when its part's PUT returned). A reader in this
process watches the live output (the local file every 5 ms; on S3, the next part read every 50 ms
straight from moto, uncounted: up to 50 ms of what it measures there is its own) and notes when
each record's enriched line is readable. Before the load, ``--idle-s`` seconds of an idle, followed run.

Per store and rate: landing to readable p50 / p90 / p99 / max (ms); the follower's CPU (its process
and threads, from /proc) per record under load and per second idle; its store requests a second,
by kind, idle and under load (S3: counted by its own FaultProxy; the proxy's and the harness's
requests go through another); a store request's round trip midway through the load (HEADs through
the follower's FaultProxy: the added latency and what the machine's load adds to it); the CPU share
of the bench's other processes (moto, the proxies, the harness); the rate achieved; then
``finish`` to the published end (seconds).
JSON on stdout, a table on stderr; the host's load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_cli import base_env, cli, prefect_server  # noqa: E402
from bench_proxy import Connection, cpu_seconds, start_proxy, start_upstream  # noqa: E402

from benchmarks.store_bench import DUMMY_CREDENTIALS, CountingProxy, Moto  # noqa: E402

BUCKET = "bench-follow"
CALLS = 5
POOL = 48


def _records() -> list[dict[str, Any]]:
    from examples.samples import corpus_records

    return corpus_records(ROOT / "tests" / "data" / "corpus")


class Reader(threading.Thread):
    """Notes when each record's enriched line becomes readable in the live output."""

    def __init__(self, run: str, s3: dict[str, Any] | None) -> None:
        super().__init__(daemon=True)
        self.folder, self.s3 = run, s3
        self.readable: dict[int, float] = {}
        self.halt = threading.Event()

    def _lines(self) -> Any:
        import orjson

        if self.s3 is None:
            path = Path(self.folder) / "rollouts.enriched.live.jsonl"
            offset, rest = 0, b""
            while not self.halt.wait(0.005):
                try:
                    with open(path, "rb") as handle:
                        handle.seek(offset)
                        data = handle.read()
                except FileNotFoundError:
                    continue
                offset += len(data)
                *whole, rest = (rest + data).split(b"\n")
                seen = time.time()
                for line in whole:
                    yield seen, orjson.loads(line)
        else:
            import fsspec

            fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **self.s3)
            folder = self.folder.removeprefix("s3://") + "/rollouts.enriched.live"
            first = 1  # the next part starts at the line after those read: one GET a probe, no listing
            while not self.halt.wait(0.05):
                try:
                    body = fs.cat_file(f"{folder}/{first:012d}.jsonl")
                except FileNotFoundError:
                    continue
                seen = time.time()
                for line in body.splitlines():
                    first += 1
                    yield seen, orjson.loads(line)

    def run(self) -> None:
        for seen, record in self._lines():
            self.readable[record["_ng_task_index"]] = seen


class Harness:
    """Rollouts of ``CALLS`` calls through the capture proxy, each record landing as its last call returns."""

    def __init__(self, proxy: str, run: str, s3: dict[str, Any] | None) -> None:
        self.proxy, self.run, self.s3 = proxy, run, s3
        self.records = _records()
        self.landed: dict[int, float] = {}
        self._done: list[tuple[int, bytes]] = []
        if s3 is None:
            self._file = open(Path(run) / "rollouts.jsonl", "ab")  # noqa: SIM115 - open for the run
        else:
            from rollout_capture.rollout_parts import PartsWriter

            self._parts = PartsWriter(run, s3)

    def _line(self, index: int) -> bytes:
        import orjson

        record = self.records[index % len(self.records)]
        return orjson.dumps({**record, "_ng_task_index": index, "_ng_rollout_index": 0})

    def _land(self, index: int) -> None:
        line = self._line(index)
        if self.s3 is None:
            self._file.write(line + b"\n")
            self._file.flush()
            self.landed[index] = time.time()
        else:
            self._done.append((index, line))

    async def _flusher(self, stop: asyncio.Event) -> None:
        """S3: every 100 ms, the records finished since land as one part."""
        while True:
            stopping = stop.is_set()
            if self._done:
                batch, self._done = self._done, []
                await asyncio.to_thread(self._parts.append, [line for _, line in batch])
                now = time.time()
                for index, _ in batch:
                    self.landed[index] = now
            if stopping and not self._done:
                return
            await asyncio.sleep(0.1)

    async def load(self, rate: float, seconds: float) -> float:
        """Start ``rate`` rollouts a second for ``seconds``; returns the seconds until all landed."""
        host = self.proxy.removeprefix("http://")
        body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}).encode()
        pool: asyncio.Queue[Connection] = asyncio.Queue()
        for _ in range(POOL):
            pool.put_nowait(await Connection.open(self.proxy))
        stop = asyncio.Event()
        flusher = asyncio.create_task(self._flusher(stop)) if self.s3 is not None else None

        async def rollout(index: int) -> None:
            conn = await pool.get()
            try:
                for _ in range(CALLS):
                    path = f"/ng-rollout/{index}-0/v1/chat/completions"
                    try:
                        await conn.post(path, host, body)
                    except (asyncio.IncompleteReadError, ConnectionError):  # idle past its keep-alive
                        conn.writer.close()
                        conn = await Connection.open(self.proxy)
                        await conn.post(path, host, body)
            finally:
                pool.put_nowait(conn)
            self._land(index)

        started = time.perf_counter()
        tasks = []
        total = int(rate * seconds)
        for index in range(total):
            delay = started + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(rollout(index)))
        await asyncio.gather(*tasks)
        stop.set()
        if flusher is not None:
            await flusher
        while not pool.empty():
            pool.get_nowait().writer.close()
        return time.perf_counter() - started


def _quantiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "p50_ms": round(q[49] * 1000),
        "p90_ms": round(q[89] * 1000),
        "p99_ms": round(q[98] * 1000),
        "max_ms": round(max(values) * 1000),
    }


def _per_second(counts: dict[str, int], seconds: float) -> dict[str, float]:
    return {kind: round(n / seconds, 2) for kind, n in sorted(counts.items())} | {
        "total": round(sum(counts.values()) / seconds, 2)
    }


def scenario(store: str, rate: float, args: argparse.Namespace, shared: dict[str, Any]) -> dict[str, Any]:
    """One store at one rate: idle, then the load, then ``finish`` to the published end."""
    tag = f"{store}-{int(rate)}"
    counter: CountingProxy | None = None
    s3_reader: dict[str, Any] | None = None
    if store == "local":
        run = str(shared["work"] / tag / "runs" / "r1")
        Path(run, "captures").mkdir(parents=True)
        Path(run, "_STARTED").write_bytes(b"")
        capture_dir, follower_options, producer_options = f"{run}/captures", None, None
    else:
        moto: Moto = shared["moto"]
        run = f"s3://{BUCKET}/{tag}/runs/r1"
        counter = CountingProxy(moto.port, args.latency_ms)
        follower_options = {"client_kwargs": {"endpoint_url": counter.endpoint}}
        producer_options = {"client_kwargs": {"endpoint_url": shared["producer"].endpoint}}
        s3_reader = {"client_kwargs": {"endpoint_url": moto.endpoint}}
        capture_dir = f"{run}/captures"
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True, **producer_options).pipe_file(
            f"{run.removeprefix('s3://')}/_STARTED", b""
        )
    env = {**base_env(shared["home"], shared["api"]), **DUMMY_CREDENTIALS}
    flags = ["--storage-options", json.dumps(producer_options)] if producer_options else []
    proxy, proxy_url = start_proxy(shared["upstream"], capture_dir, flags, env=env)
    command = [*cli(), "follow", run, "--quiescence-timeout", "10"]
    if follower_options:
        command += ["--storage-options", json.dumps(follower_options)]
    log = open(shared["work"] / f"{tag}.follow.log", "wb")  # noqa: SIM115 - the follower's whole life
    follower = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    reader = Reader(run, s3_reader)
    reader.start()
    try:
        _wait_following(run, s3_reader, follower)
        time.sleep(2)  # its first UI updates and lease renewal out of the way
        if counter is not None:
            counter.reset()
        cpu_idle = cpu_seconds(follower.pid)
        time.sleep(args.idle_s)
        idle_cpu_s = cpu_seconds(follower.pid) - cpu_idle
        idle_requests = counter.reset() if counter is not None else {}

        harness = Harness(proxy_url, run, producer_options)
        others = _others(shared, proxy, counter)
        others_before = {name: cpu_seconds(pid) for name, pid in others.items()}
        cpu_before = cpu_seconds(follower.pid)
        load_started = time.perf_counter()
        rtt: list[float] = []
        if counter is not None:  # what a request costs under this load, midway (uncounted HEADs)
            timer = threading.Timer(args.seconds / 2, lambda: rtt.extend(counter.round_trips_ms(BUCKET)))
            timer.start()
        landing_s = asyncio.run(harness.load(rate, args.seconds))
        total = len(harness.landed)
        deadline = time.monotonic() + 300
        while len(reader.readable) < total and time.monotonic() < deadline:
            time.sleep(0.05)
        load_s = time.perf_counter() - load_started
        load_cpu_s = cpu_seconds(follower.pid) - cpu_before
        shares = {
            name: round((cpu_seconds(pid) - others_before[name]) / load_s, 3) for name, pid in others.items()
        }
        load_requests = counter.reset() if counter is not None else {}

        finished_at = time.perf_counter()
        if store == "local":
            Path(run, "_SUCCESS").write_bytes(b"")
        else:
            import fsspec

            fsspec.filesystem("s3", skip_instance_cache=True, **s3_reader).pipe_file(
                f"{run.removeprefix('s3://')}/_SUCCESS", b""
            )
        follower.wait(600)
        end_s = time.perf_counter() - finished_at
    finally:
        reader.halt.set()
        if follower.poll() is None:
            follower.terminate()
            follower.wait(60)
        log.close()
        proxy.terminate()
        proxy.wait(30)
        if counter is not None:
            counter.close()
    latencies = [reader.readable[i] - landed for i, landed in harness.landed.items() if i in reader.readable]
    return {
        "store": store,
        "rate_target": rate,
        "records": total,
        "readable": len(latencies),
        "rate_achieved": round(total / landing_s, 1),
        "landing_to_readable": _quantiles(latencies) if latencies else None,
        "cpu_ms_per_record": round(1000 * load_cpu_s / max(total, 1), 2),
        "cpu_share_under_load": round(load_cpu_s / load_s, 3),
        "cpu_share_idle": round(idle_cpu_s / args.idle_s, 4),
        "requests_per_s_idle": _per_second(idle_requests, args.idle_s) if counter is not None else None,
        "requests_per_s_load": _per_second(load_requests, load_s) if counter is not None else None,
        "requests_per_record": round(sum(load_requests.values()) / max(total, 1), 2) if counter else None,
        "cpu_share_of_the_others_under_load": shares,
        "store_round_trip_ms_under_load": round(statistics.median(rtt), 1) if rtt else None,
        "finish_to_published_s": round(end_s, 2),
        "follower_exit": follower.returncode,
    }


def _others(
    shared: dict[str, Any], proxy: subprocess.Popen[str], counter: CountingProxy | None
) -> dict[str, int | None]:
    """The bench's other processes, whose CPU shares the machine with the follower's (None: this one)."""
    found: dict[str, int | None] = {"capture proxy": proxy.pid, "harness and reader": None}
    if "moto" in shared:
        found["moto"] = shared["moto"].proc.pid
        found["the producers' latency proxy"] = shared["producer"].proc.pid
    if counter is not None:
        found["the follower's latency proxy"] = counter.proc.pid
    return found


def _wait_following(run: str, s3: dict[str, Any] | None, follower: subprocess.Popen[bytes]) -> None:
    """Until the follower holds the run's lease (its flow run has begun following)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if follower.poll() is not None:
            raise SystemExit(f"the follower exited {follower.returncode} before following")
        if s3 is None:
            if any(p.name.startswith("_ENRICHING") for p in Path(run).iterdir()):
                return
        else:
            import fsspec

            fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **s3)
            if any(
                "_ENRICHING" in name for name in fs.ls(run.removeprefix("s3://"), detail=False, refresh=True)
            ):
                return
        time.sleep(0.2)
    raise SystemExit("the follower never took the run's lease")


def _table(results: list[dict[str, Any]]) -> str:
    rows = [
        "store  rate  records  p50 ms  p99 ms  max ms  CPU ms/rec  CPU idle  req/s idle  req/s load  req/rec"
    ]
    for r in results:
        q = r["landing_to_readable"] or {}
        idle = (r["requests_per_s_idle"] or {}).get("total", "-")
        load = (r["requests_per_s_load"] or {}).get("total", "-")
        rows.append(
            f"{r['store']:<6} {r['rate_achieved']:>5} {r['records']:>8} {q.get('p50_ms', '-'):>7} "
            f"{q.get('p99_ms', '-'):>7} {q.get('max_ms', '-'):>7} {r['cpu_ms_per_record']:>11} "
            f"{r['cpu_share_idle']:>9} {idle!s:>11} {load!s:>11} {r['requests_per_record']!s:>8} "
            f"{r['store_round_trip_ms_under_load']!s:>7}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", default="20,100")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--stores", default="local,s3")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.update(DUMMY_CREDENTIALS)
    work = Path(tempfile.mkdtemp(prefix="bench-follow-"))
    load_before = os.getloadavg()
    results = []
    shared: dict[str, Any] = {"work": work, "home": work / "prefect"}
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    upstream, shared["upstream"] = start_upstream(args.delay_ms / 1000, "h11", "asyncio")
    try:
        with prefect_server(shared["home"], work / "server.log") as api:
            shared["api"] = api
            if "s3" in stores:
                shared["moto"] = moto = Moto()
                moto.make_bucket(BUCKET)
                shared["producer"] = CountingProxy(moto.port, args.latency_ms)
            for store in stores:
                for rate in (float(r) for r in args.rates.split(",")):
                    results.append(scenario(store, rate, args, shared))
                    print(_table(results[-1:]), file=sys.stderr, flush=True)
    finally:
        upstream.terminate()
        if "producer" in shared:
            shared["producer"].close()
        if "moto" in shared:
            shared["moto"].close()
        shutil.rmtree(work, ignore_errors=True)
    print(_table(results), file=sys.stderr)
    out = {
        "calls_per_record": CALLS,
        "store_latency_ms": args.latency_ms,
        "upstream_delay_ms": args.delay_ms,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "results": results,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
