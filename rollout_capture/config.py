"""Run-wide capture configuration (spec section 10), validated at the boundary.

Storage options travel through config files and flow parameters, which end up in logs
and the Prefect UI, so anything that looks like a credential is refused here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import fsspec
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

_SECRET_KEY_RE = re.compile(
    r"secret|passw|token|credential|private|signature|api_?key|access_?key|account_?key|sas|^key$",
    re.IGNORECASE,
)


def refuse_secret_options(options: Mapping[str, Any] | None, *, where: str = "storage_options") -> None:
    """Raise ``ValueError`` naming the first option that looks like a credential.

    Credentials belong to the standard provider chain (environment, profile, role) or a
    named Prefect block, never to parameters that are logged and shown in the UI.
    """
    if not options:
        return
    for name, value in options.items():
        path = f"{where}.{name}"
        if _SECRET_KEY_RE.search(str(name)) and value not in (None, "", False):
            raise ValueError(
                f"{path} looks like a secret; pass credentials through the environment "
                "(AWS_* variables, a profile or a role) or a Prefect block instead"
            )
        if isinstance(value, Mapping):
            refuse_secret_options(value, where=path)


REDACTED = "<refused: looks like a secret>"


def redact_secret_options(value: Any) -> Any:
    """A copy of ``value`` with every secret-looking entry of every mapping replaced.

    For what is about to be recorded (flow parameters in the Prefect API), so a secret
    handed in by mistake is refused without being stored first.
    """
    if isinstance(value, Mapping):
        return {
            key: REDACTED
            if _SECRET_KEY_RE.search(str(key)) and item not in (None, "", False)
            else redact_secret_options(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact_secret_options(item) for item in value]
    return value


def check_capture_url(url: str) -> str:
    """Accept an absolute local path or a URL whose scheme fsspec knows."""
    if "://" in url:
        scheme = url.split("://", 1)[0]
        if scheme not in fsspec.available_protocols():
            raise ValueError(f"unknown storage scheme {scheme!r} in {url!r}")
        return url
    if not url.startswith("/"):
        raise ValueError(f"capture dir must be an absolute path or a URL; got {url!r}")
    return url


class ModelCallCaptureConfig(BaseModel):
    """The capture settings read from a run's global config; other keys are ignored."""

    model_config = ConfigDict(extra="ignore")

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


def model_call_capture_dirs_from_config(global_config: Mapping[str, Any]) -> list[Any]:
    """Return the run-wide capture store in a list, or ``[]`` when capture is off."""
    from rollout_capture.store import CaptureStore

    config = ModelCallCaptureConfig.model_validate(dict(global_config))
    if not config.observability_enabled or config.model_call_capture_dir is None:
        return []
    return [
        CaptureStore(
            config.model_call_capture_dir,
            storage_options=config.model_call_capture_storage_options,
        )
    ]
