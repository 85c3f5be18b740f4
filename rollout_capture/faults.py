"""Which storage errors are worth retrying, and what a refused one says.

Transient faults (connections, timeouts, throttling, 5xx, s3fs giving up after its own
retries) heal by themselves; bad input and missing or forbidden files never do, and
retrying them only delays the error the user needs to see. A refused request names the store
and where its credentials came from: "Access Denied" alone says neither.
"""

from __future__ import annotations

import errno
import getpass
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from fsspec.exceptions import FSTimeoutError

from rollout_capture.secret_options import shown_url

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


_AWS_SOURCES = {
    "env": "AWS_* environment variables",
    "shared-credentials-file": "the shared credentials file",
    "config-file": "the AWS config file",
    "assume-role": "a role assumed by the profile",
    "assume-role-with-web-identity": "a web identity token",
    "sso": "AWS SSO",
    "container-role": "the container's role",
    "iam-role": "the instance's role",
}


def credentials_source(url: str, block_name: str | None = None) -> str:
    """Where the credentials of a request to ``url`` came from, as a refusal names them (never a
    key): the block, else the store's own chain (for S3, where in it botocore found them)."""
    if block_name:
        return f"credentials block {block_name!r}"
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme in ("s3", "s3a"):
        try:
            import botocore.session

            found = botocore.session.Session().get_credentials()
        except Exception:  # the chain itself is broken: s3fs said so already
            found = None
        method = getattr(found, "method", None)
        return "the AWS credential chain" + (f" ({_AWS_SOURCES.get(method, method)})" if method else "")
    if scheme in ("gs", "gcs"):
        return "Google's Application Default Credentials"
    if scheme in ("az", "abfs", "abfss", "adl"):
        return "the AZURE_STORAGE_* environment (else DefaultAzureCredential)"
    if scheme in ("file", "local"):
        return f"this process's user ({getpass.getuser()})"
    return f"the {scheme} filesystem's own configuration"


@contextmanager
def refusal_named(url: str | None, block_name: str | None = None, what: str | None = None) -> Iterator[None]:
    """A ``PermissionError`` inside raised again naming ``what`` (``runs root``) at ``url`` and the
    credentials' source: ``runs root s3://b/runs: access denied with the AWS credential chain (AWS_*
    environment variables): Access Denied``. Without ``url``, the source alone (S3's chain)."""
    try:
        yield
    except PermissionError as exc:
        where = f"{what + ' ' if what else ''}{shown_url(url)}: " if url else ""
        source = credentials_source(url or "s3://", block_name)
        raise PermissionError(f"{where}access denied with {source}: {exc}") from exc
