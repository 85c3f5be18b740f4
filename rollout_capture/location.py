"""Where the bytes are: a path or URL with its fsspec options and the name of its credentials block.

The three travel together from the command line through the flows and tasks to the core,
so they are one value, validated once where it is made: the URL's shape (credentials in it
refused, never echoed), and storage options refused when a key looks like a secret (named, its
value never echoed). Only the block's
*name* is held; the tasks resolve it to credentials where they run (``tasks/credentials.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeAlias

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollout_capture.config import check_capture_url
from rollout_capture.filesystem import absolute_location, is_local
from rollout_capture.secret_options import refuse_secret_options
from rollout_capture.store import CaptureStore, shared_store


class LocationError(ValueError):
    """A location refused at the boundary: one line naming the field (never a secret's value)."""


class Location(BaseModel):
    """A path or fsspec URL, the options to open it with, and the credentials block to read it as.

    A plain string (or ``os.PathLike``) validates to a location with no options, so a
    parameter typed ``Location`` still takes what callers passed before.

    Examples:
        ```python
        from rollout_capture.location import Location

        captures = Location(url="s3://bucket/r1/captures", credentials_block="rollout-capture")
        rollouts = captures.at("s3://bucket/r1/rollouts.jsonl")  # same options, same block
        print(rollouts, rollouts.is_local, Location.coerce("runs/r1").is_local)  # s3://... False True
        ```
    """

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    url: str = Field(min_length=1, description="A local path or an fsspec URL (s3://bucket/prefix).")
    storage_options: dict[str, Any] | None = Field(
        None, description="fsspec options for the URL, without secrets (those come from credentials_block)."
    )
    credentials_block: str | None = Field(
        None, description="Name of a prefect-aws AwsCredentials block to read and write S3 with."
    )

    @model_validator(mode="before")
    @classmethod
    def _from_url(cls, value: Any) -> Any:
        """A bare path or URL is a location with no options and no block."""
        if isinstance(value, str | os.PathLike):
            return {"url": os.fspath(value)}
        return value

    @field_validator("url", mode="before")
    @classmethod
    def _url_shape(cls, value: Any) -> Any:
        """A URL's scheme must be one fsspec knows; a local path may be relative (a terminal's)."""
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("is empty: name a path or an fsspec URL")
            if "://" in value:
                check_capture_url(value)
        return value

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """The one place flows, tasks and the CLI refuse secret-looking storage options."""
        refuse_secret_options(value)
        return value or None

    @field_validator("credentials_block")
    @classmethod
    def _block_name(cls, value: str | None) -> str | None:
        return value or None

    @classmethod
    def of(
        cls,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        credentials_block: str | None = None,
    ) -> Location:
        """The location of ``url`` with these options and block; a bad field raises ``LocationError``.

        What a flow does with its ``capture_dir``, ``storage_options`` and ``credentials_block``
        parameters, first thing: from there on they travel as one value.
        """
        return cls._validated(
            {
                "url": url,
                "storage_options": dict(storage_options) if storage_options is not None else None,
                "credentials_block": credentials_block,
            }
        )

    @classmethod
    def coerce(cls, value: Location | str | os.PathLike[str] | Mapping[str, Any]) -> Location:
        """A location as given, or made from a path, URL or mapping of its fields."""
        return value if isinstance(value, Location) else cls._validated(value)

    @classmethod
    def _validated(cls, value: Any) -> Location:
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            raise LocationError(describe_errors(exc)) from None

    def at(self, url: str | os.PathLike[str]) -> Location:
        """Another URL read the same way: these options, this block (``output`` beside ``rollouts``)."""
        return Location.of(url, self.storage_options, self.credentials_block)

    def absolute(self) -> Location:
        """The same location with a local path made absolute here (workers run elsewhere)."""
        url = absolute_location(self.url)
        return self if url == self.url else self.model_copy(update={"url": url})

    @property
    def is_local(self) -> bool:
        """A local path (or ``file://`` URL), as ``filesystem.open_filesystem`` reads it; else remote."""
        return is_local(self.url)

    def capture_store(
        self, credentials: Mapping[str, Any] | None = None, *, shared: bool = True
    ) -> CaptureStore:
        """The capture store at this location, opened with ``credentials`` resolved by the caller.

        ``shared``: the process's store for the same URL, options and credentials (reused
        across batches); otherwise a new one.
        """
        if shared:
            return shared_store(self.url, self.storage_options, credentials=credentials)
        return CaptureStore(self.url, storage_options=self.storage_options, credentials=credentials)

    def flow_parameters(self) -> dict[str, Any]:
        """The flows' keyword arguments beside a URL (``storage_options``, ``credentials_block``), if set."""
        given = {"storage_options": self.storage_options, "credentials_block": self.credentials_block}
        return {name: value for name, value in given.items() if value is not None}

    def __str__(self) -> str:
        """The URL alone: what a task run's name, a log line or an error message shows."""
        return self.url

    def __hash__(self) -> int:
        options = orjson.dumps(self.storage_options or {}, option=orjson.OPT_SORT_KEYS, default=str)
        return hash((self.url, options, self.credentials_block))


LocationLike: TypeAlias = Location | str
"""What a task takes where a location goes: a ``Location``, or a path or URL (no options)."""


def describe_errors(exc: ValidationError) -> str:
    """A validation error in one line, each message after the field it is about; no input echoed."""
    parts = []
    for error in exc.errors(include_input=False, include_url=False):
        field = ".".join(str(part) for part in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(message if not field or message.startswith(field) else f"{field}: {message}")
    return "; ".join(parts)
