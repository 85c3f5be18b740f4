"""What the capture proxy adds to a model call: latency, first-chunk delay and throughput.

    python benchmarks/bench_proxy.py [--calls 2000] [--concurrency 32] [--delay-ms 20]

One run, same upstream, same load: first straight to the scripted upstream, then through
``rollout-capture proxy`` writing its captures to a local disk. The upstream and the
proxy are separate processes from the load generator, a raw-asyncio HTTP/1.1 client on
keep-alive connections (cheap, so it takes little CPU from the processes measured). Half
the calls stream (a chat stream of 13 events); the upstream answers each call after
``--delay-ms``. Prints JSON: per-call latency p50/p99 direct and proxied, the added
latency, the added delay of the first streamed chunk, and the throughput ratio.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def serve_upstream(delay_s: float) -> None:
    """The scripted upstream, on a free port announced on stdout (runs in its own process)."""
    import socket

    import uvicorn

    from tests.scripted_upstream import ScriptedUpstream

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so Nagle is off
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(ScriptedUpstream(delay_s=delay_s), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def start_upstream(delay_s: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-upstream", "--delay-ms", str(delay_s * 1000)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"


def start_proxy(upstream: str, capture_dir: str) -> tuple[subprocess.Popen[str], str]:
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
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "rollout-capture proxy on http://127.0.0.1:PORT -> ..."
    return proc, line.split(" on ", 1)[1].split(" ", 1)[0]


class Connection:
    """One keep-alive HTTP/1.1 connection: send a POST, read the answer, time its first body chunk."""

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
        if b"transfer-encoding: chunked" in headers:
            first = None
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                data = await self.reader.readexactly(size + 2)
                if size and first is None:
                    first = time.perf_counter()
                if not size:
                    break
            del data
        else:
            length = int(headers.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            await self.reader.readexactly(length)
            first = time.perf_counter()
        end = time.perf_counter()
        return (first or end) - start, end - start


async def load(url: str, prefix: str, calls: int, concurrency: int) -> dict[str, object]:
    host = url.removeprefix("http://")
    plain = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}).encode()
    stream = json.dumps(
        {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    latencies: list[float] = []
    firsts: list[float] = []
    counter = iter(range(calls))

    async def worker(number: int) -> None:
        conn = await Connection.open(url)
        for n in counter:
            path = f"{prefix.format(n=n)}/v1/chat/completions"
            streaming = n % 2 == 1
            first, total = await conn.post(path, host, stream if streaming else plain)
            latencies.append(total)
            if streaming:
                firsts.append(first)
        conn.writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
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


def compare(upstream_url: str, proxy_url: str, calls: int, concurrency: int, tag: str) -> dict[str, object]:
    """Direct then proxied, same load; the proxied rollout ids are fresh for each comparison."""
    direct = asyncio.run(load(upstream_url, "", calls, concurrency))
    proxied = asyncio.run(load(proxy_url, "/ng-rollout/" + tag + "{n}-0", calls, concurrency))

    def added(key: str) -> float:
        return round(float(proxied[key]) - float(direct[key]), 2)  # type: ignore[arg-type]

    ratio = float(proxied["calls_per_s"]) / float(direct["calls_per_s"])  # type: ignore[arg-type]
    return {
        "calls": calls,
        "concurrency": concurrency,
        "direct": direct,
        "proxied": proxied,
        "added_latency_p50_ms": added("p50_ms"),
        "added_latency_p99_ms": added("p99_ms"),
        "added_first_chunk_p50_ms": added("first_chunk_p50_ms"),
        "added_first_chunk_p99_ms": added("first_chunk_p99_ms"),
        "throughput_ratio": round(ratio, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--light-concurrency", type=int, default=4, help="a second, unsaturated load")
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.delay_ms / 1000)
        return

    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    upstream, upstream_url = start_upstream(args.delay_ms / 1000)
    proxy, proxy_url = start_proxy(upstream_url, str(work / "captures"))
    try:
        asyncio.run(load(upstream_url, "", args.warmup, args.concurrency))
        asyncio.run(load(proxy_url, "/ng-rollout/warm-{n}", args.warmup, args.concurrency))
        main_run = compare(upstream_url, proxy_url, args.calls, args.concurrency, "")
        light = compare(upstream_url, proxy_url, args.calls // 4, args.light_concurrency, "light-")
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
        "machine": {"cpus": os.cpu_count(), "note": "shared with other workloads; figures as measured"},
        "setup": {
            "upstream_delay_ms": args.delay_ms,
            "streaming_share": 0.5,
            "captures": "local disk (JSONL, flock + fsync), claim + row + release per call",
            "processes": "upstream, proxy and load generator each in its own process",
        },
        **main_run,
        "rows_written": rows,
        "light_load": light,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
