"""The released NeMo Gym 0.7.0 itself, record for record, both ways (issue 34).

Run by ``make test-nemo-gym`` (and so by ``.ci/run``): it builds a Python 3.13 venv holding the
``nemo-gym==0.7.0`` wheel beside rollout-capture and names its interpreter in ``NEMO_GYM_PYTHON``;
without it these tests are skipped. NeMo Gym runs as processes of its own
(tests/support/nemo_gym_side.py), one scenario is driven through each producer, and each capture
dir is read by NeMo Gym's merge and by ours:

- A: NeMo Gym 0.7.0's producer (``install_model_call_capture`` on its model servers) writes; its
  merge and ours must give the same records, field by field.
- B: our middleware (on the very same model-server app) and our proxy write; NeMo Gym's merge and
  ours must give the same records. And what ours write reads in NeMo Gym as what its own producer
  wrote for the same scenario (item 4).
- C (tests/test_nemo_gym_070_collection.py): NeMo Gym's own rollout collection, end to end.

The scenario runs once, as this module's fixture: ``make test-nemo-gym`` keeps a module on one
xdist worker (``--dist loadfile``), C's module on the other.

The only differences allowed are the fields the contract names as ours (``DOCUMENTED``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_capture import merge_model_call_capture_into_record
from rollout_capture.producer import CaptureMiddleware
from rollout_capture.producer.proxy import CaptureProxy
from rollout_capture.producer.settings import ProxySettings

from .conftest import wait_for
from .support.hostile_rows import VERSIONS, inflating_row, whitespace_row
from .support.nemo_gym_compare import (
    Tally,
    compare,
    print_counts,
)
from .support.scripted_upstream import CHAT, ScriptedUpstream
from .support.servers import ThreadedServer

NG_PYTHON = os.environ.get("NEMO_GYM_PYTHON")
SIDE = Path(__file__).resolve().parent / "support" / "nemo_gym_side.py"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1800),  # NeMo Gym's servers and imports start slowly on a busy machine
    pytest.mark.skipif(not NG_PYTHON, reason="NeMo Gym 0.7.0's own tier: run by `make test-nemo-gym`"),
]

# ---------------------------------------------------------------- the scenario

LEAVER = "scripted-gated-leave"
"""The model a client that leaves mid-stream asks for (:func:`_leave`)."""
PATHS = {"chat": "v1/chat/completions", "responses": "v1/responses", "messages": "v1/messages"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def body(dialect: str, model: str, stream: bool, usage: bool = False) -> dict[str, Any]:
    if dialect == "chat":
        sent: dict[str, Any] = {"model": model, "messages": ASK, "stream": stream}
        if usage:
            sent["stream_options"] = {"include_usage": True}
        return sent
    if dialect == "responses":
        return {"model": model, "input": "What is the weather in Paris?", "stream": stream}
    return {"model": model, "max_tokens": 64, "messages": ASK, "stream": stream}


# (rollout id, step): ("call", server, dialect, model, stream[, usage]), ("leave", server, dialect),
# ("verify", invocation id, judge calls). Two model servers: policy and judge.
SCENARIO: list[tuple[str, tuple[Any, ...]]] = [
    *[("0-0", ("call", "policy", d, "scripted", False)) for d in ("chat", "responses", "messages")],
    *[("1-0", ("call", "policy", d, "scripted", True)) for d in ("chat", "responses", "messages")],
    ("2-0", ("call", "policy", "chat", "scripted", True, True)),
    ("2-0", ("call", "policy", "chat", "scripted-429", False)),
    ("2-0", ("call", "policy", "chat", "scripted-500", False)),
    ("3-0", ("call", "policy", "chat", "scripted-cut", True)),
    ("3-0", ("call", "policy", "responses", "scripted-cut", True)),
    ("4-0", ("call", "policy", "chat", "scripted", False)),
    ("4-0", ("leave", "policy", "chat")),
    ("5-0", ("call", "policy", "chat", "scripted-tools-only", True, True)),
    ("5-0", ("call", "policy", "chat", "scripted-stream-error", True, True)),
    ("5-0", ("call", "policy", "messages", "scripted-stream-error", True)),
    *[("6-0-a1", ("call", "policy", "chat", "scripted", False)) for _ in range(2)],
    ("explicit-7", ("call", "policy", "responses", "scripted", False)),
    ("explicit-7", ("call", "policy", "messages", "scripted", True)),
    ("8-0", ("call", "policy", "chat", "scripted", False)),
    ("8-0", ("verify", "v-8-0", [("chat", "scripted")])),
    ("9-0", ("call", "policy", "responses", "scripted", True)),
    ("9-0", ("verify", "v-9-0-a", [("chat", "scripted"), ("messages", "scripted")])),
    ("9-0", ("verify", "v-9-0-b", [("responses", "scripted")])),
    ("10-0", ("call", "policy", "chat", "scripted", False)),
    ("12-0", ("call", "policy", "messages", "scripted", False)),
    ("13-0", ("call", "policy", "messages", "scripted-429", False)),
    ("13-0", ("call", "policy", "responses", "scripted-500", False)),
    ("14-0", ("call", "judge", "chat", "scripted", False)),
    *[("15-0", ("call", "policy", "chat", "scripted", False)) for _ in range(6)],
    ("16-0", ("call", "policy", "responses", "scripted", True)),
    ("16-0", ("call", "policy", "messages", "scripted", True)),
    *[("17-0", ("call", "policy", d, "scripted", False)) for d in ("messages", "chat", "responses")],
    *[("17-0", ("call", "judge", d, "scripted", True)) for d in ("chat", "responses")],
    *[("18-0", ("call", "policy", "chat", "scripted", s, s)) for s in (False, True, False)],
]
DAMAGED = {"10-0": [b'{"torn": ', b"[1, 2]"]}
INCOMPLETE = ["12-0"]


def records() -> list[dict[str, Any]]:
    """The rollout records the scenario's captures are merged into (one without any call, one
    without an id, an attempt, an explicit id)."""
    out: list[dict[str, Any]] = []
    for task in range(19):
        if task == 7:
            out.append({"_ng_rollout_id": "explicit-7", "_ng_task_index": 7, "_ng_rollout_index": 0})
            continue
        record: dict[str, Any] = {"_ng_task_index": task, "_ng_rollout_index": 0, "reward": task % 2}
        if task == 6:
            record["_ng_attempt_index"] = 1
        out.append(record)
    out.append({"reward": 0.0, "response": {"output": []}})  # no id: left as it is
    return out


class Producers:
    """Where the scenario's calls go: the policy and judge model servers, the verifier."""

    def __init__(
        self,
        policy: str,
        judge: str,
        verifier: str,
        capture_dir: Path,
        upstream: ScriptedUpstream,
        verify_rows: bool = True,
    ):
        self.urls = {"policy": policy, "judge": judge}
        self.verifier = verifier
        self.capture_dir = capture_dir
        self.upstream = upstream
        self.verify_rows = verify_rows  # NeMo Gym's verifier records no row

    def rows(self, rollout: str) -> int:
        """Lines the rollout's capture holds now (a row a line, as both producers append them)."""
        path = self.capture_dir / f"{rollout}.capture.jsonl"
        return path.read_bytes().count(b"\n") if path.exists() else 0

    def landed(self, rollout: str, before: int) -> None:
        """Wait for the step's row: a row is written after its answer (both producers), so a call
        to another server (the judge after the policy) could land its row first on a loaded
        machine and NeMo Gym's merge, counting rows in file order, would compare other calls."""
        wait_for(lambda: self.rows(rollout) > before, 300, f"the row of a call of {rollout}", poll_s=0.01)


def run_scenario(producers: Producers, http: httpx.Client) -> None:
    """Every step of the scenario, in order, through ``producers`` (on ``http``'s kept-alive
    connections); then the damage."""
    for rollout, step in SCENARIO:
        before = producers.rows(rollout)
        if step[0] == "call":
            _, server, dialect, model, stream, *usage = step
            _call(http, producers.urls[server], rollout, dialect, body(dialect, model, stream, bool(usage)))
            producers.landed(rollout, before)
        elif step[0] == "leave":
            _leave(producers, rollout, step[1], step[2])
        else:
            _, invocation, judged = step
            header = {"X-Rollout-Capture-Verifier-Invocation-Id": invocation}
            verify = http.post(f"{producers.verifier}/ng-rollout/{rollout}/verify", json={}, headers=header)
            assert verify.status_code == 200
            if producers.verify_rows:
                producers.landed(rollout, before)
            for dialect, model in judged:
                before = producers.rows(rollout)
                _call(http, producers.urls["judge"], rollout, dialect, body(dialect, model, False), header)
                producers.landed(rollout, before)
    for rollout, lines in DAMAGED.items():
        with open(producers.capture_dir / f"{rollout}.capture.jsonl", "ab") as capture:
            capture.write(b"".join(line + b"\n" for line in lines))
    for rollout in INCOMPLETE:
        (producers.capture_dir / f"{rollout}.capture.incomplete").touch()


def _call(
    http: httpx.Client, base: str, rollout: str, dialect: str, sent: dict[str, Any], headers: Any = None
) -> None:
    url = f"{base}/ng-rollout/{rollout}/{PATHS[dialect]}"
    with http.stream("POST", url, json=sent, headers=headers) as answer:
        answer.read()


def _leave(producers: Producers, rollout: str, server: str, dialect: str) -> None:
    """A client that reads the first event of a stream, then goes away, on a connection of its own
    (as a client that gives up closes it). The upstream waits at its gate meanwhile (until the
    scenario is over): the call ends by its client leaving, never by the stream's end. Its row is
    read once the producer has stopped (:func:`record_scenario`), so nothing waits for it here."""
    url = f"{producers.urls[server]}/ng-rollout/{rollout}/{PATHS[dialect]}"
    with (
        httpx.Client(timeout=60) as fresh,
        fresh.stream("POST", url, json=body(dialect, LEAVER, True, True)) as answer,
    ):
        assert next(answer.iter_raw()).startswith(b"data: ")


# ---------------------------------------------------------------- the producers


def verifier_app(capture_dir: Path | None) -> Any:
    """A resources server's verify: a reward (the judge calls follow, made by the driver)."""

    async def verify(request: Request) -> JSONResponse:
        return JSONResponse({**(await request.json()), "reward": 1.0})

    app = Starlette(routes=[Route("/verify", verify, methods=["POST"])])
    if capture_dir is None:  # NeMo Gym records no verify call: the prefix is only stripped
        app.add_middleware(CaptureMiddleware, enabled=False)
    else:
        app.add_middleware(CaptureMiddleware, capture_dir=str(capture_dir), server_name="verifier")
    return app


class NeMoGymServers:
    """Model servers as NeMo Gym 0.7.0 builds and runs them (its middlewares, the cancellation of a
    call whose client left, its uvicorn settings), in a Python 3.13 process: with NeMo Gym's own
    capture (``producer="nemo-gym"``) or our middleware in its place (``"ours"``)."""

    def __init__(self, upstream: str, capture_dir: Path, names: list[str], producer: str) -> None:
        assert NG_PYTHON is not None
        command = [NG_PYTHON, str(SIDE), "serve", "--upstream", upstream, "--capture-dir", str(capture_dir)]
        self.process = subprocess.Popen(
            [*command, "--producer", producer, *names],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, "NeMo Gym's servers did not start"
        self.urls = {name: f"http://127.0.0.1:{port}" for name, port in json.loads(line)["ports"].items()}

    def stop(self) -> None:
        """Its standard input closed, the process stops its servers and exits: every row written."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait() == 0


def _stop_and_wait(served: ThreadedServer) -> Callable[[], None]:
    """Stop an in-process server and wait for its thread's end (its lifespan's shutdown: every
    write in flight finished), however long that takes on a busy machine."""

    def stop() -> None:
        served.server.should_exit = True
        served.thread.join()
        served.sock.close()

    return stop


def record_scenario(kind: str, root: Path) -> Path:
    """Run the scenario through one producer (``nemo-gym``, ``middleware`` or ``proxy``) into a
    capture dir of its own; its upstream is a fresh scripted server."""
    capture_dir = root / kind
    capture_dir.mkdir(parents=True)
    upstream_app = ScriptedUpstream()
    upstream = ThreadedServer(upstream_app)
    stops: list[Callable[[], None]] = [upstream.stop]
    http = httpx.Client(timeout=60)
    try:
        if kind in ("nemo-gym", "middleware"):  # our middleware on NeMo Gym's very server
            gym = NeMoGymServers(
                upstream.url, capture_dir, ["policy", "judge"], "nemo-gym" if kind == "nemo-gym" else "ours"
            )
            stops.append(gym.stop)
            urls = gym.urls
            verifier = ThreadedServer(verifier_app(None if kind == "nemo-gym" else capture_dir))
        else:
            urls = {}
            for name in ("policy", "judge"):
                proxy = CaptureProxy(
                    ProxySettings(upstream=upstream.url, capture_dir=str(capture_dir), server_name=name)
                )
                served = ThreadedServer(proxy)
                stops.append(_stop_and_wait(served))
                urls[name] = served.url
            verifier = ThreadedServer(verifier_app(capture_dir))
        stops.append(_stop_and_wait(verifier))
        # The client's connections close once the producers have stopped, never before: NeMo Gym
        # 0.7.0's server lets a plain answer's body reach the client before its row is written
        # (its session middleware, inside the capture, sends the body in a message of its own
        # ahead of the closing one the capture holds back), and a client that closes its
        # connection then has the row cancelled with the call (ClientDisconnectCancellationMiddleware)
        # before its thread starts: the scenario's last call would lose its row, by chance.
        stops.insert(0, http.close)
        producers = Producers(
            urls["policy"],
            urls["judge"],
            verifier.url,
            capture_dir,
            upstream_app,
            verify_rows=kind != "nemo-gym",
        )
        run_scenario(producers, http)
    finally:
        upstream_app.gate("leave").set()
        for stop in reversed(stops):
            stop()
    return capture_dir


def nemo_gym_merge(
    captures: dict[str, Path], root: Path, *, payloads: bool = True
) -> dict[str, list[dict[str, Any]]]:
    """NeMo Gym 0.7.0's own merge of every record, of each capture dir, in one Python 3.13 process."""
    assert NG_PYTHON is not None
    given = root / "records.jsonl"
    given.write_text("".join(json.dumps(r) + "\n" for r in records()))
    outs = {kind: root / f"{kind}.nemo-gym.jsonl" for kind in captures}
    command = [NG_PYTHON, str(SIDE), "merge", "--records", str(given)]
    command += [f"{captures[kind]}={outs[kind]}" for kind in captures]
    subprocess.run([*command, *(["--payloads"] if payloads else [])], check=True, timeout=900)
    merged = {}
    for kind, out in outs.items():
        meta, *lines = (json.loads(line) for line in out.read_text().splitlines())
        assert meta["nemo_gym"] == "0.7.0" and meta["python"].startswith("3.13.")
        merged[kind] = lines
    return merged


def our_merge(capture_dir: Path, *, payloads: bool = True) -> list[dict[str, Any]]:
    return [
        merge_model_call_capture_into_record(r, [capture_dir], include_payloads=payloads) for r in records()
    ]


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("nemo-gym-070")
    yield {kind: record_scenario(kind, root) for kind in ("nemo-gym", "middleware", "proxy")}


@pytest.fixture(scope="module")
def gym_merged(captures: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each capture dir as NeMo Gym 0.7.0's merge reads it."""
    return nemo_gym_merge(captures, tmp_path_factory.mktemp("nemo-gym-merged"))


def test_a_nemo_gyms_captures_read_the_same_in_ours(
    captures: dict[str, Path], gym_merged: dict[str, Any]
) -> None:
    tally = Tally()
    compare(gym_merged["nemo-gym"], our_merge(captures["nemo-gym"]), tally)
    print_counts("A: 0.7.0's producer, its merge vs ours", tally)
    assert tally.differences == [] and tally.records >= 18
    # Every call of the scenario, but maybe the one whose client left (contract 12: row lost).
    assert tally.calls in (SCENARIO_CALLS, SCENARIO_CALLS - 1)
    assert tally.equal == tally.calls


@pytest.mark.parametrize("producer", ["middleware", "proxy"])
def test_b_our_captures_read_the_same_in_nemo_gym(
    captures: dict[str, Path], gym_merged: dict[str, Any], producer: str
) -> None:
    tally = Tally()
    compare(gym_merged[producer], our_merge(captures[producer]), tally)
    print_counts(f"B: our {producer}, NeMo Gym's merge vs ours", tally)
    assert tally.differences == [] and tally.calls == SCENARIO_CALLS and tally.records >= 18
    assert tally.equal == tally.calls


def test_b_nemo_gyms_own_clear_takes_our_verifier_evidence_with_the_calls(
    captures: dict[str, Path], tmp_path: Path
) -> None:
    """NeMo Gym 0.7.0's own clear before dispatch (it deletes ``R.capture.jsonl`` and the marker)
    leaves nothing of a rollout our middleware recorded, its verify calls' rows included: the next
    rollout of the id starts clean, read alike by NeMo Gym's merge and ours."""
    assert NG_PYTHON is not None
    verified = {"8-0", "9-0"}  # the rollouts with verify calls
    before = {rollout_id_of_record(r): r for r in our_merge(captures["middleware"])}
    assert all(before[v]["ng_model_call_capture"]["verifier_invocations"] for v in verified)
    cleared = tmp_path / "cleared"
    shutil.copytree(captures["middleware"], cleared)
    given = tmp_path / "dispatched.jsonl"
    given.write_text("".join(json.dumps(r) + "\n" for r in records() if rollout_id_of_record(r) in verified))
    command = [NG_PYTHON, str(SIDE), "clear", "--records", str(given), "--capture-dir", str(cleared)]
    subprocess.run(command, check=True, timeout=900)
    (tmp_path / "merged").mkdir()
    tally = Tally()
    compare(nemo_gym_merge({"cleared": cleared}, tmp_path / "merged")["cleared"], our_merge(cleared), tally)
    assert tally.differences == []
    after = {rollout_id_of_record(r): r for r in our_merge(cleared)}
    for rollout in verified:
        capture = after[rollout]["ng_model_call_capture"]
        assert capture["calls"] == [] and "verifier_invocations" not in capture
        assert capture["gaps"] == [{"code": "model_call_capture_no_records"}]


TIMING = frozenset({"model_call_id", "started_at", "completed_at", "latency_total_ms", "latency_ttft_ms"})
"""What differs from one run to the next whoever records it."""


def scenario_calls_of(rollout: str) -> list[tuple[str, str, bool, bool]]:
    """The scenario's calls of one rollout, in order: ``(dialect, model, stream, usage asked)``."""
    out: list[tuple[str, str, bool, bool]] = []
    for rollout_id, step in SCENARIO:
        if rollout_id != rollout:
            continue
        if step[0] == "call":
            _, _, dialect, model, stream, *usage = step
            out.append((dialect, model, stream, bool(usage)))
        elif step[0] == "leave":
            out.append((step[2], LEAVER, True, True))
        else:
            out += [(dialect, model, False, False) for dialect, model in step[2]]
    return out


SCENARIO_CALLS = sum(len(scenario_calls_of(rollout)) for rollout in dict.fromkeys(r for r, _ in SCENARIO))
"""Every model call the scenario makes (the verifiers' judge calls too)."""


def _producer_asks_usage(call: tuple[str, str, bool, bool]) -> bool:
    """Whether ours asks the upstream for usage the client did not ask for (a chat stream without it)."""
    return call[0] == "chat" and call[2] and not call[3]


# Each difference of ours from NeMo Gym's producer, by its label in contract 12 ("Our producers
# beside NeMo Gym's", whose labels tests/test_docs.py holds equal to these): the fields it may
# touch, and in which calls.
DOCUMENTED_PRODUCER_DIFFERENCES: dict[str, tuple[str, Callable[[tuple[str, str, bool, bool], str], bool]]] = {
    "usage asked": (
        r"\.(tokens_in|tokens_out|tokens_reasoning|tokens_total|cache_hit|cached_tokens|response\.usage)$",
        lambda call, producer: _producer_asks_usage(call),
    ),
    "usage asked, cut": (
        r"\.response\.choices\[0\]\.message\.content$",
        lambda call, producer: _producer_asks_usage(call) and call[1] == "scripted-cut",
    ),
    "raw stream text": (r"\.response_raw$", lambda call, producer: call[2] and call[1] != LEAVER),
    "anthropic stream": (
        r"\.response\.(content\[\d+\]\.signature|stop_sequence|stop_reason)$",
        lambda call, producer: call[0] == "messages" and call[2],
    ),
    "responses cut": (
        r"\.(reasoning_content|tool_calls|response\.output)$",
        lambda call, producer: call[0] == "responses" and call[1] == "scripted-cut",
    ),
    "several choices": (
        r"\.response\.choices\[[1-9]\d*\]",
        lambda call, producer: False,  # the scenario asks one choice of each call
    ),
    "client left, partial response": (
        r"\.(response|response_raw|response_id|model)$",
        lambda call, producer: call[1] == LEAVER,
    ),
    "client left, row lost": (
        r"^$",  # not a field: a whole row, taken out before comparing (:func:`_leaver_row_lost`)
        lambda call, producer: False,
    ),
}
"""Where what ours writes reads otherwise than NeMo Gym's producer wrote it, in NeMo Gym's merge."""


def _leaver_row_lost(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> int:
    """Contract 12, ``client left, row lost``: NeMo Gym 0.7.0's capture may write no row for the
    call whose client left (its ``asyncio.to_thread`` cancelled before a thread starts it). Where
    it wrote none, that call of ours is taken out (and out of ``num_calls``) before the records
    are compared; every other call must still match. How many were taken out."""
    taken = 0
    for gym, mine in zip(theirs, ours, strict=True):
        gym_capture, my_capture = gym.get("ng_model_call_capture"), mine.get("ng_model_call_capture")
        if not gym_capture or not my_capture:
            continue
        leavers = [c for c in my_capture["calls"] if (c.get("request") or {}).get("model") == LEAVER]
        if not leavers or any((c.get("request") or {}).get("model") == LEAVER for c in gym_capture["calls"]):
            continue
        assert len(gym_capture["calls"]) == len(my_capture["calls"]) - len(leavers)
        my_capture["calls"] = [c for c in my_capture["calls"] if c not in leavers]
        my_capture["metrics"]["num_calls"] -= len(leavers)
        taken += len(leavers)
    return taken


def _without_timing(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for record in records:
        capture = record.get("ng_model_call_capture")
        if capture is not None:
            metrics = {k: v for k, v in capture["metrics"].items() if k != "latency_total_ms"}
            calls = [{k: v for k, v in call.items() if k not in TIMING} for call in capture["calls"]]
            record = {**record, "ng_model_call_capture": {**capture, "metrics": metrics, "calls": calls}}
        out.append(record)
    return out


def undocumented_differences(differences: list[str], producer: str) -> tuple[list[str], dict[str, int]]:
    """The differences no documented one explains, and how many each explains. A rollout's metrics
    differ exactly when one of its calls does by a documented field (its sums follow)."""
    import re

    ids = [rollout_id_of_record(r) for r in records()]
    left: list[str] = []
    used: dict[str, int] = {}
    for line in differences:
        path = line.split(": NeMo Gym ")[0]
        found = re.match(r"record (\d+)( call (\d+))?\.(.*)$", path)
        assert found, line
        rollout = ids[int(found.group(1))]
        field = found.group(4)
        if found.group(2) is None:  # the rollout's metrics: a sum of a documented difference
            ok = field.startswith("metrics.") and field != "metrics.num_calls"
            ok = (
                ok
                and any(_producer_asks_usage(c) for c in scenario_calls_of(rollout))
                and not field.endswith("latency_total_ms")
            )
            if ok:
                used["metrics follow their calls"] = used.get("metrics follow their calls", 0) + 1
            else:
                left.append(line)
            continue
        call = scenario_calls_of(rollout)[int(found.group(3))]
        for reason, (pattern, applies) in DOCUMENTED_PRODUCER_DIFFERENCES.items():
            if re.search(pattern, "." + field) and applies(call, producer):
                used[reason] = used.get(reason, 0) + 1
                break
        else:
            left.append(line)
    return left, used


def rollout_id_of_record(record: dict[str, Any]) -> str | None:
    if "_ng_rollout_id" in record:
        return str(record["_ng_rollout_id"])
    if "_ng_task_index" not in record:
        return None
    suffix = f"-a{record['_ng_attempt_index']}" if record.get("_ng_attempt_index") else ""
    return f"{record['_ng_task_index']}-{record['_ng_rollout_index']}{suffix}"


@pytest.mark.parametrize("producer", ["middleware", "proxy"])
def test_b_ours_read_in_nemo_gym_as_its_own_producers_captures(
    gym_merged: dict[str, Any], producer: str
) -> None:
    """Item 4: the same scenario recorded by NeMo Gym 0.7.0's producer and by ours, both read by
    NeMo Gym's merge: the same calls, counts, categories and tool calls (a client that left
    mid-stream, a chat stream of tool calls alone, ``event:error``), but for timings, ids and the
    differences the contract names and says why (``DOCUMENTED_PRODUCER_DIFFERENCES``)."""
    theirs = _without_timing(gym_merged["nemo-gym"])
    ours = _without_timing(gym_merged[producer])
    lost = _leaver_row_lost(theirs, ours)
    tally = Tally()
    compare(theirs, ours, tally)
    left, used = undocumented_differences(tally.differences, producer)
    if lost:
        used["client left, row lost"] = lost
    print_counts(f"item 4: NeMo Gym's producer vs our {producer}, both read by NeMo Gym", tally)
    for reason, count in used.items():
        print(f"    documented ({count}): {reason}", file=sys.stderr)
    assert left == []
    assert tally.records >= 18 and tally.calls + lost >= SCENARIO_CALLS
    for theirs_record, ours_record in zip(theirs, ours, strict=True):  # the counts NeMo Gym reads
        mine, gym = ours_record.get("ng_model_call_capture"), theirs_record.get("ng_model_call_capture")
        assert (mine or {}).get("metrics", {}).get("num_calls") == (gym or {}).get("metrics", {}).get(
            "num_calls"
        )
        assert [c["error_category"] for c in (mine or {}).get("calls", [])] == [
            c["error_category"] for c in (gym or {}).get("calls", [])
        ]


# ---------------------------------------------------------------- E: NeMo Gym's servers, ours around them

RECIPE_SERVERS = ("vllm_model", "openai_model", "azure_openai_model", "litellm_model")
"""NeMo Gym 0.7.0's model servers whose calls its own capture records (docs/nemo-gym.md)."""


def test_e_every_nemo_gym_model_server_captured_by_the_recipe(tmp_path: Path) -> None:
    """E (issue 45): each of NeMo Gym 0.7.0's model servers run as rollout-capture's
    ``rollout_capture_model`` (``serves: <it>``), with two uvicorn workers or one, started as ``gym env
    start`` starts servers (the folder found through NEMO_GYM_EXTRA_ROOTS). A prefixed call is
    captured by ours, its ``model_ref`` the server's name; what vLLM's server answers itself (a
    prompt past the context) keeps NeMo Gym's execution facts; NeMo Gym's own capture folder stays
    empty; a call without the prefix is forwarded uncaptured, and each server says so."""
    import openai

    from rollout_capture import read_model_call_records

    assert NG_PYTHON is not None
    captures, decoy, work = tmp_path / "captures", tmp_path / "nemo-gym-captures", tmp_path / "work"
    for folder in (captures, decoy, work):
        folder.mkdir()
    upstream = ThreadedServer(ScriptedUpstream())
    command = [NG_PYTHON, str(SIDE), "serve-ours", "--upstream", upstream.url, "--capture-dir", str(captures)]
    # Two uvicorn workers where NeMo Gym's own app.py has a worker entry (vllm_model) and where it
    # has none (openai_model: ours gives one); one for the others.
    serving = ["vllm_model:2", "openai_model:2", "azure_openai_model:1", "litellm_model:1"]
    assert [name.partition(":")[0] for name in serving] == list(RECIPE_SERVERS)
    command += ["--decoy", str(decoy), "--workdir", str(work), *serving]
    side = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=work)
    try:
        assert side.stdout is not None and side.stdin is not None
        ports = json.loads(side.stdout.readline())["ports"]
        for serves, port in ports.items():
            base = f"http://127.0.0.1:{port}"
            client = openai.OpenAI(base_url=f"{base}/ng-rollout/{serves}-1/v1", api_key="k", max_retries=0)
            answer = client.responses.create(model="scripted", input="weather in Paris?")
            assert answer.output, serves
            unprefixed = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
            unprefixed.responses.create(model="scripted", input="weather in Paris?")
            if serves == "vllm_model":  # a prompt past the context: vLLM answers 400, the server itself 200
                client.responses.create(model="scripted", input="scripted-context-overflow " * 3)
        side.stdin.close()
        assert side.wait(300) == 0
    finally:
        if side.poll() is None:
            side.kill()
        upstream.stop()
    assert list(decoy.iterdir()) == []  # NeMo Gym's own capture wrote nothing
    for serves in RECIPE_SERVERS:
        calls = read_model_call_records(str(captures), f"{serves}-1")  # raises on a damaged row
        assert len(calls) == (2 if serves == "vllm_model" else 1), serves
        first = calls[0]
        assert first.model_ref is not None and first.model_ref.name == f"{serves}_policy"
        assert (first.dialect, first.status_code, first.error_category) == ("responses", 200, None)
        # Its answer's usage, as the server gives it (azure_openai_model builds a response without one).
        assert (first.tokens_in is None) == (serves == "azure_openai_model"), serves
        log = (work / f"{serves}.log").read_text()
        assert "model call(s) forwarded uncaptured" in log and "POST /v1/responses" in log, serves
    vllm = read_model_call_records(str(captures), "vllm_model-1")
    assert (vllm[0].response_source, vllm[0].upstream_attempted) == ("upstream", True)
    local = vllm[1]
    assert (local.response_source, local.local_response_reason) == ("local", "context_length_exceeded")
    assert local.error_category == "context_length_exceeded" and local.status_code == 200


def test_the_projection_cases_are_what_nemo_gym_builds(tmp_path: Path) -> None:
    """tests/data/nemo_gym_070_projections.json, which the projections' unit tests hold ours to, is
    what NeMo Gym 0.7.0's own merge and projection build from tests/support/projection_cases.py."""
    assert NG_PYTHON is not None
    built = tmp_path / "projections.json"
    command = [NG_PYTHON, str(SIDE), "project", "--output", str(built)]
    subprocess.run(command, check=True, timeout=600, cwd=tmp_path)
    committed = Path(__file__).resolve().parent / "data" / "nemo_gym_070_projections.json"
    assert json.loads(built.read_text()) == json.loads(committed.read_text())


def test_whitespace_rows_a_writer_left_damaged_count_the_same_calls_in_nemo_gym(tmp_path: Path) -> None:
    """Issue 46 (1, 4, 5): whitespace rows of both versions, whole, torn by a killed writer with the
    next row glued to it, hiding a model call, inflating past the cap: NeMo Gym 0.7.0's own merge
    and ours count the same calls at the same indexes, with the same metrics; ours alone names
    what was lost (NeMo Gym skips the blank lines and strips the torn rows off)."""
    assert NG_PYTHON is not None

    def call(name: str) -> bytes:
        return json.dumps({"model_call_id": name, "dialect": "chat", "response": CHAT}).encode() + b"\n"

    verify = {"kind": "verifier_invocation", "verifier_invocation_id": "v", "reward": 1.0}
    hidden = {"model_call_id": "hidden", "dialect": "chat", "response": CHAT}
    cases: dict[str, list[bytes]] = {}
    for n, version in enumerate(VERSIONS):
        whole = whitespace_row(verify, version)
        cases[f"{n}-0"] = [call("p0"), whole, call("p1")]
        cases[f"{n}-1"] = [call("p0"), whole[: len(whole) // 2], call("p1"), call("p2")]  # torn, glued
        cases[f"{n}-2"] = [call("p0"), whitespace_row(hidden, version), call("p1")]
        cases[f"{n}-3"] = [call("p0"), inflating_row(300, version), call("p1")]
    captures = tmp_path / "captures"
    captures.mkdir()
    for rollout, lines in cases.items():
        (captures / f"{rollout}.capture.jsonl").write_bytes(b"".join(lines))
    given = [
        {"_ng_task_index": int(r.split("-")[0]), "_ng_rollout_index": int(r.split("-")[1])} for r in cases
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in given))
    out = tmp_path / "merged.jsonl"
    command = [
        NG_PYTHON,
        str(SIDE),
        "merge",
        "--records",
        str(tmp_path / "records.jsonl"),
        f"{captures}={out}",
    ]
    subprocess.run(command, check=True, timeout=900)
    _, *theirs = (json.loads(line) for line in out.read_text().splitlines())
    ours = [merge_model_call_capture_into_record(r, [captures]) for r in given]
    for rollout, gym, mine in zip(cases, theirs, ours, strict=True):
        gym_capture, my_capture = gym["ng_model_call_capture"], mine["ng_model_call_capture"]
        assert [(c["model_call_id"], c["call_index"]) for c in gym_capture["calls"]] == [
            (c["model_call_id"], c["call_index"]) for c in my_capture["calls"]
        ], rollout
        assert gym_capture["metrics"] == my_capture["metrics"], rollout
        assert "gaps" not in gym_capture, rollout
        named = rollout.endswith("-0") or my_capture["gaps"][0]["detail"].startswith("count=1; ")
        assert named, rollout
