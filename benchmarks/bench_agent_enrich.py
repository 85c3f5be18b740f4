"""An agent-shaped run written to S3 through the proxy, then enriched: issue 48's table.

    python benchmarks/bench_agent_enrich.py [--rollouts 2000] [--baseline REF] [--store-latency-ms 20]
                                            [--delay-ms 20] [--rounds 1] [--clients]

The write: 32 clients, each taking the next rollout and sending its 5 calls one after another
(an agent's turns, the request growing with the answers before it), answers of 200 B to 4 kB
(``scripted-size-<n>``), half streamed, through one ``rollout-capture proxy`` to ``s3://`` on
moto (its own process) behind a counting proxy adding ``--store-latency-ms`` to every request
(benchmarks/store_bench.py), in the producers' default layout there (the journal); the same load
through a second proxy to a local disk (its default, JSONL).

Then ``rollout-capture enrich`` (threads, its defaults) in a fresh process each, against a running
``prefect server``: over the local disk's captures, over the S3 objects mirrored to a local folder,
and over S3 itself, counting the store's requests by kind and status and the bytes it sent; each
process's own CPU (user + system, its threads included) and peak RSS. ``--baseline REF`` (a git
ref, or a checkout's directory) runs the code before beside this tree's, interleaved in each round.
The floor: plain HTTP GETs (URLs presigned beforehand) of the same objects through the same
counting proxy at 32 in flight, in this process. ``--clients`` also reads every object with each
client measured for issue 48 (s3fs as this tree's backend reads, obstore, aiohttp signing with
botocore's SigV4, the plain GETs): time and CPU a request in this process.

Then the same objects served by ``rclone serve s3`` (a Go server that keeps its connections open,
as S3 does; moto closes each) behind the same counting proxy and latency: enriched there, and the
floor's plain GETs there (its CPU against the round's mirror).

Last, the S3 run compacted (``rollout-capture compact``, as a run long over) and enriched on S3
again: the objects a run before and after, the compaction's requests, and that enrichment's time
against the round's local disk (issue 48: within 1.5x); then the same compacted objects served by
``rclone serve s3`` behind the same counting proxy, enriched again (moto's ranged GETs of a large
part copy its whole value each: there the server's bandwidth sets the time).

Every output must be byte-identical to the mirror's (S3) or to the baseline's (same captures).
JSON on stdout, a table on stderr; the machine's load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_cli import base_env, cli, prefect_server  # noqa: E402
from benchmarks.bench_proxy import baseline_checkout, load, start_proxy, start_upstream  # noqa: E402
from benchmarks.corpus import source_corpus  # noqa: E402
from benchmarks.store_bench import DUMMY_CREDENTIALS, CountingProxy, Moto  # noqa: E402
from tests.support.stores import stop_process  # noqa: E402

BUCKET = "bench-agent"
PREFIX = "run/captures"
CALLS_PER_ROLLOUT = 5
CLIENTS = 32


async def agent_load(url: str, rollouts: int, clients: int = CLIENTS) -> dict[str, Any]:
    """``rollouts`` agent rollouts of :data:`CALLS_PER_ROLLOUT` calls over ``clients`` keep-alive
    connections (bench_proxy's agent shape), named ``<task>-<index>`` as the rollouts file names them."""
    calls = rollouts * CALLS_PER_ROLLOUT
    done = await load(
        url, "/ng-rollout/{task}-{index}", calls, clients, per_rollout=CALLS_PER_ROLLOUT, agent=True
    )
    return {key: done[key] for key in ("calls", "seconds", "calls_per_s")}


def rollouts_file(path: Path, rollouts: int) -> None:
    """The run's rollout records: corpus records named ``<task>-<rollout>`` as the load named them."""
    import orjson

    from examples.samples import corpus_records

    records = corpus_records(source_corpus())
    with path.open("wb") as out:
        for index in range(rollouts):
            record = dict(records[index % len(records)])
            record["_ng_task_index"], record["_ng_rollout_index"] = index // 4, index % 4
            out.write(orjson.dumps(record) + b"\n")


def stop(proc: subprocess.Popen[str]) -> None:
    stop_process(proc, grace_s=60)


def write_run(upstream: str, capture_dir: str, rollouts: int, env: dict[str, str]) -> dict[str, Any]:
    """The agent load through one proxy writing to ``capture_dir``; the proxy stopped after."""
    proc, url = start_proxy(upstream, capture_dir, [], env=env)
    try:
        return asyncio.run(agent_load(url, rollouts))
    finally:
        stop(proc)


def mirror(endpoint: str, local: Path) -> tuple[list[str], int]:
    """Every object under the run's prefix copied to ``local`` (straight from moto, uncounted):
    the keys and the bytes stored."""
    fs = s3_fs(endpoint)
    found = fs.find(f"{BUCKET}/{PREFIX}", detail=True)
    keys = sorted(found)
    fs.get(keys, [str(local / key.removeprefix(f"{BUCKET}/{PREFIX}/")) for key in keys])
    return keys, sum(int(found[key]["size"]) for key in keys)


def enrich(
    checkout: Path,
    rollouts: Path,
    capture_dir: str,
    output: Path,
    env: dict[str, str],
) -> dict[str, Any]:
    """One ``rollout-capture enrich`` in a fresh process of ``checkout``'s code: wall time, its own
    CPU and peak RSS (from ``wait4``), and the sha256 of what it wrote."""
    if checkout != ROOT:
        env = {**env, "PYTHONPATH": str(checkout)}
    command = [
        *([sys.executable, "-m", "rollout_capture.cli"] if checkout != ROOT else cli()),
        "enrich",
        str(rollouts),
        "--capture-dir",
        capture_dir,
        "--output",
        str(output),
        "--json",
    ]
    log = output.with_suffix(".log")
    started = time.perf_counter()
    with log.open("wb") as err:
        proc = subprocess.Popen(command, env=env, cwd=checkout, stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        said = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(
            f"enrich of {capture_dir} exited {proc.returncode}; see {log}:\n{said.decode()[-2000:]}"
        )
    digest = hashlib.sha256(output.read_bytes()).hexdigest()
    output.unlink()
    return {
        "seconds": round(elapsed, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "sha256": digest[:16],
    }


def presigned(endpoint: str, keys: list[str]) -> list[str]:
    """A GET URL for each key, signed beforehand (the floor pays no signing)."""
    import boto3
    from botocore.config import Config

    signed = Config(signature_version="s3v4")  # rclone serve s3 refuses SigV2's query form
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=signed, **_boto_keys())
    return [
        client.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": key.split("/", 1)[1]}, ExpiresIn=7200
        )
        for key in keys
    ]


def _boto_keys() -> dict[str, str]:
    return {
        "aws_access_key_id": DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }


async def plain_gets(port: int, targets: list[str], in_flight: int = CLIENTS) -> int:
    """Every target GET over ``in_flight`` keep-alive HTTP/1.1 connections, as little client
    work as a GET can take; the bytes of the bodies."""
    queue = list(reversed(targets))
    received = 0

    async def worker() -> None:
        nonlocal received
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while queue:
                target = queue.pop()
                writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                head = (await reader.readuntil(b"\r\n\r\n")).lower()
                if not head.startswith(b"http/1.1 200"):
                    raise RuntimeError(f"GET {target}: {head[:40]!r}")
                body = await reader.readexactly(
                    int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                )
                received += len(body)
                if b"connection: close" in head:
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return received


def floor_reader(counter: CountingProxy, keys: list[str]) -> Callable[[], int]:
    """The floor's read: plain GETs of ``keys`` through ``counter``, their URLs signed now."""
    targets = [url.removeprefix(counter.endpoint) for url in presigned(counter.endpoint, keys)]
    return lambda: asyncio.run(plain_gets(counter.port, targets))


def cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured_read(
    counter: CountingProxy, read: Callable[[], int], stored: int, objects: int
) -> dict[str, Any]:
    """Time, CPU of this process and the store's requests of one read of every object."""
    counter.reset()
    counter.answers()
    cpu, started = cpu_now(), time.perf_counter()
    received = read()
    elapsed, cpu = time.perf_counter() - started, cpu_now() - cpu
    if received != stored:
        raise SystemExit(f"read {received} bytes of {stored}")
    return {
        "seconds": round(elapsed, 2),
        "cpu_s": round(cpu, 2),
        "cpu_ms_per_request": round(cpu * 1000 / objects, 3),
        "requests": counter.reset(),
    }


def clients(counter: CountingProxy, keys: list[str], stored: int) -> dict[str, Any]:
    """Every object read by each client, 32 in flight, in this process."""
    endpoint = counter.endpoint
    n = len(keys)

    def s3fs_backend() -> int:
        from fsspec.asyn import sync

        fs = s3_fs(endpoint)

        async def all_of() -> int:
            gate = asyncio.Semaphore(CLIENTS)

            async def one(key: str) -> int:
                async with gate:
                    return len(await fs._cat_file(key, max_concurrency=1))

            return sum(await asyncio.gather(*(one(k) for k in keys)))

        total: int = sync(fs.loop, all_of)
        return total

    def obstore_gets() -> int:
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            endpoint=endpoint,
            region="us-east-1",
            client_options={"allow_http": True},
            **{k.removeprefix("aws_"): v for k, v in _boto_keys().items()},
        )

        async def all_of() -> int:
            gate = asyncio.Semaphore(CLIENTS)

            async def one(key: str) -> int:
                async with gate:
                    got = await obstore.get_async(store, key.split("/", 1)[1])
                    return len(bytes(await got.bytes_async()))

            return sum(await asyncio.gather(*(one(k) for k in keys)))

        return asyncio.run(all_of())

    def aiohttp_sigv4() -> int:
        import aiohttp
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        signer = S3SigV4Auth(
            Credentials(DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"], DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]),
            "s3",
            "us-east-1",
        )

        async def all_of() -> int:
            gate = asyncio.Semaphore(CLIENTS)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS)) as session:

                async def one(key: str) -> int:
                    url = f"{endpoint}/{key}"
                    request = AWSRequest(method="GET", url=url, headers={})
                    signer.add_auth(request)
                    async with gate, session.get(url, headers=dict(request.headers.items())) as answer:
                        return len(await answer.read())

                return sum(await asyncio.gather(*(one(k) for k in keys)))

        return asyncio.run(all_of())

    runs: dict[str, Callable[[], int]] = {
        "s3fs": s3fs_backend,
        "obstore": obstore_gets,
        "aiohttp_botocore_sigv4": aiohttp_sigv4,
        "plain_gets": floor_reader(counter, keys),
    }
    out: dict[str, Any] = {}
    for name, run in runs.items():
        try:
            out[name] = measured_read(counter, run, stored, n)
        except ImportError as exc:
            out[name] = {"error": str(exc)}
    return out


def ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=2000, help="agent rollouts of 5 calls each")
    parser.add_argument("--store-latency-ms", type=float, default=20.0, help="added to every store request")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="the upstream's, before each answer")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", help="a git ref or a checkout's directory: the code before, beside")
    parser.add_argument("--clients", action="store_true", help="also read every object with each client")
    parser.add_argument("--work", help="keep the run here (default: a temporary folder, removed)")
    args = parser.parse_args()

    load_before = os.getloadavg()
    os.environ.update(DUMMY_CREDENTIALS)  # moto's; a developer's own keys never reach it
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-agent-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **DUMMY_CREDENTIALS}
    moto = Moto()
    counter = None
    upstream = None
    report: dict[str, Any] = {"rollouts": args.rollouts, "store_added_latency_ms": args.store_latency_ms}
    try:
        moto.make_bucket(BUCKET)
        counter = CountingProxy(moto.port, args.store_latency_ms)
        env["AWS_ENDPOINT_URL"] = counter.endpoint
        upstream, upstream_url = start_upstream(args.delay_ms / 1000, "auto", "auto")
        checkouts = {"": ROOT}
        if args.baseline:
            checkouts["base_"] = baseline_checkout(args.baseline, work)

        counter.reset()
        report["write_s3"] = write_run(upstream_url, f"s3://{BUCKET}/{PREFIX}", args.rollouts, env)
        report["write_s3"]["settle_s"] = counter.wait_quiet()
        written = counter.reset()
        report["write_s3"]["requests"] = written
        report["write_s3"]["requests_per_call"] = round(
            sum(written.values()) / report["write_s3"]["calls"], 3
        )
        local = work / "local-captures"
        report["write_local"] = write_run(upstream_url, str(local), args.rollouts, env)
        stop(upstream)
        upstream = None

        mirrored = work / "mirror"
        keys, stored = mirror(moto.endpoint, mirrored)
        report["objects"], report["stored_mb"] = len(keys), round(stored / 1e6, 1)
        rollouts = work / "rollouts.jsonl"
        rollouts_file(rollouts, args.rollouts)

        with prefect_server(work / "prefect-home", work / "prefect.log") as api:
            enrich_env = {**base_env(work / "prefect-home", api), **DUMMY_CREDENTIALS}
            enrich_env["AWS_ENDPOINT_URL"] = counter.endpoint
            rounds: list[dict[str, Any]] = []
            for round_no in range(args.rounds):
                this: dict[str, Any] = {}
                cases = [("local", str(local)), ("mirror", str(mirrored)), ("s3", f"s3://{BUCKET}/{PREFIX}")]
                for case, capture_dir in cases:
                    for name, checkout in checkouts.items():
                        counter.reset()
                        counter.answers()
                        out = enrich(
                            checkout, rollouts, capture_dir, work / f"out-{round_no}.jsonl", enrich_env
                        )
                        if case == "s3":
                            requests = counter.reset()
                            out["requests"] = requests
                            out.update(counter.answers())
                        this[name + case] = out
                # The floor, in the same round: the same objects, plain GETs, 32 in flight.
                floor = measured_read(counter, floor_reader(counter, keys), stored, len(keys))
                floor.update(counter.answers())
                this["floor"] = floor
                rounds.append(this)
            report["rounds"] = rounds
            last = rounds[-1]
            served = served_by_rclone(
                mirrored, keys, stored, rollouts, work, enrich_env, args.store_latency_ms, floor=True
            )
            report["rclone"] = served | {
                "over_floor": ratio(served["seconds"], served["floor"]["seconds"]),
                "cpu_over_mirror": ratio(served["cpu_s"], last["mirror"]["cpu_s"]),
                "same_output_as_mirror": served["sha256"] == last["mirror"]["sha256"],
            }
            report["compaction"] = compaction(counter, moto.endpoint, rollouts, work, enrich_env, last)
        if args.clients:
            report["clients"] = clients(counter, keys, stored)
    finally:
        if upstream is not None:
            stop(upstream)
        if counter is not None:
            counter.close()
        moto.close()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report["load"] = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
    }
    report["summary"] = summary(report, list(checkouts), stored)
    print(json.dumps(report, indent=2))
    print(table(report), file=sys.stderr)


def s3_fs(endpoint: str) -> Any:
    """s3fs on ``endpoint`` directly (moto's own), uncached."""
    import fsspec

    return fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)


def compaction(
    counter: CountingProxy,
    endpoint: str,
    rollouts: Path,
    work: Path,
    env: dict[str, str],
    last: dict[str, Any],
) -> dict[str, Any]:
    """``rollout-capture compact`` of the S3 run (as a run long over: ``--quiet 0``), through the
    counting proxy; the objects a run before and after; then ``enrich`` on S3 again, its output the
    same bytes as before, its time against the same round's local disk and mirror."""
    fs = s3_fs(endpoint)
    before = len(fs.find(f"{BUCKET}/{PREFIX}"))
    counter.reset()
    started = time.perf_counter()
    done = subprocess.run(
        [*cli(), "compact", f"s3://{BUCKET}/{PREFIX}", "--quiet", "0", "--remove-after", "0", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"compact exited {done.returncode}:\n{done.stderr[-2000:]}")
    said = json.loads(done.stdout)
    requests = counter.reset()
    fs.invalidate_cache()
    after = len(fs.find(f"{BUCKET}/{PREFIX}"))
    counter.answers()
    s3 = enrich(ROOT, rollouts, f"s3://{BUCKET}/{PREFIX}", work / "out-compacted.jsonl", env)
    s3["requests"] = counter.reset()
    s3.update(counter.answers())
    compacted = work / "compacted"
    keys, stored = mirror(endpoint, compacted)
    served = served_by_rclone(compacted, keys, stored, rollouts, work, env, counter.latency_ms)
    return {
        "objects_before": before,
        "objects_after": after,
        "parts": said["parts"],
        "part_mb": round(said["part_bytes"] / 1e6, 1),
        "compact_s": round(seconds, 2),
        "compact_requests": requests,
        "enrich_s3": s3,
        "s3_over_local": ratio(s3["seconds"], last["local"]["seconds"]),
        "s3_over_mirror": ratio(s3["seconds"], last["mirror"]["seconds"]),
        "s3_before_over_after": ratio(last["s3"]["seconds"], s3["seconds"]),
        "same_output_as_before": s3["sha256"] == last["s3"]["sha256"] == last["mirror"]["sha256"],
        "enrich_rclone": served,
        "rclone_over_local": ratio(served["seconds"], last["local"]["seconds"]),
        "rclone_same_output": served["sha256"] == s3["sha256"],
    }


def served_by_rclone(
    local: Path,
    keys: list[str],
    stored: int,
    rollouts: Path,
    work: Path,
    env: dict[str, str],
    latency_ms: float,
    *,
    floor: bool = False,
) -> dict[str, Any]:
    """The run's objects (``local``, a :func:`mirror` of them, its ``keys`` and bytes ``stored``)
    served by ``rclone serve s3`` (a Go server reading a local folder, keeping its connections open
    as S3 does, where moto closes each) behind the same counting proxy and latency, and enriched
    there: after compaction, moto copies a part's whole value for each ranged GET, so there its
    bandwidth, not our client, sets the time; before it, each of moto's GETs is a new connection.
    ``floor``: the plain GETs of the same objects through the same proxy too."""
    from tests.support.stores import start_rclone

    folder = work / "rclone"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    server, endpoint = start_rclone(str(folder))
    proxy = None
    try:
        shutil.copytree(local, folder / "data" / BUCKET / PREFIX, copy_function=os.link)  # no copy
        proxy = CountingProxy(int(endpoint.rsplit(":", 1)[1]), latency_ms)
        out = enrich(
            ROOT, rollouts, f"s3://{BUCKET}/{PREFIX}", work / "out-rclone.jsonl",
            {**env, "AWS_ENDPOINT_URL": proxy.endpoint},
        )  # fmt: skip
        out["requests"] = proxy.reset()
        if floor:
            out["floor"] = measured_read(proxy, floor_reader(proxy, keys), stored, len(keys))
        return out
    finally:
        if proxy is not None:
            proxy.close()
        server.stop()


def summary(report: dict[str, Any], names: list[str], stored: int) -> dict[str, Any]:
    """The issue's figures per tree, each round's ratios taken within the round."""
    out: dict[str, Any] = {}
    objects = report["objects"]
    for name in names:
        per: dict[str, list[Any]] = {}
        for this in report["rounds"]:
            s3, mirrored, floor = this[name + "s3"], this[name + "mirror"], this["floor"]
            requests = sum(s3["requests"].values())
            for key, value in {
                "local_s": this[name + "local"]["seconds"],
                "mirror_s": mirrored["seconds"],
                "s3_s": s3["seconds"],
                "requests": requests,
                "requests_by_kind": s3["requests"],
                "requests_a_rollout": round(requests / report["rollouts"], 2),
                "bytes_down_over_stored": ratio(s3["bytes"], stored),
                "statuses": s3["statuses"],
                "cpu_s3_over_mirror": ratio(s3["cpu_s"], mirrored["cpu_s"]),
                "cpu_ms_a_request_more_than_mirror": round(
                    (s3["cpu_s"] - mirrored["cpu_s"]) * 1000 / requests, 3
                ),
                "peak_rss_mb": [
                    this[name + "local"]["peak_rss_mb"],
                    mirrored["peak_rss_mb"],
                    s3["peak_rss_mb"],
                ],
                "s3_over_floor": ratio(s3["seconds"], floor["seconds"]),
                "floor_s": floor["seconds"],
                "same_output_as_mirror": s3["sha256"] == mirrored["sha256"],
            }.items():
                per.setdefault(key, []).append(value)
        out[name or "this"] = per
    out["objects"] = objects
    if "rclone" in report:
        served = report["rclone"]
        out["rclone"] = {
            "s": served["seconds"],
            "cpu_s": served["cpu_s"],
            "requests": served["requests"],
            "floor_s": served["floor"]["seconds"],
            "floor_cpu_s": served["floor"]["cpu_s"],
            "over_floor": served["over_floor"],
            "cpu_over_mirror": served["cpu_over_mirror"],
            "same_output_as_mirror": served["same_output_as_mirror"],
        }
    if "compaction" in report:
        done = report["compaction"]
        out["compaction"] = {k: v for k, v in done.items() if k not in ("enrich_s3", "enrich_rclone")} | {
            f"enrich_{server}_{figure}": done[f"enrich_{server}"][key]
            for server in ("s3", "rclone")
            for figure, key in (("s", "seconds"), ("cpu_s", "cpu_s"), ("requests", "requests"))
        }
    return out


def table(report: dict[str, Any]) -> str:
    lines = [f"load {report['load']}; {report['objects']} objects, {report['stored_mb']} MB"]
    for name, figures in report["summary"].items():
        if name == "objects":
            continue
        lines.append(f"[{name}]")
        lines += [f"  {key}: {value}" for key, value in figures.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
