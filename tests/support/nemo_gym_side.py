"""NeMo Gym's side of tests/test_nemo_gym_070.py, run by the Python 3.13 venv holding the released
``nemo-gym`` (``make test-nemo-gym``), as processes of their own. It imports no rollout_capture.

- ``serve``: model servers as NeMo Gym builds them (a FastAPI app calling its upstream, NeMo Gym
  0.7's own ``install_model_call_capture`` on it), one per name, on loopback ports; prints
  ``{"ports": {name: port}}`` and serves until its standard input closes.
- ``merge``: NeMo Gym 0.7's own ``merge_model_call_capture_into_record`` on every record of a
  JSONL file, written to another (with ``sys.version`` and ``nemo_gym.__version__`` first).

:func:`passthrough_app` is the model server's app itself, imported by the test too, so that our
middleware is mounted on the very same app NeMo Gym's capture is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
from pathlib import Path
from typing import Any


def passthrough_app(upstream: str) -> Any:
    """A model server that forwards each call to ``upstream`` and answers as it does (a stream as
    a stream, event by event: Starlette's ``StreamingResponse``), like NeMo Gym's servers in front
    of vLLM. Paths come with NeMo Gym's ``/ng-rollout/<id>`` prefix stripped by the capture."""
    import httpx
    from fastapi import FastAPI
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    app = FastAPI()
    clients: list[httpx.AsyncClient] = []

    def client() -> httpx.AsyncClient:
        if not clients:
            clients.append(httpx.AsyncClient(base_url=upstream, timeout=60))
        return clients[0]

    async def forward(request: Any) -> Response:  # a Starlette endpoint: no signature to read
        sent = client().build_request(
            "POST",
            request.url.path,
            content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )
        answer = await client().send(sent, stream=True)
        kind = answer.headers.get("content-type", "application/json")
        if kind.startswith("text/event-stream"):

            async def events() -> Any:
                try:
                    async for chunk in answer.aiter_raw():
                        yield chunk
                finally:
                    await answer.aclose()

            return StreamingResponse(events(), status_code=answer.status_code, media_type=kind)
        body = await answer.aread()
        await answer.aclose()
        return Response(body, status_code=answer.status_code, media_type=kind)

    app.router.routes.append(Route("/{path:path}", forward, methods=["POST"]))
    return app


def _serve(args: argparse.Namespace) -> None:
    import uvicorn
    from nemo_gym.base_responses_api_model import ModelCallCaptureConfig, install_model_call_capture

    config = ModelCallCaptureConfig(observability_enabled=True, model_call_capture_dir=Path(args.capture_dir))
    ports: dict[str, int] = {}
    servers = []
    for name in args.names:
        app = passthrough_app(args.upstream)
        install_model_call_capture(app, config, model_server_name=name)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        ports[name] = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        threading.Thread(
            target=lambda s=server, k=sock: asyncio.run(s.serve(sockets=[k])), daemon=True
        ).start()
        servers.append(server)
    for server in servers:
        while not server.started:
            threading.Event().wait(0.01)
    print(json.dumps({"ports": ports}), flush=True)
    sys.stdin.read()  # until the test closes it
    for server in servers:
        server.should_exit = True


def _merge(args: argparse.Namespace) -> None:
    import nemo_gym
    from nemo_gym.base_responses_api_model import merge_model_call_capture_into_record

    dirs = [Path(d) for d in args.capture_dir]
    with open(args.records, "rb") as source, open(args.out, "w") as out:
        out.write(json.dumps({"python": sys.version, "nemo_gym": nemo_gym.__version__}) + "\n")
        for line in source:
            record = json.loads(line)
            merged = merge_model_call_capture_into_record(record, dirs, include_payloads=args.payloads)
            out.write(json.dumps(merged) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve")
    serve.add_argument("--upstream", required=True)
    serve.add_argument("--capture-dir", required=True)
    serve.add_argument("names", nargs="+")
    merge = commands.add_parser("merge")
    merge.add_argument("--records", required=True)
    merge.add_argument("--out", required=True)
    merge.add_argument("--payloads", action="store_true")
    merge.add_argument("capture_dir", nargs="+")
    args = parser.parse_args()
    {"serve": _serve, "merge": _merge}[args.command](args)


if __name__ == "__main__":
    main()
