"""NeMo Gym's side of tests/test_nemo_gym_070.py, run by the Python 3.13 venv holding the released
``nemo-gym`` (``make test-nemo-gym``), as processes of their own. It imports no rollout_capture.

- ``serve``: model servers as NeMo Gym builds them (a FastAPI app calling its upstream, NeMo Gym
  0.7's own ``install_model_call_capture`` on it), one per name, on loopback ports; prints
  ``{"ports": {name: port}}`` and serves until its standard input closes.
- ``merge``: NeMo Gym 0.7's own ``merge_model_call_capture_into_record`` on every record of a
  JSONL file, for each capture dir given, written to a file each (``sys.version`` and
  ``nemo_gym.__version__`` first).
- ``collect``: NeMo Gym's own rollout collection against its servers (see :func:`_collect`).

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

    given = Path(args.records).read_text().splitlines()
    for pair in args.merges:  # CAPTURE_DIR=OUT: one process for all (its imports take seconds)
        capture_dir, _, target = pair.partition("=")
        with open(target, "w") as out:
            out.write(json.dumps({"python": sys.version, "nemo_gym": nemo_gym.__version__}) + "\n")
            for line in given:
                merged = merge_model_call_capture_into_record(
                    json.loads(line), [Path(capture_dir)], include_payloads=args.payloads
                )
                out.write(json.dumps(merged) + "\n")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


AGENT = "weather_simple_agent"


def _gym_config(upstream: str, capture_dir: str, max_steps: int) -> dict[str, Any]:
    """NeMo Gym's config of a run: its vLLM model server in front of ``upstream``, its example
    weather resources server, its ``simple_agent``; model-call capture on."""
    host = {"host": "127.0.0.1"}
    return {
        "observability_enabled": True,
        "model_call_capture_dir": capture_dir,
        "head_server": {**host, "port": _free_port()},
        "policy_model": {
            "responses_api_models": {
                "vllm_model": {
                    **host,
                    "port": _free_port(),
                    "entrypoint": "app.py",
                    "base_url": upstream.rstrip("/") + "/v1",
                    "api_key": "scripted-key",
                    "model": "scripted",
                    "return_token_id_information": False,
                    "uses_reasoning_parser": True,
                }
            }
        },
        "weather": {
            "resources_servers": {
                "example_single_tool_call": {
                    **host,
                    "port": _free_port(),
                    "entrypoint": "app.py",
                    "domain": "agent",
                }
            }
        },
        AGENT: {
            "responses_api_agents": {
                "simple_agent": {
                    **host,
                    "port": _free_port(),
                    "entrypoint": "app.py",
                    "resources_server": {"type": "resources_servers", "name": "weather"},
                    "model_server": {"type": "responses_api_models", "name": "policy_model"},
                    "max_steps": max_steps,
                }
            }
        },
    }


_LEGACY_AGENT_WITHOUT_RAY = (
    "from environment_servers.legacy_agent.app import LegacyAgentEnvironmentServer as Server\n"
    "Server.ray_enabled = False\n"
    "Server.run_webserver()\n"
)
"""NeMo Gym's environment server for an agent configured without one, as its ``app.py`` runs it,
declaring ``ray_enabled = False``: it uses no Ray, and NeMo Gym says a future release defaults it so;
undeclared, it starts a local Ray cluster (a dashboard, a dozen processes, over 30 s on a busy
machine, where Ray's own start-up deadline fails it)."""


def _collect(args: argparse.Namespace) -> None:
    """NeMo Gym's own rollout collection (what ``gym eval run --no-serve`` runs) against its servers,
    each started as ``gym env start`` starts it (its ``app.py`` given the resolved config in the
    environment), in this venv rather than a uv venv each. The collector, the model, agent and
    resources servers use no Ray, nor does the environment server NeMo Gym adds for an agent
    configured without one (``legacy_agent``), run with ``ray_enabled = False`` declared
    (:data:`_LEGACY_AGENT_WITHOUT_RAY`): no Ray cluster is started."""
    import os
    import subprocess
    import time

    import yaml
    from omegaconf import OmegaConf

    work = Path(args.workdir)
    config_path = work / "gym.yaml"
    config_path.write_text(yaml.safe_dump(_gym_config(args.upstream, args.capture_dir, args.max_steps)))
    sys.argv = [sys.argv[0], f"+config_paths=[{config_path}]"]
    from nemo_gym.global_config import get_global_config_dict
    from nemo_gym.rollout_collection import RolloutCollectionConfig, RolloutCollectionHelper

    resolved = get_global_config_dict()
    text = OmegaConf.to_yaml(resolved)
    site = Path(__import__("nemo_gym").__file__).resolve().parent.parent
    started = time.monotonic()
    processes: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    # Every server the resolved config names (the environment server NeMo Gym adds for an agent
    # configured without one too), as RunHelper.start finds and starts them.
    for name, section in resolved.items():
        kinds = section.items() if OmegaConf.is_dict(section) else []
        for kind, servers in kinds:
            for server, settings in servers.items() if OmegaConf.is_dict(servers) else []:
                if not OmegaConf.is_dict(settings) or "entrypoint" not in settings:
                    continue
                env = {**os.environ, "NEMO_GYM_CONFIG_DICT": text, "NEMO_GYM_CONFIG_PATH": name}
                log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - open for the process's life
                command = [sys.executable, settings["entrypoint"]]
                if (kind, server) == ("environment_servers", "legacy_agent"):
                    command = [sys.executable, "-c", _LEGACY_AGENT_WITHOUT_RAY]
                processes.append(
                    subprocess.Popen(
                        command,
                        cwd=site / kind / server,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
                ports.append(int(settings["port"]))
    try:
        for port in ports:
            while True:
                assert all(p.poll() is None for p in processes), f"a NeMo Gym server exited: see {work}"
                assert time.monotonic() - started < 900, f"NeMo Gym's servers did not start: see {work}"
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    time.sleep(0.1)
        os.environ["NEMO_GYM_CONFIG_DICT"] = text
        config = RolloutCollectionConfig(
            agent_name=AGENT,
            input_jsonl_fpath=args.input,
            output_jsonl_fpath=args.output,
            num_samples_in_parallel=args.parallel,
            num_repeats=args.repeats,
            disable_aggregation=True,
            disable_health_check=True,
        )
        asyncio.run(RolloutCollectionHelper().run_from_config(config))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve")
    serve.add_argument("--upstream", required=True)
    serve.add_argument("--capture-dir", required=True)
    serve.add_argument("names", nargs="+")
    merge = commands.add_parser("merge")
    merge.add_argument("--records", required=True)
    merge.add_argument("--payloads", action="store_true")
    merge.add_argument("merges", nargs="+", metavar="CAPTURE_DIR=OUT")
    collect = commands.add_parser("collect")
    collect.add_argument("--upstream", required=True)
    collect.add_argument("--capture-dir", required=True)
    collect.add_argument("--workdir", required=True)
    collect.add_argument("--input", required=True)
    collect.add_argument("--output", required=True)
    collect.add_argument("--max-steps", type=int, default=2)
    collect.add_argument("--parallel", type=int, default=4)
    collect.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    {"serve": _serve, "merge": _merge, "collect": _collect}[args.command](args)


if __name__ == "__main__":
    main()
