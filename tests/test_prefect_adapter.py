"""Prefect behaviour the flows rely on without a public API for it (flows/prefect_adapter.py).

Each test pins one assumption, so a Prefect upgrade that breaks it fails here by name.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
from enum import Enum
from typing import Any

import orjson
import pytest
from prefect import Flow
from prefect.task_runners import ThreadPoolTaskRunner

from rollout_capture.flows.guard import GuardedFlow, guarded_flow
from rollout_capture.flows.prefect_adapter import FLOW_OPTIONS, heartbeats_unjoined
from rollout_capture.secret_options import redact_secret_options

from .support.prefect_api import flow_run


def test_every_option_prefect_takes_is_carried_over() -> None:
    """A new Flow option in a Prefect upgrade would be dropped from the guard's copies."""
    taken = set(inspect.signature(Flow.__init__).parameters) - {"self"}
    assert taken == set(FLOW_OPTIONS), f"Flow.__init__ options changed: {sorted(taken ^ set(FLOW_OPTIONS))}"
    assert set(inspect.signature(Flow.with_options).parameters) - {"self"} <= set(FLOW_OPTIONS)


def _hook(*_: Any) -> None:
    """A state hook (identity is what the copies must keep)."""


def test_a_guarded_copy_is_a_guarded_flow_equal_to_prefects_own_copy() -> None:
    @guarded_flow(name="adapter-original", retries=1, log_prints=True)
    def original(storage_options: dict[str, Any] | None = None) -> int:
        return 1

    options: dict[str, Any] = {
        "name": "adapter-copy",
        "flow_run_name": "copy {storage_options}",
        "retries": 3,
        "task_runner": ThreadPoolTaskRunner(max_workers=3),
        "timeout_seconds": 30,
        "on_failure": [_hook],
    }
    copy = original.with_options(**options)
    plain = Flow.with_options(original, **options)
    assert type(copy) is GuardedFlow and type(plain) is Flow
    assert vars(copy) == vars(plain)


def test_the_engine_records_parameters_as_serialize_parameters_gives_them(prefect_api: str) -> None:
    @guarded_flow(name="adapter-records")
    def records(storage_options: dict[str, Any] | None = None) -> int:
        return 1

    state = records.with_options(flow_run_name="adapter-copy")(
        storage_options={"token": "hunter2", "anon": False}, return_state=True
    )
    recorded = flow_run(state.state_details.flow_run_id).parameters
    assert "hunter2" not in orjson.dumps(recorded).decode()
    assert recorded["storage_options"]["anon"] is False


_EMBEDDED = """
import json
from prefect import flow
from rollout_capture.flows.runners import api_shared_with_workers, current_api_url
from prefect.settings import PREFECT_API_URL

@flow
def probe() -> dict:
    with api_shared_with_workers("dask"):
        return {"url": current_api_url(), "shared": PREFECT_API_URL.value()}

print(json.dumps({"outside": current_api_url(), **probe()}))
"""


@pytest.mark.integration  # its child process starts Prefect's temporary server (no fixture says so)
def test_the_embedded_servers_url_is_found_in_a_run_and_shared_with_workers(tmp_path: Any) -> None:
    """Without a configured API, remote workers get the URL of this run's temporary server."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path)
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a loaded machine starts it slowly
    done = subprocess.run(
        [sys.executable, "-c", _EMBEDDED], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["outside"] is None
    assert found["url"] and found["shared"] == found["url"]
    assert found["url"].startswith("http://127.0.0.1:") and found["url"].endswith("/api")


def test_prefect_rays_task_body_is_still_the_static_hook_the_ray_runner_wraps() -> None:
    """flows/runners.py wraps ``RayTaskRunner._run_prefect_task`` (no public hook exists) so a
    Ray batch sends its last states to the API before Ray ends its worker: if prefect-ray stops
    submitting through that static method, or changes what it passes, this fails by name."""

    ray_runners = pytest.importorskip("prefect_ray.task_runners")
    hook = inspect.getattr_static(ray_runners.RayTaskRunner, "_run_prefect_task")
    assert isinstance(hook, staticmethod)
    assert "self._run_prefect_task" in inspect.getsource(ray_runners.RayTaskRunner.submit)
    passed = set(inspect.signature(hook.__func__).parameters)
    assert {"task", "task_run_id", "context", "parameters", "wait_for", "dependencies"} <= passed


def test_the_sync_engine_still_takes_its_heartbeats_from_the_name_the_adapter_rebinds() -> None:
    """``heartbeats_unjoined`` rebinds ``prefect.flow_engine._send_heartbeats`` with
    ``join_on_exit=False`` (a run's end no longer waits out the thread's one-second sleep): if the
    sync engine stops looking it up by that name, or the parameter goes, this fails by name."""
    import prefect.flow_engine as engine

    heartbeats_unjoined()
    heartbeats_unjoined()  # idempotent: one partial, not one around another
    bound = engine._send_heartbeats
    assert isinstance(bound, functools.partial) and bound.keywords == {"join_on_exit": False}
    assert not isinstance(bound.func, functools.partial)
    assert "join_on_exit" in inspect.signature(bound.func).parameters
    assert "with _send_heartbeats(self):" in inspect.getsource(engine.FlowRunEngine.run_context)


class _Colour(Enum):
    red = "red"


@pytest.mark.parametrize(
    "parameters",
    [
        {"rollouts": "r.jsonl", "batch_size": 1000, "quiescence_timeout_s": 10.0, "strict": False},
        {"storage_options": {"anon": False, "client_kwargs": {"region_name": "x"}, "ports": [1, 2.5]}},
        {"storage_options": {"token": "hunter2", "key": None}, "output": "s3://u:p@bucket/x"},
        {"storage_options": None, "big": 1e308, "negative": -3},
        {"colour": _Colour.red, "pair": (1, 2)},  # not plain JSON: Prefect's encoder as before
        {"storage_options": {"_sa_state": 1, "anon": True}},  # its encoder drops _sa keys
    ],
)
def test_parameters_are_recorded_as_prefects_encoder_gives_them(parameters: dict[str, Any]) -> None:
    """The guard encodes plain JSON itself (no FastAPI import for a flow run): the same values."""

    @guarded_flow(name="adapter-encoded")
    def encoded(**given: Any) -> None:
        return None

    assert encoded.serialize_parameters(parameters) == redact_secret_options(
        Flow.serialize_parameters(encoded, parameters)
    )


def test_plain_parameters_are_recorded_without_importing_fastapi() -> None:
    probe = (
        "import sys\n"
        "from rollout_capture.flows.guard import guarded_flow\n"
        "flow = guarded_flow(name='probe')(lambda rollouts, options=None: None)\n"
        "flow.serialize_parameters({'rollouts': 'r.jsonl', 'options': {'anon': False}})\n"
        "print('fastapi' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
