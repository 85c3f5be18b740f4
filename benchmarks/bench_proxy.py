"""What the capture proxy adds to a model call: latency, first-chunk delay, throughput, CPU.

    python benchmarks/bench_proxy.py [--calls 2000] [--concurrency 32] [--delay-ms 20] [--rounds 3]

Same upstream, same load, direct and through ``rollout-capture proxy`` writing its
captures to a local disk, interleaved for ``--rounds`` rounds (the order alternates) so a
shared machine's drift hits both alike. The upstream and the proxy are separate processes
from the load generator, a raw-asyncio HTTP/1.1 client on keep-alive connections. Half the
calls stream (a chat stream of 13 events); the upstream answers each call after
``--delay-ms``. ``--http``/``--loop`` pick uvicorn's server stack for the upstream and the
proxy alike (a real vLLM runs httptools + uvloop); ``--client`` the proxy's upstream client.

Prints JSON: per round, latency p50/p99 and first-chunk p50/p99 direct and proxied, the
added latency, the throughput ratio, and the CPU each process spent per call (from
/proc), so what the proxy costs can be told apart from the load generator and upstream;
then min/median/max over the rounds, the proxy's upstream connections (pool reuse), and
the same comparison at 4 clients, unsaturated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_TICK = os.sysconf("SC_CLK_TCK")


def serve_upstream(delay_s: float, http: str, loop: str) -> None:
    """The scripted upstream, on a free port announced on stdout (runs in its own process)."""
    import socket

    import uvicorn

    from tests.scripted_upstream import ScriptedUpstream

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so Nagle is off
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(
        ScriptedUpstream(delay_s=delay_s),
        log_level="warning",
        access_log=False,
        http=http,  # type: ignore[arg-type]
        loop=loop,  # type: ignore[arg-type]
    )
    uvicorn.Server(config).run(sockets=[sock])


def start_upstream(delay_s: float, http: str, loop: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve-upstream",
            "--delay-ms",
            str(delay_s * 1000),
            "--http",
            http,
            "--loop",
            loop,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"


def start_proxy(upstream: str, capture_dir: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "proxy",
            "--upstream",
            upstream,
            "--capture-dir",
            capture_dir,
            "--port",
            "0",
            "--server-name",
            "bench",
            "--log-level",
            "warning",
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "rollout-capture proxy on http://127.0.0.1:PORT -> ..."
    if " on " not in line:
        raise RuntimeError(f"proxy did not start: {line}{proc.stderr.read()}")
    return proc, line.split(" on ", 1)[1].split(" ", 1)[0]


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process, all its threads (this process when ``pid`` is None)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


# Local ports of the load generator's own connections: their time-wait is not the proxy's.
LOADGEN_PORTS: set[int] = set()


def tcp_states(port: int) -> dict[str, int]:
    """Connections to a server port: established (its side), and closed by a client other than
    the load generator (time-wait on the client's side)."""
    counts = {"established": 0, "time_wait": 0}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local_port = int(parts[1].rsplit(":", 1)[1], 16)
            remote_port = int(parts[2].rsplit(":", 1)[1], 16)
            if parts[3] == "01" and local_port == port:
                counts["established"] += 1
            elif parts[3] == "06" and remote_port == port and local_port not in LOADGEN_PORTS:
                counts["time_wait"] += 1
    return counts


class Connection:
    """One keep-alive HTTP/1.1 connection: send a POST, read the answer, time its first body chunk.

    The first chunk is timed the same way direct and proxied: when the first non-empty
    chunk of a chunked answer has been read whole (a plain answer: its whole body).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def post(self, path: str, host: str, body: bytes) -> tuple[float, float]:
        """(seconds to the first body byte, seconds to the end of the answer)."""
        start = time.perf_counter()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer sk-bench\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
        headers = head.lower()
        if b"connection: close" in headers:
            raise RuntimeError("the server closed a keep-alive connection")
        first = None
        if b"transfer-encoding: chunked" in headers:
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                await self.reader.readexactly(size + 2)
                if size and first is None:
                    first = time.perf_counter()
                if not size:
                    break
        else:
            length = int(headers.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            await self.reader.readexactly(length)
            first = time.perf_counter()
        end = time.perf_counter()
        return (first or end) - start, end - start


async def load(url: str, prefix: str, calls: int, concurrency: int) -> dict[str, Any]:
    host = url.removeprefix("http://")
    plain = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}).encode()
    stream = json.dumps(
        {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    latencies: list[float] = []
    firsts: list[float] = []
    counter = iter(range(calls))

    async def worker() -> None:
        conn = await Connection.open(url)
        LOADGEN_PORTS.add(conn.writer.get_extra_info("sockname")[1])
        for n in counter:
            path = f"{prefix.format(n=n)}/v1/chat/completions"
            streaming = n % 2 == 1
            first, total = await conn.post(path, host, stream if streaming else plain)
            latencies.append(total)
            if streaming:
                firsts.append(first)
        conn.writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    fq = statistics.quantiles(firsts, n=100, method="inclusive")
    return {
        "calls": calls,
        "seconds": round(elapsed, 3),
        "calls_per_s": round(calls / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "first_chunk_p50_ms": round(fq[49] * 1000, 2),
        "first_chunk_p99_ms": round(fq[98] * 1000, 2),
    }


def measured(
    url: str, prefix: str, calls: int, concurrency: int, pids: dict[str, int | None], upstream_port: int
) -> dict[str, Any]:
    """One load, with the CPU milliseconds per call of each process named in ``pids``.

    Through the proxy, also its connections to the upstream: open after the load, and how
    many it closed during it (no keep-alive reuse would show here).
    """
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    closed = tcp_states(upstream_port)["time_wait"]
    result = asyncio.run(load(url, prefix, calls, concurrency))
    result["cpu_ms_per_call"] = {
        name: round((cpu_seconds(pid) - before[name]) * 1000 / calls, 3) for name, pid in pids.items()
    }
    if "proxy" in pids:
        after = tcp_states(upstream_port)
        result["upstream_connections"] = {
            "open": after["established"],
            "closed": max(0, after["time_wait"] - closed),
        }
    return result


def compare(
    upstream: tuple[str, int],
    proxy: tuple[str, int],
    calls: int,
    concurrency: int,
    tag: str,
    proxy_first: bool,
) -> dict[str, Any]:
    """Direct and proxied, same load; the proxied rollout ids are fresh for each comparison."""
    (upstream_url, upstream_pid), (proxy_url, proxy_pid) = upstream, proxy
    port = int(upstream_url.rsplit(":", 1)[1])
    direct_pids: dict[str, int | None] = {"upstream": upstream_pid, "loadgen": None}
    proxied_pids: dict[str, int | None] = {"proxy": proxy_pid, **direct_pids}
    runs: dict[str, dict[str, Any]] = {}
    order = ("proxied", "direct") if proxy_first else ("direct", "proxied")
    for name in order:
        if name == "direct":
            runs[name] = measured(upstream_url, "", calls, concurrency, direct_pids, port)
        else:
            prefix = "/ng-rollout/" + tag + "{n}-0"
            runs[name] = measured(proxy_url, prefix, calls, concurrency, proxied_pids, port)
    direct, proxied = runs["direct"], runs["proxied"]

    def added(key: str) -> float:
        return round(float(proxied[key]) - float(direct[key]), 2)

    return {
        "calls": calls,
        "concurrency": concurrency,
        "direct": direct,
        "proxied": proxied,
        "added_latency_p50_ms": added("p50_ms"),
        "added_latency_p99_ms": added("p99_ms"),
        "added_first_chunk_p50_ms": added("first_chunk_p50_ms"),
        "added_first_chunk_p99_ms": added("first_chunk_p99_ms"),
        "throughput_ratio": round(float(proxied["calls_per_s"]) / float(direct["calls_per_s"]), 3),
        "proxy_cpu_ms_per_call": proxied["cpu_ms_per_call"]["proxy"],
    }


SUMMARY_KEYS = (
    "added_latency_p50_ms",
    "added_latency_p99_ms",
    "added_first_chunk_p50_ms",
    "added_first_chunk_p99_ms",
    "throughput_ratio",
    "proxy_cpu_ms_per_call",
)


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """[min, median, max] over the rounds of the figures that matter."""

    def spread(values: list[float]) -> list[float]:
        return [round(min(values), 3), round(statistics.median(values), 3), round(max(values), 3)]

    out: dict[str, Any] = {key: spread([r[key] for r in rounds]) for key in SUMMARY_KEYS}
    for side in ("direct", "proxied"):
        out[f"{side}_calls_per_s"] = spread([r[side]["calls_per_s"] for r in rounds])
        out[f"{side}_p50_ms"] = spread([r[side]["p50_ms"] for r in rounds])
    out["upstream_cpu_ms_per_call_direct"] = spread(
        [r["direct"]["cpu_ms_per_call"]["upstream"] for r in rounds]
    )
    out["loadgen_cpu_ms_per_call_direct"] = spread(
        [r["direct"]["cpu_ms_per_call"]["loadgen"] for r in rounds]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved direct/proxied rounds")
    parser.add_argument("--light-concurrency", type=int, default=4, help="a second, unsaturated load")
    parser.add_argument("--http", default="httptools", help="uvicorn --http of the upstream and the proxy")
    parser.add_argument("--loop", default="asyncio", help="uvicorn --loop of the upstream and the proxy")
    parser.add_argument("--client", default=None, help="the proxy's upstream client (its default if unset)")
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.delay_ms / 1000, args.http, args.loop)
        return

    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    upstream, upstream_url = start_upstream(args.delay_ms / 1000, args.http, args.loop)
    extra = ["--http", args.http, "--loop", args.loop]
    if args.client:
        extra += ["--client", args.client]
    proxy, proxy_url = start_proxy(upstream_url, str(work / "captures"), extra)
    try:
        asyncio.run(load(upstream_url, "", args.warmup, args.concurrency))
        asyncio.run(load(proxy_url, "/ng-rollout/warm-{n}", args.warmup, args.concurrency))
        ends = (upstream_url, upstream.pid), (proxy_url, proxy.pid)
        rounds = [
            compare(*ends, args.calls, args.concurrency, f"r{i}-", proxy_first=i % 2 == 1)
            for i in range(args.rounds)
        ]
        light = compare(*ends, args.calls // 4, args.light_concurrency, "light-", proxy_first=False)
        rows = sum(
            p.read_bytes().count(b"\n")
            for p in (work / "captures").glob("*.capture.jsonl")
            if not p.name.startswith(("warm", "light"))
        )
    finally:
        for proc in (proxy, upstream):
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "note": "shared with other workloads; figures as measured",
        },
        "setup": {
            "upstream_delay_ms": args.delay_ms,
            "streaming_share": 0.5,
            "server": {"http": args.http, "loop": args.loop},
            "client": args.client or "default",
            "captures": "local disk (JSONL), claim + row + release per call",
            "processes": "upstream, proxy and load generator each in its own process",
        },
        "summary_min_median_max": summary(rounds),
        "rows_written": rows,
        "rows_expected": args.calls * args.rounds,
        "rounds": rounds,
        "light_load": light,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
