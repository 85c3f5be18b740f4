"""Shared fixtures: an isolated Prefect home, a real S3 endpoint (moto server), the corpus."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

# Before anything imports Prefect: no telemetry, no shared home (SQLite locks), no server.
_PREFECT_HOME = tempfile.mkdtemp(prefix="rollout-capture-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["PREFECT_LOGGING_LEVEL"] = os.environ.get("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.pop("PREFECT_API_URL", None)
# Events reach the API's feed within half a second instead of five (the persister's batches).
os.environ["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL"] = "0.5"
# Workers and serve look for flow runs to start every second instead of ten (the same polling,
# on a test-sized clock): a triggered run starts when it is due, not up to ten seconds later.
os.environ["PREFECT_WORKER_QUERY_SECONDS"] = "1"
os.environ["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"
# Core log records sent to the API outside a flow run are dropped quietly, not warned about.
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
# Task retries on the same policy as production, on a test-sized clock.
os.environ["ROLLOUT_CAPTURE_RETRY_BASE_S"] = "0.3"
os.environ["ROLLOUT_CAPTURE_TASK_RETRIES"] = "5"
# Dummy credentials for the local S3 endpoint; never real ones.
for _name, _value in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}.items():
    os.environ[_name] = _value
os.environ.pop("AWS_PROFILE", None)
# GCS and Azure reach only the emulators the tests start: google-auth never probes the GCE metadata
# server, gcsfs never asks the storage-control API (no emulator has it) for a bucket's layout, and
# nobody's own credentials are read.
os.environ["NO_GCE_CHECK"] = "true"
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
for _name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING"):
    os.environ.pop(_name, None)
os.environ["CLOUDSDK_CONFIG"] = tempfile.mkdtemp(prefix="rollout-capture-gcloud-")

import contextlib  # noqa: E402
import inspect  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import socketserver  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "corpus"
SAMPLE = ROOT / "rollout_capture" / "sample"


def wait_for(
    check: Callable[[], T], timeout_s: float = 30.0, what: str = "the condition", poll_s: float = 0.02
) -> T:
    """``check()`` once it is truthy, polled every ``poll_s`` until ``timeout_s``: a readiness
    wait that fails naming ``what`` instead of hanging (the one polling helper of the suite)."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(poll_s)
    return found


def wait_ready(event: Any, process: Any, what: str = "the spawned process to be ready") -> None:
    """Wait until ``process`` sets ``event``, for as long as it lives: on a loaded machine a spawned
    process may take minutes to import, so no window decides; one that exits first fails at once,
    naming its exit code (pytest-timeout bounds a hang)."""
    while not event.wait(0.2):
        assert process.is_alive(), f"{what}: it exited first, with {process.exitcode}"


class Clock:
    """A clock the test sets: claims and leases are judged by it, so no test sleeps a TTL out."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def set(self, moment: float) -> None:
        self.now = moment

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Iterator[Clock]:
    """Claims and leases judged by a settable clock (starting at the real time) for this test."""
    from rollout_capture.claims import clock_set

    with clock_set(Clock()) as set_clock:
        assert isinstance(set_clock, Clock)
        yield set_clock


@pytest.fixture(autouse=True)
def _fresh_module_caches() -> Iterator[None]:
    """Every test starts as a fresh process would: no shared stores, no resolved credentials."""
    yield
    from rollout_capture.store import forget_shared_stores

    forget_shared_stores()
    credentials = sys.modules.get("rollout_capture.tasks.credentials")
    if credentials is not None:  # only once a test imported it (it imports Prefect)
        credentials.forget_resolved()


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """A committed slice of the shared NeMo Gym corpus (real records, real bad rows)."""
    return CORPUS


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3 HTTP endpoint on 127.0.0.1 (moto server mode), for the whole session."""
    from .support.moto_s3 import AtomicMotoServer  # its conditional writes atomic, as S3's

    server = AtomicMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def fake_gcs_endpoint() -> Iterator[str]:
    """fake-gcs-server on 127.0.0.1 for the whole session; ``STORAGE_EMULATOR_HOST`` names it."""
    from .support.stores import session_folder, start_fake_gcs

    with _session_server(start_fake_gcs, session_folder("gcs"), "STORAGE_EMULATOR_HOST", str) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def azurite_endpoint() -> Iterator[str]:
    """Azurite's blob service on 127.0.0.1 for the whole session; ``AZURE_STORAGE_CONNECTION_STRING``
    names it (the development account Azurite publishes)."""
    from .support.stores import azurite_connection_string, session_folder, start_azurite

    with _session_server(
        start_azurite, session_folder("azurite"), "AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string
    ) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def rclone_endpoint() -> Iterator[str]:
    """``rclone serve s3`` over a temporary folder on 127.0.0.1, for the whole session."""
    from .support.stores import session_folder, start_rclone

    with _session_server(start_rclone, session_folder("rclone"), None, str) as endpoint:
        yield endpoint


@contextlib.contextmanager
def _session_server(
    start: Callable[[str], tuple[Any, str]], folder: str, variable: str | None, value: Callable[[str], str]
) -> Iterator[str]:
    """A server started in ``folder``, the environment ``variable`` set to reach it while it runs."""
    server, endpoint = start(folder)
    if variable is not None:
        os.environ[variable] = value(endpoint)
    try:
        yield endpoint
    finally:
        if variable is not None:
            os.environ.pop(variable, None)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


STORE_ENDPOINTS = {"s3": "moto_endpoint", "gcs": "fake_gcs_endpoint", "azure": "azurite_endpoint"}
STORE_VARIABLES = {"gcs": "STORAGE_EMULATOR_HOST", "azure": "AZURE_STORAGE_CONNECTION_STRING"}


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Any:
    """A fresh bucket on the real server of the store the test is parametrized with (``indirect``):
    ``s3`` (moto), ``gcs`` (fake-gcs-server), ``azure`` (Azurite) or ``rclone`` (``rclone serve s3``)."""
    return open_store(request, request.param)


def open_store(request: pytest.FixtureRequest, kind: str) -> Any:
    """A fresh bucket on the session's server of ``kind`` (started on first use)."""
    from .support.stores import Store

    endpoint: str = request.getfixturevalue("rclone_endpoint" if kind == "rclone" else STORE_ENDPOINTS[kind])
    if kind == "s3":
        request.getfixturevalue("s3")  # moto reset for this test, as the s3 fixture does
    variable = STORE_VARIABLES.get(kind)
    return Store(kind, endpoint, {variable: os.environ[variable]} if variable else {}).create_bucket()


class S3:
    """One fresh bucket on the moto endpoint, and how to reach it."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.storage_options: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint}}

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path}".rstrip("/")

    def fs(self) -> Any:
        import fsspec

        return fsspec.filesystem(  # dummy keys of its own: works in tests that empty the environment
            "s3",
            use_listings_cache=False,
            skip_instance_cache=True,
            key="testing",
            secret="testing",
            **self.storage_options,
        )


@pytest.fixture
def s3(moto_endpoint: str) -> S3:
    """Reset the endpoint and create an empty bucket for this test."""
    request = urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(request).close()
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    S3(moto_endpoint, bucket).fs().mkdir(bucket)
    return S3(moto_endpoint, bucket)


# botocore's own retries off: s3fs then gives up on a dead endpoint in about half a second,
# so a test outage of a few seconds outlasts it and only Prefect's retries can save the run.
# The proxy's outages refuse or cut connections (an error at once, whatever the timeouts), so the
# timeouts are long: an answer slow on a loaded machine is no outage, and a request timed out and
# sent again would change the counts the tests check (a 2 s read timeout did, under load).
FAST_FAIL = {
    "config_kwargs": {
        "retries": {"max_attempts": 1, "mode": "standard"},
        "connect_timeout": 10,
        "read_timeout": 60,
    }
}


@pytest.fixture
def flaky_s3(s3: S3) -> Iterator[tuple[S3, Any]]:
    """The test bucket reached through a proxy that can go down on demand."""
    from .support.fault_proxy import FaultProxy

    host, port = s3.endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    via = S3(proxy.endpoint, s3.bucket)
    via.storage_options = {**via.storage_options, **FAST_FAIL}
    try:
        yield via, proxy
    finally:
        proxy.close()


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect API (temporary SQLite database) for the whole session."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # The harness polls the server's health and counts 0.1 s a poll, however long a poll takes:
    # a start that needs a minute and more on a loaded machine must not fail every Prefect test
    # of the worker (a session fixture's error is each later test's). pytest-timeout still bounds it.
    with prefect_test_harness(server_startup_timeout=240):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def scripted_upstream() -> Iterator[tuple[str, Any]]:
    """The scripted model server on a loopback port, for the whole session: ``(url, app)``."""
    from .support.scripted_upstream import ScriptedUpstream
    from .support.servers import ThreadedServer

    app = ScriptedUpstream()
    server = ThreadedServer(app)
    try:
        yield server.url, app
    finally:
        server.stop()


def pytest_addoption(parser: Any) -> None:
    """``--sim-seed N``: run one schedule of the protocol simulations alone (a failing seed replays)."""
    parser.addoption("--sim-seed", default=None, help="replay one seed of the journal simulation")


# The `integration` marker: a test that starts a server, a cluster, a browser or the CLI in a
# process of its own. Marked here at collection, from what the test reaches (its fixtures, and the
# code of the test and of the tests' helpers it calls), so a test moved to another file stays marked.
SERVER_FIXTURES = frozenset(
    {
        *(
            "moto_endpoint",
            "s3",
            "flaky_s3",
            "prefect_api",
            "scripted_upstream",
            "dask_cluster",
            "ray_cluster",
        ),
        *("fake_gcs_endpoint", "azurite_endpoint", "rclone_endpoint", "store"),
    }
)
STARTERS = frozenset(
    {
        "ThreadedServer",  # uvicorn on a loopback port (tests/support/servers.py)
        "ThreadedMotoServer",
        "AtomicMotoServer",
        "start_fake_gcs",  # the stores' servers (tests/support/stores.py)
        "start_azurite",
        "start_rclone",
        "FaultProxy",  # a TCP proxy in front of the S3 endpoint
        "LocalCluster",
        "DaskTaskRunner",
        "RayTaskRunner",
        "prefect_test_harness",
        "listen",  # a raw socket server of the test's own
        "HTTPServer",  # the standard library's (http.server, socketserver)
        "ThreadingHTTPServer",
        "TCPServer",
        "ThreadingTCPServer",
        "AppRunner",  # aiohttp's server
        "start_server",  # asyncio's
        "phoenix_server",  # `phoenix serve` in a process of its own (tests/support/phoenix.py)
    }
)
CLI_PROCESS = "rollout_capture.cli"  # `python -m rollout_capture.cli ...` in a subprocess
_TESTS_PACKAGE = __name__.rpartition(".")[0]


def _is_tests_code(value: Any) -> bool:
    module = getattr(value, "__module__", None) or ""
    return isinstance(module, str) and (module == _TESTS_PACKAGE or module.startswith(_TESTS_PACKAGE + "."))


def _is_server_class(value: Any) -> bool:
    """A server class of the tests' own (an ``http.server`` or ``socketserver`` subclass, such as
    tests/support/otlp_receiver.py's): making one binds and listens, whatever it is called."""
    return inspect.isclass(value) and issubclass(value, socketserver.BaseServer)


def _functions_of(value: Any) -> list[types.FunctionType]:
    """The plain functions a test-side object runs: itself, or a class's methods and properties."""
    members = list(vars(value).values()) if inspect.isclass(value) else [value]
    found = []
    for member in members:
        member = member.fget if isinstance(member, property) else member
        member = getattr(member, "__func__", member)  # static and class methods
        member = inspect.unwrap(member) if inspect.isfunction(member) else member
        if inspect.isfunction(member):
            found.append(member)
    return found


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _strings(consts: Any) -> Iterator[str]:
    """The strings among a code object's constants, in tuples too (``["-m", "x"]`` is one)."""
    for const in consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, tuple | frozenset):
            yield from _strings(const)


def _tests_namespace() -> dict[str, Any]:
    """Every name the loaded tests modules define: where a locally imported name comes from
    (``from .test_proxy import Spawned`` inside a test)."""
    found: dict[str, Any] = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(_TESTS_PACKAGE + "."):
            found.update({name: value for name, value in vars(module).items() if _is_tests_code(value)})
    return found


def _reaches(function: types.FunctionType, seen: dict[Any, set[str]], local: dict[str, Any]) -> set[str]:
    """What a function of the tests, or a helper of the tests it calls, starts (the starters'
    names) and asks for by name (``request.getfixturevalue("s3")``)."""
    if function in seen:
        return seen[function]
    found: set[str] = set()
    seen[function] = found  # a cycle adds nothing
    for code in _code_objects(function.__code__):
        strings = set(_strings(code.co_consts))
        found.update({CLI_PROCESS} & strings)
        if "getfixturevalue" in code.co_names:
            found.update(strings & SERVER_FIXTURES)
        found.update(STARTERS.intersection(code.co_names))
        for name in code.co_names:
            if name in function.__globals__:
                value = function.__globals__[name]
            elif name in code.co_varnames or name in code.co_cellvars:  # imported in the function
                value = local.get(name)
            else:
                continue
            if isinstance(value, list | tuple) and CLI_PROCESS in _strings(tuple(value)):
                found.add(CLI_PROCESS)  # a command line named once (tests/support/cli.py's CLI)
            if _is_tests_code(value):
                if _is_server_class(value):
                    found.add(value.__name__)
                for inner in _functions_of(value):
                    found.update(_reaches(inner, seen, local))
    return found


def _params(item: pytest.Item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    values = callspec.params.values() if callspec is not None else ()
    return {value for value in values if isinstance(value, str)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``integration`` every test whose fixtures or code start a server, cluster or CLI process.

    A fixture that asks for a server fixture by name only for some of its parameters (``s3`` among
    local folders) marks only the tests run with a parameter naming it."""
    seen: dict[Any, set[str]] = {}
    local = _tests_namespace()
    for item in items:
        if item.get_closest_marker("integration"):
            continue
        fixturenames = set(getattr(item, "fixturenames", ()))
        functions = _functions_of(getattr(item, "function", None))
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name in fixturenames:
            functions += [d.func for d in definitions.get(name, ()) if _is_tests_code(d.func)]
        reached = set().union(*(_reaches(function, seen, local) for function in functions))
        asked = reached & SERVER_FIXTURES
        params = _params(item)
        by_param = any(name in value for name in asked for value in params) or bool(asked and not params)
        if fixturenames & SERVER_FIXTURES or reached - SERVER_FIXTURES or by_param:
            item.add_marker(pytest.mark.integration)
    for item in items:
        marked = item.get_closest_marker("integration") is not None
        COLLECTED[item.nodeid] = (marked, frozenset(getattr(item, "fixturenames", ())))
    items.sort(key=_slowest_first)  # stable: a file's tests stay together, in their order


SLOWEST_FIRST = (
    "test_deployments.py",
    "test_clusters.py",
    "test_s3_reads.py",
    "test_follow.py",
    "test_traces_endpoint.py",
    "test_traces.py",
    "test_journal.py",
    "test_cli.py",
    "test_install.py",
    "test_production.py",
    "test_stores.py",
    "test_cli_enrich.py",
    "test_run_folders.py",
    "test_producer_hold.py",
)
"""The files that take longest (measured: ``--durations``), run first so that the two workers of
``make test``, each taking a file at a time (``--dist loadfile --no-loadscope-reorder``), end
together; xdist's own order puts the files with the most tests first, and these last."""


def _slowest_first(item: pytest.Item) -> int:
    name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)


COLLECTED: dict[str, tuple[bool, frozenset[str]]] = {}
"""Every test collected, before ``-m`` deselects any: whether it is marked ``integration``, and its
fixtures (tests/test_markers.py checks the marking in a run that leaves those tests out)."""


# `-m "not integration"` (make test-fast) holds the marker to its word: a test left unmarked that
# opens a listening socket (a server the code above did not see coming) fails, naming the fix.
_LISTENING: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Count listening sockets in a run that leaves the integration tests out; Ctrl-C reaches the
    processes the tests start and stop with SIGINT (serve, workers) however the suite was started:
    a shell's background job ignores SIGINT, and its children would inherit that (a serve stopped
    by SIGINT then polled on until the test timed out)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # children start with SIGINT's default
    if "not integration" not in (config.getoption("markexpr", "") or ""):
        return
    original = socket.socket.listen

    def listen(self: socket.socket, *args: Any) -> None:
        _LISTENING.append(repr(self.getsockname()))
        original(self, *args)

    socket.socket.listen = listen  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _unit_tests_start_no_server(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a run without the integration tests, fail a test that started a server anyway."""
    before = len(_LISTENING)
    yield
    started = _LISTENING[before:]
    if started and request.node.get_closest_marker("integration") is None:
        pytest.fail(
            f"a test left unmarked listened on {', '.join(started)}: mark it integration "
            "(or add what starts the server to STARTERS in tests/conftest.py)",
            pytrace=False,
        )
