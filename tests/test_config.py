"""Configuration (spec 10): validation errors name the field; secrets are refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_capture import CaptureStore, ModelCallCaptureConfig, observability_enabled_from_config
from rollout_capture.secret_options import refuse_secret_options


def test_disabled_by_default() -> None:
    assert observability_enabled_from_config({}) is False
    assert ModelCallCaptureConfig.model_validate({"other": 1}).model_call_capture_dir is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"observability_enabled": True}, "model_call_capture_dir is required"),
        ({"observability_enabled": True, "model_call_capture_dir": "relative/dir"}, "absolute path or a URL"),
        (
            {"observability_enabled": True, "model_call_capture_dir": "nope://bucket"},
            "unknown storage scheme",
        ),
        ({"observability_enabled": "maybe"}, "observability_enabled"),
        (
            {
                "observability_enabled": True,
                "model_call_capture_dir": "s3://b/p",
                "model_call_capture_storage_options": {"secret": "x"},
            },
            "model_call_capture_storage_options.secret looks like a secret",
        ),
    ],
)
def test_bad_config_names_the_field(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelCallCaptureConfig.model_validate(config)


@pytest.mark.parametrize(
    "options",
    [
        {"key": "AKIA"},
        {"client_kwargs": {"aws_secret_access_key": "x"}},
        {"token": "t"},
        {"password": "p"},
        {"client_kwargs": {"aws_session_token": "s"}},
    ],
)
def test_secret_looking_storage_options_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="looks like a secret"):
        refuse_secret_options(options)
    with pytest.raises(ValueError, match="looks like a secret"):
        CaptureStore("s3://bucket/prefix", storage_options=options)


def test_ordinary_storage_options_pass() -> None:
    refuse_secret_options({"anon": False, "client_kwargs": {"endpoint_url": "http://x"}, "profile": "dev"})


@pytest.mark.parametrize(
    "url", ["s3://b/caps", "gs://b/caps", "gcs://b/caps", "az://c/caps", "abfs://c/caps"]
)
def test_object_stores_that_cache_listings_get_the_cache_off(url: str) -> None:
    """A cached listing would miss rows, leases and markers written since; the caller may still choose."""
    from rollout_capture.filesystem import with_defaults

    assert with_defaults(url, None, 8)["use_listings_cache"] is False
    assert with_defaults(url, {"use_listings_cache": True}, 8)["use_listings_cache"] is True
    assert "use_listings_cache" not in with_defaults("/local/caps", None, 8)
