"""Run-wide capture configuration (spec section 10), validated at the boundary.

Storage options travel through config files, which end up in logs, so anything that
looks like a credential is refused here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from rollout_capture.filesystem import url_scheme
from rollout_capture.secret_options import refuse_secret_options, refuse_url_credentials
from rollout_capture.store import CaptureStore


def check_capture_url(url: str) -> str:
    """Accept an absolute local path or a URL whose scheme fsspec knows, without credentials in it."""
    refuse_url_credentials(url)
    scheme = url_scheme(url)
    if scheme is not None:
        if scheme not in fsspec.available_protocols():
            raise ValueError(f"unknown storage scheme {scheme!r} in {url!r}")
        return url
    if not url.startswith("/"):
        raise ValueError(f"capture dir must be an absolute path or a URL; got {url!r}")
    return url


class ModelCallCaptureConfig(BaseModel):
    """The capture settings read from a run's global config; other keys are ignored."""

    model_config = ConfigDict(extra="ignore", hide_input_in_errors=True)  # a URL may hold a secret

    observability_enabled: bool = False
    model_call_capture_dir: str | None = None
    model_call_capture_storage_options: dict[str, Any] | None = None

    @field_validator("model_call_capture_dir", mode="before")
    @classmethod
    def _dir_as_str(cls, value: Any) -> Any:
        return str(value) if hasattr(value, "__fspath__") else value

    @field_validator("model_call_capture_storage_options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        refuse_secret_options(value, where="model_call_capture_storage_options")
        return value

    @model_validator(mode="after")
    def _dir_required_when_enabled(self) -> ModelCallCaptureConfig:
        if not self.observability_enabled:
            return self
        if self.model_call_capture_dir is None:
            raise ValueError("model_call_capture_dir is required when observability_enabled=true")
        try:
            check_capture_url(self.model_call_capture_dir)
        except ValueError as exc:
            raise ValueError(f"model_call_capture_dir: {exc}") from None
        return self


def observability_enabled_from_config(global_config: Mapping[str, Any]) -> bool:
    """Read the run-wide ``observability_enabled`` flag alone."""
    return ModelCallCaptureConfig.model_validate(dict(global_config)).observability_enabled


def model_call_capture_dirs_from_config(global_config: Mapping[str, Any]) -> list[CaptureStore]:
    """Return the run-wide capture store in a list, or ``[]`` when capture is off."""
    config = ModelCallCaptureConfig.model_validate(dict(global_config))
    if not config.observability_enabled or config.model_call_capture_dir is None:
        return []
    return [
        CaptureStore(
            config.model_call_capture_dir,
            storage_options=config.model_call_capture_storage_options,
        )
    ]
