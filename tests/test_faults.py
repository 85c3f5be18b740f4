"""``rollout_capture.faults``: which storage errors are worth a retry, followed down their causes."""

from __future__ import annotations

import errno

import pytest
from fsspec.exceptions import FSTimeoutError

from rollout_capture.faults import is_transient_storage_error, missing_capture_dir


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError("reset by peer"),
        TimeoutError("read"),
        FSTimeoutError(),
        OSError(errno.EBUSY, "SlowDown"),  # s3fs: 503, SlowDown, 409
        OSError(errno.EREMOTEIO, "500"),
        OSError(errno.EIO, "502"),
        OSError(errno.EAGAIN, "again"),
    ],
    ids=repr,
)
def test_faults_that_heal_are_transient(exc: BaseException) -> None:
    assert is_transient_storage_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(errno.EIO, "gone"),  # a missing file never heals, whatever its errno
        PermissionError(errno.EAGAIN, "denied"),
        FileExistsError("there"),
        IsADirectoryError("dir"),
        OSError(errno.ENOSPC, "disk full"),
        ValueError("bad input"),
        KeyError("row"),
    ],
    ids=repr,
)
def test_bad_input_and_missing_or_forbidden_files_are_not(exc: BaseException) -> None:
    assert not is_transient_storage_error(exc)


def test_the_cause_decides_and_a_value_error_on_the_way_stops_the_search() -> None:
    wrapped = RuntimeError("read failed")
    wrapped.__cause__ = ConnectionResetError("reset")
    assert is_transient_storage_error(wrapped)

    refused = ValueError("not JSON")
    refused.__context__ = ConnectionResetError("reset")  # raised while handling a fault: still bad input
    assert not is_transient_storage_error(refused)

    context = RuntimeError("outer")
    context.__context__ = OSError(errno.ETIMEDOUT, "timed out")
    assert is_transient_storage_error(context)


def test_a_cycle_of_causes_ends() -> None:
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__cause__, second.__cause__ = second, first
    assert not is_transient_storage_error(first)


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        (503, "ServiceUnavailable", True),
        (500, "InternalError", True),
        (429, "", True),
        (400, "SlowDown", True),
        (400, "ThrottlingException", True),
        (404, "NoSuchKey", False),
        (403, "AccessDenied", False),
    ],
)
def test_botocores_client_errors_by_status_and_code(status: int, code: str, transient: bool) -> None:
    from botocore.exceptions import ClientError

    response = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    exc = ClientError(response, "PutObject")  # type: ignore[arg-type]
    assert is_transient_storage_error(exc) is transient


def test_a_missing_capture_dir_is_named_with_the_option_that_allows_it() -> None:
    message = missing_capture_dir("s3://bucket/caps")
    assert "capture dir s3://bucket/caps does not exist" in message and "--allow-empty" in message
    assert "allow_empty=True" in missing_capture_dir("/data/caps", allow="allow_empty=True")
