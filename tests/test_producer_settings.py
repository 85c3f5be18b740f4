"""``rollout_capture.producer.settings``: one validated model from arguments or ``ROLLOUT_CAPTURE_*``
variables, refusing what would write to the wrong place or echo a secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rollout_capture.producer.settings import ENV_NAMES, ProducerSettings, ProxySettings

URL_SECRET = "hunter2SECRET"


def test_settings_come_from_the_environment_and_explicit_values_win(tmp_path: Path) -> None:
    environ = {
        "ROLLOUT_CAPTURE_DIR": str(tmp_path / "env"),
        "ROLLOUT_CAPTURE_SERVER_NAME": "policy",
        "ROLLOUT_CAPTURE_CLAIM_TTL_S": "12.5",
        "ROLLOUT_CAPTURE_STORAGE_OPTIONS": '{"anon": false}',
        "ROLLOUT_CAPTURE_LAYOUT": "",  # empty: unset
        "UNRELATED": "x",
    }
    settings = ProducerSettings.from_env(environ, capture_dir=str(tmp_path / "given"), server_name=None)
    assert settings.capture_dir == str(tmp_path / "given")
    assert settings.server_name == "policy"  # an override of None leaves the variable's value
    assert settings.claim_ttl_s == 12.5 and settings.storage_options == {"anon": False}
    assert settings.layout == "auto" and settings.root == str(tmp_path / "given")


def test_every_field_of_a_producer_has_its_variable() -> None:
    proxy_only = {"upstream", "upstream_client"}
    assert set(ENV_NAMES) - proxy_only <= set(ProducerSettings.model_fields)
    assert set(ENV_NAMES) <= set(ProxySettings.model_fields)
    assert all(name.startswith("ROLLOUT_CAPTURE_") for name in ENV_NAMES.values())


def test_storage_options_that_are_not_json_are_named() -> None:
    with pytest.raises(ValueError, match="ROLLOUT_CAPTURE_STORAGE_OPTIONS is not JSON"):
        ProducerSettings.env_values({"ROLLOUT_CAPTURE_STORAGE_OPTIONS": "{anon: false"})


def test_capture_on_needs_a_root_and_off_needs_none() -> None:
    with pytest.raises(ValidationError, match="ROLLOUT_CAPTURE_DIR is not set"):
        ProducerSettings()
    off = ProducerSettings(enabled=False)
    assert off.capture_dir is None
    with pytest.raises(ValueError, match="capture is off"):
        _ = off.root


def test_a_relative_capture_dir_is_refused_naming_where_it_came_from() -> None:
    with pytest.raises(ValidationError, match="ROLLOUT_CAPTURE_DIR or --capture-dir"):
        ProducerSettings(capture_dir="relative/caps")


def test_the_claims_log_needs_a_local_disk(tmp_path: Path) -> None:
    assert ProducerSettings(capture_dir=str(tmp_path), claims="log").claims == "log"
    with pytest.raises(ValidationError, match="claims=log"):
        ProducerSettings(capture_dir="s3://bucket/caps", claims="log")


def test_secrets_are_refused_and_never_echoed(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as caught:
        ProducerSettings(capture_dir=str(tmp_path), storage_options={"secret": URL_SECRET})
    assert URL_SECRET not in str(caught.value)
    with pytest.raises(ValidationError) as caught:
        ProducerSettings(capture_dir=f"s3://AKIAEXAMPLE:{URL_SECRET}@bucket/caps")
    assert URL_SECRET not in str(caught.value) and "AKIAEXAMPLE" not in str(caught.value)


def test_unknown_settings_and_out_of_bounds_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="extra"):
        ProducerSettings(capture_dir=str(tmp_path), colour="blue")  # type: ignore[call-arg]
    for field, value in [("claim_ttl_s", 0), ("max_body_bytes", 0), ("io_threads", 1025), ("layout", "csv")]:
        with pytest.raises(ValidationError):
            ProducerSettings.model_validate({"capture_dir": str(tmp_path), field: value})


def test_a_proxys_upstream_is_an_http_url_without_its_trailing_slash(tmp_path: Path) -> None:
    settings = ProxySettings(upstream="http://127.0.0.1:8000/", capture_dir=str(tmp_path))
    assert settings.upstream == "http://127.0.0.1:8000"
    with pytest.raises(ValidationError, match="http:// or https://"):
        ProxySettings(upstream="127.0.0.1:8000", capture_dir=str(tmp_path))
