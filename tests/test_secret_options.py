"""Credentials where they do not belong: secret-looking option names at any depth and in any
case, and URLs with userinfo, refused naming where they are (never what they hold)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from rollout_capture.secret_options import (
    REDACTED,
    REFUSED_URL,
    redact_secret_options,
    refuse_secret_options,
    url_credentials,
)

SECRET = "hunter2SECRET"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"AWS_SECRET_ACCESS_KEY": SECRET}, "storage_options.AWS_SECRET_ACCESS_KEY"),
        ({"Token": SECRET}, "storage_options.Token"),
        ({"headers": {"Authorization": f"Bearer {SECRET}"}}, "storage_options.headers.Authorization"),
        ({"client_kwargs": {"pwd": SECRET}}, "storage_options.client_kwargs.pwd"),
        ({"db": {"PASS": SECRET}}, "storage_options.db.PASS"),
        ({"api-key": SECRET}, "storage_options.api-key"),
        ({"headers": [{"x": 1}, {"API_KEY": SECRET}]}, "storage_options.headers[1].API_KEY"),
        ({"chain": [[{"token": SECRET}]]}, "storage_options.chain[0][0].token"),
        (
            {"client_kwargs": {"endpoint_url": f"http://user:{SECRET}@minio:9000"}},
            "endpoint_url: credentials",
        ),
    ],
)
def test_a_secret_at_any_depth_and_in_any_case_is_refused_naming_its_path(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError) as raised:
        refuse_secret_options(options)
    assert named in str(raised.value) and SECRET not in str(raised.value)
    redacted = str(redact_secret_options({"storage_options": options}))
    assert SECRET not in redacted and (REDACTED in redacted or REFUSED_URL in redacted)


def test_ordinary_options_and_empty_secrets_pass() -> None:
    refuse_secret_options(
        {
            "anon": False,
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"},
            "headers": [{"User-Agent": "x"}],
            "token": None,
        }
    )


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"s3://AKIAEXAMPLE:{SECRET}@bucket/x", "s3://bucket"),
        ("s3://AKIAEXAMPLE@bucket/x", "s3://bucket"),
        (f"s3://AKIAEXAMPLE:{SECRET}/more@bucket/x", "s3://"),  # a secret holding a '/'
        (f"https://u:{SECRET}@host:8443/p", "https://host:8443"),
        (f"simplecache::s3://k:{SECRET}@bucket/x", "s3://bucket"),
        (f"abfs://container:{SECRET}@account.dfs.core.windows.net/p", "abfs://account.dfs.core.windows.net"),
        (f"gs://a:{SECRET}@b@bucket/x", "gs://bucket"),
        (f"http://127.0.0.1:4318/v1/traces?api_key={SECRET}", "http://127.0.0.1:4318"),  # a query's key
        (f"https://host/v1/traces?project=p&Token={SECRET}#top", "https://host"),
        (f"az://cont/caps?sv=2021-08-06&sp=rl&sig={SECRET}", "az://cont"),  # a SAS token's signature
        (f"abfs://cont@acct.dfs.core.windows.net/p?se=2099&SIG={SECRET}", "abfs://acct.dfs.core.windows.net"),
        (
            f"https://acct.blob.core.windows.net/cont/p?sv=2021&%73ig={SECRET}",
            "https://acct.blob.core.windows.net",
        ),
        (f"https://bucket.s3.amazonaws.com/k?X-Amz-Signature={SECRET}", "https://bucket.s3.amazonaws.com"),
    ],
)
def test_a_url_with_credentials_is_told_by_its_scheme_and_host_alone(url: str, shown: str) -> None:
    assert url_credentials(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/runs/user@example.com/x",  # an '@' in the path is a name
        "http://127.0.0.1:9000/x",
        "http://[::1]:9000/x",
        "http://[::1]/x",
        "abfs://container@account.dfs.core.windows.net/p",  # adlfs's container@account, no secret
        "/data/runs/a:b@c",
        "file:///data/x",
        "memory://caps",
        "http://127.0.0.1:4318/v1/traces?project=p&token=",  # a query naming no secret, or none given
        "az://cont/caps?design=x&signal=y",  # words holding "sig" are no signature
    ],
)
def test_urls_without_credentials_pass(url: str) -> None:
    assert url_credentials(url) is None


def test_the_producer_settings_and_the_capture_config_never_echo_a_url_secret() -> None:
    from rollout_capture import ModelCallCaptureConfig
    from rollout_capture.producer.settings import ProducerSettings

    url = f"s3://AKIAEXAMPLE:{SECRET}@bucket/caps"
    with pytest.raises(ValidationError) as raised:
        ProducerSettings(capture_dir=url)
    assert "credentials in the URL are not allowed" in str(raised.value) and SECRET not in str(raised.value)
    with pytest.raises(ValidationError) as raised:
        ProducerSettings.from_env({"ROLLOUT_CAPTURE_DIR": url})
    assert SECRET not in str(raised.value)
    with pytest.raises(ValidationError) as raised:
        ModelCallCaptureConfig.model_validate({"observability_enabled": True, "model_call_capture_dir": url})
    assert "credentials in the URL" in str(raised.value) and SECRET not in str(raised.value)
