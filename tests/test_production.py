"""The production path: credential blocks against a real S3 endpoint, events in the API's feed,
core warnings in the run's logs, and a mistyped capture dir refused before any reading."""

from __future__ import annotations

import base64
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_capture import CaptureStore
from rollout_capture.flows import enrich_rollouts
from rollout_capture.flows.events import COMPLETED, FAILED, GAPS_EXCEEDED, RESOURCE_PREFIX

from .conftest import S3
from .support.cli import cli_env, run_cli
from .support.prefect_api import task_runs, wait_for_events, wait_for_logs
from .support.runs_helpers import run_objects

pytestmark = pytest.mark.usefixtures("prefect_api")
TEST_KEYS = {"key": "testing", "secret": "testing"}
ROW = {
    "model_call_id": "c",
    "dialect": "chat",
    "response": {"usage": {"prompt_tokens": 3, "completion_tokens": 2}},
}


def rollouts_file(path: Path, count: int) -> bytes:
    data = b"".join(orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": 0}) + b"\n" for t in range(count))
    path.write_bytes(data)
    return data


@pytest.fixture
def no_aws_environment(s3: S3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing in the environment says where S3 is or who we are: only the block may."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def save_block(endpoint: str, key: str = "testing") -> str:
    from prefect_aws import AwsClientParameters, AwsCredentials

    name = f"s3-{uuid.uuid4().hex[:8]}"
    AwsCredentials(
        aws_access_key_id=key,
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(
            endpoint_url=endpoint, config={"retries": {"max_attempts": 2}}
        ),
    ).save(name)
    return name


@pytest.mark.usefixtures("no_aws_environment")
def test_a_block_naming_its_endpoint_is_all_a_flow_needs(s3: S3, tmp_path: Path) -> None:
    store = CaptureStore(s3.url("caps"), storage_options=s3.storage_options, credentials=TEST_KEYS)
    for task in range(3):
        store.record(f"{task}-0", ROW)
    s3.fs().pipe_file(f"{s3.bucket}/in/rollouts.jsonl", rollouts_file(tmp_path / "r.jsonl", 3))
    block = save_block(s3.endpoint)

    summary = enrich_rollouts(
        s3.url("in/rollouts.jsonl"),
        s3.url("caps"),
        output=s3.url("out/enriched.jsonl"),
        credentials_block=block,
    )

    assert summary.stats.rollouts == 3 and summary.stats.calls == 3 and not summary.stats.gaps
    out = s3.fs().cat_file(f"{s3.bucket}/out/enriched.jsonl").splitlines()
    assert [orjson.loads(line)["ng_model_call_capture"]["metrics"]["tokens_in"] for line in out] == [3, 3, 3]


@pytest.fixture
def s3_checking_keys(s3: S3) -> Iterator[S3]:
    """The endpoint refuses keys it does not know (moto accepts any, unless told otherwise).

    moto's server runs in this process (the session fixture), so its settings are set here.
    """
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    unchecked = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    ActionAuthenticatorMixin.request_count = 0
    try:
        yield s3
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = unchecked


@pytest.mark.usefixtures("no_aws_environment")
def test_a_wrong_key_fails_at_once_and_says_which_block(s3_checking_keys: S3, tmp_path: Path) -> None:
    s3 = s3_checking_keys
    block = save_block(s3.endpoint, key="AKIAWRONGWRONGWRONG0")
    rollouts_file(tmp_path / "r.jsonl", 2)

    state = enrich_rollouts(
        str(tmp_path / "r.jsonl"), s3.url("caps"), credentials_block=block, return_state=True
    )

    assert state.is_failed()
    with pytest.raises(PermissionError, match=rf"access denied with credentials block '{block}'"):
        state.result()
    (check,) = task_runs(state.state_details.flow_run_id, "check_capture_dir")
    assert check.run_count == 1  # refused, not retried
    assert not task_runs(state.state_details.flow_run_id, "merge_batch", at_least=0)  # nothing was read


def test_a_mistyped_capture_dir_fails_before_reading_unless_empty_is_expected(tmp_path: Path) -> None:
    rollouts_file(tmp_path / "r.jsonl", 2)
    missing = tmp_path / "no-such-captures"
    state = enrich_rollouts(str(tmp_path / "r.jsonl"), str(missing), return_state=True)
    with pytest.raises(FileNotFoundError, match=f"capture dir {missing} does not exist"):
        state.result()
    assert not task_runs(state.state_details.flow_run_id, "read_rollouts", at_least=0)
    assert not (tmp_path / "r.enriched.jsonl").exists()

    summary = enrich_rollouts(str(tmp_path / "r.jsonl"), str(missing), allow_empty=True)
    assert summary.stats.gaps == {"model_call_capture_no_records": 2}


def test_enrichment_events_carry_the_counts(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "caps")
    for task in range(3):
        store.record(f"{task}-0", ROW)
    rollouts_file(tmp_path / "r.jsonl", 4)  # one rollout without a capture: 1 of 4 has a gap
    (tmp_path / "r.jsonl").write_bytes((tmp_path / "r.jsonl").read_bytes() + b"not json\n")
    output = str(tmp_path / "r.enriched.jsonl")

    enrich_rollouts(str(tmp_path / "r.jsonl"), str(tmp_path / "caps"), max_gap_share=0.2)

    (completed,) = wait_for_events(COMPLETED, RESOURCE_PREFIX + output)
    payload = completed.payload
    assert {
        k: payload[k] for k in ("lines", "rollouts", "calls", "tokens_in", "tokens_out", "tokens_total")
    } == {
        "lines": 5,
        "rollouts": 4,
        "calls": 3,
        "tokens_in": 9,
        "tokens_out": 6,
        "tokens_total": 15,
    }
    assert payload["gaps"] == {"model_call_capture_no_records": 1} and payload["rollouts_with_gaps"] == 1
    assert payload["gap_share"] == 0.25 and payload["lines_passed_through"] == 1
    assert completed.resource["rollout-capture.source"] == str(tmp_path / "r.jsonl")
    assert any(related.role == "flow-run" for related in completed.related)
    (exceeded,) = wait_for_events(GAPS_EXCEEDED, RESOURCE_PREFIX + output)
    assert exceeded.payload["gap_share"] == 0.25 and exceeded.payload["max_gap_share"] == 0.2

    broken = str(tmp_path / "broken.enriched.jsonl")
    state = enrich_rollouts(
        str(tmp_path / "r.jsonl"), str(tmp_path / "caps"), output=broken, strict=True, return_state=True
    )
    assert state.is_failed()
    (failed,) = wait_for_events(FAILED, RESOURCE_PREFIX + broken)
    assert failed.payload["error"] == "ValueError" and ":5: not JSON" in failed.payload["message"]


def test_core_warnings_reach_the_flow_run_logs(tmp_path: Path) -> None:
    (tmp_path / "caps" / "0-0.capture.jsonl").mkdir(parents=True)  # a folder where a file belongs
    rollouts_file(tmp_path / "r.jsonl", 1)
    state = enrich_rollouts(str(tmp_path / "r.jsonl"), str(tmp_path / "caps"), return_state=True)
    assert state.result().stats.gaps == {"model_call_capture_unreadable": 1}
    wait_for_logs(state.state_details.flow_run_id, "could not read captures in")


def test_batches_never_persist_their_bytes_whatever_the_result_settings(tmp_path: Path) -> None:
    """A user who persists results by default still never finds rollout bytes in result storage."""
    from prefect.settings import (
        PREFECT_LOCAL_STORAGE_PATH,
        PREFECT_RESULTS_PERSIST_BY_DEFAULT,
        temporary_settings,
    )

    store = CaptureStore(tmp_path / "caps")
    store.record("0-0", ROW)
    marker = b"unmistakable-rollout-bytes"
    (tmp_path / "r.jsonl").write_bytes(
        orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": 0, "note": marker.decode()}) + b"\n"
    )
    results = tmp_path / "results"
    with temporary_settings(
        updates={PREFECT_RESULTS_PERSIST_BY_DEFAULT: True, PREFECT_LOCAL_STORAGE_PATH: results}
    ):
        enrich_rollouts(str(tmp_path / "r.jsonl"), str(tmp_path / "caps"))
    stored = [base64.b64decode(path.read_bytes()) for path in results.rglob("*") if path.is_file()]
    assert stored  # results were persisted (the setting took effect)...
    assert not any(marker in data for data in stored)  # ...but never a batch's bytes (pickled as they are)


@pytest.mark.usefixtures("no_aws_environment")
def test_a_block_is_loaded_once_for_all_the_batches_of_a_run(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every batch asks for the credentials; the block is loaded (a role assumed) once."""
    from rollout_capture.tasks import credentials

    loads: list[str] = []
    load = credentials._load_block

    def counted(name: str) -> object:
        loads.append(name)
        return load(name)

    monkeypatch.setattr(credentials, "_load_block", counted)
    store = CaptureStore(s3.url("caps-once"), storage_options=s3.storage_options, credentials=TEST_KEYS)
    for task in range(4):
        store.record(f"{task}-0", ROW)
    rollouts_file(tmp_path / "r.jsonl", 4)
    block = save_block(s3.endpoint)
    summary = enrich_rollouts(
        str(tmp_path / "r.jsonl"),
        s3.url("caps-once"),
        output=str(tmp_path / "out.jsonl"),
        batch_size=1,
        credentials_block=block,
    )
    assert summary.stats.calls == 4 and summary.batches == 4
    assert loads == [block]


def test_temporary_credentials_are_resolved_again_before_they_expire() -> None:
    """Reused for a while, but never past five minutes before their expiry."""
    from datetime import datetime

    import boto3
    from botocore.credentials import RefreshableCredentials
    from prefect_aws import AwsClientParameters, AwsCredentials

    from rollout_capture.tasks.credentials import CREDENTIALS_REUSE_S, s3fs_options

    now = 1_800_000_000.0
    expiry = datetime.fromtimestamp(now + 600, tz=UTC)
    temporary = RefreshableCredentials.create_from_metadata(
        {"access_key": "AK", "secret_key": "SK", "token": "TK", "expiry_time": expiry.isoformat()},
        refresh_using=lambda: {},
        method="test",
    )

    class Block:  # an assumed role's block, as far as s3fs_options looks at it
        aws_client_parameters = AwsClientParameters()

        def get_boto3_session(self) -> boto3.Session:
            session = boto3.Session(region_name="us-east-1")
            session._session._credentials = temporary
            return session

    options, reuse_until = s3fs_options(Block(), now=now)
    assert (options["key"], options["secret"], options["token"]) == ("AK", "SK", "TK")
    assert reuse_until == now + 300
    static = AwsCredentials(aws_access_key_id="a", aws_secret_access_key="b")
    options, reuse_until = s3fs_options(static, now=now)
    assert options["key"] == "a" and reuse_until == now + CREDENTIALS_REUSE_S


def test_refused_credentials_are_not_reused() -> None:
    """A block fixed after a refusal is loaded afresh by the next run in the same process."""
    from rollout_capture.tasks import credentials

    credentials._resolved["fixed-later"] = ({"key": "old"}, float("inf"))
    refused = pytest.raises(PermissionError, match="credentials block 'fixed-later'")
    with refused, credentials.access_denied_names("fixed-later"):
        raise PermissionError("InvalidAccessKeyId")
    assert "fixed-later" not in credentials._resolved


# ---------------------------------------------------------------------- refusals that name what and why


def iam_keys(s3: S3, allow: list[str]) -> dict[str, str]:
    """The environment of a new IAM user of the moto endpoint allowed ``allow`` alone (its rights
    are checked inside :func:`rights_checked`)."""
    import boto3

    iam = boto3.client("iam", endpoint_url=s3.endpoint, region_name="us-east-1")
    name = f"user-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=name)
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": allow, "Resource": "*"}]}
    iam.put_user_policy(UserName=name, PolicyName="rights", PolicyDocument=orjson.dumps(policy).decode())
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


@contextmanager
def rights_checked() -> Iterator[None]:
    """moto's server (in this process) checks every request's rights against IAM meanwhile."""
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    unchecked = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    ActionAuthenticatorMixin.request_count = 0
    try:
        yield
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = unchecked


def test_a_user_without_read_rights_is_told_the_store_and_where_the_credentials_came_from(
    s3: S3, prefect_api: str, tmp_path: Path
) -> None:
    s3.fs().pipe({f"{s3.bucket}/{k}": v for k, v in run_objects("runs", "r1", finished=True).items()})
    user = iam_keys(s3, allow=["iam:GetUser"])  # no right on S3 at all
    env = {name: value for name, value in cli_env(prefect_api).items() if name != "AWS_SESSION_TOKEN"}
    with rights_checked():
        done = run_cli(
            "enrich-runs", s3.url("runs"), "--storage-options", orjson.dumps(s3.storage_options).decode(),
            env={**env, **user},
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert error == (
        f"error: runs root {s3.url('runs')}: access denied with the AWS credential chain "
        "(AWS_* environment variables): Access Denied"
    )
    assert user["AWS_SECRET_ACCESS_KEY"] not in done.stdout + done.stderr


def test_without_delete_rights_what_stays_behind_is_named(
    flaky_s3: tuple[S3, Any], s3: S3, prefect_api: str
) -> None:
    """A store that refuses deletes (S3 answers DeleteObjects 200, each key an error, which s3fs
    drops): the run is still enriched, and the objects left behind (the put-if-absent probe, the
    lease generations) are each named in a warning, never left in silence."""
    via, proxy = flaky_s3
    s3.fs().pipe({f"{s3.bucket}/{k}": v for k, v in run_objects("runs", "r1", finished=True).items()})
    proxy.refuse_deletes()
    done = run_cli(
        "enrich-runs", via.url("runs"), "--storage-options", orjson.dumps(via.storage_options).decode(),
        "--json", api=prefect_api,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout)["enriched"] == ["r1"]
    (probe,) = [name for name in s3.fs().ls(f"{s3.bucket}/runs", detail=False) if "/_probe-" in name]
    assert f"probe s3://{probe} could not be removed" in done.stderr, done.stderr
    assert "Access Denied" in done.stderr and "stays there" in done.stderr
    leases = [n for n in s3.fs().ls(f"{s3.bucket}/runs/r1", detail=False) if "_ENRICHING" in n]
    assert leases and all(f"s3://{lease}" in done.stderr for lease in leases), done.stderr


def test_a_run_left_alone_for_a_link_fails_one_tick_naming_it_then_is_held(
    prefect_api: str, tmp_path: Path
) -> None:
    """A run whose captures folder is a link is never read through it: the other runs are
    enriched, and the tick says which run was left alone and why (exit 1, ``ok: false``). The
    next ticks name it as held without failing (one such run never fails every tick over its
    root, issue 45); once the link is gone and the run finished again, it is enriched."""
    from .support.runs_helpers import make_run

    root = tmp_path / "runs"
    make_run(root, "good", finished=True)
    linked = make_run(root, "linked", finished=True)
    outside = tmp_path / "elsewhere"
    (linked / "captures").rename(outside)
    (linked / "captures").symlink_to(outside)
    done = run_cli("enrich-runs", str(root), "--json", api=prefect_api)
    assert done.returncode == 1, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "linked" in error and "captures: a symbolic link" in error, error
    shown = orjson.loads(done.stdout)
    assert shown["ok"] is False and "linked" in shown["error"]
    assert (root / "good" / "_ENRICHED").exists() and not (root / "linked" / "_ENRICHED").exists()
    for as_json in (True, False):
        again = run_cli("enrich-runs", str(root), *(["--json"] if as_json else []), api=prefect_api)
        assert again.returncode == 0, again.stderr
        if as_json:
            assert "captures: a symbolic link" in orjson.loads(again.stdout)["held"]["linked"]
        else:
            assert "held linked: captures: a symbolic link" in again.stdout
    (linked / "captures").unlink()
    outside.rename(linked / "captures")
    assert run_cli("finish", str(linked)).returncode == 0
    assert run_cli("enrich-runs", str(root), api=prefect_api).returncode == 0
    assert (linked / "_ENRICHED").exists() and not (linked / "_REFUSED").exists()


def test_a_run_with_no_captures_fails_one_tick_with_the_likely_causes_then_is_held(
    prefect_api: str, tmp_path: Path
) -> None:
    """A finished run whose producer captured nothing (no rollout prefix, captures written
    elsewhere): the tick fails naming it and what to check; the next ticks over the root name it
    held and pass (issue 45: seen twice, such a run made a later tick exit 1 though it enriched
    another run). ``--recheck`` tries it again, and once its captures are there, enriches it."""
    from .support.runs_helpers import make_run

    root = tmp_path / "runs"
    empty = make_run(root, "empty", finished=True)
    shutil.move(str(empty / "captures"), str(tmp_path / "captures-elsewhere"))
    silent = make_run(root, "silent", finished=True)  # its folder there, empty: enriched, and said
    shutil.rmtree(silent / "captures")
    (silent / "captures").mkdir()
    done = run_cli("enrich-runs", str(root), api=prefect_api)
    assert done.returncode == 1
    assert "holds no capture: the producer writes elsewhere" in done.stderr
    assert "observability_enabled" in done.stderr
    assert "silent: no call captured for any of 3 rollout(s): the producer writes elsewhere" in done.stderr
    assert (empty / "_REFUSED").exists() and (silent / "_ENRICHED").exists()
    make_run(root, "later", finished=True)
    again = run_cli("enrich-runs", str(root), "--json", api=prefect_api)
    assert again.returncode == 0, again.stderr
    shown = orjson.loads(again.stdout)
    assert shown["enriched"] == ["later"] and "holds no capture" in shown["held"]["empty"]
    shutil.move(str(tmp_path / "captures-elsewhere"), str(empty / "captures"))
    rechecked = run_cli("enrich-runs", str(root), "--recheck", "empty", "--json", api=prefect_api)
    assert rechecked.returncode == 0, rechecked.stderr
    assert orjson.loads(rechecked.stdout)["enriched"] == ["empty"]
    assert (empty / "_ENRICHED").exists() and not (empty / "_REFUSED").exists()


def test_a_missing_shared_capture_dir_fails_the_tick_and_holds_no_run(
    prefect_api: str, tmp_path: Path
) -> None:
    """The job's one ``capture_dir`` missing (a deployment's parameter, not checked by the CLI's
    pre-flight) is the tick's fault, not the runs': each tick fails naming it, no run is held, and
    the first tick after it is mended enriches them (held, they would wait for ``--recheck``)."""
    from rollout_capture.flows import enrich_completed_runs
    from rollout_capture.flows.enrich_runs import RunsFailed

    from .support.runs_helpers import make_run

    root = tmp_path / "runs"
    run = make_run(root, "r1", finished=True)
    shared = tmp_path / "shared-captures"
    for _ in range(2):
        with pytest.raises(RunsFailed, match="shared-captures"):
            enrich_completed_runs(str(root), capture_dir=str(shared))
        assert not (run / "_REFUSED").exists() and not (run / "_ENRICHED").exists()
    shutil.move(str(run / "captures"), str(shared))
    assert enrich_completed_runs(str(root), capture_dir=str(shared)).enriched == ["r1"]
