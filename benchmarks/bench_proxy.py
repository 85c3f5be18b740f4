"""What the capture proxy adds to a model call: latency, first-chunk delay, throughput, CPU.

    python benchmarks/bench_proxy.py [--calls 2000] [--concurrency 32] [--delay-ms 20] [--rounds 3]
                                     [--workers 2,4] [--calls-per-rollout 1] [--capture-root DIR]

Same upstream, same load, direct, through ``rollout-capture proxy`` with one worker and
through one with each of the ``--workers`` counts of worker processes, each writing its
captures to a local disk, interleaved for ``--rounds`` rounds (the order rotates) so a
shared machine's drift hits all alike. The upstream and the proxy are separate processes
from the load generator, a raw-asyncio HTTP/1.1 client on keep-alive connections. Half the
calls stream (a chat stream of 13 events); the upstream answers each call after
``--delay-ms``. ``--http``/``--loop`` pick uvicorn's server stack for the upstream and the
proxy alike (a real vLLM runs httptools + uvloop).

Prints JSON: per round, latency p50/p99 and first-chunk p50/p99 direct and proxied, the
added latency, the throughput ratio, and the CPU each process spent per call (from
/proc; a proxy's summed over its parent and worker processes), so what the proxy costs
can be told apart from the load generator and upstream; then min/median/max over the
rounds for each worker count, the proxy's upstream connections (pool reuse), how the
clients' connections spread over the workers, and the same comparison at 4 clients,
unsaturated.
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
from collections.abc import Callable
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
            "rollout_capture.cli",
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


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (a proxy's worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process and its live descendants, all their threads (this
    process when ``pid`` is None)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    total = 0.0
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def sockets_held(pid: int) -> dict[int, set[str]]:
    """The socket inodes each process of ``pid``'s tree holds open."""
    held: dict[int, set[str]] = {}
    for member in process_tree(pid):
        inodes: set[str] = set()
        try:
            fds = list(Path(f"/proc/{member}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        held[member] = inodes
    return held


def tcp_table() -> list[tuple[int, int, str, str]]:
    """(local port, remote port, state, inode) of every TCP socket (/proc/net/tcp and tcp6)."""
    rows: list[tuple[int, int, str, str]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local_port = int(parts[1].rsplit(":", 1)[1], 16)
            remote_port = int(parts[2].rsplit(":", 1)[1], 16)
            rows.append((local_port, remote_port, parts[3], parts[9]))
    return rows


ESTABLISHED, TIME_WAIT = "01", "06"


def connections_per_process(pid: int, port: int) -> list[int]:
    """How many established connections to ``port`` each process of ``pid``'s tree serves
    (the workers of one proxy), largest first; processes serving none left out."""
    served = {inode for local, _, state, inode in tcp_table() if state == ESTABLISHED and local == port}
    counts = [len(inodes & served) for inodes in sockets_held(pid).values()]
    return sorted((n for n in counts if n), reverse=True)


def upstream_connections_open(pid: int, upstream_port: int) -> int:
    """Established connections from ``pid``'s tree (a proxy's pools) to the upstream."""
    held = set().union(*sockets_held(pid).values())
    return sum(
        1
        for _, remote, state, inode in tcp_table()
        if state == ESTABLISHED and remote == upstream_port and inode in held
    )


# Local ports of the load generator's own connections: their time-wait is not the proxy's.
LOADGEN_PORTS: set[int] = set()


def time_waits(port: int) -> int:
    """Connections to a server port closed by a client other than the load generator
    (time-wait on the client's side: no keep-alive reuse)."""
    return sum(
        1
        for local, remote, state, _ in tcp_table()
        if state == TIME_WAIT and remote == port and local not in LOADGEN_PORTS
    )


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


async def load(
    url: str,
    prefix: str,
    calls: int,
    concurrency: int,
    while_open: Callable[[], Any] | None = None,
    per_rollout: int = 1,
) -> dict[str, Any]:
    """``calls`` calls over ``concurrency`` keep-alive connections, ``per_rollout`` consecutive
    calls to each rollout id; ``while_open`` is called (its result kept as ``spread``) once
    they are done but before the connections close."""
    host = url.removeprefix("http://")
    plain = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}).encode()
    stream = json.dumps(
        {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    latencies: list[float] = []
    firsts: list[float] = []
    counter = iter(range(calls))

    async def worker() -> Connection:
        conn = await Connection.open(url)
        LOADGEN_PORTS.add(conn.writer.get_extra_info("sockname")[1])
        for n in counter:
            path = f"{prefix.format(n=n // per_rollout)}/v1/chat/completions"
            streaming = n % 2 == 1
            first, total = await conn.post(path, host, stream if streaming else plain)
            latencies.append(total)
            if streaming:
                firsts.append(first)
        return conn

    started = time.perf_counter()
    conns = await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    spread = while_open() if while_open is not None else None
    for conn in conns:
        conn.writer.close()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    fq = statistics.quantiles(firsts, n=100, method="inclusive")
    out: dict[str, Any] = {
        "calls": calls,
        "seconds": round(elapsed, 3),
        "calls_per_s": round(calls / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "first_chunk_p50_ms": round(fq[49] * 1000, 2),
        "first_chunk_p99_ms": round(fq[98] * 1000, 2),
    }
    if spread is not None:
        out["client_connections_per_process"] = spread
    return out


def measured(
    url: str,
    prefix: str,
    calls: int,
    concurrency: int,
    pids: dict[str, int | None],
    upstream_port: int,
    per_rollout: int = 1,
) -> dict[str, Any]:
    """One load, with the CPU milliseconds per call of each process named in ``pids`` (a
    proxy's summed over its worker processes).

    Through the proxy, also its connections to the upstream: open after the load, and how
    many it closed during it (no keep-alive reuse would show here); and how the clients'
    connections spread over its processes.
    """
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    closed = time_waits(upstream_port)
    proxy_pid = pids.get("proxy")
    spread = None
    if proxy_pid is not None:
        port = int(url.rsplit(":", 1)[1])
        spread = lambda: connections_per_process(proxy_pid, port)  # noqa: E731
    result = asyncio.run(load(url, prefix, calls, concurrency, spread, per_rollout))
    result["cpu_ms_per_call"] = {
        name: round((cpu_seconds(pid) - before[name]) * 1000 / calls, 3) for name, pid in pids.items()
    }
    if proxy_pid is not None:
        result["upstream_connections"] = {
            "open": upstream_connections_open(proxy_pid, upstream_port),
            "closed": max(0, time_waits(upstream_port) - closed),
        }
    return result


# Added figure -> the measured one it is the difference of.
ADDED = {
    "added_latency_p50_ms": "p50_ms",
    "added_latency_p99_ms": "p99_ms",
    "added_first_chunk_p50_ms": "first_chunk_p50_ms",
    "added_first_chunk_p99_ms": "first_chunk_p99_ms",
}


def compare(
    upstream: tuple[str, int],
    proxies: dict[str, tuple[str, int]],
    calls: int,
    concurrency: int,
    tag: str,
    shift: int,
    per_rollout: int = 1,
) -> dict[str, Any]:
    """Direct and through each proxy, same load, the order rotated by ``shift``; the proxied
    rollout ids are fresh for each comparison."""
    upstream_url, upstream_pid = upstream
    port = int(upstream_url.rsplit(":", 1)[1])
    direct_pids: dict[str, int | None] = {"upstream": upstream_pid, "loadgen": None}
    names = ["direct", *proxies]
    shift %= len(names)
    runs: dict[str, dict[str, Any]] = {}
    for name in names[shift:] + names[:shift]:
        if name == "direct":
            runs[name] = measured(upstream_url, "", calls, concurrency, direct_pids, port)
        else:
            proxy_url, proxy_pid = proxies[name]
            prefix = "/ng-rollout/" + tag + "{n}-0"
            pids: dict[str, int | None] = {"proxy": proxy_pid, **direct_pids}
            runs[name] = measured(proxy_url, prefix, calls, concurrency, pids, port, per_rollout)
    direct = runs["direct"]

    def added(proxied: dict[str, Any]) -> dict[str, float]:
        out = {name: round(float(proxied[key]) - float(direct[key]), 2) for name, key in ADDED.items()}
        out["throughput_ratio"] = round(float(proxied["calls_per_s"]) / float(direct["calls_per_s"]), 3)
        out["proxy_cpu_ms_per_call"] = proxied["cpu_ms_per_call"]["proxy"]
        return out

    return {
        "calls": calls,
        "concurrency": concurrency,
        "direct": direct,
        "proxied": {name: runs[name] for name in proxies},
        "added": {name: added(runs[name]) for name in proxies},
    }


SUMMARY_KEYS = (
    "added_latency_p50_ms",
    "added_latency_p99_ms",
    "added_first_chunk_p50_ms",
    "added_first_chunk_p99_ms",
    "throughput_ratio",
    "proxy_cpu_ms_per_call",
)


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(statistics.median(values), 3), round(max(values), 3)]


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """[min, median, max] over the rounds of the figures that matter, for each proxy."""
    out: dict[str, Any] = {}
    for name in rounds[0]["added"]:
        figures: dict[str, Any] = {
            key: spread([r["added"][name][key] for r in rounds]) for key in SUMMARY_KEYS
        }
        figures["proxied_calls_per_s"] = spread([r["proxied"][name]["calls_per_s"] for r in rounds])
        figures["proxied_p50_ms"] = spread([r["proxied"][name]["p50_ms"] for r in rounds])
        out[name] = figures
    out["direct_calls_per_s"] = spread([r["direct"]["calls_per_s"] for r in rounds])
    out["direct_p50_ms"] = spread([r["direct"]["p50_ms"] for r in rounds])
    out["upstream_cpu_ms_per_call_direct"] = spread(
        [r["direct"]["cpu_ms_per_call"]["upstream"] for r in rounds]
    )
    out["loadgen_cpu_ms_per_call_direct"] = spread(
        [r["direct"]["cpu_ms_per_call"]["loadgen"] for r in rounds]
    )
    return out


def filesystem_of(path: Path) -> str:
    """The filesystem holding ``path`` (from /proc/mounts): the per-call claim file's create
    cost depends on it (0.02-0.5 ms measured here on one ext4 disk, ~0.01 ms on tmpfs)."""
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    resolved = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if (
            len(parts) > 2
            and (resolved + "/").startswith(parts[1].rstrip("/") + "/")
            and len(parts[1]) >= len(best)
        ):
            best, kind = parts[1], f"{parts[2]} on {parts[1]}"
    return kind


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
    parser.add_argument(
        "--workers",
        default="2,4",
        help="proxy worker processes, comma-separated counts (each measured beside a 1-worker proxy)",
    )
    parser.add_argument(
        "--calls-per-rollout",
        type=int,
        default=1,
        help="consecutive calls sent to each rollout id (1: every call opens a new capture file)",
    )
    parser.add_argument(
        "--capture-root",
        default=None,
        help="where the capture dirs go (default: the system temp dir); e.g. /dev/shm to leave the disk out",
    )
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.delay_ms / 1000, args.http, args.loop)
        return

    work = Path(tempfile.mkdtemp(prefix="bench-proxy-", dir=args.capture_root))
    upstream, upstream_url = start_upstream(args.delay_ms / 1000, args.http, args.loop)
    extra = ["--http", args.http, "--loop", args.loop]
    counts = sorted({1, *(int(n) for n in args.workers.split(","))})
    started: dict[str, tuple[subprocess.Popen[str], str]] = {}
    try:
        for count in counts:
            name = f"workers_{count}"
            started[name] = start_proxy(upstream_url, str(work / name), [*extra, "--workers", str(count)])
        proxies = {name: (url, proc.pid) for name, (proc, url) in started.items()}
        asyncio.run(load(upstream_url, "", args.warmup, args.concurrency))
        for url, _ in proxies.values():
            asyncio.run(load(url, "/ng-rollout/warm-{n}", args.warmup, args.concurrency))
        ends = (upstream_url, upstream.pid), proxies
        per = args.calls_per_rollout
        rounds = [
            compare(*ends, args.calls, args.concurrency, f"r{i}-", shift=i, per_rollout=per)
            for i in range(args.rounds)
        ]
        light = compare(*ends, args.calls // 4, args.light_concurrency, "light-", shift=0, per_rollout=per)
        rows = {
            name: sum(
                p.read_bytes().count(b"\n")
                for p in (work / name).glob("*.capture.jsonl")
                if not p.name.startswith(("warm", "light"))
            )
            for name in proxies
        }
    finally:
        for proc in [*(proc for proc, _ in started.values()), upstream]:
            proc.terminate()
            proc.wait(60)
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
            "client": "aiohttp",
            "captures": "JSONL, claim + row (fsync) + release per call",
            "calls_per_rollout": args.calls_per_rollout,
            "capture_filesystem": filesystem_of(work),
            "processes": "upstream, proxy and load generator each in its own process",
            "proxies": {f"workers_{n}": f"rollout-capture proxy --workers {n}" for n in counts},
        },
        "summary_min_median_max": summary(rounds),
        "rows_written": rows,
        "rows_expected_each": args.calls * args.rounds,
        "rounds": rounds,
        "light_load": light,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
