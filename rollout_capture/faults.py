"""Which storage errors are worth retrying.

Transient faults (connections, timeouts, throttling, 5xx, s3fs giving up after its own
retries) heal by themselves; bad input and missing or forbidden files never do, and
retrying them only delays the error the user needs to see.
"""

from __future__ import annotations

import errno
import sys

from fsspec.exceptions import FSTimeoutError

# s3fs maps 503/SlowDown/409 to EBUSY, 500 to EREMOTEIO and unknown codes (502, 504) to EIO.
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EREMOTEIO, errno.EIO, errno.EAGAIN, errno.ETIMEDOUT}
_THROTTLING_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
}
_NEVER = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)


def _loaded(module: str, *names: str) -> tuple[type[BaseException], ...]:
    """Exception types of ``module`` if it is loaded, else none: an exception of one of them
    implies its module is loaded, so nothing is missed, and a command that never touches S3
    (a local enrichment) never pays for importing aiohttp and botocore (about 0.2 s)."""
    found = sys.modules.get(module)
    return tuple(getattr(found, name) for name in names) if found is not None else ()


def _transient_alone(exc: BaseException) -> bool:
    if isinstance(exc, _NEVER):
        return False
    botocore = "botocore.exceptions"
    if isinstance(
        exc, (ConnectionError, TimeoutError, FSTimeoutError, *_loaded(botocore, "HTTPClientError"))
    ):
        return True
    if isinstance(exc, _loaded("aiohttp", "ClientConnectionError", "ClientPayloadError")):
        return True
    if isinstance(exc, _loaded(botocore, "ClientError")):
        response = getattr(exc, "response", None) or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = response.get("Error", {}).get("Code", "")
        return status >= 500 or status == 429 or code in _THROTTLING_CODES
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def is_transient_storage_error(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is a storage fault that may heal on retry."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (*_NEVER, ValueError)):
            return False
        if _transient_alone(current):
            return True
        current = current.__cause__ or current.__context__
    return False


NO_CAPTURE_CAUSES = (
    "the producer writes elsewhere (compare its capture dir), or it saw no /ng-rollout/<id> prefix "
    "(NeMo Gym's agents add it only while observability_enabled is true; a producer behind NeMo Gym's "
    "model server sees none, and its log says 'forwarded uncaptured': see docs/nemo-gym.md), or no "
    "model call was made"
)
"""Why a capture root or a rollout can hold nothing: what a user checks first."""


def missing_capture_dir(url: str, allow: str = "--allow-empty") -> str:
    """The one message for a capture root that is not there (a mistyped path, a wrong prefix, a
    producer that captured nothing), naming the likely causes."""
    return (
        f"capture dir {url} does not exist or holds no capture: {NO_CAPTURE_CAUSES} "
        f"(pass {allow} if that is expected)"
    )
