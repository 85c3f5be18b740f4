"""Storage credentials from a named Prefect block, resolved where the task runs.

Only the block's name travels in parameters; the secret is loaded in the worker and
handed to the filesystem, never logged, returned, or stored in an artifact.
"""

from __future__ import annotations

from typing import Any, cast


def credentials_from_block(block_name: str | None) -> dict[str, Any] | None:
    """s3fs options from an ``AwsCredentials`` block (``prefect-aws``), or None without a name."""
    if not block_name:
        return None
    try:
        from prefect_aws import AwsCredentials
    except ImportError as exc:
        raise ValueError(
            f"credentials block {block_name!r} needs prefect-aws: pip install 'rollout-capture[aws]'"
        ) from exc
    # _sync: this also runs inside async tasks, where load() would return a coroutine.
    block = cast(AwsCredentials, AwsCredentials.load(block_name, _sync=True))  # type: ignore[call-arg]
    options: dict[str, Any] = {}
    if block.aws_access_key_id:
        options["key"] = block.aws_access_key_id
    if block.aws_secret_access_key is not None:
        options["secret"] = block.aws_secret_access_key.get_secret_value()
    if block.aws_session_token:
        options["token"] = block.aws_session_token
    if block.profile_name:
        options["profile"] = block.profile_name
    if block.region_name:
        options["client_kwargs"] = {"region_name": block.region_name}
    return options
