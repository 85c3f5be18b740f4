"""Storage credentials from a named Prefect block, resolved where the task runs.

Only the block's name travels in parameters; the secret is loaded in the worker and
handed to the filesystem, never logged, returned, or stored in an artifact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from rollout_capture.faults import refusal_named

if TYPE_CHECKING:
    from rollout_capture.location import Location

# A block is loaded (and a role assumed) once per this long in a process, not per batch;
# credentials that expire sooner are resolved again this long before they do.
CREDENTIALS_REUSE_S = 900.0
_RENEW_BEFORE_EXPIRY_S = 300.0
_resolved: dict[str, tuple[dict[str, Any], float]] = {}  # block name -> (options, reuse until)
_resolved_lock = threading.Lock()


def forget_resolved() -> None:
    """Drop every credentials set resolved so far: the next use loads its block again."""
    with _resolved_lock:
        _resolved.clear()


def s3fs_options(block: Any, now: float | None = None) -> tuple[dict[str, Any], float]:
    """s3fs options from an ``AwsCredentials`` block, through prefect-aws's own API.

    ``get_boto3_session()`` resolves keys, session token, profile and assume-role;
    ``aws_client_parameters.get_params_override()`` gives the client settings (endpoint,
    TLS verification, SSL, API version), and the block's botocore config becomes s3fs's
    ``config_kwargs``. s3fs takes no boto3 session, hence the frozen credentials, and
    the time until which they may be reused (earlier when they expire).
    """
    now = time.time() if now is None else now
    reuse_until = now + CREDENTIALS_REUSE_S
    session = block.get_boto3_session()
    parameters = block.aws_client_parameters
    client_kwargs: dict[str, Any] = dict(parameters.get_params_override())
    client_kwargs.pop("config", None)  # a botocore Config object; s3fs wants the kwargs it was built from
    verify = client_kwargs.get("verify")
    if verify is not None and not isinstance(verify, bool):
        client_kwargs["verify"] = str(verify)  # verify_cert_path arrives as a Path
    if session.region_name:
        client_kwargs["region_name"] = session.region_name
    config_kwargs = dict(parameters.config or {})
    options: dict[str, Any] = {"client_kwargs": client_kwargs}
    if str(config_kwargs.get("signature_version", "")).lower() == "unsigned":
        config_kwargs.pop("signature_version")
        options["anon"] = True  # a public bucket, no signing
    else:
        credentials = session.get_credentials()  # None: nothing in the chain, s3fs will say so
        if credentials is not None:
            frozen = credentials.get_frozen_credentials()
            expiry = getattr(credentials, "_expiry_time", None)  # botocore's refreshable credentials
            if isinstance(expiry, datetime):
                reuse_until = min(reuse_until, expiry.timestamp() - _RENEW_BEFORE_EXPIRY_S)
            options["key"], options["secret"] = frozen.access_key, frozen.secret_key
            if frozen.token:
                options["token"] = frozen.token
    if config_kwargs:
        options["config_kwargs"] = config_kwargs
    return options, reuse_until


def credentials_from_block(block_name: str | None) -> dict[str, Any] | None:
    """s3fs options from an ``AwsCredentials`` block (``prefect-aws``), or None without a name.

    Resolved once per :data:`CREDENTIALS_REUSE_S` in a process (every batch asks), and
    again before temporary credentials expire, so a long run keeps valid ones.

    Examples:
        ```python
        from rollout_capture.tasks.credentials import credentials_from_block

        print(credentials_from_block(None))  # None: s3fs uses the standard AWS chain
        # With a block saved as "rollout-capture" (pip install 'rollout-capture[aws]'):
        # options = credentials_from_block("rollout-capture")  # key, secret, client_kwargs...
        ```
    """
    if not block_name:
        return None
    with _resolved_lock:
        cached = _resolved.get(block_name)
    if cached is not None and time.time() < cached[1]:
        return cached[0]
    options, reuse_until = s3fs_options(_load_block(block_name))
    with _resolved_lock:
        _resolved[block_name] = (options, reuse_until)
    return options


def _load_block(block_name: str) -> Any:
    try:
        from prefect_aws import AwsCredentials
    except ImportError as exc:
        raise ValueError(
            f"credentials block {block_name!r} needs prefect-aws: pip install 'rollout-capture[aws]'"
        ) from exc
    # _sync: this also runs inside async tasks, where load() would return a coroutine.
    return cast(AwsCredentials, AwsCredentials.load(block_name, _sync=True))  # type: ignore[call-arg]


@contextmanager
def credentials_for(where: Location) -> Iterator[dict[str, Any] | None]:
    """The location's credentials, resolved here from its block; a refused request inside names them."""
    with access_denied_names(where.credentials_block, where.url):
        yield credentials_from_block(where.credentials_block)


@contextmanager
def access_denied_names(
    block_name: str | None, url: str | None = None, what: str | None = None
) -> Iterator[None]:
    """A refused request (wrong key, expired token, no permission) says which credentials were used
    and, given ``url``, on which store (:func:`rollout_capture.faults.refusal_named`).

    It is never retried (see tasks/retry.py): no retry storm on a bad key.
    """
    try:
        with refusal_named(url, block_name, what):
            yield
    except PermissionError:
        if block_name:  # the block may be fixed before the next run: load it afresh then
            with _resolved_lock:
                _resolved.pop(block_name, None)
        raise


AWS_CREDENTIALS_SLUG = "aws-credentials"


def require_block(block_name: str) -> None:
    """Raise ``ValueError`` unless an ``AwsCredentials`` block of that name is on the API.

    Its values are never read (no prefect-aws needed): ``deploy`` checks a name before
    registering deployments that would otherwise fail every tick.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_block_document_by_name(block_name, AWS_CREDENTIALS_SLUG, include_secrets=False)
        except ObjectNotFound:
            raise ValueError(f"no {AWS_CREDENTIALS_SLUG} block of that name on the Prefect server") from None
