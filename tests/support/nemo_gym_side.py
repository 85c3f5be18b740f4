"""NeMo Gym's side of tests/test_nemo_gym_070.py, run by the Python 3.13 venv holding the released
``nemo-gym`` (``make test-nemo-gym``), as processes of their own. It imports rollout_capture (the
installed wheel) only to serve our middleware.

- ``serve``: model servers as NeMo Gym builds and runs them (a FastAPI app calling its upstream,
  NeMo Gym 0.7's own ``install_model_call_capture`` on it, or our middleware in its place, inside
  NeMo Gym's middlewares and uvicorn settings), one per name, on loopback ports; prints
  ``{"ports": {name: port}}``, serves until its standard input closes, then stops them.
- ``merge``: NeMo Gym 0.7's own ``merge_model_call_capture_into_record`` on every record of a
  JSONL file, for each capture dir given, written to a file each (``sys.version`` and
  ``nemo_gym.__version__`` first).
- ``clear``: NeMo Gym 0.7's own ``clear_model_call_captures_for_rollouts`` for the records of a
  JSONL file, in one capture dir.
- ``collect``: NeMo Gym's own rollout collection against its servers (see :func:`_collect`).

:func:`model_server` is the model server itself, with NeMo Gym's capture or our middleware on
the very same app and stack.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def passthrough_app(upstream: str) -> Any:
    """A model server that forwards each call to ``upstream`` and answers as it does (a stream as
    a stream, event by event: Starlette's ``StreamingResponse``), like NeMo Gym's servers in front
    of vLLM. Paths come with NeMo Gym's ``/ng-rollout/<id>`` prefix stripped by the capture. It
    says who answered as NeMo Gym's ``vllm_model`` does (``start_model_execution``): the upstream
    was attempted and answered, its status kept only when it is an error (``vllm_model`` learns it
    from the ``ClientResponseError`` that ``raise_for_status`` raises for a status >= 400)."""
    import httpx
    from fastapi import FastAPI
    from nemo_gym.base_responses_api_model import start_model_execution
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    app = FastAPI()
    clients: list[httpx.AsyncClient] = []

    def client() -> httpx.AsyncClient:
        if not clients:
            clients.append(httpx.AsyncClient(base_url=upstream, timeout=60))
        return clients[0]

    async def forward(request: Any) -> Response:  # a Starlette endpoint: no signature to read
        execution = start_model_execution(request, upstream_attempted=True)
        sent = client().build_request(
            "POST",
            request.url.path,
            content=await request.body(),
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )
        answer = await client().send(sent, stream=True)
        execution["response_source"] = "upstream"
        if answer.status_code >= 400:
            execution["upstream_status_code"] = answer.status_code
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


class _ServerStub:
    """What NeMo Gym's ``SimpleServer.setup_*_middleware`` methods read of their server."""

    def __init__(self, name: str) -> None:
        self.config = argparse.Namespace(name=name)

    def get_session_middleware_key(self) -> str:
        return f"PassthroughModel___{self.config.name}"


def model_server(name: str, upstream: str, capture_dir: str, producer: str) -> Any:
    """One model server's app as NeMo Gym builds and runs it (``SimpleResponsesAPIModel.setup_webserver``
    then ``SimpleServer.run_webserver``): its session middleware, the capture (NeMo Gym's own
    ``install_model_call_capture``, or ours: ``producer``), its exception middleware, and outermost
    its ``ClientDisconnectCancellationMiddleware``, which cancels a call whose client left."""
    from nemo_gym.base_responses_api_model import ModelCallCaptureConfig, install_model_call_capture
    from nemo_gym.server_utils import SimpleServer

    app = passthrough_app(upstream)
    stub: Any = _ServerStub(name)
    SimpleServer.setup_session_middleware(stub, app)
    if producer == "nemo-gym":
        config = ModelCallCaptureConfig(observability_enabled=True, model_call_capture_dir=Path(capture_dir))
        install_model_call_capture(app, config, model_server_name=name)
    else:
        from rollout_capture.producer import CaptureMiddleware  # the installed wheel's

        app.add_middleware(CaptureMiddleware, capture_dir=capture_dir, server_name=name)
    SimpleServer.setup_exception_middleware(stub, app)
    SimpleServer.setup_cancellation_middleware(stub, app)
    return app


def _serve(args: argparse.Namespace) -> None:
    """Serve until standard input closes, then stop each server and wait for it (its calls' rows
    written): the test reads the captures once this process has exited."""
    from functools import partial

    import uvicorn
    from nemo_gym.server_utils import GlobalAIOHTTPAsyncClientConfig, KeepaliveHttpToolsProtocol

    keepalive = GlobalAIOHTTPAsyncClientConfig()  # NeMo Gym's defaults
    ports: dict[str, int] = {}
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []
    for name in args.names:
        app = model_server(name, args.upstream, args.capture_dir, args.producer)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        ports[name] = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(  # as run_webserver configures it
                app,
                timeout_graceful_shutdown=0.5,
                timeout_keep_alive=30,
                http=partial(
                    KeepaliveHttpToolsProtocol,
                    keepalive=(
                        keepalive.global_aiohttp_tcp_keepalive_idle_seconds,
                        keepalive.global_aiohttp_tcp_keepalive_interval_seconds,
                        keepalive.global_aiohttp_tcp_keepalive_probes,
                    ),
                ),
                log_level="warning",
                access_log=False,
            )
        )

        thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),))
        thread.start()
        servers.append((server, thread))
    # Listening already: a call made before uvicorn accepts waits in the backlog, no wait needed.
    print(json.dumps({"ports": ports}), flush=True)
    sys.stdin.read()  # until the test closes it
    for server, _ in servers:
        server.should_exit = True
    for _, thread in servers:
        thread.join()


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


def _project(args: argparse.Namespace) -> None:
    """0.7.0's own merge and projections (``ng_trajectory``, ``ng_perf``) of every case of
    tests/support/projection_cases.py, as its collection runs them at a rollout's end (in its
    order: merge, trajectory, perf), with the case's capture and with an empty one."""
    import copy
    import importlib.util
    import tempfile

    import nemo_gym
    from nemo_gym.base_responses_api_model import merge_model_call_capture_into_record
    from nemo_gym.rollout_collection import _attach_ng_perf, _attach_trajectory_record, _has_observation_gap

    spec = importlib.util.spec_from_file_location(
        "projection_cases", Path(__file__).with_name("projection_cases.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = []
    for case in module.cases():
        outcome: dict[str, Any] = {"name": case["name"]}
        for kind in ("full", "empty"):
            with tempfile.TemporaryDirectory() as capture_dir:
                if kind == "full":
                    lines = "".join(json.dumps(row) + "\n" for row in case["rows"])
                    (Path(capture_dir) / "3-1.capture.jsonl").write_text(lines)
                result = copy.deepcopy(case["result"])
                redacted = _has_observation_gap(result, "multimodal_history_redacted")
                merge_model_call_capture_into_record(
                    result, [Path(capture_dir)], include_payloads=not redacted
                )
                if {"ng_model_call_capture", "ng_agent_observations", "ng_trajectory"} & result.keys():
                    _attach_trajectory_record(case["row"], result)
                _attach_ng_perf(result, observability_enabled=True, rollout_latency_ms=case["latency_ms"])
                outcome[kind] = result
        built.append(outcome)
    Path(args.output).write_text(
        json.dumps({"nemo_gym": nemo_gym.__version__, "cases": built}, indent=1) + "\n"
    )


_SERVER_SETTINGS: dict[str, Callable[[str], dict[str, Any]]] = {
    "vllm_model": lambda upstream: {
        "base_url": upstream + "/v1",
        "api_key": "scripted-key",
        "model": "scripted",
        "return_token_id_information": False,
        "uses_reasoning_parser": True,
    },
    "openai_model": lambda upstream: {
        "openai_base_url": upstream + "/v1",
        "openai_api_key": "scripted-key",
        "openai_model": "scripted",
    },
    "azure_openai_model": lambda upstream: {
        "openai_base_url": upstream,
        "openai_api_key": "scripted-key",
        "openai_model": "scripted",
        "default_query": {"api-version": "2024-10-21"},
        "num_concurrent_requests": 4,
    },
    "litellm_model": lambda upstream: {
        "openai_base_url": upstream + "/v1",
        "openai_api_key": "scripted-key",
        "openai_model": "scripted",
    },
}
"""Each NeMo Gym 0.7.0 model server's own settings, in front of the scripted upstream."""


def _serve_ours(args: argparse.Namespace) -> None:
    """rollout-capture's model server (docs/nemo-gym.md's recipe) serving each NeMo Gym model
    server named (``name`` or ``name:workers``; default ``--num-workers``), one process each as
    ``gym env start`` starts them (its folder found through NEMO_GYM_EXTRA_ROOTS, ``python app.py``
    with the config in the environment); prints their ports, serves until standard input closes,
    then stops each and waits for it."""
    import os
    import signal
    import subprocess
    import time

    import yaml

    from rollout_capture.producer.nemo_gym import SERVER_FOLDER, search_dir

    os.environ["NEMO_GYM_EXTRA_ROOTS"] = str(search_dir())
    work = Path(args.workdir)
    config: dict[str, Any] = {
        "observability_enabled": True,
        "model_call_capture_dir": args.decoy,
        "head_server": {"host": "127.0.0.1", "port": _free_port()},
    }
    ports: dict[str, int] = {}
    workers = {
        name: int(n or args.num_workers) for name, _, n in (given.partition(":") for given in args.serves)
    }
    for serves in workers:
        ports[serves] = _free_port()
        server = {
            "host": "127.0.0.1",
            "port": ports[serves],
            "entrypoint": "app.py",
            "serves": serves,
            "num_workers": workers[serves],
            "rollout_capture": {"capture_dir": args.capture_dir},
            **_SERVER_SETTINGS[serves](args.upstream.rstrip("/")),
        }
        config[f"{serves}_policy"] = {"responses_api_models": {SERVER_FOLDER: server}}
    config_path = work / "gym.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sys.argv = [sys.argv[0], f"+config_paths=[{config_path}]"]
    from nemo_gym.cli.env import _resolve_server_dir
    from nemo_gym.global_config import get_global_config_dict
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(get_global_config_dict())
    folder = _resolve_server_dir(Path("responses_api_models", SERVER_FOLDER))
    processes = []
    for serves in workers:
        env = {**os.environ, "NEMO_GYM_CONFIG_DICT": text, "NEMO_GYM_CONFIG_PATH": f"{serves}_policy"}
        log = open(work / f"{serves}.log", "wb")  # noqa: SIM115 - open for the process's life
        command = [sys.executable, "app.py"]
        processes.append(subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT))
    for port in ports.values():  # until each accepts, for as long as every server lives
        while True:
            assert all(p.poll() is None for p in processes), f"a server exited: see {work}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
    print(json.dumps({"ports": ports, "folder": str(folder)}), flush=True)
    sys.stdin.read()  # until the test closes it
    for process in processes:
        process.send_signal(signal.SIGINT)  # Ctrl-C, as gym env start stops its servers
    for process in processes:
        process.wait(120)


def _health(args: argparse.Namespace) -> None:
    """What NeMo Gym 0.7.0's own tools make of a collection's records: its rollout health checks
    (the ``gym`` health report's summary) and the ``perf_summary`` its aggregation writes."""
    import tempfile

    from nemo_gym.reward_profile import compute_perf_summary
    from nemo_gym.rollout_health import run_health_checks

    records = [json.loads(line) for line in Path(args.records).read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as reports:
        health = run_health_checks(Path(args.records), output_dir=Path(reports), workers=1)
    perf = [record["ng_perf"] for record in records if isinstance(record.get("ng_perf"), dict)]
    summary = {"health": health.summary, "perf_summary": compute_perf_summary(perf, len(records))}
    print(json.dumps(summary))


def _clear(args: argparse.Namespace) -> None:
    """NeMo Gym 0.7's own clear before dispatch, for every record of a JSONL file."""
    from nemo_gym.base_responses_api_model import clear_model_call_captures_for_rollouts

    given = [json.loads(line) for line in Path(args.records).read_text().splitlines()]
    clear_model_call_captures_for_rollouts(given, [Path(args.capture_dir)])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


AGENT = "weather_simple_agent"


def _gym_config(
    upstream: str,
    capture_dir: str,
    max_steps: int,
    ours: dict[str, Any] | None = None,
    num_workers: int | None = None,
) -> dict[str, Any]:
    """NeMo Gym's config of a run: its vLLM model server in front of ``upstream``, its example
    weather resources server, its ``simple_agent``; model-call capture on. With ``ours`` (the
    ``rollout_capture`` settings: ``capture_dir``, ``storage_options``), the model server is
    rollout-capture's (docs/nemo-gym.md's recipe: ``rollout_capture_model`` serving ``vllm_model``)
    and ``capture_dir`` NeMo Gym's own folder, which stays empty."""
    host = {"host": "127.0.0.1"}
    vllm = {
        **host,
        "port": _free_port(),
        "entrypoint": "app.py",
        "base_url": upstream.rstrip("/") + "/v1",
        "api_key": "scripted-key",
        "model": "scripted",
        "return_token_id_information": False,
        "uses_reasoning_parser": True,
    }
    if num_workers is not None:
        vllm["num_workers"] = num_workers
    model = {"vllm_model": vllm}
    if ours is not None:
        model = {"rollout_capture_model": {**vllm, "serves": "vllm_model", "rollout_capture": ours}}
    return {
        "observability_enabled": True,
        "model_call_capture_dir": capture_dir,
        "head_server": {**host, "port": _free_port()},
        "policy_model": {"responses_api_models": model},
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
    ours = json.loads(args.ours) if args.ours else None
    built = _gym_config(args.upstream, args.capture_dir, args.max_steps, ours, args.num_workers)
    config_path.write_text(yaml.safe_dump(built))
    if ours is not None:  # the recipe: rollout-capture's server folder found as NeMo Gym finds plugins
        from rollout_capture.producer.nemo_gym import search_dir

        os.environ["NEMO_GYM_EXTRA_ROOTS"] = str(search_dir())
    sys.argv = [sys.argv[0], f"+config_paths=[{config_path}]"]
    from nemo_gym.cli.env import _resolve_server_dir
    from nemo_gym.global_config import get_global_config_dict
    from nemo_gym.rollout_collection import RolloutCollectionConfig, RolloutCollectionHelper

    resolved = get_global_config_dict()
    text = OmegaConf.to_yaml(resolved)
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
                        cwd=_resolve_server_dir(Path(kind, server)),  # as gym env start finds it
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
                ports.append(int(settings["port"]))
    try:
        # Each server's port accepting a connection is the event waited on, for as long as every
        # server lives (the test's own timeout bounds a hang): a server's start-up on a busy machine
        # takes what it takes, no window decides; one that exits fails this at once.
        for port in ports:
            while True:
                assert all(p.poll() is None for p in processes), f"a NeMo Gym server exited: see {work}"
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    time.sleep(0.1)  # refused at once while nothing listens: the next try
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
        if args.hold_until_live:  # the collection's servers stay up until a follower has every line
            written = Path(args.output).read_bytes().count(b"\n")
            live = Path(args.hold_until_live)
            while not (live.exists() and live.read_bytes().count(b"\n") >= written):
                assert all(p.poll() is None for p in processes), f"a NeMo Gym server exited: see {work}"
                time.sleep(0.1)  # the file's next look; the test's own timeout bounds a hang
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
    serve.add_argument("--producer", choices=["nemo-gym", "ours"], default="nemo-gym")
    serve.add_argument("names", nargs="+")
    merge = commands.add_parser("merge")
    merge.add_argument("--records", required=True)
    merge.add_argument("--payloads", action="store_true")
    merge.add_argument("merges", nargs="+", metavar="CAPTURE_DIR=OUT")
    clear = commands.add_parser("clear")
    clear.add_argument("--records", required=True)
    clear.add_argument("--capture-dir", required=True)
    ours = commands.add_parser("serve-ours")
    ours.add_argument("--upstream", required=True)
    ours.add_argument("--capture-dir", required=True)
    ours.add_argument("--decoy", required=True)
    ours.add_argument("--workdir", required=True)
    ours.add_argument("--num-workers", type=int, default=2)
    ours.add_argument("serves", nargs="+")
    health = commands.add_parser("health")
    health.add_argument("--records", required=True)
    project = commands.add_parser("project")
    project.add_argument("--output", required=True)
    collect = commands.add_parser("collect")
    collect.add_argument("--upstream", required=True)
    collect.add_argument("--capture-dir", required=True)
    collect.add_argument("--workdir", required=True)
    collect.add_argument("--input", required=True)
    collect.add_argument("--output", required=True)
    collect.add_argument("--max-steps", type=int, default=2)
    collect.add_argument("--parallel", type=int, default=4)
    collect.add_argument("--repeats", type=int, default=2)
    collect.add_argument("--ours", help="rollout-capture's server, these rollout_capture settings (JSON)")
    collect.add_argument("--num-workers", type=int)
    collect.add_argument("--hold-until-live", help="after the collection, wait until this file has its lines")
    args = parser.parse_args()
    {
        "serve": _serve,
        "merge": _merge,
        "clear": _clear,
        "collect": _collect,
        "project": _project,
        "health": _health,
        "serve-ours": _serve_ours,
    }[args.command](args)


if __name__ == "__main__":
    main()
