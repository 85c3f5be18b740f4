"""Producer configuration (spec 11): one validated model, from arguments or the environment.

Servers that load a middleware by import path (vLLM's ``--middleware``) give it no
arguments, so every setting also has a ``ROLLOUT_CAPTURE_*`` environment variable. Each
default and description lives here once: ``rollout-capture proxy`` makes its options from
these fields (their types, defaults, bounds, descriptions and variables).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_capture.claims import DEFAULT_CLAIM_TTL_S
from rollout_capture.config import check_capture_url
from rollout_capture.filesystem import is_local
from rollout_capture.layouts import LayoutChoice
from rollout_capture.producer.routing import VERIFY_PATHS
from rollout_capture.secret_options import refuse_secret_options

ENV_PREFIX = "ROLLOUT_CAPTURE_"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

# Field name -> environment variable (spec 11 names the first three).
ENV_NAMES: dict[str, str] = {
    "enabled": "ROLLOUT_CAPTURE_ENABLED",
    "capture_dir": "ROLLOUT_CAPTURE_DIR",
    "server_name": "ROLLOUT_CAPTURE_SERVER_NAME",
    "claim_ttl_s": "ROLLOUT_CAPTURE_CLAIM_TTL_S",
    "max_body_bytes": "ROLLOUT_CAPTURE_MAX_BODY_BYTES",
    "storage_options": "ROLLOUT_CAPTURE_STORAGE_OPTIONS",
    "layout": "ROLLOUT_CAPTURE_LAYOUT",
    "claims": "ROLLOUT_CAPTURE_CLAIMS",
    "io_threads": "ROLLOUT_CAPTURE_IO_THREADS",
    "upstream": "ROLLOUT_CAPTURE_UPSTREAM",
    "upstream_client": "ROLLOUT_CAPTURE_UPSTREAM_CLIENT",
}


class ProducerSettings(BaseModel):
    """What a producer needs to write rows and claims for the calls it sees."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)  # no URL secret echoed

    enabled: bool = Field(
        True,
        description=(
            "Capture on. Off (ROLLOUT_CAPTURE_ENABLED=false), as NeMo Gym's servers run with capture "
            "disabled: the rollout prefix is still stripped and the call forwarded, nothing is written."
        ),
    )
    capture_dir: str | None = Field(
        None, min_length=1, description="Capture root: an absolute local path or fsspec URL (needed when on)."
    )
    server_name: str | None = Field(None, description="The row's model_ref name (null when unset).")
    claim_ttl_s: float = Field(DEFAULT_CLAIM_TTL_S, gt=0, description="Seconds a claim stays live.")
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1, description="Cap on the request or response bytes kept for a row."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description='fsspec options as JSON (no secrets), e.g. {"anon": false}.'
    )
    layout: LayoutChoice = Field(
        "auto",
        description=(
            "Capture layout: auto writes JSONL on local disks (NeMo Gym's) and the journal on object "
            "stores (many calls' claims and rows in one object); objects: one object a row."
        ),
    )
    claims: Literal["auto", "log", "files"] = Field(
        "auto",
        description=(
            "Claims on a local disk: auto and log append them to this process's claims log "
            "(_claims/, two appends a call); files: a claim file a call (R.capture.claims/). "
            "Object stores: claim files (objects) or the journal."
        ),
    )
    io_threads: int = Field(32, ge=1, le=1024, description="Threads writing claims and rows.")
    verify_paths: tuple[str, ...] = Field(
        VERIFY_PATHS,
        description="Paths of a verifier server's verify calls, each recorded as a verifier_invocation row.",
    )

    @field_validator("capture_dir")
    @classmethod
    def _capture_url(cls, value: str | None) -> str | None:
        """As the core's config (spec 10): a relative path would depend on each server's cwd."""
        if value is None:
            return None
        try:
            return check_capture_url(value)
        except ValueError as exc:
            raise ValueError(f"{exc} (set by ROLLOUT_CAPTURE_DIR or --capture-dir)") from None

    @model_validator(mode="after")
    def _dir_when_on(self) -> ProducerSettings:
        if self.enabled and self.capture_dir is None:
            raise ValueError(
                f"{ENV_NAMES['capture_dir']} is not set (the capture root, a path or URL); "
                f"{ENV_NAMES['enabled']}=false turns capture off"
            )
        return self

    @model_validator(mode="after")
    def _log_on_local_disks(self) -> ProducerSettings:
        if self.claims == "log" and self.capture_dir is not None and not is_local(self.capture_dir):
            raise ValueError(
                f"claims=log ({ENV_NAMES['claims']}) needs a local disk; {self.capture_dir} is an object "
                "store, where claims are claim files (objects layout) or in the journal"
            )
        return self

    @property
    def root(self) -> str:
        """The capture root of a producer that captures (its settings were validated on)."""
        if self.capture_dir is None:
            raise ValueError("capture is off: there is no capture root")
        return self.capture_dir

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any]) -> dict[str, Any]:
        refuse_secret_options(value)
        return value

    @classmethod
    def env_values(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The settings given by ``ROLLOUT_CAPTURE_*`` variables, unvalidated."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, name in ENV_NAMES.items():
            if field not in cls.model_fields:
                continue
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            if field == "storage_options":
                try:
                    values[field] = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{name} is not JSON: {exc}") from None
            else:
                values[field] = raw
        return values

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ProducerSettings:
        """Settings from the environment; explicit ``overrides`` (not None) win."""
        values = cls.env_values(environ)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)


class ProxySettings(ProducerSettings):
    """A producer that forwards to an upstream it cannot modify."""

    upstream: str = Field(description="Base URL of the model server, e.g. http://127.0.0.1:8000.")
    connect_timeout_s: float = Field(10.0, gt=0, description="Seconds to connect to the upstream.")
    read_timeout_s: float = Field(600.0, gt=0, description="Longest silence from the upstream mid-answer.")
    write_timeout_s: float = Field(60.0, gt=0, description="Seconds to send a request to the upstream.")
    max_connections: int = Field(512, ge=1, description="Pooled upstream connections.")
    upstream_client: Literal["aiohttp"] = Field(
        "aiohttp",
        description="The upstream client (aiohttp; the former httpx one cost twice the CPU per call).",
    )
    shutdown_grace_s: float = Field(30.0, ge=0, description="How long a stop waits for calls in flight.")

    @field_validator("upstream")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http:// or https:// URL; got {value!r}")
        return value.rstrip("/")
