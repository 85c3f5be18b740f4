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

    python benchmarks/bench_proxy.py --store s3 [--layouts objects,journal] [--disk-layouts jsonl]
                                     [--delay-ms 150] [--store-latency-ms 20] [--calls 400] [--rounds 2]

Issue 20's targets instead: a proxy for each of ``--layouts`` writing to ``s3://`` on moto
(its own process) through tests/support/fault_proxy.py's FaultProxy (its own process too, adding
``--store-latency-ms`` to each request and counting them by method), and one for each of
``--disk-layouts`` on a local disk (``jsonl+files``, ``jsonl+log``: the JSONL layout with claim
files, or with the claims log; a plain ``jsonl`` takes the producer's default), beside direct
calls and each other in interleaved rounds at ``--concurrency`` and ``--light-concurrency``
clients. Per proxy: first chunk and last byte
added (p50, p99), store requests per call by method over the measured calls only, CPU per
call until its store went quiet, and the rows a reader then finds (missing, doubled, claims
left). A layout whose proxy does not start or breaks is reported as ``{"error": ...}``. JSON
on stdout, a table of the targets beside what was measured (min .. max over rounds) on stderr.
``--baseline REF`` (a git ref of this repository, or a checkout's directory) runs the code before
beside it, every proxy named ``base_*``: last byte and first chunk added, store requests and CPU
a call before and after, in one run. A layout ``@N`` is served by ``--workers N`` (``journal@2``).
``--shape agent`` sends the agent shape (issue 48): each client takes the next rollout and sends its
``--calls-per-rollout`` calls one after another, each request carrying the answers before it,
answers of 200 B to 4 kB, half streamed. Per S3 proxy also the store's answers by status (412: a
create that found its number taken) and the journal commits the calls left, by stream (commits,
tombstones, entries each, writers).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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

    from tests.support.scripted_upstream import ScriptedUpstream

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


def baseline_checkout(baseline: str, work: Path) -> Path:
    """The code before, to run beside this tree's: a directory as it is, else a git ref of this
    repository (``main``, ``HEAD~3``, a commit), unpacked from ``git archive`` under ``work``."""
    given = Path(baseline)
    if given.is_dir():
        return given.resolve()
    target = work / "baseline"
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", baseline], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise SystemExit(
            f"--baseline {baseline!r}: neither a directory nor a git ref: {archive.stderr.decode()}"
        )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def start_proxy(
    upstream: str,
    capture_dir: str,
    extra: list[str],
    env: dict[str, str] | None = None,
    checkout: Path = ROOT,
) -> tuple[subprocess.Popen[str], str]:
    """A proxy process running the code of ``checkout`` (another tree's, for a before/after run)."""
    if checkout != ROOT:
        env = {**(env if env is not None else os.environ), "PYTHONPATH": str(checkout)}
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
        cwd=checkout,
        env=env,
    )
    assert proc.stderr is not None
    said: list[str] = []
    while " on http" not in (line := proc.stderr.readline()):  # "rollout-capture proxy on http://..."
        if not line:  # it exited before serving
            proc.wait(30)
            raise RuntimeError(f"proxy did not start: {''.join(said).strip()}")
        said.append(line)  # a warning before the line that says where it serves
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


ANSWER_BYTES = (200, 4000)
"""An agent's answers: from 200 B to 4 kB of content (``scripted-size-<n>``)."""


def answer_size(rollout: int, call: int) -> int:
    """A call's answer size in the agent shape, the same in every run and for every proxy."""
    return random.Random(rollout * 131 + call).randint(*ANSWER_BYTES)


def rollout_path(prefix: str, rollout: int) -> str:
    """The chat path of rollout number ``rollout``: ``prefix`` formatted with ``n`` (the number),
    ``task`` and ``index`` (``n // 4`` and ``n % 4``, a task's four rollouts)."""
    return f"{prefix.format(n=rollout, task=rollout // 4, index=rollout % 4)}/v1/chat/completions"


async def load(
    url: str,
    prefix: str,
    calls: int,
    concurrency: int,
    while_open: Callable[[], Any] | None = None,
    per_rollout: int = 1,
    agent: bool = False,
) -> dict[str, Any]:
    """``calls`` calls over ``concurrency`` keep-alive connections, ``per_rollout`` consecutive
    calls to each rollout id; ``while_open`` is called (its result kept as ``spread``) once
    they are done but before the connections close.

    ``agent``: the agent shape instead: each connection takes the next rollout and sends its
    ``per_rollout`` calls one after another (an agent's turns), each request carrying the answers
    before it, each answer :func:`answer_size` characters, half of them streamed."""
    host = url.removeprefix("http://")
    plain = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}).encode()
    stream = json.dumps(
        {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    latencies: list[float] = []
    firsts: list[float] = []
    counter = iter(range(calls))

    async def call(conn: Connection, path: str, body: bytes, streaming: bool) -> None:
        first, total = await conn.post(path, host, body)
        latencies.append(total)
        if streaming:
            firsts.append(first)

    async def worker() -> Connection:
        conn = await Connection.open(url)
        LOADGEN_PORTS.add(conn.writer.get_extra_info("sockname")[1])
        for n in counter:
            streaming = n % 2 == 1
            await call(
                conn, rollout_path(prefix, n // per_rollout), stream if streaming else plain, streaming
            )
        return conn

    async def agent_worker() -> Connection:
        conn = await Connection.open(url)
        LOADGEN_PORTS.add(conn.writer.get_extra_info("sockname")[1])
        for rollout in rollouts:
            history: list[dict[str, str]] = [{"role": "user", "content": f"task {rollout}: plan it"}]
            for turn in range(per_rollout):
                size = answer_size(rollout, turn)
                streaming = (rollout + turn) % 2 == 1
                body = {"model": f"scripted-size-{size}", "messages": history, "stream": streaming}
                await call(conn, rollout_path(prefix, rollout), json.dumps(body).encode(), streaming)
                history = [
                    *history,
                    {"role": "assistant", "content": "x" * size},
                    {"role": "user", "content": f"tool result {turn}"},
                ]
        return conn

    rollouts = iter(range(calls // per_rollout))

    started = time.perf_counter()
    conns = await asyncio.gather(*((agent_worker if agent else worker)() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    spread = while_open() if while_open is not None else None
    for conn in conns:
        conn.writer.close()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    fq = statistics.quantiles(firsts, n=100, method="inclusive")
    out: dict[str, Any] = {
        "calls": len(latencies),
        "seconds": round(elapsed, 3),
        "calls_per_s": round(len(latencies) / elapsed, 1),
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


# ---------------------------------------------------------------- --store s3: layouts side by side

STORE_BUCKET = "bench-captures"
LOAD_TIMEOUT_S = 300.0  # one measured load through one proxy, at most


class Target:
    """One proxy under test: where it serves, where it writes, how to read it back, its store's counter."""

    def __init__(
        self,
        proc: subprocess.Popen[str],
        url: str,
        capture_url: str,
        read_options: dict[str, Any],
        counter: Any = None,
    ) -> None:
        self.proc, self.url, self.capture_url = proc, url, capture_url
        self.read_options = read_options
        self.counter = counter  # store_bench.CountingProxy in front of moto, or None on a local disk
        self.error: str | None = None
        self.census: set[str] = set()  # journal commits counted already (store_bench.journal_census)
        self.said: collections.deque[str] = collections.deque(maxlen=20)
        # Keep reading the proxy's log: a full pipe would stall it mid-benchmark.
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.said.append(line.rstrip())

    def last_words(self) -> str:
        return " | ".join(self.said)


def measured_store(
    target: Target,
    prefix: str,
    calls: int,
    concurrency: int,
    pids: dict[str, int | None],
    rollout_ids: list[str],
    settle_s: float,
    per_rollout: int = 1,
    agent: bool = False,
) -> dict[str, Any]:
    """One load through one proxy: latency and first chunk, its CPU per call counted until
    its store went quiet (writes after the last byte included), the store requests of these
    calls alone (and the store's answers by status: 412, a create that found its object, 404),
    what a reader then finds in the store for them, and the journal commits they left."""
    from benchmarks.store_bench import journal_census, read_back

    out: dict[str, Any] = {}
    trips: list[float] = []
    if target.counter is not None:
        trips += target.counter.round_trips_ms(STORE_BUCKET)
        target.counter.reset()  # warmup and earlier loads left out
        target.counter.answers()
        journal_census(target.capture_url, target.read_options, target.census, 1)  # theirs too
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    running = load(target.url, prefix, calls, concurrency, per_rollout=per_rollout, agent=agent)
    out.update(asyncio.run(asyncio.wait_for(running, LOAD_TIMEOUT_S)))  # a stuck layout is an error
    if target.counter is not None:
        out["settle_s"] = target.counter.wait_quiet(settle_s)
    else:
        time.sleep(settle_s)
        out["settle_s"] = settle_s
    out["cpu_ms_per_call"] = {
        name: round((cpu_seconds(pid) - before[name]) * 1000 / calls, 3) for name, pid in pids.items()
    }
    if target.counter is not None:
        counts = target.counter.reset()
        statuses = target.counter.answers()["statuses"]  # before the round trips' HEADs (404s)
        trips += target.counter.round_trips_ms(STORE_BUCKET)  # the median of before and after the load
        out["store_round_trip_ms"] = round(statistics.median(trips), 2)
        out["store_requests"] = counts
        out["store_requests_per_call"] = {
            "total": round(sum(counts.values()) / calls, 3),
            **{kind: round(n / calls, 3) for kind, n in sorted(counts.items())},
        }
        out["store_statuses"] = statuses
    out["read_back"] = read_back(target.capture_url, target.read_options, rollout_ids, calls)
    if target.counter is not None:
        out["journal"] = journal_census(target.capture_url, target.read_options, target.census, calls)
    out.update(recorded(target.capture_url, target.read_options, rollout_ids))
    return out


RECORDED_KEYS = (
    "recorded_ttft_p50_ms",
    "recorded_latency_p50_ms",
    "capture_hold_p50_ms",
    "capture_hold_p99_ms",
)


def recorded(url: str, storage_options: dict[str, Any], rollout_ids: list[str]) -> dict[str, float]:
    """What the rows say: TTFT and latency p50 (the upstream's own: its --delay-ms, then the stream
    sent at once) and the hold for the claim apart (``capture_hold_ms``), p50/p99; a figure no row
    gave is left out."""
    from rollout_capture import CaptureStore

    fetched = CaptureStore(url, storage_options=dict(storage_options)).prefetch(rollout_ids)
    columns: dict[str, list[float]] = {"latency_ttft_ms": [], "latency_ms": [], "capture_hold_ms": []}
    for rollout_id in rollout_ids:
        for _, row in fetched.snapshot(rollout_id).rows:
            for key, values in columns.items():
                if isinstance(row.get(key), int | float):
                    values.append(float(row[key]))

    def nearest_rank(values: list[float], share: float) -> float:
        ordered = sorted(values)
        return round(ordered[max(0, math.ceil(share * len(ordered)) - 1)], 2)

    out: dict[str, float] = {}
    for key, name, share in (
        ("latency_ttft_ms", "recorded_ttft_p50_ms", 0.5),
        ("latency_ms", "recorded_latency_p50_ms", 0.5),
        ("capture_hold_ms", "capture_hold_p50_ms", 0.5),
        ("capture_hold_ms", "capture_hold_p99_ms", 0.99),
    ):
        if columns[key]:
            out[name] = nearest_rank(columns[key], share)
    return out


def compare_store(
    upstream: tuple[str, int],
    targets: dict[str, Target],
    other_pids: dict[str, int | None],
    calls: int,
    concurrency: int,
    tag: str,
    shift: int,
    per_rollout: int,
    settle_s: float,
    agent: bool = False,
) -> dict[str, Any]:
    """Direct and through each live proxy, same load (direct: the plain shape), the order
    rotated by ``shift``."""
    upstream_url, upstream_pid = upstream
    port = int(upstream_url.rsplit(":", 1)[1])
    direct_pids: dict[str, int | None] = {"upstream": upstream_pid, "loadgen": None}
    names = ["direct", *(name for name, t in targets.items() if t.error is None)]
    shift %= len(names)
    runs: dict[str, dict[str, Any]] = {}
    for name in names[shift:] + names[:shift]:
        if name == "direct":
            runs[name] = measured(upstream_url, "", calls, concurrency, direct_pids, port)
            continue
        target = targets[name]
        pids: dict[str, int | None] = {"proxy": target.proc.pid, **direct_pids, **other_pids}
        if target.counter is not None:
            pids["store_proxy"] = target.counter.proc.pid
        label = name.replace(":", ".").replace("/", ".").replace("@", "w")  # a valid rollout id
        try:
            runs[name] = measured_store(
                target,
                f"/ng-rollout/{tag}{label}-" + "{n}-0",
                calls,
                concurrency,
                pids,
                sorted({f"{tag}{label}-{n // per_rollout}-0" for n in range(calls)}),
                settle_s,
                per_rollout,
                agent,
            )
        except Exception as exc:  # a layout that breaks mid-run is a result; the others go on
            target.error = f"{type(exc).__name__}: {exc}; proxy said: {target.last_words()}"
            runs[name] = {"error": target.error}
    direct = runs["direct"]
    added: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        if name == "direct" or "error" in run:
            continue
        figures: dict[str, Any] = {
            key: round(float(run[measured_key]) - float(direct[measured_key]), 2)
            for key, measured_key in ADDED.items()
        }
        figures["throughput_ratio"] = round(float(run["calls_per_s"]) / float(direct["calls_per_s"]), 3)
        figures["proxy_cpu_ms_per_call"] = run["cpu_ms_per_call"]["proxy"]
        if "store_requests_per_call" in run:
            figures["store_requests_per_call"] = run["store_requests_per_call"]
            figures["store_round_trip_ms"] = run["store_round_trip_ms"]
            figures["store_statuses"] = run["store_statuses"]
            figures["journal"] = run["journal"]
        figures["read_back"] = run["read_back"]
        figures.update({key: run[key] for key in RECORDED_KEYS if key in run})
        added[name] = figures
    return {
        "calls": calls,
        "concurrency": concurrency,
        "direct": direct,
        "proxied": {name: run for name, run in runs.items() if name != "direct"},
        "added": added,
    }


STORE_SUMMARY_KEYS = (*SUMMARY_KEYS, "store_round_trip_ms", *RECORDED_KEYS)


def store_summary(comparisons: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """[min, median, max] over the rounds of each figure, per proxy; row checks summed."""
    out: dict[str, Any] = {}
    for name in names:
        measured_rounds = [c["added"][name] for c in comparisons if name in c["added"]]
        if not measured_rounds:
            continue
        figures: dict[str, Any] = {
            key: spread([float(r[key]) for r in measured_rounds])
            for key in STORE_SUMMARY_KEYS
            if all(key in r for r in measured_rounds)
        }
        if all("store_requests_per_call" in r for r in measured_rounds):
            kinds = sorted({k for r in measured_rounds for k in r["store_requests_per_call"]})
            figures["store_requests_per_call"] = {
                kind: spread([float(r["store_requests_per_call"].get(kind, 0)) for r in measured_rounds])
                for kind in kinds
            }
        backs = [r["read_back"] for r in measured_rounds]
        if any("error" in b for b in backs):
            figures["read_back"] = {"error": next(b["error"] for b in backs if "error" in b)}
        else:
            figures["read_back"] = {
                key: sum(int(b[key]) for b in backs)
                for key in ("calls", "rows", "missing", "duplicated", "damaged", "claims_left")
            }
            figures["read_back"]["complete"] = all(b["complete"] for b in backs)
        figures["rounds_measured"] = len(measured_rounds)
        out[name] = figures
    directs = [c["direct"] for c in comparisons]
    out["direct_calls_per_s"] = spread([d["calls_per_s"] for d in directs])
    out["direct_p50_ms"] = spread([d["p50_ms"] for d in directs])
    out["direct_first_chunk_p50_ms"] = spread([d["first_chunk_p50_ms"] for d in directs])
    return out


def _range(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:g}" if low == high else f"{low:g} .. {high:g}"


def _last_words(text: str, width: int = 110) -> str:
    """An error on one line, its end kept (typer's and tracebacks' point is last)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else "..." + flat[-width:]


def targets_table(
    summaries: dict[int, dict[str, Any]], names: list[str], errors: dict[str, str], light: int, heavy: int
) -> list[tuple[str, str, str]]:
    """(issue 20's target, proxy, measured over the rounds as min .. max) rows."""
    rows: list[tuple[str, str, str]] = [
        ("proxy ran the whole benchmark", name, "error: " + _last_words(text))
        for name, text in errors.items()
    ]

    def figure(concurrency: int, name: str, key: str) -> list[float] | None:
        found = summaries.get(concurrency, {}).get(name, {}).get(key)
        return None if found is None else [found[0], found[2]]

    def each(target: str, concurrency: int, key: str, which: list[str], unit: str = " ms") -> None:
        for name in which:
            values = figure(concurrency, name, key)
            if values is None and name in errors:
                continue  # its error is the first row
            rows.append((target, name, "not measured" if values is None else _range(values) + unit))

    s3 = [n for n in names if n.startswith(("s3_", "base_s3_"))]
    disk = [n for n in names if n.startswith(("disk_", "base_disk_"))]
    each(f"first chunk added p50 <= 5 ms @{light}", light, "added_first_chunk_p50_ms", s3 + disk)
    each(f"first chunk added p99 (no target) @{light}", light, "added_first_chunk_p99_ms", s3 + disk)
    each(f"first chunk added p50 (no target) @{heavy}", heavy, "added_first_chunk_p50_ms", s3 + disk)
    for name in s3:
        per_call = summaries.get(heavy, {}).get(name, {}).get("store_requests_per_call", {})
        total = per_call.get("total")
        if total is None and name in errors:
            continue
        kinds = ", ".join(f"{k} {_range([v[0], v[2]])}" for k, v in per_call.items() if k != "total")
        measured_text = "not measured" if total is None else f"{_range([total[0], total[2]])} ({kinds})"
        rows.append((f"store requests/call <= 0.5 @{heavy}", name, measured_text))
    for name in s3 + disk:
        backs = [summaries[c][name]["read_back"] for c in summaries if name in summaries[c]]
        if not backs:
            continue
        if any("error" in b for b in backs):
            text = f"read error: {next(b['error'] for b in backs if 'error' in b)[:60]}"
        else:
            calls, rows_found = sum(b["calls"] for b in backs), sum(b["rows"] for b in backs)
            missing, doubled = sum(b["missing"] for b in backs), sum(b["duplicated"] for b in backs)
            left = sum(b["claims_left"] for b in backs)
            ok = "yes" if all(b["complete"] for b in backs) else "NO"
            text = (
                f"{ok}: {rows_found} rows / {calls} calls, {missing} missing, {doubled} doubled, "
                f"{left} claims left"
            )
        rows.append(("rows complete, none duplicated", name, text))
    for concurrency in (light, heavy):
        for name in s3:
            latency = figure(concurrency, name, "added_latency_p50_ms")
            trip = figure(concurrency, name, "store_round_trip_ms")
            if latency is None or trip is None:
                continue
            bound = [round(trip[0] + 10, 1), round(trip[1] + 10, 1)]
            rows.append(
                (
                    f"last byte added p50 <= RTT + 10 ms @{concurrency}",
                    name,
                    f"{_range(latency)} ms (RTT + 10 = {_range(bound)} ms)",
                )
            )
    each(f"last byte added p99 (no target) @{heavy}", heavy, "added_latency_p99_ms", s3)
    for concurrency in (light, heavy):  # issue 27: the rows say the upstream's time, the hold apart
        each(
            f"recorded TTFT p50 (upstream's own) @{concurrency}",
            concurrency,
            "recorded_ttft_p50_ms",
            s3 + disk,
        )
        each(f"capture hold p50 @{concurrency}", concurrency, "capture_hold_p50_ms", s3)
        each(f"capture hold p99 @{concurrency}", concurrency, "capture_hold_p99_ms", s3)
    each(f"CPU/call on S3 <= 2 ms @{heavy}", heavy, "proxy_cpu_ms_per_call", s3)
    each(f"CPU/call on S3 <= 2 ms @{light}", light, "proxy_cpu_ms_per_call", s3)
    each(f"CPU/call on local disk <= 0.6 ms @{heavy}", heavy, "proxy_cpu_ms_per_call", disk)
    each(f"CPU/call on local disk <= 0.6 ms @{light}", light, "proxy_cpu_ms_per_call", disk)
    each(f"throughput / direct (no target) @{heavy}", heavy, "throughput_ratio", s3 + disk, unit="")
    rows.append(("lost acks / concurrency / crash tests hold", "(all)", "not measured here: the test suite"))
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in [("target", "proxy", "measured"), *rows]) for i in range(2)]
    lines = [f"{'target':<{widths[0]}}  {'proxy':<{widths[1]}}  measured (min .. max over rounds)"]
    lines += [f"{t:<{widths[0]}}  {p:<{widths[1]}}  {m}" for t, p, m in rows]
    return "\n".join(lines)


def layout_spec(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """``journal:1`` -> the journal layout with one commit in flight per stream (main's before
    pipelining), as the environment tells the proxy; a plain name -> that layout as it comes;
    ``@N`` after either: the proxy's ``--workers N``. Also the proxy's flags."""
    spec, _, workers = spec.partition("@")
    flags: list[str] = []
    if workers:
        if not workers.isdigit() or not 1 <= int(workers) <= 64:
            raise SystemExit(f"--layouts: {spec}@{workers}: @N takes worker processes, 1 to 64")
        flags = ["--workers", workers]
    layout, _, in_flight = spec.partition(":")
    if not in_flight:
        return layout, {}, flags
    parts = in_flight.split("/")
    if layout != "journal" or len(parts) > 2 or not all(p.isdigit() and 1 <= int(p) <= 64 for p in parts):
        raise SystemExit(
            f"--layouts: {spec!r}: only journal:N or journal:ROWS/CLAIMS (commits in flight, 1-4) "
            "takes numbers"
        )
    return layout, {"ROLLOUT_CAPTURE_JOURNAL_IN_FLIGHT": in_flight}, flags


def store_main(args: argparse.Namespace) -> None:
    """``--store s3``: each layout's proxy writing to moto behind a counting, slowed proxy, beside
    the local-disk layouts, direct calls and each other, in interleaved rounds at two loads."""
    from benchmarks.store_bench import DUMMY_CREDENTIALS, CountingProxy, Moto

    if args.store != "s3":
        raise SystemExit(f"--store: only s3 is supported (moto), got {args.store!r}")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    disk_layouts = [x.strip() for x in args.disk_layouts.split(",") if x.strip()]
    os.environ.update(DUMMY_CREDENTIALS)  # the read-back's client, and the proxies' below
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-", dir=args.capture_root))
    extra = ["--http", args.http, "--loop", args.loop]
    moto = Moto()
    started: list[Any] = []
    targets: dict[str, Target] = {}
    errors: dict[str, str] = {}
    upstream = None
    try:
        moto.make_bucket(STORE_BUCKET)
        upstream, upstream_url = start_upstream(args.delay_ms / 1000, args.http, args.loop)
        checkouts = [("", ROOT)] + (
            [("base_", baseline_checkout(args.baseline, work))] if args.baseline else []
        )
        for (tag, checkout), spec in [(c, s) for s in layouts for c in checkouts]:
            name = tag + "s3_" + spec
            layout, in_flight, workers = layout_spec(spec)
            counter = CountingProxy(moto.port, args.store_latency_ms)
            started.append(counter)
            options = {"client_kwargs": {"endpoint_url": counter.endpoint}}
            folder = tag + ("".join(c if c.isalnum() else "-" for c in spec.lower()) or "layout")
            capture_url = f"s3://{STORE_BUCKET}/{folder}"
            env = {
                **os.environ,
                **DUMMY_CREDENTIALS,
                "ROLLOUT_CAPTURE_STORAGE_OPTIONS": json.dumps(options),
                "ROLLOUT_CAPTURE_LAYOUT": layout,
                **in_flight,
            }
            flags = [*extra, *workers, "--layout", layout, "--storage-options", json.dumps(options)]
            try:
                proc, url = start_proxy(upstream_url, capture_url, flags, env=env, checkout=checkout)
            except RuntimeError as exc:
                errors[name] = str(exc)
                continue
            started.append(proc)
            read_options = {"client_kwargs": {"endpoint_url": moto.endpoint}}  # uncounted, unslowed
            targets[name] = Target(proc, url, capture_url, read_options, counter)
        for (tag, checkout), spec in [(c, d) for d in disk_layouts for c in checkouts]:
            # jsonl+files: claim files, jsonl+log: the claims log; journal:N: N commits in flight.
            # The name is in rollout ids: no "+" nor ":".
            name = tag + "disk_" + "".join(c if c.isalnum() else "-" for c in spec)
            capture_dir = str(work / name)
            base, _, claims = spec.partition("+")
            layout, in_flight, workers = layout_spec(base)
            env = {**os.environ, "ROLLOUT_CAPTURE_LAYOUT": layout, **in_flight}
            flags = [*extra, *workers, "--layout", layout]
            if claims:
                env["ROLLOUT_CAPTURE_CLAIMS"] = claims
                flags += ["--claims", claims]
            try:
                proc, url = start_proxy(upstream_url, capture_dir, flags, env=env, checkout=checkout)
            except RuntimeError as exc:
                errors[name] = str(exc)
                continue
            started.append(proc)
            targets[name] = Target(proc, url, capture_dir, {})
        names = list(targets)
        ends = (upstream_url, upstream.pid)
        other_pids: dict[str, int | None] = {"moto": moto.proc.pid}
        asyncio.run(load(upstream_url, "", args.warmup, args.concurrency))
        for target in targets.values():
            try:
                warming = load(target.url, "/ng-rollout/warm-{n}", args.warmup, args.concurrency)
                asyncio.run(asyncio.wait_for(warming, LOAD_TIMEOUT_S))
            except Exception as exc:
                target.error = f"warmup: {type(exc).__name__}: {exc}; proxy said: {target.last_words()}"
        loads = [(args.concurrency, args.calls, "r"), (args.light_concurrency, args.light_calls, "l")]
        comparisons: dict[int, list[dict[str, Any]]] = {c: [] for c, _, _ in loads}
        per = args.calls_per_rollout
        for i in range(args.rounds):
            for concurrency, calls, letter in loads:
                comparisons[concurrency].append(
                    compare_store(
                        ends,
                        targets,
                        other_pids,
                        calls,
                        concurrency,
                        f"{letter}{i}-",
                        i,
                        per,
                        args.settle_s,
                        args.shape == "agent",
                    )
                )
        errors.update({name: t.error for name, t in targets.items() if t.error is not None})
    finally:
        for item in reversed(started):
            if isinstance(item, subprocess.Popen):
                item.terminate()
                try:
                    item.wait(60)
                except subprocess.TimeoutExpired:
                    item.kill()
            else:
                item.close()
        if upstream is not None:
            upstream.terminate()
            upstream.wait(60)
        moto.close()
        shutil.rmtree(work, ignore_errors=True)

    summaries = {c: store_summary(rounds, names) for c, rounds in comparisons.items()}
    rows = targets_table(
        summaries, names + sorted(set(errors) - set(names)), errors, args.light_concurrency, args.concurrency
    )
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "note": "shared with other workloads; figures as measured",
        },
        "setup": {
            "store": "moto server (own process) behind tests/support/fault_proxy.py FaultProxy (own process)",
            "store_added_latency_ms": args.store_latency_ms,
            "upstream_delay_ms": args.delay_ms,
            "streaming_share": 0.5,
            "server": {"http": args.http, "loop": args.loop},
            "calls_per_round": {str(c): n for c, n, _ in loads},
            "rounds": args.rounds,
            "warmup_calls_each": args.warmup,
            "calls_per_rollout": per,
            "shape": args.shape,
            "capture_filesystem": filesystem_of(work),
            "proxies": {
                name: {"capture_dir": t.capture_url, "layout": name.split("_", 1)[1]}
                for name, t in targets.items()
            },
            "cpu": "proxy CPU from /proc, parent + workers, from the load's start until its store went quiet",
            "store_requests": "counted on the wire over the measured calls only (warmup excluded), "
            "until no request crossed for --settle-s",
        },
        "errors": {name: {"error": text} for name, text in errors.items()},
        # What each proxy logged (warnings: e.g. writes moved off its event loop by a slow moment).
        "proxy_said": {name: list(t.said) for name, t in targets.items() if t.said},
        "summary_min_median_max": {str(c): s for c, s in summaries.items()},
        "targets": [{"target": t, "proxy": p, "measured": m} for t, p, m in rows],
        "rounds": {str(c): rounds for c, rounds in comparisons.items()},
    }
    print(json.dumps(report, indent=2))
    print(format_table(rows), file=sys.stderr)


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
        "--shape",
        choices=("calls", "agent"),
        default="calls",
        help="with --store: calls (each client sends the next call, --calls-per-rollout in a row to one "
        "rollout) or agent (each client takes the next rollout and sends its --calls-per-rollout calls "
        "one after another, the request growing, answers of 200 B to 4 kB; half streamed either way)",
    )
    parser.add_argument(
        "--capture-root",
        default=None,
        help="where the capture dirs go (default: the system temp dir); e.g. /dev/shm to leave the disk out",
    )
    parser.add_argument(
        "--store",
        default=None,
        help="s3: instead, proxies of each --layouts writing to s3:// on moto behind a counting proxy, "
        "beside --disk-layouts on local disk (issue 20's targets)",
    )
    parser.add_argument(
        "--layouts",
        default="objects",
        help="with --store: object-store layouts, comma-separated; journal:N keeps N commits in flight "
        "per stream, journal:ROWS/CLAIMS each stream's (journal:1 is the journal before pipelining); "
        "@N after a layout: the proxy serves with --workers N (journal@2)",
    )
    parser.add_argument(
        "--disk-layouts",
        default="jsonl",
        help="with --store: local-disk layouts measured beside them ('' for none); layout+files or "
        "layout+log (jsonl+files, jsonl+log) picks how claims are written",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="with --store: the code before, a directory (a checkout) or a git ref of this repository "
        "(e.g. main, a commit: unpacked from git archive), whose proxy runs each --layouts and "
        "--disk-layouts too, named base_s3_* and base_disk_*: before and after in one run",
    )
    parser.add_argument(
        "--store-latency-ms", type=float, default=20.0, help="with --store: added per store request"
    )
    parser.add_argument(
        "--light-calls", type=int, default=None, help="with --store: calls at --light-concurrency"
    )
    parser.add_argument(
        "--settle-s", type=float, default=0.3, help="with --store: quiet store time that ends a measured load"
    )
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.delay_ms / 1000, args.http, args.loop)
        return
    if args.store is not None:
        if args.light_calls is None:
            args.light_calls = max(8, args.calls // 4)
        store_main(args)
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
