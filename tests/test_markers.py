"""The ``integration`` marker as tests/conftest.py sets it: from what a test reaches, so a test
moved to another file, or calling a helper that starts a server, stays marked."""

from __future__ import annotations

from typing import Any

import pytest

from . import conftest
from .support.cli import CLI
from .support.otlp_receiver import OtlpReceiver
from .support.servers import ThreadedServer


def _starts_a_server() -> None:
    ThreadedServer(object()).stop()  # never called: only read


def _calls_a_helper_that_does() -> None:
    _starts_a_server()


def _imports_one_that_does() -> None:
    from .test_markers import _calls_a_helper_that_does

    _calls_a_helper_that_does()


def _starts_a_receiver() -> None:
    OtlpReceiver().stop()  # a server class of the tests' own: found whatever its name


def _runs_the_cli() -> list[str]:
    return ["python", "-m", "rollout_capture.cli", "enrich"]


def _runs_the_cli_named_once() -> list[str]:
    return [*CLI, "enrich"]  # the command line a module constant of the tests' helpers holds


def _asks_for_s3(request: Any) -> Any:
    return request.getfixturevalue("s3") if request.param == "s3" else None


def _plain(rows: list[int]) -> int:
    return sum(rows)  # a name shared with nothing that starts a server


def reached(name: str) -> set[str]:
    """What the sample function ``name`` reaches (looked up by name, so that these tests, which
    only read the samples, are not marked for what the samples would start)."""
    return conftest._reaches(globals()[name], {}, conftest._tests_namespace())


def test_a_starter_is_found_in_the_code_and_through_the_helpers_it_calls() -> None:
    for name in ("_starts_a_server", "_calls_a_helper_that_does", "_imports_one_that_does"):
        assert "ThreadedServer" in reached(name), name


def test_a_server_class_of_the_tests_own_is_a_starter_whatever_its_name() -> None:
    """tests/support/otlp_receiver.py's receiver (an ``http.server`` subclass) listens when made."""
    assert reached("_starts_a_receiver") == {"OtlpReceiver"}


def test_a_cli_process_and_a_server_fixture_asked_by_name_are_found() -> None:
    assert reached("_runs_the_cli") == {conftest.CLI_PROCESS}
    assert reached("_runs_the_cli_named_once") == {conftest.CLI_PROCESS}
    assert reached("_asks_for_s3") == {"s3"}


def test_plain_code_reaches_nothing() -> None:
    assert reached("_plain") == set()


def test_this_run_marked_the_tests_that_start_servers_and_not_the_others(
    request: pytest.FixtureRequest,
) -> None:
    """Among the tests collected with this one (``-m`` deselected or not): each using a server
    fixture is marked, and some are (in a whole-suite collection)."""
    assert request.node.nodeid in conftest.COLLECTED
    for nodeid, (marked, fixtures) in conftest.COLLECTED.items():
        if fixtures & conftest.SERVER_FIXTURES:
            assert marked, nodeid
    assert request.node.get_closest_marker("integration") is None
