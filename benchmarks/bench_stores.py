"""Store requests a proxied call costs, on each object store's real server (the docs' table of stores).

For each store (moto for S3, fake-gcs-server for GCS, Azurite for Azure Blob; ``rclone serve s3``
is refused at startup, so it has no figure) and each object layout (journal, objects), a
``rollout-capture proxy`` process writes to the store through a counting proxy
(tests/support/fault_proxy.py's FaultProxy: every HTTP request line counted by kind, plus a fixed
latency per request as a network would add); one warm-up call, then ``--calls`` chat calls into
one rollout (or round-robin over ``--rollouts``), ``--concurrency`` at a time. Requests are counted
from the warm-up's end until the store is quiet after the last call (the claims' releases
included) and divided by the calls.

    python benchmarks/bench_stores.py [--calls 60] [--concurrency 8] [--rollouts 1] [--latency-ms 5]
                                      [--json OUT]

Figures are counts, not timings: they hold on a busy machine too (the journal's batching does
depend on how many calls are in flight at once, hence ``--concurrency``).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_GCE_CHECK": "true",  # google-auth never probes a metadata server
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no storage-control API on an emulator
    }
)

from tests.support.fault_proxy import FaultProxy  # noqa: E402
from tests.support.scripted_upstream import ScriptedUpstream  # noqa: E402
from tests.support.servers import ThreadedServer  # noqa: E402
from tests.support.stores import (  # noqa: E402
    Store,
    azurite_connection_string,
    start_azurite,
    start_fake_gcs,
)

LAYOUTS = ("journal", "objects")
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's line per request


def start_moto(folder: str) -> tuple[Any, str]:
    from tests.support.moto_s3 import AtomicMotoServer  # its conditional writes atomic, as S3's

    server = AtomicMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def counted_store(kind: str, endpoint: str, latency_s: float) -> tuple[Store, FaultProxy]:
    """A fresh bucket on the server, reached through a counting proxy (the environment set to it)."""
    host, port = endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port), latency_s=latency_s)
    environment = {}
    if kind == "gcs":
        environment["STORAGE_EMULATOR_HOST"] = proxy.endpoint
    if kind == "azure":
        environment["AZURE_STORAGE_CONNECTION_STRING"] = azurite_connection_string(proxy.endpoint)
    os.environ.update(environment)
    store = Store(kind, proxy.endpoint, environment).create_bucket()
    return store, proxy


def quiet(proxy: FaultProxy, for_s: float = 1.5, timeout_s: float = 60) -> None:
    """Wait until no request crossed the proxy for ``for_s`` (writes after the last answer included)."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        total = sum(proxy.requests.values())
        if total != last:
            last, since = total, time.monotonic()
        elif time.monotonic() - since >= for_s:
            return
        time.sleep(0.1)


def measure(
    store: Store, proxy: FaultProxy, upstream: str, layout: str, calls: int, concurrency: int, rollouts: int
) -> dict[str, Any]:
    """Requests a call of one proxy process writing ``layout`` to the store."""
    options = json.dumps(store.storage_options) if store.storage_options else None
    command = [sys.executable, "-m", "rollout_capture.cli", "proxy", "--upstream", upstream, "--capture-dir",
               store.url(f"{layout}-caps"), "--port", "0", "--log-level", "error", "--layout", layout,
               *(["--storage-options", options] if options else [])]  # fmt: skip
    quiet(proxy, for_s=0.5)
    proxy.reset_counts()  # the bucket's creation, an earlier proxy's last requests
    proc = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=store.process_environment()
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if " on http://" in line:
            base = line.split(" on ", 1)[1].split(" ", 1)[0]
            break
    else:
        raise RuntimeError(f"the proxy did not start: {proc.wait()}")
    startup = proxy.reset_counts()  # the startup probe: create, create again (refused), remove

    def call(n: int, rollout: str = "0-0") -> int:
        body = {"model": "scripted", "messages": [{"role": "user", "content": f"call {n}"}]}
        with httpx.Client(base_url=base, timeout=60) as client:
            return client.post(f"/ng-rollout/{rollout}/v1/chat/completions", json=body).status_code

    try:
        assert call(-1, "9-9") == 200  # warm-up: connections, the journal's first look
        quiet(proxy)
        proxy.reset_counts()
        with ThreadPoolExecutor(concurrency) as pool:
            assert set(pool.map(call, range(calls), [f"{n % rollouts}-0" for n in range(calls)])) == {200}
        quiet(proxy)
        counts = proxy.reset_counts()
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "startup_requests": startup,
        "requests": counts,
        "per_call": {
            "total": round(sum(counts.values()) / calls, 2),
            **{kind: round(n / calls, 2) for kind, n in sorted(counts.items())},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument(
        "--rollouts", type=int, default=1, help="calls spread over this many rollouts (1: all into one)"
    )
    parser.add_argument("--stores", default="s3,gcs,azure")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    upstream = ThreadedServer(ScriptedUpstream())
    starters = {"s3": start_moto, "gcs": start_fake_gcs, "azure": start_azurite}
    figures: dict[str, Any] = {
        "calls": args.calls,
        "concurrency": args.concurrency,
        "rollouts": args.rollouts,
        "stores": {},
    }
    for kind in args.stores.split(","):
        server, endpoint = starters[kind](tempfile.mkdtemp(prefix=f"bench-{kind}-") if kind != "s3" else "")
        try:
            store, proxy = counted_store(kind, endpoint, args.latency_ms / 1000)
            for layout in LAYOUTS:
                result = measure(
                    store, proxy, upstream.url, layout, args.calls, args.concurrency, args.rollouts
                )
                figures["stores"].setdefault(kind, {})[layout] = result
                startup = result["startup_requests"]
                print(f"{kind:6} {layout:8} per call: {result['per_call']}  startup: {startup}")
            proxy.close()
        finally:
            server.stop()
    upstream.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
