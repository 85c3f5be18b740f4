"""``Location``: one validated value for a URL, its storage options and its credentials block.

Validated once where it is made: errors name the field, a secret-looking option is refused
naming its key (its value never echoed, not even by pydantic's own error), a plain path or
URL coerces to a location, and it knows whether it is local.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from rollout_capture import CaptureStore
from rollout_capture.location import Location, LocationError

from .conftest import S3

ROW = {"model_call_id": "c", "dialect": "chat"}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"url": ""}, "url: "),
        ({"url": "   "}, "url: is empty"),
        ({"url": "nosuchscheme://bucket/caps"}, "url: unknown storage scheme 'nosuchscheme'"),
        ({"url": "/c", "storage_options": "anon"}, "storage_options: "),
        ({"url": "/c", "credentials_block": 3}, "credentials_block: "),
        ({"url": "/c", "endpoint": "http://x"}, "endpoint: "),
    ],
)
def test_a_bad_field_is_refused_naming_it(fields: dict[str, object], named: str) -> None:
    with pytest.raises(LocationError) as raised:
        Location.coerce(fields)
    assert str(raised.value).startswith(named), raised.value
    assert "\n" not in str(raised.value)  # one line, for a terminal


@pytest.mark.parametrize(
    "options",
    [
        {"secret": "hunter2"},
        {"client_kwargs": {"aws_secret_access_key": "hunter2"}},
        {"anon": False, "token": "hunter2"},
    ],
)
def test_a_secret_in_the_storage_options_is_refused_naming_the_key_never_the_value(
    options: dict[str, object],
) -> None:
    with pytest.raises(LocationError, match=r"storage_options\.\S+ looks like a secret") as raised:
        Location.of("s3://bucket/caps", options)
    assert "hunter2" not in str(raised.value)
    # Validated directly (a Prefect parameter typed Location): pydantic's error hides the input too.
    with pytest.raises(ValidationError) as direct:
        Location.model_validate({"url": "s3://bucket/caps", "storage_options": options})
    assert "looks like a secret" in str(direct.value) and "hunter2" not in str(direct.value)


def test_an_empty_secret_looking_option_is_no_secret() -> None:
    assert Location.of("s3://b/c", {"token": None, "anon": True}).storage_options == {
        "token": None,
        "anon": True,
    }


def test_a_plain_path_or_url_coerces_to_a_location(tmp_path: Path) -> None:
    assert Location.coerce("s3://bucket/caps") == Location(url="s3://bucket/caps")
    assert Location.coerce(tmp_path).url == str(tmp_path)  # os.PathLike too
    where = Location.of("s3://bucket/caps", {"anon": True}, "rollout-capture")
    assert Location.coerce(where) is where

    class Parameters(BaseModel):  # how Prefect validates a flow's parameters
        captures: Location

    assert Parameters.model_validate({"captures": "runs/r1"}).captures == Location(url="runs/r1")
    assert Location.of("/c", {}, "").model_dump() == {
        "url": "/c",
        "storage_options": None,
        "credentials_block": None,
    }


def test_local_or_remote() -> None:
    assert Location.coerce("captures").is_local and Location.coerce("/data/c").is_local
    assert Location.coerce("file:///data/c").is_local
    assert not Location.coerce("s3://bucket/c").is_local
    assert not Location.coerce("memory://c").is_local


def test_a_sibling_url_is_read_the_same_way_and_validated() -> None:
    captures = Location.of("s3://bucket/r1/captures", {"anon": True}, "rollout-capture")
    rollouts = captures.at("s3://bucket/r1/rollouts.jsonl")
    assert (rollouts.storage_options, rollouts.credentials_block) == ({"anon": True}, "rollout-capture")
    assert str(rollouts) == "s3://bucket/r1/rollouts.jsonl"  # what a task run's name shows
    with pytest.raises(LocationError, match="url: unknown storage scheme"):
        captures.at("nosuchscheme://x")
    assert captures.flow_parameters() == {
        "storage_options": {"anon": True},
        "credentials_block": "rollout-capture",
    }
    assert Location.coerce("/c").flow_parameters() == {}


def test_it_is_frozen_hashable_and_travels_to_workers() -> None:
    where = Location.of("s3://bucket/caps", {"client_kwargs": {"region_name": "x"}})
    with pytest.raises(ValidationError):
        where.url = "elsewhere"  # type: ignore[misc]
    assert hash(where) == hash(Location.of("s3://bucket/caps", {"client_kwargs": {"region_name": "x"}}))
    assert pickle.loads(pickle.dumps(where)) == where  # Dask, Ray and spawned workers get it pickled


def test_a_relative_local_path_is_made_absolute_for_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert Location.coerce("caps").absolute().url == str(tmp_path / "caps")
    remote = Location.coerce("s3://bucket/caps")
    assert remote.absolute() is remote


def test_the_capture_store_it_opens_reads_with_its_options(tmp_path: Path, s3: S3) -> None:
    CaptureStore(tmp_path).record("1-0", ROW)
    store = Location.coerce(tmp_path).capture_store(shared=False)
    assert [row["model_call_id"] for row in store.read("1-0")] == ["c"]
    local = Location.coerce(str(tmp_path))
    assert local.capture_store() is local.capture_store()  # the process's one store for it
    remote = Location.of(s3.url("caps"), s3.storage_options)  # the endpoint travels with the URL
    remote.capture_store(shared=False).record("2-0", ROW)
    assert CaptureStore(s3.url("caps"), storage_options=s3.storage_options).has_any("2-0")


URL_SECRET = "hunter2SECRET"


@pytest.mark.parametrize(
    "url", [f"s3://AKIAEXAMPLE:{URL_SECRET}@bucket/caps", f"s3://{URL_SECRET}@bucket/caps"]
)
def test_credentials_in_a_url_are_refused_wherever_a_url_enters_never_echoed(
    url: str, tmp_path: Path
) -> None:
    """A ``Location`` (made, coerced, validated as a parameter, or a sibling ``at``), a store
    opened directly and ``open_filesystem``: one check, naming the scheme and host alone."""
    from rollout_capture.filesystem import open_filesystem
    from rollout_capture.rollout_files import stage_rollouts

    refusals: list[str] = []
    for attempt in (
        lambda: Location.of(url),
        lambda: Location.coerce({"url": url}),
        lambda: Location.coerce(tmp_path).at(url),
        lambda: Location.model_validate({"url": url}),
        lambda: CaptureStore(url),
        lambda: open_filesystem(url),
        lambda: stage_rollouts(url, None),
    ):
        with pytest.raises(ValueError) as raised:
            attempt()
        refusals.append(str(raised.value))
    for message in refusals:
        assert "credentials in the URL are not allowed" in message and "(s3://bucket)" in message, message
        assert URL_SECRET not in message and "AKIAEXAMPLE" not in message


@pytest.mark.usefixtures("prefect_api")
def test_a_flow_given_a_url_with_credentials_fails_and_records_it_nowhere(tmp_path: Path) -> None:
    """Prefect records a run's parameters and name before the flow can refuse them: the URL is
    replaced in both by a note naming its scheme and host, and the run fails with the refusal."""
    import orjson

    from rollout_capture.flows import enrich_rollouts, prepare_dispatch

    from .support.prefect_api import flow_run

    url = f"s3://AKIAEXAMPLE:{URL_SECRET}@bucket/caps"
    states = [
        enrich_rollouts(f"{url}/r.jsonl", str(tmp_path), return_state=True),
        enrich_rollouts(str(tmp_path / "r.jsonl"), url, return_state=True),
        prepare_dispatch([{"_ng_rollout_id": "1-0"}], url, return_state=True),
    ]
    for state in states:
        with pytest.raises(LocationError, match=r"credentials in the URL are not allowed.*\(s3://bucket\)"):
            state.result()
        run = flow_run(state.state_details.flow_run_id)
        recorded = orjson.dumps(run.parameters).decode() + run.name
        assert URL_SECRET not in recorded and "AKIAEXAMPLE" not in recorded, recorded
        assert "<refused: credentials in the URL> (s3://bucket)" in recorded


@pytest.mark.usefixtures("prefect_api")
def test_a_task_given_a_url_with_credentials_is_named_without_them() -> None:
    """A task called with a raw URL (not a ``Location`` a flow validated) is refused in its body;
    its run's name, recorded before, shows the URL's scheme and host alone."""
    from prefect import flow

    from rollout_capture.tasks.capture import check_capture_dir
    from rollout_capture.tasks.rollout_files import read_rollouts
    from rollout_capture.tasks.run_folders import find_runs

    from .support.prefect_api import task_runs

    url = f"s3://AKIAEXAMPLE:{URL_SECRET}@bucket/x"
    refusals: list[str] = []

    @flow
    def calls() -> None:
        for call in (lambda: read_rollouts(url), lambda: check_capture_dir(url), lambda: find_runs(url)):
            try:
                call()
            except LocationError as exc:
                refusals.append(str(exc))

    state = calls(return_state=True)
    assert len(refusals) == 3 and all("(s3://bucket)" in r and URL_SECRET not in r for r in refusals)
    names = [
        run.name
        for prefix in ("read_rollouts", "check_capture_dir", "find_runs")
        for run in task_runs(state.state_details.flow_run_id, prefix)
    ]
    assert len(names) == 3 and all(
        name.endswith(" <refused: credentials in the URL> (s3://bucket)") for name in names
    )
